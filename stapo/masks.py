"""Token masks: which response tokens of an optimizer mini-batch receive gradient.

Every mask takes the per-token statistics of the WHOLE mini-batch (the S2T quantile and the 20-Entropy
top-k are mini-batch quantities, not micro-batch ones) and returns a boolean keep-mask plus statistics.
The objective then renormalises the loss over the kept tokens (:mod:`stapo.objectives`).

Registry ``TOKEN_MASKS``: name → pure function with the common signature

    fn(logprobs [B,T], entropy [B,T], advantages [B,T] or [B], response_mask [B,T], **params) -> TokenMask

- ``"none"``        every response token is kept (GRPO, JustRL).
- ``"s2t"``         the S2T mask of STAPO (METHOD.md §4).
- ``"top_entropy"`` keep the top 20 % highest-entropy tokens (20-Entropy, arXiv 2506.01939; METHOD.md §5).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from stapo.tensor_utils import as_bool_mask, check_same_shape, quantile

__all__ = [
    "TokenMask",
    "no_mask",
    "s2t_mask",
    "top_entropy_mask",
    "TOKEN_MASKS",
    "get_token_mask",
    "maskable_rows",
]

QuantileScope = Literal["candidates", "all"]


@dataclass
class TokenMask:
    """A keep-mask and its statistics.

    Attributes:
        keep: [B, T] bool — True where the token is a response token that receives gradient.
        stats: scalar statistics (Python floats); keys depend on the mask (see each function).
    """

    keep: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)


def _prepare(
    logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    advantages: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Validate shapes, cast to bool / fp32, broadcast [B] advantages to [B, T]."""
    mask = as_bool_mask(response_mask, "response_mask")
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(mask.shape)}")
    out: dict[str, torch.Tensor] = {}
    for name, t in (("logprobs", logprobs), ("entropy", entropy), ("advantages", advantages)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if name == "advantages" and t.dim() == 1:
            if t.shape[0] != mask.shape[0]:
                raise ValueError(f"advantages has shape {tuple(t.shape)}; expected [B]={mask.shape[0]} or [B, T]")
            t = t[:, None].expand_as(mask)  # [B, T]
        check_same_shape("response_mask", mask, **{name: t})
        out[name] = t.float()  # fp32, [B, T]
    return mask, out


def no_mask(
    logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    advantages: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> TokenMask:
    """Keep every response token (GRPO, JustRL). ``keep`` = ``response_mask`` as bool, [B, T]."""
    mask, _ = _prepare(None, None, None, response_mask)
    return TokenMask(keep=mask.clone(), stats={})


def s2t_mask(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    prob_threshold: float = 0.002,
    entropy_quantile: float = 0.75,
    quantile_scope: QuantileScope = "candidates",
) -> TokenMask:
    """The S2T (Silencing Spurious Tokens) mask of STAPO (METHOD.md §4, paper Algorithm 1).

    A response token is silenced iff  Â > 0  AND  p < τ_p  AND  H < τ_h  (strict inequalities), where
    τ_h is the ``entropy_quantile``-quantile of H over
      - ``"candidates"`` (v4, default): the tokens of the mini-batch with Â > 0 and p < τ_p;
      - ``"all"`` (v1 text / seed summary, used with q = 0.80): all response tokens of the mini-batch.
    An empty candidate set silences nothing. Thresholds are fp32 from ``kthvalue`` (linear interpolation,
    :func:`stapo.tensor_utils.quantile`), never ``torch.quantile``.

    Args:
        logprobs: [B, T] log p of the sampled tokens under π_θ at the rollout temperature (nats), any float
            dtype (compared in fp32). Detached inside.
        entropy: [B, T] full-vocabulary entropy H (nats), any float dtype (bf16 is fine).
        advantages: [B, T] token advantages, or [B] per-response advantages (broadcast).
        response_mask: [B, T] bool (or integer 0/1) — True on response tokens.
        prob_threshold: τ_p, absolute probability (0.002 ⇒ log p < ln 0.002 ≈ −6.2146).
        entropy_quantile: q ∈ (0, 1).
        quantile_scope: ``"candidates"`` or ``"all"``.

    Returns:
        :class:`TokenMask` with ``keep`` [B, T] bool = response tokens that are not silenced, and stats:
        ``num_response_tokens``, ``num_candidates``, ``num_masked``, ``masked_frac`` (silenced / response
        tokens), ``entropy_threshold`` (τ_h; NaN when it is undefined), ``masked_prob_mean``,
        ``masked_entropy_mean``, ``masked_adv_mean`` (NaN when nothing is silenced).

    Raises:
        ValueError: shapes disagree, τ_p ∉ (0, 1], q ∉ (0, 1), unknown scope, a NaN/inf entropy or NaN
            log-prob on a response token.
        TypeError: a float mask, or non-float statistics.

    With strict inequalities and a linearly interpolated quantile, a single candidate, or candidates whose
    entropies are all equal, are never silenced (τ_h equals their entropy).

    Example (scope = "candidates", q = 0.75, τ_p = 0.002): four candidates with H = [0.1, 0.2, 0.3, 0.4]
    → τ_h = 0.3 + 0.25·(0.4 − 0.3) = 0.325 → the tokens with H 0.1, 0.2, 0.3 are silenced, 0.4 is kept.
    """
    if not 0.0 < prob_threshold <= 1.0:
        raise ValueError(f"prob_threshold (tau_p) must be in (0, 1], got {prob_threshold}")
    if not 0.0 < entropy_quantile < 1.0:
        raise ValueError(f"entropy_quantile (q) must be in (0, 1), got {entropy_quantile}")
    if quantile_scope not in ("candidates", "all"):
        raise ValueError(f"quantile_scope must be 'candidates' or 'all', got {quantile_scope!r}")
    mask, t = _prepare(logprobs, entropy, advantages, response_mask)
    logp, ent, adv = t["logprobs"].detach(), t["entropy"].detach(), t["advantages"].detach()  # [B, T] fp32

    bad = mask & ~(torch.isfinite(ent) & ~torch.isnan(logp))
    if bool(bad.any()):  # a NaN in the quantile pool would make τ_h NaN and silently silence nothing
        b, t_ = bad.nonzero()[0].tolist()
        raise ValueError(f"s2t_mask: non-finite entropy or NaN log-prob at response token ({b}, {t_}); "
                         f"{int(bad.sum())} such tokens")
    log_tau_p = math.log(prob_threshold)
    candidates = mask & (adv > 0) & (logp < log_tau_p)  # [B, T] bool
    num_candidates = int(candidates.sum())
    num_response = int(mask.sum())

    pool = candidates if quantile_scope == "candidates" else mask  # [B, T] bool
    if num_candidates == 0 or not bool(pool.any()):
        tau_h = float("nan")
        silenced = torch.zeros_like(mask)  # [B, T] bool, nothing silenced
    else:
        tau_h_t = quantile(ent[pool], entropy_quantile)  # 0-dim fp32
        tau_h = tau_h_t.item()
        silenced = candidates & (ent < tau_h_t)  # [B, T] bool

    num_masked = int(silenced.sum())
    nan = float("nan")
    stats = {
        "num_response_tokens": float(num_response),
        "num_candidates": float(num_candidates),
        "num_masked": float(num_masked),
        "masked_frac": num_masked / max(num_response, 1),
        "entropy_threshold": tau_h,
        "masked_prob_mean": logp[silenced].exp().mean().item() if num_masked else nan,
        "masked_entropy_mean": ent[silenced].mean().item() if num_masked else nan,
        "masked_adv_mean": adv[silenced].mean().item() if num_masked else nan,
    }
    return TokenMask(keep=mask & ~silenced, stats=stats)


def top_entropy_mask(
    logprobs: torch.Tensor | None,
    entropy: torch.Tensor,
    advantages: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    ratio: float = 0.2,
) -> TokenMask:
    """20-Entropy: keep only the top ⌈ratio · n⌉ highest-entropy response tokens of the mini-batch.

    Source: "Beyond the 80/20 Rule" (arXiv 2506.01939); METHOD.md §5. n = number of response tokens.
    Ties are broken deterministically: among equal entropies, the token that comes first in row-major
    order of [B, T] (lower batch index, then lower position) is kept (stable descending sort).

    Args:
        logprobs, advantages: unused (common signature).
        entropy: [B, T] entropy (nats), any float dtype (compared in fp32).
        response_mask: [B, T] bool (or integer 0/1).
        ratio: fraction kept, in (0, 1].

    Returns:
        :class:`TokenMask` with stats ``num_response_tokens``, ``num_kept``, ``kept_frac`` and
        ``entropy_threshold`` (the smallest kept entropy; NaN when there are no response tokens).

    Raises:
        ValueError: ratio ∉ (0, 1] or shapes disagree.

    Example: entropies of 5 response tokens [0.5, 2.0, 1.0, 2.0, 0.1], ratio 0.2 → k = ⌈1.0⌉ = 1; the two
    2.0 tie and the first (index 1) is kept.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"top-entropy ratio must be in (0, 1], got {ratio}")
    mask, t = _prepare(None, entropy, None, response_mask)
    ent = t["entropy"].detach()  # [B, T] fp32
    if bool((mask & torch.isnan(ent)).any()):  # sort would rank NaN above every entropy and keep it
        raise ValueError(f"top_entropy_mask: {int((mask & torch.isnan(ent)).sum())} response tokens have NaN entropy")
    n = int(mask.sum())
    keep_flat = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)  # [B*T] bool
    threshold = float("nan")
    if n > 0:
        k = math.ceil(ratio * n - 1e-9)  # guard: 0.2 * 15 = 3.0000000000000004 in floats
        k = min(max(k, 1), n)
        flat_idx = mask.reshape(-1).nonzero().squeeze(1)  # [n] int64, increasing
        vals = ent.reshape(-1)[flat_idx]  # [n] fp32
        order = torch.sort(vals, descending=True, stable=True).indices[:k]  # [k]
        keep_flat[flat_idx[order]] = True
        threshold = vals[order[-1]].item()
    keep = keep_flat.view(mask.shape)  # [B, T] bool
    num_kept = int(keep.sum())
    stats = {
        "num_response_tokens": float(n),
        "num_kept": float(num_kept),
        "kept_frac": num_kept / max(n, 1),
        "entropy_threshold": threshold,
    }
    return TokenMask(keep=keep, stats=stats)


TokenMaskFn = Callable[..., TokenMask]

TOKEN_MASKS: dict[str, TokenMaskFn] = {
    "none": no_mask,
    "s2t": s2t_mask,
    "top_entropy": top_entropy_mask,
}


def get_token_mask(name: str) -> TokenMaskFn:
    """Look up a token mask by name. Raises ``KeyError`` listing the valid names."""
    try:
        return TOKEN_MASKS[name]
    except KeyError:
        raise KeyError(f"unknown token mask {name!r}; valid names: {sorted(TOKEN_MASKS)}") from None


def maskable_rows(name: str, advantages: torch.Tensor) -> torch.Tensor:
    """Rows whose keep-mask may differ from their response mask, whatever the token statistics turn out to be.

    - ``"none"``: no row.
    - ``"s2t"``: rows with Â > 0 — S2T silences only candidates, and candidates need Â > 0 (METHOD.md §4);
      rows with Â ≤ 0 keep every response token for any p, H and τ_h.
    - ``"top_entropy"``: every row (all tokens compete for the top 20 %).

    The trainer's ``actor.fused_forward`` uses this to run the backward of the other rows before the
    mini-batch's statistics are complete.

    Args:
        name: a registered mask name.
        advantages: [B] per-response advantages (fp32).

    Returns:
        [B] bool.

    Raises:
        KeyError: unknown mask name.

    Example: ``maskable_rows("s2t", torch.tensor([0.5, 0.0, -0.5]))`` → ``[True, False, False]``.
    """
    get_token_mask(name)  # validates the name
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be [B] per-response values, got shape {tuple(advantages.shape)}")
    if name == "none":
        return torch.zeros_like(advantages, dtype=torch.bool)
    if name == "s2t":
        return advantages > 0
    return torch.ones_like(advantages, dtype=torch.bool)
