"""The update schedule of one training step, decided before any forward runs (docs/method.md#update-schedule).

:func:`build_plan` turns the step's rollout (response lengths, advantages) and the actor settings into an
:class:`UpdatePlan`: which rows are forwarded in which pass, in which micro-batches and order, where each
mini-batch's token mask reads its statistics (and so whether an extra forward is needed), and which update
forwards keep their graph until the mask is known. :mod:`stapo.train.update` executes the plan; the trainer's
progress bar is sized by :attr:`UpdatePlan.num_forwards`. One plan serves both update paths:

* **plain** (paper order, Algorithm 1): the mask of a mini-batch comes from statistics computed beforehand —
  the old-policy pass (its first mini-batch, where π_θ = π_old; every mini-batch with
  ``algorithm.mask_stats_source=old`` or a mask that reads no statistics) or a no-grad pass of the current
  policy (``stats="current_pass"``); then the denominator; then forward/backward per micro-batch.
* **fused** (``actor.fused_forward``): the mask reads the update's own forwards (``stats="own_forward"``) —
  always for the first mini-batch (whose old-policy pass is skipped: π_θ = π_old, so those forwards also give
  its old-policy statistics), and for later ones when the mask wants the current policy. Rows the mask may
  touch (:func:`stapo.masks.maskable_rows`) keep their graphs (``deferred``) until the mask of the whole
  mini-batch is known; the others are backwarded at once.

Example (2 prompts × G = 4 = rows 0–7, one prompt per mini-batch, micro-batches of 2 rows, no length sorting,
S2T, fused, mask from the current policy, rows 0, 2, 4, 6 with Â > 0): ``old_pass`` = [4, 5], [6, 7] (the first
mini-batch's old statistics come from its own forwards); mini-batch 0 (rows 0–3) forwards [0, 2] deferred, then
[1, 3]; mini-batch 1 forwards [4, 6] deferred, then [5, 7] → 2 + 2 + 2 = 6 forwards (no reference pass: β = 0).
``tests/test_train_plan.py`` builds this plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from stapo.masks import get_mask_spec, maskable_rows

__all__ = ["MicroStep", "MiniBatchPlan", "UpdatePlan", "build_plan", "micro_batches"]

StatsSource = Literal["old_pass", "current_pass", "own_forward"]


def micro_batches(lengths: torch.Tensor, rows: torch.Tensor, size: int, sort_by_length: bool) -> list[torch.Tensor]:
    """Split ``rows`` ([n] batch rows) into micro-batches of ``size`` rows → list of [b] index tensors.

    With ``sort_by_length`` the rows are ordered by ``lengths[rows]`` (prompt + response tokens), longest first,
    ties in rollout order (stable), so a micro-batch pads little; results are scattered back by these indices.

    Example: lengths [3, 5, 4, 5], rows 0–3, size 3 → sorted [[1, 3, 2], [0]]; unsorted [[0, 1, 2], [3]].
    """
    if sort_by_length:
        rows = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    return [rows[i:i + size] for i in range(0, len(rows), size)]


@dataclass(frozen=True)
class MicroStep:
    """One update forward: rows ``rows`` ([b]) with grad; ``deferred``: its graph is kept until the mini-batch's
    mask is known (fused path), else its backward runs right after the forward."""

    rows: torch.Tensor
    deferred: bool = False


@dataclass(frozen=True)
class MiniBatchPlan:
    """One optimizer step.

    Attributes:
        rows: [n] the mini-batch's contiguous batch rows (whole groups).
        first: the step's first mini-batch (π_θ = π_old).
        stats: where the token mask reads log p / H — ``old_pass`` (the old-policy statistics),
            ``current_pass`` (a no-grad forward of the current policy over ``stats_pass`` first) or
            ``own_forward`` (the update forwards themselves; fused).
        stats_pass: micro-batches of the no-grad current-policy pass (``current_pass`` only).
        forwards: the update's micro-batch forwards, in order.
        fills_old: these forwards also provide the old-policy statistics of ``rows`` (fused first mini-batch).
    """

    rows: torch.Tensor
    first: bool
    stats: StatsSource
    stats_pass: tuple[torch.Tensor, ...]
    forwards: tuple[MicroStep, ...]
    fills_old: bool = False

    @property
    def num_forwards(self) -> int:
        return len(self.stats_pass) + len(self.forwards)


@dataclass(frozen=True)
class UpdatePlan:
    """The whole step: no-grad passes, then the mini-batches (see the module docstring).

    Attributes:
        old_pass: micro-batches of the no-grad old-policy pass (rows not covered by ``fills_old``).
        ref_pass: micro-batches of the reference-model pass (β > 0; else empty).
        minibatches: the optimizer steps, in order.
    """

    old_pass: tuple[torch.Tensor, ...]
    ref_pass: tuple[torch.Tensor, ...]
    minibatches: tuple[MiniBatchPlan, ...]

    @property
    def num_forwards(self) -> int:
        """Every forward of the step (old + reference passes, current-policy passes, update forwards)."""
        return len(self.old_pass) + len(self.ref_pass) + sum(mb.num_forwards for mb in self.minibatches)


def build_plan(lengths: torch.Tensor, advantages: torch.Tensor, *, mini_batch_rows: int, micro_batch_size: int,
               token_mask: str, mask_stats_source: str = "current", fused_forward: bool = False,
               sort_by_length: bool = True, has_reference: bool = False, keep_all_graphs: bool = False
               ) -> UpdatePlan:
    """The update schedule of one step over B responses.

    Args:
        lengths: [B] prompt + response tokens per row (micro-batch sorting).
        advantages: [B] fp32 per-response Â (which rows a mask may touch, fused path).
        mini_batch_rows: rows per optimizer step (this rank's share of ``actor.ppo_mini_batch_size`` × G).
        micro_batch_size: rows per forward (``actor.ppo_micro_batch_size``).
        token_mask: the objective's registered mask name.
        mask_stats_source: ``current`` (Algorithm 1: later mini-batches' masks read the current policy) or ``old``.
        fused_forward: ``actor.fused_forward``.
        sort_by_length: ``actor.sort_by_length`` (False with ``actor.share_prompt``: groups stay together).
        has_reference: β > 0 (a reference pass over every row).
        keep_all_graphs: FSDP2 — forwards and backwards are collectives, so no data-dependent split: every
            fused forward is deferred.

    Returns:
        :class:`UpdatePlan`.
    """
    B = int(lengths.shape[0])

    def split(rows: torch.Tensor) -> list[torch.Tensor]:
        return micro_batches(lengths, rows, micro_batch_size, sort_by_length)

    current = get_mask_spec(token_mask).needs_stats and mask_stats_source == "current"
    minibatches = []
    for start in range(0, B, mini_batch_rows):
        rows = torch.arange(start, min(start + mini_batch_rows, B))  # [n]
        first = start == 0
        if fused_forward and (first or current):
            deferred = maskable_rows(token_mask, advantages[rows])  # [n] bool
            if keep_all_graphs:
                deferred[:] = True
            forwards = ([MicroStep(idx, True) for idx in split(rows[deferred])]
                        + [MicroStep(idx, False) for idx in split(rows[~deferred])])
            minibatches.append(MiniBatchPlan(rows, first, "own_forward", (), tuple(forwards), fills_old=first))
        else:
            stats: StatsSource = "current_pass" if current and not first else "old_pass"
            stats_pass = tuple(split(rows)) if stats == "current_pass" else ()
            minibatches.append(MiniBatchPlan(rows, first, stats, stats_pass,
                                             tuple(MicroStep(idx) for idx in split(rows))))
    first_rows = min(mini_batch_rows, B) if fused_forward else 0  # filled by the first mini-batch's forwards
    old_pass = tuple(split(torch.arange(first_rows, B)))
    ref_pass = tuple(split(torch.arange(B))) if has_reference else ()
    return UpdatePlan(old_pass, ref_pass, tuple(minibatches))
