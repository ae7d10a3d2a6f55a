"""The token viewer's page (stapo/tools/viewer.py, scripts/view_rollouts.py), read back with the stdlib's
html.parser."""
import json
import math
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from stapo.train.samples import write_rollouts
from stapo.tools.viewer import ViewerError, render_page, write_page

REPO = Path(__file__).resolve().parents[1]
TAU_P = 0.002  # ln τ_p ≈ -6.2146


class _Page(HTMLParser):
    """The page's responses (``article.resp`` attributes) and token spans (classes, title, text); every
    ``<script>`` / ``<link>`` / ``<img>`` / ``src`` seen, to check the page loads nothing."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.responses, self.tokens, self.external = [], [], []
        self._tok = None
        self._inner = 0  # spans open inside the current token (class "ctl": a control character's stand-in)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("link", "img", "iframe") or "src" in a or (a.get("href") or "").startswith("http"):
            self.external.append((tag, a))
        if tag == "article" and "resp" in a.get("class", "").split():
            self.responses.append({**a, "tokens": []})
        if tag == "span" and self._tok is not None:
            self._inner += 1
            self._tok["inner"].append(a)
        elif tag == "span" and "tok" in a.get("class", "").split():
            self._tok = {"classes": set(a["class"].split()), "title": a.get("title", ""), "text": "", "inner": []}

    def handle_data(self, data):
        if self._tok is not None:
            self._tok["text"] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._inner:
            self._inner -= 1
        elif tag == "span" and self._tok is not None:
            self.tokens.append(self._tok)
            self.responses[-1]["tokens"].append(self._tok)
            self._tok = None


def _parse(page):
    p = _Page()
    p.feed(page)
    p.close()
    return p


# Two prompts. Tokens hold markup, entities, quotes and newlines. Candidates: Â > 0 and log p < ln 0.002.
NASTY = ["<script>alert(1)</script>", "a & b", "\"quoted\"", "it's", "\n", "&amp;", "</span>", ""]
RECORDS = [
    {"step": 3, "prompt_index": 0, "prompt_id": "set/0", "sample": 0, "prompt": "What is 1 < 2 & 3?", "gold": "<1>",
     "reward": 1.0, "advantage": 0.87, "extracted_answer": "<b>1</b>", "response_length": 8,
     "token_ids": list(range(10, 18)), "tokens": NASTY,
     # p:  0.001 (cand)  0.5  0.0001 (cand) 0.9  0.01  0.0019 (cand)  1.0  0.3
     "logprobs": [math.log(0.001), math.log(0.5), math.log(1e-4), math.log(0.9), math.log(0.01), math.log(0.0019),
                  0.0, math.log(0.3)],
     "entropy": [0.1, 1.0, 0.2, 0.3, 2.0, 0.05, 0.0, 0.7],
     "silenced": [1, 0, 1, 0, 0, 0, 0, 0]},  # S2T silenced two of the three candidates
    {"step": 3, "prompt_index": 0, "prompt_id": "set/0", "sample": 1, "prompt": "What is 1 < 2 & 3?", "gold": "<1>",
     "reward": -1.0, "advantage": -0.87, "extracted_answer": None, "response_length": 2,
     "token_ids": [5, 6], "tokens": ["x", "y"], "logprobs": [math.log(1e-5), None], "entropy": [0.1, None],
     "silenced": [0, 0]},  # Â < 0: p = 1e-5 is no candidate; a non-finite statistic saved as null
    {"step": 3, "prompt_index": 1, "prompt_id": "set/1", "sample": 0, "prompt": "Second", "gold": "2",
     "reward": 1.0, "advantage": 0.0, "extracted_answer": "2", "response_length": 1,
     "token_ids": [7], "tokens": ["z"], "logprobs": [math.log(1e-3)], "entropy": [0.4], "silenced": [0]},  # Â = 0
]


def test_page_has_one_card_per_response_and_marks_exactly_the_silenced_tokens():
    page = _parse(render_page(RECORDS, prob_threshold=TAU_P, title="run <x>: step 3"))
    assert len(page.responses) == 3
    assert [len(r["tokens"]) for r in page.responses] == [8, 2, 1]
    flags = [sil for rec in RECORDS for sil in rec["silenced"]]
    assert ["silenced" in t["classes"] for t in page.tokens] == [bool(f) for f in flags]
    # candidates (worked above): tokens 0, 2, 5 of the first response only
    assert ["cand" in t["classes"] for t in page.tokens] == [True, False, True, False, False, True, False, False,
                                                            False, False, False]
    assert [(r["data-cand"], r["data-silenced"]) for r in page.responses] == [("3", "2"), ("0", "0"), ("0", "0")]
    assert [float(r["data-adv"]) for r in page.responses] == [0.87, -0.87, 0.0]
    # colour classes: p = 0.001 → log10 p = -3 → (−3 + 4) / 4 = 0.25 of 16 bins → p4; H = 0.1 → some h bin
    assert "p4" in page.tokens[0]["classes"] and "p0" in page.tokens[2]["classes"]  # p = 1e-4: the lowest
    assert "p15" in page.tokens[6]["classes"]  # p = 1
    assert page.external == []  # self-contained


def test_every_token_is_escaped_and_reads_back_unchanged():
    html_text = render_page(RECORDS, prob_threshold=TAU_P, title="run <x>: step 3")
    page = _parse(html_text)
    assert [t["text"] for t in page.responses[0]["tokens"]] == NASTY
    assert "<script>alert" not in html_text and "</span></span>" not in html_text
    assert "run &lt;x&gt;: step 3" in html_text  # the title too
    assert html_text.count("<script>") == 1  # the page's own script only
    assert "What is 1 &lt; 2 &amp; 3?" in html_text
    assert "extracted answer: <code>&lt;b&gt;1&lt;/b&gt;</code>" in html_text
    assert "nl" in page.tokens[4]["classes"] and "empty" in page.tokens[7]["classes"]
    first = page.tokens[0]["title"]  # hover: p, H, id
    assert "p = 0.001 " in first and "H = 0.100 nats" in first and "token id 10" in first and "silenced" in first
    assert "p = n/a" in page.responses[1]["tokens"][1]["title"]


def test_control_characters_are_shown_not_written_raw():
    """A token may decode to a NUL or another control character: none reaches the HTML raw (a browser drops or
    mangles them, a NUL breaks text tools); each is a visible stand-in in a ``ctl`` span; tab and newline stay."""
    import re

    rec = {**RECORDS[2], "prompt": "nul\x00here", "extracted_answer": "2\x00",
           "tokens": ["a\x00b", "\x1b[31m", "\r", "\t", "\x7f", "\x85", "\n"], "token_ids": list(range(7)),
           "logprobs": [0.0] * 7, "entropy": [0.0] * 7, "silenced": [0] * 7}
    html_text = render_page([rec], prob_threshold=TAU_P, title="run \x00: step 3")
    assert re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", html_text) is None  # no raw control character anywhere
    page = _parse(html_text)
    # U+2400 + code: NUL → ␀ (U+2400), ESC (0x1b) → ␛ (U+241B), CR (0x0d) → ␍ (U+240D); DEL → ␡; C1 0x85 → \x85
    assert [t["text"] for t in page.tokens] == ["a\u2400b", "\u241b[31m", "\u240d", "\t", "\u2421", "\\x85", "\n"]
    assert [[a["title"] for a in t["inner"]] for t in page.tokens] == [
        ["U+0000"], ["U+001B"], ["U+000D"], [], ["U+007F"], ["U+0085"], []]
    assert all(a["class"] == "ctl" for t in page.tokens for a in t["inner"])
    assert 'nul<span class="ctl" title="U+0000">\u2400</span>here' in html_text  # the prompt
    assert 'extracted answer: <code>2<span class="ctl" title="U+0000">\u2400</span></code>' in html_text
    assert "<title>run \u2400: step 3</title>" in html_text  # no markup inside <title>


def test_render_page_refuses_a_bad_threshold():
    with pytest.raises(ValueError, match="prob_threshold"):
        render_page(RECORDS, prob_threshold=0.0, title="t")


def _run_dir(tmp_path, tau=TAU_P):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algorithm": {"objective": "stapo", "s2t": {"prob_threshold": tau}}}))
    write_rollouts(run, 3, RECORDS)
    return run


def test_write_page_reads_tau_p_from_the_run_config(tmp_path):
    # τ_p = 0.0005 → only p = 1e-4 (token 2) is a candidate
    out = write_page(_run_dir(tmp_path, tau=0.0005), step=None)
    assert out == tmp_path / "run" / "rollouts" / "step_000003.html"
    page = _parse(out.read_text())
    assert [i for i, t in enumerate(page.tokens) if "cand" in t["classes"]] == [2]


def test_script_writes_the_page_and_reports_errors_in_one_line(tmp_path):
    run = _run_dir(tmp_path)
    script = [sys.executable, str(REPO / "scripts" / "view_rollouts.py")]
    ok = subprocess.run(script + [str(run), "--step", "3", "--out", str(tmp_path / "p.html")], capture_output=True,
                        text=True)
    assert ok.returncode == 0 and Path(ok.stdout.strip()) == tmp_path / "p.html"
    assert len(_parse((tmp_path / "p.html").read_text()).responses) == 3
    bad = subprocess.run(script + [str(run), "--step", "4"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "saved steps: 3" in bad.stderr
    for step in ("-1", "0"):  # not a training step: a usage error, before any file is read
        neg = subprocess.run(script + [str(run), "--step", step], capture_output=True, text=True)
        assert neg.returncode == 2
        assert neg.stderr == f"view_rollouts.py: error: argument --step: step must be >= 1, got {step} (see --help)\n"
    with pytest.raises(ViewerError, match="step must be >= 1, got -1"):
        write_page(run, step=-1)
    with pytest.raises(ViewerError, match="config.json not found"):
        write_page(tmp_path)  # not a run directory
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ViewerError, match="trainer.save_rollouts=true"):
        write_page(tmp_path)
