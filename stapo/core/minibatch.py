"""A token mask over an optimizer mini-batch whose rows are split across data-parallel ranks.

The S2T entropy quantile τ_h, the 20-Entropy top-k and the kept-token denominator N are properties of the
WHOLE mini-batch (docs/method.md#data-parallelism), not of one rank's share. :func:`minibatch_token_mask`
all-gathers the per-token statistics (log p, H, Â) of every rank's response tokens and applies the objective's own mask function
(:func:`stapo.core.objectives.compute_token_mask`) once to the concatenation, so every rank computes the same global
mask, and N follows from it without a further reduction. Used by the native trainer
(:mod:`stapo.model.distributed`, :mod:`stapo.train`) and the verl plugin
(:mod:`stapo.integrations.verl`); it has no verl dependency. Communication: 12 bytes per response token.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stapo.core.masks import TokenMask
from stapo.core.objectives import Objective, compute_token_mask
from stapo.core.tensor_utils import as_bool_mask

__all__ = ["dist_world", "all_gather_varlen", "minibatch_token_mask"]


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
) -> TokenMask:
    """The objective's token mask over the whole mini-batch, whose rows are split across data-parallel ranks.

    Every rank contributes the (log p, H, Â) of its response tokens; they are all-gathered in rank order and
    :func:`stapo.core.objectives.compute_token_mask` is applied ONCE to the concatenation, viewed as a single row
    [1, N_resp]. S2T and its ablations do not depend on the layout (``s2t_random``'s seeded draw depends only on
    the row-major candidate sequence and the counts: :func:`stapo.core.masks.s2t_random_mask`); the 20-Entropy tie-break
    ("first in row-major order") becomes rank-major then row-major, which is plain row-major order with one rank —
    so the keep-mask is the one-process ``compute_token_mask`` of the [n, R] mini-batch. A rank without response
    tokens or without S2T candidates is fine. Collective: every rank of ``group`` must call it.

    Args:
        objective: an :class:`Objective` (any registered token mask: ``s2t``, ``top_entropy``, ``none``, the S2T
            ablations...).
        logprobs: [B, T] log p of the sampled tokens under the current policy (nats), any float dtype.
        entropy: [B, T] entropy (nats), any float dtype.
        advantages: [B, T] or [B] advantages.
        response_mask: [B, T] bool (or 0/1).
        group: torch.distributed process group of the data-parallel ranks; None = the default group when
            torch.distributed is initialised, else no communication.

    Returns:
        :class:`stapo.core.masks.TokenMask`: this rank's ``keep`` [B, T] bool on ``response_mask``'s device, ``num_kept``
        the global N, ``stats`` of the whole mini-batch (under their metric keys, ``actor/s2t/...``).

    Raises:
        ValueError / TypeError: shapes disagree, or from the mask functions (NaN entropy, invalid parameters).

    Example: rank 0 has candidates with H = [0.1, 0.2], rank 1 has [0.3, 0.4], S2T q = 0.75 → every rank
    uses τ_h = 0.325 of all four; rank 0 silences both of its candidates, rank 1 only the 0.3 one; N is the
    same on both ranks.
    """
    mask = as_bool_mask(response_mask, "response_mask")
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(mask.shape)}")
    adv = advantages
    if adv.dim() == 1:
        adv = adv[:, None].expand(mask.shape)  # [B, T]
    for name, t in (("logprobs", logprobs), ("entropy", entropy), ("advantages", adv)):
        if tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, response_mask {tuple(mask.shape)}")
    device = logprobs.device
    m = mask.to(device)
    local = torch.stack([logprobs.detach().float()[m], entropy.detach().to(device).float()[m],
                         adv.detach().to(device).float()[m]])  # [3, n_local]
    parts = all_gather_varlen(local, group)
    _, rank = dist_world(group)
    flat = torch.cat(parts, dim=1)  # [3, N_resp], rank-major
    ones = torch.ones(1, flat.shape[1], dtype=torch.bool, device=device)  # [1, N_resp]
    tm = compute_token_mask(objective, flat[0:1], flat[1:2], flat[2:3], ones)
    keep_all = tm.keep[0]  # [N_resp] bool
    offset = sum(p.shape[1] for p in parts[:rank])
    keep = torch.zeros_like(m)  # [B, T] bool
    keep[m] = keep_all[offset: offset + local.shape[1]]  # row-major, as m's extraction above
    return TokenMask(keep=keep.to(mask.device), stats=dict(tm.stats), num_kept=int(keep_all.sum()))
