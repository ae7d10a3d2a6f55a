"""stapo/study/stats.py against values worked out by hand on small inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from stapo.study.stats import detectable_effect, moving_average, paired_bootstrap, t_band, window_steps

nan = math.nan


def test_t_band_three_seeds():
    # [1, 2, 3]: mean 2, s = sqrt(((1-2)² + 0 + (3-2)²) / 2) = 1, t_{0.975, 2} = 4.302653 → half = 4.302653 / √3
    b = t_band(np.array([1.0, 2.0, 3.0]))
    assert b.mean[0] == pytest.approx(2.0)
    assert b.half[0] == pytest.approx(4.302653 / math.sqrt(3), abs=1e-5)  # 2.48414
    assert b.half[0] == pytest.approx(2.4841, abs=1e-4)
    assert (b.low[0], b.high[0]) == pytest.approx((2 - 2.48414, 2 + 2.48414), abs=1e-4)
    assert b.n[0] == 3


def test_t_band_per_step_with_missing_values_and_one_seed():
    # step 1: seeds 1 and 3 → mean 2, s = √2, t_{0.975, 1} = 12.7062 → half = 12.7062 · √2 / √2 = 12.7062
    # step 2: only the second seed has a value (5) → mean 5, no interval (NaN)
    # step 3: nobody → mean NaN, n = 0
    b = t_band(np.array([[1.0, nan, nan], [3.0, 5.0, nan]]))
    assert b.mean[0] == pytest.approx(2.0) and b.half[0] == pytest.approx(12.7062, abs=1e-4)
    assert b.mean[1] == 5.0 and math.isnan(b.half[1]) and b.n[1] == 1
    assert math.isnan(b.mean[2]) and math.isnan(b.half[2]) and b.n[2] == 0


def test_t_band_confidence_changes_the_quantile():
    # [0, 2]: s = √2, n = 2; 90 %: t_{0.95, 1} = 6.313752 → half = 6.313752 · √2 / √2 = 6.313752
    assert t_band(np.array([0.0, 2.0]), confidence=0.90).half[0] == pytest.approx(6.313752, abs=1e-5)
    with pytest.raises(ValueError, match="confidence"):
        t_band(np.array([1.0, 2.0]), confidence=1.0)


def test_moving_average_trailing_and_nan():
    # window 2: [1, (1+3)/2, (3+5)/2]; a NaN entry stays NaN and is left out of its neighbour's mean
    assert moving_average(np.array([1.0, 3.0, 5.0]), 2) == pytest.approx([1.0, 2.0, 4.0])
    out = moving_average(np.array([1.0, nan, 3.0, 5.0]), 2)
    assert math.isnan(out[1]) and out[0] == 1.0 and out[2] == 3.0 and out[3] == 4.0
    assert moving_average(np.array([1.0, 7.0]), 1) == pytest.approx([1.0, 7.0])


def test_window_steps_dense_and_sparse():
    steps = np.arange(1, 7)
    dense = np.arange(12, dtype=float).reshape(2, 6)
    assert window_steps(steps, dense, 3).tolist() == [4, 5, 6]
    sparse = np.full((2, 6), nan)
    sparse[0, [1, 3]] = 1.0  # run 0 validated at steps 2 and 4
    sparse[1, 5] = 1.0  # run 1 at step 6
    # the window is W training steps, not W logged points: 6 − 2 < t ≤ 6 → step 4 is out, step 6 in
    assert window_steps(steps, sparse, 2).tolist() == [6]
    assert window_steps(steps, sparse, 3).tolist() == [4, 6]  # 3 < t ≤ 6
    assert window_steps(steps, np.full((1, 6), nan), 2).size == 0


def test_window_steps_sparse_metric_uses_the_study_last_step():
    # validation logged every 20 steps of a 60-step study, W = 10: only step 60 (was 20, 40, 60 when counting points)
    steps = np.arange(1, 61)
    val = np.full((2, 60), nan)
    val[:, [19, 39, 59]] = 0.5
    assert window_steps(steps, val, 10, last_step=60).tolist() == [60]
    # validation at steps 2 and 4 only, the study ran to step 6: W = 3 → 3 < t ≤ 6 → [4];
    # W = 1 → nothing in 5 < t ≤ 6 → the last logged step alone, [4] (a sparse metric always has a final value)
    short = np.full((1, 6), nan)
    short[0, [1, 3]] = 1.0
    assert window_steps(np.arange(1, 7), short, 3, last_step=6).tolist() == [4]
    assert window_steps(np.arange(1, 7), short, 1, last_step=6).tolist() == [4]


def test_bootstrap_all_differences_equal_collapses():
    # every pair differs by 0.5: every replicate's mean is 0.5
    ci = paired_bootstrap(np.full((3, 4), 0.5), n_boot=500, seed=1)
    assert (ci.mean, ci.low, ci.high) == (0.5, 0.5, 0.5)
    assert (ci.n_seeds, ci.n_pairs) == (3, 12)


def test_bootstrap_two_pairs_reachable_means():
    # one seed, steps with differences 0 and 2: a replicate draws 2 steps with replacement → mean 0 (1/4),
    # 1 (1/2) or 2 (1/4); with 10,000 replicates the 2.5 % and 97.5 % quantiles are 0 and 2, the estimate 1.
    ci = paired_bootstrap(np.array([0.0, 2.0]), n_boot=10_000, seed=0)
    assert ci.mean == 1.0
    assert (ci.low, ci.high) == (0.0, 2.0)
    # a 40 % interval lies inside the middle value's mass (30 % … 70 % of the replicates are 1): [1, 1]
    ci40 = paired_bootstrap(np.array([0.0, 2.0]), n_boot=10_000, seed=0, confidence=0.4)
    assert (ci40.low, ci40.high) == (1.0, 1.0)


def test_bootstrap_two_seeds_one_step_each():
    # seeds with one pair each (differences 1 and 3): stage 1 draws 2 seeds → means 1, 2 or 3 only
    ci = paired_bootstrap(np.array([[1.0], [3.0]]), n_boot=2_000, seed=3)
    assert ci.mean == 2.0
    assert ci.low in (1.0, 2.0, 3.0) and ci.high in (1.0, 2.0, 3.0)
    assert (ci.low, ci.high) == (1.0, 3.0)  # mean 1 and mean 3 have probability 1/4 each (> 2.5 %)


def test_bootstrap_missing_pairs_and_seed_weighting():
    # seed 0: differences 1, 2 (mean 1.5); seed 1: only step 1 has a pair (3). The estimate weighs seeds
    # equally: (1.5 + 3) / 2 = 2.25 (not the mean of the 3 pairs, 2).
    ci = paired_bootstrap(np.array([[1.0, 2.0, nan], [3.0, nan, nan]]), n_boot=2_000, seed=0)
    assert ci.mean == pytest.approx(2.25) and (ci.n_seeds, ci.n_pairs) == (2, 3)
    # every reachable replicate mean is (a + b) / 2 with a, b ∈ {1, 1.5, 2, 3} (a seed's resampled mean)
    reachable = {(a + b) / 2 for a in (1, 1.5, 2, 3) for b in (1, 1.5, 2, 3)}
    assert ci.low in reachable and ci.high in reachable and ci.low <= ci.mean <= ci.high
    # same seed, same interval (reproducible)
    assert paired_bootstrap(np.array([[1.0, 2.0, nan], [3.0, nan, nan]]), n_boot=2_000, seed=0) == ci


def test_bootstrap_no_pairs():
    ci = paired_bootstrap(np.full((2, 3), nan))
    assert math.isnan(ci.mean) and math.isnan(ci.low) and math.isnan(ci.high) and ci.n_pairs == 0
    with pytest.raises(ValueError, match="n_boot"):
        paired_bootstrap(np.zeros(2), n_boot=0)


def test_detectable_effect_by_hand():
    # 0.02, 0.04, 0.06: s = 0.02, s/√3 = 0.0115470. With 2 degrees of freedom t_{p,2} = (2p − 1) / √(2p(1 − p)):
    # t_{0.975,2} = 0.95 / √0.04875 = 4.302653, t_{0.8,2} = 0.6 / √0.32 = 1.060660
    # half = 4.302653 · 0.0115470 = 0.0496827; mde = (4.302653 + 1.060660) · 0.0115470 = 0.0619302
    d = detectable_effect(np.array([0.02, 0.04, 0.06]))
    assert (d.n, d.s) == (3, pytest.approx(0.02))
    assert d.half == pytest.approx(0.0496827, abs=1e-7) and d.mde == pytest.approx(0.0619302, abs=1e-7)
    # 2 seeds 1 and 3: s = √2, s/√2 = 1; t_{0.975,1} = tan(π · 0.475) = 12.706205, t_{0.8,1} = tan(π · 0.3) = 1.376382
    two = detectable_effect(np.array([1.0, 3.0, nan]))  # NaN left out
    assert two.n == 2 and two.half == pytest.approx(12.706205, abs=1e-5)
    assert two.mde == pytest.approx(12.706205 + 1.376382, abs=1e-5)
    one = detectable_effect(np.array([5.0]))
    assert one.n == 1 and math.isnan(one.half) and math.isnan(one.mde)
    with pytest.raises(ValueError, match="power"):
        detectable_effect(np.zeros(3), power=1.0)
