"""Training rewards: JustRL's "DAPO strict box" (default) and a math-verify alternative.

Both score the **response text only** (never the prompt) and return +1.0 (correct) / -1.0
(incorrect, including "no answer").

``dapo_strict_box`` (docs/method.md#training-reward) follows verl's ``verl/utils/reward_score/math_dapo.py`` with
``strict_box_verify=True``, the reward JustRL trains with (thunlp/JustRL
``train/verl/utils/reward_score/math_dapo.py``, where ``compute_score`` defaults to the strict box):

1. keep the last 300 characters of the response (``solution_str[-300:]``);
2. of those, keep the last 100 (``pred[-100:]``);
3. take the last ``\\boxed{...}`` that *starts* in that 100-character window, braces matched
   (verl's ``last_boxed_only_string``; an unclosed last box counts as no box);
4. compare its content with the gold answer as an exact string.

Deviation (asked for by issue 3 / docs/method.md#training-reward, "after light normalisation"): verl compares the
raw box content with the raw ground truth; here both sides first go through
:func:`normalize_strict_box_answer` (surrounding whitespace, surrounding ``$``, a trailing period).
verl's ``normalize_final_answer`` (unit stripping etc.) is *not* applied: that belongs to its
non-strict "Minerva" path, which JustRL does not use.

``math_verify`` uses the evaluation grader (:mod:`stapo.tasks.grader`) for tasks whose answers are not
plain integers; grader timeouts and errors give -1.0 and are counted in the returned stats.

``math_verify_value`` is ``math_verify`` with an answer-form rule (``MathGrader(require_value=True)``): an answer that
math-verify finds equivalent but that is still an unevaluated expression scores -1 (counted in
``reward/grader/unevaluated``). Not from the paper: on the synthetic arithmetic task math-verify evaluates an echo
of the question ("So 9 + 5.") to the gold answer, so plain ``math_verify`` pays for repeating the question
(results/study_cpu/ and results/cpu_task_probe.md measure how often).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from stapo.tasks.boxed import last_boxed_content, strip_answer_decorations
from stapo.tasks.grader import GraderStats, GradeStatus, MathGrader, check_text_batch

__all__ = [
    "STRICT_BOX_TAIL_CHARS",
    "STRICT_BOX_WINDOW_CHARS",
    "REWARD_CORRECT",
    "REWARD_INCORRECT",
    "REWARD_NAMES",
    "REWARD_ALIASES",
    "RewardStats",
    "RewardBatch",
    "normalize_strict_box_answer",
    "extract_strict_box_answer",
    "strict_box_reward",
    "StrictBoxReward",
    "MathVerifyReward",
    "make_reward_fn",
]

STRICT_BOX_TAIL_CHARS = 300  # verl: solution_str = solution_str[-300:]
STRICT_BOX_WINDOW_CHARS = 100  # verl is_correct_strict_box: pred = pred[-100:]
REWARD_CORRECT = 1.0
REWARD_INCORRECT = -1.0
REWARD_NAMES = ("dapo_strict_box", "math_verify", "math_verify_value")
REWARD_ALIASES = {"strict_box": "dapo_strict_box"}  # config spelling


@dataclass
class RewardStats:
    """Counts over one batch of rewards.

    Attributes:
        n: responses scored.
        correct: responses with reward +1.
        no_answer: responses with no answer (strict box: no closed box in the final 100
            characters; math-verify: nothing extractable).
        timeouts / errors: grader timeouts / errors (always 0 for ``dapo_strict_box``).
        grader: the grader's own stats for this batch (``math_verify`` only).
    """

    n: int = 0
    correct: int = 0
    no_answer: int = 0
    timeouts: int = 0
    errors: int = 0
    grader: GraderStats | None = None

    @property
    def mean_reward(self) -> float:
        """Mean reward over the batch (+1/-1 rewards), 0.0 for an empty batch."""
        if not self.n:
            return 0.0
        return (self.correct * REWARD_CORRECT + (self.n - self.correct) * REWARD_INCORRECT) / self.n

    def as_dict(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat ``{prefix + name: value}`` dict for a metrics logger."""
        out = {prefix + k: v for k, v in asdict(self).items() if k != "grader"}
        out[prefix + "mean"] = self.mean_reward
        if self.grader is not None:
            out.update(self.grader.as_dict(prefix=prefix + "grader/"))
        return out


@dataclass(frozen=True)
class RewardBatch:
    """Rewards for a batch of responses.

    Attributes:
        rewards: one float per response, +1.0 or -1.0, in input order.
        extracted: the answer text each reward was computed from (``None`` when none).
        stats: :class:`RewardStats`.
    """

    rewards: list[float]
    extracted: list[str | None]
    stats: RewardStats = field(default_factory=RewardStats)


def normalize_strict_box_answer(answer: str) -> str:
    """Light normalisation applied to both the boxed answer and the gold answer.

    Repeatedly strips surrounding whitespace, one leading ``$``, one trailing unescaped ``$``
    and one trailing ``.`` until nothing changes (:func:`stapo.tasks.boxed.strip_answer_decorations`).
    Inner spaces are kept (``"1, 2"`` stays ``"1, 2"``).

    Examples: ``" 34 "`` -> ``"34"``; ``"$34$."`` -> ``"34"``; ``"3.5"`` -> ``"3.5"``.

    Raises:
        TypeError: ``answer`` is not a ``str``.

    Source: docs/method.md#training-reward ("exact string after light normalisation"); verl applies none.
    """
    return strip_answer_decorations(answer)


def extract_strict_box_answer(response: str) -> str | None:
    """The raw content of the last ``\\boxed{...}`` that starts within the final
    :data:`STRICT_BOX_WINDOW_CHARS` characters of ``response``, or ``None``.

    Args:
        response: the response text (prompt excluded).

    Returns:
        Box content (not normalised), or ``None`` (no box in the window, or the last box there
        is unclosed).

    Raises:
        TypeError: ``response`` is not a ``str``.

    Source: verl ``math_dapo.compute_score`` (``[-300:]``) + ``is_correct_strict_box`` (``[-100:]``).
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    window = response[-STRICT_BOX_TAIL_CHARS:][-STRICT_BOX_WINDOW_CHARS:]
    return last_boxed_content(window)


def strict_box_reward(response: str, gold: str) -> float:
    """JustRL's "DAPO strict box" reward for one response.

    Args:
        response: the response text only (never prompt + response).
        gold: the gold answer (e.g. ``"34"``).

    Returns:
        ``+1.0`` if the normalised content of the last box in the final 100 characters equals
        the normalised gold answer (and is non-empty), else ``-1.0`` (also when there is no box).

    Raises:
        TypeError: ``response`` or ``gold`` is not a ``str``.

    Source: docs/method.md#training-reward; verl/JustRL ``math_dapo.py`` (see the module docstring).
    """
    if not isinstance(gold, str):
        raise TypeError(f"gold must be str, got {type(gold).__name__}")
    content = extract_strict_box_answer(response)
    if content is None:
        return REWARD_INCORRECT
    pred = normalize_strict_box_answer(content)
    return REWARD_CORRECT if pred and pred == normalize_strict_box_answer(gold) else REWARD_INCORRECT


class StrictBoxReward:
    """Batch form of :func:`strict_box_reward` (``name = "dapo_strict_box"``).

    Call with ``(responses, golds)`` (equal-length sequences of ``str``) to get a
    :class:`RewardBatch`.  Raises ``TypeError``/``ValueError`` naming the offending index.
    """

    name = "dapo_strict_box"

    def __call__(self, responses: Sequence[str], golds: Sequence[str]) -> RewardBatch:
        responses, golds = check_text_batch(responses, golds)
        rewards: list[float] = []
        extracted: list[str | None] = []
        stats = RewardStats()
        for resp, gold in zip(responses, golds):
            content = extract_strict_box_answer(resp)
            reward = strict_box_reward(resp, gold)
            rewards.append(reward)
            extracted.append(content)
            stats.n += 1
            stats.correct += reward == REWARD_CORRECT
            stats.no_answer += content is None
        return RewardBatch(rewards=rewards, extracted=extracted, stats=stats)

    def close(self) -> None:
        """Nothing to release (present for interface symmetry with :class:`MathVerifyReward`)."""


class MathVerifyReward:
    """+1/-1 reward from the math-verify grader (``name = "math_verify"``).

    Args:
        grader: an existing :class:`~stapo.tasks.grader.MathGrader` to share (not closed by
            :meth:`close`); when ``None`` a grader is created from ``grader_kwargs`` and owned.
        **grader_kwargs: passed to :class:`~stapo.tasks.grader.MathGrader` (``num_workers``,
            ``timeout_s``, ...).

    Call with ``(responses, golds)`` to get a :class:`RewardBatch`; grader timeouts and errors give
    -1.0 and are counted in ``stats.timeouts`` / ``stats.errors`` (and ``stats.grader``).
    """

    name = "math_verify"

    def __init__(self, grader: MathGrader | None = None, **grader_kwargs) -> None:
        if grader is not None and grader_kwargs:
            raise ValueError("pass either an existing grader or grader keyword arguments, not both")
        self._owns_grader = grader is None
        self.grader = grader if grader is not None else MathGrader(**grader_kwargs)
        if self.grader.require_value:
            self.name = "math_verify_value"

    def __call__(self, responses: Sequence[str], golds: Sequence[str]) -> RewardBatch:
        responses, golds = check_text_batch(responses, golds)
        batch = self.grader.grade(responses, golds)
        stats = RewardStats(
            n=batch.stats.n,
            correct=batch.stats.correct,
            no_answer=batch.stats.no_answer,
            timeouts=batch.stats.timeouts,
            errors=batch.stats.errors,
            grader=batch.stats,
        )
        rewards = [REWARD_CORRECT if r.status is GradeStatus.CORRECT else REWARD_INCORRECT for r in batch.results]
        return RewardBatch(rewards=rewards, extracted=[r.extracted for r in batch.results], stats=stats)

    def close(self) -> None:
        """Close the grader if this object created it."""
        if self._owns_grader:
            self.grader.close()


RewardFn = Callable[[Sequence[str], Sequence[str]], RewardBatch]


def make_reward_fn(name: str, **kwargs) -> StrictBoxReward | MathVerifyReward:
    """Build a training reward by name (a config value).

    Args:
        name: ``"dapo_strict_box"`` (JustRL/STAPO default; alias ``"strict_box"``), ``"math_verify"`` or
            ``"math_verify_value"`` (math-verify, and an unevaluated expression such as ``9 + 5`` scores -1).
        **kwargs: for the math-verify rewards: ``grader=`` or :class:`~stapo.tasks.grader.MathGrader`
            arguments; none are accepted for ``"dapo_strict_box"``.

    Returns:
        A callable ``(responses, golds) -> RewardBatch`` with a ``close()`` method.

    Raises:
        ValueError: unknown name, or keyword arguments given to ``dapo_strict_box``.
    """
    name = REWARD_ALIASES.get(name, name)
    if name == "dapo_strict_box":
        if kwargs:
            raise ValueError(f"dapo_strict_box takes no options, got {sorted(kwargs)}")
        return StrictBoxReward()
    if name == "math_verify":
        return MathVerifyReward(**kwargs)
    if name == "math_verify_value":
        grader = kwargs.get("grader")
        if grader is not None and not grader.require_value:
            raise ValueError("math_verify_value needs a grader made with require_value=True")
        return MathVerifyReward(**kwargs) if grader is not None else MathVerifyReward(require_value=True, **kwargs)
    raise ValueError(f"unknown reward {name!r}; known: {', '.join(REWARD_NAMES)}")
