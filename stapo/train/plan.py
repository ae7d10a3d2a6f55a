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
  touch (:func:`stapo.core.masks.maskable_rows`) keep their graphs (``deferred``) until the mask of the whole
  mini-batch is known; the others are backwarded at once.

Example (2 prompts × G = 4 = rows 0–7, one prompt per mini-batch, micro-batches of 2 rows, no length sorting,
S2T, fused, mask from the current policy, rows 0, 2, 4, 6 with Â > 0): ``old_pass`` = [4, 5], [6, 7] (the first
mini-batch's old statistics come from its own forwards); mini-batch 0 (rows 0–3) forwards [0, 2] deferred, then
[1, 3]; mini-batch 1 forwards [4, 6] deferred, then [5, 7] → 2 + 2 + 2 = 6 forwards (no reference pass: β = 0).
``tests/test_train_plan.py`` builds this plan.

Micro-batches hold ``actor.ppo_micro_batch_size`` rows each (:func:`micro_batches`), or, with
``actor.use_dynamic_bsz``, as many rows as fit a token budget ``actor.ppo_max_token_len_per_gpu``
(:func:`token_budget_micro_batches`; verl's ``rearrange_micro_batches``). Under FSDP2 every forward is a collective,
so every rank runs the same number of micro-batches in every pass: :func:`build_plan` computes each pass's count,
takes the maximum over the ranks (``sync_counts``; verl's ``same_micro_num_in_dp``) and splits into that many.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from stapo.core.masks import get_mask_spec, maskable_rows
from stapo.model import distributed as dist

__all__ = ["MicroStep", "MiniBatchPlan", "UpdatePlan", "build_plan", "micro_batches", "micro_batch_tokens",
           "token_budget_micro_batches", "max_over_ranks"]

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


def micro_batch_tokens(lengths: torch.Tensor, rows: torch.Tensor, layout: str = "padded",
                       prompt_lengths: torch.Tensor | None = None) -> int:
    """Tokens of one forward's input tensor over ``rows`` ([b] batch rows; ``lengths`` [B] prompt + response
    tokens) in ``layout`` (:data:`stapo.train.policy.LAYOUTS`): ``packed`` Σ lengths; ``trailing`` b × the longest
    row; ``padded`` b × (the longest prompt + the longest response) (the trimmed left-padded width; with
    ``prompt_lengths`` None: b × the longest row). 0 for no rows."""
    if rows.numel() == 0:
        return 0
    ln = lengths[rows]  # [b]
    if layout == "packed":
        return int(ln.sum())
    if layout == "padded" and prompt_lengths is not None:
        p = prompt_lengths[rows]  # [b]
        return int(rows.numel()) * (int(p.max()) + max(int((ln - p).max()), 1))
    return int(rows.numel()) * int(ln.max())


def token_budget_micro_batches(lengths: torch.Tensor, rows: torch.Tensor, budget: int, *, layout: str = "padded",
                               prompt_lengths: torch.Tensor | None = None, count: int | None = None
                               ) -> list[torch.Tensor]:
    """Split ``rows`` ([n] batch rows) into micro-batches of at most ``budget`` tokens each
    (:func:`micro_batch_tokens` in ``layout``) → list of [b] index tensors, each row in exactly one.

    Rows are taken longest first (verl's ``rearrange_micro_batches`` balances by length too). A row longer than
    the budget gets a micro-batch of its own (the trainer refuses such a budget at start-up).

    * ``count`` None: the fewest micro-batches this rule finds (``packed``: first-fit decreasing; ``trailing`` /
      ``padded``: consecutive rows of the length order, so a micro-batch pads little).
    * ``count`` k (≥ that number, e.g. the maximum over the ranks): exactly min(k, n) micro-batches, balanced —
      ``packed``: each row to the least-loaded of k (longest-processing-time), or, if that breaks the budget,
      the first-fit packing with its largest micro-batches halved until there are k; ``trailing`` / ``padded``:
      consecutive rows of the length order under the smallest cap that needs ≤ k micro-batches (binary search),
      then the largest halved until there are k. (A k below the ``count=None`` number gives that number.)

    Returned largest first (an out-of-memory shows at the first forward), rows longest first inside each.

    Example: lengths [3, 5, 4, 5], rows 0–3, budget 10: packed → [[1, 3], [2, 0]] (5 + 5, 4 + 3); trailing →
    [[1, 3], [2, 0]] (2 × 5, 2 × 4); with count 3, trailing → [[2, 0], [1], [3]] (8, 5, 5 tokens).

    Raises:
        ValueError: budget < 1, or count < 0.
    """
    if budget < 1:
        raise ValueError(f"token budget must be ≥ 1, got {budget}")
    if count is not None and count < 0:
        raise ValueError(f"micro-batch count must be ≥ 0, got {count}")
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]  # [n] longest first
    n = int(order.numel())
    if n == 0:
        return []
    k = None if count is None else min(int(count), n)

    items = order.tolist()
    ln = {r: int(lengths[r]) for r in items}  # prompt + response tokens
    pl = None if prompt_lengths is None else {r: int(prompt_lengths[r]) for r in items}

    def cost(idx: Sequence[int]) -> int:  # micro_batch_tokens in Python ints
        if layout == "packed":
            return sum(ln[r] for r in idx)
        if layout == "padded" and pl is not None:
            return len(idx) * (max(pl[r] for r in idx) + max(max(ln[r] - pl[r] for r in idx), 1))
        return len(idx) * max(ln[r] for r in idx)

    if layout == "packed":
        bins: list[list[int]] = []
        loads: list[int] = []
        for r in items:  # first-fit decreasing
            j = next((j for j, load in enumerate(loads) if load + ln[r] <= budget), None)
            if j is None:
                bins.append([r])
                loads.append(ln[r])
            else:
                bins[j].append(r)
                loads[j] += ln[r]
        if k is not None and k > len(bins):
            heap = [(0, j) for j in range(k)]  # (load, micro-batch)
            lpt: list[list[int]] = [[] for _ in range(k)]
            for r in items:  # longest processing time: each row to the least-loaded micro-batch
                load, j = heapq.heappop(heap)
                lpt[j].append(r)
                heapq.heappush(heap, (load + ln[r], j))
            if all(len(b) == 1 or cost(b) <= budget for b in lpt):
                bins = lpt
    else:
        def chunks(cap: int) -> list[list[int]]:
            out: list[list[int]] = []
            for r in items:  # consecutive rows of the length order while they fit ``cap``
                if out and cost(out[-1] + [r]) <= cap:
                    out[-1].append(r)
                else:
                    out.append([r])
            return out

        bins = chunks(budget)
        if k is not None and k > len(bins):
            lo, hi = 1, budget  # the smallest cap giving ≤ k micro-batches (a lone row may exceed any cap)
            while lo < hi:
                mid = (lo + hi) // 2
                if len(chunks(mid)) <= k:
                    hi = mid
                else:
                    lo = mid + 1
            bins = chunks(lo)
    while k is not None and len(bins) < k:  # halve the largest micro-batch of ≥ 2 rows (costs never grow)
        j = max((j for j, b in enumerate(bins) if len(b) > 1), key=lambda j: cost(bins[j]))
        b = bins.pop(j)
        bins += [b[:(len(b) + 1) // 2], b[(len(b) + 1) // 2:]]
    rank = {r: i for i, r in enumerate(items)}  # place in the length order
    bins = [sorted(b, key=rank.__getitem__) for b in bins]
    bins.sort(key=lambda b: -cost(b))  # stable: ties keep their order
    return [torch.tensor(b, dtype=torch.long) for b in bins]


def max_over_ranks(ctx) -> Callable[[list[int]], list[int]]:
    """A ``sync_counts`` for :func:`build_plan`: each pass's micro-batch count, the maximum over the ranks of
    ``ctx`` (a :class:`stapo.model.distributed.DistContext`; one all-reduce per plan, collective; verl's
    ``same_micro_num_in_dp``). Identity for W = 1."""

    def sync(counts: list[int]) -> list[int]:
        top = dist.all_reduce({f"{i:06d}": float(c) for i, c in enumerate(counts)}, ctx, op="max")
        return [int(top[f"{i:06d}"]) for i in range(len(counts))]

    return sync


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
               sort_by_length: bool = True, has_reference: bool = False, keep_all_graphs: bool = False,
               token_budget: int | None = None, layout: str = "padded", prompt_lengths: torch.Tensor | None = None,
               sync_counts: Callable[[list[int]], list[int]] | None = None) -> UpdatePlan:
    """The update schedule of one step over B responses.

    Args:
        lengths: [B] prompt + response tokens per row (micro-batch sorting).
        advantages: [B] fp32 per-response Â (which rows a mask may touch, fused path).
        mini_batch_rows: rows per optimizer step (this rank's share of ``actor.ppo_mini_batch_size`` × G).
        micro_batch_size: rows per forward (``actor.ppo_micro_batch_size``; unused with ``token_budget``).
        token_mask: the objective's registered mask name.
        mask_stats_source: ``current`` (Algorithm 1: later mini-batches' masks read the current policy) or ``old``.
        fused_forward: ``actor.fused_forward``.
        sort_by_length: ``actor.sort_by_length`` (False with ``actor.share_prompt``: groups stay together;
            ignored with ``token_budget``, which always takes rows longest first).
        has_reference: β > 0 (a reference pass over every row).
        keep_all_graphs: FSDP2 — forwards and backwards are collectives, so no data-dependent split: every
            fused forward is deferred.
        token_budget: ``actor.ppo_max_token_len_per_gpu`` when ``actor.use_dynamic_bsz`` (tokens per forward,
            :func:`token_budget_micro_batches`), else None (``micro_batch_size`` rows per forward).
        layout: the forwards' layout (:func:`stapo.train.policy.forward_layout`), which the budget counts in.
        prompt_lengths: [B] prompt tokens per row (the ``padded`` layout's budget); None: counted as ``trailing``.
        sync_counts: with ``token_budget``, maps this rank's micro-batch count of every pass (a list in plan
            order, the same length on every rank) to the counts to use — the maximum over the ranks under FSDP2
            (one all-reduce; every rank then runs the same number of forwards in every pass). None: local counts.

    Returns:
        :class:`UpdatePlan`.
    """
    B = int(lengths.shape[0])
    current = get_mask_spec(token_mask).needs_stats and mask_stats_source == "current"
    # 1. the row sets each pass splits into micro-batches, in plan order
    sets: list[torch.Tensor] = []

    def row_set(rows: torch.Tensor) -> int:
        sets.append(rows)
        return len(sets) - 1

    skeleton = []
    for start in range(0, B, mini_batch_rows):
        rows = torch.arange(start, min(start + mini_batch_rows, B))  # [n]
        first = start == 0
        if fused_forward and (first or current):
            deferred = maskable_rows(token_mask, advantages[rows])  # [n] bool
            if keep_all_graphs:
                deferred[:] = True
            skeleton.append((rows, first, "own_forward", row_set(rows[deferred]), row_set(rows[~deferred])))
        else:
            stats: StatsSource = "current_pass" if current and not first else "old_pass"
            skeleton.append((rows, first, stats, row_set(rows), None))
    first_rows = min(mini_batch_rows, B) if fused_forward else 0  # filled by the first mini-batch's forwards
    old_set = row_set(torch.arange(first_rows, B))
    ref_set = row_set(torch.arange(B)) if has_reference else None
    # 2. the micro-batches of each set (token budget: counts agreed over the ranks first)
    if token_budget is None:
        micro = [micro_batches(lengths, rows, micro_batch_size, sort_by_length) for rows in sets]
    else:
        def split(rows: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
            return token_budget_micro_batches(lengths, rows, token_budget, layout=layout,
                                              prompt_lengths=prompt_lengths, count=count)

        micro = [split(rows) for rows in sets]
        if sync_counts is not None:
            counts = [int(c) for c in sync_counts([len(m) for m in micro])]
            micro = [m if len(m) == c else split(rows, c) for m, rows, c in zip(micro, sets, counts)]
    # 3. the plan
    minibatches = []
    for rows, first, stats, a, b in skeleton:
        if stats == "own_forward":
            forwards = [MicroStep(idx, True) for idx in micro[a]] + [MicroStep(idx, False) for idx in micro[b]]
            minibatches.append(MiniBatchPlan(rows, first, stats, (), tuple(forwards), fills_old=first))
        else:
            stats_pass = tuple(micro[a]) if stats == "current_pass" else ()
            forwards = [MicroStep(idx) for idx in micro[a]]
            minibatches.append(MiniBatchPlan(rows, first, stats, stats_pass, tuple(forwards)))
    ref_pass = tuple(micro[ref_set]) if ref_set is not None else ()
    return UpdatePlan(tuple(micro[old_set]), ref_pass, tuple(minibatches))
