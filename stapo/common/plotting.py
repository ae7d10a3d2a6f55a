"""Curves over seeds, drawn the same way by the study report (``curves.png``, :mod:`stapo.study.report`) and by
``scripts/plot_runs.py`` (any run folders): per group a thin line per seed, the mean over seeds as a thick line and
a light band from the seeds' minimum to their maximum, clipped to the metric's physical range
(:func:`physical_range`: no negative entropy, no accuracy above 1).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["physical_range", "draw_seed_curves"]

#: Pieces of a metric key (docs/metrics.md) that make it a fraction or an accuracy in [0, 1].
_UNIT_PIECES = ("acc", "accuracy", "frac", "clip_ratio", "pass@", "avg@", "maj@", "mean@", "mfu")
#: Pieces that make it non-negative (entropies, lengths, counts, times, norms, memory).
_NONNEG_PIECES = ("entropy", "length", "num_", "timing_s", "grad_norm", "tokens", "memory", "_gb")


def physical_range(key: str) -> tuple[float | None, float | None]:
    """The range a metric's values can take, from its key (docs/metrics.md names): ``(0, 1)`` for fractions and
    accuracies (``actor/pg_clipfrac``, ``actor/s2t/masked_frac``, ``reward/grader/accuracy``,
    ``val-core/<bench>/acc/mean@N``, ``eval/.../avg@N``, ``response_length/clip_ratio``), ``(0, None)`` for entropies,
    lengths, counts, times, norms and memory, ``(None, None)`` otherwise (rewards, losses, advantages).

    Returns:
        ``(low, high)``; None = unbounded on that side.
    """
    k = key.lower()
    if "entropy" in k and "frac" not in k:  # actor/entropy, probe/entropy: nats, >= 0
        return 0.0, None
    if any(p in k for p in _UNIT_PIECES):
        return 0.0, 1.0
    if any(p in k for p in _NONNEG_PIECES):
        return 0.0, None
    return None, None


def draw_seed_curves(ax: Any, x: np.ndarray, values: np.ndarray, color: Any, label: str,
                     clip: tuple[float | None, float | None] = (None, None), marker: bool | None = None) -> bool:
    """Draw one group's seeds on a matplotlib axis: each seed a thin line over its own logged steps, the mean over
    seeds a thick line (with markers when there are few points), the seeds' min–max a light band, the band clipped
    to ``clip``.

    Args:
        ax: a matplotlib ``Axes``.
        x: [T] the steps (training step axis).
        values: [S, T] float, NaN where a seed did not log the metric at that step.
        color: the group's colour (kept in every panel by the caller).
        label: the legend entry of the mean line, e.g. ``"stapo (3)"``.
        clip: ``(low, high)`` of :func:`physical_range`; None = unbounded. NaN-free values outside it (smoothing,
            rounding) are drawn at the bound.
        marker: markers on the mean line; None = when fewer than 12 steps have a value.

    Returns:
        False when no step has a value (nothing drawn).
    """
    values = np.asarray(values, dtype=float).reshape(-1, len(x))
    logged = ~np.isnan(values).all(axis=0)  # [T]
    if not logged.any():
        return False
    xs, v = np.asarray(x)[logged], values[:, logged]
    lo_b = -math.inf if clip[0] is None else clip[0]
    hi_b = math.inf if clip[1] is None else clip[1]
    for row in v:
        ok = ~np.isnan(row)
        ax.plot(xs[ok], row[ok], color=color, lw=0.7, alpha=0.45)
    with np.errstate(all="ignore"):
        mean, lo, hi = np.nanmean(v, 0), np.nanmin(v, 0), np.nanmax(v, 0)
    ax.fill_between(xs, np.clip(lo, lo_b, hi_b), np.clip(hi, lo_b, hi_b), color=color, alpha=0.12, linewidth=0)
    sparse = xs.size < 12 if marker is None else marker
    ax.plot(xs, mean, color=color, lw=2.0, label=label, marker="o" if sparse else None, ms=3)
    return True
