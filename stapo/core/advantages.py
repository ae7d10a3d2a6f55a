"""GRPO group-normalised advantages (docs/method.md#grpo-advantages).

    Â_i = (R_i − mean_j R_j) / (std_j R_j + ε)

over the G responses of one prompt, std with Bessel's correction (ddof = 1), ε = 1e-6 (verl / JustRL).
``norm_by_std=False`` skips the division (Dr. GRPO). Â_i is broadcast to every token of response i by
:func:`broadcast_to_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stapo.core.tensor_utils import as_bool_mask

__all__ = ["GroupAdvantages", "grpo_advantages", "broadcast_to_tokens"]


@dataclass
class GroupAdvantages:
    """What :func:`grpo_advantages` returns.

    Attributes:
        advantages: [num_groups · G] fp32, one value per response, in the input's order.
        frac_reward_zero_std: fraction of groups whose rewards are all equal (their Â are all 0).
        metrics: verl-named scalars: ``critic/advantages/mean|max|min``, ``frac_reward_zero_std``.
    """

    advantages: torch.Tensor
    frac_reward_zero_std: float
    metrics: dict[str, float]


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> GroupAdvantages:
    """Group-normalised outcome advantages, one per response.

    Args:
        rewards: [num_groups · G] (responses of a group contiguous) or [num_groups, G]; any float dtype
            (computed in fp32).
        group_size: G, the number of responses per prompt, ≥ 2 (ddof = 1 needs two samples).
        eps: ε added to the std (1e-6 as in verl / JustRL).
        norm_by_std: divide by (std + ε) (GRPO) or not (Dr. GRPO: Â = R − mean).

    Returns:
        :class:`GroupAdvantages` with ``advantages`` of shape [num_groups · G], fp32.

    Raises:
        ValueError: G < 2, the number of rewards is not a multiple of G, a 2-D input whose second
            dimension is not G, or non-finite rewards.

    Example:
        rewards [1, −1, −1, −1] (one group, G = 4): mean −0.5, std (ddof 1) = 1.0 →
        Â = [1.5, −0.5, −0.5, −0.5] / (1 + 1e-6).
    """
    if group_size < 2:
        raise ValueError(f"group_size (G) must be ≥ 2 for a ddof=1 std, got {group_size}")
    if rewards.dim() == 2:
        if rewards.shape[1] != group_size:
            raise ValueError(f"rewards has shape {tuple(rewards.shape)} but group_size is {group_size}")
    elif rewards.dim() != 1:
        raise ValueError(f"rewards must be [num_groups*G] or [num_groups, G], got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    r = rewards.float().reshape(-1, group_size)  # [num_groups, G]
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or inf")

    mean = r.mean(dim=1, keepdim=True)  # [num_groups, 1]
    std = r.std(dim=1, keepdim=True, correction=1)  # [num_groups, 1]
    # all-equal groups, detected exactly (fp32 std of [0.1]*8 is ~7e-9, not 0, and /(std + ε) would amplify it)
    zero_std = r.amax(dim=1) == r.amin(dim=1)  # [num_groups] bool
    adv = r - mean  # [num_groups, G]
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(zero_std[:, None], torch.zeros_like(adv), adv)  # Â = 0 for all-equal groups (docs/method.md#grpo-advantages)
    frac_zero = zero_std.float().mean().item()
    adv = adv.reshape(-1)  # [num_groups * G]
    metrics = {
        "critic/advantages/mean": adv.mean().item(),
        "critic/advantages/max": adv.max().item(),
        "critic/advantages/min": adv.min().item(),
        "frac_reward_zero_std": frac_zero,
    }
    return GroupAdvantages(advantages=adv, frac_reward_zero_std=frac_zero, metrics=metrics)


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-response advantages to tokens: Â_{i,t} = Â_i on response tokens, 0 elsewhere.

    Args:
        advantages: [B] fp32.
        response_mask: [B, T] bool (or 0/1 integer).

    Returns:
        [B, T] fp32.
    """
    mask = as_bool_mask(response_mask, "response_mask")
    if advantages.dim() != 1 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match response_mask "
                         f"{tuple(mask.shape)} (expected [B] with B = {mask.shape[0]})")
    return advantages.float()[:, None] * mask  # [B, T]
