"""What a run will cost, before it starts: ``train.py --dry-run`` and ``evaluate.py --dry-run`` (issue 16, item 7).

Pure functions from a config (plus the sizes the start-up checks already read: prompt lengths, the model's
parameter count and shape) to a cost dataclass, a formatter for each, and the measured throughput a time estimate
is scaled from:

* :func:`train_cost` → :class:`TrainCost`: per step and in total — prompts, responses (prompts × G), the
  generated-token bound (responses × ``rollout.response_length``), prompt tokens, the forward/backward passes of
  the update plan (:func:`stapo.train.plan.build_plan`), optimizer steps, checkpoints and their size, validation
  samples, the FLOPs of a step at the bound (:mod:`stapo.common.perf`'s counts).
* :func:`eval_cost` → :class:`EvalCost`: problems per benchmark (after ``--limit``), samples per setting (avg@N),
  the samples still to generate (a rerun resumes) and their generated-token bound; for a checkpoint sweep
  (``model.checkpoints``), those of every checkpoint still to evaluate, planned by the sweep's own functions
  (:func:`stapo.evaluation.sweep.check_sweep`, :func:`~stapo.evaluation.sweep.sweep_jobs`).
* Time: only from a measurement, never guessed. Training: the throughput cache that every finished ``train.py``
  run writes (:func:`record_train_throughput`: ``$STAPO_CACHE_DIR`` or ``~/.cache/stapo``, ``throughput.json``,
  keyed by model, device, compute dtype and :func:`machine_key`), else the ``metrics.jsonl`` of an earlier run of
  the same model and compute dtype under ``trainer.output_dir`` (whose machine is not recorded, which the output
  says), else "unknown". Evaluation: the ``results.json`` of an earlier evaluation of the same model, backend and
  dtype under ``output.root`` (its ``run.tokens_per_s`` and mean response length), else "unknown".

Scaling rule (training): seconds per step grow with the generated-token bound, so a measurement at B' responses ×
R' tokens gives ``seconds_per_step × (B·R) / (B'·R')`` — exact at the measured shape, a first-order guess
elsewhere (the output names the shape it was measured at). Step time excludes validation and checkpoint saves.

Example (``configs/tiny_test.yaml``: 2 prompts × G = 4, 8 new tokens, 2 steps): 8 responses and at most 64
generated tokens per step, 128 in all; mini-batches of 1 prompt → 2 optimizer steps per step.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from stapo.run.provenance import read_launches
from stapo.run.throughput import (  # noqa: F401 - re-exported
    Measured,
    _cache_key,
    _measured_from_rows,
    _median,
    lookup_train_throughput,
    machine_key,
    record_train_throughput,
    throughput_cache_path,
)
from stapo.run.tracking import CorruptJsonlError, read_metrics

__all__ = ["TrainCost", "EvalCost", "Measured", "ModelSize", "train_cost", "eval_cost", "checkpoint_steps",
           "model_size", "machine_key", "throughput_cache_path", "record_train_throughput", "lookup_train_throughput",
           "measured_from_runs", "measured_from_evaluations", "format_train_cost", "format_eval_cost",
           "train_dry_run", "eval_dry_run", "eval_sweep_dry_run"]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


# --- sizes ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSize:
    """The policy's parameter count and matmul shape, read from its config (no weights are loaded).

    Attributes:
        params: trainable parameters (tied weights once), as ``sum(p.numel() for p in model.parameters())``.
        shape: :class:`stapo.common.perf.ModelShape` (FLOP counts), or None when the architecture has no such fields.
    """

    params: int
    shape: Any = None


def model_size(path: str, cache_dir: str | None = None, tokenizer: Any = None) -> ModelSize | None:
    """Build the model ``path`` on PyTorch's ``meta`` device (shapes only, no memory, no weights read) and count
    its parameters. ``"tiny"``: :func:`stapo.model.models.build_tiny_model` as the trainer builds it; an embedded alias,
    a folder or a hub id: its ``config.json`` (``AutoConfig``), found as :func:`stapo.model.models.load_policy` finds
    it.

    Returns:
        :class:`ModelSize`, or None when the config cannot be read (a hub id offline and not cached, an
        architecture transformers does not know): the estimate then says "unknown" for what needs it.
    """
    import torch

    from stapo.common.perf import ModelShape
    from stapo.model.models import _resolve_source, _source_kwargs, build_tiny_model

    try:
        with torch.device("meta"):
            if path == "tiny":
                model = build_tiny_model(tokenizer=tokenizer, cache_dir=cache_dir)[0]
            else:  # resolved as load_policy resolves it (embedded alias, folder, hub id: HF cache when offline)
                from transformers import AutoConfig, AutoModelForCausalLM

                source, local = _resolve_source(path, cache_dir)
                hub = None if local else source
                config = AutoConfig.from_pretrained(source, **_source_kwargs(local, cache_dir, hub))
                model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an estimate without the size beats no estimate; the output says unknown
        return None
    params = sum(p.numel() for p in model.parameters())
    try:
        shape = ModelShape.from_hf_config(model.config)
    except (AttributeError, TypeError, ValueError):
        shape = None
    return ModelSize(params=int(params), shape=shape)


def checkpoint_steps(start_step: int, total_steps: int, save_every: int) -> list[int]:
    """The steps after which :meth:`stapo.train.Trainer.train` writes a checkpoint: every ``save_every`` steps and
    the last one, of the steps ``start_step + 1 … total_steps`` this run trains.

    Example: ``checkpoint_steps(0, 25, 10)`` → ``[10, 20, 25]``; ``checkpoint_steps(0, 3, 0)`` → ``[3]``.
    """
    return [s for s in range(start_step + 1, total_steps + 1) if (save_every and s % save_every == 0)
            or s == total_steps]


def _run_ranks(run: Path) -> int | None:
    """The data-parallel ranks of a run folder's last launch (``run_info.json``, :mod:`stapo.run.provenance`), or
    None."""
    try:
        launches = read_launches(run)
        return int(launches[-1]["world_size"]) if launches else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measured_from_runs(output_dir: str | os.PathLike, model: str, compute_dtype: str,
                       exclude: str | os.PathLike | None = None) -> Measured | None:
    """The newest run folder under ``output_dir`` whose ``config.json`` has this ``model.path`` and (resolved)
    ``model.compute_dtype`` and whose ``metrics.jsonl`` holds step rows with ``timing_s/step``: the medians of
    those rows. ``exclude``: a run folder to skip (none skipped by default: a resumed run's own rows count).

    Returns:
        :class:`Measured` (its ``source`` names the file and says that the machine is not recorded), or None.
    """
    root = Path(output_dir)
    found = []
    for cfg_file in root.glob("*/config.json") if root.is_dir() else []:
        run = cfg_file.parent
        if exclude is not None and run.resolve() == Path(exclude).resolve():
            continue
        metrics = run / "metrics.jsonl"
        try:
            saved = json.loads(cfg_file.read_text())
            same = (saved["model"]["path"] == model and saved["model"].get("compute_dtype") == compute_dtype)
            if not same or not metrics.is_file():
                continue
            responses = int(saved["data"]["train_batch_size"]) * int(saved["rollout"]["n"])
            length = int(saved["rollout"]["response_length"])
            rows = read_metrics(metrics)
        except (OSError, ValueError, KeyError, TypeError, CorruptJsonlError):
            continue
        m = _measured_from_rows(rows, responses, length, f"{metrics} (an earlier run of this model and compute "
                                                         f"dtype; its machine is not recorded)", ranks=_run_ranks(run))
        if m is not None:
            found.append((metrics.stat().st_mtime, m))
    return max(found, key=lambda x: x[0])[1] if found else None


def measured_from_evaluations(root: str | os.PathLike, model_path: str | Sequence[str], backend: str, dtype: str,
                              also: Iterable[str | os.PathLike] = ()) -> Measured | None:
    """The newest ``results.json`` (``also`` folders first, then every ``<root>/*/`` and ``<root>/*/step_*/``: a
    sweep's checkpoints) of an evaluation of ``model_path`` (the resolved model path, or several: e.g. the
    checkpoints of one run, which share the shape) with this backend and dtype whose ``run.tokens_per_s`` is set (a
    rerun that generated nothing has none): its generation rate and mean response length.

    Returns:
        :class:`Measured` (``seconds_per_step`` None; ``response_length`` = its ``max_new_tokens``), or None.
    """
    paths = {model_path} if isinstance(model_path, str) else set(model_path)
    candidates = [Path(a) / "results.json" for a in also]
    base = Path(root)
    if base.is_dir():  # single evaluations, and the checkpoints of sweeps (stapo.evaluation.sweep)
        candidates += sorted(base.glob("*/results.json")) + sorted(base.glob("*/step_*/results.json"))
    found = []
    for f in candidates:
        try:
            res = json.loads(f.read_text())
            rate = res["run"].get("tokens_per_s")
            same = (res["model"]["path"] in paths and res["model"].get("dtype") == dtype
                    and res["protocol"]["engine"]["backend"] == backend)
            if not same or not rate:
                continue
            lengths = [(m["average"]["mean_response_tokens"], m["average"]["samples"]) for m in res["metrics"].values()]
            total = sum(n for _, n in lengths)
            mean = sum(x * n for x, n in lengths) / total if total else None
            found.append((f.stat().st_mtime, Measured(
                seconds_per_step=None, tokens_per_s=float(rate), responses=int(res["run"].get("generated", 0)),
                response_length=int(res["protocol"]["max_new_tokens"]), mean_response_tokens=mean,
                source=f"{f} (an earlier evaluation of this model, backend and dtype; its machine is not recorded)")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return max(found, key=lambda x: x[0])[1] if found else None


# --- training -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainCost:
    """The cost of a ``train.py`` run (:func:`train_cost`). "Per step" is the whole batch (all ranks); forward
    passes are per rank.

    Attributes:
        start_step, total_steps, steps: the run trains steps ``start_step + 1 … total_steps`` (``steps`` of them).
        prompts, responses: per step (``data.train_batch_size``; × ``rollout.n`` = G).
        response_length: ``rollout.response_length`` (tokens).
        generated_tokens_bound: per step, responses × response_length (every response at the cap).
        prompt_tokens: per step, prompts × the mean prompt length of the training set (tokens), or None.
        optimizer_steps: per step (``data.train_batch_size / actor.ppo_mini_batch_size`` mini-batches).
        forwards, backwards: per step and rank, micro-batch forward passes (every pass of the plan) and those
            with a backward (the update's), from :func:`stapo.train.plan.build_plan` with every Â > 0.
        checkpoints: the steps a checkpoint is written after; checkpoints_kept: ``trainer.keep_last`` of them.
        checkpoint_bytes: one checkpoint (HF export in the compute dtype + DCP parameters and AdamW moments in the
            parameter dtype), or None when the parameter count is unknown.
        params: the policy's parameters, or None.
        validations: the validation runs of this run (``trainer.val_before_train`` at step 0 + every
            ``trainer.val_every`` steps); validation_samples: responses of one (problems × N × decoding settings);
            validation_tokens_bound: their generated-token bound; validation_problems: problems of one;
            validation_settings: its decoding settings; validation_max_new_tokens: its generation limit;
            validation_samples_per_rank: the responses the busiest rank generates in one (each engine call — a block
            of ``validation.samples_per_call`` — is split over the ranks: Σ over blocks of ⌈block problems / ranks⌉
            × N × settings); validation_calls: engine calls (blocks) of one validation, each rank's share of a call
            generated at once; validation_seconds: the time of one validation's generation, or None (unknown).
        flops_per_step: model FLOPs of a step at the bound (rollout + every planned forward and backward), or None.
        ranks: data-parallel ranks.
        seconds_per_step: the time estimate, or None (unknown); measured: what it is scaled from.
    """

    start_step: int
    total_steps: int
    steps: int
    prompts: int
    responses: int
    response_length: int
    generated_tokens_bound: int
    prompt_tokens: float | None
    optimizer_steps: int
    forwards: int
    backwards: int
    checkpoints: list[int]
    checkpoints_kept: int
    checkpoint_bytes: int | None
    params: int | None
    validations: int = 0
    validation_samples: int = 0
    validation_tokens_bound: int = 0
    validation_problems: int = 0
    validation_settings: int = 1
    validation_max_new_tokens: int = 0
    validation_samples_per_rank: int = 0
    validation_calls: int = 0
    validation_seconds: float | None = None
    flops_per_step: float | None = None
    ranks: int = 1
    seconds_per_step: float | None = None
    measured: Measured | None = None

    @property
    def seconds_total(self) -> float | None:
        """seconds_per_step × steps (no validation or checkpoint time), or None."""
        return None if self.seconds_per_step is None else self.seconds_per_step * self.steps


def train_cost(cfg: Any, *, start_step: int = 0, prompt_lengths: Sequence[int] | None = None,
               size: ModelSize | None = None, ranks: int = 1, validation_problems: int = 0,
               measured: Measured | None = None, strategy: str = "none", validation_settings: int = 1,
               validation_samples_per_call: int | None = None) -> TrainCost:
    """The cost of training ``cfg`` from ``start_step`` to ``trainer.total_steps``.

    Args:
        cfg: a validated :class:`~stapo.config.TrainConfig` (``model.compute_dtype`` resolved, or ``auto``: the
            HF export is then counted at 4 bytes per parameter).
        start_step: the step a resume continues from (0: a fresh run).
        prompt_lengths: token counts of the training prompts (:func:`stapo.train.prompts.load_prompts`), or None.
        size: the policy's size (:func:`model_size`), or None.
        ranks: data-parallel ranks (the plan is per rank: ``train_batch_size / ranks`` prompts).
        validation_problems: problems of one validation run (after ``validation.limit``), Σ over its benchmarks.
        validation_settings: decoding settings of one validation (the config's hook has one).
        validation_samples_per_call: the validation's engine-call size; default ``validation.samples_per_call``.
        measured: a measured step time to scale (:class:`Measured`), or None.
        strategy: ``"fsdp2"`` keeps every fused forward's graph (:func:`~stapo.train.plan.build_plan`).

    Returns:
        :class:`TrainCost`.
    """
    import torch

    from stapo.config import objective_from_config
    from stapo.train.plan import build_plan
    from stapo.train.policy import forward_layout

    tc, dc, rc, ac = cfg.trainer, cfg.data, cfg.rollout, cfg.actor
    G, R = int(rc.n), int(rc.response_length)
    prompts = int(dc.train_batch_size)
    responses = prompts * G
    objective = objective_from_config(cfg)
    rows = prompts // ranks * G  # this rank's rows
    mean_prompt = statistics.fmean(prompt_lengths) if prompt_lengths else None
    P = int(round(mean_prompt)) if mean_prompt is not None else 0
    # the plan at the bound: every row P + R tokens, every Â > 0 (a fused mini-batch's rows all deferred)
    plan = build_plan(torch.full((rows,), P + R), torch.ones(rows), mini_batch_rows=ac.ppo_mini_batch_size // ranks * G,
                      micro_batch_size=ac.ppo_micro_batch_size, token_mask=objective.token_mask,
                      mask_stats_source=cfg.algorithm.mask_stats_source, fused_forward=ac.fused_forward,
                      sort_by_length=ac.sort_by_length and not ac.share_prompt, has_reference=objective.kl_coef > 0,
                      keep_all_graphs=strategy == "fsdp2",
                      token_budget=ac.ppo_max_token_len_per_gpu if ac.use_dynamic_bsz else None,
                      layout=forward_layout(ac.use_remove_padding, cfg.model.attn_implementation))
    grad_steps = [m for mb in plan.minibatches for m in mb.forwards]
    recomputed = [m for m in grad_steps if m.deferred] if ac.deferred_graphs == "recompute" else []
    forwards = plan.num_forwards + len(recomputed)  # "recompute": each deferred micro-batch is forwarded twice
    ckpts = checkpoint_steps(start_step, tc.total_steps, tc.save_every)
    ckpt_bytes = None
    if size is not None:  # HF export (compute dtype) + DCP: parameters and two AdamW moments (parameter dtype)
        export = _ITEMSIZE.get(cfg.model.compute_dtype, 4)
        ckpt_bytes = size.params * (export + 3 * _ITEMSIZE[cfg.model.param_dtype])
    validations = 0
    if tc.val_every:
        validations = sum(1 for s in range(start_step + 1, tc.total_steps + 1) if s % tc.val_every == 0)
    validations += int(bool(getattr(tc, "val_before_train", False)) and start_step == 0)
    val_n, settings = int(cfg.validation.samples), int(validation_settings)
    val_samples = validation_problems * val_n * settings
    val_new = min(int(cfg.validation.max_new_tokens or R), R)
    # the blocks of stapo.evaluation.runner.plan_blocks (one N): max(1, samples_per_call // N) problems each, every
    # block split over the ranks (runner.shard_positions) → the busiest rank's problems per block: ⌈size / ranks⌉
    spc = int(validation_samples_per_call or getattr(cfg.validation, "samples_per_call", 256))
    per_block = max(1, spc // val_n)
    sizes = [min(per_block, validation_problems - i) for i in range(0, validation_problems, per_block)]
    val_per_rank = sum(-(-k // ranks) for k in sizes) * val_n * settings
    val_seconds = None
    if validation_problems and measured is not None and measured.rollout_seconds:
        # the training rollout's seconds per generated-token bound of one rank, at the validation's bound per rank
        then = measured.responses * measured.response_length / (measured.ranks or ranks)
        val_seconds = measured.rollout_seconds * val_per_rank * val_new / then if then else None
    flops = None
    if size is not None and size.shape is not None and mean_prompt is not None:
        from stapo.common.perf import decode_work, forward_work, prefill_work

        itemsize = _ITEMSIZE.get(cfg.model.compute_dtype, 4)
        rollout = prefill_work(size.shape, [P] * responses).flops + decode_work(
            size.shape, [P] * responses, [R] * responses, itemsize).flops
        # one row's forward (a backward is 2× its forward); actor.share_prompt: a group's G rows share one prompt pass
        row = (forward_work(size.shape, G, P, R, prompts=1).flops / G if ac.share_prompt
               else forward_work(size.shape, 1, P, R).flops)
        grad_rows = sum(len(m.rows) for m in grad_steps)
        nograd_rows = (sum(len(r) for r in (*plan.old_pass, *plan.ref_pass))
                       + sum(len(r) for mb in plan.minibatches for r in mb.stats_pass)
                       + sum(len(m.rows) for m in recomputed))
        flops = rollout + ranks * row * (nograd_rows + 3 * grad_rows)
    seconds = None
    if measured is not None and measured.seconds_per_step is not None:
        bound, then = responses * R, measured.responses * measured.response_length
        seconds = measured.seconds_per_step * bound / then if then else None
    return TrainCost(
        start_step=int(start_step), total_steps=int(tc.total_steps), steps=max(int(tc.total_steps) - start_step, 0),
        prompts=prompts, responses=responses, response_length=R, generated_tokens_bound=responses * R,
        prompt_tokens=prompts * mean_prompt if mean_prompt is not None else None,
        optimizer_steps=prompts // ac.ppo_mini_batch_size, forwards=forwards, backwards=len(grad_steps),
        checkpoints=ckpts, checkpoints_kept=min(len(ckpts), tc.keep_last), checkpoint_bytes=ckpt_bytes,
        params=size.params if size is not None else None, validations=validations, validation_samples=val_samples,
        validation_tokens_bound=val_samples * val_new, validation_problems=int(validation_problems),
        validation_settings=settings, validation_max_new_tokens=val_new,
        validation_samples_per_rank=val_per_rank, validation_calls=len(sizes) * settings,
        validation_seconds=val_seconds, flops_per_step=flops, ranks=ranks, seconds_per_step=seconds,
        measured=measured)


# --- evaluation -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalCost:
    """The cost of an ``evaluate.py`` run (:func:`eval_cost`).

    Attributes:
        benchmarks: ``{benchmark: {"problems", "loaded", "dropped", "N", "prompt_tokens"}}`` — problems evaluated
            (after ``data.limit`` and ``data.max_prompt_tokens``), loaded, dropped for a long prompt, samples per
            problem, Σ prompt tokens of its problems.
        settings: the decoding settings' names.
        samples_per_setting: Σ problems × N (the samples of one avg@N table column).
        samples: every sample of the run (× settings × checkpoints).
        pending: samples still to generate (a rerun resumes: complete problems are skipped).
        max_new_tokens: ``generation.max_new_tokens``.
        tokens_bound: pending × max_new_tokens.
        seconds_bound, seconds_expected: the pending samples at the cap / at the measured mean response length,
            over the measured generation rate; None when unknown. measured: the measurement.
        checkpoints: the checkpoints evaluated (a sweep's still to evaluate; 1 for a single evaluation), each with
            ``benchmarks`` and ``settings``.
    """

    benchmarks: dict[str, dict[str, int]]
    settings: list[str]
    samples_per_setting: int
    samples: int
    pending: int
    max_new_tokens: int
    tokens_bound: int
    seconds_bound: float | None = None
    seconds_expected: float | None = None
    measured: Measured | None = None
    checkpoints: int = 1


def eval_cost(benchmarks: Mapping[str, Mapping[str, int]], settings: Sequence[str], pending: int, max_new_tokens: int,
              measured: Measured | None = None, checkpoints: int = 1) -> EvalCost:
    """Samples, the generated-token bound and the time of an evaluation.

    Args:
        benchmarks: ``{benchmark: {"problems", "N", ...}}`` (see :class:`EvalCost`).
        settings: decoding setting names.
        pending: samples not stored yet (all of them for a new run directory).
        max_new_tokens: tokens per response at most.
        measured: an earlier evaluation's generation rate (:func:`measured_from_evaluations`), or None.
        checkpoints: how many checkpoints are evaluated with these benchmarks and settings (a sweep); ``pending``
            counts the samples of all of them.

    Example: AIME24 (2 problems, N = 3) and MATH500 (2 problems, N = 2) under 2 settings, 8 new tokens:
    2·3 + 2·2 = 10 samples per setting, 20 in all, ≤ 160 generated tokens; 3 checkpoints of a sweep: 60.
    """
    per = sum(int(b["problems"]) * int(b["N"]) for b in benchmarks.values())
    bound = int(pending) * int(max_new_tokens)
    sec_bound = sec_exp = None
    if measured is not None and measured.tokens_per_s:
        sec_bound = bound / measured.tokens_per_s
        if measured.mean_response_tokens is not None:
            sec_exp = pending * min(measured.mean_response_tokens, max_new_tokens) / measured.tokens_per_s
    return EvalCost(benchmarks={k: dict(v) for k, v in benchmarks.items()}, settings=list(settings),
                    samples_per_setting=per, samples=per * len(settings) * int(checkpoints), pending=int(pending),
                    max_new_tokens=int(max_new_tokens), tokens_bound=bound, seconds_bound=sec_bound,
                    seconds_expected=sec_exp, measured=measured, checkpoints=int(checkpoints))


# --- formatting -----------------------------------------------------------------------------------------------
def _n(x: float | int | None) -> str:
    """12,345 / 1.23 M / 4.5 G; "unknown" for None."""
    if x is None:
        return "unknown"
    for scale, unit in ((1e12, " T"), (1e9, " G"), (1e6, " M")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:,.0f}" if float(x).is_integer() or abs(x) >= 100 else f"{x:.3g}"


def _bytes(b: float | None) -> str:
    if b is None:
        return "unknown"
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


def _table(rows: Sequence[tuple[str, str, str]]) -> list[str]:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return [f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]


def format_train_cost(c: TrainCost, cfg: Any) -> str:
    """The cost lines of ``train.py --dry-run`` (a table per step / in total, then checkpoints, validation, time)."""
    rank = " per rank" if c.ranks > 1 else ""
    rows = [("", "per step", "total"),
            ("prompts", _n(c.prompts), _n(c.prompts * c.steps)),
            (f"responses (G = {cfg.rollout.n})", _n(c.responses), _n(c.responses * c.steps)),
            (f"generated tokens ≤ (× {c.response_length})", _n(c.generated_tokens_bound),
             _n(c.generated_tokens_bound * c.steps)),
            ("prompt tokens ≈ (mean prompt)", _n(c.prompt_tokens),
             _n(None if c.prompt_tokens is None else c.prompt_tokens * c.steps)),
            (f"forward passes{rank}", _n(c.forwards), _n(c.forwards * c.steps)),
            (f"  with a backward{rank}", _n(c.backwards), _n(c.backwards * c.steps)),
            ("optimizer steps", _n(c.optimizer_steps), _n(c.optimizer_steps * c.steps)),
            ("model FLOPs ≤", _n(c.flops_per_step),
             _n(None if c.flops_per_step is None else c.flops_per_step * c.steps))]
    last = c.start_step + c.steps
    lines = [f"cost estimate: steps {c.start_step + 1}–{last} of {c.total_steps} ({c.steps} step(s)"
             f"{', resumed from step ' + str(c.start_step) if c.start_step else ''}"
             f"{f', {c.ranks} ranks' if c.ranks > 1 else ''})", *_table(rows),
             "  (forward passes: the update plan with every Â > 0; a fused mini-batch whose rows split may take one "
             "more micro-batch)"]
    size = _bytes(c.checkpoint_bytes)
    params = (f"{_n(c.params)} parameters × ({_ITEMSIZE.get(cfg.model.compute_dtype, 4)} B HF export + "
              f"3 × {_ITEMSIZE[cfg.model.param_dtype]} B parameters and AdamW moments)" if c.params else
              "parameter count unknown")
    shown = ", ".join(map(str, c.checkpoints[:6])) + (", …" if len(c.checkpoints) > 6 else "")
    lines.append(f"checkpoints: {len(c.checkpoints)} written (after step{'s' if len(c.checkpoints) != 1 else ''} "
                 f"{shown}), {c.checkpoints_kept} kept; {size} each ({params}); on disk ≤ "
                 f"{_bytes(None if c.checkpoint_bytes is None else c.checkpoint_bytes * c.checkpoints_kept)}")
    tc = cfg.trainer
    if tc.val_every or tc.val_before_train:
        when = " + ".join(([f"every {tc.val_every} steps"] if tc.val_every else [])
                          + (["step 0 (trainer.val_before_train)"] if tc.val_before_train else []))
        lines.append(f"validation: {c.validations} run(s) ({when}) × {_n(c.validation_samples)} responses "
                     f"({_n(c.validation_problems)} problems × N = {cfg.validation.samples} × "
                     f"{c.validation_settings} setting(s)) ≤ {_n(c.validation_tokens_bound)} generated tokens each "
                     f"(× {c.validation_max_new_tokens}), "
                     f"{_n(c.validation_tokens_bound * c.validations)} in all")
        if c.ranks > 1:
            lines.append(f"  split over {c.ranks} ranks: ≤ {_n(c.validation_samples_per_rank)} responses "
                         f"(≤ {_n(c.validation_samples_per_rank * c.validation_max_new_tokens)} tokens) on the "
                         f"busiest rank, in {c.validation_calls} engine call(s) (validation.samples_per_call="
                         f"{getattr(cfg.validation, 'samples_per_call', 256)}; a call ends with its longest response)")
        if c.validation_seconds is None:
            lines.append("  time: unknown (no measured rollout time of this model, device and compute dtype)"
                         if c.validation_problems else "  time: unknown (the validation's problems were not read)")
        else:
            m = c.measured
            assert m is not None
            lines.append(f"  time: ≈ {_duration(c.validation_seconds)} per validation, ≈ "
                         f"{_duration(c.validation_seconds * c.validations)} in all (the generation only: the "
                         f"training rollout's median {m.rollout_seconds:.3g} s for {m.responses} responses × "
                         f"{m.response_length} tokens on {m.ranks or c.ranks} rank(s), scaled by the generated-token "
                         f"bound per rank; grading not included)")
    else:
        lines.append("validation: off (trainer.val_every=0, trainer.val_before_train=false)")
    if c.seconds_per_step is None:
        lines.append("time: unknown (no measured throughput of this model, device and compute dtype on this "
                     "machine; a finished train.py run records one)")
    else:
        m = c.measured
        assert m is not None
        how = ("measured at this shape" if m.responses * m.response_length == c.generated_tokens_bound else
               f"scaled by the generated-token bound from {m.responses} responses × {m.response_length} tokens")
        lines.append(f"time: ≈ {_duration(c.seconds_per_step)} per step, ≈ {_duration(c.seconds_total)} for "
                     f"{c.steps} step(s) without validation and saves ({how}: median {m.seconds_per_step:.3g} s/step "
                     f"over {m.steps} step(s), from {m.source})")
    return "\n".join(lines)


def format_eval_cost(c: EvalCost) -> str:
    """The cost lines of ``evaluate.py --dry-run`` (a table per benchmark, then samples, tokens, time)."""
    rows = [("benchmark", "problems", "N  samples/setting  prompt tokens")]
    for name, b in c.benchmarks.items():
        dropped = f" ({b['dropped']} dropped: long prompt)" if b.get("dropped") else ""
        rows.append((name, _n(b["problems"]), f"{b['N']:<3}{_n(b['problems'] * b['N']):>16}  "
                                               f"{_n(b.get('prompt_tokens')):>13}{dropped}"))
    per_ckpt = f" × {c.checkpoints} checkpoint(s)" if c.checkpoints != 1 else ""
    lines = [f"cost estimate{' (per checkpoint)' if per_ckpt else ''}:", *_table(rows),
             f"samples: {_n(c.samples_per_setting)} per setting (avg@N) × {len(c.settings)} setting(s) "
             f"({', '.join(c.settings)}){per_ckpt} = {_n(c.samples)}; to generate: {_n(c.pending)}"
             f"{' (the rest are stored: a rerun resumes)' if c.pending < c.samples else ''}",
             f"generated tokens ≤ {_n(c.tokens_bound)} ({_n(c.pending)} × {c.max_new_tokens} max new tokens)"]
    m = c.measured
    if c.pending == 0:
        lines.append("time: nothing to generate (the reports are rebuilt)")
    elif m is None or c.seconds_bound is None:
        lines.append("time: unknown (no earlier evaluation of this model, backend and dtype under output.root "
                     "records a generation rate)")
    else:
        mean = (f"≈ {_duration(c.seconds_expected)} at its mean response length of "
                f"{m.mean_response_tokens:.0f} tokens, "
                if c.seconds_expected is not None else "")
        lines.append(f"time: {mean}≤ {_duration(c.seconds_bound)} at the cap (generation at {m.tokens_per_s:.3g} "
                     f"tokens/s, from {m.source}; grading not included)")
    return "\n".join(lines)


def _yaml(d: Mapping[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(dict(d)))


# --- the dry runs -------------------------------------------------------------------------------------------------
def train_dry_run(trainer: Any) -> str:
    """What ``train.py --dry-run`` prints: the resolved config (YAML, ``model.compute_dtype`` resolved for the
    device), the run folder and where the run would start, :func:`format_train_cost` and the GPU memory per phase
    (:func:`stapo.run.memory_plan.format_plan` of the plan the trainer checked at start-up).

    Args:
        trainer: a :class:`stapo.train.Trainer` built with ``preflight_only=True`` (every start-up check passed, the
            tokenizer and training prompts loaded, no model, nothing written).
    """
    from stapo.config import to_dict
    from stapo.evaluation.runner import load_problems

    cfg = trainer.cfg
    plan = trainer.resume_plan
    start = plan.step if plan is not None else 0
    size = model_size(cfg.model.path, cfg.model.cache_dir, trainer.tokenizer)
    hook = trainer.validation_hook
    val_problems, val_settings, val_spc = 0, 1, None
    if hook is not None and (cfg.trainer.val_every or cfg.trainer.val_before_train):
        loaded = load_problems(hook.data_root or cfg.data.root, hook.benchmarks, hook.limit)
        val_problems = sum(len(p) for p in loaded.values())
        val_settings, val_spc = len(getattr(hook, "settings", [None])), getattr(hook, "samples_per_call", None)
    measured = (lookup_train_throughput(cfg.model.path, trainer.device, cfg.model.compute_dtype,
                                        machine_key(trainer.device))
                or measured_from_runs(cfg.trainer.output_dir, cfg.model.path, cfg.model.compute_dtype))
    cost = train_cost(cfg, start_step=start, prompt_lengths=[len(p[0]) for p in trainer.prompts], size=size,
                      ranks=trainer.dist.world, validation_problems=val_problems, measured=measured,
                      strategy=trainer.dist.strategy, validation_settings=val_settings,
                      validation_samples_per_call=val_spc)
    where = (f"resumes from {plan.checkpoint} (step {plan.step})" if plan is not None else "starts at step 0")
    exists = "exists" if Path(trainer.run_dir).is_dir() else "not created by --dry-run"
    head = [f"# train.py --dry-run: the resolved config (model.compute_dtype for {trainer.device})",
            _yaml(to_dict(cfg)).rstrip(),
            f"run directory: {trainer.run_dir} ({exists}); the run {where}",
            f"training prompts: {len(trainer.prompts)} (data/num_dropped_too_long "
            f"{trainer.prompt_stats.get('data/num_dropped_too_long', 0):.0f})"]
    from stapo.run.memory_plan import format_plan

    mem = getattr(trainer, "memory_plan", None)  # checked at start-up (stapo/run/memory_plan.py::check_memory_plan)
    memory = (format_plan(mem) if mem is not None else
              f"memory plan: unknown (the shape of model.path {cfg.model.path} could not be read)")
    return "\n".join(head + [format_train_cost(cost, cfg), memory, _start_up_memory(cfg, size, trainer)])


def _start_up_memory(cfg: Any, size: ModelSize | None, trainer: Any) -> str:
    """The dry run's line on the host memory of the weights at start-up
    (:func:`stapo.model.distributed.start_up_host_bytes`; ``model.meta_init``: rank 0 alone reads them)."""
    from stapo.model.distributed import start_up_host_bytes

    if size is None:
        return "start-up host memory: unknown (the parameter count of model.path is unknown)"
    mc, ranks = cfg.model, trainer.dist.world
    host = start_up_host_bytes(size.params, mc.param_dtype, mc.compute_dtype, reference=trainer.objective.kl_coef > 0,
                               ranks=ranks, meta_init=mc.meta_init)
    ref = f", then the {mc.compute_dtype} reference {_bytes(host['reference'])}" if host["reference"] else ""
    who = ("rank 0 alone (model.meta_init: the other ranks build the model on the meta device and receive its "
           "weights)" if mc.meta_init else "every rank (model.meta_init=false)")
    many = f" of {ranks} ranks" if ranks > 1 else ""
    return (f"start-up host memory (weights): the {mc.param_dtype} policy {_bytes(host['policy'])}{ref}, read by "
            f"{who}: ≤ {_bytes(host['per_node'])} per node{many}")


def eval_dry_run(cfg: Any) -> str:
    """What ``evaluate.py --dry-run`` prints: every check of :func:`stapo.evaluation.runner.run_evaluation` that
    needs no model (``dry_run=True``: nothing written, no lock taken), then the resolved config (YAML), the run
    directory and :func:`format_eval_cost`. With ``model.checkpoints`` (``--all-checkpoints`` / ``--checkpoints``)
    the sweep's plan instead (:func:`eval_sweep_dry_run`).

    Raises:
        stapo.evaluation.EvalError: as :func:`~stapo.evaluation.runner.run_evaluation` before it loads the model.
    """
    from stapo.evaluation.config import eval_config_to_dict
    from stapo.evaluation.runner import run_evaluation

    if cfg.model.checkpoints is not None:
        return eval_sweep_dry_run(cfg)
    plan = run_evaluation(cfg, dry_run=True)
    cost, _ = _plan_cost(cfg, [plan], measured_from_evaluations(
        cfg.output.root, plan["source"].path, cfg.engine.backend, cfg.model.dtype, also=[plan["run_dir"]]))
    source = plan["source"]
    exists = "exists" if Path(plan["run_dir"]).is_dir() else "not created by --dry-run"
    head = ["# evaluate.py --dry-run: the resolved config", _yaml(eval_config_to_dict(cfg)).rstrip(),
            f"model: {source.spec} ({source.kind}{f', step {source.step}' if source.step is not None else ''}); "
            f"prompt: {plan['prompt'].style} ({plan['prompt'].source})",
            f"run directory: {plan['run_dir']} ({exists})"]
    return "\n".join(head + [format_eval_cost(cost)])


def _plan_cost(cfg: Any, plans: Sequence[Mapping[str, Any]], measured: Measured | None) -> tuple[EvalCost, list[int]]:
    """The :class:`EvalCost` of the dry-run plans of one or more checkpoints evaluated with ``cfg``'s benchmarks
    and settings (:func:`~stapo.evaluation.runner.run_evaluation` with ``dry_run=True``; the problems of the first
    one — the checkpoints of a run share the tokenizer and prompt), and each plan's samples still to generate."""
    first = plans[0]
    benchmarks = {name: {"problems": len(plist), "loaded": first["totals"][name], "dropped": first["dropped"][name],
                         "N": int(cfg.data.samples[name]), "prompt_tokens": sum(len(p.prompt_ids) for p in plist)}
                  for name, plist in first["problems"].items()}
    pending = [sum(n * int(cfg.data.samples[b]) for per in plan["pending"].values() for b, n in per.items())
               for plan in plans]
    return eval_cost(benchmarks, [s.name for s in cfg.generation.settings], sum(pending),
                     cfg.generation.max_new_tokens, measured, checkpoints=len(plans)), pending


def eval_sweep_dry_run(cfg: Any) -> str:
    """``evaluate.py --dry-run`` of a checkpoint sweep (``model.checkpoints``): the plan a real sweep would follow,
    from the sweep's own functions (:func:`stapo.evaluation.sweep.check_sweep`, then, with the sweep folder's lock
    only checked, :func:`~stapo.evaluation.sweep.sweep_jobs` and :func:`~stapo.evaluation.sweep.earlier_results`),
    and the dry run of every checkpoint still to evaluate. Prints the resolved config, the sweep folder, one line
    per selected checkpoint (its folder and whether it is skipped as already evaluated, evaluated, or damaged, with
    the reason), the checkpoints evaluated earlier that stay on the curve, and the cost of the checkpoints still to
    evaluate (:func:`format_eval_cost`, × checkpoints). Nothing is loaded or written.

    Raises:
        stapo.evaluation.EvalError: what the sweep refuses (a step with no checkpoint, no intact checkpoint, an
            output folder that is not this run's sweep folder, a folder in use), and as
            :func:`~stapo.evaluation.runner.run_evaluation` before it loads the model, for each checkpoint.
    """
    from stapo.evaluation.config import eval_config_to_dict
    from stapo.evaluation.runner import _holding_lock, run_evaluation
    from stapo.evaluation.sweep import check_sweep, earlier_results, sweep_jobs

    plan, sweep_dir = check_sweep(cfg)
    with _holding_lock(sweep_dir, "output.dir" if cfg.output.dir else "output.root", take=False):
        jobs = sweep_jobs(cfg, plan, sweep_dir)
        earlier = earlier_results(cfg, plan, sweep_dir)
    todo = [job for job in jobs if job.done is None]
    plans = [run_evaluation(job.cfg, dry_run=True) for job in todo]
    exists = "exists" if sweep_dir.is_dir() else "not created by --dry-run"
    lines = ["# evaluate.py --dry-run: the resolved config", _yaml(eval_config_to_dict(cfg)).rstrip(),
             f"sweep of {plan.run_dir} (model.checkpoints={cfg.model.checkpoints}): sweep folder {sweep_dir} "
             f"({exists})"]
    if plans:
        lines.append(f"prompt: {plans[0]['prompt'].style} ({plans[0]['prompt'].source})")
    names = {p.name for p in (plan.run_dir / "checkpoints").glob("step_*")} | {p.name for p in sweep_dir.glob("step_*")}
    measured = measured_from_evaluations(  # any checkpoint of the run (one shape), in this sweep or elsewhere
        cfg.output.root, [str(plan.run_dir / "checkpoints" / name) for name in names], cfg.engine.backend,
        cfg.model.dtype, also=[job.cfg.output.dir for job in jobs])
    cost, pending = _plan_cost(cfg, plans, measured) if plans else (None, [])
    todo_pending = dict(zip((job.step for job in todo), pending))
    rows = [(job.step, job.checkpoint.name, job.cfg.output.dir,
             "already evaluated: skipped" if job.done is not None else
             f"to evaluate ({_n(todo_pending[job.step])} samples to generate)") for job in jobs]
    rows += [(step, ckpt.name, "-", f"damaged ({why}): skipped") for step, ckpt, why in plan.damaged]
    lines.append(f"checkpoints: {len(plan.checkpoints) + len(plan.damaged)} selected — {len(todo)} to evaluate, "
                 f"{len(jobs) - len(todo)} already evaluated (skipped), {len(plan.damaged)} damaged (skipped)")
    lines += _table([(f"step {s}", name, f"{folder}  {what}") for s, name, folder, what in sorted(rows)])
    if earlier:
        lines.append(f"also on the curve (evaluated earlier in this folder with the same settings): step(s) "
                     f"{', '.join(str(s) for s, _ in earlier)}")
    if cost is None:
        lines.append("cost estimate: nothing to evaluate (every selected checkpoint is evaluated; the sweep reports "
                     "are rebuilt)")
    else:
        lines.append(format_eval_cost(cost))
    return "\n".join(lines)
