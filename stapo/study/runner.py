"""Run a study's grid with train.py (and evaluate.py), one subprocess per run, resumable at any point.

Each run is ``train.py`` in its own subprocess (a crash or a SIGKILL of one run loses nothing of the others) with
its output in ``<output_dir>/logs/<run>.log``; runs go one after another in :func:`stapo.study.config.run_specs`
order. Before each run its folder decides what to do (:func:`run_status`):

- ``skip``: finished — ``metrics.jsonl`` reaches ``trainer.total_steps`` and the checkpoint of that step exists;
- ``resume``: a complete checkpoint of an earlier step exists — ``train.py ... --resume`` continues from it;
- ``restart``: the folder holds no complete checkpoint and no finished run (killed before its first save): it is
  moved to ``<output_dir>/superseded/`` (one line says so; never deleted) and the run starts afresh;
- ``changed``: the folder holds a run that is not the one the study would run now (:func:`run_identity_problems`:
  its recorded config differs from the plan, its config.json was edited, its model or training data changed, it
  is a symlink to or a copy of another run), or a finished run without its checkpoints whose ``total_steps`` was
  raised (it cannot be continued): refused before anything runs (:class:`RunIdentityError`), or with
  ``--rerun-changed`` moved to ``<output_dir>/superseded/`` and trained afresh (:func:`run_grid`);
- ``new``: no folder yet;
- ``busy``: another live process (a ``train.py`` left by a runner that was killed, finishing its step; one started by
  hand) holds the run folder's lock: the runner waits for it to exit (one line says so), then decides again — it
  never starts a second writer beside it.

A run whose final checkpoint exists but whose ``metrics.jsonl`` lacks the rows of its last steps (a torn last line)
is finished (``skip``): the training state is complete, and the lost rows cannot be recomputed without retraining,
so the plan line and the report name them instead of resuming a run that has nothing left to train.

A damaged line of a run's ``metrics.jsonl`` that is not its torn last line
(:class:`stapo.run.tracking.CorruptJsonlError`) decides nothing: the runner (and ``--dry-run``) stops before running
anything, in one line naming the file and the line — the report's policy. Such a run is never restarted (its folder
moved aside), resumed or skipped over it.

Nothing finished is deleted: a run continued past its old ``total_steps`` resumes from its last checkpoint
(``trainer.total_steps`` may change on resume); a run that must be trained again goes into a fresh folder and the
old one is kept under ``<output_dir>/superseded/`` (:data:`SUPERSEDED`).

The same for the optional final evaluation (``final_eval``): done when ``<run>/final_eval/results.json`` exists
(evaluate.py writes it at the end), else ``evaluate.py`` (which resumes its own generations). Every attempt is appended
to ``<output_dir>/attempts.jsonl`` (run, kind, action, exit code, wall seconds, threads) for the report's cost line.
The study folder is locked for the runner's lifetime (``<output_dir>/run.lock``, :mod:`stapo.run.runlock`).

A child does not outlive the runner: it stays in the runner's process group (Ctrl-C reaches both), and on Linux it
is started with ``PR_SET_PDEATHSIG`` = SIGTERM, so when the runner dies, even by SIGKILL, the kernel sends the child
SIGTERM (train.py then finishes its step, checkpoints it and exits).
"""
from __future__ import annotations

import ctypes
import fnmatch
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
from typing import Callable, Literal, Sequence

from stapo.common.checkpoint_files import latest_checkpoint
from stapo.common.fingerprint import read_fingerprint
from stapo.config import to_dict
from stapo.run.provenance import default_group
from stapo.run.run_identity import config_matches_fingerprint, data_part, model_part, plan_differences, recorded_config
from stapo.run.runlock import LOCK_NAME, Holder, RunLock, RunLockError
from stapo.run.tracking import CorruptJsonlError, read_jsonl_rows
from stapo.study.config import RunSpec, StudyConfig

__all__ = ["REPO", "RunStatus", "EvalStatus", "run_status", "eval_status", "train_command", "eval_command",
           "describe_plan", "run_grid", "default_threads", "lock_holder", "exit_text", "ATTEMPTS", "FINISHED",
           "export_study", "check_metrics", "run_identity_problems", "RunIdentityError", "SUPERSEDED",
           "identity_refusal"]

#: The repository root: train.py and evaluate.py live there.
REPO = Path(__file__).resolve().parents[2]
ATTEMPTS = "attempts.jsonl"
EVAL_DIR = "final_eval"
#: Written into a run folder when its training exited 0 at ``total_steps``: the run counts as finished from it (and
#: its metrics) alone, so a folder kept without its checkpoints (an exported study, :func:`export_study`) is not
#: retrained.
FINISHED = "finished.json"
#: The folder of ``output_dir`` that run folders are moved to instead of being deleted (``superseded/<run>``,
#: ``<run>.1``, ...): a run restarted afresh, or one retrained with ``--rerun-changed``.
SUPERSEDED = "superseded"
_STEP = re.compile(r"^step_(\d+)$")

Action = Literal["skip", "resume", "restart", "new", "busy", "changed"]
#: Seconds between two looks at a busy run folder (:func:`run_grid` waits for its holder to exit).
BUSY_POLL_S = 2.0


@dataclass(frozen=True)
class RunStatus:
    """What a run's folder says (:func:`run_status`).

    Attributes:
        spec: the run.
        action: ``skip`` | ``resume`` | ``restart`` | ``new`` | ``busy`` | ``changed`` (module docstring).
        checkpoint_step: the step of its latest complete checkpoint (0: none).
        logged_step: the last step in its ``metrics.jsonl`` (0: none).
        reason: one phrase for the plan's listing.
        holder: who holds the run folder's lock (``busy``), else None.
    """

    spec: RunSpec
    action: Action
    checkpoint_step: int
    logged_step: int
    reason: str
    holder: Holder | None = None


@dataclass(frozen=True)
class EvalStatus:
    """The final evaluation of a run: ``done`` (results.json written), ``run`` (to run or resume), ``wait``
    (its training run is not finished)."""

    spec: RunSpec
    action: Literal["done", "run", "wait"]
    output: Path


_MOVE_AWAY = "delete that line (or move the file away) and rerun"  # stapo.run.tracking.CorruptJsonlError's advice
_KEEP_FILE = ("delete or repair that line and rerun (keep the file: a run without its metrics.jsonl and checkpoints "
              "would start afresh)")


def _last_logged_step(run_dir: Path) -> tuple[int, str]:
    """The last step of ``metrics.jsonl`` (0: none) and a note on a torn last line.

    Raises:
        CorruptJsonlError: a damaged line that is not the torn last one (one line naming the file and the line).
            It is never read as "nothing logged": that would restart a finished run whose checkpoints are gone
            (its folder deleted) and misstate its logged and lost steps.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0, ""
    try:
        rows, torn = read_jsonl_rows(path)
    except CorruptJsonlError as e:  # the report's one line, with the runner's advice (moving the file away would
        raise CorruptJsonlError(  # make a run without its checkpoints start afresh)
            f"{str(e).replace(_MOVE_AWAY, _KEEP_FILE)}; nothing was run") from None
    note = f"; {path} ends in a torn line of {torn} bytes (an interrupted write)" if torn else ""
    return max((r["step"] for r in rows), default=0), note


def _finished_step(run_dir: Path) -> int:
    """The ``steps`` of the run folder's :data:`FINISHED` marker (0 when there is none or it is unreadable)."""
    try:
        steps = json.loads((run_dir / FINISHED).read_text()).get("steps", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return int(steps) if isinstance(steps, int) and not isinstance(steps, bool) else 0


def _mark_finished(spec: RunSpec) -> None:
    """Write the run folder's :data:`FINISHED` marker for ``trainer.total_steps`` (unless it already says so)."""
    if _finished_step(spec.run_dir) < spec.total_steps:
        (spec.run_dir / FINISHED).write_text(json.dumps({"steps": spec.total_steps}) + "\n")


def lock_holder(folder: Path) -> Holder | None:
    """Who holds ``folder``'s run lock (:mod:`stapo.run.runlock`; a live process other than this one), else None.
    Nothing is created or taken. A holder that has not written its identity yet reads as pid 0, program ``?``."""
    try:
        RunLock(folder).check_free()
    except RunLockError:
        try:
            text = (Path(folder) / LOCK_NAME).read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        return Holder.parse(text) or Holder(pid=0, host="?", started="?")
    return None


class RunIdentityError(ValueError):
    """Runs of a study are not the runs its plan would make (:func:`run_identity_problems`), or a finished run
    cannot be continued: refused before anything runs, in one line naming each run and why."""


def _run_name(run: RunSpec | str | os.PathLike) -> tuple[Path, str, RunSpec | None]:
    if isinstance(run, RunSpec):
        return run.run_dir, run.name, run
    return Path(run), Path(run).name, None


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _names_itself(run_dir: Path) -> bool:
    """Whether the run's config.json names the folder it sits in (``trainer.run_name``): a copy placed elsewhere
    keeps the name of the run it was copied from."""
    cfg = recorded_config(run_dir) or {}
    return isinstance(cfg.get("trainer"), dict) and cfg["trainer"].get("run_name") == run_dir.name


def _same_run(a: Path, b: Path) -> str | None:
    """Why run folders ``a`` and ``b`` hold one run (None: they do not): identical fingerprints (config, model,
    data, seed), or, for runs without fingerprint.json, identical config.json and metrics.jsonl bytes."""
    fa, fb = read_fingerprint(a), read_fingerprint(b)
    if fa is not None and fb is not None:
        parts = ("config", "model", "data", "seed")
        if all(p in fa for p in parts) and all(fa.get(p) == fb.get(p) for p in parts):
            return "identical fingerprint.json: config, model, data and seed"
        return None
    ca, cb = _read_bytes(a / "config.json"), _read_bytes(b / "config.json")
    if ca is None or ca != cb:
        return None
    ma, mb = _read_bytes(a / "metrics.jsonl"), _read_bytes(b / "metrics.jsonl")
    return "identical config.json and metrics.jsonl" if ma is not None and ma == mb else None


def run_identity_problems(spec_or_run_dir: RunSpec | str | os.PathLike,
                          others: Sequence[RunSpec | str | os.PathLike] = (), *,
                          check_inputs: bool = True) -> list[str]:
    """Why a run folder cannot be counted as the run it stands for: one line per reason, each starting with the
    run's name; ``[]`` when there is none (or nothing is recorded yet: no folder, no config.json). Reads only.

    For the study runner (a run with a problem is ``changed``: refused, or retrained with ``--rerun-changed``) and
    for the report and claims, which must not count such a run. Results made before fingerprints existed (no
    ``fingerprint.json``, e.g. ``results/study_cpu/grid``) are checked by their ``config.json`` alone.

    Args:
        spec_or_run_dir: a :class:`~stapo.study.config.RunSpec` (its folder is compared with its plan,
            ``spec.train``) or a run folder (only the checks that need no plan).
        others: the other runs of the study (specs or folders; the run itself may be among them): a run with
            the same content as one of them is a duplicate.
        check_inputs: also compare the recorded ``model`` and ``data`` fingerprint parts with the plan's current
            model folder and training data (hashing them; big files are cached): False skips it (reading only the
            run folders).

    Returns:
        One-line reasons, among:

        - ``<run>: the run folder <dir> is a symlink to <target>: ...`` — a link to another run is no run of its own;
        - ``<run>: <dir>/config.json is not the config its fingerprint.json records ...`` — edited after the run;
        - ``<run>: its recorded config differs from the study's plan: actor.lr: 0.001 → 0.002; ...`` —
          :func:`stapo.run.run_identity.plan_differences` (``trainer.total_steps`` raised is no difference; keys of
          :data:`stapo.run.run_identity.HOW_KEYS` are tolerated);
        - ``<run>: the model of model.path (...) is not the one it was trained from ...`` / ``... the training data
          of data.train_file.path (...) changed ...`` — the fingerprint's content parts;
        - ``<run>: the same run as <other> (identical ...): a copy counts once, not as an independent seed`` —
          identical fingerprints (config, model, data, seed), or for runs without fingerprints identical
          config.json and metrics.jsonl. Of an original and its copy only the copy is named (the run whose
          config.json does not name its own folder); when that cannot be told, both are.
    """
    run_dir, name, spec = _run_name(spec_or_run_dir)
    if not run_dir.is_symlink() and not run_dir.is_dir():
        return []
    problems: list[str] = []
    if run_dir.is_symlink():
        problems.append(f"{name}: the run folder {run_dir} is a symlink to {os.readlink(run_dir)}: a run counts once, "
                        f"in its own folder (a duplicate, not an independent seed)")
    recorded = recorded_config(run_dir)
    if config_matches_fingerprint(run_dir) is False:
        problems.append(f"{name}: {run_dir / 'config.json'} is not the config its fingerprint.json records (edited "
                        f"or replaced after the run wrote it)")
    if spec is not None and recorded is not None:
        refused, _ = plan_differences(recorded, to_dict(spec.train))
        if refused:
            problems.append(f"{name}: its recorded config differs from the study's plan: {'; '.join(refused)}")
    fp = read_fingerprint(run_dir)
    if spec is not None and fp is not None and check_inputs:
        mc = spec.train.model
        try:
            part, folder = model_part(mc.path, mc.cache_dir, convert=False)
        except OSError:  # not readable here: nothing to compare with
            part, folder = "id:", None
        old = str(fp.get("model"))
        if old != part and not old.startswith("id:") and not part.startswith("id:"):
            problems.append(f"{name}: the model of model.path ({mc.path}; {folder}) is not the one it was trained "
                            f"from (its weights or config files changed since: fingerprint.json model)")
        try:
            digest, key, what = data_part(spec.train.data)
        except (OSError, ValueError):  # the plan's training file is not here: nothing to compare with
            digest = None
        if digest is not None and fp.get("data") not in (None, digest):
            problems.append(f"{name}: the training data of {key} ({what}) changed since it was trained "
                            f"(fingerprint.json data)")
    for other in others:
        other_dir, other_name, _ = _run_name(other)
        if other_name == name or other_dir.absolute() == run_dir.absolute() or not other_dir.is_dir():
            continue
        if run_dir.is_symlink() or other_dir.is_symlink():
            continue  # the link is named above (as its own run's problem)
        why = _same_run(run_dir, other_dir)
        if why is None or (_names_itself(run_dir) and not _names_itself(other_dir)):
            continue
        problems.append(f"{name}: the same run as {other_name} ({why}): a copy counts once, not as an independent "
                        f"seed")
    return problems


def _tolerated(spec: RunSpec) -> str:
    """``; recorded with <key: old → new>, ... (how it is computed, not what: reused)`` for the HOW_KEYS the run's
    config.json differs from the plan in, else ""."""
    recorded = recorded_config(spec.run_dir)
    how = plan_differences(recorded, to_dict(spec.train))[1] if recorded is not None else []
    return f"; recorded with {', '.join(how)} (how it is computed, not what: kept)" if how else ""


def run_status(spec: RunSpec, others: Sequence[RunSpec] = ()) -> RunStatus:
    """Decide what to do with a run from its folder (nothing is changed on disk; module docstring).

    Args:
        spec: the run.
        others: the study's other runs (for :func:`run_identity_problems`'s duplicates; may include ``spec``).

    Raises:
        CorruptJsonlError: the run's ``metrics.jsonl`` has a damaged line that is not its torn last line.
    """
    ckpt = latest_checkpoint(spec.run_dir / "checkpoints")
    ckpt_step = int(_STEP.match(ckpt.name).group(1)) if ckpt is not None else 0
    logged, note = _last_logged_step(spec.run_dir)
    total = spec.total_steps
    holder = lock_holder(spec.run_dir) if spec.run_dir.is_dir() else None
    if holder is not None:
        return RunStatus(spec, "busy", ckpt_step, logged,
                         f"busy (pid {holder.pid}): {holder.program} holds the run folder (started "
                         f"{holder.started}); the runner waits for it to exit, then decides", holder)
    finished = _finished_step(spec.run_dir)
    kept = ckpt is not None or finished > 0 or (spec.run_dir / EVAL_DIR).exists()  # what a restart would lose
    problems = run_identity_problems(spec, others) if kept else []
    if problems:
        return RunStatus(spec, "changed", ckpt_step, logged, " / ".join(problems))
    if ckpt_step >= total and logged >= total:
        return RunStatus(spec, "skip", ckpt_step, logged, f"finished (step {ckpt_step}/{total})" + _tolerated(spec))
    if finished >= total and logged >= total:
        return RunStatus(spec, "skip", ckpt_step, logged, f"finished (step {total}/{total}; {FINISHED}, "
                                                          f"checkpoints not kept)" + _tolerated(spec))
    done_step = max(ckpt_step, finished)  # a final checkpoint, or finished.json (exported runs)
    if done_step >= total:  # the training is complete, rows after `logged` are lost (a torn last line): never retrain
        lost = f"step {total}" if logged == total - 1 else f"steps {logged + 1}-{total}"
        return RunStatus(spec, "skip", ckpt_step, logged,
                         f"finished (step {done_step}/{total}), but metrics.jsonl holds rows only to step {logged}: "
                         f"the metrics row of {lost} is lost (the training state is complete; the row cannot be "
                         f"recomputed without retraining)" + note)
    if ckpt is not None:
        return RunStatus(spec, "resume", ckpt_step, logged,
                         f"resume from the checkpoint of step {ckpt_step}/{total} (metrics logged to step {logged})"
                         + note + _tolerated(spec))
    if finished > 0:  # finished at an earlier total_steps, checkpoints not kept (an exported run): cannot continue
        return RunStatus(spec, "changed", 0, logged,
                         f"{spec.name}: finished at step {finished}, the study now plans {total} steps, and its "
                         f"checkpoints are not kept (an exported run): it cannot be continued; copy its checkpoints "
                         f"back into {spec.run_dir / 'checkpoints'}, or train it afresh with --rerun-changed")
    if spec.run_dir.exists():
        return RunStatus(spec, "restart", 0, logged, f"no complete checkpoint (metrics logged to step {logged}): "
                                                     f"the folder is moved to {SUPERSEDED}/ and the run starts "
                                                     f"afresh" + note)
    return RunStatus(spec, "new", 0, 0, "not started")


def _move_aside(spec: RunSpec) -> Path:
    """Move the run folder to ``<output_dir>/superseded/<run>`` (``<run>.1``, ... when taken) → the new place.
    Never deletes: the folder (its metrics, final evaluation, checkpoints) is kept whole.

    Raises:
        RunLockError: another live process holds the run folder (nothing is moved).
    """
    if not spec.run_dir.is_symlink():
        RunLock(spec.run_dir).check_free()
    root = spec.run_dir.parent.parent / SUPERSEDED
    root.mkdir(parents=True, exist_ok=True)
    dest, k = root / spec.name, 1
    while dest.exists() or dest.is_symlink():
        dest, k = root / f"{spec.name}.{k}", k + 1
    spec.run_dir.rename(dest)
    return dest


_SHOWN = 6  # runs named in the refusal line (the dry run lists every one)


def identity_refusal(cfg: StudyConfig, changed: list[RunStatus]) -> RunIdentityError:
    """The one-line refusal of the ``changed`` runs (:func:`run_grid` without ``--rerun-changed``)."""
    out = Path(cfg.output_dir) / SUPERSEDED
    groups: dict[str, list[str]] = {}  # the same reason for several runs (a changed plan key) is said once
    for st in changed:
        name, sep, why = st.reason.partition(": ")
        if not sep or name != st.spec.name:
            name, why = st.spec.name, st.reason
        groups.setdefault(why, []).append(name)
    parts = []
    for why, names in list(groups.items())[:_SHOWN]:
        who = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{who}: {why}")
    shown = " / ".join(parts)
    more = (f" / and {len(groups) - _SHOWN} more reasons (--dry-run lists every run)"
            if len(groups) > _SHOWN else "")
    return RunIdentityError(
        f"{len(changed)} run{'s' if len(changed) > 1 else ''} of study {cfg.name} "
        f"{'are' if len(changed) > 1 else 'is'} not what the study would run now, so nothing is reused: "
        f"{shown}{more}; set the study's config back, or rerun with --rerun-changed to "
        f"train {'them' if len(changed) > 1 else 'it'} afresh (the old folders are moved to {out}/, never deleted); "
        f"nothing was run")


def eval_status(spec: RunSpec) -> EvalStatus:
    """The final evaluation's state: its output folder is ``<run_dir>/final_eval``. It is ``done`` only when its
    results.json evaluated the run's final checkpoint (``model.step`` = ``trainer.total_steps``); an evaluation of
    an earlier final step (the study's ``total_steps`` was raised since) is run again (evaluate.py refuses or
    resumes by its own manifest: a changed model or protocol starts a fresh folder, see :func:`eval_command`).
    The evaluation of a ``changed`` run (:func:`run_status`) is never reused: it waits for the run."""
    out = spec.run_dir / EVAL_DIR
    results = out / "results.json"
    action = run_status(spec).action
    if action == "changed":
        return EvalStatus(spec, "wait", out)
    if results.is_file():  # evaluate.py writes it once every generation is graded (its "complete" field means
        try:                # every benchmark asked for, in full, no limit — not that the run finished)
            res = json.loads(results.read_text())
            if "metrics" in res and evaluated_step(res) == spec.total_steps:
                return EvalStatus(spec, "done", out)
        except ValueError:
            pass
    return EvalStatus(spec, "run" if action == "skip" else "wait", out)


def _retire_stale_eval(spec: RunSpec, tag: str, say: Callable[[str], None]) -> None:
    """Move a final evaluation of an earlier checkpoint (its manifest names another step) aside to
    ``final_eval.step_<N>`` (kept, never deleted), so that evaluate.py starts the final checkpoint's in a fresh folder
    instead of refusing the folder of another model."""
    out = spec.run_dir / EVAL_DIR
    step = None
    for name in ("results.json", "eval_manifest.json"):
        try:
            step = evaluated_step(json.loads((out / name).read_text()))
        except (OSError, ValueError):
            continue
        break
    if step is None or step == spec.total_steps:
        return
    dest = spec.run_dir / f"{EVAL_DIR}.step_{step:06d}"
    k = 1
    while dest.exists():
        dest, k = spec.run_dir / f"{EVAL_DIR}.step_{step:06d}.{k}", k + 1
    out.rename(dest)
    say(f"{tag}: the final evaluation in {out} is of step {step}, not {spec.total_steps}: moved to {dest}")


def evaluated_step(results: dict) -> int | None:
    """The training step of the checkpoint a results.json evaluated (``model.step``), ``None`` when it names none."""
    step = (results.get("model") or {}).get("step") if isinstance(results.get("model"), dict) else None
    return int(step) if isinstance(step, int) and not isinstance(step, bool) else None


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
            f"logging.group={default_group(cfg.name, spec.method)}", f"logging.study={cfg.name}",
            f"logging.method={spec.method}"]


#: What :func:`export_study` leaves out of a run folder: the large or rebuildable parts.
EXPORT_EXCLUDE = ("checkpoints", "wandb", "rollouts", "generations", "run.lock", "*.tmp")


def export_study(cfg: StudyConfig, dest: Path) -> list[Path]:
    """Copy the study's small files — each run's metrics.jsonl, config.json, run_info.json, :data:`FINISHED`,
    tables.jsonl, validation and final-evaluation results (without their generations), and the study's
    attempts.jsonl — to ``dest`` (e.g. a folder under results/ to commit), keeping the layout, so that
    ``output_dir=<dest>`` reports them again (``--report-only``) and a runner copied back over them skips the
    finished runs and evaluations. Checkpoints, W&B files, saved rollouts and generations (:data:`EXPORT_EXCLUDE`)
    are left out. Returns the files written."""
    src, dest = Path(cfg.output_dir), Path(dest)
    written: list[Path] = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if not path.is_file() or any(fnmatch.fnmatch(part, pat) for part in rel.parts for pat in EXPORT_EXCLUDE):
            continue
        if rel.parts[0] not in ("runs", ATTEMPTS) or (rel.parts[0] == "runs" and len(rel.parts) < 3):
            continue
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, out)
        written.append(out)
    return written


def check_metrics(specs: list[RunSpec]) -> None:
    """Read every run's ``metrics.jsonl`` (nothing is changed on disk).

    Raises:
        CorruptJsonlError: one has a damaged line that is not its torn last line (the first such run, in grid
            order; one line naming the file and the line). :func:`run_grid` calls it before running anything.
    """
    for spec in specs:
        _last_logged_step(spec.run_dir)


def describe_plan(cfg: StudyConfig, specs: list[RunSpec], rerun_changed: bool = False) -> str:
    """The ``--dry-run`` listing: one line per run (and final evaluation) with its action and command; a
    ``changed`` run says whether the runner would refuse it or (``rerun_changed``) move it aside and retrain it.

    Raises:
        CorruptJsonlError: a run's ``metrics.jsonl`` has a damaged line that is not its torn last line.
    """
    lines = [f"study {cfg.name}: {len(specs)} runs ({len(cfg.methods)} methods, seeds "
             f"{', '.join(map(str, dict.fromkeys(s.seed for s in specs)))}) in {cfg.output_dir}"]
    study = lock_holder(Path(cfg.output_dir)) if Path(cfg.output_dir).is_dir() else None
    if study is not None:
        lines.append(f"  the study folder is in use by {study.program} (pid {study.pid}, started {study.started}): "
                     f"it is working through this plan; a second runner is refused (--report-only is not)")
    width = max(len(s.name) for s in specs)
    for spec in specs:
        st = run_status(spec, specs)
        what = st.reason
        if st.action == "changed":
            what += (f" — moved to {SUPERSEDED}/ and trained afresh (--rerun-changed)" if rerun_changed else
                     " — refused: the runner stops before running anything (--rerun-changed trains it afresh, "
                     f"the old folder moved to {SUPERSEDED}/)")
        lines.append(f"  {spec.name:<{width}}  {st.action:<7}  {what}")
        if st.action not in ("skip", "busy") and (st.action != "changed" or rerun_changed):
            lines.append(f"  {'':<{width}}  {'':<7}  $ {shlex.join(train_command(st))}")
    if cfg.final_eval.enabled:
        for spec in specs:
            ev = eval_status(spec)
            what = {"done": "final evaluation done (reused)", "run": "final evaluation to run",
                    "wait": "final evaluation after training"}[ev.action]
            lines.append(f"  {spec.name:<{width}}  {'eval':<7}  {what}: {ev.output}")
    return "\n".join(lines)


def default_threads(cfg: StudyConfig) -> int:
    """Threads a run uses, for the CPU-hours of the cost line: ``runner.threads``, else ``$OMP_NUM_THREADS`` (the
    runs inherit it and torch uses that many threads), else this machine's core count. Recorded per attempt in
    ``attempts.jsonl``; the report prefers each run's own count (``run_info.json``) for its training steps."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return cfg.runner.threads or (int(env) if env.isdigit() and int(env) >= 1 else 0) or os.cpu_count() or 1


def _record(out: Path, row: dict) -> None:
    with (out / ATTEMPTS).open("a") as f:
        f.write(json.dumps(row) + "\n")


def _last_error(log: Path) -> str:
    """The last ``train.py:`` / ``evaluate.py:`` line of the log's last attempt (their one-line errors), else that
    attempt's last line ("" when it wrote nothing; the runner's ``=== <time> $ <command>`` header is not output)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("=== ")]
    lines = lines[starts[-1] + 1:] if starts else lines
    marked = [ln for ln in lines if ln.startswith(("train.py:", "evaluate.py:"))]
    return (marked or lines or [""])[-1][:300]


def exit_text(rc: int) -> str:
    """A child's return code in words: ``exit 2``, or ``killed by signal 9 (SIGKILL)`` for a negative one."""
    if rc >= 0:
        return f"exit {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = "unknown signal"
    return f"killed by signal {-rc} ({name})"


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGTERM when the runner dies (Linux ``prctl``
    ``PR_SET_PDEATHSIG``; the child's own SIGTERM handling then applies: train.py checkpoints its step and exits);
    None elsewhere. libc is loaded here, in the parent, so the child only calls into it between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the runner died between fork and prctl: the signal would never come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _terminal_sends_sigint() -> bool:
    """Whether a SIGINT the runner got came from its terminal's Ctrl-C, which reaches the whole foreground process
    group (the child too): the runner is that group (stdin a terminal whose foreground group is ours). Otherwise
    (``kill -INT <runner pid>``, no terminal, a background job) only the runner has it."""
    try:
        fd = sys.stdin.fileno()
        return os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


#: The signal (SIGINT / SIGTERM) the runner received during the last :func:`_run`, None when none came: the
#: runner's exit code names it (:func:`_stop_code`), also when the run finished in the meantime.
_received_signal: int | None = None


def _stop_code(rc: int, signum: int | None) -> int:
    """The runner's exit code when a run was interrupted: 128 + the signal the runner received (130 SIGINT, 143
    SIGTERM); without one, that of the run's: exit 143 or killed by SIGTERM (rc -15) → 143, else (exit 130,
    killed by SIGINT, rc -2) 130."""
    if signum in (signal.SIGINT, signal.SIGTERM):
        return 128 + int(signum)
    if rc in (129, -signal.SIGHUP):  # the run's terminal closed (train.py handles SIGHUP like SIGTERM: exit 129)
        return 129
    return 143 if rc in (143, -signal.SIGTERM) else 130


#: A run's exit codes that mean it was stopped by SIGINT / SIGTERM / SIGHUP (train.py's 130 / 143 / 129, or killed
#: by the signal).
_STOPPED = (129, 130, 143, -signal.SIGHUP, -signal.SIGINT, -signal.SIGTERM)


def _run(cmd: list[str], log: Path, verbose: bool) -> tuple[int, float, bool]:
    """Run ``cmd`` (its output appended to ``log``, or the console when ``verbose``); returns (exit code, wall
    seconds, interrupted). Ctrl-C reaches the child through the terminal's process group (train.py finishes its
    step and checkpoints; a second Ctrl-C stops it at once): the runner waits for it. A SIGINT sent to the runner
    alone (``kill -INT <pid>``, :func:`_terminal_sends_sigint` false) and SIGTERM are passed on to the child. The
    child stays in the runner's process group and gets SIGTERM when the runner dies (:func:`_die_with_parent`)."""
    global _received_signal
    _received_signal = None
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n=== {datetime.now(timezone.utc).isoformat(timespec='seconds')} $ {shlex.join(cmd)}\n")
        f.flush()
        sink = None if verbose else f
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT if sink else None,
                                preexec_fn=_die_with_parent())
        interrupted = False
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt as e:  # Ctrl-C (the child has it too), SIGINT to us alone, or SIGTERM
                interrupted = True
                signum = getattr(e, "signum", signal.SIGINT)
                _received_signal = int(signum)
                if proc.poll() is None and (signum == signal.SIGTERM or not _terminal_sends_sigint()):
                    proc.send_signal(signum)  # pass it on: the child checkpoints its step and exits
    return rc, time.monotonic() - t0, interrupted or rc in _STOPPED


def _wait_for(folder: Path, holder: Holder | None, tag: str, say: Callable[[str], None]) -> None:
    """Wait (one line says so) until no live process holds ``folder``'s run lock: a train.py / evaluate.py of a
    runner that was killed finishes its step and exits, one started by hand runs to its end. Ctrl-C stops the
    wait (KeyboardInterrupt)."""
    who = f"{holder.program} (pid {holder.pid}, started {holder.started})" if holder else "another process"
    say(f"{tag}: waiting for {who}, which still holds {folder} (left by an earlier runner, or started by hand); "
        f"the run is decided once it exits (Ctrl-C stops waiting)")
    while lock_holder(folder) is not None:
        _sleep(BUSY_POLL_S)


_sleep = time.sleep  # the busy wait's pause (tests replace it to release the lock instead of waiting)


def run_grid(cfg: StudyConfig, specs: list[RunSpec], *, verbose: bool = False,
             say: Callable[[str], None] | None = None, rerun_changed: bool = False) -> int:
    """Run every unfinished run (and final evaluation) of the grid, in order.

    A ``changed`` run (:func:`run_status`: not the run the study would make now, or a finished run that cannot be
    continued) is refused before anything runs (:class:`RunIdentityError`); with ``rerun_changed`` its folder is
    moved to ``<output_dir>/superseded/`` (kept whole) and it is trained afresh. A ``restart`` folder is moved there
    too: nothing is deleted.

    Returns:
        0 when every run (and evaluation) is finished; 1 when one failed (the others ran unless
        ``runner.stop_on_error``); 130 / 143 when interrupted (Ctrl-C / SIGTERM: the run in progress checkpoints
        its step, the rest of the grid waits for the next call; a run that finished meanwhile counts as finished
        and gets its :data:`FINISHED` marker, the code is still 130 / 143).

    Raises:
        CorruptJsonlError: a run's ``metrics.jsonl`` has a damaged line that is not its torn last line — checked
            for every run before anything runs (:func:`check_metrics`), so nothing is run, deleted or skipped.
        RunIdentityError: ``changed`` runs and not ``rerun_changed``: one line naming each and why; nothing ran.
    """
    global _received_signal
    say = say or (lambda line: print(line, flush=True))
    out = Path(cfg.output_dir)
    failed: list[str] = []
    todo: list[tuple[str, RunSpec]] = [("train", s) for s in specs]
    if cfg.final_eval.enabled and cfg.runner.eval_after_each_run:  # each run's evaluation right after its training
        todo = [(kind, s) for s in specs for kind in ("train", "eval")]
    elif cfg.final_eval.enabled:
        todo += [("eval", s) for s in specs]
    check_metrics(specs)
    changed = [st for st in (run_status(s, specs) for s in specs) if st.action == "changed"]
    if changed and not rerun_changed:
        raise identity_refusal(cfg, changed)
    for i, (kind, spec) in enumerate(todo, start=1):
        tag = f"[{i}/{len(todo)}] {spec.name}"
        log = out / "logs" / (f"{spec.name}.log" if kind == "train" else f"{spec.name}.eval.log")
        if kind == "train":
            st = run_status(spec, specs)
            if st.action == "busy":
                _wait_for(spec.run_dir, st.holder, tag, say)
                st = run_status(spec, specs)
            if st.action == "skip":
                if st.logged_step >= spec.total_steps:
                    _mark_finished(spec)
                say(f"{tag}: {st.reason}: skipped")
                continue
            if st.action == "changed" and not rerun_changed:  # changed while the grid ran (a folder copied in)
                raise identity_refusal(cfg, [st])
            if st.action in ("restart", "changed"):  # another live process writes it: RunLockError, nothing moved
                dest = _move_aside(spec)
                what = "no complete checkpoint" if st.action == "restart" else st.reason
                say(f"{tag}: {what}: the folder is moved to {dest} (kept); training afresh (log: {log})")
            else:
                say(f"{tag}: {st.reason if st.action != 'new' else 'start'} (log: {log})")
            cmd, action = train_command(st), ("rerun" if st.action == "changed" else st.action)
        else:
            holder = lock_holder(spec.run_dir / EVAL_DIR)
            if holder is not None:
                _wait_for(spec.run_dir / EVAL_DIR, holder, tag, say)
            ev = eval_status(spec)
            if ev.action != "run":
                say(f"{tag}: final evaluation {'done (reused)' if ev.action == 'done' else 'skipped: the run is not finished'}")
                continue
            _retire_stale_eval(spec, tag, say)
            say(f"{tag}: final evaluation (log: {log})")
            cmd, action = eval_command(cfg, spec), "eval"
        _received_signal = None
        rc, wall, interrupted = _run(cmd, log, verbose)
        _record(out, {"run": spec.name, "kind": kind, "action": action, "rc": rc, "wall_s": round(wall, 3),
                      "threads": default_threads(cfg), "end": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        if rc == 0 and kind == "train" and _last_logged_step(spec.run_dir)[0] >= spec.total_steps:
            _mark_finished(spec)  # also when the study is stopping: a finished run counts as finished
        if interrupted:
            what = "finished, then the study stopped" if rc == 0 else f"interrupted ({exit_text(rc)})"
            say(f"{tag}: {what} after {wall / 60:.1f} min; rerun the same command to resume the study")
            return _stop_code(rc, _received_signal)
        if rc != 0:
            failed.append(spec.name)
            error = _last_error(log) if rc > 0 else ""  # killed by a signal: the log's last line is not the cause
            say(f"{tag}: FAILED ({exit_text(rc)}) after {wall / 60:.1f} min{': ' + error if error else ''} "
                f"(log: {log})")
            if cfg.runner.stop_on_error:
                break
        else:
            say(f"{tag}: done in {wall / 60:.1f} min")
    if failed:
        say(f"study {cfg.name}: {len(failed)} failed: {', '.join(failed)}; rerun the same command to retry them "
            f"(finished runs are skipped)")
        return 1
    return 0
