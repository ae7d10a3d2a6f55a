"""The run folder and the run's lifecycle around the training steps: one object the trainer is handed
(:class:`RunFolder`), so that :class:`stapo.train.Trainer` builds the model and steps it, and nothing else.

What it does, in the order a run meets it::

    RunFolder(cfg, ctx, device, objective=..., evaluation_manifest=...)
                             where: <trainer.output_dir>/<run name>, its checkpoints/
    .check()                 before any model loads: writable, no live process holds it, not an evaluation folder,
                             its metrics.jsonl / tables.jsonl readable (a resume appends to them)
    .check_identity(plan)    the model and training data are the resumed run's / the fork source's (by content)
    with .locked():          run.lock held for the whole run (rank 0; every rank learns the answer)
        .open(step, plan)    config.json, fingerprint.json, this launch in run_info.json, the tracker (metrics.jsonl,
                             W&B); rows and outputs of steps after ``step`` dropped (a crashed run's)
        with .steps(...) as history:   start lines, the progress bar, the two-signal interrupt guard
            .log(step, metrics)        the row, the console line or bar, the history
            .maybe_save(step, save)    the due checkpoint; True when a signal asked to stop
                             on leaving: the tracker finished, the throughput cache written, :class:`Interrupted`

Only rank 0 writes (under torchrun every rank holds a folder: the checks and the stop decision are collectives).
The run shell never imports training or evaluation (``stapo.LAYERS``): what it needs of them — the evaluation
folder's manifest name, the rollouts files' clean-up, the trainer's ``save`` — is handed in.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tqdm.auto import tqdm

from stapo.common.fingerprint import read_fingerprint, write_fingerprint
from stapo.config import ConfigError, to_dict
from stapo.model import distributed as dist
from stapo.model.checkpoint import latest_checkpoint
from stapo.run.cli import raise_terminated, signal_name, survive_closed_terminal
from stapo.run.console import start_lines, step_line, use_progress_bars
from stapo.run.preflight import check_writable
from stapo.run.provenance import TRAIN_STEP_METRIC, launch_record, record_launch
from stapo.run.run_identity import (
    CHANGES_FILE,
    MACHINE_CHANGE_KEY,
    config_digest,
    data_part,
    resume_identity_check,
    run_fingerprint,
)
from stapo.run.runlock import LOCK_NAME, RunLock, RunLockError
from stapo.run.throughput import record_train_throughput
from stapo.run.tracking import Tracker, read_jsonl_rows

__all__ = ["RunFolder", "Interrupted"]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT), SIGTERM (a cluster scheduler's preemption, ``kill``) or SIGHUP (the terminal closed) stopped
    :meth:`Trainer.train` before ``trainer.total_steps`` (train.py prints how to resume and exits 128 + the signal:
    130 / 143 / 129).

    Attributes:
        step: the last finished step.
        checkpoint: the latest complete checkpoint (``--resume`` continues from it), or None.
        abandoned: True when a second signal abandoned the step in progress (nothing of it is saved).
        signum: the first signal received (``signal.SIGINT``, ``signal.SIGTERM`` or ``signal.SIGHUP``).
    """

    def __init__(self, step: int, checkpoint: Path | None, abandoned: bool,
                 signum: int = signal.SIGINT) -> None:
        super().__init__(f"interrupted after step {step}")
        self.step, self.checkpoint, self.abandoned, self.signum = step, checkpoint, abandoned, int(signum)


class _InterruptGuard:
    """SIGINT, SIGTERM and SIGHUP handling while :meth:`Trainer.train` steps (main thread only, and only over Python's
    default handlers): the first signal sets :attr:`requested` (and :attr:`signum`) and calls ``announce(signum)``
    (the step in progress finishes), the second raises KeyboardInterrupt where the code is (the step is
    abandoned; finished checkpoints stay), a third exits the process at once (``os._exit(128 + signum)``, e.g. a
    clean-up that hangs)."""

    #: the handlers it replaces (others, installed by someone else, are left alone)
    _DEFAULTS = {signal.SIGINT: (signal.default_int_handler,), signal.SIGTERM: (signal.SIG_DFL, raise_terminated),
                 signal.SIGHUP: (signal.SIG_DFL, raise_terminated)}

    def __init__(self, announce: Callable[[int], None]) -> None:
        self.announce = announce
        self.requested = False
        self.signum = int(signal.SIGINT)
        self._count = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> "_InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            for signum, defaults in self._DEFAULTS.items():
                if any(signal.getsignal(signum) is d for d in defaults):
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:  # the terminal is gone: its writes fail with EIO from now on
            survive_closed_terminal()
        self._count += 1
        if self._count == 1:
            self.requested, self.signum = True, int(signum)
            with contextlib.suppress(Exception):
                self.announce(signum)
            return
        if self._count == 2:
            raise KeyboardInterrupt
        os._exit(128 + self.signum)


def default_run_name(cfg: Any, objective: str) -> str:
    """``trainer.run_name``, or ``<objective>_<model folder or hub name>_seed<trainer.seed>`` when unset (``:`` of a
    hub revision written ``-``), e.g. ``stapo_Qwen3-8B-Base_seed0``."""
    model_tag = cfg.model.path.rstrip("/").split("/")[-1].replace(":", "-")
    return cfg.trainer.run_name or f"{objective}_{model_tag}_seed{cfg.trainer.seed}"


class RunFolder:
    """A training run's folder (``<trainer.output_dir>/<run name>``) and everything about the run's lifecycle that is
    not training: the pre-flight checks, the run lock, the files written at start, the tracker, the clean-up of a
    crashed run's later steps, the console, the interrupt guard, the checkpoint cadence and the throughput record.

    Args:
        cfg: the run's :class:`~stapo.config.TrainConfig` (``model.compute_dtype`` resolved: it is recorded).
        ctx: this process's :class:`~stapo.model.distributed.DistContext` (rank 0 writes; the checks are collective).
        device: the trainer's device (the throughput cache's key).
        objective: the objective's name (the default run name: :func:`default_run_name`).
        argv: the command line recorded in ``run_info.json`` and the W&B config (default ``sys.argv``; assignable
            until :meth:`open`).
        evaluation_manifest: the file name that marks an evaluate.py output folder (``stapo.evaluation.runner.
            MANIFEST``, handed in: the run shell does not import evaluation); required, so no caller skips the check.

    Attributes:
        run_name, run_dir, ckpt_root: the run's name, folder and ``checkpoints/`` folder.
        tracker: the :class:`~stapo.run.tracking.Tracker` once :meth:`open` ran (rank 0), else None.
        fingerprint, identity_notes: :meth:`check_identity`'s fingerprint (rank 0) and the lines it printed.
    """

    def __init__(self, cfg: Any, ctx: dist.DistContext, device: Any, *, objective: str,
                 evaluation_manifest: str, argv: Sequence[str] | None = None) -> None:
        self.cfg, self.ctx, self.device = cfg, ctx, device
        self.run_name = default_run_name(cfg, objective)
        self.run_dir = Path(cfg.trainer.output_dir) / self.run_name
        self.ckpt_root = self.run_dir / "checkpoints"
        self.argv = list(sys.argv if argv is None else argv)
        self.evaluation_manifest = evaluation_manifest
        self.tracker: Tracker | None = None
        self.fingerprint: dict[str, Any] | None = None
        self.identity_notes: list[str] = []
        self.history: list[dict[str, float]] = []
        self._stepping = 1  # the step in progress (the first signal's message)
        self._bar: Any = None
        self._guard: _InterruptGuard | None = None
        self._stopped = False

    # --- before any model loads ---------------------------------------------------------------------------------
    def check(self) -> None:
        """The pre-flight checks of the folder, before anything is loaded or written: it can be written
        (:func:`stapo.run.preflight.check_writable`), no other live process holds it (a collective: every rank stops
        alike), it is not an evaluate.py output folder nor inside one, and, resuming, its ``metrics.jsonl`` /
        ``tables.jsonl`` hold only valid rows but for a torn last line (rank 0).

        Raises:
            stapo.config.ConfigError: not writable; the folder or a folder above it holds an evaluation (its manifest).
            stapo.run.runlock.RunLockError: (every rank) the folder is in use; the message names the holder.
            stapo.run.tracking.CorruptJsonlError: a damaged line that is not a torn last one (naming file and line).
        """
        check_writable(self.run_dir, "trainer.output_dir")
        self._check_lock_free()  # another live train.py on this folder: say so now, not after loading the model
        manifest = self.evaluation_manifest
        for folder in (self.run_dir, *Path(self.run_dir).absolute().parents):
            if (folder / manifest).is_file():
                key, value, where = (("trainer.run_name", self.run_name, "an") if folder == self.run_dir else
                                     ("trainer.output_dir", self.cfg.trainer.output_dir, f"inside {folder}, an"))
                raise ConfigError(f"invalid value for {key!r} ({value}): {self.run_dir} is {where} evaluate.py "
                                  f"output folder ({manifest}); choose another run name or output folder")
        if self.cfg.trainer.resume != "never" and self.ctx.is_main:
            for name in ("metrics.jsonl", "tables.jsonl"):
                if (self.run_dir / name).is_file():
                    read_jsonl_rows(self.run_dir / name)

    def _check_lock_free(self) -> None:
        """Rank 0 looks whether another live process holds the folder (:meth:`stapo.run.runlock.RunLock.check_free`)
        and tells every rank (a collective), so all of them stop with the same error before loading a model.

        Raises:
            stapo.run.runlock.RunLockError: (every rank) the folder is in use; the message names the holder.
        """
        refused = None
        if self.ctx.is_main:
            try:
                RunLock(self.run_dir).check_free()
            except RunLockError as e:
                refused = str(e)
        refused = dist.gather_objects(refused, self.ctx)[0]
        if refused is not None:
            raise RunLockError(refused)

    def check_identity(self, plan: Any) -> None:
        """Rank 0: this launch's fingerprint (:func:`stapo.run.run_identity.run_fingerprint`) and, resuming, its
        comparison with the recorded ``fingerprint.json`` (:func:`stapo.run.run_identity.resume_identity_check`; its
        lines are printed here) or, forking, with the source run's. Sets :attr:`fingerprint` and
        :attr:`identity_notes` (None and [] on the other ranks).

        Args:
            plan: the resume plan (:class:`stapo.train.state.ResumePlan`: its ``fork`` has the source checkpoint's
                ``path``), or None for a fresh run.

        Raises:
            stapo.config.ConfigError: (every rank) the model or the training data changed since the run started
                (naming the key and the file), or they cannot be read.
        """
        fp, notes, refused = None, [], None
        fork = plan.fork if plan is not None else None
        if self.ctx.is_main:
            try:
                fp = run_fingerprint(self.cfg)
                if fork is not None:
                    self._check_fork_identity(fp, fork.path)
                elif plan is not None:
                    notes = resume_identity_check(self.run_dir, fp, self.cfg)
            except ConfigError as e:
                refused = str(e)
            except OSError as e:
                refused = (f"cannot read the run's inputs to fingerprint them (model.path {self.cfg.model.path}, "
                           f"data.train_set {self.cfg.data.train_set}): {e}")
        refused = dist.gather_objects(refused, self.ctx)[0]
        if refused is not None:
            raise ConfigError(refused)
        for line in notes:
            print(line, file=sys.stderr, flush=True)
        self.fingerprint, self.identity_notes = fp, notes

    def _check_fork_identity(self, fp: dict[str, Any], init_from: str) -> None:
        """A fork's model and training data are the source run's (its ``fingerprint.json``, two folders above the
        checkpoint; nothing to compare when it has none): the config keys are compared by
        :func:`stapo.train.state.plan_fork`, this compares their content.

        Raises:
            stapo.config.ConfigError: the ``model`` or ``data`` part differs, naming ``trainer.init_from``.
        """
        source = read_fingerprint(Path(init_from).expanduser().parent.parent) or {}
        for part in ("model", "data"):
            old, new = source.get(part), fp.get(part)
            if old is not None and old != new and not str(old).startswith("id:") and not str(new).startswith("id:"):
                key = "model.path" if part == "model" else data_part(self.cfg.data)[1]
                raise ConfigError(f"invalid value for 'trainer.init_from' ({init_from}): the source run's {part} "
                                  f"is not this run's ({key}: fingerprint.json {part} {str(old)[:12]}… → "
                                  f"{str(new)[:12]}…); a fork keeps the source's model and training data")

    # --- the run ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's lock (``run.lock``, :mod:`stapo.run.runlock`; rank 0 alone under torchrun, which tells
        the other ranks) for the block, so one process at a time writes a run folder.

        Raises:
            stapo.run.runlock.RunLockError: another live process holds the folder, or its lock file cannot be
                created (on every rank).
        """
        lock, refused = None, None
        if self.ctx.is_main:
            try:
                lock = RunLock(self.run_dir).acquire()
            except RunLockError as e:
                refused = str(e)
            except OSError as e:  # e.g. a read-only file system: told to every rank too (none may hang)
                refused = f"cannot create the run directory's lock file {self.run_dir / LOCK_NAME}: {e}"
        refused = dist.gather_objects(refused, self.ctx)[0]  # collective: every rank learns rank 0's answer
        if refused is not None:
            raise RunLockError(refused)
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def open(self, step: int, plan: Any = None, *, validation_subdir: str | None = "validation",
             drop_after: Sequence[Callable[[Path, int], Any]] = ()) -> None:
        """Rank 0, at the start step (after a resume): create the folder, write ``config.json``, ``fingerprint.json``
        (:meth:`_record_identity`), append this launch to ``run_info.json`` (:mod:`stapo.run.provenance`; a fork's
        first launch says where it started), start the tracker (``metrics.jsonl``, W&B, ...) and drop what a crashed
        run wrote after ``step``: its metrics rows (:meth:`stapo.run.tracking.Tracker.truncate_after`), its
        validation outputs (``<validation_subdir>/step_*``) and whatever each ``drop(run_dir, step)`` of
        ``drop_after`` removes (the rollouts files). Other ranks: nothing.

        Raises:
            stapo.run.tracking.TrackerError: ``logging.wandb_mode=online`` cannot start and
                ``logging.wandb_fallback=error``.
        """
        if not self.ctx.is_main:
            return
        fork = plan.fork if plan is not None else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=2))
        self._record_identity(step)  # fingerprint.json: what the run is made from (stapo/run/run_identity.py)
        # provenance (stapo/run/provenance.py): this launch appended to run_info.json, and in the W&B config
        launch = launch_record(self.argv, start_step=step, world_size=self.ctx.world)
        if fork is not None:  # the fork's first launch: where it started from (path, step, digest)
            launch["init_from"] = fork.record()
        launches = record_launch(self.run_dir, launch)
        lc = self.cfg.logging
        self.tracker = Tracker(self.run_dir, {**to_dict(self.cfg), "run_info": {**launches[-1],
                                                                                "launch": len(launches)}},
                               mode=lc.wandb_mode, project=lc.project, entity=lc.entity, name=self.run_name,
                               fallback=lc.wandb_fallback, group=lc.group, tags=lc.tags, job_type=lc.job_type,
                               notes=lc.notes, step_metric=TRAIN_STEP_METRIC,
                               wandb_step=True,  # monotonic: a resumed offline run continues the steps
                               backends=lc.backends, system_metrics=lc.system_metrics,
                               console_capture=lc.console_capture)
        self.tracker.truncate_after(step)  # rows a crashed run wrote after its last checkpoint
        self._drop_stale_validation(step, validation_subdir)
        for drop in drop_after:  # e.g. rollouts files of steps a resume redoes (or never reaches)
            drop(self.run_dir, step)

    def _record_identity(self, step: int) -> None:
        """Rank 0, at start-up: write ``<run_dir>/fingerprint.json`` (its ``config`` part of the config just written
        to config.json) and, after a resume on another machine kind, a ``fingerprint.machine`` row of
        ``config_changes.jsonl`` (once per step and change)."""
        if self.fingerprint is None:
            return
        old = read_fingerprint(self.run_dir) if step > 0 else None
        fp = {**self.fingerprint, "config": config_digest(to_dict(self.cfg))}
        if old is not None and old.get("machine") not in (None, fp["machine"]):
            path = self.run_dir / CHANGES_FILE
            line = json.dumps({"step": step, "key": MACHINE_CHANGE_KEY, "old": old["machine"],
                               "new": fp["machine"]})
            seen = set(path.read_text().splitlines()) if path.is_file() else set()
            if line not in seen:
                with open(path, "a") as f:
                    f.write(line + "\n")
        write_fingerprint(self.run_dir, fp)

    def _drop_stale_validation(self, step: int, subdir: str | None) -> None:
        """Remove validation outputs of steps after ``step`` (a crashed or earlier run's), so the evaluation store
        never resumes generations of other weights."""
        root = self.run_dir / subdir if subdir else None
        if root is None or not root.is_dir():
            return
        for d in root.glob("step_*"):
            try:
                done = int(d.name.split("_", 1)[1])
            except ValueError:
                continue
            if done > step:
                shutil.rmtree(d, ignore_errors=True)

    def logged(self, step: int) -> bool:
        """Whether ``metrics.jsonl`` already holds a row of ``step`` (rank 0's answer, told to every rank: a
        collective), e.g. the step-0 validation of a run restarted at step 0."""
        path = self.tracker.metrics_path if self.ctx.is_main else None
        done = self.ctx.is_main and path.exists() and any(row["step"] == step for row in read_jsonl_rows(path)[0])
        return dist.gather_objects(done, self.ctx)[0]

    def write_row(self, step: int, metrics: dict[str, Any]) -> None:
        """``metrics`` as the row of ``step`` (``metrics.jsonl``, W&B, ...; rank 0, nothing elsewhere)."""
        if self.tracker is not None:
            self.tracker.log(step, metrics)

    @functools.cached_property
    def bars(self) -> bool:
        """tqdm bars (``trainer.progress_bar``; auto: stdout and stderr are terminals) or one line per step."""
        return use_progress_bars(self.cfg.trainer.progress_bar)

    def print_start(self) -> None:
        """The run folder and the W&B location (mode, project, group, the online URL or the offline folder)."""
        lc, tracker = self.cfg.logging, self.tracker
        mode = tracker.mode if tracker is not None else "disabled"
        url = getattr(getattr(tracker, "_wandb", None), "url", None) if mode == "online" else None
        wandb_dir = tracker.wandb_dir if tracker is not None and mode != "disabled" else None
        for line in start_lines(self.run_dir, mode=mode, project=lc.project, group=lc.group, wandb_dir=wandb_dir,
                                url=url):
            print(line, flush=True)

    @contextlib.contextmanager
    def steps(self, step: Callable[[], int], close: Sequence[Any] = ()) -> Iterator[list[dict[str, float]]]:
        """The step loop's surroundings. On entering (rank 0): the start lines (:meth:`print_start`); the progress
        bar; Ctrl-C, SIGTERM and SIGHUP handled (docs/metrics.md#interrupting-and-resuming): the first lets the
        step in progress finish, then :meth:`maybe_save` stops the run (checkpointing the step if
        ``trainer.save_on_interrupt`` or one is due); a second abandons the step at once. On leaving: the bar closed,
        the tracker finished, ``close()`` of each of ``close`` that has one (the reward's and the validation hook's
        grader process pools), the signal handlers restored (until then a third signal exits at once); after a
        normal exit the throughput cache written (:func:`stapo.run.throughput.record_train_throughput`, rank 0).

        Args:
            step: returns the last finished step (the trainer's counter).
            close: objects whose ``close()`` ends the run.

        Yields:
            The history: each step's metrics, as :meth:`log` receives them.

        Raises:
            Interrupted: a second signal abandoned the step in progress, or a signal stopped the run before
                ``trainer.total_steps``.
        """
        tc, main = self.cfg.trainer, self.ctx.is_main
        if main:  # where this run writes, before its first step (stapo/run/console.py)
            self.print_start()
        self.history = history = []
        self._bar = tqdm(total=tc.total_steps, initial=step(), desc="train", disable=not (self.bars and main),
                         dynamic_ncols=True)
        self._stepping, self._stopped = step() + 1, False
        guard = self._guard = _InterruptGuard(self._announce_interrupt if main else lambda signum: None).install()
        try:
            yield history
        except KeyboardInterrupt:  # the second Ctrl-C / SIGTERM: the step in progress is abandoned
            raise Interrupted(step(), latest_checkpoint(self.ckpt_root), abandoned=True,
                              signum=guard.signum) from None
        finally:
            try:
                self._bar.close()
                if self.tracker is not None:
                    self.tracker.finish()
                for owner in close:  # grader process pools
                    closer = getattr(owner, "close", None)
                    if callable(closer):
                        closer()
            finally:
                guard.uninstall()  # until here a further Ctrl-C exits at once
        if main and history:  # this machine's measured step time, for train.py --dry-run (stapo/run/throughput.py)
            record_train_throughput(self.cfg, self.device, history, self.run_dir)
        if self._stopped and step() < tc.total_steps:
            raise Interrupted(step(), latest_checkpoint(self.ckpt_root), abandoned=False, signum=guard.signum)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """A finished step (inside :meth:`steps`): its row (:meth:`write_row`), the history, and on the console one
        plain line (a log file: Slurm, nohup; no cursor codes) or the bar's tick and postfix (reward, entropy, kept
        of all response tokens)."""
        self.write_row(step, metrics)
        self.history.append(metrics)
        if self.ctx.is_main and not self.bars:
            print(step_line(step, self.cfg.trainer.total_steps, metrics), flush=True)
        self._bar.update(1)
        self._bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}", ent=f"{metrics['actor/entropy']:.3f}",
                              kept=f"{metrics['actor/num_kept_tokens']:.0f}/"
                                   f"{metrics['response_length/total_tokens']:.0f}")

    def save_due(self, step: int) -> bool:
        """Whether ``step`` is checkpointed: every ``trainer.save_every`` steps (0: never) and the last step."""
        tc = self.cfg.trainer
        return bool((tc.save_every and step % tc.save_every == 0) or step == tc.total_steps)

    def maybe_save(self, step: int, save: Callable[[], Any]) -> bool:
        """End the finished ``step`` (inside :meth:`steps`): ``save()`` when a checkpoint is due (:meth:`save_due`),
        then whether a signal asked to stop — decided on every rank alike (all-reduced: a rank that missed the
        signal stops too; after the due save, so a signal during it stops here too); stopping, ``save()`` once more
        with ``trainer.save_on_interrupt`` unless just saved. Collective under torchrun.

        Returns:
            True: stop after this step (:meth:`steps` then raises :class:`Interrupted` unless it was the last);
            False: the next step is in progress.
        """
        saved = self.save_due(step)
        if saved:
            save()
        stop = dist.all_reduce({"stop": float(self._guard.requested)}, self.ctx, op="max")["stop"] > 0
        if stop:
            if self.cfg.trainer.save_on_interrupt and not saved:
                save()
            self._stopped = True
            return True
        self._stepping = step + 1
        return False

    def _announce_interrupt(self, signum: int) -> None:
        """The first Ctrl-C's (or SIGTERM's, SIGHUP's) line on stderr (rank 0)."""
        save = " and writing its checkpoint" if self.cfg.trainer.save_on_interrupt else ""
        what, again = (("Ctrl-C", "press Ctrl-C again") if signum == signal.SIGINT
                       else (signal_name(signum), "a second signal"))
        sys.stderr.write(f"\n{what}: finishing step {self._stepping}{save}, then stopping; {again} stops now (the "
                         f"checkpoints already written are kept)\n")
        sys.stderr.flush()
