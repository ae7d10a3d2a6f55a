"""Run a study's grid with train.py (and evaluate.py), one subprocess per run, resumable at any point.

Each run is ``train.py`` in its own subprocess (a crash or a SIGKILL of one run loses nothing of the others) with
its output in ``<output_dir>/logs/<run>.log``; runs go one after another in :func:`stapo.study.config.run_specs`
order. Before each run its folder decides what to do (:func:`run_status`):

- ``skip``: finished — ``metrics.jsonl`` reaches ``trainer.total_steps`` and the checkpoint of that step exists;
- ``resume``: a complete checkpoint of an earlier step exists — ``train.py ... --resume`` continues from it;
- ``restart``: the folder holds no complete checkpoint (killed before its first save): it is deleted (one line
  says so; nothing in it could be resumed) and the run starts afresh;
- ``new``: no folder yet.

The same for the optional final evaluation (``final_eval``): done when ``<run>/final_eval/results.json`` exists
(evaluate.py writes it at the end), else ``evaluate.py`` (which resumes its own generations). Every attempt is appended to
``<output_dir>/attempts.jsonl`` (run, kind, action, exit code, wall seconds, threads) for the report's cost line.
The study folder is locked for the runner's lifetime (``<output_dir>/run.lock``, :mod:`stapo.runlock`).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Literal

from stapo.checkpoint_files import latest_checkpoint
from stapo.study.config import RunSpec, StudyConfig
from stapo.tracking import CorruptJsonlError, read_jsonl_rows

__all__ = ["REPO", "RunStatus", "EvalStatus", "run_status", "eval_status", "train_command", "eval_command",
           "describe_plan", "run_grid", "ATTEMPTS"]

#: The repository root: train.py and evaluate.py live there.
REPO = Path(__file__).resolve().parents[2]
ATTEMPTS = "attempts.jsonl"
EVAL_DIR = "final_eval"
_STEP = re.compile(r"^step_(\d+)$")

Action = Literal["skip", "resume", "restart", "new"]


@dataclass(frozen=True)
class RunStatus:
    """What a run's folder says (:func:`run_status`).

    Attributes:
        spec: the run.
        action: ``skip`` | ``resume`` | ``restart`` | ``new`` (module docstring).
        checkpoint_step: the step of its latest complete checkpoint (0: none).
        logged_step: the last step in its ``metrics.jsonl`` (0: none).
        reason: one phrase for the plan's listing.
    """

    spec: RunSpec
    action: Action
    checkpoint_step: int
    logged_step: int
    reason: str


@dataclass(frozen=True)
class EvalStatus:
    """The final evaluation of a run: ``done`` (results.json written), ``run`` (to run or resume), ``wait``
    (its training run is not finished)."""

    spec: RunSpec
    action: Literal["done", "run", "wait"]
    output: Path


def _last_logged_step(run_dir: Path) -> tuple[int, str]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0, ""
    try:
        rows, _ = read_jsonl_rows(path)
    except CorruptJsonlError as e:
        return 0, f"; {e}"
    return max((r["step"] for r in rows), default=0), ""


def run_status(spec: RunSpec) -> RunStatus:
    """Decide what to do with a run from its folder (nothing is changed on disk)."""
    ckpt = latest_checkpoint(spec.run_dir / "checkpoints")
    ckpt_step = int(_STEP.match(ckpt.name).group(1)) if ckpt is not None else 0
    logged, note = _last_logged_step(spec.run_dir)
    total = spec.total_steps
    if ckpt_step >= total and logged >= total:
        return RunStatus(spec, "skip", ckpt_step, logged, f"finished (step {ckpt_step}/{total})")
    if ckpt is not None:
        return RunStatus(spec, "resume", ckpt_step, logged,
                         f"resume from the checkpoint of step {ckpt_step}/{total} (metrics logged to step {logged})"
                         + note)
    if spec.run_dir.exists():
        return RunStatus(spec, "restart", 0, logged, f"no complete checkpoint (metrics logged to step {logged}): "
                                                     f"the folder is deleted and the run starts afresh" + note)
    return RunStatus(spec, "new", 0, 0, "not started")


def eval_status(spec: RunSpec) -> EvalStatus:
    """The final evaluation's state: its output folder is ``<run_dir>/final_eval``."""
    out = spec.run_dir / EVAL_DIR
    results = out / "results.json"
    if results.is_file():  # evaluate.py writes it once every generation is graded (its "complete" field means
        try:                # the full protocol: all six benchmarks, no limit — not that the run finished)
            if "metrics" in json.loads(results.read_text()):
                return EvalStatus(spec, "done", out)
        except ValueError:
            pass
    return EvalStatus(spec, "run" if run_status(spec).action == "skip" else "wait", out)


def train_command(status: RunStatus) -> list[str]:
    """The train.py command line of a run (``--resume`` when resuming)."""
    spec = status.spec
    cmd = [sys.executable, str(REPO / "train.py"), "--config", spec.config, *spec.overrides]
    return cmd + (["--resume"] if status.action == "resume" else [])


def eval_command(cfg: StudyConfig, spec: RunSpec) -> list[str]:
    """The evaluate.py command line of a run's final evaluation (its final checkpoint, into ``final_eval/``)."""
    assert cfg.final_eval.config is not None
    ckpt = spec.run_dir / "checkpoints" / f"step_{spec.total_steps:06d}"
    return [sys.executable, str(REPO / "evaluate.py"), "--config", cfg.final_eval.config, "--model", str(ckpt),
            "--label", spec.name, "--output", str(spec.run_dir / EVAL_DIR), *cfg.final_eval.overrides,
            f"logging.group={cfg.name}"]


def describe_plan(cfg: StudyConfig, specs: list[RunSpec]) -> str:
    """The ``--dry-run`` listing: one line per run (and final evaluation) with its action and command."""
    lines = [f"study {cfg.name}: {len(specs)} runs ({len(cfg.methods)} methods, seeds "
             f"{', '.join(map(str, dict.fromkeys(s.seed for s in specs)))}) in {cfg.output_dir}"]
    width = max(len(s.name) for s in specs)
    for spec in specs:
        st = run_status(spec)
        lines.append(f"  {spec.name:<{width}}  {st.action:<7}  {st.reason}")
        if st.action != "skip":
            lines.append(f"  {'':<{width}}  {'':<7}  $ {shlex.join(train_command(st))}")
    if cfg.final_eval.enabled:
        for spec in specs:
            ev = eval_status(spec)
            what = {"done": "final evaluation done (reused)", "run": "final evaluation to run",
                    "wait": "final evaluation after training"}[ev.action]
            lines.append(f"  {spec.name:<{width}}  {'eval':<7}  {what}: {ev.output}")
    return "\n".join(lines)


def _threads(cfg: StudyConfig) -> int:
    return cfg.runner.threads or os.cpu_count() or 1


def _record(out: Path, row: dict) -> None:
    with (out / ATTEMPTS).open("a") as f:
        f.write(json.dumps(row) + "\n")


def _last_error(log: Path) -> str:
    """The last ``train.py:`` / ``evaluate.py:`` line of a log (their one-line errors), else its last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    marked = [ln for ln in lines if ln.startswith(("train.py:", "evaluate.py:"))]
    return (marked or lines or [""])[-1][:300]


def _run(cmd: list[str], log: Path, verbose: bool) -> tuple[int, float, bool]:
    """Run ``cmd`` (its output appended to ``log``, or the console when ``verbose``); returns (exit code, wall
    seconds, interrupted). Ctrl-C reaches the child through the terminal's process group (train.py finishes its
    step and checkpoints; a second Ctrl-C stops it at once): the runner waits for it. SIGTERM to the runner is
    passed on to the child."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n=== {datetime.now(timezone.utc).isoformat(timespec='seconds')} $ {shlex.join(cmd)}\n")
        f.flush()
        sink = None if verbose else f
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT if sink else None)
        interrupted = False
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt as e:  # Ctrl-C (the child has it too) or SIGTERM (Terminated: pass it on)
                interrupted = True
                if getattr(e, "signum", signal.SIGINT) == signal.SIGTERM and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
    return rc, time.monotonic() - t0, interrupted or rc in (130, 143)


def run_grid(cfg: StudyConfig, specs: list[RunSpec], *, verbose: bool = False,
             say: Callable[[str], None] | None = None) -> int:
    """Run every unfinished run (and final evaluation) of the grid, in order.

    Returns:
        0 when every run (and evaluation) is finished; 1 when one failed (the others ran unless
        ``runner.stop_on_error``); 130 / 143 when interrupted (Ctrl-C / SIGTERM: the run in progress checkpoints
        its step, the rest of the grid waits for the next call).
    """
    say = say or (lambda line: print(line, flush=True))
    out = Path(cfg.output_dir)
    failed: list[str] = []
    todo: list[tuple[str, RunSpec]] = [("train", s) for s in specs]
    if cfg.final_eval.enabled:
        todo += [("eval", s) for s in specs]
    for i, (kind, spec) in enumerate(todo, start=1):
        tag = f"[{i}/{len(todo)}] {spec.name}"
        log = out / "logs" / (f"{spec.name}.log" if kind == "train" else f"{spec.name}.eval.log")
        if kind == "train":
            st = run_status(spec)
            if st.action == "skip":
                say(f"{tag}: {st.reason}: skipped")
                continue
            if st.action == "restart":
                from stapo.runlock import RunLock

                RunLock(spec.run_dir).check_free()  # another live process writes it: RunLockError, nothing deleted
                shutil.rmtree(spec.run_dir)
            say(f"{tag}: {st.reason if st.action != 'new' else 'start'} (log: {log})")
            cmd, action = train_command(st), st.action
        else:
            ev = eval_status(spec)
            if ev.action != "run":
                say(f"{tag}: final evaluation {'done (reused)' if ev.action == 'done' else 'skipped: the run is not finished'}")
                continue
            say(f"{tag}: final evaluation (log: {log})")
            cmd, action = eval_command(cfg, spec), "eval"
        rc, wall, interrupted = _run(cmd, log, verbose)
        _record(out, {"run": spec.name, "kind": kind, "action": action, "rc": rc, "wall_s": round(wall, 3),
                      "threads": _threads(cfg), "end": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        if interrupted:
            say(f"{tag}: interrupted (exit {rc}) after {wall / 60:.1f} min; rerun the same command to resume the "
                f"study")
            return 143 if rc == 143 else 130
        if rc != 0:
            failed.append(spec.name)
            say(f"{tag}: FAILED (exit {rc}) after {wall / 60:.1f} min: {_last_error(log)} (log: {log})")
            if cfg.runner.stop_on_error:
                break
        else:
            say(f"{tag}: done in {wall / 60:.1f} min")
    if failed:
        say(f"study {cfg.name}: {len(failed)} failed: {', '.join(failed)}; rerun the same command to retry them "
            f"(finished runs are skipped)")
        return 1
    return 0
