"""The study runner (stapo/study/): its config, the run states read from run folders, the grid loop, the report;
and (slow) a real study of the tiny model killed with SIGKILL mid-grid and resumed to the same report.

The fast tests build run folders by hand (a checkpoint = ``checkpoints/step_N/trainer_state.pt``, the file rule of
:func:`stapo.common.checkpoint_files.latest_checkpoint` for folders without a COMPLETE.json) and write metrics rows
whose statistics are worked out in the comments.
"""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo.common.checkpoint_files import latest_checkpoint
from stapo.config import ConfigError
from stapo.run.tracking import CorruptJsonlError
from stapo.study import describe_plan, load_study_config, run_grid, run_specs, run_status, write_report
from stapo.study import runner as study_runner
from stapo.study.report import eval_se_rows

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "study" / "tiny_test.yaml"


def _study(tmp_path: Path, *extra: str):
    cfg = load_study_config(TINY, [f"output_dir={tmp_path / 'study'}", *extra])
    return cfg, run_specs(cfg)


def _write_run(run_dir: Path, rows: list[dict], ckpt_steps: list[int]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s in ckpt_steps:
        d = run_dir / "checkpoints" / f"step_{s:06d}"
        d.mkdir(parents=True)
        (d / "trainer_state.pt").write_bytes(b"x")


# --- config ---------------------------------------------------------------------------------------------
def test_config_runs_in_seed_major_order_with_their_overrides(tmp_path):
    cfg, specs = _study(tmp_path)
    assert [s.name for s in specs] == ["stapo_seed0", "grpo_seed0", "stapo_seed1", "grpo_seed1"]
    s = specs[3]
    assert s.run_dir == tmp_path / "study" / "runs" / "grpo_seed1"
    assert s.train.algorithm.objective == "grpo" and s.train.trainer.seed == 1 and s.total_steps == 2
    assert (s.train.logging.study, s.train.logging.method) == ("tiny_test", "grpo")
    assert s.train.trainer.run_name == "grpo_seed1"
    # the W&B group train.py resolves: <study>-<method>, shared by the seeds of a method, one per method
    from stapo.run.provenance import apply_identity

    groups = {spec.name: apply_identity(spec.train, spec.config).group for spec in specs}
    assert groups == {"stapo_seed0": "tiny_test-stapo", "grpo_seed0": "tiny_test-grpo",
                      "stapo_seed1": "tiny_test-stapo", "grpo_seed1": "tiny_test-grpo"}
    assert s.config == str(REPO / "configs" / "tiny_test.yaml")  # relative to the study file
    assert cfg.reference == "grpo"


def test_config_method_seeds(tmp_path):
    # stapo keeps the study's seeds [0, 1]; grpo runs seeds 1 and 2 → order: seed 0 (stapo), 1 (both), 2 (grpo)
    cfg, specs = _study(tmp_path, "methods.grpo.seeds=[1,2]")
    assert [s.name for s in specs] == ["stapo_seed0", "stapo_seed1", "grpo_seed1", "grpo_seed2"]


@pytest.mark.parametrize("override, match", [
    ("reference=ppo", "invalid value for 'reference': 'ppo' is not a method"),
    ("seeds=[1,1]", "invalid value for 'seeds'"),
    ("report.window=0", "report.window"),
    ("report.metrics=[rewards]", "report.metrics"),
    ("sedes=[1]", "unknown config key 'sedes'; did you mean 'seeds'"),
    ("methods.grpo.overrides=[algorithm.objective=grpoo]", "run grpo_seed0: invalid value for 'algorithm.objective'"),
    # defect #11: a method's keys are listed, with the closest one
    ("methods.stapo.overides=[x=1]", r"unknown config key 'methods.stapo.overides'; did you mean "
                                      r"'methods.stapo.overrides'\? \(valid keys under 'methods.stapo': config, "
                                      r"overrides, seeds\)"),
    # defect #13e: keys the runner sets itself are refused, in the study's and a method's overrides
    ("overrides=[trainer.seed=5]", "invalid value for 'overrides': 'trainer.seed=5': the runner sets"),
    ("methods.grpo.overrides=[trainer.run_name=x]", "invalid value for 'methods.grpo.overrides': "
                                                     "'trainer.run_name=x'"),
    ("overrides=[+trainer.output_dir=/tmp/x]", "invalid value for 'overrides'"),
    ("methods.stapo.overrides=[logging.group=g]", "invalid value for 'methods.stapo.overrides'"),
    ("methods.stapo.overrides=[logging.method=g]", "invalid value for 'methods.stapo.overrides'"),
])
def test_config_errors_are_one_line(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match) as e:
        _study(tmp_path, override)
    assert "\n" not in str(e.value)


# --- run states -----------------------------------------------------------------------------------------
def test_run_status_from_run_folders(tmp_path):
    cfg, specs = _study(tmp_path)
    by = {s.name: s for s in specs}
    _write_run(by["stapo_seed0"].run_dir, [{"step": 1}, {"step": 2}], [1, 2])  # finished
    _write_run(by["grpo_seed0"].run_dir, [{"step": 1}, {"step": 2}], [1])  # killed after logging step 2
    _write_run(by["stapo_seed1"].run_dir, [{"step": 1}], [])  # killed before its first checkpoint
    (by["stapo_seed1"].run_dir / "checkpoints" / "step_000001.tmp").mkdir(parents=True)  # an interrupted save
    st = {s.name: run_status(s) for s in specs}
    assert [st[n].action for n in by] == ["skip", "resume", "restart", "new"]
    assert (st["grpo_seed0"].checkpoint_step, st["grpo_seed0"].logged_step) == (1, 2)
    assert study_runner.train_command(st["grpo_seed0"])[-1] == "--resume"
    assert "--resume" not in study_runner.train_command(st["stapo_seed1"])
    plan = describe_plan(cfg, specs)
    assert "stapo_seed0  skip     finished (step 2/2)" in plan
    assert "grpo_seed0   resume   resume from the checkpoint of step 1/2" in plan
    assert "stapo_seed1  restart" in plan and "grpo_seed1   new" in plan
    assert plan.count("$ ") == 3  # a command for each run that is not skipped
    # defect #3: the final checkpoint exists, the last row is torn (lost): finished, and the line names the lost
    # row (resuming would find nothing to train, forever); no command, the report names the run
    _write_run(by["grpo_seed1"].run_dir, [{"step": 1}], [2])
    with (by["grpo_seed1"].run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "critic/sc')  # a torn last line of 22 bytes
    st = run_status(by["grpo_seed1"])
    assert (st.action, st.checkpoint_step, st.logged_step) == ("skip", 2, 1)
    assert "the metrics row of step 2 is lost" in st.reason and "torn line of 22 bytes" in st.reason
    assert describe_plan(cfg, specs).count("$ ") == 2
    said: list[str] = []
    write_report(cfg, specs, say=said.append)
    md = (Path(cfg.output_dir) / "report.md").read_text()
    assert "lacks the rows of the last steps" in md and "grpo_seed1 (rows to step 1 of 2)" in md
    assert "Not finished (reported as far as they got): stapo_seed1." in md


FAKE_TRAIN = r"""
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
ov = dict(a.split("=", 1) for a in args if "=" in a)
run = Path(ov["trainer.output_dir"]) / ov["trainer.run_name"]
if ov["trainer.run_name"] == os.environ.get("FAIL_RUN"):
    print("train.py: invalid value for 'x': a failure", file=sys.stderr)
    sys.exit(2)
start = 0
if "--resume" in args:
    start = max(int(p.name[5:]) for p in (run / "checkpoints").iterdir())
run.mkdir(parents=True, exist_ok=True)
with open(run / "metrics.jsonl", "a") as f:
    for step in range(start + 1, int(ov["trainer.total_steps"]) + 1):
        f.write(json.dumps({"step": step, "critic/score/mean": 0.0, "response_length/total_tokens": 10,
                            "timing_s/step": 1.0, "resumed_from": start}) + "\n")
        d = run / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "trainer_state.pt").write_bytes(b"x")
"""


def test_run_grid_skips_resumes_restarts_and_goes_on_after_a_failure(tmp_path, monkeypatch):
    """The grid loop with train.py replaced by a small script of the same contract (run folder from the
    overrides, ``--resume`` continues after the latest checkpoint), so the loop's decisions run in a second."""
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    real = study_runner.train_command
    monkeypatch.setattr(study_runner, "train_command",
                        lambda st: [sys.executable, str(fake), *real(st)[2:]])
    monkeypatch.setenv("FAIL_RUN", "grpo_seed1")
    cfg, specs = _study(tmp_path)
    by = {s.name: s for s in specs}
    _write_run(by["stapo_seed0"].run_dir, [{"step": 1}, {"step": 2}], [1, 2])
    _write_run(by["grpo_seed0"].run_dir, [{"step": 1}], [1])
    _write_run(by["stapo_seed1"].run_dir, [{"step": 1, "stale": True}], [])
    said: list[str] = []
    assert run_grid(cfg, specs, say=said.append) == 1  # grpo_seed1 failed, the others ran
    assert said[0] == "[1/4] stapo_seed0: finished (step 2/2): skipped"
    rows = lambda n: [json.loads(x) for x in (by[n].run_dir / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [(r["step"], r.get("resumed_from")) for r in rows("grpo_seed0")] == [(1, None), (2, 1)]
    assert [r["step"] for r in rows("stapo_seed1")] == [1, 2] and "stale" not in rows("stapo_seed1")[0]
    assert any("grpo_seed1: FAILED (exit 2)" in s and "train.py: invalid value for 'x'" in s for s in said)
    attempts = [json.loads(x) for x in (Path(cfg.output_dir) / "attempts.jsonl").read_text().splitlines()]
    assert [(a["run"], a["action"], a["rc"]) for a in attempts] == [
        ("grpo_seed0", "resume", 0), ("stapo_seed1", "restart", 0), ("grpo_seed1", "new", 2)]
    # second call: only the failed run is left
    monkeypatch.delenv("FAIL_RUN")
    said.clear()
    assert run_grid(cfg, specs, say=said.append) == 0
    assert sum("skipped" in s for s in said) == 3 and run_status(by["grpo_seed1"]).action == "skip"


# --- report ---------------------------------------------------------------------------------------------
def _row(step, reward, tokens=10.0, step_s=3600.0, **extra):
    return {"step": step, "critic/score/mean": reward, "actor/entropy": 1.0, "response_length/total_tokens": tokens,
            "timing_s/step": step_s, **extra}


def test_report_values_by_hand(tmp_path):
    cfg, specs = _study(tmp_path, "report.window=2", "report.bootstrap_samples=400", "runner.threads=2")
    by = {s.name: s for s in specs}
    # grpo (reference) rewards per step: seed 0: 0, 0 ; seed 1: 1, 1
    # stapo: seed 0: 1, 2 ; seed 1: 1, 3 ; val-core/average/acc/mean@4 at step 2 only (stapo seed 0: 0.5, seed 1: 0.7)
    _write_run(by["grpo_seed0"].run_dir, [_row(1, 0.0), _row(2, 0.0)], [1, 2])
    _write_run(by["grpo_seed1"].run_dir, [_row(1, 1.0), _row(2, 1.0)], [1, 2])
    _write_run(by["stapo_seed0"].run_dir, [_row(1, 1.0), _row(2, 2.0, **{"val-core/average/acc/mean@4": 0.5})],
               [1, 2])
    _write_run(by["stapo_seed1"].run_dir, [_row(1, 1.0), _row(2, 3.0, **{"val-core/average/acc/mean@4": 0.7})],
               [1, 2])
    write_report(cfg, specs)
    out = Path(cfg.output_dir)
    final = {(r["metric"], r["method"]): r for r in csv.DictReader((out / "final.csv").open())}
    # stapo final reward per seed (mean of steps 1–2): 1.5 and 2.0 → mean 1.75, s = 0.353553,
    # t_{0.975, 1} = 12.7062 → half = 12.7062 · 0.353553 / √2 = 3.17655
    r = final[("reward", "stapo")]
    assert float(r["final_mean"]) == pytest.approx(1.75)
    assert float(r["final_ci_high"]) - 1.75 == pytest.approx(3.17655, abs=1e-4)
    # paired differences stapo − grpo: seed 0: 1, 2 ; seed 1: 0, 2 → per-seed means 1.5, 1.0 → estimate 1.25
    assert float(r["diff_mean"]) == pytest.approx(1.25) and r["n_pairs"] == "4"
    assert 0.0 <= float(r["diff_ci_low"]) <= 1.25 <= float(r["diff_ci_high"]) <= 2.0
    g = final[("reward", "grpo")]  # grpo: seeds 0 and 1 → mean 0.5; the reference has no difference
    assert float(g["final_mean"]) == pytest.approx(0.5) and g["diff_mean"] == ""
    # validation: one series per setting key; only stapo logs it (the window is its last 2 logged steps: step 2)
    v = final[("val_accuracy[val-core/average/acc/mean@4]", "stapo")]
    assert float(v["final_mean"]) == pytest.approx(0.6) and v["window_steps"] == "2-2"
    curves = [r for r in csv.DictReader((out / "curves.csv").open()) if r["metric"] == "reward"]
    s1 = next(r for r in curves if r["method"] == "stapo" and r["step"] == "2")  # rewards 2, 3 at step 2
    assert float(s1["mean"]) == pytest.approx(2.5) and s1["n_seeds"] == "2"
    assert float(s1["ci_high"]) - 2.5 == pytest.approx(12.7062 * math.sqrt(0.5) / math.sqrt(2), abs=1e-4)
    md = (out / "report.md").read_text()
    # cost: 4 runs × 2 steps = 8 steps, 80 tokens, 8 h of step time × 2 threads = 16 CPU-hours
    assert "4 runs, 8 steps, 80 response tokens; Σ step time 8.00 h × 2 threads = 16.00 CPU-hours" in md
    assert "![curves](curves.png)" in md and (out / "curves.png").stat().st_size > 0
    assert "not logged: accuracy (stapo, grpo)" in md


def _recorded(spec, **model) -> dict:
    """A run's config.json as train.py writes it (its resolved config: the study's plan), with ``model`` keys
    replaced (e.g. the resolved compute dtype)."""
    from stapo.config import to_dict

    cfg = to_dict(spec.train)
    cfg["model"].update(model)
    return cfg


# the plan leaves the compute dtype to the machine, as the CPU recipe does: a run records the one it resolved
AUTO_DTYPE = ("overrides=[trainer.total_steps=2,trainer.save_every=1,trainer.log_examples_every=0,"
              "model.compute_dtype=auto]")


def test_report_runs_table_names_each_runs_machine_and_compute_dtype(tmp_path):
    cfg, specs = _study(tmp_path, "report.window=1", AUTO_DTYPE)
    by = {s.name: s for s in specs}
    for s in specs:
        # step times 10 s and 20 s → mean 15.0 s/step
        _write_run(s.run_dir, [_row(1, 0.0, step_s=10.0), _row(2, 1.0, step_s=20.0)], [1, 2])
    def hw(name, machine, dtype):
        d = by[name].run_dir
        (d / "run_info.json").write_text(json.dumps({"launches": [
            {"machine": "Old box, torch 2.0, 2 threads"}, {"machine": f"{machine}, torch 2.13.0+cpu, 2 threads"}]}))
        (d / "config.json").write_text(json.dumps(_recorded(by[name], compute_dtype=dtype)))
    hw("stapo_seed0", "Intel Xeon, 2 cores, flags amx_bf16", "bfloat16")
    hw("grpo_seed0", "AMD EPYC, 2 cores, flags avx2 fma", "float32")
    (by["stapo_seed1"].run_dir / "run_info.json").write_text("{damaged")  # → "?" for its machine, no crash
    md = (Path(write_report(cfg, specs))).read_text()
    # the last launch's machine, without the package versions
    assert "| stapo_seed0 | 2 | 2 | 15.0 | 2 | bfloat16 | Intel Xeon, 2 cores, flags amx_bf16 |" in md
    assert "| grpo_seed0 | 2 | 2 | 15.0 | 2 | float32 | AMD EPYC, 2 cores, flags avx2 fma |" in md
    assert "| stapo_seed1 | 2 | 2 | 15.0 | ? | ? | ? |" in md
    assert "trained on more than one machine or compute dtype" in md


def test_report_cost_counts_each_steps_own_threads(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg, specs = _study(tmp_path, "report.window=1", "runner.threads=4")
    by = {s.name: s for s in specs}
    for s in specs:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 1.0)], [1, 2])  # 3600 s per step
    # stapo_seed0: launched with 2 threads, resumed after step 1 with 1 thread (step 1: 2 threads, step 2: 1)
    (by["stapo_seed0"].run_dir / "run_info.json").write_text(json.dumps({"launches": [
        {"start_step": 0, "machine": "box, 2 cores, torch 2.13.0+cpu, 2 threads"},
        {"start_step": 1, "machine": "box, 2 cores, torch 2.13.0+cpu, 1 threads"}]}))
    # the 3 other runs record nothing: runner.threads = 4 for their 2 × 3 = 6 steps
    # CPU-hours = 1 h × 2 + 1 h × 1 + 6 h × 4 = 27; Σ step time 8 h
    md = Path(write_report(cfg, specs)).read_text()
    assert "Σ step time 8.00 h × each step's threads (run_info.json) = 27.00 CPU-hours" in md
    assert "| stapo_seed0 | 2 | 2 | 3600.0 | 1 | ? | box, 2 cores |" in md  # the last launch's threads


def test_default_threads_runner_setting_then_omp_num_threads_then_cores(tmp_path, monkeypatch):
    from stapo.study.runner import default_threads
    cfg, _ = _study(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads(cfg) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: the core count
    assert default_threads(cfg) == (os.cpu_count() or 1)
    cfg.runner.threads = 3
    assert default_threads(cfg) == 3


def test_report_one_machine_has_no_mixed_hardware_note(tmp_path):
    cfg, specs = _study(tmp_path, "report.window=1", AUTO_DTYPE)
    for s in specs:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 1.0)], [1, 2])
        (s.run_dir / "run_info.json").write_text(json.dumps({"launches": [{"machine": "box, torch 2"}]}))
        (s.run_dir / "config.json").write_text(json.dumps(_recorded(s, compute_dtype="float32")))
    md = Path(write_report(cfg, specs)).read_text()
    assert "| stapo_seed0 | 2 | 2 | 3600.0 | ? | float32 | box |" in md
    assert "more than one machine" not in md


def test_report_one_seed_has_no_band(tmp_path):
    cfg, specs = _study(tmp_path, "seeds=[0]", "report.window=1")
    for s in specs:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 1.0)], [1, 2])
    write_report(cfg, specs)
    out = Path(cfg.output_dir)
    final = {(r["metric"], r["method"]): r for r in csv.DictReader((out / "final.csv").open())}
    r = final[("reward", "stapo")]
    assert r["n_seeds"] == "1" and float(r["final_mean"]) == 1.0 and r["final_ci_low"] == r["final_ci_high"] == ""
    assert float(r["diff_mean"]) == 0.0 and float(r["diff_ci_low"]) == 0.0  # identical runs: Δ = 0, CI [0, 0]
    assert "| reward (mean, ±1) | stapo | 1 | 1 | n/a |" in (out / "report.md").read_text()


def test_report_partial_runs_and_missing_steps(tmp_path):
    # stapo_seed1 stopped after step 1 and grpo_seed1 never started: the report covers what exists
    cfg, specs = _study(tmp_path, "report.window=2")
    by = {s.name: s for s in specs}
    _write_run(by["stapo_seed0"].run_dir, [_row(1, 1.0), _row(2, 3.0)], [2])
    _write_run(by["grpo_seed0"].run_dir, [_row(1, 0.0), _row(2, 0.0)], [2])
    _write_run(by["stapo_seed1"].run_dir, [_row(1, 5.0)], [1])
    write_report(cfg, specs)
    out = Path(cfg.output_dir)
    final = {(r["metric"], r["method"]): r for r in csv.DictReader((out / "final.csv").open())}
    # stapo: seed 0 → (1 + 3) / 2 = 2, seed 1 → 5 (its only step in the window) → mean 3.5
    assert float(final[("reward", "stapo")]["final_mean"]) == pytest.approx(3.5)
    # pairs only where grpo has the seed: seed 0 steps 1, 2 → differences 1, 3 → 2.0
    assert float(final[("reward", "stapo")]["diff_mean"]) == pytest.approx(2.0)
    assert final[("reward", "stapo")]["n_pairs"] == "2"
    assert "Not finished (reported as far as they got): stapo_seed1, grpo_seed1." in (out / "report.md").read_text()


def test_final_eval_state_and_report(tmp_path):
    # final_eval on: a results.json makes the evaluation "done" (reused) and its average avg@N a final value
    cfg, specs = _study(tmp_path, "final_eval.enabled=true", "final_eval.config=../eval/tiny_test.yaml")
    by = {s.name: s for s in specs}
    for name, acc in (("stapo_seed0", 0.5), ("grpo_seed0", 0.25), ("stapo_seed1", 0.75)):
        _write_run(by[name].run_dir, [_row(1, 0.0), _row(2, 0.0)], [1, 2])
        if name != "stapo_seed1":
            (by[name].run_dir / "final_eval").mkdir()
            # two benchmarks: a final value per benchmark beside the average (arith_test 2·acc − 0.25, arith_hard 0.25)
            # arith_test with its standard error (0.02 for stapo_seed0, 0.04 for grpo_seed0), arith_hard without
            benches = {"arith_test": {"avg@N": 2 * acc - 0.25, "avg@N_se": 0.01 / acc, "problems": 256, "N": 4},
                       "arith_hard": {"avg@N": 0.25}}
            (by[name].run_dir / "final_eval" / "results.json").write_text(json.dumps(
                {"label": name, "complete": False, "model": {"step": 2},
                 "metrics": {"t1.0_p1.0": {"average": {"avg@N": acc}, "benchmarks": benches}}}))
    assert [study_runner.eval_status(by[n]).action for n in by] == ["done", "done", "run", "wait"]
    # an evaluation of an earlier final step (total_steps raised since) is not done, and the report leaves it out
    stale = tmp_path / "stale"
    _write_run(stale, [_row(1, 0.0)], [1])
    (stale / "final_eval").mkdir()
    (stale / "final_eval" / "results.json").write_text(json.dumps({"model": {"step": 1}, "metrics": {}}))
    import dataclasses

    stale_spec = dataclasses.replace(by["stapo_seed1"], run_dir=stale, total_steps=1)
    assert study_runner.eval_status(stale_spec).action == "done"
    stale_spec = dataclasses.replace(stale_spec, total_steps=3)
    assert study_runner.eval_status(stale_spec).action == "wait"  # not finished at 3 steps: evaluated later
    said = []
    study_runner._retire_stale_eval(stale_spec, "[x]", said.append)  # moved aside (kept), not deleted
    assert not (stale / "final_eval").exists() and (stale / "final_eval.step_000001" / "results.json").is_file()
    assert "is of step 1, not 3" in said[0]
    cmd = study_runner.eval_command(cfg, by["stapo_seed1"])
    assert cmd[cmd.index("--model") + 1] == str(by["stapo_seed1"].run_dir / "checkpoints" / "step_000002")
    assert cmd[-3:] == [f"logging.group={cfg.name}-stapo", f"logging.study={cfg.name}", "logging.method=stapo"]
    write_report(cfg, specs)
    final = {(r["metric"], r["method"]): r for r in csv.DictReader((Path(cfg.output_dir) / "final.csv").open())}
    r = final[("final_eval[t1.0_p1.0]", "stapo")]  # seed 0 only: 0.5; paired with grpo seed 0: 0.5 − 0.25
    assert (r["n_seeds"], float(r["final_mean"]), float(r["diff_mean"]), r["n_pairs"]) == ("1", 0.5, 0.25, "1")
    # one pair: the report shows no interval (a bootstrap of one value would print [0.25, 0.25])
    assert "| final evaluation avg@N (t1.0_p1.0) | stapo | 1 of 2 | 0.5 | n/a | 0.25 | n/a | 1 |" in \
        (Path(cfg.output_dir) / "report.md").read_text()
    # sampling error: SEs 0.02 and 0.04 → median 0.03; resolvable = 1.96 · √2 · 0.03 = 2.772 · 0.03 = 0.0832;
    # arith_hard reports no SE, so it has no row
    report = (Path(cfg.output_dir) / "report.md").read_text()
    assert "| t1.0_p1.0 | arith_test | 2 | 256 | 4 | 0.02 | 0.03 | 0.04 | 0.0832 |" in report
    assert "| t1.0_p1.0 | arith_hard |" not in report
    rows = eval_se_rows(specs, 0.9)  # z = 1.645 at 90 %: 1.645 · 1.414 · 0.03 = 0.0698
    assert len(rows) == 1 and rows[0]["resolvable"] == pytest.approx(0.0698, abs=1e-4)
    # a damaged results.json stops the report with one line naming it (never a silently smaller final table)
    bad = by["grpo_seed0"].run_dir / "final_eval" / "results.json"
    good = bad.read_text()
    bad.write_text('{"metrics": {trunc')
    with pytest.raises(CorruptJsonlError, match="damaged final evaluation") as err:
        write_report(cfg, specs)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)
    bad.write_text(good)
    r = final[("final_eval[t1.0_p1.0/arith_test]", "stapo")]  # 2·0.5 − 0.25 = 0.75 vs grpo 2·0.25 − 0.25 = 0.25
    assert (float(r["final_mean"]), float(r["diff_mean"])) == (0.75, 0.5)
    assert float(final[("final_eval[t1.0_p1.0/arith_hard]", "grpo")]["final_mean"]) == 0.25


def test_cli_dry_run_and_bad_config(tmp_path, capsys):
    from stapo.study.__main__ import main

    assert main(["--config", str(TINY), f"output_dir={tmp_path}", "--dry-run"]) == 0
    assert "study tiny_test: 4 runs" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    assert main(["--config", str(TINY), "reference=nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stapo.study: ") and err.count("\n") == 1


def test_cli_sigterm_while_starting_is_one_line(tmp_path, capsys, monkeypatch):
    """SIGTERM while the runner imports torch or loads its config (stapo.run.cli.Terminated raised there): one line and
    exit 143, nothing written — not an import traceback (seen when a runner was stopped seconds after its start)."""
    from stapo.run.cli import Terminated
    from stapo.study import config as study_config
    from stapo.study.__main__ import main

    def terminated(*args, **kwargs):
        raise Terminated()

    monkeypatch.setattr(study_config, "load_study_config", terminated)
    assert main(["--config", str(TINY), f"output_dir={tmp_path}"]) == 143
    err = capsys.readouterr().err
    assert err == "stapo.study: interrupted while starting; nothing ran (rerun the same command)\n"
    assert not any(tmp_path.iterdir())


def test_final_eval_config_is_checked_at_load(tmp_path):
    """Defect #5: the final evaluation's config and overrides are loaded when the study loads (one line naming the
    study file and the key), not after the grid has trained."""
    on = ["final_eval.enabled=true"]
    with pytest.raises(ConfigError, match=r"tiny_test.yaml: invalid value for 'final_eval.config': .*nothere.yaml "
                                          r"is not a file") as e:
        _study(tmp_path, *on, "final_eval.config=nothere.yaml")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"tiny_test.yaml: final_eval .*unknown config key 'data.limt'; did you "
                                          r"mean 'data.limit'"):
        _study(tmp_path, *on, "final_eval.config=../eval/tiny_test.yaml", "final_eval.overrides=[data.limt=1]")
    with pytest.raises(ConfigError, match=r"final_eval .*invalid value for 'generation.max_new_tokens'"):
        _study(tmp_path, *on, "final_eval.config=../eval/tiny_test.yaml",
               "final_eval.overrides=[generation.max_new_tokens=0]")
    with pytest.raises(ConfigError, match=r"invalid value for 'final_eval.overrides': 'output.dir=/tmp/x'"):
        _study(tmp_path, *on, "final_eval.config=../eval/tiny_test.yaml", "final_eval.overrides=[output.dir=/tmp/x]")
    _study(tmp_path, *on, "final_eval.config=../eval/tiny_test.yaml")  # the shipped one loads


def _damage_line(path: Path, lineno: int) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[lineno - 1] = lines[lineno - 1][:12] + "\n"  # a complete line that is not a row
    path.write_text("".join(lines))


def test_report_stops_on_a_damaged_middle_line(tmp_path, capsys):
    """Defect #1: a damaged line that is not the last one stops the report (and --report-only, exit 2) with the
    one line naming file and line; the run is never dropped silently, and no report is written."""
    from stapo.study.__main__ import main
    from stapo.run.tracking import CorruptJsonlError

    cfg, specs = _study(tmp_path)
    for s in specs:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 1.0)], [1, 2])
    bad = specs[2].run_dir / "metrics.jsonl"
    _damage_line(bad, 1)
    with pytest.raises(CorruptJsonlError, match=rf"{bad}: line 1 is not a valid row"):
        write_report(cfg, specs)
    assert main(["--config", str(TINY), f"output_dir={tmp_path / 'study'}", "--report-only"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stapo.study: {bad}: line 1 is not a valid row") and err.count("\n") == 1
    assert not (Path(cfg.output_dir) / "report.md").exists()


def test_report_leaves_out_a_torn_last_line_and_says_so(tmp_path):
    """Defect #2: a torn last line is left out with one line naming the file; the run is reported (and listed as
    not finished) up to its last intact step."""
    cfg, specs = _study(tmp_path, "report.window=1")
    for s in specs:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 1.0)], [1, 2])
    torn = specs[0].run_dir / "metrics.jsonl"  # stapo_seed0: row 2 torn by an interrupted write, checkpoint 1
    torn.write_text(json.dumps(_row(1, 0.0)) + "\n" + json.dumps(_row(2, 1.0))[:30])
    (specs[0].run_dir / "checkpoints" / "step_000002" / "trainer_state.pt").unlink()
    said: list[str] = []
    write_report(cfg, specs, say=said.append)
    assert said == [f"{torn}: a torn last line (30 bytes, an interrupted write) is left out; stapo_seed0 is reported "
                    f"to step 1"]
    md = (Path(cfg.output_dir) / "report.md").read_text()
    assert "| stapo_seed0 | 1 | 2 |" in md and "Not finished (reported as far as they got): stapo_seed0." in md
    # its final reward (window 1: the last step any run logged, 2) is missing: stapo's final is seed 1's alone (1.0)
    final = {(r["metric"], r["method"]): r for r in csv.DictReader((Path(cfg.output_dir) / "final.csv").open())}
    assert final[("reward", "stapo")]["n_seeds"] == "1" and float(final[("reward", "stapo")]["final_mean"]) == 1.0


def test_report_keeps_the_step0_validation_point(tmp_path):
    """Defect #9: the step-0 validation row (trainer.val_before_train) is on the val_accuracy curve; training
    metrics start at step 1; the final window never reaches back to step 0."""
    cfg, specs = _study(tmp_path, "seeds=[0]", "report.window=5")
    val = "val-core/average/acc/mean@4"
    for s in specs:  # step 0: validation only (0.1); steps 1, 2 training, validation again at step 2 (0.3)
        _write_run(s.run_dir, [{"step": 0, val: 0.1, "critic/score/mean": 9.0}, _row(1, 0.0),
                               _row(2, 1.0, **{val: 0.3})], [1, 2])
    write_report(cfg, specs)
    out = Path(cfg.output_dir)
    curves = list(csv.DictReader((out / "curves.csv").open()))
    vsteps = [r["step"] for r in curves if r["metric"] == f"val_accuracy[{val}]" and r["method"] == "stapo"]
    assert vsteps == ["0", "2"]
    assert [r["step"] for r in curves if r["metric"] == "reward" and r["method"] == "stapo"] == ["1", "2"]
    final = {(r["metric"], r["method"]): r for r in csv.DictReader((out / "final.csv").open())}
    v = final[(f"val_accuracy[{val}]", "stapo")]  # window 5 → the validation steps ≥ 1: step 2 only → 0.3
    assert v["window_steps"] == "2-2" and float(v["final_mean"]) == pytest.approx(0.3)
    # reward window: steps 1–2 (step 0's stray 9.0 is not a training value) → (0 + 1) / 2
    assert float(final[("reward", "stapo")]["final_mean"]) == pytest.approx(0.5)


def test_report_final_window_counts_training_steps_not_validation_points(tmp_path):
    """The final window of a sparse metric is the last W *training* steps: validation at steps 2 and 4 of a
    4-step study with W = 2 → window 2 < t ≤ 4 → step 4 only (counting logged points would average 2 and 4)."""
    cfg, specs = _study(tmp_path, "seeds=[0]", "report.window=2")
    val = "val-core/average/acc/mean@4"
    for s in specs:  # validation 0.2 at step 2 and 0.6 at step 4; rewards 0, 0, 1, 1
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 0.0, **{val: 0.2}), _row(3, 1.0), _row(4, 1.0, **{val: 0.6})],
                   [4])
    write_report(cfg, specs)
    final = {(r["metric"], r["method"]): r for r in csv.DictReader((Path(cfg.output_dir) / "final.csv").open())}
    v = final[(f"val_accuracy[{val}]", "stapo")]
    assert v["window_steps"] == "4-4" and float(v["final_mean"]) == pytest.approx(0.6)  # not (0.2 + 0.6) / 2
    r = final[("reward", "stapo")]  # per-step metric: steps 3–4 → (1 + 1) / 2
    assert r["window_steps"] == "3-4" and float(r["final_mean"]) == pytest.approx(1.0)


def test_exit_text_names_the_signal():
    # defect #12: a negative return code is a signal
    assert study_runner.exit_text(2) == "exit 2"
    assert study_runner.exit_text(-9) == "killed by signal 9 (SIGKILL)"
    assert study_runner.exit_text(-15) == "killed by signal 15 (SIGTERM)"


HOLD_LOCK = ("import sys\nfrom stapo.run.runlock import RunLock\nRunLock(sys.argv[1], sys.argv[2]).acquire()\n"
             "print('held', flush=True)\nsys.stdin.read()\n")


def _hold(folder: Path, program: str) -> subprocess.Popen:
    """Another live process holding ``folder``'s run lock until its stdin is closed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder), program], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline() == "held\n"
    return proc


def _release(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=60)


def test_busy_run_folder_is_waited_for_not_run_beside(tmp_path, monkeypatch):
    """Defect #4 / #13d: a run folder whose lock a live train.py holds (left by a killed runner) is ``busy
    (pid N)`` in the plan — not ``restart`` — and the grid waits for it (one line), then decides."""
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    real = study_runner.train_command
    monkeypatch.setattr(study_runner, "train_command", lambda st: [sys.executable, str(fake), *real(st)[2:]])
    cfg, specs = _study(tmp_path, "seeds=[0]")
    first = specs[0].run_dir
    _write_run(first, [{"step": 1}], [])  # no checkpoint yet: without the lock this would be "restart"
    holder = _hold(first, "train.py")
    try:
        st = run_status(specs[0])
        assert st.action == "busy" and st.holder.pid == holder.pid
        plan = describe_plan(cfg, specs)
        assert f"stapo_seed0  busy     busy (pid {holder.pid}): train.py holds the run folder" in plan
        assert plan.count("$ ") == 1  # grpo_seed0 only
        waits: list[float] = []

        def sleep(seconds: float) -> None:  # the first pause: the holder exits (no real waiting in the test)
            waits.append(seconds)
            _release(holder)

        monkeypatch.setattr(study_runner, "_sleep", sleep)
        said: list[str] = []
        assert run_grid(cfg, specs, say=said.append) == 0
    finally:
        if holder.poll() is None:
            _release(holder)
    assert waits == [study_runner.BUSY_POLL_S]
    assert said[0].startswith(f"[1/2] stapo_seed0: waiting for train.py (pid {holder.pid}")
    assert said[1].startswith("[1/2] stapo_seed0: no complete checkpoint")  # decided after the holder exited
    assert [json.loads(x)["step"] for x in (first / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_report_only_is_read_only_beside_a_working_runner(tmp_path, capsys):
    """Defect #13d: --report-only works while a runner holds the study folder, takes no lock and writes nothing
    under runs/; --dry-run names the runner."""
    from stapo.study.__main__ import main

    cfg, specs = _study(tmp_path)
    for s in specs:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 1.0)], [1, 2])
    runs = Path(cfg.output_dir) / "runs"
    before = sorted((str(p), p.stat().st_mtime_ns) for p in runs.rglob("*"))
    holder = _hold(Path(cfg.output_dir), "stapo.study")
    try:
        args = ["--config", str(TINY), f"output_dir={cfg.output_dir}"]
        assert main([*args, "--report-only"]) == 0
        assert (Path(cfg.output_dir) / "report.md").is_file()
        assert main([*args, "--dry-run"]) == 0
        assert f"the study folder is in use by stapo.study (pid {holder.pid}" in capsys.readouterr().out
        assert main(args) == 2  # a second runner is still refused
        assert "is in use by stapo.study" in capsys.readouterr().err
    finally:
        _release(holder)
    assert sorted((str(p), p.stat().st_mtime_ns) for p in runs.rglob("*")) == before
    assert not list(Path(cfg.output_dir).glob(".*.tmp*"))  # the atomic writes left no temporary file


CHILD = r"""
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def on_term(*a):  # written under another name, then renamed: the test never sees a created-but-empty file
    out.joinpath("term.tmp").write_text("SIGTERM")
    os.replace(out / "term.tmp", out / "term")
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
out.joinpath("ready").write_text("")
while True:
    time.sleep(0.05)
"""

RUNNER = r"""
import pathlib, sys
from stapo.study import runner
runner._run([sys.executable, sys.argv[1], sys.argv[2]], pathlib.Path(sys.argv[2]) / "child.log", False)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_gets_sigterm_when_the_runner_is_killed(tmp_path):
    """Defect #4: a SIGKILL of the runner alone (not its process group) still stops its child: the kernel sends
    the child SIGTERM (PR_SET_PDEATHSIG), which train.py answers by checkpointing its step and exiting."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(child), str(tmp_path)], env=_env())
    deadline = time.monotonic() + 300  # generous bounds for a loaded machine; the order of events decides
    while not (tmp_path / "ready").exists():  # the child is up (its handler installed)
        assert runner.poll() is None, f"the runner exited ({runner.returncode}) before its child was up"
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    runner.kill()
    runner.wait()
    deadline = time.monotonic() + 300
    while not (tmp_path / "term").exists():
        assert time.monotonic() < deadline, "the child did not get SIGTERM when its runner died"
        time.sleep(0.05)
    assert (tmp_path / "term").read_text() == "SIGTERM"


def test_killed_run_reports_the_signal(tmp_path, monkeypatch):
    """Defect #12: a run killed by a signal is reported as such, not by the log's header line."""
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setattr(study_runner, "train_command", lambda st: [sys.executable, str(script)])
    cfg, specs = _study(tmp_path, "seeds=[0]", "runner.stop_on_error=true")  # the first run fails, the grid stops
    said: list[str] = []
    assert run_grid(cfg, specs, say=said.append) == 1
    failed = next(s for s in said if "FAILED" in s)
    assert "stapo_seed0: FAILED (killed by signal 9 (SIGKILL)) after" in failed and "===" not in failed


# --- slow: the real thing -------------------------------------------------------------------------------
def _study_cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "stapo.study", "--config", str(TINY), f"output_dir={out}"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _final_values(out: Path) -> dict[tuple[str, str], tuple[str, ...]]:
    return {(r["metric"], r["method"]): (r["n_seeds"], r["final_mean"], r["final_ci_low"], r["final_ci_high"],
                                         r["diff_mean"], r["diff_ci_low"], r["diff_ci_high"], r["n_pairs"])
            for r in csv.DictReader((out / "final.csv").open())}


@pytest.mark.slow
def test_study_sigkill_mid_grid_then_resume_gives_the_same_report(tmp_path):
    """The tiny study (2 methods × 2 seeds × 2 steps, a checkpoint every step) killed with SIGKILL — the whole
    process group, runner and train.py — once the first run has written its first checkpoint, then resumed with the same
    command; its final.csv equals that of an uninterrupted study exactly. The tiny runs are deterministic on CPU
    (same seed → same rollouts and updates; a resume restores the RNG states): checked by hand, every non-timing
    metric of a run resumed from step 1 equals the uninterrupted run's bit for bit."""
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    done = subprocess.run(_study_cmd(ref_out), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]

    proc = subprocess.Popen(_study_cmd(out), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    first = out / "runs" / "stapo_seed0"
    deadline = time.monotonic() + 600
    while latest_checkpoint(first / "checkpoints") is None and proc.poll() is None:  # its step-1 checkpoint
        assert time.monotonic() < deadline, "the first run never wrote a checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and the train.py it started (one process group)
    proc.wait()
    assert not (out / "report.md").exists()  # killed before the grid was through
    cfg = load_study_config(TINY, [f"output_dir={out}"])
    states = [run_status(s).action for s in run_specs(cfg)]
    # the first run resumes (or, had it finished in the meantime, is skipped); the next one may have started
    assert states[0] in ("resume", "skip") and states[2:] == ["new", "new"] and states[1] in ("new", "restart")

    again = subprocess.run(_study_cmd(out), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0, again.stderr[-2000:] + again.stdout[-2000:]
    assert _final_values(out) == _final_values(ref_out)
    for name in ("stapo_seed0", "grpo_seed1"):  # one metrics row per step, as uninterrupted
        steps = [json.loads(x)["step"] for x in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "study").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_study_config_loads_and_builds_its_runs(path):
    """Each configs/study/*.yaml loads under the study schema and every run's train config is built (the check
    tests/test_config.py leaves to this file)."""
    cfg = load_study_config(path)
    specs = run_specs(cfg)
    # one run per (method, seed): a method's own seeds, else the study's
    assert len(specs) == sum(len(m.seeds or cfg.seeds) for m in cfg.methods.values())


def test_quadrant_table_by_hand(tmp_path):
    # report.window=2 over 3 steps; only the low_p_low_h quadrant carries values here (the others NaN: empty)
    # stapo seed 0: share 0.1, 0.2, 0.4 ; seed 1: 0.3, NaN (empty that step), 0.6
    #   step 1: mean(0.1, 0.3) = 0.2 ; last 2 steps: seed 0 (0.2 + 0.4)/2 = 0.3, seed 1 0.6 (NaN left out) → 0.45
    # grad_norm only at step 1 of seed 0 (2.0): step 1 → 2.0, last 2 steps → NaN (no run has a value there)
    cfg, specs = _study(tmp_path, "report.window=2", "report.bootstrap_samples=200")
    by = {s.name: s for s in specs}
    key = "s2t/quadrant/low_p_low_h/"
    nan = float("nan")
    # (seed 0 starts with a step-0 validation row, which has no token statistics: "step 1" is its first training row)
    _write_run(by["stapo_seed0"].run_dir, [{"step": 0, "val-core/average/acc/mean@4": 0.1},
                                           _row(1, 0.0, **{key + "share": 0.1, key + "grad_norm": 2.0}),
                                           _row(2, 0.0, **{key + "share": 0.2}), _row(3, 0.0, **{key + "share": 0.4})],
               [1, 2, 3])
    _write_run(by["stapo_seed1"].run_dir, [_row(1, 0.0, **{key + "share": 0.3}), _row(2, 0.0, **{key + "share": nan}),
                                           _row(3, 0.0, **{key + "share": 0.6})], [1, 2, 3])
    _write_run(by["grpo_seed0"].run_dir, [_row(1, 0.0)], [1])  # logs no quadrant: no rows for grpo
    report = write_report(cfg, specs).read_text()
    rows = {(r["method"], r["phase"], r["quadrant"]): r
            for r in csv.DictReader((Path(cfg.output_dir) / "quadrants.csv").open())}
    assert {m for m, _, _ in rows} == {"stapo"}
    first, last = rows[("stapo", "step 1 (base model)", "low_p_low_h")], rows[("stapo", "last 2 steps", "low_p_low_h")]
    assert float(first["share"]) == pytest.approx(0.2) and float(last["share"]) == pytest.approx(0.45)
    assert float(first["grad_norm"]) == 2.0 and last["grad_norm"] == ""  # NaN is written as an empty cell
    assert rows[("stapo", "step 1 (base model)", "high_p_high_h")]["share"] == ""
    assert first["tokens"] == ""  # no counts logged: the plain mean of the steps, no sample size
    assert "## Token taxonomy" in report and "| stapo | last 2 steps | low_p_low_h | 0.45 |" in report


def test_quadrant_table_pools_steps_by_token_count(tmp_path):
    # one seed, 2 steps, the low_p_low_h quadrant with the counts logged:
    #   step 1: 100 tokens, 1 in the quadrant, ‖∇‖ 2.0, ΔH 0.5 ; step 2: 50 tokens, 3 in it, ‖∇‖ 1.0, ΔH −0.1
    #   pooled over both steps (report.window=2): share 4 / 150 = 0.026667 ; ‖∇‖ (1·2 + 3·1) / 4 = 1.25 (the plain
    #   mean of the steps would be 1.5) ; ΔH (0.5 − 0.3) / 4 = 0.05 ; tokens 4. Step 1 alone: share 0.01, tokens 1.
    cfg, specs = _study(tmp_path, "seeds=[0]", "report.window=2", "report.bootstrap_samples=200")
    by = {s.name: s for s in specs}
    k = "s2t/quadrant/low_p_low_h/"
    steps = [_row(1, 0.0, **{"s2t/quadrant/num_tokens": 100.0, k + "count": 1.0, k + "share": 0.01,
                             k + "grad_norm": 2.0, k + "entropy_change": 0.5}),
             _row(2, 0.0, **{"s2t/quadrant/num_tokens": 50.0, k + "count": 3.0, k + "share": 0.06,
                             k + "grad_norm": 1.0, k + "entropy_change": -0.1})]
    _write_run(by["stapo_seed0"].run_dir, steps, [2])
    write_report(cfg, specs)
    rows = {(r["method"], r["phase"], r["quadrant"]): r
            for r in csv.DictReader((Path(cfg.output_dir) / "quadrants.csv").open())}
    last = rows[("stapo", "last 2 steps", "low_p_low_h")]
    assert float(last["share"]) == pytest.approx(4 / 150) and float(last["grad_norm"]) == pytest.approx(1.25)
    assert float(last["entropy_change"]) == pytest.approx(0.05) and float(last["tokens"]) == 4.0
    assert rows[("stapo", "first 2 steps", "low_p_low_h")]["grad_norm"] == last["grad_norm"]
    first = rows[("stapo", "step 1 (base model)", "low_p_low_h")]
    assert float(first["share"]) == pytest.approx(0.01) and float(first["tokens"]) == 1.0


def test_sigint_to_the_runner_alone_reaches_the_run(tmp_path, python_default_signal_handlers):
    # `kill -INT <runner pid>` (no terminal: pytest's stdin is not one) must reach the child, which then stops as
    # train.py does on Ctrl-C; a child that already has it from the terminal would not get it twice
    import threading

    assert study_runner._terminal_sends_sigint() is False
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = ("import signal, sys, time, pathlib\n"
             f"def stop(*a):\n    pathlib.Path({str(got)!r}).write_text('SIGINT')\n    sys.exit(130)\n"
             "signal.signal(signal.SIGINT, stop)\n"
             f"pathlib.Path({str(ready)!r}).write_text('1')\n"
             "time.sleep(600)\n")

    def interrupt_when_ready():
        while not ready.exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # to the runner (this process) only

    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    rc, _, interrupted = study_runner._run([sys.executable, "-c", child], tmp_path / "log", verbose=False)
    assert (rc, interrupted, got.read_text()) == (130, True, "SIGINT")


def test_a_study_inheriting_from_another_folder_keeps_the_parents_paths(tmp_path):
    # the parent (configs/study/tiny_test.yaml) says base: ../tiny_test.yaml, relative to itself; a child in another
    # folder that starts from it must not re-resolve that against its own folder
    child = tmp_path / "elsewhere" / "mine.yaml"
    child.parent.mkdir()
    child.write_text(f"defaults: [{TINY}]\nname: mine\n")
    cfg = load_study_config(child, [f"output_dir={tmp_path / 'out'}"])
    assert cfg.base == str((REPO / "configs" / "tiny_test.yaml").resolve())
    # a path the child sets itself is relative to the child
    (tmp_path / "elsewhere" / "b.yaml").write_text((REPO / "configs" / "tiny_test.yaml").read_text())
    child.write_text(f"defaults: [{TINY}]\nname: mine\nbase: b.yaml\n")
    assert load_study_config(child).base == str(tmp_path / "elsewhere" / "b.yaml")


def test_a_malformed_override_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^override 'seeds=\[0,': the value is not valid YAML"):
        load_study_config(TINY, ["seeds=[0,"])


def test_an_empty_token_taxonomy_is_a_note_not_a_table(tmp_path):
    # every quadrant share NaN (no Â > 0 token in any step, e.g. all rewards −1): one sentence instead of n/a rows
    cfg, specs = _study(tmp_path, "report.bootstrap_samples=200")
    by = {s.name: s for s in specs}
    nan = float("nan")
    shares = {f"s2t/quadrant/{q}/share": nan for q in ("high_p_high_h", "high_p_low_h", "low_p_high_h", "low_p_low_h")}
    _write_run(by["stapo_seed0"].run_dir, [_row(1, -1.0, **shares), _row(2, -1.0, **shares)], [1, 2])
    report = write_report(cfg, specs).read_text()
    assert "No response token had Â > 0" in report and "| method | phase | quadrant |" not in report
    assert not (Path(cfg.output_dir) / "quadrants.csv").exists()


def test_an_exported_study_is_reported_and_its_finished_runs_are_not_retrained(tmp_path):
    # a finished run (checkpoint of step 2, finished.json written by the runner) and its final evaluation; the
    # export keeps the small files only; copied back without checkpoints the run is still "finished" and its
    # evaluation "done", so nothing is retrained or re-evaluated
    cfg, specs = _study(tmp_path, "final_eval.enabled=true", "final_eval.config=../eval/tiny_test.yaml")
    spec = specs[0]
    _write_run(spec.run_dir, [_row(1, 0.0), _row(2, 1.0)], [2])
    (spec.run_dir / study_runner.FINISHED).write_text(json.dumps({"steps": 2}))
    (spec.run_dir / "final_eval" / "generations").mkdir(parents=True)
    (spec.run_dir / "final_eval" / "generations" / "x.jsonl").write_text("{}\n")
    (spec.run_dir / "final_eval" / "results.json").write_text(json.dumps({"model": {"step": 2}, "metrics": {}}))
    (spec.run_dir / "wandb").mkdir()
    (spec.run_dir / "wandb" / "big").write_text("x")
    dest = tmp_path / "exported"
    written = {p.relative_to(dest).as_posix() for p in study_runner.export_study(cfg, dest)}
    run = f"runs/{spec.name}"
    assert written == {f"{run}/metrics.jsonl", f"{run}/finished.json", f"{run}/final_eval/results.json"}
    cfg2, specs2 = _study(tmp_path, "final_eval.enabled=true", "final_eval.config=../eval/tiny_test.yaml",
                          f"output_dir={dest}")
    st = run_status(specs2[0])
    assert st.action == "skip" and "checkpoints not kept" in st.reason
    assert study_runner.eval_status(specs2[0]).action == "done"
    # a marker of a smaller step (the study's total_steps raised since): the run cannot be continued without its
    # checkpoints and is refused as changed, never restarted (which deleted the folder, final evaluation included)
    (dest / run / "finished.json").write_text(json.dumps({"steps": 1}))
    st = run_status(specs2[0])
    assert st.action == "changed" and "cannot be continued" in st.reason and "--rerun-changed" in st.reason


def test_eval_after_each_run_interleaves_the_grid(tmp_path, monkeypatch):
    cfg, specs = _study(tmp_path, "final_eval.enabled=true", "final_eval.config=../eval/tiny_test.yaml",
                        "runner.eval_after_each_run=true")
    calls = []

    def fake_run(cmd, log, verbose):
        calls.append(("eval" if "evaluate.py" in cmd[1] else "train", Path(log).name))
        return 0, 0.0, False

    monkeypatch.setattr(study_runner, "_run", fake_run)
    # every run finished already except the first: its training runs, then its evaluation, then the others' evals
    for s in specs[1:]:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 0.0)], [1, 2])
    monkeypatch.setattr(study_runner, "eval_status", lambda spec: study_runner.EvalStatus(spec, "run", spec.run_dir))
    run_grid(cfg, specs, say=lambda line: None)
    assert [k for k, _ in calls] == ["train", "eval", "eval", "eval", "eval"]
    # the runs skipped as finished got their finished.json (their folders can now be exported without checkpoints)
    assert all(json.loads((s.run_dir / study_runner.FINISHED).read_text()) == {"steps": 2} for s in specs[1:])
    assert calls[1][1] == f"{specs[0].name}.eval.log"


def test_report_refuses_foreign_rows_and_non_numbers(tmp_path, capsys):
    """A row beyond the run's own trainer.total_steps (config.json), or a metric value that is not a number or null,
    is not something train.py writes: the report stops with one line naming file, row and key, rather than letting
    it move a final window or drop a value silently."""
    from stapo.study.__main__ import main
    from stapo.run.tracking import CorruptJsonlError

    cfg, specs = _study(tmp_path)
    for s in specs:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 1.0)], [1, 2])
        (s.run_dir / "config.json").write_text(json.dumps({"trainer": {"total_steps": 2}}))
    path = specs[0].run_dir / "metrics.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(_row(999, 5.0)) + "\n")
    with pytest.raises(CorruptJsonlError, match=rf"{path}: row 3 has step 999, outside 0..2, the run's "
                                                 r"trainer.total_steps \(config.json\)"):
        write_report(cfg, specs)
    path.write_text("".join(json.dumps(_row(step, 0.0)) + "\n" for step in (-5, 1, 2)))
    with pytest.raises(CorruptJsonlError, match=r"row 1 has step -5, outside 0..2"):
        write_report(cfg, specs)
    path.write_text(json.dumps(_row(1, 0.0)) + "\n" + json.dumps({**_row(2, 1.0), "actor/entropy": True}) + "\n")
    with pytest.raises(CorruptJsonlError, match=r"row 2 \(step 2\): actor/entropy = true is not a number"):
        write_report(cfg, specs)
    path.write_text(json.dumps(_row(1, 0.0)) + "\n" + json.dumps({**_row(2, 1.0), "actor/entropy": "1.83x"}) + "\n")
    with pytest.raises(CorruptJsonlError, match=r'row 2 \(step 2\): actor/entropy = "1.83x" is not a number'):
        write_report(cfg, specs)
    assert main(["--config", str(TINY), f"output_dir={tmp_path / 'study'}", "--report-only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'actor/entropy = "1.83x" is not a number' in err and str(path) in err
    # null is a step that did not log the key (kept: NaN-aware means), not an error
    path.write_text(json.dumps(_row(1, 0.0)) + "\n" + json.dumps({**_row(2, 1.0), "actor/entropy": None}) + "\n")
    assert write_report(cfg, specs).is_file()


def test_report_notes_assumed_threads_bad_attempt_lines_and_unevaluated_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg, specs = _study(tmp_path, "runner.threads=2", "final_eval.enabled=true",
                        "final_eval.config=../eval/tiny_test.yaml", "overrides=[trainer.total_steps=2]")
    for s in specs:
        _write_run(s.run_dir, [_row(1, 0.0), _row(2, 1.0)], [1, 2])  # 3600 s per step
        (s.run_dir / "run_info.json").write_text(json.dumps({"launches": [
            {"start_step": 0, "machine": "box, 2 cores, torch 2.13.0+cpu, 2 threads"}]}))
        (s.run_dir / "final_eval").mkdir()
        (s.run_dir / "final_eval" / "results.json").write_text(json.dumps(
            {"model": {"step": 2}, "metrics": {"t1.0_p1.0": {"average": {"avg@N": 0.5}, "benchmarks": {}}}}))
    by = {s.name: s for s in specs}
    (by["stapo_seed1"].run_dir / "run_info.json").write_text("{damaged")
    (by["grpo_seed0"].run_dir / "final_eval" / "results.json").unlink()
    out = Path(cfg.output_dir)
    # one good attempt of 3600 s with 2 threads, one damaged line, one blank line (ignored without a word)
    (out / "attempts.jsonl").write_text('{"run": "x", "wall_s": 3600, "threads": 2}\n{"run": "y", "wall\n\n')
    md = write_report(cfg, specs).read_text()
    assert ("threads not recorded (run_info.json missing, damaged or without a thread count): stapo_seed1; the "
            "cost line counts their steps at 2 threads") in md
    assert "attempts.jsonl: 1 line(s) that are not attempt records are left out of the runner wall time" in md
    assert "runner wall time (recorded attempts) 1.00 h = 2.00 CPU-hours" in md
    assert "Finished without a final evaluation of their last checkpoint" in md and ": grpo_seed0." in md
