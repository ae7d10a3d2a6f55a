"""A sweep over the checkpoints of a train.py run: each one evaluated in turn, logged at its training step.

    python evaluate.py --config configs/eval/cpu_smollm2.yaml --model runs/<run> --all-checkpoints --limit 1
    python evaluate.py ... --model runs/<run> model.checkpoints=[10,20]

``model.checkpoints`` (:func:`stapo.evaluation.config.checkpoint_selection`) picks them: ``all``, ``latest`` or a
list of training steps. Sweep folder (``output.dir``, default ``<output.root>/<run name>``, never the training
run's folder)::

    eval_manifest.json          {"kind": "checkpoint_sweep", "run_dir": ...}: marks the folder (train.py refuses
                                it and any folder inside it, a single evaluation refuses it) and pins it to one
                                training run
    run.lock                    held while a process sweeps into it (stapo.run.runlock; one writer)
    step_XXXXXX/                one evaluation run directory per checkpoint (stapo.evaluation.runner)
    sweep.csv  sweep.md  sweep.png   accuracy against the training step (stapo.evaluation.report)
    metrics.jsonl  tables.jsonl  wandb/   ONE W&B run, every checkpoint at its training step
    wandb_run_id  wandb_logged.json       its id, and the checkpoints logged to it (a rerun logs only new ones)

Resumption. A checkpoint whose folder holds a ``results.json`` made with the same generation-relevant settings
(model, prompt, data, generation, engine backend, verifier) is skipped and its results reused (one line says so);
any other is passed to :func:`stapo.evaluation.runner.run_evaluation`, whose store resumes an interrupted one
where it stopped. A damaged checkpoint (:func:`stapo.common.checkpoint_files.verify_checkpoint`) is skipped with one
line naming it. The reports are rebuilt at the end from every checkpoint evaluated in the folder with the same
settings — those selected now and those of earlier sweeps (a checkpoint since deleted by ``trainer.keep_last``
stays on the curve); the W&B run gets the points it does not hold yet (:func:`stapo.evaluation.report.log_wandb`).
``evaluate.py --dry-run`` follows the same plan (:func:`check_sweep`, :func:`sweep_jobs`, :func:`earlier_results`;
:func:`stapo.tools.estimate.eval_sweep_dry_run`).
"""
from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stapo.common.checkpoint_files import _STEP_DIR, resumable_checkpoints
from stapo.evaluation.config import EvalConfig, eval_config_to_dict, validate_eval_config
from stapo.evaluation.errors import EvalError
from stapo.evaluation.report import load_results, result_step, write_sweep_reports
from stapo.evaluation.runner import MANIFEST, SWEEP_KIND, _holding_lock, _slug, log_results_to_wandb, run_evaluation

__all__ = ["SweepPlan", "SweepJob", "plan_sweep", "sweep_run_dir", "check_sweep", "sweep_jobs", "earlier_results",
           "run_sweep"]

#: The sections of an evaluation config that decide the generations and grades of a finished checkpoint.
_SAME_RESULTS = ("model", "prompt", "data", "generation", "verifier")


class SweepPlan:
    """The checkpoints a sweep evaluates.

    Attributes:
        run_dir: the train.py run folder.
        checkpoints: ``[(step, folder)]`` of the intact selected checkpoints, oldest first.
        damaged: ``[(step, folder, reason)]`` of the selected checkpoints that are damaged (skipped).
    """

    def __init__(self, run_dir: Path, checkpoints: list[tuple[int, Path]],
                 damaged: list[tuple[int, Path, str]]) -> None:
        self.run_dir, self.checkpoints, self.damaged = run_dir, checkpoints, damaged


def _run_folder(spec: str) -> Path:
    """The train.py run folder named by ``spec``: the run folder, its ``checkpoints`` folder or a checkpoint in it.

    Raises:
        EvalError: ``spec`` is none of these (naming it).
    """
    path = Path(spec).expanduser()
    if (path / "checkpoints").is_dir():
        return path.resolve()
    if path.name == "checkpoints" and path.is_dir():
        return path.resolve().parent
    if _STEP_DIR.match(path.name) and path.parent.name == "checkpoints" and path.is_dir():
        return path.resolve().parent.parent
    raise EvalError(f"model.checkpoints needs a train.py run folder (runs/<name> with checkpoints/); model.path "
                    f"{spec!r} is not one")


def plan_sweep(spec: str, selection: str | list[int]) -> SweepPlan:
    """The checkpoints of the run ``spec`` that ``selection`` picks (``"all"``, ``"latest"`` — the newest intact
    one — or a list of training steps).

    Raises:
        EvalError: ``spec`` is not a run folder; the run has no checkpoint; a listed step has no checkpoint (the
            message lists the steps there are); no selected checkpoint is intact.
    """
    run_dir = _run_folder(spec)
    found = [(int(_STEP_DIR.match(p.name).group(1)), p, why)  # type: ignore[union-attr]
             for p, why in reversed(resumable_checkpoints(run_dir / "checkpoints"))]  # oldest first
    if not found:
        raise EvalError(f"run folder {run_dir} has no checkpoint under checkpoints/")
    if selection == "latest":
        intact = [f for f in found if f[2] is None]
        chosen = intact[-1:] + [f for f in found if f[2] is not None and f[0] > (intact[-1][0] if intact else -1)]
    elif selection == "all":
        chosen = found
    else:
        steps = {f[0] for f in found}
        missing = [s for s in selection if s not in steps]
        if missing:
            raise EvalError(f"invalid value for 'model.checkpoints': no checkpoint of step(s) {missing} in "
                            f"{run_dir / 'checkpoints'} (steps there: {sorted(steps)})")
        chosen = [f for f in found if f[0] in selection]
    chosen.sort(key=lambda f: f[0])
    plan = SweepPlan(run_dir, [(s, p) for s, p, why in chosen if why is None],
                     [(s, p, why) for s, p, why in chosen if why is not None])
    if not plan.checkpoints:
        raise EvalError(f"run folder {run_dir}: no intact checkpoint among the selected ones (each one is damaged: "
                        + "; ".join(f"{p.name}: {why}" for _, p, why in plan.damaged) + ")")
    return plan


def sweep_run_dir(cfg: EvalConfig, run_dir: Path) -> Path:
    """``output.dir`` when set, else ``<output.root>/<model.label or the run's name>``."""
    if cfg.output.dir:
        return Path(cfg.output.dir)
    return Path(cfg.output.root) / _slug(cfg.model.label or run_dir.name)


def _finished(sub: Path, cfg: EvalConfig) -> dict[str, Any] | None:
    """The results of a checkpoint's folder when they were made with the generation-relevant settings of ``cfg``
    (:data:`_SAME_RESULTS`, the engine backend), else None."""
    if not (sub / "results.json").is_file():
        return None
    try:
        res = load_results(sub)
    except EvalError:
        return None
    want, got = json.loads(json.dumps(eval_config_to_dict(cfg), default=str)), res.get("config") or {}
    for key in _SAME_RESULTS:
        a, b = dict(want.get(key) or {}), dict(got.get(key) or {})
        if key == "model":  # the row name and the sweep selection do not change a sample
            for k in ("label", "checkpoints"):
                a.pop(k, None), b.pop(k, None)
        if a != b:
            return None
    if (want.get("engine") or {}).get("backend") != (got.get("engine") or {}).get("backend"):
        return None
    return res


def _checkpoint_cfg(cfg: EvalConfig, ckpt: Path, sweep_dir: Path) -> EvalConfig:
    """The evaluation config of one checkpoint of a sweep: ``model.path`` the checkpoint, output in
    ``<sweep folder>/step_XXXXXX``, the row label ``<label>@step_XXXXXX`` (with ``model.label``)."""
    sub = copy.deepcopy(cfg)
    sub.model.path, sub.model.checkpoints = str(ckpt), None
    sub.model.label = f"{cfg.model.label}@{ckpt.name}" if cfg.model.label else None
    sub.output.dir = str(sweep_dir / ckpt.name)
    return sub


def _claim(sweep_dir: Path, run_dir: Path, write: bool = True) -> None:
    """Write (or check) the sweep folder's manifest; ``write=False`` (a dry run) only checks, creating nothing.

    Raises:
        EvalError: the folder is a train.py run folder, a single evaluation's folder, or the sweep of another run.
    """
    if (sweep_dir / "checkpoints").is_dir() or ((sweep_dir / "metrics.jsonl").is_file()
                                               and not (sweep_dir / MANIFEST).is_file()):
        raise EvalError(f"output folder {sweep_dir} is a train.py run folder (checkpoints/, metrics.jsonl): a sweep "
                        f"goes to a folder of its own; drop --output or choose another")
    path = sweep_dir / MANIFEST
    mine = {"kind": SWEEP_KIND, "run_dir": str(run_dir)}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError as e:
            raise EvalError(f"{path} is not valid JSON ({e}); move the folder away") from None
        if not isinstance(old, dict) or old.get("kind") != SWEEP_KIND:
            raise EvalError(f"output folder {sweep_dir} holds the evaluation of one model ({MANIFEST}), not a "
                            f"checkpoint sweep: choose another output directory (--output)")
        if old.get("run_dir") != str(run_dir):
            raise EvalError(f"output folder {sweep_dir} is the sweep of {old.get('run_dir')}, not of {run_dir}: "
                            f"choose another output directory (--output)")
        return
    if not write:
        return
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mine, indent=2) + "\n")


@dataclass(frozen=True)
class SweepJob:
    """One selected intact checkpoint of a sweep (:func:`sweep_jobs`).

    Attributes:
        step: its training step.
        checkpoint: its folder ``<run>/checkpoints/step_XXXXXX``.
        cfg: its evaluation config (:func:`_checkpoint_cfg`: output in ``<sweep folder>/step_XXXXXX``).
        done: the results of an earlier evaluation in that folder with the same generation-relevant settings
            (:func:`_finished`; the sweep skips it and reuses them), else None (it is evaluated, resuming).
    """

    step: int
    checkpoint: Path
    cfg: EvalConfig
    done: dict[str, Any] | None


def check_sweep(cfg: EvalConfig) -> tuple[SweepPlan, Path]:
    """Every check of a sweep that needs neither a model nor the sweep folder's lock, writing nothing: the config,
    the checkpoint selection (:func:`plan_sweep`), and the sweep folder (not inside the training run; not a
    training run's, a single evaluation's or another run's sweep folder). :func:`run_sweep` and ``evaluate.py
    --dry-run`` (:func:`stapo.tools.estimate.eval_dry_run`) both start here, so a dry run refuses what a sweep refuses.

    Returns:
        ``(plan, sweep folder)``.

    Raises:
        EvalError: ``model.checkpoints`` is not set, and as :func:`plan_sweep` and :func:`_claim`.
    """
    validate_eval_config(cfg)
    if cfg.model.checkpoints is None:
        raise EvalError("run_sweep needs model.checkpoints (all, latest or a list of steps)")
    plan = plan_sweep(cfg.model.path, cfg.model.checkpoints)
    sweep_dir = sweep_run_dir(cfg, plan.run_dir)
    if sweep_dir.resolve() == plan.run_dir or plan.run_dir in sweep_dir.resolve().parents:
        raise EvalError(f"output folder {sweep_dir} is inside the training run {plan.run_dir}: evaluation results go "
                        f"to a folder of their own; drop --output or choose another")
    _claim(sweep_dir, plan.run_dir, write=False)
    return plan, sweep_dir


def sweep_jobs(cfg: EvalConfig, plan: SweepPlan, sweep_dir: Path) -> list[SweepJob]:
    """The intact selected checkpoints of ``plan``, oldest first, each with its config and, when its folder already
    holds finished results made with the same settings, those results (read only; call it holding the sweep
    folder's lock, or in a dry run after checking it is free)."""
    jobs = []
    for step, ckpt in plan.checkpoints:
        sub = _checkpoint_cfg(cfg, ckpt, sweep_dir)
        jobs.append(SweepJob(step, ckpt, sub, _finished(Path(sub.output.dir), sub)))
    return jobs


def earlier_results(cfg: EvalConfig, plan: SweepPlan, sweep_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """``[(step, results)]`` of the checkpoints evaluated in ``sweep_dir`` by earlier sweeps with the same settings
    but not selected now (perhaps since deleted by ``trainer.keep_last``): they stay on the curve. By step."""
    if not sweep_dir.is_dir():
        return []
    chosen = {ckpt.name for _, ckpt in plan.checkpoints}
    out = []
    for folder in sorted(sweep_dir.iterdir()):
        m = _STEP_DIR.match(folder.name)
        if m and folder.name not in chosen and folder.is_dir():
            done = _finished(folder, _checkpoint_cfg(cfg, plan.run_dir / "checkpoints" / folder.name, sweep_dir))
            if done is not None:
                out.append((int(m.group(1)), done))
    return out


def run_sweep(cfg: EvalConfig, *, model_factory: Any = None, tokenizer: Any = None,
              grader: Any = None) -> dict[str, Any]:
    """Evaluate the checkpoints ``cfg.model.checkpoints`` selects of the run ``cfg.model.path``, oldest first
    (folder layout and resumption in the module docstring), then write ``sweep.csv`` / ``.md`` / ``.png`` and
    log every checkpoint into ONE W&B run at its training step (the training run's group, job_type ``eval``).

    Args:
        cfg: the evaluation config (validated again here); ``model.checkpoints`` must be set.
        model_factory: ``fn(checkpoint folder) -> model`` instead of loading each checkpoint (tests).
        tokenizer: a tokenizer to share (tests); default: each checkpoint's own.
        grader: a :class:`~stapo.tasks.grader.MathGrader` to share (not closed here); default one for the whole sweep.

    Returns:
        ``{"run_dir": sweep folder, "train_run_dir", "results": [results dict per checkpoint on the curve, by
        step], "evaluated": [steps evaluated now], "skipped": [selected steps already evaluated], "earlier": [steps
        not selected this time but evaluated in this folder before, with the same settings], "damaged": [steps
        skipped], "reports"}``.

    Raises:
        EvalError: as :func:`plan_sweep`, :func:`stapo.evaluation.runner.run_evaluation`, and an output folder that
            is a training run's, a single evaluation's or the sweep of another run.
    """
    plan, sweep_dir = check_sweep(cfg)
    for step, ckpt, why in plan.damaged:
        print(f"evaluate.py: {ckpt} is damaged ({why}); skipped", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"run_dir": str(sweep_dir), "train_run_dir": str(plan.run_dir), "results": [],
                           "evaluated": [], "skipped": [], "earlier": [],
                           "damaged": [s for s, _, _ in plan.damaged]}
    owned = None
    with _holding_lock(sweep_dir, "output.dir" if cfg.output.dir else "output.root"):
        _claim(sweep_dir, plan.run_dir)
        try:
            for job in sweep_jobs(cfg, plan, sweep_dir):
                step, ckpt, sub, done = job.step, job.checkpoint, job.cfg, job.done
                if done is not None:
                    print(f"evaluate.py: {ckpt.name} already evaluated ({sub.output.dir}); skipped",
                          file=sys.stderr, flush=True)
                    out["results"].append(done)
                    out["skipped"].append(step)
                    continue
                if grader is None:
                    from stapo.tasks.grader import MathGrader

                    grader = owned = MathGrader(num_workers=cfg.grader.num_workers, timeout_s=cfg.grader.timeout_s,
                                                require_value=cfg.grader.require_value)
                print(f"evaluate.py: evaluating {ckpt.name} (step {step}) into {sub.output.dir}", file=sys.stderr,
                      flush=True)
                model = model_factory(ckpt) if model_factory is not None else None
                out["results"].append(run_evaluation(sub, model=model, tokenizer=tokenizer, grader=grader,
                                                     wandb=False))
                out["evaluated"].append(step)
        finally:
            if owned is not None:
                owned.close()
        for step, done in earlier_results(cfg, plan, sweep_dir):
            out["results"].append(done)
            out["earlier"].append(step)
        out["results"].sort(key=result_step)
        title = f"{cfg.model.label or plan.run_dir.name} ({plan.run_dir})"
        out["reports"] = {k: str(v) for k, v in
                          write_sweep_reports(out["results"], sweep_dir, title=title, plot=cfg.output.plot).items()}
        log_results_to_wandb(out["results"], sweep_dir, cfg, name=f"eval-{cfg.model.label or plan.run_dir.name}")
    return out
