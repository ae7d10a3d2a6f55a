"""``rollout.stop_at_first_boxed``: a response ends right after the token that closes its first complete
``\\boxed{}`` (stapo/rollout/boxed_cut.py, Trainer._generate), on token lists written by hand with the embedded
SmolLM2 tokenizer; off, the trainer's responses are the engine's, untouched."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from stapo.tasks.boxed import first_boxed_end
from stapo.rollout import BACKENDS, Backend
from stapo.rollout.base import Response
from stapo.rollout.boxed_cut import boxed_cut_length, cut_at_first_boxed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import REPO  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 2  # SmolLM2's <|im_end|>
# "The final answer is \boxed{17}. And \boxed{18}" in SmolLM2 tokens: 'The', ' final', ' answer', ' is', ' \\',
# 'box', 'ed', '{', '1', '7', '}.', ' And', ' \\', 'box', 'ed', '{', '1', '8', '}' — the first box closes in '}.'
TWO_BOXES = [504, 3403, 2988, 314, 3814, 4810, 277, 107, 33, 39, 19181, 1350, 3814, 4810, 277, 107, 33, 40, 109]
# "so \boxed{\frac{1}{2}} more": 'so', ' \\', 'box', 'ed', '{\\', 'frac', '{', '1', '}{', '2', '}}', ' more'
NESTED = [559, 3814, 4810, 277, 26754, 18169, 107, 33, 15009, 34, 17859, 540]
UNCLOSED = [104, 3814, 4810, 277, 107, 37]  # "x \boxed{5": 'x', ' \\', 'box', 'ed', '{', '5'
LAST = [76, 4810, 277, 107, 36, 17859]  # "\boxed{4}}": the box closes in the last token, '}}'


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from stapo.model.models import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())


def _response(tok, ids, finish="eos"):
    return Response(group=0, prompt_ids=[1, 9], response_ids=list(ids),
                    text=tok.decode(ids, skip_special_tokens=True),
                    engine_logprobs=[-0.01 * (i + 1) for i in range(len(ids))], finish_reason=finish)


def test_the_token_lists_are_what_the_comments_say(tok):
    assert tok.decode(TWO_BOXES) == "The final answer is \\boxed{17}. And \\boxed{18}"
    assert tok.decode(NESTED) == "so \\boxed{\\frac{1}{2}} more"
    assert tok.decode(UNCLOSED) == "x \\boxed{5" and tok.decode(LAST) == "\\boxed{4}}"
    assert first_boxed_end("so \\boxed{\\frac{1}{2}} more") == 22 and first_boxed_end("x \\boxed{5") is None
    assert first_boxed_end("no box") is None and first_boxed_end("\\boxed{}") == 8


def test_cut_after_the_token_that_closes_the_first_box(tok):
    cut = cut_at_first_boxed(_response(tok, TWO_BOXES + [EOS]), tok)
    assert cut.response_ids == TWO_BOXES[:11]  # through '}.': the period shares the brace's token
    assert cut.text == "The final answer is \\boxed{17}."
    assert cut.engine_logprobs == pytest.approx([-0.01 * (i + 1) for i in range(11)])
    assert cut.finish_reason == "boxed" and cut.prompt_ids == [1, 9] and cut.group == 0

    nested = cut_at_first_boxed(_response(tok, NESTED, "length"), tok)
    assert nested.response_ids == NESTED[:11] and nested.text == "so \\boxed{\\frac{1}{2}}"  # braces matched
    assert nested.finish_reason == "boxed"

    last = cut_at_first_boxed(_response(tok, LAST, "length"), tok)  # nothing after the box: kept whole, yet boxed
    assert last.response_ids == LAST and last.finish_reason == "boxed"
    assert boxed_cut_length(LAST, tok) == 6 and boxed_cut_length(TWO_BOXES, tok) == 11


def test_no_complete_box_keeps_the_response(tok):
    for ids in (UNCLOSED, UNCLOSED + [EOS], [504, 3403, EOS]):
        r = _response(tok, ids, "length")
        assert cut_at_first_boxed(r, tok) is r
    assert boxed_cut_length([], tok) is None
    # an EOS alone after the box: it leaves too (nothing after the box is trained on)
    only_eos = cut_at_first_boxed(_response(tok, LAST + [EOS]), tok)
    assert only_eos.response_ids == LAST and only_eos.finish_reason == "boxed"


class _ScriptedEngine:
    """A rollout engine stand-in whose responses alternate between the two-box list (+ EOS) and one without a box."""

    def __init__(self, model, tokenizer, **kwargs) -> None:
        self.tokenizer = tokenizer
        self.returned: list[Response] = []

    def generate(self, prompts, group_size, sampling, progress=None):
        out = []
        for i, p in enumerate(prompts):
            for j in range(group_size):
                ids = TWO_BOXES + [EOS] if j % 2 == 0 else [504, 3403, 2988, EOS]
                out.append(Response(group=i, prompt_ids=list(p), response_ids=ids,
                                    text=self.tokenizer.decode(ids, skip_special_tokens=True), engine_logprobs=None,
                                    finish_reason="eos", index=j))
        self.returned = out
        return out

    def sync_weights(self, model) -> None:
        pass

    def sleep(self, level=None) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass

    def close(self) -> None:
        pass


def _trainer(tmp_path, switch: bool, seen: list[str]):
    from stapo.config import load_config
    from stapo.train import Trainer

    def reward(texts, golds):
        seen.extend(texts)
        return SimpleNamespace(rewards=[1.0 if "17" in t else -1.0 for t in texts], stats=None)

    cfg = load_config(REPO / "configs" / "tiny_test.yaml",
                      [f"trainer.output_dir={tmp_path}", "trainer.run_name=cut", "rollout.backend=scripted",
                       f"rollout.stop_at_first_boxed={str(switch).lower()}", "trainer.log_examples_every=0",
                       "trainer.total_steps=1"])
    return Trainer(cfg, reward_fn=reward)


def test_trainer_switch_off_changes_nothing_and_on_cuts_before_the_reward(tmp_path, monkeypatch):
    monkeypatch.setitem(BACKENDS, "scripted", Backend("scripted", f"{__name__}:_ScriptedEngine", lambda o: {}))
    seen: list[str] = []
    trainer = _trainer(tmp_path, False, seen)
    _, responses = trainer._generate()
    assert responses is trainer.engine.returned  # off: the engine's list itself, nothing touched

    trainer.cfg.rollout.stop_at_first_boxed = True  # read at every rollout
    _, responses = trainer._generate()
    assert [r.response_ids for r in responses[:2]] == [TWO_BOXES[:11], [504, 3403, 2988, EOS]]
    assert [r.finish_reason for r in responses[:2]] == ["boxed", "eos"]
    metrics = trainer.train_step()
    assert metrics["response_length/mean"] == pytest.approx((11 + 4) / 2)  # the tokens after '}.' left the batch
    assert metrics["response_length/clip_ratio"] == 0.0
    assert seen[:2] == ["The final answer is \\boxed{17}.", "The final answer"]  # the reward saw the cut text
