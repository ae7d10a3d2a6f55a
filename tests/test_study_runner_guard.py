"""The study runner's guards (stapo/study/runner.py): a damaged metrics line never restarts (deletes) a run, and
the exit code after a signal names the signal.

1. A run folder whose ``metrics.jsonl`` has a damaged line that is not its torn last line — e.g. a finished run of
   an exported grid (``finished.json``, final evaluation, no checkpoints) — was planned as ``restart`` ("metrics
   logged to step 0", the folder deleted and the run retrained), or with a final checkpoint as ``skip`` with "the
   metrics row of steps 1-2 is lost" when only step 1's line was damaged. Now the runner and ``--dry-run`` stop
   before running anything, in one line naming the file and the line (exit 2), as the report does; a torn last
   line keeps its handling.
2. SIGTERM to the runner while its run dies of it (rc -15) exited 130, not 143; a run that finished while the
   runner was being stopped got no ``finished.json`` and the runner exited 130 for a SIGTERM.

The run folders are built by hand (a checkpoint = ``checkpoints/step_N/trainer_state.pt``, as in
tests/test_study.py); no model is trained.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo.study import describe_plan, run_grid, run_status
from stapo.study import runner as study_runner
from stapo.run.tracking import CorruptJsonlError

from test_study import REPO, TINY, _study, _write_run  # the study tests' tiny config and hand-built run folders


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


DAMAGED = '{"step": 1, trunc'  # a complete line (newline-terminated) that is not a row: not a torn last line


def _damaged_run(run_dir: Path, ckpt_steps: list[int], finished: bool) -> Path:
    """A run of 2 steps whose line 1 (step 1) is damaged and line 2 (step 2) intact; with ``finished`` the runner's
    finished.json and a final evaluation (an exported, finished run: checkpoints not kept)."""
    _write_run(run_dir, [{"step": 2, "critic/score/mean": 0.5}], ckpt_steps)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(DAMAGED + "\n" + metrics.read_text())
    if finished:
        (run_dir / study_runner.FINISHED).write_text(json.dumps({"steps": 2}) + "\n")
        (run_dir / "final_eval").mkdir()
        (run_dir / "final_eval" / "results.json").write_text(json.dumps({"metrics": {}, "model": {"step": 2}}))
    return metrics


CASES = {  # how the damaged run was planned before the fix
    "finished_no_checkpoints": ([], True),  # restart: "metrics logged to step 0", the folder deleted, retrained
    "final_checkpoint": ([2], False),       # skip: "the metrics row of steps 1-2 is lost" (only step 1 was damaged)
    "earlier_checkpoint": ([1], False),     # resume: "metrics logged to step 0"
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_middle_line_stops_the_plan_and_the_runner_before_anything_runs(tmp_path, monkeypatch, case):
    ckpts, finished = CASES[case]
    cfg, specs = _study(tmp_path, "seeds=[0]")  # stapo_seed0 (new: would run first), grpo_seed0 (damaged)
    new, damaged = specs
    metrics = _damaged_run(damaged.run_dir, ckpts, finished)
    before = _snapshot(damaged.run_dir)

    with pytest.raises(CorruptJsonlError) as e:
        run_status(damaged)
    msg = str(e.value)
    assert msg.startswith(f"{metrics}: line 1 is not a valid row") and "\n" not in msg
    assert "step 0" not in msg and "lost" not in msg and "move the file away" not in msg
    assert "delete or repair that line and rerun" in msg and msg.endswith("nothing was run")
    with pytest.raises(CorruptJsonlError, match="line 1 is not a valid row"):
        describe_plan(cfg, specs)

    calls: list[list[str]] = []
    monkeypatch.setattr(study_runner, "_run", lambda cmd, log, verbose: calls.append(cmd) or (0, 0.0, False))
    said: list[str] = []
    with pytest.raises(CorruptJsonlError, match="line 1 is not a valid row"):
        run_grid(cfg, specs, say=said.append)
    assert calls == [] and said == []  # nothing ran, not even the new run before it in grid order
    assert not new.run_dir.exists() and not (Path(cfg.output_dir) / study_runner.ATTEMPTS).exists()
    assert _snapshot(damaged.run_dir) == before  # the folder is kept byte for byte (never deleted)


def test_the_cli_refuses_a_damaged_line_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    """python -m stapo.study --dry-run and the runner itself: one line on stderr naming the file and the line,
    exit 2, no traceback, nothing run or deleted (before: --dry-run listed `restart` and exited 0, the runner
    deleted the finished run's folder and retrained it)."""
    from stapo.study.__main__ import main

    cfg, specs = _study(tmp_path, "seeds=[0]")
    metrics = _damaged_run(specs[1].run_dir, [], finished=True)
    before = _snapshot(specs[1].run_dir)
    args = ["--config", str(TINY), f"output_dir={cfg.output_dir}", "seeds=[0]"]
    assert main([*args, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"stapo.study: {metrics}: line 1 is not a valid row")

    monkeypatch.setattr(study_runner, "_run", lambda *a: pytest.fail(f"a run was started: {a[0]}"))
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"stapo.study: {metrics}: line 1 is not")
    assert _snapshot(specs[1].run_dir) == before and not specs[0].run_dir.exists()


def test_a_torn_last_line_keeps_its_handling(tmp_path, monkeypatch):
    """An unterminated last line (a crash mid-write) is no error: with the final checkpoint the run is finished
    and the plan names the one lost row (step 2, not "steps 1-2"); with an earlier one it resumes."""
    cfg, specs = _study(tmp_path, "seeds=[0]")
    stapo, grpo = specs
    _write_run(stapo.run_dir, [{"step": 1}], [2])
    _write_run(grpo.run_dir, [{"step": 1}], [1])
    for spec in specs:
        with (spec.run_dir / "metrics.jsonl").open("a") as f:
            f.write('{"step": 2, "critic/sc')  # torn: 22 bytes, no newline
    st = run_status(stapo)
    assert (st.action, st.logged_step) == ("skip", 1)
    assert "holds rows only to step 1: the metrics row of step 2 is lost" in st.reason
    assert "torn line of 22 bytes" in st.reason
    st = run_status(grpo)
    assert st.action == "resume" and "(metrics logged to step 1)" in st.reason
    calls: list[str] = []
    monkeypatch.setattr(study_runner, "_run", lambda cmd, log, verbose: calls.append(Path(log).name) or (0, 0.0, False))
    assert run_grid(cfg, specs, say=lambda line: None) == 0
    assert calls == ["grpo_seed0.log"]


def test_a_finished_exported_run_with_a_torn_last_line_is_never_retrained(tmp_path, monkeypatch):
    """finished.json (the runner's record; an exported grid keeps no checkpoints) counts as the final checkpoint
    does: a torn last line loses that row only, the run is skipped, its folder kept (before: `restart`, deleted)."""
    cfg, specs = _study(tmp_path, "seeds=[0]")
    stapo, grpo = specs
    _write_run(grpo.run_dir, [{"step": 1}], [])
    (grpo.run_dir / study_runner.FINISHED).write_text(json.dumps({"steps": 2}) + "\n")
    with (grpo.run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "critic/sc')  # torn: no newline
    before = _snapshot(grpo.run_dir)
    st = run_status(grpo)
    assert st.action == "skip" and "finished (step 2/2), but metrics.jsonl holds rows only to step 1" in st.reason
    calls: list[str] = []
    monkeypatch.setattr(study_runner, "_run", lambda cmd, log, verbose: calls.append(Path(log).name) or (0, 0.0, False))
    run_grid(cfg, specs, say=lambda line: None)
    assert "grpo_seed0.log" not in calls and _snapshot(grpo.run_dir) == before


# --- the exit code after a signal ---------------------------------------------------------------------------
@pytest.mark.parametrize("rc, code", [(-signal.SIGTERM, 143), (143, 143), (-signal.SIGINT, 130), (130, 130)])
def test_the_exit_code_of_an_interrupted_run_names_its_signal(tmp_path, monkeypatch, rc, code):
    """A run killed by SIGTERM (subprocess's rc -15, or train.py's exit 143) → 143; by SIGINT (-2, 130) → 130
    (before: 130 for rc -15)."""
    cfg, specs = _study(tmp_path, "seeds=[0]")
    Path(cfg.output_dir).mkdir(parents=True)  # (the real _run makes it, for the run's log)
    monkeypatch.setattr(study_runner, "_run", lambda cmd, log, verbose: (rc, 0.0, True))
    said: list[str] = []
    assert run_grid(cfg, specs, say=said.append) == code
    assert said[-1].startswith("[1/2] stapo_seed0: interrupted (")  # the grid stopped at the first run


RUNNER = r"""
import sys
from stapo.run.cli import sigterm_as_interrupt
from stapo.study import load_study_config, run_specs
from stapo.study import runner
tiny, out, child, mode = sys.argv[1:]
cfg = load_study_config(tiny, [f"output_dir={out}", "seeds=[0]"])
runner.train_command = lambda st: [sys.executable, child, str(st.spec.run_dir), str(st.spec.total_steps), mode]
sigterm_as_interrupt()  # as python -m stapo.study does
sys.exit(runner.run_grid(cfg, run_specs(cfg)))
"""

CHILD = r"""
import json, os, pathlib, signal, sys, time
run, total, mode = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
run.mkdir(parents=True, exist_ok=True)
def finish(*a):  # the run was on its last step when the signal came: it logs it and exits 0
    with open(run / "metrics.jsonl", "a") as f:
        for step in range(1, total + 1):
            f.write(json.dumps({"step": step}) + "\n")
    d = run / "checkpoints" / f"step_{total:06d}"
    d.mkdir(parents=True)
    (d / "trainer_state.pt").write_bytes(b"x")
    sys.exit(0)
if mode == "finish":
    signal.signal(signal.SIGTERM, finish)
# mode "die": SIGTERM's default action kills it (the runner sees rc -15)
(run.parent / "ready.tmp").write_text("")
os.replace(run.parent / "ready.tmp", run.parent / "ready")
while True:
    time.sleep(0.05)
"""


def _sigterm_runner(tmp_path: Path, mode: str) -> tuple[int, str, Path]:
    """A runner (its own process, as python -m stapo.study) of a 2-run grid whose first run is ``CHILD``; once the
    child is up, SIGTERM to the runner alone (it passes it on). Returns (runner's exit code, its output, out)."""
    child, out = tmp_path / "child.py", tmp_path / "study"
    child.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(TINY), str(out), str(child), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = out / "runs" / "ready"
    deadline = time.monotonic() + 300  # generous for a loaded machine; the order of events decides
    try:
        while not ready.exists():
            assert proc.poll() is None, f"the runner exited ({proc.returncode}): {proc.stdout.read()[-2000:]}"
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, output, out


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_sigterm_to_the_runner_whose_run_dies_of_it_exits_143(tmp_path):
    rc, output, out = _sigterm_runner(tmp_path, "die")
    assert rc == 143, output  # before: 130
    assert "stapo_seed0: interrupted (killed by signal 15 (SIGTERM))" in output
    attempts = [json.loads(x) for x in (out / study_runner.ATTEMPTS).read_text().splitlines()]
    assert [(a["run"], a["rc"]) for a in attempts] == [("stapo_seed0", -15)]  # the grid stopped: grpo not started


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_a_run_that_finishes_while_the_runner_is_stopped_is_finished(tmp_path):
    """docs/study.md: a run that was already finishing when the signal came is reported as finished (and gets its
    finished.json, so an export without checkpoints is not retrained); the runner exits 143 for SIGTERM (before:
    130, and no finished.json)."""
    rc, output, out = _sigterm_runner(tmp_path, "finish")
    assert rc == 143, output
    assert "stapo_seed0: finished, then the study stopped" in output
    run = out / "runs" / "stapo_seed0"
    assert json.loads((run / study_runner.FINISHED).read_text()) == {"steps": 2}
    assert not (out / "runs" / "grpo_seed0").exists()
