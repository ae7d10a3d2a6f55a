"""A study reuses runs by content, not by folder name, and never deletes a finished run (stapo/study/runner.py,
stapo/run/run_identity.py).

Each case was silently wrong before:

1. A finished study whose YAML or overrides changed since (lr, objective, rollout.n, model path) was rerun with exit
   0, every run skipped as finished, the report rewritten from the old runs. Now the runner refuses before running
   anything, in one line naming each run and the differing keys (exit 2), or retrains them into fresh folders with
   ``--rerun-changed``, the old folders moved to ``superseded/``.
2. A run folder that is a symlink to, or a copy of, another run counted as an independent seed; a ``config.json``
   edited by hand (another model) was taken at its word.
3. Raising ``trainer.total_steps`` on an exported grid (``finished.json``, no checkpoints) deleted each finished
   run's folder, final evaluation included, and retrained it from scratch; a run killed before its first checkpoint
   had its folder deleted too. Now nothing is deleted: a run with checkpoints is continued from its last one, an
   exported one is refused (or retrained into a fresh folder on request), a partial one is moved aside.
4. The report's notes said the methods differ in a key (from the changed plan) that the recorded runs do not.

Run folders are built by hand as train.py leaves them (config.json of the resolved config, fingerprint.json,
metrics, a checkpoint = ``checkpoints/step_N/trainer_state.pt``, as in tests/test_study.py); train.py is replaced by
tests/test_study.py's small script of the same contract where a run must run.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from stapo.config import to_dict
from stapo.common.fingerprint import model_digest, write_fingerprint
from stapo.run.run_identity import run_fingerprint
from stapo.study import run_grid, run_status, write_report
from stapo.study import runner as study_runner
from stapo.study.runner import RunIdentityError, describe_plan, run_identity_problems

from test_study import FAKE_TRAIN, REPO, TINY, _study, _write_run

SHARED = "overrides=[trainer.total_steps=2,trainer.save_every=1,trainer.log_examples_every=0"
_REAL_RUN = study_runner._run


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _finish(spec, *, ckpt: bool = True, fingerprint: bool = True, final_eval: bool = False) -> None:
    """A finished 2-step run as train.py and the runner leave it; ``ckpt=False``: exported (no checkpoints)."""
    _write_run(spec.run_dir, [{"step": s, "critic/score/mean": 0.25 * s * (spec.seed + 1)} for s in (1, 2)],
               [2] if ckpt else [])
    (spec.run_dir / "config.json").write_text(json.dumps(to_dict(spec.train), indent=2))
    if fingerprint:
        write_fingerprint(spec.run_dir, run_fingerprint(spec.train))
    (spec.run_dir / study_runner.FINISHED).write_text(json.dumps({"steps": 2}) + "\n")
    if final_eval:
        (spec.run_dir / "final_eval").mkdir()
        (spec.run_dir / "final_eval" / "results.json").write_text(json.dumps({"model": {"step": 2}, "metrics": {}}))


def _no_runs(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(study_runner, "_run", lambda cmd, log, verbose: calls.append(cmd) or (0, 0.0, False))
    return calls


def _fake_train(monkeypatch, tmp_path: Path) -> None:
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    real = study_runner.train_command
    monkeypatch.setattr(study_runner, "train_command", lambda st: [sys.executable, str(fake), *real(st)[2:]])


# --- 1. a changed plan ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, diff", [
    ("actor.lr=0.002", "actor.lr: 0.001 → 0.002"),
    ("rollout.n=2", "rollout.n: 4 → 2"),
    ("algorithm.objective=grpo", "algorithm.objective: 'stapo' → 'grpo'"),
    ("model.path=/models/other", "model.path: 'tiny' → '/models/other'"),
])
def test_finished_runs_of_a_changed_plan_are_refused_in_one_line_not_reused(tmp_path, monkeypatch, override, diff):
    cfg, specs = _study(tmp_path)
    for spec in specs:
        _finish(spec)
    before = _snapshot(tmp_path / "study")
    cfg2, specs2 = _study(tmp_path, f"methods.stapo.overrides=[algorithm.objective=stapo,{override}]")
    calls = _no_runs(monkeypatch)
    with pytest.raises(RunIdentityError) as e:
        run_grid(cfg2, specs2, say=lambda line: None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("2 runs of study tiny_test are not what the study would run now")
    # both runs differ in the same key: the reason is said once, naming both (the line stays short)
    assert f"stapo_seed0, stapo_seed1: its recorded config differs from the study's plan: {diff}" in msg, msg
    assert msg.count("its recorded config differs") == 1
    assert "grpo_seed" not in msg and "--rerun-changed" in msg and msg.endswith("nothing was run")
    assert calls == [] and _snapshot(tmp_path / "study") == before  # nothing ran, moved or written
    assert [run_status(s, specs2).action for s in specs2] == ["changed", "skip", "changed", "skip"]
    assert "refused" in describe_plan(cfg2, specs2)


def test_the_cli_refuses_a_changed_plan_with_exit_2(tmp_path, monkeypatch, capsys):
    from stapo.study.__main__ import main

    cfg, specs = _study(tmp_path)
    for spec in specs:
        _finish(spec)
    _no_runs(monkeypatch)
    args = ["--config", str(TINY), f"output_dir={cfg.output_dir}", "methods.grpo.overrides=[algorithm.objective=grpo,"
            "actor.lr=0.002]"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err and "grpo_seed0, grpo_seed1: its recorded config differs" in err
    assert not (Path(cfg.output_dir) / "report.md").exists()  # no report rewritten from the old runs


def test_rerun_changed_trains_afresh_into_a_new_folder_and_keeps_the_old(tmp_path, monkeypatch):
    cfg, specs = _study(tmp_path)
    for spec in specs:
        _finish(spec, final_eval=True)
    old = {s.name: _snapshot(s.run_dir) for s in specs}
    _fake_train(monkeypatch, tmp_path)
    cfg2, specs2 = _study(tmp_path, "methods.grpo.overrides=[algorithm.objective=grpo,actor.lr=0.002]")
    said: list[str] = []
    assert run_grid(cfg2, specs2, say=said.append, rerun_changed=True) == 0
    superseded = Path(cfg.output_dir) / study_runner.SUPERSEDED
    assert sorted(p.name for p in superseded.iterdir()) == ["grpo_seed0", "grpo_seed1"]
    for name in ("grpo_seed0", "grpo_seed1"):
        assert _snapshot(superseded / name) == old[name]  # kept whole, final evaluation included
        assert any(f"{name}: its recorded config differs" in s and f"moved to {superseded / name} (kept)" in s
                   for s in said), said
    for spec in specs2:
        rows = [json.loads(x) for x in (spec.run_dir / "metrics.jsonl").read_text().splitlines()]
        if spec.method == "grpo":  # trained afresh by the fake train.py (no --resume)
            assert [(r["step"], r["resumed_from"]) for r in rows] == [(1, 0), (2, 0)]
        else:
            assert _snapshot(spec.run_dir) == old[spec.name]  # unchanged: skipped
    attempts = [json.loads(x) for x in (Path(cfg.output_dir) / "attempts.jsonl").read_text().splitlines()]
    assert [(a["run"], a["action"]) for a in attempts] == [("grpo_seed0", "rerun"), ("grpo_seed1", "rerun")]


def test_keys_of_how_a_run_computes_are_tolerated_and_named(tmp_path):
    cfg, specs = _study(tmp_path, "seeds=[0]")
    for spec in specs:
        _finish(spec)
    cfg2, specs2 = _study(tmp_path, "seeds=[0]", f"{SHARED},actor.ppo_micro_batch_size=2]")
    st = run_status(specs2[0], specs2)
    assert st.action == "skip" and "recorded with actor.ppo_micro_batch_size: 3 → 2 (how it is computed" in st.reason


# --- 2. copies, links and edited configs ----------------------------------------------------------------------
@pytest.mark.parametrize("fingerprint", [True, False], ids=["fingerprinted", "before_fingerprints"])
def test_a_copy_of_another_seed_is_a_duplicate_not_an_independent_seed(tmp_path, monkeypatch, fingerprint):
    cfg, specs = _study(tmp_path)
    by = {s.name: s for s in specs}
    for spec in specs:
        if spec.name != "grpo_seed1":
            _finish(spec, fingerprint=fingerprint)
    shutil.copytree(by["grpo_seed0"].run_dir, by["grpo_seed1"].run_dir)
    problems = run_identity_problems(by["grpo_seed1"], specs)
    why = "identical fingerprint.json: config, model, data and seed" if fingerprint else \
        "identical config.json and metrics.jsonl"
    assert f"grpo_seed1: the same run as grpo_seed0 ({why}): a copy counts once, not as an independent seed" \
        in problems, problems
    assert any("trainer.seed: 0 → 1" in p for p in problems)  # and its config is not the plan's seed 1
    assert run_identity_problems(by["grpo_seed0"], specs) == []  # the original names its own folder
    # by folder alone (no plan), as a report or claims reader may call it
    assert any("the same run as grpo_seed0" in p
               for p in run_identity_problems(by["grpo_seed1"].run_dir, [s.run_dir for s in specs]))
    _no_runs(monkeypatch)
    with pytest.raises(RunIdentityError, match="grpo_seed1: the same run as grpo_seed0"):
        run_grid(cfg, specs, say=lambda line: None)


def test_a_symlinked_run_folder_is_refused(tmp_path, monkeypatch):
    cfg, specs = _study(tmp_path)
    by = {s.name: s for s in specs}
    for spec in specs:
        if spec.name != "stapo_seed1":
            _finish(spec)
    os.symlink(by["stapo_seed0"].run_dir, by["stapo_seed1"].run_dir)
    st = run_status(by["stapo_seed1"], specs)
    assert st.action == "changed" and f"is a symlink to {by['stapo_seed0'].run_dir}" in st.reason
    _no_runs(monkeypatch)
    with pytest.raises(RunIdentityError, match="stapo_seed1: the run folder .* is a symlink"):
        run_grid(cfg, specs, say=lambda line: None)
    _fake_train(monkeypatch, tmp_path)
    monkeypatch.setattr(study_runner, "_run", _REAL_RUN)
    assert run_grid(cfg, specs, say=lambda line: None, rerun_changed=True) == 0
    link = Path(cfg.output_dir) / study_runner.SUPERSEDED / "stapo_seed1"
    assert link.is_symlink() and by["stapo_seed0"].run_dir.is_dir()  # the link moved aside, its target untouched
    assert not by["stapo_seed1"].run_dir.is_symlink() and (by["stapo_seed1"].run_dir / "metrics.jsonl").is_file()



@pytest.mark.parametrize("fingerprint", [True, False], ids=["fingerprinted", "before_fingerprints"])
def test_a_config_json_edited_to_another_model_is_named(tmp_path, fingerprint):
    cfg, specs = _study(tmp_path, "seeds=[0]")
    spec = specs[0]
    _finish(spec, fingerprint=fingerprint)
    config = json.loads((spec.run_dir / "config.json").read_text())
    config["model"]["path"] = "/models/other"
    (spec.run_dir / "config.json").write_text(json.dumps(config, indent=2))
    problems = run_identity_problems(spec, specs)
    assert f"{spec.name}: its recorded config differs from the study's plan: model.path: '/models/other' → 'tiny'" \
        in problems
    edited = f"{spec.name}: {spec.run_dir / 'config.json'} is not the config its fingerprint.json records"
    assert any(p.startswith(edited) for p in problems) == fingerprint
    assert run_identity_problems(spec.run_dir) == ([p for p in problems if p.startswith(edited)])


def test_replaced_model_weights_or_training_rows_under_the_same_paths_are_named(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1 + 1?", "answer": "2"}\n')
    cfg, specs = _study(tmp_path, "seeds=[0]", f"{SHARED},model.path={model},data.train_set=file,"
                        f"data.train_file.path={data}]")
    spec = specs[0]
    _finish(spec)
    assert run_identity_problems(spec, specs) == []
    assert json.loads((spec.run_dir / "fingerprint.json").read_text())["model"] == model_digest(model)
    (model / "model.safetensors").write_bytes(b"\x01" * 64)
    data.write_text('{"problem": "1 + 1?", "answer": "3"}\n')
    problems = run_identity_problems(spec, specs)
    assert problems == [
        f"{spec.name}: the model of model.path ({model}; {model}) is not the one it was trained from (its weights or "
        f"config files changed since: fingerprint.json model)",
        f"{spec.name}: the training data of data.train_file.path ({data}) changed since it was trained "
        f"(fingerprint.json data)"]
    assert run_identity_problems(spec, specs, check_inputs=False) == []


# --- 3. nothing finished is deleted -----------------------------------------------------------------------------
def test_raising_total_steps_continues_runs_from_their_last_checkpoint(tmp_path, monkeypatch):
    cfg, specs = _study(tmp_path, "seeds=[0]", "final_eval.enabled=true", "final_eval.config=../eval/tiny_test.yaml")
    for spec in specs:
        _finish(spec, final_eval=True)
    cfg3, specs3 = _study(tmp_path, "seeds=[0]", "final_eval.enabled=true", "final_eval.config=../eval/tiny_test.yaml",
                          f"{SHARED.replace('total_steps=2', 'total_steps=3')}]")
    assert [run_status(s, specs3).action for s in specs3] == ["resume", "resume"]
    _fake_train(monkeypatch, tmp_path)
    real = study_runner._run
    monkeypatch.setattr(study_runner, "_run", lambda cmd, log, verbose: (0, 0.0, False) if "evaluate.py" in cmd[1]
                        else real(cmd, log, verbose))
    said: list[str] = []
    assert run_grid(cfg3, specs3, say=said.append) == 0
    for spec in specs3:
        rows = [json.loads(x) for x in (spec.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [(r["step"], r.get("resumed_from")) for r in rows] == [(1, None), (2, None), (3, 2)]
        kept = spec.run_dir / "final_eval.step_000002" / "results.json"  # the step-2 evaluation moved aside, kept
        assert json.loads(kept.read_text())["model"]["step"] == 2
    assert not (Path(cfg.output_dir) / study_runner.SUPERSEDED).exists()


def test_raising_total_steps_on_an_exported_grid_deletes_nothing(tmp_path, monkeypatch):
    cfg, specs = _study(tmp_path, "seeds=[0]")
    for spec in specs:
        _finish(spec, ckpt=False, final_eval=True)  # exported: finished.json, final evaluation, no checkpoints
    before = {s.name: _snapshot(s.run_dir) for s in specs}
    cfg3, specs3 = _study(tmp_path, "seeds=[0]", f"{SHARED.replace('total_steps=2', 'total_steps=3')}]")
    st = run_status(specs3[0], specs3)
    assert st.action == "changed" and "finished at step 2, the study now plans 3 steps" in st.reason
    calls = _no_runs(monkeypatch)
    with pytest.raises(RunIdentityError, match="cannot be continued"):
        run_grid(cfg3, specs3, say=lambda line: None)
    assert calls == [] and {s.name: _snapshot(s.run_dir) for s in specs3} == before
    # on request: trained afresh into a fresh folder, the finished one (final evaluation included) kept aside
    _fake_train(monkeypatch, tmp_path)
    monkeypatch.setattr(study_runner, "_run", _REAL_RUN)
    assert run_grid(cfg3, specs3, say=lambda line: None, rerun_changed=True) == 0
    for spec in specs3:
        assert _snapshot(Path(cfg.output_dir) / study_runner.SUPERSEDED / spec.name) == before[spec.name]
        assert run_status(spec).action == "skip"


def test_a_run_killed_before_its_first_checkpoint_is_moved_aside_not_deleted(tmp_path, monkeypatch):
    cfg, specs = _study(tmp_path, "seeds=[0]")
    _write_run(specs[0].run_dir, [{"step": 1, "stale": True}], [])
    _finish(specs[1])
    _fake_train(monkeypatch, tmp_path)
    said: list[str] = []
    assert run_grid(cfg, specs, say=said.append) == 0
    kept = Path(cfg.output_dir) / study_runner.SUPERSEDED / specs[0].name
    assert json.loads((kept / "metrics.jsonl").read_text()) == {"step": 1, "stale": True}
    assert any(f"no complete checkpoint: the folder is moved to {kept} (kept)" in s for s in said), said
    assert "stale" not in (specs[0].run_dir / "metrics.jsonl").read_text()


def test_no_deletion_is_left_in_the_runner():
    src = (REPO / "stapo" / "study" / "runner.py").read_text()
    assert "rmtree" not in src and ".unlink(" not in src and "os.remove" not in src


# --- 4. the report's notes --------------------------------------------------------------------------------------
def test_report_notes_describe_the_recorded_runs_not_a_changed_plan(tmp_path):
    cfg, specs = _study(tmp_path, "seeds=[0]")
    for spec in specs:
        _finish(spec)
    cfg2, specs2 = _study(tmp_path, "seeds=[0]", "methods.stapo.overrides=[algorithm.objective=stapo,rollout.n=2]")
    write_report(cfg2, specs2, say=lambda line: None)
    md = (Path(cfg.output_dir) / "report.md").read_text()
    assert "differ in" not in md  # before: "seed 0: the methods differ in rollout.n", which the runs do not
    # a real difference in the recorded runs is still named: stapo_seed0 trained as the changed plan says
    shutil.rmtree(specs2[0].run_dir)
    _finish(specs2[0])
    write_report(cfg2, specs2, say=lambda line: None)
    assert "seed 0: the methods differ in rollout.n" in (Path(cfg.output_dir) / "report.md").read_text()


# --- the committed results ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not (REPO / "results" / "study_cpu" / "grid" / "runs").is_dir(), reason="no committed grid")
def test_the_committed_grid_made_before_fingerprints_has_no_identity_problem():
    from stapo.study import load_study_config, run_specs

    cfg = load_study_config(REPO / "configs" / "study" / "cpu_reproduction.yaml",
                            [f"output_dir={REPO / 'results' / 'study_cpu' / 'grid'}"])
    specs = run_specs(cfg)
    assert [p for s in specs for p in run_identity_problems(s, specs, check_inputs=False)] == []
    assert {run_status(s, specs).action for s in specs} == {"skip"}
