"""Our training reward as a verl custom reward function.

verl (0.9.1) loads it with ``reward.custom_reward_function.path=pkg://stapo.integrations.verl_reward`` and
``reward.custom_reward_function.name=compute_score`` (``verl.trainer.ppo.reward.get_custom_reward_fn``,
reward.py:50, via ``verl.utils.import_utils.load_extern_object``; ``pkg://`` imports the installed module) and
calls it once per response from its reward loop
(``verl/experimental/reward_loop/reward_manager/naive.py``, :67–81) as::

    compute_score(data_source=..., solution_str=<decoded response, special tokens skipped>,
                  ground_truth=<row["reward_model"]["ground_truth"]>, extra_info=<row["extra_info"]>,
                  **reward.custom_reward_function.reward_kwargs)

A returned dict must contain ``"score"``; its other keys become ``reward_extra_info`` columns (naive.py:89–95).
The default reward is JustRL's "DAPO strict box" (docs/method.md#training-reward,
:func:`stapo.tasks.rewards.strict_box_reward`);
``+reward.custom_reward_function.reward_kwargs.reward=math_verify`` selects the math-verify grader instead.
"""
from __future__ import annotations

import threading
from typing import Any

from stapo.tasks.rewards import REWARD_CORRECT, make_reward_fn

__all__ = ["compute_score", "close"]

_REWARDS: dict[str, Any] = {}
_LOCK = threading.Lock()
# keyword arguments that verl's reward loop adds when a reward-model router is configured; unused here
_VERL_EXTRA_KWARGS = frozenset({"reward_router_address", "reward_model_tokenizer"})


def _reward(name: str) -> Any:
    with _LOCK:
        if name not in _REWARDS:
            _REWARDS[name] = make_reward_fn(name)
        return _REWARDS[name]


def compute_score(
    data_source: str | None,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    reward: str = "dapo_strict_box",
    **kwargs: Any,
) -> dict[str, Any]:
    """Score one response with our grader (:func:`stapo.tasks.rewards.make_reward_fn`), in verl's signature.

    Args:
        data_source: the dataset name of the row (unused: the same reward for every source, as in JustRL).
        solution_str: the response text only (verl decodes the response tokens, never the prompt).
        ground_truth: the gold answer (``str``; an int/float is converted with ``str``).
        extra_info: verl's per-row extra info (unused).
        reward: ``"dapo_strict_box"`` (default; alias ``"strict_box"``) or ``"math_verify"``.
        **kwargs: ``reward_router_address`` / ``reward_model_tokenizer`` from verl's reward loop are ignored.

    Returns:
        ``{"score": +1.0 or -1.0, "acc": 1.0 or 0.0, "pred": <extracted answer or "">}``.

    Raises:
        TypeError: ``solution_str`` is not a ``str``, ``ground_truth`` is None/not a scalar, or an unexpected
            keyword argument. ValueError: unknown ``reward``.

    Example: ``compute_score("DAPO-17k", "... so the answer is \\\\boxed{34}", "34")["score"] == 1.0``.
    """
    unexpected = set(kwargs) - _VERL_EXTRA_KWARGS
    if unexpected:
        raise TypeError(f"compute_score got unexpected keyword arguments {sorted(unexpected)}")
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be str, got {type(solution_str).__name__}")
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth must be str, got {type(ground_truth).__name__}")
    fn = _reward(reward)
    if getattr(fn, "name", "").startswith("math_verify"):  # the grader's process pool is shared: one call at a time
        with _LOCK:
            batch = fn([solution_str], [ground_truth])
    else:
        batch = fn([solution_str], [ground_truth])
    score = float(batch.rewards[0])
    pred = batch.extracted[0]
    return {"score": score, "acc": 1.0 if score == REWARD_CORRECT else 0.0, "pred": pred if pred is not None else ""}


def close() -> None:
    """Close the rewards created by :func:`compute_score` (math-verify grader pools)."""
    with _LOCK:
        for fn in _REWARDS.values():
            fn.close()
        _REWARDS.clear()
