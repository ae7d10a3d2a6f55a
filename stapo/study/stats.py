"""The statistics of a study report (docs/study.md#statistics): pure functions on NumPy arrays.

- :func:`t_band`: the mean over seeds and the half-width of its Student-t confidence interval,
  ``mean ± t_{(1+c)/2, n−1} · s / √n`` (s: sample standard deviation, ddof = 1), step by step.
- :func:`moving_average`: the trailing moving average of one run's curve (the report's optional smoothing).
- :func:`window_steps`: the logged steps within the last W training steps (the "final value" window).
- :func:`paired_bootstrap`: the mean paired difference between two methods over (seed, step) pairs and its
  two-stage (hierarchical) percentile bootstrap interval: seeds resampled, then steps within each resampled seed.
- :func:`detectable_effect`: what a t-interval over n replicates can resolve: its half-width, and the effect that
  a two-sided t-test would detect with the given power (80 %), from the replicates' own spread.
- :func:`block_bootstrap`: the mean of one autocorrelated series (a run's steps) and its moving-block bootstrap
  percentile interval (the mechanism study's δ, :mod:`stapo.study.mechanism_claims`).

Missing values are NaN and are left out everywhere (a step a run has not reached, a validation step, a metric a
method does not log).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as _scipy_stats

__all__ = ["Band", "t_band", "moving_average", "window_steps", "BootstrapCI", "paired_bootstrap", "Detectable",
           "detectable_effect", "BlockBootstrapCI", "block_bootstrap"]


@dataclass(frozen=True)
class Band:
    """What :func:`t_band` returns, one entry per column (step) of its input.

    Attributes:
        mean: [T] float64, the mean over the seeds that have a value (NaN where none has).
        half: [T] float64, the half-width ``t_{(1+c)/2, n−1} · s / √n``; NaN where n < 2 (no interval from one seed).
        n: [T] int64, the number of seeds with a value.
    """

    mean: np.ndarray
    half: np.ndarray
    n: np.ndarray

    @property
    def low(self) -> np.ndarray:
        return self.mean - self.half

    @property
    def high(self) -> np.ndarray:
        return self.mean + self.half


def t_band(values: np.ndarray, confidence: float = 0.95) -> Band:
    """Mean over seeds and the Student-t confidence half-width, per step.

    ``half = t_{(1+c)/2, n−1} · s / √n`` with ``s`` the sample standard deviation (ddof = 1) of the n seeds that
    have a value (NaN entries are left out), ``t`` from :func:`scipy.stats.t.ppf`. The interval assumes the
    seeds' values are independent draws of a normal variable (a t-interval; with few seeds it is wide, as it
    should be).

    Args:
        values: [S] (one step) or [S, T] float, seeds × steps; NaN = missing.
        confidence: the coverage c in (0, 1), e.g. 0.95.

    Returns:
        :class:`Band` with [T] arrays ([1] for a 1-D input). n = 0: mean and half NaN; n = 1: half NaN.

    Raises:
        ValueError: ``confidence`` not in (0, 1), or ``values`` not 1-D or 2-D.

    Example:
        ``t_band([1, 2, 3])``: mean 2, s = 1, t_{0.975, 2} = 4.3027 → half = 4.3027 / √3 = 2.4841.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 1:
        v = v[:, None]  # [S, 1]
    if v.ndim != 2:
        raise ValueError(f"values must be [seeds] or [seeds, steps], got shape {v.shape}")
    ok = ~np.isnan(v)  # [S, T]
    n = ok.sum(axis=0)  # [T]
    total = np.where(ok, v, 0.0).sum(axis=0)  # [T]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, total / np.maximum(n, 1), np.nan)  # [T]
        sq = np.where(ok, (v - mean[None, :]) ** 2, 0.0).sum(axis=0)  # [T]
        s = np.sqrt(sq / np.maximum(n - 1, 1))  # [T], ddof = 1
        t = _scipy_stats.t.ppf(0.5 + confidence / 2, np.maximum(n - 1, 1))  # [T]
        half = np.where(n >= 2, t * s / np.sqrt(np.maximum(n, 1)), np.nan)  # [T]
    return Band(mean=mean, half=half, n=n.astype(np.int64))


@dataclass(frozen=True)
class Detectable:
    """What :func:`detectable_effect` returns (units of the values; NaN with fewer than 2 replicates).

    Attributes:
        half: the t-interval's half-width ``t_{1−α/2, n−1} · s / √n``: a mean must be at least this far from the
            threshold for the interval to exclude it.
        mde: the effect (true mean − threshold) that the two-sided test at level α detects with probability
            ``power``: ``(t_{1−α/2, n−1} + t_{power, n−1}) · s / √n``.
        n: the replicates used; s: their sample standard deviation (ddof = 1).
    """

    half: float
    mde: float
    n: int
    s: float


def detectable_effect(values: np.ndarray, confidence: float = 0.95, power: float = 0.8) -> Detectable:
    """The smallest effects n replicates resolve, from their own spread (docs/study.md#claims, "Power").

    ``half = t_{(1+c)/2, n−1} · s/√n`` (the half-width of the t-interval the claims use, α = 1 − c two-sided) and
    ``mde = (t_{(1+c)/2, n−1} + t_{power, n−1}) · s/√n``, the usual approximation of the effect a two-sided
    one-sample t-test at level α detects with probability ``power`` (it leaves out the non-central t: by
    simulation the power at that effect is 0.77 for n = 3 and 0.73 for n = 2 at 80 % asked, so the true need is
    somewhat larger). s is the sample standard deviation (ddof = 1) of the non-NaN values; the true spread is
    unknown and s from 2–3 replicates is itself noisy, so read both as orders of magnitude.

    Args:
        values: [n] float, one value per replicate (NaN left out).
        confidence: c in (0, 1), e.g. 0.95 (two-sided α = 0.05).
        power: in (0, 1), e.g. 0.8.

    Returns:
        :class:`Detectable`; half and mde NaN when fewer than 2 values.

    Raises:
        ValueError: ``confidence`` or ``power`` not in (0, 1), or ``values`` not 1-D.

    Example:
        values 0.02, 0.04, 0.06 (n = 3, s = 0.02, s/√3 = 0.011547). With 2 degrees of freedom the t quantile is
        closed-form, t_{p, 2} = (2p − 1) / √(2p(1 − p)): t_{0.975, 2} = 0.95 / √0.04875 = 4.3027, t_{0.8, 2} =
        0.6 / √0.32 = 1.0607 → half = 0.049683, mde = 5.3633 · 0.011547 = 0.061930.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power}")
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"values must be [replicates], got shape {v.shape}")
    v = v[~np.isnan(v)]
    n = int(v.size)
    if n < 2:
        return Detectable(math.nan, math.nan, n, math.nan)
    s = float(np.std(v, ddof=1))
    se = s / math.sqrt(n)
    t_c = float(_scipy_stats.t.ppf(0.5 + confidence / 2, n - 1))
    t_p = float(_scipy_stats.t.ppf(power, n - 1))
    return Detectable(half=t_c * se, mde=(t_c + t_p) * se, n=n, s=s)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average of one run's curve: entry i is the mean of the non-NaN values among entries
    ``i−window+1 … i``; NaN stays NaN (a step the run did not log is not filled in). ``window`` = 1: unchanged.

    Args:
        values: [T] float, one value per step (NaN = not logged).
        window: ≥ 1 entries.

    Returns:
        [T] float64.

    Raises:
        ValueError: ``window`` < 1.
    """
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {window}")
    v = np.asarray(values, dtype=np.float64)  # [T]
    out = np.full_like(v, np.nan)
    for i in range(v.size):
        if math.isnan(v[i]):
            continue
        chunk = v[max(0, i - window + 1):i + 1]
        out[i] = np.nanmean(chunk)
    return out


def window_steps(steps: np.ndarray, values: np.ndarray, window: int, last_step: int | None = None) -> np.ndarray:
    """The steps of the final-value window: those within the last ``window`` training steps at which any run
    logged the metric; for a metric with no point there, its last logged step alone.

    The window is measured in training steps, not in logged points, so a sparse metric is not averaged back to
    the start of training: validation logged every 20 steps of a 60-step run with W = 10 has the window
    ``{60}``, not ``{20, 40, 60}``. Worked example: steps 1…6, a per-step metric, W = 3 → ``[4, 5, 6]``;
    validation at steps 2 and 4 only with ``last_step`` = 6: W = 3 → the window is 3 < t ≤ 6 → ``[4]``;
    W = 1 → nothing in 5 < t ≤ 6 → the last logged step, ``[4]``.

    Args:
        steps: [T] int, the step axis (increasing).
        values: [S, T] float, runs × steps, NaN = not logged.
        window: W ≥ 1, in training steps.
        last_step: the study's last training step (the window is ``last_step − W < t ≤ last_step``); default:
            the metric's own last logged step.

    Returns:
        The window's steps, increasing (empty only when the metric was never logged).

    Raises:
        ValueError: ``window`` < 1.
    """
    if window < 1:
        raise ValueError(f"final window must be >= 1, got {window}")
    logged_steps = np.asarray(steps)[~np.isnan(np.asarray(values, dtype=np.float64)).all(axis=0)]  # [T']
    if logged_steps.size == 0:
        return logged_steps
    last = int(logged_steps[-1]) if last_step is None else int(last_step)
    inside = logged_steps[(logged_steps > last - window) & (logged_steps <= last)]  # [≤ W]
    return inside if inside.size else logged_steps[-1:]


@dataclass(frozen=True)
class BootstrapCI:
    """What :func:`paired_bootstrap` returns.

    Attributes:
        mean: the point estimate: the mean over seeds of each seed's mean difference over its steps.
        low, high: the percentile interval's bounds (NaN when there are no pairs).
        n_seeds: seeds with at least one pair; n_pairs: (seed, step) pairs.
    """

    mean: float
    low: float
    high: float
    n_seeds: int
    n_pairs: int


def paired_bootstrap(diffs: np.ndarray, *, confidence: float = 0.95, n_boot: int = 10_000,
                     seed: int = 0) -> BootstrapCI:
    """Mean paired difference over (seed, step) pairs and its two-stage percentile bootstrap interval.

    ``diffs[s, t]`` is method − reference at seed s and step t (runs of one seed share the data order and the
    rollout seeds, so the two values of a pair saw the same prompts); NaN where either value is missing.
    The statistic is ``mean_s mean_t diffs[s, t]``: seeds weigh equally, whatever their number of steps.
    Each bootstrap replicate (1) draws S seeds with replacement from the S seeds that have pairs — the seeds are
    the independent replicates of the experiment, so they carry the run-to-run variance — and (2) for each drawn
    seed draws its T_s steps with replacement from that seed's own steps — the step-to-step noise within a run
    (steps of one run are autocorrelated, so this part is optimistic; with many seeds stage 1 dominates). The
    interval is the ``(1−c)/2`` and ``(1+c)/2`` quantiles of the replicates (``numpy.quantile``,
    ``method="inverted_cdf"``: each bound is one of the replicates' values). A fixed ``seed`` makes it exact to
    reproduce (:func:`numpy.random.default_rng`).

    Args:
        diffs: [S, T] (or [T]: one seed) float, NaN = no pair.
        confidence: coverage c in (0, 1).
        n_boot: bootstrap replicates (≥ 1).
        seed: the RNG seed.

    Returns:
        :class:`BootstrapCI`. No pairs: mean, low and high NaN. All differences equal to d: ``[d, d]``.

    Raises:
        ValueError: ``confidence`` not in (0, 1), ``n_boot`` < 1, or ``diffs`` not 1-D / 2-D.

    Example:
        one seed, steps with differences [0, 2]: a replicate's mean is 0, 1 or 2 (probabilities 1/4, 1/2, 1/4),
        so the 95 % interval of 10,000 replicates is [0, 2] around the estimate 1.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim == 1:
        d = d[None, :]  # [1, T]
    if d.ndim != 2:
        raise ValueError(f"diffs must be [seeds, steps] or [steps], got shape {d.shape}")
    per_seed = [row[~np.isnan(row)] for row in d]  # S × [T_s]
    per_seed = [row for row in per_seed if row.size]
    n_pairs = int(sum(row.size for row in per_seed))
    if not per_seed:
        return BootstrapCI(math.nan, math.nan, math.nan, 0, 0)
    estimate = float(np.mean([row.mean() for row in per_seed]))
    rng = np.random.default_rng(seed)
    n_seeds, width = len(per_seed), max(row.size for row in per_seed)
    padded = np.zeros((n_seeds, width))  # [S, W] each seed's differences, zero-padded
    for i, row in enumerate(per_seed):
        padded[i, :row.size] = row
    sizes = np.array([row.size for row in per_seed])  # [S] T_s
    picked = rng.integers(0, n_seeds, size=(n_boot, n_seeds))  # [n_boot, S] stage 1: seeds with replacement
    size = sizes[picked]  # [n_boot, S]
    # stage 2: T_s steps with replacement within each drawn seed: uniform index in [0, T_s) per slot
    idx = np.floor(rng.random((n_boot, n_seeds, width)) * size[..., None]).astype(np.int64)  # [n_boot, S, W]
    vals = padded[picked[..., None], idx]  # [n_boot, S, W]
    used = np.arange(width)[None, None, :] < size[..., None]  # [n_boot, S, W] the first T_s slots
    reps = (np.where(used, vals, 0.0).sum(axis=2) / size).mean(axis=1)  # [n_boot]
    alpha = 1 - confidence
    low, high = np.quantile(reps, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    return BootstrapCI(estimate, float(low), float(high), n_seeds, n_pairs)


@dataclass(frozen=True)
class BlockBootstrapCI:
    """What :func:`block_bootstrap` returns.

    Attributes:
        mean: the series' mean (NaN for an empty series).
        low, high: the percentile interval's bounds (NaN for an empty series).
        n: the series' length; block: the block length used (``min(block, n)``).
    """

    mean: float
    low: float
    high: float
    n: int
    block: int


def block_bootstrap(values: np.ndarray, *, block: int = 5, confidence: float = 0.95, n_boot: int = 10_000,
                    seed: int = 0) -> BlockBootstrapCI:
    """Mean of one autocorrelated series and its moving-block bootstrap percentile interval (Künsch 1989).

    The series x_0 … x_{n−1} (in step order) has the n − L + 1 overlapping blocks x_s … x_{s+L−1},
    s = 0 … n − L, with L = ``min(block, n)``. Each replicate draws k = ⌈n / L⌉ block starts uniformly with
    replacement (``numpy.random.default_rng(seed).integers(0, n − L + 1, size=(n_boot, k))``, one call, so the
    result is exact to reproduce), concatenates the k blocks, keeps the first n values and takes their mean. The
    interval is the ``(1−c)/2`` and ``(1+c)/2`` quantiles of the replicates (``numpy.quantile``,
    ``method="inverted_cdf"``: each bound is one replicate's value). Blocks keep the dependence between
    neighbouring steps that a plain bootstrap of single steps would break (which makes its interval too narrow).

    Args:
        values: [n] float, the series in step order (no NaN: leave missing steps out before).
        block: L ≥ 1, the block length in points.
        confidence: coverage c in (0, 1).
        n_boot: replicates (≥ 1).
        seed: the RNG seed.

    Returns:
        :class:`BlockBootstrapCI`. An empty series: NaN mean and bounds. A constant series c: ``[c, c]``.
        n ≤ L: one block, the whole series, so the interval has zero width at the mean (said by ``block == n``).

    Raises:
        ValueError: ``block`` < 1, ``n_boot`` < 1, ``confidence`` not in (0, 1), ``values`` not 1-D or with NaN.

    Example:
        x = [0, 0, 0, 0, 0, 10], L = 5: blocks start at 0 (all zeros) or 1 (four zeros and the 10), k = 2 blocks,
        the first 6 values kept; a replicate's mean is 0 (both starts 0), 10/6 (one start 1 and, if it is the
        first, the 10 is kept: (0,1) → [0,0,0,0,0 | 0] = 0, (1,0) → [0,0,0,0,10 | 0] = 10/6, (1,1) → 10/6);
        so the replicates are 0 or 10/6 and the interval is [0, 10/6] around the mean 10/6.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {x.shape}")
    if np.isnan(x).any():
        raise ValueError("values contain NaN: leave the missing steps out before the bootstrap")
    n = x.size
    if n == 0:
        return BlockBootstrapCI(math.nan, math.nan, math.nan, 0, 0)
    size = min(block, n)
    k = -(-n // size)  # ⌈n / L⌉
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n - size + 1, size=(n_boot, k))  # [n_boot, k]
    idx = (starts[:, :, None] + np.arange(size)[None, None, :]).reshape(n_boot, k * size)[:, :n]  # [n_boot, n]
    reps = x[idx].mean(axis=1)  # [n_boot]
    alpha = 1 - confidence
    low, high = np.quantile(reps, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    return BlockBootstrapCI(float(x.mean()), float(low), float(high), int(n), int(size))

