"""The mechanism study's pre-registered rules (stapo/study/mechanism_claims.py, docs/study.md "Mechanism study
(issue 32)") and the moving-block bootstrap (stapo/study/stats.py::block_bootstrap), on small series worked by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from stapo.study.stats import block_bootstrap


# ---------------------------------------------------------------- block bootstrap

def test_block_bootstrap_constant_series_has_zero_width_interval():
    # every block of a constant series is that constant → every replicate's mean is 0.25
    ci = block_bootstrap(np.full(12, 0.25), block=5, n_boot=1000, seed=0)
    assert (ci.mean, ci.low, ci.high, ci.n, ci.block) == (0.25, 0.25, 0.25, 12, 5)


def test_block_bootstrap_two_outcomes_by_hand():
    # x = [0,0,0,0,0,10], L = 5: starts 0 or 1, k = 2 blocks, first 6 values kept.
    # (0,0) → zeros, (0,1) → [0]*5 + [0] = 0, (1,0) and (1,1) → [0,0,0,0,10,0] = 10/6: replicates 0 or 10/6,
    # each with probability 1/2, so the 2.5 % and 97.5 % quantiles are 0 and 10/6; the mean is 10/6.
    ci = block_bootstrap([0, 0, 0, 0, 0, 10], block=5, n_boot=10_000, seed=0)
    assert ci.mean == pytest.approx(10 / 6)
    assert ci.low == 0.0 and ci.high == pytest.approx(10 / 6)


def test_block_bootstrap_is_deterministic_with_its_seed_and_follows_the_rng_draws():
    x = np.array([0.3, -0.1, 0.4, 0.0, -0.2, 0.5, 0.1, -0.3, 0.2, 0.6, -0.4, 0.05])
    a = block_bootstrap(x, block=5, n_boot=200, seed=0)
    assert a == block_bootstrap(x, block=5, n_boot=200, seed=0)
    # the replicates by hand from the same generator calls: n = 12, L = 5, k = 3 starts in [0, 8) each
    starts = np.random.default_rng(0).integers(0, 8, size=(200, 3))
    reps = [np.concatenate([x[s:s + 5] for s in row])[:12].mean() for row in starts]
    low, high = np.quantile(reps, [0.025, 0.975], method="inverted_cdf")
    assert (a.low, a.high) == (pytest.approx(low), pytest.approx(high))
    assert a.low != block_bootstrap(x, block=5, n_boot=200, seed=1).low or a.high != block_bootstrap(
        x, block=5, n_boot=200, seed=1).high


def test_block_bootstrap_short_and_empty_series():
    ci = block_bootstrap([1.0, 3.0], block=5)  # n ≤ L: one block, the whole series → [2, 2]
    assert (ci.low, ci.high, ci.block) == (2.0, 2.0, 2)
    assert math.isnan(block_bootstrap([], block=5).mean)
    with pytest.raises(ValueError, match="NaN"):
        block_bootstrap([1.0, math.nan])
