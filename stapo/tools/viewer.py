"""A token-level viewer of one training step: a static, self-contained HTML page (docs/metrics.md#token-viewer).

    python scripts/view_rollouts.py runs/<run> --step K [--out F.html]

It reads the step's rollouts file (``<run_dir>/rollouts/step_XXXXXX.jsonl.gz``, written with
``trainer.save_rollouts=true``; :mod:`stapo.train.samples`) and the run's ``config.json`` (τ_p =
``algorithm.s2t.prob_threshold``), and writes one HTML file with inline CSS and JavaScript (no network access):

- the responses grouped by prompt (prompt text, gold answer), each with its reward, advantage Â, extracted answer,
  length, number of silenced tokens and of S2T candidates;
- every response token coloured by its probability p (log scale, 10⁻⁴ … 1) or its entropy H (0 … the page's 95th
  percentile), a toggle between the two; silenced tokens (no gradient under the step's mask) outlined and struck
  through (class ``silenced``), S2T candidates (Â > 0 and p < τ_p, docs/method.md#s2t-mask) underlined
  (class ``cand``); hovering a token shows p, log p, H and the token id;
- filters: responses with Â > 0, responses with candidates, responses with silenced tokens; a legend. The address
  may preset them: ``step_000003.html#h,silenced`` (colour by H; only responses with silenced tokens; also ``p``,
  ``pos``, ``cand``).

Every token, prompt and answer is HTML-escaped (tokens hold ``<``, ``&``, quotes and newlines; a newline token is
shown with a ``↵`` before its line break). Control characters other than newline and tab (a token may decode to
``\\x00``) are never written raw: C0 and DEL are shown as their Unicode control pictures (``␀``, ``␛``, ``␡``), C1
as ``\\x85``, each in a ``<span class="ctl">`` (boxed, its code point on hover).
"""
from __future__ import annotations

import html
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

from stapo.run.preflight import write_error
from stapo.train.samples import ROLLOUTS_DIR, RolloutFileError, read_rollouts, rollouts_path, saved_steps

__all__ = ["ViewerError", "COLOUR_BINS", "P_LOG10_MIN", "load_step", "render_page", "write_page"]

COLOUR_BINS = 16  # colour classes per scale (p0..p15, h0..h15)
P_LOG10_MIN = -4.0  # the p scale: log10 p from -4 (p ≤ 1e-4, darkest) to 0 (p = 1, white)
_P_STOPS = ((0.0, (244, 109, 67)), (0.35, (253, 174, 97)), (0.7, (254, 236, 170)), (1.0, (255, 255, 255)))
_H_STOPS = ((0.0, (255, 255, 255)), (0.5, (171, 206, 228)), (1.0, (95, 150, 200)))
_NEEDED = ("prompt_index", "sample", "reward", "advantage", "tokens", "token_ids", "logprobs", "entropy", "silenced")


class ViewerError(ValueError):
    """The viewer cannot build a page (no rollouts, a missing step, an unreadable file or config): one line."""


# control characters HTML must not carry raw: C0 except tab and newline, DEL, C1
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _control_text(ch: str) -> str:
    """A visible stand-in for a control character: its Unicode control picture (U+2400 + code for C0, U+2421 for
    DEL), ``\\xNN`` for C1."""
    code = ord(ch)
    if code < 0x20:
        return chr(0x2400 + code)
    return "\u2421" if code == 0x7F else f"\\x{code:02x}"


def _esc(text: str) -> str:
    """``text`` HTML-escaped (quotes too), with every control character but tab and newline replaced by a
    ``<span class="ctl" title="U+XXXX">`` holding its visible stand-in (:func:`_control_text`)."""
    return _CONTROL.sub(lambda m: f'<span class="ctl" title="U+{ord(m.group()):04X}">{_control_text(m.group())}'
                                  f'</span>', html.escape(text))


def _esc_attr(text: str) -> str:
    """``text`` escaped for an attribute or the ``<title>``: control characters as their stand-ins, no markup."""
    return html.escape(_CONTROL.sub(lambda m: _control_text(m.group()), text))


def _lerp(stops: Sequence[tuple[float, tuple[int, int, int]]], t: float) -> str:
    """The colour at t ∈ [0, 1] on a piecewise-linear scale of RGB stops, as ``#rrggbb``."""
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            w = (t - t0) / (t1 - t0)
            return "#" + "".join(f"{round(a + w * (b - a)):02x}" for a, b in zip(c0, c1))
    return "#" + "".join(f"{c:02x}" for c in stops[-1][1])


def _bin(t: float) -> int:
    """t ∈ [0, 1] (clamped) → colour class 0..COLOUR_BINS-1."""
    return min(COLOUR_BINS - 1, max(0, int(t * COLOUR_BINS)))


def _p_bin(logp: float | None) -> int:
    """Colour class of a token's probability: log10 p on [P_LOG10_MIN, 0] (None: the lowest)."""
    if logp is None:
        return 0
    return _bin((logp / math.log(10) - P_LOG10_MIN) / -P_LOG10_MIN)


def load_step(run_dir: str | os.PathLike, step: int | None = None) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """The step's response records and the run's config.

    Args:
        run_dir: a train.py run directory.
        step: the training step; None = the last step with a rollouts file.

    Returns:
        ``(step, records, config)`` — records as written (:mod:`stapo.train.samples`), config = ``config.json``.

    Raises:
        ViewerError: no ``config.json`` or it is not JSON; no rollouts files; no file for ``step`` (the message
            lists the saved steps); a damaged file; a record without the per-token arrays (naming the line).
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise ViewerError(f"{cfg_path} not found: is {run_dir} a train.py run directory?")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ViewerError(f"{cfg_path}: cannot read it as JSON ({e})") from None
    steps = saved_steps(run_dir)
    if not steps:
        raise ViewerError(f"{run_dir / ROLLOUTS_DIR} holds no rollouts files: train with trainer.save_rollouts=true")
    if step is None:
        step = steps[-1]
    if step < 1:
        raise ViewerError(f"step must be >= 1, got {step}")
    if step not in steps:
        shown = ", ".join(map(str, steps[:20])) + (", ..." if len(steps) > 20 else "")
        raise ViewerError(f"{rollouts_path(run_dir, step)} not found; saved steps: {shown}")
    path = rollouts_path(run_dir, step)
    try:
        records = read_rollouts(path)
    except RolloutFileError as e:
        raise ViewerError(str(e)) from None
    for i, rec in enumerate(records, start=1):
        missing = [k for k in _NEEDED if k not in rec]
        if missing:
            raise ViewerError(f"{path}: line {i} lacks {', '.join(missing)} (not a rollouts record)")
        n = len(rec["tokens"])
        if any(len(rec[k]) != n for k in ("token_ids", "logprobs", "entropy", "silenced")):
            raise ViewerError(f"{path}: line {i}: the per-token arrays differ in length")
    return step, records, config


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def render_page(records: Sequence[dict[str, Any]], *, prob_threshold: float, title: str,
                subtitle: str = "") -> str:
    """The HTML page of a step's response records.

    Args:
        records: response records with the per-token arrays (:func:`stapo.train.samples.response_records`).
        prob_threshold: τ_p of the candidate test ``Â > 0 and log p < ln τ_p`` (strict, as the mask).
        title: the page's heading (escaped here); subtitle: a line under it (escaped here).

    Returns:
        The page: one ``<article class="resp">`` per record (attributes ``data-adv``, ``data-cand``,
        ``data-silenced``), one ``<span class="tok ...">`` per response token whose text is the escaped token,
        with ``silenced`` exactly on the tokens whose ``silenced`` flag is 1 and ``cand`` on the candidates.

    Raises:
        ValueError: ``prob_threshold`` not in (0, 1].
    """
    if not 0.0 < prob_threshold <= 1.0:
        raise ValueError(f"prob_threshold must be in (0, 1], got {prob_threshold}")
    log_tau = math.log(prob_threshold)
    ents = sorted(h for rec in records for h in rec["entropy"] if h is not None)
    h_max = max(ents[min(len(ents) - 1, int(0.95 * len(ents)))] if ents else 1.0, 0.05)  # the H scale's top
    groups: dict[Any, list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault(rec["prompt_index"], []).append(rec)
    n_tok = sum(len(rec["tokens"]) for rec in records)
    n_sil = sum(sum(rec["silenced"]) for rec in records)
    n_cand = 0
    body: list[str] = []
    for prompt_index, recs in groups.items():
        first = recs[0]
        head = f"prompt {prompt_index}"
        if first.get("prompt_id"):
            head += f" · {first['prompt_id']}"
        if first.get("gold") is not None:
            head += f" · gold answer: {first['gold']}"
        body.append(f'<section class="group"><h2>{_esc(head)}</h2>'
                    f'<details><summary>prompt</summary><pre class="prompt">{_esc(first.get("prompt") or "")}'
                    f'</pre></details>')
        for rec in recs:
            adv = rec["advantage"] if rec["advantage"] is not None else 0.0
            spans = []
            cand_here = 0
            for tok, tid, lp, h, sil in zip(rec["tokens"], rec["token_ids"], rec["logprobs"], rec["entropy"],
                                            rec["silenced"]):
                cand = adv > 0 and lp is not None and lp < log_tau
                cand_here += cand
                classes = ["tok", f"p{_p_bin(lp)}", f"h{_bin((h or 0.0) / h_max)}"]
                if sil:
                    classes.append("silenced")
                if cand:
                    classes.append("cand")
                if "\n" in tok:
                    classes.append("nl")
                if tok == "":
                    classes.append("empty")
                tip = (f"p = {_fmt(None if lp is None else math.exp(lp), '.4g')} (log p = {_fmt(lp, '.3f')})\n"
                       f"H = {_fmt(h, '.3f')} nats\ntoken id {tid}" + ("\nsilenced" if sil else "")
                       + ("\nS2T candidate (Â > 0, p < τ_p)" if cand else ""))
                spans.append(f'<span class="{" ".join(classes)}" title="{html.escape(tip)}">{_esc(tok)}</span>')
            n_cand += cand_here
            n_sil_here = sum(rec["silenced"])
            meta = [f"sample {rec['sample']}", f"reward {_fmt(rec['reward'], '+.3g')}",
                    f"Â {_fmt(rec['advantage'], '+.3f')}",
                    f"{len(rec['tokens'])} tokens", f"{n_sil_here} silenced", f"{cand_here} candidates"]
            if rec.get("mean_p") is not None:
                meta.append(f"mean p {rec['mean_p']:.3g}, mean H {rec['mean_entropy']:.3g} nats")
            if rec.get("finish_reason"):
                meta.append(f"finish: {rec['finish_reason']}")
            answer = rec.get("extracted_answer")
            answer_html = "none" if answer is None else f"<code>{_esc(str(answer))}</code>"
            cls = "resp pos" if adv > 0 else ("resp neg" if adv < 0 else "resp zero")
            body.append(f'<article class="{cls}" data-adv="{adv:.6g}" data-cand="{cand_here}" '
                        f'data-silenced="{n_sil_here}"><div class="meta">{_esc(" · ".join(meta))} · '
                        f'extracted answer: {answer_html}</div>'
                        f'<div class="toks">{"".join(spans)}</div></article>')
        body.append("</section>")

    p_css = "".join(f".by-p .p{i}{{background:{_lerp(_P_STOPS, (i + 0.5) / COLOUR_BINS)}}}" for i in range(COLOUR_BINS))
    h_css = "".join(f".by-h .h{i}{{background:{_lerp(_H_STOPS, (i + 0.5) / COLOUR_BINS)}}}" for i in range(COLOUR_BINS))
    p_css += "".join(f".lp{i}{{background:{_lerp(_P_STOPS, (i + 0.5) / COLOUR_BINS)}}}" for i in range(COLOUR_BINS))
    h_css += "".join(f".lh{i}{{background:{_lerp(_H_STOPS, (i + 0.5) / COLOUR_BINS)}}}" for i in range(COLOUR_BINS))
    p_legend = "".join(f'<span class="sw lp{i}"></span>' for i in range(COLOUR_BINS))
    h_legend = "".join(f'<span class="sw lh{i}"></span>' for i in range(COLOUR_BINS))
    summary = (f"{len(records)} responses · {len(groups)} prompts · {n_tok} tokens · {n_sil} silenced · "
               f"{n_cand} S2T candidates (Â > 0, p < τ_p = {prob_threshold:g})")
    esc = _esc
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_esc_attr(title)}</title>
<style>
body{{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;background:#f6f6f6;color:#111}}
header{{position:sticky;top:0;z-index:2;background:#fff;border-bottom:1px solid #ccc;padding:8px 16px}}
h1{{font-size:18px;margin:0 0 2px}} h2{{font-size:14px;margin:0 0 4px}}
.sub,.summary{{font-size:13px;color:#444;margin:2px 0}}
.controls,.legend{{font-size:13px;margin:4px 0;display:flex;flex-wrap:wrap;gap:4px 16px;align-items:center}}
.sw{{display:inline-block;width:10px;height:14px;vertical-align:middle}}
.scale{{display:inline-flex;align-items:center;gap:4px}}
main{{padding:8px 16px}}
.group{{background:#fff;border:1px solid #ddd;border-radius:6px;margin:10px 0;padding:8px 10px}}
.prompt{{white-space:pre-wrap;font-size:12px;background:#f3f3f3;padding:6px;margin:4px 0}}
.resp{{border-left:4px solid #bbb;padding:4px 8px;margin:6px 0}}
.resp.pos{{border-left-color:#1a9850}} .resp.neg{{border-left-color:#d73027}}
.meta{{font-size:12px;color:#333;margin-bottom:2px}} .meta code{{background:#eee;padding:0 3px}}
.toks{{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:13px;line-height:1.9;
white-space:pre-wrap;word-break:break-word}}
.tok{{border-radius:2px}} .tok:hover{{outline:1px solid #333}}
.tok.silenced,.key-sil{{outline:2px solid #000;outline-offset:-1px;text-decoration:line-through 2px;font-weight:bold;
margin:0 2px}}
.mark-cand .tok.cand,.key-cand{{box-shadow:inset 0 -3px 0 #7b3294}}
.ctl{{outline:1px dashed #888;color:#555;padding:0 1px}}
.tok.nl::before{{content:"\\21b5";color:#888}} .tok.empty::before{{content:"\\2205";color:#888}}
.key{{padding:0 4px;font-family:ui-monospace,"DejaVu Sans Mono",monospace}}
{p_css}
{h_css}
</style></head>
<body class="by-p mark-cand">
<header>
<h1>{esc(title)}</h1>
<p class="sub">{esc(subtitle)}</p>
<p class="summary">{esc(summary)}</p>
<div class="controls">
<span>colour by
<label><input type="radio" name="colour" value="p" checked> probability p</label>
<label><input type="radio" name="colour" value="h"> entropy H</label></span>
<label><input type="checkbox" id="f-pos"> only Â &gt; 0</label>
<label><input type="checkbox" id="f-cand"> only responses with candidates (Â &gt; 0, p &lt; τ_p)</label>
<label><input type="checkbox" id="f-sil"> only responses with silenced tokens</label>
<label><input type="checkbox" id="f-mark" checked> underline candidates</label>
<span id="shown">{len(records)} of {len(records)} responses shown</span>
</div>
<div class="legend">
<span class="scale">p: 10⁻⁴ {p_legend} 1 (log scale)</span>
<span class="scale">H: 0 {h_legend} ≥ {h_max:.2f} nats</span>
<span><span class="key key-sil">silenced</span> no gradient under the step's mask</span>
<span><span class="key key-cand">cand</span> S2T candidate</span>
<span>left bar: <b style="color:#1a9850">Â &gt; 0</b> / <b style="color:#d73027">Â &lt; 0</b> / grey Â = 0</span>
<span>hover a token: p, H, id</span>
</div>
</header>
<main>
{"".join(body)}
</main>
<script>
(function () {{
  var body = document.body, total = {len(records)};
  function apply() {{
    var pos = document.getElementById("f-pos").checked, cand = document.getElementById("f-cand").checked,
        sil = document.getElementById("f-sil").checked, shown = 0;
    document.querySelectorAll("article.resp").forEach(function (r) {{
      var ok = (!pos || parseFloat(r.dataset.adv) > 0) && (!cand || +r.dataset.cand > 0)
               && (!sil || +r.dataset.silenced > 0);
      r.hidden = !ok; if (ok) shown++;
    }});
    document.querySelectorAll("section.group").forEach(function (g) {{
      g.hidden = !g.querySelector("article.resp:not([hidden])");
    }});
    document.getElementById("shown").textContent = shown + " of " + total + " responses shown";
  }}
  document.querySelectorAll("input[name=colour]").forEach(function (el) {{
    el.addEventListener("change", function () {{
      body.classList.toggle("by-p", el.value === "p" && el.checked);
      body.classList.toggle("by-h", el.value === "h" && el.checked);
    }});
  }});
  document.getElementById("f-mark").addEventListener("change", function (e) {{
    body.classList.toggle("mark-cand", e.target.checked);
  }});
  ["f-pos", "f-cand", "f-sil"].forEach(function (id) {{
    document.getElementById(id).addEventListener("change", apply);
  }});
  // presets from the address: page.html#h,silenced (colour by H, only responses with silenced tokens)
  var preset = {{pos: "f-pos", cand: "f-cand", silenced: "f-sil"}};
  location.hash.slice(1).split(",").forEach(function (k) {{
    if (preset[k]) document.getElementById(preset[k]).checked = true;
    if (k === "h" || k === "p") {{
      var el = document.querySelector("input[name=colour][value=" + k + "]");
      el.checked = true; el.dispatchEvent(new Event("change"));
    }}
  }});
  apply();
}})();
</script>
</body></html>
"""


def write_page(run_dir: str | os.PathLike, step: int | None = None, out: str | os.PathLike | None = None) -> Path:
    """Render the viewer page of ``run_dir``'s step ``step`` (None: the last saved one) to ``out`` (default
    ``<run_dir>/rollouts/step_XXXXXX.html``). Returns the path written.

    Raises:
        ViewerError: see :func:`load_step`; the config lacks ``algorithm.s2t.prob_threshold``.
        OSError: the page cannot be written (naming the file).
    """
    run_dir = Path(run_dir)
    step, records, config = load_step(run_dir, step)
    try:
        tau_p = float(config["algorithm"]["s2t"]["prob_threshold"])
    except (KeyError, TypeError, ValueError):
        raise ViewerError(f"{run_dir / 'config.json'}: no number at algorithm.s2t.prob_threshold (τ_p)") from None
    alg = config.get("algorithm", {})
    mask = records[0].get("mask", "?") if records else "?"
    subtitle = (f"objective {alg.get('objective', '?')} · token mask {mask} · τ_p = {tau_p:g} · "
                f"{rollouts_path(run_dir, step)}")
    page = render_page(records, prob_threshold=tau_p, title=f"{run_dir.name}: step {step}", subtitle=subtitle)
    out = Path(out) if out is not None else rollouts_path(run_dir, step).with_name(f"step_{step:06d}.html")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as e:
        raise write_error(e, out) from None
    return out
