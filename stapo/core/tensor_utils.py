"""Small tensor helpers shared by the masks, objectives and analysis modules.

Pitfalls these helpers exist for (docs/method.md#pitfalls):
- an integer 0/1 tensor used as an index *gathers* rows instead of masking, so every mask that enters
  the core goes through :func:`as_bool_mask`;
- ``torch.quantile`` rejects bf16 input, empty input and (on some versions) inputs over 2^24 elements,
  so thresholds come from :func:`quantile` (fp32 ``kthvalue``).
"""
from __future__ import annotations

import torch

__all__ = ["as_bool_mask", "check_same_shape", "masked_mean", "quantile"]


def as_bool_mask(mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` as a boolean tensor, accepting integer 0/1 masks.

    Args:
        mask: bool tensor, or an integer tensor whose values are all 0 or 1 (any shape).
        name: the argument's name, used in error messages.

    Returns:
        A ``torch.bool`` tensor of the same shape (the input itself when it is already boolean).

    Raises:
        TypeError: ``mask`` is not a tensor, or is a floating/complex tensor (ambiguous: 0.5 is neither).
        ValueError: an integer mask holds a value other than 0 or 1.

    Example:
        >>> as_bool_mask(torch.tensor([1, 0, 1]))
        tensor([ True, False,  True])
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype bool, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"{name} must be a boolean (or integer 0/1) tensor, got dtype {mask.dtype}; "
            f"convert explicitly, e.g. {name}.bool() or ({name} > 0.5)"
        )
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        raise ValueError(f"{name} is an integer tensor with values other than 0/1 (e.g. {mask[bad][0].item()}); "
                         f"a mask must be boolean or 0/1")
    return mask != 0


def check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first tensor in ``others`` whose shape differs from ``reference``."""
    for name, t in others.items():
        if tuple(t.shape) != tuple(reference.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {reference_name} has shape {tuple(reference.shape)}"
            )


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask``; 0 when the mask is empty (never 0/0).

    Args:
        values: float tensor [...].
        mask: bool (or integer 0/1) tensor of the same shape.

    Returns:
        0-dim fp32 tensor. Masked-out entries never reach the sum (``torch.where``), so NaN/inf there is harmless.
    """
    mask = as_bool_mask(mask, "mask")
    v = torch.where(mask, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))
    return v.sum() / mask.sum().clamp(min=1)


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of a 1-D tensor with linear interpolation (numpy's default ``method="linear"``).

    Computed in fp32 with ``torch.kthvalue`` — not ``torch.quantile``, which rejects bf16, empty input and,
    on some torch versions, more than 2^24 elements (docs/method.md#pitfalls).

    Args:
        values: 1-D float tensor [n], n ≥ 1, any float dtype (cast to fp32).
        q: quantile level in [0, 1].

    Returns:
        0-dim fp32 tensor: v_(lo) + (v_(hi) − v_(lo)) · (pos − lo) with pos = q·(n−1), lo = ⌊pos⌋,
        hi = ⌈pos⌉, where v_(k) is the k-th smallest value (0-based).

    Raises:
        ValueError: ``values`` is empty or not 1-D, or q is outside [0, 1].

    Example:
        values [1, 2, 3, 4], q = 0.75 → pos = 2.25 → 3 + (4 − 3)·0.25 = 3.25.
    """
    if values.dim() != 1:
        raise ValueError(f"quantile expects a 1-D tensor, got shape {tuple(values.shape)}")
    n = values.numel()
    if n == 0:
        raise ValueError("quantile of an empty tensor is undefined")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile level q must be in [0, 1], got {q}")
    v = values.float()
    pos = q * (n - 1)
    lo = int(pos)  # floor, pos ≥ 0
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    v_lo = torch.kthvalue(v, lo + 1).values  # kthvalue is 1-based
    if frac == 0.0 or hi == lo:
        return v_lo
    v_hi = torch.kthvalue(v, hi + 1).values
    return v_lo + (v_hi - v_lo) * frac
