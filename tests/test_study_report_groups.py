"""The study report's S2T-rule token split, clip counts, entropy–length fit and panels (stapo/study/report.py), by hand
on small hand-written rows."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from stapo.config import ConfigError
from stapo.study import load_study_config
from stapo.study.report import Series, _clip_counts, _length_rows, _plot, _pooled_groups

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "study" / "tiny_test.yaml"


def _step(step, n, cand, masked, **quadrants):
    row = {"step": step, "s2t/quadrant/num_tokens": n, "s2t/would_mask/num_candidates": cand,
           "s2t/would_mask/num_masked": masked}
    for q, (count, grad, dh) in quadrants.items():
        row.update({f"s2t/quadrant/{q}/count": count, f"s2t/quadrant/{q}/grad_norm": grad,
                    f"s2t/quadrant/{q}/entropy_change": dh})
    return row


def test_s2t_groups_by_hand():
    # step 1: 100 Â > 0 tokens, 6 candidates (low_p_high_h 4 with ‖∇‖ 1.0, ΔH 0.01; low_p_low_h 2 with ‖∇‖ 2.0,
    # ΔH 0.04), 4 of them silenced; high_p_high_h 60 (‖∇‖ 0.5, ΔH −0.2), high_p_low_h 34 (‖∇‖ 0.1, ΔH −0.1)
    # step 2: 50 tokens, no candidate; high_p_high_h 50 (‖∇‖ 0.3, ΔH −0.1)
    rows = [_step(1, 100.0, 6.0, 4.0, low_p_high_h=(4.0, 1.0, 0.01), low_p_low_h=(2.0, 2.0, 0.04),
                  high_p_high_h=(60.0, 0.5, -0.2), high_p_low_h=(34.0, 0.1, -0.1)),
            _step(2, 50.0, 0.0, 0.0, low_p_high_h=(0.0, math.nan, math.nan), low_p_low_h=(0.0, math.nan, math.nan),
                  high_p_high_h=(50.0, 0.3, -0.1), high_p_low_h=(0.0, math.nan, math.nan))]
    g = _pooled_groups(rows)
    # shares of 150 tokens: silenced 4/150, kept 2/150, candidates 6/150, non-candidates 144/150
    assert g["silenced"][0] == pytest.approx(4 / 150) and g["silenced"][3] == 4.0
    assert g["kept candidates"][0] == pytest.approx(2 / 150) and g["kept candidates"][3] == 2.0
    assert math.isnan(g["silenced"][1]) and math.isnan(g["kept candidates"][2])  # not logged: never made up
    # candidates: ‖∇‖ (4·1 + 2·2) / 6 = 1.3333, ΔH (4·0.01 + 2·0.04) / 6 = 0.02
    assert g["candidates (silenced + kept)"][1:] == pytest.approx((8 / 6, 0.02, 6.0))
    # non-candidates: ‖∇‖ (60·0.5 + 34·0.1 + 50·0.3) / 144 = 48.4 / 144; ΔH (−12 − 3.4 − 5) / 144 = −20.4 / 144
    assert g["non-candidates"] == pytest.approx((144 / 150, 48.4 / 144, -20.4 / 144, 144.0))
    assert _pooled_groups([{"step": 1, "s2t/quadrant/num_tokens": 3.0}]) is None  # older logs: no split


def test_clip_counts_by_hand():
    rows = {"a": [{"step": 0}, {"step": 1, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": -1e-9},
                  {"step": 2, "actor/pg_clipfrac": 0.25, "actor/ppo_kl": 0.0}],
            "b": [{"step": 1, "actor/pg_clipfrac": 0.0}]}
    specs = [SimpleNamespace(name="a"), SimpleNamespace(name="b")]
    # pg_clipfrac logged at 3 training steps, > 0 at one; |ppo_kl| > 0 at one of 2; the step-0 row is not training
    assert _clip_counts(specs, rows) == {"actor/pg_clipfrac": (3, 1), "actor/ppo_kl": (2, 1)}


def test_length_adjusted_entropy_by_hand():
    # reference a: (length, entropy) (10, 1), (20, 2); b: (10, 2), (20, 3), same seed. Pooled: x̄ = 15, ȳ = 2,
    # Σdx·dy = 5 + 0 + 0 + 5 = 10, Σdx² = 100, Σdy² = 2 → b = 0.1, a = 2 − 0.1·15 = 0.5, r = 10 / √200 = 0.70711
    # residuals: a −0.5, −0.5; b +0.5, +0.5 → Δ(b − a) = 1.0 over all steps and over the last step (window 1)
    cfg = SimpleNamespace(report=SimpleNamespace(window=1), reference="a")
    specs = [SimpleNamespace(name="a0", method="a", seed=0), SimpleNamespace(name="b0", method="b", seed=0)]
    row = lambda t, x, y: {"step": t, "response_length/mean": x, "actor/entropy": y}  # noqa: E731
    rows = {"a0": [{"step": 0}, row(1, 10.0, 1.0), row(2, 20.0, 2.0)], "b0": [row(1, 10.0, 2.0), row(2, 20.0, 3.0)]}
    fit, out = _length_rows(cfg, specs, rows)
    assert fit == pytest.approx({"r": 0.7071068, "a": 0.5, "b": 0.1, "points": 4})
    a, b = out
    assert (a["resid_all"], a["resid_final"]) == pytest.approx((-0.5, -0.5)) and math.isnan(a["diff_all"])
    assert (b["diff_all"], b["diff_final"]) == pytest.approx((1.0, 1.0))
    flat = {"a0": [row(1, 10.0, 1.0), row(2, 10.0, 2.0)], "b0": []}  # no spread in length: no fit, no rows
    assert _length_rows(cfg, specs, flat)[1] == [] and math.isnan(_length_rows(cfg, specs, flat)[0]["r"])


def test_panels_are_checked_and_drawn(tmp_path):
    with pytest.raises(ConfigError, match="report.panels"):
        load_study_config(TINY, [f"output_dir={tmp_path}", "report.panels=[[stapo, nope]]"])
    cfg = load_study_config(TINY, [f"output_dir={tmp_path}", "report.panels=[[stapo, grpo], [stapo]]"])
    assert cfg.report.panels == [["stapo", "grpo"], ["stapo"]]
    # one metric, two comparisons → two panels; a seed's NaN step is skipped, not drawn as 0
    values = np.array([[np.nan, 1.0, 0.5], [np.nan, 2.0, np.nan]])  # [2 seeds, steps 0–2]
    s = Series("entropy", ["actor/entropy"], [0, 1], np.arange(3), values)
    assert _plot(tmp_path / "c.png", cfg, {"entropy": {"stapo": s, "grpo": s}})
    assert (tmp_path / "c.png").stat().st_size > 0
    assert not _plot(tmp_path / "d.png", cfg, {}) and not (tmp_path / "d.png").exists()  # nothing to draw
