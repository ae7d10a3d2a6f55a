"""The two quantities of an optimizer mini-batch whose rows are split across data-parallel ranks: its token mask and
its loss denominator.

The S2T entropy quantile τ_h, the 20-Entropy top-k and the loss denominator are properties of the WHOLE mini-batch
(docs/method.md#data-parallelism), not of one rank's share. Each function here is the one-process formula applied to
the whole mini-batch, and in one process it is that formula with no communication:

- :func:`minibatch_token_mask` gathers the ranks' per-token statistics and calls
  :func:`stapo.core.objectives.compute_token_mask` ONCE on the whole mini-batch; every rank takes its own rows back,
  and N (``num_kept``) follows without a further reduction;
- :func:`minibatch_loss_denominator` sums the ranks' :class:`~stapo.core.objectives.KeptCounts` and calls
  :func:`stapo.core.objectives.loss_denominator`.

The layout rule (docs/extending.md#the-layout-rule): a mask is called on the mini-batch's rows, as one process calls
it — the ranks' [B_r, T_r] tensors padded to a common T and concatenated in rank order (rank-major = the
one-process row order: :func:`stapo.model.distributed.shard_prompt_indices`) — unless it is registered with
``reads_rows=False`` (:attr:`stapo.core.masks.MaskSpec.reads_rows`; every built-in mask), a declaration that its
result depends only on the response tokens in row-major order: it is then called on the ranks' response tokens
concatenated into one row [1, N] (12 bytes per response token instead of 16 per padded position).

Used by the native trainer (:mod:`stapo.train.update`) and the verl plugin (:mod:`stapo.integrations.verl`); no verl
dependency.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stapo.core.masks import TokenMask, get_mask_spec
from stapo.core.objectives import KeptCounts, LossAggMode, Objective, compute_token_mask, loss_denominator
from stapo.core.tensor_utils import as_bool_mask

__all__ = ["dist_world", "all_gather_varlen", "minibatch_token_mask", "minibatch_loss_denominator"]


def dist_world(group: Any = None) -> tuple[int, int]:
    """(world size, rank) of ``group`` (None = the default group); (1, 0) when torch.distributed is not
    initialised."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def all_gather_varlen(x: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """All-gather [C, n_r] tensors whose length n_r differs by rank. Collective over ``group``.

    Args:
        x: [C, n] tensor on a device the group's backend supports (CUDA for NCCL, CPU for gloo).
        group: process group (None = default group); without torch.distributed, returns ``[x]``.

    Returns:
        The ranks' tensors in rank order, each [C, n_r], same dtype/device as ``x``.
    """
    world, _ = dist_world(group)
    if world == 1:
        return [x]
    n = torch.tensor([x.shape[1]], dtype=torch.long, device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    torch.distributed.all_gather(sizes, n, group=group)
    sizes_i = [int(s.item()) for s in sizes]
    width = max(sizes_i)
    padded = F.pad(x, (0, width - x.shape[1])).contiguous()  # [C, width]
    bufs = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(bufs, padded, group=group)
    return [b[:, :s] for b, s in zip(bufs, sizes_i)]


def minibatch_token_mask(
    objective: Objective,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group: Any = None,
    device: torch.device | str | None = None,
) -> TokenMask:
    """The objective's token mask over the whole mini-batch, whose rows are split across data-parallel ranks: the one
    entry point of the native trainer and the verl plugin.

    One process (``group``'s world is 1, or torch.distributed is not initialised): :func:`stapo.core.objectives.
    compute_token_mask` of the rows as given. Several ranks: every rank contributes its rows, and
    ``compute_token_mask`` is applied ONCE to the whole mini-batch, laid out by the mask's layout rule
    (:attr:`stapo.core.masks.MaskSpec.reads_rows`):

    - ``reads_rows=True``: the ranks' rows, padded to the widest rank's T and concatenated in rank order,
      [Σ B_r, T] — exactly the one-process call on those rows (per-row Â stay [Σ B_r]);
    - ``reads_rows=False``: the ranks' response tokens (log p, H, Â) concatenated in rank-major, then row-major
      order as one row [1, N_resp] — by the mask's declaration the same keep-mask and statistics. (S2T and its
      ablations: ``s2t_random``'s seeded draw depends only on the row-major candidate sequence and the counts,
      :func:`stapo.core.masks.s2t_random_mask`; the 20-Entropy tie-break "first in row-major order" is rank-major
      then row-major, which is the one-process row order.)

    Every rank computes the same global mask, its ``keep`` restricted to its own rows; the mask's result is
    checked once, on the whole mini-batch, in ``compute_token_mask`` (so every rank raises alike). A rank without
    response tokens or without S2T candidates is fine. Collective: every rank of ``group`` must call it.

    Args:
        objective: an :class:`Objective` (any registered token mask: ``s2t``, ``top_entropy``, ``none``, the S2T
            ablations...).
        logprobs: [B, T] log p of the sampled tokens under the current policy (nats), any float dtype.
        entropy: [B, T] entropy (nats), any float dtype.
        advantages: [B] per-row (the native trainer) or [B, T] per-token (verl) advantages.
        response_mask: [B, T] bool (or 0/1).
        group: torch.distributed process group of the data-parallel ranks; None = the default group when
            torch.distributed is initialised, else no communication.
        device: where the ranks' statistics are gathered and the mask computed when there are several ranks
            (CUDA for NCCL, CPU for gloo); None = ``logprobs``' device. Unused in one process.

    Returns:
        :class:`stapo.core.masks.TokenMask`: this rank's ``keep`` [B, T] bool on ``response_mask``'s device,
        ``num_kept`` the global N, ``stats`` of the whole mini-batch (under their metric keys, ``actor/s2t/...``).

    Raises:
        ValueError / TypeError: shapes disagree, or from the mask functions (NaN entropy, invalid parameters).
        stapo.common.registry.ExtensionError: the mask broke its contract (:func:`stapo.core.masks.check_mask_result`).

    Example: rank 0 has candidates with H = [0.1, 0.2], rank 1 has [0.3, 0.4], S2T q = 0.75 → every rank
    uses τ_h = 0.325 of all four; rank 0 silences both of its candidates, rank 1 only the 0.3 one; N is the
    same on both ranks.
    """
    mask = as_bool_mask(response_mask, "response_mask")
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(mask.shape)}")
    adv = advantages[:, None].expand(mask.shape) if advantages.dim() == 1 else advantages  # [B, T]
    for name, t in (("logprobs", logprobs), ("entropy", entropy), ("advantages", adv)):
        if tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, response_mask {tuple(mask.shape)}")
    world, rank = dist_world(group)
    if world == 1:
        return compute_token_mask(objective, logprobs, entropy, advantages, response_mask)
    dev = logprobs.device if device is None else torch.device(device)
    m = mask.to(dev)
    if get_mask_spec(objective.token_mask).reads_rows:
        keep, tm = _mask_of_gathered_rows(objective, logprobs, entropy, advantages, m, group, rank)
    else:
        keep, tm = _mask_of_gathered_tokens(objective, logprobs, entropy, adv, m, group, rank)
    return TokenMask(keep=keep.to(mask.device), stats=dict(tm.stats), num_kept=tm.num_kept)


def _mask_of_gathered_tokens(objective: Objective, logprobs: torch.Tensor, entropy: torch.Tensor, adv: torch.Tensor,
                             m: torch.Tensor, group: Any, rank: int) -> tuple[torch.Tensor, TokenMask]:
    """``reads_rows=False``: the mask of the ranks' response tokens as one row [1, N_resp] → (this rank's keep [B, T]
    bool on ``m``'s device, the whole mini-batch's :class:`TokenMask`). ``adv``: [B, T]; ``m``: [B, T] bool."""
    device = m.device
    local = torch.stack([logprobs.detach().to(device).float()[m], entropy.detach().to(device).float()[m],
                         adv.detach().to(device).float()[m]])  # [3, n_local]
    parts = all_gather_varlen(local, group)
    flat = torch.cat(parts, dim=1)  # [3, N_resp], rank-major
    ones = torch.ones(1, flat.shape[1], dtype=torch.bool, device=device)  # [1, N_resp]
    tm = compute_token_mask(objective, flat[0:1], flat[1:2], flat[2:3], ones)
    offset = sum(p.shape[1] for p in parts[:rank])
    keep = torch.zeros_like(m)  # [B, T] bool
    keep[m] = tm.keep[0, offset: offset + local.shape[1]]  # row-major, as m's extraction above
    return keep, tm


def _mask_of_gathered_rows(objective: Objective, logprobs: torch.Tensor, entropy: torch.Tensor,
                           advantages: torch.Tensor, m: torch.Tensor, group: Any,
                           rank: int) -> tuple[torch.Tensor, TokenMask]:
    """``reads_rows=True``: the mask of the ranks' rows, padded to the widest rank's T and concatenated in rank order
    → (this rank's keep [B, T] bool on ``m``'s device, the whole mini-batch's :class:`TokenMask`).
    ``advantages``: [B] (stay per-row) or [B, T]; ``m``: [B, T] bool."""
    device = m.device
    B, T = m.shape
    width = torch.tensor([T], dtype=torch.long, device=device)
    torch.distributed.all_reduce(width, op=torch.distributed.ReduceOp.MAX, group=group)
    width = max(int(width.item()), 1)  # ≥ 1: column 0 carries the per-row Â

    def pad(x: torch.Tensor) -> torch.Tensor:  # [B, T] → [B, width] fp32 on device, zeros on the right
        return F.pad(x.detach().to(device).float(), (0, width - T))

    a = advantages.detach().to(device).float()
    a = a[:, None].expand(B, width) if a.dim() == 1 else pad(a)  # [B, width]
    local = torch.stack([pad(logprobs), pad(entropy), a, pad(m)])  # [4, B, width]
    gathered = all_gather_varlen(local.reshape(4, B * width), group)  # [4, B_r · width] per rank
    parts = [p.reshape(4, p.shape[1] // width, width) for p in gathered]  # [4, B_r, width]
    rows = torch.cat(parts, dim=1)  # [4, Σ B_r, width], rank order
    row_adv = rows[2, :, 0] if advantages.dim() == 1 else rows[2]  # [Σ B_r] or [Σ B_r, width]
    tm = compute_token_mask(objective, rows[0], rows[1], row_adv, rows[3] > 0.5)
    offset = sum(p.shape[1] for p in parts[:rank])
    return tm.keep[offset: offset + B, :T], tm


def minibatch_loss_denominator(
    keep: torch.Tensor,
    loss_agg_mode: LossAggMode,
    *,
    max_response_length: int | None = None,
    group: Any = None,
    device: torch.device | str | None = None,
) -> float:
    """The loss denominator of the whole mini-batch from this rank's share of its keep-mask: the ranks'
    :class:`~stapo.core.objectives.KeptCounts` (kept tokens, sequences with a kept token) are summed, then the
    one-process formula :func:`stapo.core.objectives.loss_denominator` applies (clamped ≥ 1 AFTER the sum, as in
    one process). One process: ``loss_denominator(keep, ...)``. Collective: every rank of ``group`` must call it.

    The native trainer divides each rank's loss share by this N over the number of ranks W (the ranks' gradients
    are averaged, so the update is Σ ∇ℓ / N: docs/method.md#data-parallelism).

    Args:
        keep: [b, T] bool (or 0/1), this rank's rows of the mini-batch's keep-mask.
        loss_agg_mode: one of :data:`stapo.core.objectives.LOSS_AGG_MODES`.
        max_response_length: L, required for ``seq-mean-token-sum-norm``.
        group: the data-parallel process group (None = the default group, or no communication).
        device: where the counts are summed (CUDA for NCCL, CPU for gloo); None = ``keep``'s device.

    Returns:
        A Python float ≥ 1.

    Raises:
        ValueError: unknown mode, or a missing ``max_response_length`` for seq-mean-token-sum-norm.

    Example: rank 0 keeps [[1, 1, 0], [0, 0, 0]], rank 1 keeps [[1, 0, 0]] → token-mean N = 2 + 1 = 3,
    seq-mean-token-mean S = 1 + 1 = 2, seq-mean-token-sum-norm with L = 10 → 20.
    """
    counts = KeptCounts.of(keep)
    if dist_world(group)[0] > 1:
        t = torch.tensor(counts, dtype=torch.float64, device=keep.device if device is None else device)  # [2]
        torch.distributed.all_reduce(t, group=group)
        counts = KeptCounts(*(int(v) for v in t.tolist()))
    return loss_denominator(counts, loss_agg_mode, max_response_length=max_response_length)
