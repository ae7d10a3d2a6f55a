"""The paper's token-level analysis framework (docs/method.md#token-analysis), computable from logged per-token tensors.

For the token loss ℓ = −w · log π(y) with w = ρÂ (the gradient of the clipped surrogate −ρÂ w.r.t. the
logits z = a / T is w · (π − e_y)), and w = 0 where the clip is active:

    ‖∇_z ℓ‖² = w² · ‖e_y − π‖² = w² (1 − 2p + Σ_v π(v)²)                           (exact)
    w² (1 − 2p + e^{−H})  ≤  ‖∇_z ℓ‖²  ≤  w² (2 − 2p − C_V H²),  C_V = (|V|−1) / (|V| (ln|V|)²)

(lower bound: Σπ² ≥ e^{−H} by Jensen; upper bound: the paper's). With a sampling temperature T the
gradient w.r.t. the raw logits a is ∇_z / T.

The paper's first-order entropy-change term of one token, step size η (docs/method.md#token-analysis; it is that token's
term of the covariance estimate of Cui et al., arXiv 2505.22617, not the exact first-order change of a
single logit-gradient step, which also depends on Σ_v π² (log π + H)):

    ΔH ≈ −η · p · (log p − E_π[log π]) · (Â − E_π[Â]),   E_π[log π] = −H

so a low-probability token (log p < −H) with positive advantage increases entropy.

Quadrants: among response tokens with Â > 0 (tokens of responses that beat their group), split by
probability (p < τ_p → "low_p") and entropy (H < τ_h → "low_h", τ_h the median by default); "low_p_low_h" is
the paper's spurious-risk quadrant. It is not the set S2T silences: S2T's cut is the q-quantile (0.75) of its
candidates' H (Â > 0, p < τ_p; stapo.core.masks.s2t_mask), not the median of all Â > 0 tokens.
"""
from __future__ import annotations

import math

import torch

from stapo.core.masks import PROB_THRESHOLD
from stapo.core.tensor_utils import as_bool_mask, check_same_shape, quantile

__all__ = [
    "logit_grad_norm",
    "logit_grad_norm_bounds",
    "token_loss_weight",
    "entropy_change_estimate",
    "quadrant_summary",
    "QUADRANTS",
]

QUADRANTS = ("high_p_high_h", "high_p_low_h", "low_p_high_h", "low_p_low_h")


def logit_grad_norm(
    logprobs: torch.Tensor,
    collision: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Exact per-token ‖∇_a ℓ‖ of the token loss ℓ = −w log π(y) w.r.t. the raw logits a
    (docs/method.md#token-analysis).

        ‖∇_a ℓ‖ = |w| · sqrt(1 − 2p + Σ_v π(v)²) / T

    Args:
        logprobs: [...] log p of the sampled token (nats), at temperature T.
        collision: [...] Σ_v π(v)² (from :func:`stapo.core.token_stats.token_stats`).
        weight: [...] w = ρ Â, with 0 where the clip is active (see :func:`token_loss_weight`).
        temperature: T > 0 used to form π = softmax(a / T).

    Returns:
        [...] fp32, ≥ 0.

    Example: V = 2, π = (0.5, 0.5), y = 0, w = 1 → sqrt(1 − 1 + 0.5) = 0.7071.
    """
    check_same_shape("logprobs", logprobs, collision=collision, weight=weight)
    p = logprobs.detach().float().exp()
    sq = (1.0 - 2.0 * p + collision.detach().float()).clamp(min=0.0)  # [...], rounding can go below 0
    return weight.detach().float().abs() * sq.sqrt() / temperature


def logit_grad_norm_bounds(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    weight: torch.Tensor,
    vocab_size: int,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper bounds of ‖∇_a ℓ‖ from p and H alone (docs/method.md#token-analysis).

        lower = |w| sqrt(1 − 2p + e^{−H}) / T,   upper = |w| sqrt(2 − 2p − C_V H²) / T,
        C_V = (|V| − 1) / (|V| (ln |V|)²)

    Args:
        logprobs, entropy, weight: [...] (nats; w as in :func:`logit_grad_norm`).
        vocab_size: |V| ≥ 2 (the size of the distribution, e.g. 151,936 for Qwen3).
        temperature: T > 0.

    Returns:
        (lower [...], upper [...]) fp32.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be ≥ 2, got {vocab_size}")
    check_same_shape("logprobs", logprobs, entropy=entropy, weight=weight)
    p = logprobs.detach().float().exp()
    h = entropy.detach().float()
    c_v = (vocab_size - 1) / (vocab_size * math.log(vocab_size) ** 2)
    w = weight.detach().float().abs() / temperature
    lower = w * (1.0 - 2.0 * p + torch.exp(-h)).clamp(min=0.0).sqrt()
    upper = w * (2.0 - 2.0 * p - c_v * h * h).clamp(min=0.0).sqrt()
    return lower, upper


def token_loss_weight(ratio: torch.Tensor, advantages: torch.Tensor, clipped: torch.Tensor) -> torch.Tensor:
    """w = ρ Â per token, 0 where the (ε or dual) clip is active. All [...]; returns fp32."""
    check_same_shape("ratio", ratio, advantages=advantages, clipped=clipped)
    w = ratio.detach().float() * advantages.detach().float()
    return torch.where(as_bool_mask(clipped, "clipped"), torch.zeros_like(w), w)


def entropy_change_estimate(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    *,
    lr: float = 1.0,
    expected_advantage: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """The paper's first-order entropy-change term of one token (docs/method.md#token-analysis; see the module
    docstring).

        ΔH ≈ −η · p · (log p − E_π[log π]) · (Â − E_π[Â]),  with E_π[log π] = −H.

    Args:
        logprobs: [...] log p (nats). entropy: [...] H (nats). advantages: [...] Â.
        lr: η (the result is linear in η; 1.0 gives ΔH per unit step).
        expected_advantage: E_π[Â] — 0 by default (GRPO advantages are zero-mean within a group).

    Returns:
        [...] fp32, nats per unit step. Positive = the update raises entropy.

    Example: p = e^{−3}, H = 1, Â = 1 → −e^{−3} · (−3 + 1) · 1 = 2e^{−3} ≈ 0.0996 > 0.
    """
    check_same_shape("logprobs", logprobs, entropy=entropy, advantages=advantages)
    logp = logprobs.detach().float()
    p = logp.exp()
    centred_adv = advantages.detach().float() - expected_advantage
    return -lr * p * (logp + entropy.detach().float()) * centred_adv


def quadrant_summary(
    logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *,
    grad_norm: torch.Tensor | None = None,
    entropy_change: torch.Tensor | None = None,
    prob_threshold: float = PROB_THRESHOLD,
    entropy_threshold: float | None = None,
    entropy_quantile: float = 0.5,
) -> dict[str, float]:
    """Token share, mean gradient norm and mean entropy change per probability × entropy quadrant
    (docs/method.md#token-analysis).

    Tokens considered: response tokens with Â > 0. "low_p" means p < ``prob_threshold`` (τ_p);
    "low_h" means H < τ_h, with τ_h = ``entropy_threshold`` if given, else the ``entropy_quantile``-quantile
    of H over the considered tokens (median by default).

    Args:
        logprobs, entropy, advantages: [B, T] (nats; Â may be [B]).
        response_mask: [B, T] bool (or 0/1).
        grad_norm: [B, T] per-token ‖∇_a ℓ‖ (e.g. :func:`logit_grad_norm`); omitted → not reported.
        entropy_change: [B, T] (e.g. :func:`entropy_change_estimate`); default: that estimate with η = 1.
        prob_threshold, entropy_threshold, entropy_quantile: the split points.

    Returns:
        Flat dict, keys ``quadrant/<q>/share`` (fraction of considered tokens), ``quadrant/<q>/count``,
        ``quadrant/<q>/grad_norm`` (if given), ``quadrant/<q>/entropy_change`` for q in :data:`QUADRANTS`,
        plus ``quadrant/num_tokens`` and ``quadrant/entropy_threshold``. Means over an empty quadrant are NaN.
    """
    mask = as_bool_mask(response_mask, "response_mask")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(mask)
    check_same_shape("response_mask", mask, logprobs=logprobs, entropy=entropy, advantages=advantages)
    logp = logprobs.detach().float()
    ent = entropy.detach().float()
    adv = advantages.detach().float()
    if entropy_change is None:
        entropy_change = entropy_change_estimate(logp, ent, adv)
    check_same_shape("response_mask", mask, entropy_change=entropy_change)
    if grad_norm is not None:
        check_same_shape("response_mask", mask, grad_norm=grad_norm)
    considered = mask & (adv > 0)  # [B, T] bool
    n = int(considered.sum())
    out: dict[str, float] = {"quadrant/num_tokens": float(n)}
    if n == 0:
        tau_h = float("nan")
    elif entropy_threshold is not None:
        tau_h = float(entropy_threshold)
    else:
        tau_h = quantile(ent[considered], entropy_quantile).item()
    out["quadrant/entropy_threshold"] = tau_h
    low_p = logp < math.log(prob_threshold)  # [B, T] bool
    low_h = ent < tau_h  # [B, T] bool (all False when tau_h is NaN)
    parts = {
        "high_p_high_h": ~low_p & ~low_h,
        "high_p_low_h": ~low_p & low_h,
        "low_p_high_h": low_p & ~low_h,
        "low_p_low_h": low_p & low_h,
    }
    for name in QUADRANTS:
        sel = considered & parts[name]  # [B, T] bool
        k = int(sel.sum())
        out[f"quadrant/{name}/count"] = float(k)
        out[f"quadrant/{name}/share"] = k / n if n else float("nan")
        if grad_norm is not None:
            out[f"quadrant/{name}/grad_norm"] = grad_norm.detach().float()[sel].mean().item() if k else float("nan")
        out[f"quadrant/{name}/entropy_change"] = entropy_change.detach().float()[sel].mean().item() if k else float("nan")
    return out
