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


# ---------------------------------------------------------------- helpers

from stapo.study import mechanism_claims as mc  # noqa: E402

EPYC = "AMD EPYC 7B13 64-Core Processor, 2 cores, flags avx2 fma, torch 2.13.0+cpu, 2 threads"
XEON = ("Intel(R) Xeon(R) Processor, 2 cores, flags avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16, "
        "torch 2.13.0+cpu, 2 threads")


def _rows(key: str, values, start: int = 1) -> list[dict]:
    return [{"step": start + i, key: v} for i, v in enumerate(values)]


def _write_run(folder, rows, *, objective="justrl", total_steps=None, machines=(EPYC,), dtype="float32"):
    """A run folder as train.py leaves it: metrics.jsonl, config.json, run_info.json (one launch per machine line,
    at start steps 0, 10, 20, ...), fingerprint.json (the last launch's kind and the dtype)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in r.items()}) + "\n")
    total = total_steps if total_steps is not None else max([r["step"] for r in rows] or [0])
    (folder / "config.json").write_text(json.dumps({"algorithm": {"objective": objective},
                                                    "trainer": {"total_steps": total},
                                                    "model": {"compute_dtype": dtype}}))
    launches = [{"start_step": 10 * i, "machine": m} for i, m in enumerate(machines)]
    (folder / "run_info.json").write_text(json.dumps({"launches": launches}))
    (folder / "fingerprint.json").write_text(json.dumps({"machine": mc.kind_from_machine_line(machines[-1]),
                                                         "compute_dtype": dtype}))
    return folder


# ---------------------------------------------------------------- Gate A

CAL = [  # level, accuracy, boxed, mean length, n
    {"level": 2, "accuracy": 0.60, "boxed_rate": 0.95, "mean_length": 90.0, "n": 512},
    {"level": 3, "accuracy": 0.30, "boxed_rate": 0.90, "mean_length": 120.0, "n": 512},
    {"level": 4, "accuracy": 0.10, "boxed_rate": 0.80, "mean_length": 150.0, "n": 512},
    {"level": 12, "accuracy": 0.20, "boxed_rate": 0.90, "mean_length": 140.0, "n": 512},
]


def test_gate_a_picks_the_admissible_mix_closest_to_the_target_accuracy():
    # eligible (≥ 0.15): 2, 3, 12 (level 4 at 0.10 is out). Pooled accuracies (unweighted means): {2} .60, {3} .30,
    # {12} .20, {2,3} .45, {2,12} .40, {3,12} .25, {2,3,12} .3667. Admissible (acc in [.25,.50], boxed ≥ .85,
    # length 80-160): {3}, {2,3}, {2,12}, {3,12}, {2,3,12}; closest to .35: {2,3,12} (|.0167|), then {3} (.05).
    res = mc.gate_a(CAL)
    assert res["passed"] and res["eligible"] == [2, 3, 12]
    assert res["mix"] == [2, 3, 12] and res["rule"] == "all criteria" and res["unmet"] == []
    assert res["pooled"]["accuracy"] == pytest.approx(1.1 / 3)
    assert res["pooled"]["boxed_rate"] == pytest.approx(2.75 / 3)
    assert res["pooled"]["mean_length"] == pytest.approx(350 / 3)


def test_gate_a_fallback_names_the_unmet_criteria_and_fails_below_15_percent():
    long = [dict(r, mean_length=200.0) for r in CAL]
    # no mix has a mean length in 80-160 → among eligible {2, 3, 12}: pooled accuracy closest to .35:
    # {2,12} .40 and {2,3,12} .3667 → {2,3,12} (|.0167|)
    res = mc.gate_a(long)
    assert res["mix"] == [2, 3, 12] and res["rule"].startswith("fallback")
    assert res["unmet"] == ["pooled mean length 200.0 outside [80, 160] tokens"]
    low = [dict(r, accuracy=0.14) for r in CAL]
    res = mc.gate_a(low)
    assert not res["passed"] and res["mix"] == [] and res["eligible"] == []


def test_read_calibration_csv_and_json(tmp_path):
    import json

    p = tmp_path / "cal.csv"
    p.write_text("level,accuracy,boxed_rate,mean_length,n,extra\n3,0.3,0.9,120,512,x\n")
    assert mc.read_calibration(p) == [{"level": 3, "accuracy": 0.3, "boxed_rate": 0.9, "mean_length": 120.0,
                                       "n": 512.0}]
    q = tmp_path / "cal.json"
    q.write_text(json.dumps({"rows": CAL}))
    assert [r["level"] for r in mc.read_calibration(q)] == [2, 3, 4, 12]
    q.write_text(json.dumps([{"level": 3}]))
    with pytest.raises(mc.MechanismClaimsError, match="accuracy"):
        mc.read_calibration(q)


# ---------------------------------------------------------------- Gate B

def test_rise_of_exactly_20_steps_passes_and_19_fails():
    # running minimum 0.5 at step 2; 1.2 × 0.5 = 0.6 (exact in binary floating point: 0.5 is a power of two)
    passes = [1.0, 0.5] + [0.6] * 20  # steps 3-22: 20 points ≥ 0.6
    r = mc.rise(*mc.series(_rows("x", passes), "x"))
    assert (r["rises"], r["t0"], r["min_step"], r["min_value"], r["longest"]) == (True, 3, 2, 0.5, 20)
    assert r["max_ratio"] == pytest.approx(1.2) and r["max_ratio_step"] == 3
    fails = [1.0, 0.5] + [0.6] * 19 + [0.59]  # step 22 drops below 0.6: 19 points
    r = mc.rise(*mc.series(_rows("x", fails), "x"))
    assert (r["rises"], r["t0"], r["longest"]) == (False, None, 19)


def test_rise_uses_the_running_minimum_up_to_t0_only():
    # a later, lower value does not undo an earlier rise: the minimum is over steps ≤ t0
    r = mc.rise(*mc.series(_rows("x", [0.5] + [0.6] * 20 + [0.1]), "x"))
    assert (r["rises"], r["t0"], r["min_step"]) == (True, 2, 1)
    # 0.6 after a start at 1.0 is no rise (0.6 < 1.2 × 1.0, then 0.6 < 1.2 × 0.6); after a new minimum 0.5 at
    # step 6 the 0.6s rise from step 7, and the minimum before the rise is step 6
    vals = [1.0] + [0.6] * 4 + [0.5] + [0.6] * 20
    r = mc.rise(*mc.series(_rows("x", vals), "x"))
    assert (r["rises"], r["t0"], r["min_step"], r["min_value"]) == (True, 7, 6, 0.5)
    # a NaN inside the window breaks it
    r = mc.rise(*mc.series(_rows("x", [0.5] + [0.6] * 10 + [math.nan] + [0.6] * 10), "x"))
    assert not r["rises"] and r["longest"] == 10


def test_gate_b_first_k_smoothed_and_the_fork_checkpoint():
    # no probe/entropy; first-K: five steps at 1.0 then 2.0. Trailing mean of 5: steps 1-5 → 1.0, step 6 → 6/5 =
    # 1.2 = 1.2 × 1.0 (the running minimum), then larger: a rise at step 6 through step 25 (20 points; 29 logged).
    rows = _rows("actor/entropy_first_k", [1.0] * 5 + [2.0] * 24)
    res = mc.gate_b(rows, checkpoint_steps=[2, 4, 6, 8])
    assert res["result"] == "pass" and res["decided_by"] == "S2"
    assert (res["t0"], res["min_step"]) == (6, 5)
    # the minimum is at step 5, measured at the weights after 4 updates = checkpoint step 4 (not 6, which is later)
    assert res["fork_checkpoint"] == 4
    assert mc.fork_checkpoint(5, [10, 20]) == 0 and mc.fork_checkpoint(21, [10, 20]) == 20
    assert mc.fork_checkpoint(5, None) is None


def test_gate_b_fail_pending_and_earliest_series():
    flat = _rows("probe/entropy", [1.0] * 30)
    assert mc.gate_b(flat, finished=True)["result"] == "fail"
    assert mc.gate_b(flat, finished=False)["result"] == "pending"
    assert mc.gate_b([{"step": 1}], finished=True)["result"] == "not testable"
    # both rise: S1 from step 12, S2 from step 6 → S2 decides
    rows = [dict(a, **b) for a, b in zip(_rows("probe/entropy", [0.5] * 11 + [0.6] * 20),
                                         _rows("actor/entropy_first_k", [1.0] * 5 + [2.0] * 26))]
    res = mc.gate_b(rows)
    assert res["series"]["S1"]["t0"] == 12 and res["series"]["S2"]["t0"] == 6 and res["decided_by"] == "S2"


# ---------------------------------------------------------------- E2

def _attr(step, dh, nt):
    return {"step": step, **{f"mechanism/dH_probe/{g}": v for g, v in zip(mc.GROUPS, dh)},
            **{f"mechanism/num_tokens/{g}": v for g, v in zip(mc.GROUPS, nt)}}


def _e2_rows(deltas, attr=None):
    # attribution at steps 1 and 11 (order: silenced, kept_candidates, pos_high_p, neg)
    attr = attr or [_attr(1, [0.02, -0.01, -0.05, 0.02], [1, 3, 40, 56]),
                    _attr(11, [-0.03, 0.01, -0.04, 0.02], [1, 2, 47, 50])]
    rows = {r["step"]: dict(r) for r in attr}
    for i, d in enumerate(deltas):  # counterfactual every 5 steps from step 1
        s = 1 + 5 * i
        row = rows.setdefault(s, {"step": s})
        row["mechanism/counterfactual/delta"] = d
        if d is not None and d != 0:
            row["mechanism/counterfactual/delta_masked"] = d
    return [rows[s] for s in sorted(rows)]


def test_e2_share_ratio_by_hand_and_shown():
    # Σ|dH|: silenced .02 + .03 = .05; all groups .10 + .10 = .20 → share .25.
    # tokens: silenced 1 + 1 = 2 of 100 + 100 → token share .01 → ratio 25 ≥ 10: (a) holds.
    # δ at 10 masked steps, all −0.001 → interval [−0.001, −0.001] < 0: (b) holds → shown.
    res = mc.e2(_e2_rows([-0.001] * 10 + [0.0] * 2), n_boot=500)
    assert res["groups"]["silenced"]["abs_share"] == pytest.approx(0.25)
    assert res["groups"]["silenced"]["token_share"] == pytest.approx(0.01)
    assert res["ratio"] == pytest.approx(25.0) and res["part_a"]
    assert res["groups"]["pos_high_p"]["abs_share"] == pytest.approx(0.45)  # (.05 + .04) / .20
    assert res["groups"]["neg"]["token_share"] == pytest.approx(0.53)  # 106 / 200
    assert res["groups"]["silenced"]["sum_dH"] == pytest.approx(-0.01)
    dm = res["delta_masked"]
    assert dm["n"] == 10 and dm["mean"] == pytest.approx(-0.001) and dm["high"] == pytest.approx(-0.001)
    assert res["delta"]["n"] == 12 and res["delta"]["mean"] == pytest.approx(-0.01 / 12)
    assert res["result"] == "shown" and res["n_attribution"] == 2 and res["n_attribution_silenced"] == 2


def test_e2_refuted_inconclusive_and_not_testable():
    assert mc.e2(_e2_rows([0.002] * 10), n_boot=500)["result"] == "refuted"  # lower bound > 0 (ratio 25)
    assert mc.e2(_e2_rows([-1.0, 1.0] * 5), n_boot=500)["result"] == "inconclusive"  # mean 0, ratio 25
    # ratio ≤ 1: the silenced tokens' share of |dH| (.02 + .03 of .20 = .25) equals their token share (50 of 200)
    even = [_attr(1, [0.02, -0.01, -0.05, 0.02], [25, 25, 25, 25]), _attr(11, [-0.03, 0.01, -0.04, 0.02],
                                                                          [25, 25, 25, 25])]
    res = mc.e2(_e2_rows([-0.001] * 10, attr=even), n_boot=500)
    assert res["ratio"] == pytest.approx(1.0) and res["result"] == "refuted"
    res = mc.e2(_e2_rows([-0.001] * 9), n_boot=500)
    assert res["result"] == "not testable" and "fewer than 10" in res["reasons"][0]
    none_silenced = [_attr(1, [0.0, -0.01, -0.05, 0.02], [0, 3, 40, 56])]
    res = mc.e2(_e2_rows([-0.001] * 10, attr=none_silenced), n_boot=500)
    assert res["result"] == "not testable" and res["reasons"][0] == "no attribution step has a silenced token"


# ---------------------------------------------------------------- E3

def _branch(values_by_step):
    return [{"step": s, "probe/entropy": v, "actor/entropy": 2 * v, "critic/score/mean": 0.5}
            for s, v in values_by_step.items()]


def test_e3_three_pairs_by_hand():
    # JustRL at 1.0 over steps 1-12; STAPO at 5.0 on steps 1-2 (outside the last 10: steps 3-12) then 0.9 / 0.8 /
    # 0.7 → differences −0.1, −0.2, −0.3: mean −0.2, s = 0.1, half = 4.3027 · 0.1 / √3 = 0.24841 →
    # [−0.44841, 0.04841] contains 0 → inconclusive; mde = (4.3027 + 1.0607) · 0.1 / √3 = 0.30965.
    j = _branch({s: 1.0 for s in range(1, 13)})
    pairs = [(f"seed{i}", j, _branch({s: (5.0 if s <= 2 else v) for s in range(1, 13)}))
             for i, v in enumerate([0.9, 0.8, 0.7])]
    res = mc.e3(pairs, "pass")
    p = res["primary"]
    assert res["pairs"][0]["primary"]["steps"] == list(range(3, 13))
    assert p["mean"] == pytest.approx(-0.2) and p["half"] == pytest.approx(0.248414, rel=1e-5)
    assert (p["low"], p["high"]) == (pytest.approx(-0.448414, rel=1e-5), pytest.approx(0.048414, rel=1e-4))
    assert p["mde"] == pytest.approx(0.309651, rel=1e-5)
    assert res["result"] == "inconclusive"
    assert res["secondary"]["actor/entropy"]["mean"] == pytest.approx(-0.4)  # 2 × the probe difference
    # differences −0.19, −0.2, −0.21: s = 0.01, half 0.024841 → [−0.2248, −0.1752] < 0 → shown
    pairs = [(f"seed{i}", j, _branch({s: v for s in range(1, 13)})) for i, v in enumerate([0.81, 0.8, 0.79])]
    assert mc.e3(pairs, "pass")["result"] == "shown"
    pairs = [(f"seed{i}", j, _branch({s: v for s in range(1, 13)})) for i, v in enumerate([1.19, 1.2, 1.21])]
    assert mc.e3(pairs, "pass")["result"] == "refuted"
    assert mc.e3(pairs, "fail")["result"] == "not testable"
    assert mc.e3(pairs, "pending")["result"] == "pending"


def test_from_start_difference_by_hand():
    trunk = _rows("probe/entropy", [1.0, 1.0, 1.0, 1.0])
    stapo = _rows("probe/entropy", [0.75, 0.75, 0.75])  # common steps 1-3, d = −0.25 each → [−0.25, −0.25]
    res = mc.from_start(trunk, stapo, n_boot=200)
    assert res["steps"] == [1, 2, 3] and (res["mean"], res["low"], res["high"]) == (-0.25, -0.25, -0.25)


# ---------------------------------------------------------------- machines

def test_kind_from_machine_line():
    assert mc.kind_from_machine_line(EPYC) == "cpu:AMD EPYC 7B13 64-Core Processor:avx2"
    assert mc.kind_from_machine_line(XEON) == "cpu:Intel(R) Xeon(R) Processor:amx_bf16"
    capped = XEON + ", kernels capped at ATEN_CPU_CAPABILITY=avx2"
    assert mc.kind_from_machine_line(capped) == "cpu:Intel(R) Xeon(R) Processor:avx2"
    # other core and thread counts are the same kind
    assert mc.kind_from_machine_line(EPYC.replace("2 cores", "16 cores")) == mc.kind_from_machine_line(EPYC)


def test_pairing_refused_across_machine_kinds_dtypes_and_moved_runs(tmp_path):
    rows = _rows("probe/entropy", [1.0] * 3)
    a = mc.read_run(_write_run(tmp_path / "a", rows))
    same = mc.read_run(_write_run(tmp_path / "b", rows, objective="stapo",
                                  machines=(EPYC.replace("2 cores", "8 cores"),)))
    mc.check_pairable(a, same)  # one kind, one dtype: allowed
    xeon = mc.read_run(_write_run(tmp_path / "c", rows, objective="stapo", machines=(XEON,)))
    with pytest.raises(mc.MechanismClaimsError) as e:
        mc.check_pairable(a, xeon)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "a") in msg and str(tmp_path / "c") in msg
    assert EPYC in msg and XEON in msg
    bf16 = mc.read_run(_write_run(tmp_path / "d", rows, objective="stapo", dtype="bfloat16"))
    with pytest.raises(mc.MechanismClaimsError, match="compute dtype"):
        mc.check_pairable(a, bf16)
    moved = mc.read_run(_write_run(tmp_path / "e", rows, objective="stapo", machines=(EPYC, XEON)))
    assert len(moved.kinds) == 2
    with pytest.raises(mc.MechanismClaimsError, match="more than one machine kind"):
        mc.check_pairable(a, moved)


# ---------------------------------------------------------------- CLI and figure

def _trunk_rows(n=30):
    rows = _e2_rows([-0.001] * 10 + [0.0] * 2)
    by = {r["step"]: r for r in rows}
    for s in range(1, n + 1):
        r = by.setdefault(s, {"step": s})
        r["probe/entropy"] = 1.0 - 0.001 * s
        r["actor/entropy_first_k"] = 1.5
        r["actor/entropy"] = 1.2
        r["critic/score/mean"] = 0.3
    return [by[s] for s in sorted(by)]


def test_cli_writes_both_files_and_refuses_a_cross_machine_pair(tmp_path, capsys):
    import json

    trunk = _write_run(tmp_path / "trunk", _trunk_rows(), machines=(EPYC, EPYC))
    start = _write_run(tmp_path / "stapo0", _trunk_rows(), objective="stapo")
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    out = tmp_path / "out"
    rc = mc.main(["--trunk", str(trunk), "--calibration", str(cal), "--stapo-from-start", str(start),
                  "--checkpoint-steps", "10", "20", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "mechanism_claims.json").read_text())
    assert res["gate_a"]["mix"] == [2, 3, 12]
    assert res["gate_b"]["result"] == "fail" and res["e3"]["result"] == "not testable"
    assert res["e2"]["result"] == "shown" and res["from_start"]["mean"] == 0.0
    md = (out / "mechanism_claims.md").read_text()
    assert "What this budget cannot test" in md and "Exploratory (one seed)" in md and "PARTIAL" not in md
    other = _write_run(tmp_path / "stapo_xeon", _trunk_rows(), objective="stapo", machines=(XEON,))
    rc = mc.main(["--trunk", str(trunk), "--stapo-from-start", str(other), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot pair" in err and XEON in err
    swapped = f"{start}:{trunk}"  # a STAPO run as the JustRL side
    rc = mc.main(["--trunk", str(trunk), "--fork-pairs", swapped, "--out", str(out)])
    assert rc == 2 and "must be a justrl run" in capsys.readouterr().err


def test_plot_writes_a_png_for_a_full_and_a_partial_run(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "plot_mechanism", Path(__file__).resolve().parents[1] / "scripts" / "plot_mechanism.py")
    plot_mechanism = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_mechanism)
    run = _write_run(tmp_path / "trunk", _trunk_rows(), total_steps=120)
    png = plot_mechanism.plot(run, tmp_path / "fig" / "mechanism.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    partial = _write_run(tmp_path / "partial", _rows("probe/entropy", [1.0, 0.9]), total_steps=120)
    png = plot_mechanism.plot(partial, tmp_path / "partial.png")
    assert png.stat().st_size > 1000


def test_cli_gate_only_writes_gate_b_json(tmp_path):
    import json

    # probe/entropy 0.5 at step 1, then 0.6 at steps 2-21: a rise at step 2 from the minimum at step 1; the only
    # checkpoint ≤ 1 − 1 = 0 is the initial model
    trunk = _write_run(tmp_path / "trunk", _rows("probe/entropy", [0.5] + [0.6] * 20))
    assert mc.main(["--trunk", str(trunk), "--gate-only", "--checkpoint-steps", "10", "--out", str(tmp_path)]) == 0
    gate = json.loads((tmp_path / "gate_b.json").read_text())
    assert (gate["passed"], gate["result"], gate["t0"], gate["min_step"], gate["fork_step"]) == (True, "pass", 2, 1, 0)
    assert not (tmp_path / "mechanism_claims.md").exists()


def test_gate_a_tie_on_distance_goes_to_more_levels():
    # accuracies 3: .35, 4: .30, 5: .40 → {3}, {4,5} and {3,4,5} all pool to 0.35 (the last is 0.35000000000000003
    # in binary: equal at 9 decimals, a tie) → the most levels, {3,4,5}
    row = {"boxed_rate": 0.9, "mean_length": 100.0, "n": 64}
    levels = [dict(row, level=3, accuracy=0.35), dict(row, level=4, accuracy=0.30), dict(row, level=5, accuracy=0.40)]
    assert mc.gate_a(levels)["mix"] == [3, 4, 5]
    # level 3 alone boxes 0.5: every mix with it has pooled boxed < 0.85 ((0.5 + 0.9)/2 = 0.7, (0.5 + 1.8)/3 = 0.77)
    # → admissible: {4}, {5}, {4,5}; {4,5} is 0.35 exactly
    levels[0]["boxed_rate"] = 0.5
    assert mc.gate_a(levels)["mix"] == [4, 5]


def test_recipe_checks_by_hand():
    """Two training steps: pg_clipfrac [0, 0.001] → 1 step clips; |ppo_kl| max 3e-4; S2T would silence [0, 2] of
    100 + 100 response tokens → 2 tokens, 1 step, share 0.01; kl_to_ref [0.01, 0.02]; probe 0.5 → 0.4 (a step-0
    validation row without training keys is not a step but its probe value counts as the first)."""
    from stapo.study.mechanism_claims import recipe_checks

    rows = [{"step": 0, "probe/entropy": 0.5},
            {"step": 1, "critic/score/mean": 0.0, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": -3e-4,
             "response_length/total_tokens": 100, "s2t/would_mask/num_masked": 0, "actor/kl_to_ref": 0.01},
            {"step": 2, "critic/score/mean": 0.5, "actor/pg_clipfrac": 0.001, "actor/ppo_kl": 1e-4,
             "response_length/total_tokens": 100, "s2t/would_mask/num_masked": 2, "actor/kl_to_ref": 0.02,
             "probe/entropy": 0.4}]
    c = recipe_checks(rows)
    assert (c["steps"], c["clip_steps"], c["clipfrac_max"], c["ppo_kl_max_abs"]) == (2, 1, 0.001, 3e-4)
    assert (c["silenced_key"], c["silenced"], c["silenced_steps"], c["silenced_share"]) == (
        "s2t/would_mask/num_masked", 2.0, 1, 0.01)
    assert (c["kl_to_ref_last"], c["kl_to_ref_max"], c["probe_first"], c["probe_last"]) == (0.02, 0.02, 0.5, 0.4)
    # a STAPO run: its own silenced count wins over the would-mask diagnostic
    stapo = [{**r, "actor/s2t/num_masked": 1} for r in rows[1:]]
    assert (recipe_checks(stapo)["silenced_key"], recipe_checks(stapo)["silenced"]) == ("actor/s2t/num_masked", 2.0)


def test_e3_after_a_passed_gate_without_forks_is_pending_not_a_verdict():
    from stapo.study.mechanism_claims import e3

    res = e3([], "pass")
    assert (res["result"], res["partial"]) == ("pending", True)
    assert e3([], "fail")["result"] == "not testable"


def test_repeated_fork_pairs_flags_add_up(tmp_path, monkeypatch):
    """scripts/mechanism_study.py passes one --fork-pairs per pair: all of them reach the verdicts (argparse used to
    keep only the last flag's)."""
    import stapo.study.mechanism_claims as mc

    seen = {}
    monkeypatch.setattr(mc, "read_run", lambda path: str(path))
    monkeypatch.setattr(mc, "evaluate", lambda **kw: seen.update(kw) or {"budget": None})
    monkeypatch.setattr(mc, "render_md", lambda res: "")
    rc = mc.main(["--trunk", "t", "--checkpoint-steps", "10", "--fork-pairs", "j1:s1", "--fork-pairs", "j2:s2", "j3:s3",
                  "--out", str(tmp_path)])
    assert rc == 0 and seen["fork_pairs"] == [("j1", "s1"), ("j2", "s2"), ("j3", "s3")]


def _mechanism_study_script():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "mechanism_study", Path(__file__).resolve().parents[1] / "scripts" / "mechanism_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_verdicts_from_the_snapshot_pass_the_gates_checkpoint_steps(tmp_path, monkeypatch):
    """The committed snapshot keeps no checkpoints/ folder, so without help the fork checkpoint would read 0 (the
    initial model). Reading the snapshot, the verdicts stage passes the steps gate_b.json recorded (here 10, 20);
    reading the live run folders it passes none (their checkpoints/step_N folders decide)."""
    ms = _mechanism_study_script()
    out, live = tmp_path / "results" / "mechanism_study", tmp_path / "runs" / "mechanism"
    (out / "runs" / "trunk").mkdir(parents=True)
    (out / "runs" / "trunk" / "metrics.jsonl").write_text("{}\n")
    (out / "gate_b.json").write_text('{"checkpoint_steps": [10, 20]}')
    monkeypatch.setattr(ms, "REPO", tmp_path)
    monkeypatch.setattr(ms, "OUT", out)
    monkeypatch.setattr(ms, "RUNS", live)
    cmds = []
    monkeypatch.setattr(ms, "run", cmds.append)
    ms.stage_verdicts(None)
    claims = cmds[0]
    assert claims[claims.index("--trunk") + 1] == "results/mechanism_study/runs/trunk"
    assert claims[claims.index("--checkpoint-steps"):][:3] == ["--checkpoint-steps", "10", "20"]
    (live / "trunk").mkdir(parents=True)
    (live / "trunk" / "metrics.jsonl").write_text("{}\n")
    cmds.clear()
    ms.stage_verdicts(None)
    assert cmds[0][cmds[0].index("--trunk") + 1] == "runs/mechanism/trunk" and "--checkpoint-steps" not in cmds[0]
