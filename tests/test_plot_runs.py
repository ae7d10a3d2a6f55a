"""scripts/plot_runs.py: run folders grouped by their W&B group (else objective), curves over seeds, a PNG written;
stapo/common/plotting.py's physical ranges and the band clipping (shared with the study report)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from stapo.common.plotting import draw_seed_curves, physical_range

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plot_runs", REPO / "scripts" / "plot_runs.py")
plot_runs = importlib.util.module_from_spec(_spec)
sys.modules["plot_runs"] = plot_runs  # dataclasses look their module up
_spec.loader.exec_module(plot_runs)


def _run(root: Path, name: str, objective: str, seed: int, rows: list[dict], group: str | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    logging = {"group": group, "method": group.split("-")[-1]} if group else {"group": None}
    cfg = {"algorithm": {"objective": objective}, "trainer": {"seed": seed}, "logging": logging}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_grouping_by_recorded_group_else_objective(tmp_path):
    a0 = _run(tmp_path, "a0", "stapo", 0, [{"step": 1, "actor/entropy": 1.0}], group="cpu-stapo")
    a1 = _run(tmp_path, "a1", "stapo", 1, [{"step": 1, "actor/entropy": 1.2}], group="cpu-stapo")
    b0 = _run(tmp_path, "b0", "grpo", 0, [{"step": 1, "actor/entropy": 0.8}], group="cpu-grpo")
    old = _run(tmp_path, "old", "grpo", 2, [{"step": 1, "actor/entropy": 0.9}])  # no group recorded: objective
    # a run from before groups were per method: its group (the study) is shared by all methods: the objective
    study = _run(tmp_path, "study", "grpo", 3, [{"step": 1, "actor/entropy": 0.7}])
    cfg = json.loads((study / "config.json").read_text())
    cfg["logging"] = {"group": "cpu_reproduction"}
    (study / "config.json").write_text(json.dumps(cfg))
    groups = plot_runs.group_runs([a1, b0, a0, old, study])
    assert list(groups) == ["cpu-stapo", "cpu-grpo", "grpo"]  # order of first appearance
    assert [r.seed for r in groups["grpo"]] == [2, 3]
    assert [(r.seed, r.path) for r in groups["cpu-stapo"]] == [(0, a0), (1, a1)]  # by seed
    assert plot_runs.group_runs([a0, b0, old], by="objective").keys() == {"stapo", "grpo"}
    assert [r.path for r in plot_runs.group_runs([a0, b0, old], by="objective")["grpo"]] == [b0, old]
    with pytest.raises(plot_runs.PlotError, match="no config.json"):
        plot_runs.group_runs([tmp_path / "missing"])


def test_two_run_folders_give_a_png_and_the_seed_matrix(tmp_path, capsys):
    # seed 0 logs steps 1-3 with the S2T mask, seed 1 steps 1-2 and resumed step 2 (the later row wins)
    s0 = _run(tmp_path, "s0", "stapo", 0, [
        {"step": 1, "critic/score/mean": -0.5, "actor/entropy": 1.5, "actor/s2t/masked_frac": 0.01},
        {"step": 2, "critic/score/mean": 0.0, "actor/entropy": 1.2, "actor/s2t/masked_frac": 0.02},
        {"step": 3, "critic/score/mean": 0.5, "actor/entropy": 1.0, "actor/s2t/masked_frac": 0.00}])
    s1 = _run(tmp_path, "s1", "stapo", 1, [
        {"step": 1, "critic/score/mean": -1.0, "actor/entropy": 1.7, "actor/s2t/masked_frac": 0.03},
        {"step": 2, "critic/score/mean": 9.9, "actor/entropy": 9.9},
        {"step": 2, "critic/score/mean": -0.5, "actor/entropy": 1.4, "actor/s2t/masked_frac": 0.01}])
    groups = plot_runs.group_runs([s0, s1])
    series = plot_runs.collect(groups, ["critic/score/mean", "actor/*/masked_frac", "no/such_key"])
    assert set(series) == {"critic/score/mean", "actor/*/masked_frac"}  # a metric no run logs: no panel
    steps, values, keys = series["critic/score/mean"]["stapo"]
    assert steps.tolist() == [1, 2, 3] and keys == ["critic/score/mean"]
    np.testing.assert_array_equal(values, [[-0.5, 0.0, 0.5], [-1.0, -0.5, np.nan]])
    assert series["actor/*/masked_frac"]["stapo"][2] == ["actor/s2t/masked_frac"]  # the pattern's key
    out = tmp_path / "plots" / "runs.png"
    assert plot_runs.main([str(s0), str(s1), "--out", str(out), "--metrics", "critic/score/mean",
                           "actor/entropy"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "stapo: 2 run(s), seeds 0, 1" in capsys.readouterr().out
    assert plot_runs.main([str(s0), "--out", str(out), "--metrics", "nope"]) == 2  # nothing to draw: one line
    # a copy of seed 0 (a rerun in another folder) is drawn as its own seed, and said so
    again = _run(tmp_path, "s0_again", "stapo", 0, [{"step": 1, "critic/score/mean": 0.0}])
    capsys.readouterr()
    assert plot_runs.main([str(s0), str(again), "--out", str(out), "--metrics", "critic/score/mean"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"stapo has trainer.seed=0 in 2 runs ({s0}, {again})" in err


def test_a_folder_named_twice_is_one_run_and_an_unwritable_out_is_one_line(tmp_path, capsys):
    """`plot_runs.py runs/stapo_* runs/stapo_seed0` (overlapping patterns) names seed 0 twice: one run, seeds 0, 1
    (not 0, 0, 1 with a repeated-seed warning). A --out that cannot be written: exit 2 and one line."""
    s0 = _run(tmp_path, "s0", "stapo", 0, [{"step": 1, "critic/score/mean": 0.5}])
    s1 = _run(tmp_path, "s1", "stapo", 1, [{"step": 1, "critic/score/mean": -0.5}])
    groups = plot_runs.group_runs([s0, s1, s0, f"{s0}/"])
    assert [(r.seed, r.path) for r in groups["stapo"]] == [(0, s0), (1, s1)]
    out = tmp_path / "runs.png"
    assert plot_runs.main([str(s0), str(s1), str(s0), "--out", str(out), "--metrics", "critic/score/mean"]) == 0
    got = capsys.readouterr()
    assert got.err == "" and "stapo: 2 run(s), seeds 0, 1" in got.out
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # --out under a file: its folder cannot be made
    assert plot_runs.main([str(s0), "--out", str(blocker / "runs.png"), "--metrics", "critic/score/mean"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"plot_runs.py: cannot write {blocker / 'runs.png'}: ")


def test_a_20_entropy_run_gets_its_kept_fraction_panel_by_default(tmp_path):
    """20-Entropy logs actor/top_entropy/kept_frac (no masked_frac): the default panels include it, as the W&B
    workspace's mask panel does; a run without it (GRPO) gives no such panel."""
    e0 = _run(tmp_path, "e0", "entropy20", 0, [{"step": 1, "actor/top_entropy/kept_frac": 0.2}])
    series = plot_runs.collect(plot_runs.group_runs([e0]), plot_runs.DEFAULT_METRICS)
    assert list(series) == ["actor/*/kept_frac"] and series["actor/*/kept_frac"]["entropy20"][2] == [
        "actor/top_entropy/kept_frac"]
    g0 = _run(tmp_path, "g0", "grpo", 0, [{"step": 1, "critic/score/mean": 0.0}])
    assert list(plot_runs.collect(plot_runs.group_runs([g0]), plot_runs.DEFAULT_METRICS)) == ["critic/score/mean"]


def test_physical_ranges_and_the_clipped_band():
    assert physical_range("actor/entropy") == (0.0, None)
    assert physical_range("actor/s2t/masked_frac") == (0.0, 1.0)
    assert physical_range("val-core/math500/acc/mean@4") == (0.0, 1.0)
    assert physical_range("reward/grader/accuracy") == (0.0, 1.0)
    assert physical_range("response_length/mean") == (0.0, None)
    assert physical_range("critic/score/mean") == (None, None)  # a reward may be negative
    calls = {}

    class Ax:  # records what draw_seed_curves asks matplotlib for
        def plot(self, x, y, **kw):
            calls.setdefault("plot", []).append((list(x), list(y)))

        def fill_between(self, x, lo, hi, **kw):
            calls["band"] = (list(lo), list(hi))

    # two seeds; step 2 has values beyond [0, 1] (e.g. a smoothing overshoot): the band is cut at the bounds;
    # step 3 has no value at all and is left out
    values = np.array([[0.2, -0.1, np.nan], [0.4, 1.3, np.nan]])
    assert draw_seed_curves(Ax(), np.array([1, 2, 3]), values, "C0", "x", clip=(0.0, 1.0))
    assert calls["band"] == ([0.2, 0.0], [0.4, 1.0])
    assert calls["plot"][-1] == ([1, 2], [pytest.approx(0.3), pytest.approx(0.6)])  # the mean, unclipped
    assert not draw_seed_curves(Ax(), np.array([1]), np.array([[np.nan]]), "C0", "x")
