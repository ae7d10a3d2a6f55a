"""What flows between the stages of a training step (B = this rank's prompts × G responses, R = max response).

    rollout + reward + advantages ──► :class:`Rollout` ──► old / reference passes + update ──► :class:`StepBatch`
                                                                                              (metrics, tables)

Both are complete when made and never changed afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stapo.core.token_stats import TokenStats

__all__ = ["Rollout", "StepBatch"]


@dataclass(frozen=True)
class Rollout:
    """One step's responses, scored.

    Attributes:
        batch: :class:`stapo.train.policy.RolloutBatch` — input_ids / attention_mask [B, P+R], response_ids /
            response_mask [B, R].
        responses: list[:class:`stapo.rollout.Response`], length B (text, finish reason, engine log-probs).
        rewards: [B] fp32.
        advantages: [B] fp32 GRPO advantages (docs/method.md#grpo-advantages).
        reward_stats: the reward function's counts for this rank's responses (its ``.stats``), or None.
        extracted: length B, the answer the reward function read from each response (its ``.extracted``;
            ``None`` where it found none), or None when the reward function reports none.
        prompts: this rank's prompts of the step, ``(prompt ids, gold answer, record id)`` each (index = a
            response's ``group``), or None.
    """

    batch: Any
    responses: list
    rewards: torch.Tensor
    advantages: torch.Tensor
    reward_stats: Any = None
    extracted: list | None = None
    prompts: list | None = None


@dataclass(frozen=True)
class StepBatch:
    """A step after its update: the rollout, the old-policy statistics of every row, the reference log-probs
    and the tokens that received gradient. Input of the step metrics and the example tables.

    Attributes:
        rollout: the :class:`Rollout`.
        old: old-policy log-probs, entropies and collision probabilities, each [B, R] fp32 (nats; Σπ²).
        ref_logprobs: [B, R] fp32 (β > 0) or None.
        keep: [B, R] bool — response tokens that received gradient (after the token mask).
    """

    rollout: Rollout
    old: TokenStats
    ref_logprobs: torch.Tensor | None
    keep: torch.Tensor
