"""Optional LLM-verifier fallback for answers the rule-based grader rejects (off by default; docs/method.md#grading).

The paper grades with math-verify and, for answers the rules reject, asks CompassVerifier-3B whether the
response's final answer matches the gold answer. :class:`LLMVerifier` does that with any causal LM through a
rollout engine (greedy decoding, a few new tokens): the prompt gives (question, gold answer, the tail of the
response) and asks for one letter, A = correct, B = incorrect, C = invalid; the verdict is accepted only when
it parses as A (:func:`parse_verdict`). The default template is stapo's own short prompt in the A/B/C format
of CompassVerifier (open-compass/CompassVerifier ``src/prompts.py``); pass ``prompt_template`` to use
CompassVerifier's exact prompt (placeholders ``{question}``, ``{gold_answer}``, ``{response}``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from stapo.tasks.prompts import uses_chat_template

__all__ = ["DEFAULT_VERIFIER_TEMPLATE", "VerifierVerdict", "parse_verdict", "LLMVerifier", "build_verifier"]

DEFAULT_VERIFIER_TEMPLATE = (
    "You are grading a math answer. Compare only the candidate's FINAL answer with the standard answer; ignore "
    "the reasoning. The standard answer is always correct. Equivalent forms (e.g. 1/2 and 0.5, \\frac{{1}}{{2}}) "
    "count as the same answer.\n"
    "Reply with one letter: A if the final answer matches the standard answer, B if it does not, C if the "
    "response is invalid (cut off, repetitive, or gives no final answer).\n\n"
    "Question:\n{question}\n\nStandard answer:\n{gold_answer}\n\nCandidate response (end):\n{response}\n\n"
    "Verdict (A, B or C):"
)

_LETTER = re.compile(r"\b([ABC])\b")
_WORDS = (("INCORRECT", "B"), ("INVALID", "C"), ("CORRECT", "A"))  # INCORRECT before its substring CORRECT


@dataclass(frozen=True)
class VerifierVerdict:
    """One verifier call.

    Attributes:
        verdict: ``"A"`` (correct), ``"B"`` (incorrect), ``"C"`` (invalid) or ``None`` (unparseable output).
        accepted: ``verdict == "A"``.
        raw: the verifier's output text (stripped, at most 200 characters).
    """

    verdict: Literal["A", "B", "C"] | None
    accepted: bool
    raw: str


def parse_verdict(text: str) -> Literal["A", "B", "C"] | None:
    """The verdict letter in a verifier output: the first standalone ``A``/``B``/``C`` (also inside
    ``\\boxed{A}``), else the first of the words INCORRECT / INVALID / CORRECT (case-insensitive), else ``None``.

    Examples: ``"A"`` -> ``"A"``; ``"\\boxed{B} - INCORRECT"`` -> ``"B"``; ``"correct"`` -> ``"A"``;
    ``"Incorrect."`` -> ``"B"``; ``"maybe"`` -> ``None``.
    """
    text = str(text)
    m = _LETTER.search(text.replace("\\boxed{", " ").replace("}", " "))
    if m:
        return m.group(1)  # type: ignore[return-value]
    upper = text.upper()
    hits = [(upper.find(word), letter) for word, letter in _WORDS if word in upper]
    if not hits:
        return None
    return min(hits)[1]  # type: ignore[return-value]


class LLMVerifier:
    """Ask a causal LM whether a response's final answer matches the gold answer.

    Args:
        engine: a rollout engine (:func:`stapo.rollout.build_rollout_engine`) around the verifier model.
        tokenizer: the verifier's tokenizer.
        prompt_template: ``str.format`` template with ``{question}``, ``{gold_answer}``, ``{response}``.
        max_new_tokens: tokens the verifier may write (greedy decoding).
        max_response_chars: only the last this-many characters of a response are shown (the final answer is at
            the end; bounds the prompt length).
        use_chat_template: ``"auto"`` (the tokenizer's chat template when it has one) / ``"chat"`` / ``"plain"``.
        batch_size: prompts per engine call.

    Raises:
        ValueError: a template without the three placeholders, or non-positive sizes.
    """

    def __init__(self, engine: Any, tokenizer: Any, *, prompt_template: str | None = None, max_new_tokens: int = 8,
                 max_response_chars: int = 4000, use_chat_template: str = "auto", batch_size: int = 32) -> None:
        template = prompt_template or DEFAULT_VERIFIER_TEMPLATE
        for name in ("{question}", "{gold_answer}", "{response}"):
            if name not in template:
                raise ValueError(f"verifier prompt_template lacks the placeholder {name}")
        if max_new_tokens < 1 or max_response_chars < 1 or batch_size < 1:
            raise ValueError("verifier max_new_tokens, max_response_chars and batch_size must be >= 1")
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.max_new_tokens = int(max_new_tokens)
        self.max_response_chars = int(max_response_chars)
        self.use_chat_template = use_chat_template
        self.batch_size = int(batch_size)
        self.calls = 0

    def _encode(self, question: str, gold: str, response: str) -> list[int]:
        text = self.template.format(question=question, gold_answer=gold, response=response[-self.max_response_chars:])
        if uses_chat_template(self.tokenizer, self.use_chat_template):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def verify(self, questions: Sequence[str], golds: Sequence[str], responses: Sequence[str]) -> list[VerifierVerdict]:
        """One :class:`VerifierVerdict` per (question, gold, response), in input order.

        Raises:
            ValueError: the three sequences differ in length.
        """
        from stapo.rollout import SamplingParams

        if not len(questions) == len(golds) == len(responses):
            raise ValueError(f"verify: {len(questions)} questions, {len(golds)} golds, {len(responses)} responses")
        sampling = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=self.max_new_tokens, seed=0)
        out: list[VerifierVerdict] = []
        for start in range(0, len(questions), self.batch_size):
            stop = start + self.batch_size
            prompts = [self._encode(q, g, r) for q, g, r in zip(questions[start:stop], golds[start:stop],
                                                               responses[start:stop])]
            for resp in self.engine.generate(prompts, 1, sampling):
                verdict = parse_verdict(resp.text)
                out.append(VerifierVerdict(verdict, verdict == "A", resp.text.strip()[:200]))
            self.calls += len(prompts)
        return out


def build_verifier(cfg: Any, device: str = "cpu") -> LLMVerifier:
    """Load the verifier model of a :class:`~stapo.evaluation.config.VerifierConfig` and wrap it.

    ``cfg.model == "tiny"`` builds a random tiny model (wiring tests only). The model runs on ``device`` through
    the ``cfg.backend`` rollout engine.

    Raises:
        OSError / ValueError: the model cannot be loaded (from transformers).
    """
    from stapo.model.models import build_tiny_model, load_policy
    from stapo.rollout import build_rollout_engine

    if cfg.model == "tiny":
        model, tok = build_tiny_model(seed=1)
    else:
        model, tok = load_policy(cfg.model, dtype=cfg.dtype)
    if cfg.backend == "hf":
        model.to(device)
    return LLMVerifier(build_rollout_engine(cfg.backend, model, tok), tok, prompt_template=cfg.prompt_template,
                       max_new_tokens=cfg.max_new_tokens, max_response_chars=cfg.max_response_chars,
                       batch_size=cfg.batch_size)
