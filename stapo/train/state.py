"""The run's resumable state: writing a step's checkpoint and resuming from the latest one
(:mod:`stapo.model.checkpoint`).

A checkpoint holds the policy and AdamW state (``dcp/``, sharded, re-shardable to another rank count or strategy),
an HF export in the compute dtype (for evaluation), ``trainer_state.pt``: the scheduler, the prompt loader's
position, every rank's RNG state, the step and the config — and ``COMPLETE.json`` (sizes and checksums, last).

Before anything is loaded (:func:`plan_resume`, called by the trainer before it builds the model): the newest
*intact* checkpoint is chosen (:func:`stapo.model.checkpoint.resumable_checkpoints`; each newer damaged one is reported
in one line and skipped), and its stored config is compared with the new one
(:func:`stapo.config.resume_key_changes`): a change of a key that cannot change mid-run is refused, the others
(:data:`stapo.config.RESUME_MUTABLE_KEYS`) are applied and recorded in ``<run_dir>/config_changes.jsonl``.

A fork (``trainer.init_from``, :func:`plan_fork`): a run without checkpoints of its own starts from another run's
checkpoint the way a resume would, with its own seed and objective (:class:`ForkSource`;
docs/runs.md#forks-trainerinit_from).
"""
from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stapo.common.checkpoint_files import checkpoint_digest
from stapo.config import ConfigError, fork_key_changes, resume_key_changes, to_dict
from stapo.model import distributed as dist
from stapo.model.checkpoint import (
    DCP_DIR,
    CheckpointError,
    is_sharded,
    latest_checkpoint,
    load_trainer_state,
    resumable_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from stapo.model.models import load_policy
from stapo.run.run_identity import CHANGES_FILE  # the run folder's config_changes.jsonl

__all__ = ["RunState", "ResumePlan", "ForkSource", "plan_resume", "plan_fork", "CHANGES_FILE", "plan_start",
           "refuse_checkpoints"]


@dataclass
class ForkSource:
    """Where a fork starts (:func:`plan_fork`): the checkpoint folder as given (``trainer.init_from``), its step,
    its content digest (:func:`stapo.common.checkpoint_files.checkpoint_digest`), the source run's ``trainer.seed`` and
    the keys in which the fork's config differs from the checkpoint's (``"key: old → new"``)."""

    path: str
    step: int
    digest: str
    source_seed: int
    differs: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The ``init_from`` entry of the fork's first launch in ``run_info.json``."""
        return {"path": self.path, "step": self.step, "digest": self.digest, "source_seed": self.source_seed,
                "differs": list(self.differs)}


@dataclass
class ResumePlan:
    """What a resume will load (:func:`plan_resume`): the checkpoint folder, its step, its ``trainer_state.pt``
    (loaded once) and the allowed config changes ``(dotted key, old, new)``. A fork's plan (:func:`plan_fork`) has
    ``fork`` set and no changes to apply."""

    checkpoint: Path
    step: int
    state: dict[str, Any]
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    fork: ForkSource | None = None


def _say(ctx: dist.DistContext | None, line: str) -> None:
    if ctx is None or ctx.is_main:
        print(line, file=sys.stderr, flush=True)


def _fmt(v: Any) -> str:
    return "null" if v is None else repr(v) if isinstance(v, str) else str(v)


def _runs_in(output_dir: Path) -> str:
    runs = sorted(p.name for p in output_dir.iterdir() if resumable_checkpoints(p / "checkpoints")) \
        if output_dir.is_dir() else []
    return ", ".join(runs) if runs else "none"


def plan_resume(root: Path, cfg: Any, *, required: bool, ctx: dist.DistContext | None = None,
                report: bool = True) -> ResumePlan | None:
    """Choose the checkpoint to resume from and check the new config against its config, loading no weights.

    The newest ``step_N`` folder under ``root`` that :func:`stapo.model.checkpoint.verify_checkpoint` finds intact and
    whose ``trainer_state.pt`` loads; for each newer one a line ``resuming from step_N: <path> is damaged:
    <reason>`` (stderr, rank 0; the damaged folder is kept until its step is saved again).

    Args:
        root: the run's ``checkpoints/`` folder (``<output_dir>/<run_name>/checkpoints``).
        cfg: the new :class:`~stapo.config.TrainConfig`.
        required: no checkpoint is an error (train.py ``--resume``); else None is returned (a line says so).
        ctx: the data-parallel context (only rank 0 prints; every rank runs the same checks on the same files).
        report: print the lines (False: a second call for the same resume).

    Returns:
        The :class:`ResumePlan`, or None (no checkpoint, ``required`` False).

    Raises:
        FileNotFoundError: ``required`` and no ``step_N`` folder: names the run folder and the runs of
            ``trainer.output_dir`` (those with a ``step_N`` checkpoint folder).
        stapo.model.checkpoint.CheckpointError: folders exist but none is intact (each one's reason).
        stapo.config.ConfigError: keys that cannot change mid-run differ, as ``key: old → new`` in one line.
    """
    run_dir = root.parent
    found = resumable_checkpoints(root)
    if not found:
        if required:
            raise FileNotFoundError(f"--resume: {run_dir} holds no checkpoint to resume from (runs with checkpoints "
                                    f"in {run_dir.parent}: {_runs_in(run_dir.parent)}); check trainer.run_name, or "
                                    f"start the run without --resume")
        if report:
            _say(ctx, f"resume: no checkpoint in {root}: starting at step 0")
        return None
    damaged: list[str] = []
    for ckpt, reason in found:
        state = None
        if reason is None:
            try:  # dcp format: small; previous format (full optimizer state): memory-mapped
                state = load_trainer_state(ckpt, mmap=not is_sharded(ckpt))
            except Exception as e:  # noqa: BLE001 — unpicklable / torn: that folder is damaged, whatever the error
                reason = f"trainer_state.pt does not load ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        if reason is not None:
            damaged.append(f"{ckpt} is damaged: {reason}")
            continue
        assert state is not None
        if report:
            for line in damaged:
                _say(ctx, f"resuming from {ckpt.name}: {line}")
        changes: list[tuple[str, Any, Any]] = []
        saved = state.get("config")
        if isinstance(saved, dict):
            refused, changes = resume_key_changes(saved, cfg)
            if refused:
                diff = "; ".join(f"{k}: {_fmt(a)} → {_fmt(b)}" for k, a, b in refused)
                raise ConfigError(f"cannot resume {run_dir} with a changed config: {diff} (these keys cannot change "
                                  f"mid-run: set them back, or start a new run under another trainer.run_name)")
        return ResumePlan(ckpt, int(state["step"]), state, changes)
    raise CheckpointError(f"cannot resume {run_dir}: no intact checkpoint: {'; '.join(damaged)}")


def plan_fork(path: str, cfg: Any) -> ResumePlan:
    """Check ``trainer.init_from`` (``path``) for a fork of ``cfg`` and plan loading it, loading no weights.

    Args:
        path: a checkpoint folder of another run (``<run>/checkpoints/step_N``), as given in the config.
        cfg: the fork's :class:`~stapo.config.TrainConfig`.

    Returns:
        A :class:`ResumePlan` with ``fork`` set (its :class:`ForkSource`).

    Raises:
        stapo.config.ConfigError: one line naming ``trainer.init_from`` (the path is not an intact checkpoint, or it
            stores no config), the keys that differ beyond :data:`stapo.config.FORK_MUTABLE_KEYS` (``key: old →
            new``), or ``trainer.total_steps`` (not above the checkpoint's step).
    """
    folder = Path(path).expanduser()

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"invalid value for 'trainer.init_from' ({path}): {why}")

    if not folder.is_dir():
        raise refuse("no such folder (give a checkpoint folder, <run>/checkpoints/step_N)")
    reason = verify_checkpoint(folder)
    if reason is not None:
        inner = latest_checkpoint(folder / "checkpoints") or latest_checkpoint(folder)  # a run folder or its checkpoints/ folder
        hint = f"; its latest checkpoint is {inner}" if inner is not None else ""
        raise refuse(f"not an intact train.py checkpoint folder ({reason}){hint}")
    try:
        state = load_trainer_state(folder, mmap=not is_sharded(folder))
    except Exception as e:  # noqa: BLE001 — unpicklable / torn: not a checkpoint we can fork
        raise refuse(f"trainer_state.pt does not load ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    saved = state.get("config")
    if not isinstance(saved, dict) or "step" not in state or "loader" not in state:
        raise refuse("its trainer_state.pt holds no config, step or loader state (not a checkpoint train.py wrote)")
    step = int(state["step"])
    refused, allowed = fork_key_changes(saved, cfg)
    if refused:
        diff = "; ".join(f"{k}: {_fmt(a)} → {_fmt(b)}" for k, a, b in refused)
        raise refuse(f"a fork keeps the checkpoint's recipe, but these keys differ: {diff} (a fork may change only "
                     f"the objective and mask keys, trainer.seed, the run length and folder, and how the update is "
                     f"computed: stapo.config.FORK_MUTABLE_KEYS)")
    if cfg.trainer.total_steps <= step:
        raise ConfigError(f"invalid value for 'trainer.total_steps' ({cfg.trainer.total_steps}): the fork starts "
                          f"at step {step} (trainer.init_from={path}); it must be above that")
    source = ForkSource(path=str(path), step=step, digest=checkpoint_digest(folder),
                        source_seed=int(saved.get("trainer", {}).get("seed", 0)),
                        differs=[f"{k}: {_fmt(a)} → {_fmt(b)}" for k, a, b in allowed])
    return ResumePlan(folder, step, state, [], fork=source)


def refuse_checkpoints(root: Path) -> None:
    """A run that does not resume (``trainer.resume=never``) never writes over another run's checkpoints.

    Raises:
        FileExistsError: ``root`` (a run's ``checkpoints/`` folder) holds a checkpoint; the message names the run
            folder and how to resume it or choose another.
    """
    if latest_checkpoint(root) is not None:
        raise FileExistsError(f"{root.parent} already holds checkpoints; resume it with --resume "
                              f"(or trainer.resume=auto) or choose another trainer.run_name")


def plan_start(root: Path, cfg: Any, ctx: dist.DistContext | None = None) -> ResumePlan | None:
    """Where a run starts, chosen before anything loads: with ``trainer.resume`` auto / required the checkpoint of
    :func:`plan_resume` (None: none, auto), with ``never`` nothing (:func:`refuse_checkpoints`); then, when it
    resumes nothing and ``trainer.init_from`` is set, the fork's source (:func:`plan_fork`).

    Args:
        root: the run's ``checkpoints/`` folder; cfg: the run's :class:`~stapo.config.TrainConfig`; ctx: as
            :func:`plan_resume`'s.

    Returns:
        The :class:`ResumePlan` (``fork`` set for a fork), or None: a fresh run at step 0.

    Raises:
        FileExistsError, FileNotFoundError, stapo.model.checkpoint.CheckpointError, stapo.config.ConfigError: as
            :func:`refuse_checkpoints`, :func:`plan_resume` and :func:`plan_fork`.
    """
    tc = cfg.trainer
    plan = None
    if tc.resume != "never":
        plan = plan_resume(root, cfg, required=tc.resume == "required", ctx=ctx)
    else:
        refuse_checkpoints(root)
    if plan is None and tc.init_from is not None:  # a fork: another run's checkpoint, checked now
        plan = plan_fork(tc.init_from, cfg)
    return plan


class RunState:
    """Everything a step's checkpoint saves and a resume restores, for one trainer.

    Args:
        root: the run's ``checkpoints/`` folder.
        cfg: the run's :class:`~stapo.config.TrainConfig` (stored with every checkpoint).
        model, optimizer, scheduler, loader: the policy (possibly FSDP2-wrapped), its AdamW, the warm-up scheduler
            and the :class:`~stapo.train.prompts.PromptLoader`.
        tokenizer: saved with the HF export.
        param_dtype: the parameters' dtype (checkpoints of the previous format load their weights in it).
        export_dtype: the HF export's dtype (the compute dtype).
        ctx: the data-parallel context (save and resume are collectives under torchrun).
    """

    def __init__(self, root: Path, cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, loader: Any, tokenizer: Any, *, param_dtype: torch.dtype,
                 export_dtype: torch.dtype, ctx: dist.DistContext) -> None:
        self.root, self.cfg, self.model, self.optimizer = root, cfg, model, optimizer
        self.scheduler, self.loader, self.tokenizer = scheduler, loader, tokenizer
        self.param_dtype, self.export_dtype, self.ctx = param_dtype, export_dtype, ctx

    def latest(self) -> Path | None:
        """The latest complete checkpoint folder, or None."""
        return latest_checkpoint(self.root)

    def save(self, step: int) -> Path:
        """Write step ``step``'s checkpoint (:func:`stapo.model.checkpoint.save_checkpoint`; collective under torchrun:
        every rank writes its model/optimizer shards, rank 0 the HF export and the trainer state). Every rank
        returns the folder once it is complete; older ones beyond ``trainer.keep_last`` are removed."""
        rngs = dist.gather_objects(rng_state(), self.ctx)
        state = {"scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(), "rng": rngs[0],
                 "config": to_dict(self.cfg)}
        if self.ctx.enabled:
            state["rng_per_rank"] = rngs
        return save_checkpoint(self.root, step, self.model, self.tokenizer, state, optimizer=self.optimizer,
                               keep_last=self.cfg.trainer.keep_last, export_dtype=self.export_dtype, ctx=self.ctx)

    def resume(self, plan: ResumePlan | None = None) -> tuple[Path, int] | None:
        """Restore ``plan``'s checkpoint (None: :func:`plan_resume` now, silently) on every rank → ``(folder, its
        step)``, or None when there is no checkpoint.

        Model + optimizer from ``dcp/``, re-sharded to this run's ranks and strategy (checkpoints of the previous
        format: weights from the HF files, the full optimizer state from ``trainer_state.pt``); then scheduler,
        prompt loader and RNG (this rank's when the rank count is unchanged, else rank 0's); then the plan's
        config changes (:meth:`_apply_changes`). A fork's plan (:func:`plan_fork`): the loader continues the
        source's position under this run's seed (:meth:`~stapo.train.prompts.PromptLoader.branch`), and the RNGs are
        the source's when the seeds agree, else seeded with this run's ``trainer.seed`` as a fresh run's are.

        Raises:
            stapo.model.checkpoint.CheckpointError: a torn, damaged or foreign checkpoint (naming the folder).
            stapo.config.ConfigError: (no ``plan``) a refused config change.
        """
        if plan is None:
            plan = plan_resume(self.root, self.cfg, required=False, ctx=self.ctx, report=False)
        if plan is None:
            return None
        ckpt, state = plan.checkpoint, plan.state
        try:
            if is_sharded(ckpt):
                dist.load_sharded_state(self.model, self.optimizer, ckpt / DCP_DIR)  # collective under torchrun
            else:  # every rank memory-maps it (plan_resume)
                self._load_full_checkpoint(ckpt, state)
        except (ValueError, OSError, RuntimeError, EOFError, KeyError) as e:  # torn / damaged / foreign files
            msg = " ".join(str(e).split())
            raise CheckpointError(f"cannot resume from {ckpt}: {msg[:600]} — move that folder out of "
                                  f"{self.root} to resume from the previous checkpoint") from e
        self.scheduler.load_state_dict(state["scheduler"])
        fork = plan.fork
        if fork is not None:  # the source's loader position, the rest of its epoch in the branch seed's order
            self.loader.branch(state["loader"], fork.source_seed)
        else:
            self.loader.load_state_dict(state["loader"])
        per_rank = state.get("rng_per_rank")
        if fork is None or fork.source_seed == self.cfg.trainer.seed:  # a fork with the source's seed continues it
            set_rng_state(per_rank[self.ctx.rank] if per_rank and len(per_rank) == self.ctx.world else state["rng"])
        else:  # the branch seed's, as a fresh run seeds them (one state for every arm of a pair)
            seed = self.cfg.trainer.seed
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
        self._apply_changes(plan)
        return ckpt, plan.step

    def _apply_changes(self, plan: ResumePlan) -> None:
        """Apply the plan's allowed config changes and record them (rank 0: one stderr line each and a line of
        ``<run_dir>/config_changes.jsonl``; the same change re-applied from the same step is not recorded twice).

        ``actor.lr``: the scheduler's ``base_lrs`` and every param group's ``initial_lr`` become the new lr and
        ``lr`` the new lr × the warm-up factor of the restored scheduler step, so the next optimizer step uses it.
        The other keys are read from the config where they are used.
        """
        if not plan.changes:
            return
        for key, _old, new in plan.changes:
            if key == "actor.lr":
                sch = self.scheduler
                sch.base_lrs = [float(new)] * len(self.optimizer.param_groups)
                factors = [fn(sch.last_epoch) for fn in getattr(sch, "lr_lambdas", [])] or [1.0] * len(sch.base_lrs)
                for group, base, factor in zip(self.optimizer.param_groups, sch.base_lrs, factors):
                    group["initial_lr"] = base
                    group["lr"] = base * factor
                sch._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if not self.ctx.is_main:
            return
        path = self.root.parent / CHANGES_FILE
        seen: set[str] = set()
        if path.is_file():
            seen = {line.strip() for line in path.read_text().splitlines() if line.strip()}
        with open(path, "a") as f:
            for key, old, new in plan.changes:
                line = json.dumps({"step": plan.step, "key": key, "old": old, "new": new}, default=str)
                _say(self.ctx, f"config change on resume at step {plan.step}: {key}: {_fmt(old)} → {_fmt(new)}")
                if line not in seen:
                    f.write(line + "\n")

    def _load_full_checkpoint(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Previous checkpoint format: weights from the HF files, ``state["optimizer"]`` the full optimizer state."""
        model_sd: dict[str, torch.Tensor] = {}
        if self.ctx.is_main or self.ctx.strategy != "fsdp2":  # FSDP2: rank 0 loads, the shards are broadcast
            model, _ = load_policy(str(ckpt), dtype=self.param_dtype,
                                   attn_implementation=self.cfg.model.attn_implementation)
            model_sd = model.state_dict()
            del model
        dist.load_full_state(self.model, self.optimizer, model_sd, state["optimizer"], self.ctx)
