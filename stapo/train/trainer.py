"""The trainer: STAPO and its baselines (GRPO, 20-Entropy, JustRL) — docs/method.md.

One training step, top to bottom in :meth:`Trainer.train_step`:

    rollout G responses per prompt → rewards → GRPO advantages (:class:`~stapo.train.batch.Rollout`) → the
    update plan (:func:`~stapo.train.plan.build_plan`) → old-policy (and reference, β > 0) statistics, no grad,
    fp32 → the update (:class:`~stapo.train.update.PolicyUpdate`: per mini-batch token mask → kept-token
    denominator → micro-batch forward/backward → clip → AdamW step) → sync the weights into the rollout engine
    → metrics (:mod:`stapo.train.metrics`) → [validation hook, then in :meth:`Trainer.train` the run folder
    (:class:`stapo.run.folder.RunFolder`) logs the step and has it checkpointed when one is due].

Under ``torchrun`` with W > 1 ranks (:mod:`stapo.model.distributed`) each rank does this for its share of the prompts;
the mask, the denominator and the metrics are mini-batch / step-global, only rank 0 logs; every rank writes its
shards of a checkpoint (``torch.distributed.checkpoint``) and rank 0 the HF export (:mod:`stapo.model.checkpoint`).

Precision (:mod:`stapo.model.precision`): parameters, gradients and AdamW state in ``model.param_dtype`` (fp32 master
weights), every policy forward under ``model.compute_dtype`` (bf16 autocast; FSDP2 ``MixedPrecisionPolicy``).
"""
from __future__ import annotations

import contextlib
import functools
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from stapo.common.perf import ModelShape, max_memory_gb, mfu, peak_flops, update_flops
from stapo.config import ConfigError, TrainConfig, objective_from_config
from stapo.core.advantages import grpo_advantages
from stapo.core.token_stats import TokenStats
from stapo.evaluation.runner import MANIFEST
from stapo.model import distributed as dist
from stapo.model.checkpoint import latest_checkpoint
from stapo.model.models import EMBEDDED_ALIASES, ModelCacheError, build_tiny_model, load_policy, load_tokenizer
from stapo.model.precision import PrecisionPolicy, resolve_compute_dtype
from stapo.rollout import EngineOptions, SamplingParams, build_rollout_engine, engine_kwargs
from stapo.rollout.boxed_cut import cut_responses_at_first_boxed
from stapo.rollout.phases import EnginePhases
from stapo.run.folder import Interrupted, RunFolder
from stapo.run.memory_plan import check_memory_plan
from stapo.run.preflight import check_chat_template, check_device, check_tokenizer
from stapo.run.provenance import apply_identity
from stapo.run.tracking import Tracker
from stapo.tasks.rewards import make_reward_fn
from stapo.train.batch import Rollout, StepBatch
from stapo.train.mechanism import MechanismHook
from stapo.train.metrics import gather_metric_rows, silenced_examples, step_metrics
from stapo.train.plan import UpdatePlan, build_plan, max_over_ranks
from stapo.train.policy import collate_responses, forward_layout
from stapo.train.prompts import PromptLoader, load_prompts
from stapo.train.samples import completions_table, drop_rollouts_after, response_records, write_rollouts
from stapo.train.state import RunState, plan_start, refuse_checkpoints
from stapo.train.update import PolicyUpdate, Progress, UpdateResult

__all__ = ["Trainer", "StepProgress", "Interrupted", "CannotLearn"]

ValidationHook = Callable[["Trainer", int], dict[str, float]]


class StepProgress:
    """The step's inner progress bar: ``rollout`` counting the step's responses as the engine finishes them
    (:meth:`rollout`), then, sized by :meth:`start` with the plan's forwards, one tick per forward (a
    :data:`~stapo.train.update.Progress` callback: ``progress(phase, n=1, **postfix)``; the update's postfix is
    the last finished mini-batch's loss, ``actor/pg_loss``)."""

    def __init__(self, enabled: bool) -> None:
        self.bar = tqdm(total=None, desc="rollout", unit="resp", position=1, leave=False, dynamic_ncols=True,
                        disable=not enabled)

    def rollout(self, num_responses: int) -> Callable[[int], None]:
        """Size the bar for ``num_responses`` and return the engine's ``progress(n)`` callback."""
        self.bar.reset(total=num_responses)
        return self.responses

    def responses(self, n: int) -> None:
        """``n`` more responses finished (the rollout engine's callback)."""
        self.bar.update(n)

    def start(self, total: int) -> None:
        self.bar.unit = "fwd"
        self.bar.set_description("old_log_prob", refresh=False)
        self.bar.reset(total=total)

    def __call__(self, phase: str, n: int = 1, **postfix: str) -> None:
        if self.bar.desc != phase:
            self.bar.set_description(phase, refresh=False)
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        if n:
            self.bar.update(n)
        else:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class CannotLearn(RuntimeError):
    """The run cannot learn, so :meth:`Trainer.train` stopped it after a step (docs/runs.md#a-run-that-cannot-learn):
    ``trainer.stop_after_nonfinite_steps`` optimizer steps in a row skipped for a non-finite loss or gradient norm,
    ``trainer.stop_after_silent_steps`` training steps in a row with no kept token, or weights that are no longer
    finite. The message is one line: the step, the metric, the likely cause and what was checkpointed; train.py prints
    it and exits 1 (a runtime failure). Raised on every rank alike.

    Attributes:
        step: the last finished step (its metrics are logged).
        metric: the metric that stopped it (``actor/nonfinite_grad_steps``, ``actor/num_kept_tokens``, ``weights``).
        checkpoint: the latest complete checkpoint (never one of non-finite weights), or None.
    """

    def __init__(self, message: str, step: int, metric: str, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step, self.metric, self.checkpoint = step, metric, checkpoint


def _takes_progress(engine: Any) -> bool:
    """Whether ``engine.generate`` accepts a ``progress`` keyword (the built-in backends do; a registered one may
    not)."""
    import inspect

    try:
        params = inspect.signature(engine.generate).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "progress" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@contextlib.contextmanager
def _timed(timing: dict[str, float], stage: str) -> Iterator[None]:
    """Wall-clock seconds of the block → ``timing["timing_s/<stage>"]``."""
    t0 = time.perf_counter()
    yield
    timing[f"timing_s/{stage}"] = time.perf_counter() - t0


class Trainer:
    """Builds everything from a :class:`TrainConfig` and runs :meth:`train`.

    Args:
        cfg: a validated config (:func:`stapo.config.load_config`).
        validation_hook: optional ``fn(trainer, step) -> metrics`` called every ``trainer.val_every`` steps
            (the evaluation harness provides one), on every rank under torchrun (the evaluation harness's hook
            splits the work over the ranks' engines; rank 0 logs what rank 0's call returns).
        reward_fn: optional ``fn(responses, golds) -> obj`` with ``obj.rewards`` (one float per response)
            replacing ``algorithm.reward`` (tests use a toy reward; see :func:`stapo.tasks.rewards.make_reward_fn`).
        preflight_only: stop after the start-up checks that need no model (train.py ``--dry-run``,
            :func:`stapo.tools.estimate.train_dry_run`): the config resolved, the run folder checked (not created), the
            resume chosen (:attr:`resume_plan`), the tokenizer and the training prompts (:attr:`prompts`) loaded;
            no model, engine or optimizer — such a trainer cannot train.
        argv: the command line recorded in ``<run_dir>/run_info.json`` and the W&B config (default ``sys.argv``;
            :mod:`stapo.run.provenance`).
        folder: the run folder (:class:`stapo.run.folder.RunFolder`, built for ``cfg`` on this process's data-parallel
            context; its ``argv`` is recorded, not ``argv``); default: one built here, at
            ``<trainer.output_dir>/<trainer.run_name>``. Either way its pre-flight checks run here.

    Everything about the run folder and the run's lifecycle is the folder's (:attr:`folder`: the lock, the start-up
    files, the tracker, the console, the interrupt guard, the checkpoint cadence); :attr:`run_dir`, :attr:`ckpt_root`,
    :attr:`tracker` and :attr:`argv` are its.

    Raises:
        FileExistsError: the run folder holds checkpoints and ``trainer.resume`` is ``never``.
        FileNotFoundError: ``trainer.resume=required`` (train.py ``--resume``) and the run folder holds no checkpoint.
        stapo.model.checkpoint.CheckpointError: resuming, and no checkpoint of the run folder is intact.
        stapo.config.ConfigError: a data-parallel or precision setting that cannot work (naming the key); a fork
            whose ``trainer.init_from`` is not a checkpoint or whose recipe, model or data differ from it
            (:func:`stapo.train.state.plan_fork`; ``trainer.total_steps`` not above its step); resuming
            with a changed key that cannot change mid-run (:func:`stapo.train.state.plan_resume`), or with a model or
            training data whose content changed under the same key (:mod:`stapo.run.run_identity`); before any model
            loads (:mod:`stapo.run.preflight`): ``trainer.device`` not available, the run folder not writable,
            ``model.path`` not a model (a folder without weights, an unreachable hub id), ``data.prompt_style=chat``
            with a tokenizer that has no chat template.
        stapo.tasks.data.DataError: an unreadable training file, or no training prompts left (naming the file and key).
        stapo.run.runlock.RunLockError: another live process holds the run folder's lock (every rank).

    :meth:`train` raises :class:`stapo.model.checkpoint.CheckpointError` for a damaged checkpoint,
    :class:`stapo.common.registry.ExtensionError` when a registered mask or loss formula breaks its contract and
    :class:`stapo.run.runlock.RunLockError` when another process holds the run directory.
    """

    def __init__(self, cfg: TrainConfig, validation_hook: ValidationHook | None = None,
                 reward_fn: Callable[[list[str], list[str]], Any] | None = None, preflight_only: bool = False,
                 argv: list[str] | None = None, folder: RunFolder | None = None) -> None:
        self.cfg, self.validation_hook = cfg, validation_hook
        apply_identity(cfg)  # W&B group / tags / job_type left unset (train.py fills them from --config first)
        self.objective = objective_from_config(cfg)  # the registered objective + the config's overrides (as verl)
        tc = cfg.trainer
        # the device, data parallelism (torchrun) and the memory plan, checked before anything loads
        self.dist, self.device, self.memory_plan = self._init_device()
        self._mini_rows = cfg.actor.ppo_mini_batch_size // self.dist.world * cfg.rollout.n  # this rank's rows
        # the run folder and everything about the run's lifecycle (stapo/run/folder.py), checked before loading
        self.folder = folder if folder is not None else RunFolder(
            cfg, self.dist, self.device, objective=self.objective.name, argv=argv, evaluation_manifest=MANIFEST)
        self.folder.check()  # writable, no live process on it, not an evaluation folder, its metrics files readable
        # resume / fork: the checkpoint chosen and the config checked against it before loading anything
        self.resume_plan = plan_start(self.folder.ckpt_root, cfg, ctx=self.dist)
        self._seed_everything(tc.seed)
        # --- tokenizer and training prompts: before the model, so a data problem costs seconds -------------
        self.tokenizer = self._load_tokenizer()
        prompts, self.prompt_stats = load_prompts(cfg, self.tokenizer)  # data/num_prompts, ... (logged each step)
        # what the run is made from, by content (stapo/run/run_identity.py): a resume whose model or training data
        # changed under the same path is refused here, before any model loads
        self.folder.check_identity(self.resume_plan)
        if preflight_only:  # train.py --dry-run: every check above passed; nothing loaded or written beyond this
            self.prompts, self.engine = prompts, None
            return

        # --- policy, reference, optimizer (stapo/model/precision.py: fp32 master weights, bf16 compute) ------
        self.precision = PrecisionPolicy.from_config(cfg.model)
        self.compute_dtype = self.precision.compute_dtype
        self.model, self.ref_model = self._load_models()
        self.optimizer, self.scheduler = self._build_optimizer()

        # --- data order, reward, rollout engine -------------------------------------------------------
        self.loader = PromptLoader(prompts, cfg.data.train_batch_size, tc.seed, cfg.data.shuffle)
        self.reward_fn = reward_fn if reward_fn is not None else make_reward_fn(cfg.algorithm.reward)
        self.engine = build_rollout_engine(cfg.rollout.backend, self.model, self.tokenizer, **self._engine_kwargs())
        # where the engine's memory is during a step (stapo/rollout/phases.py): asleep whenever the trainer computes
        self.engine_phases = EnginePhases(self.engine, sleep=cfg.rollout.sleep_during_update,
                                          level=cfg.rollout.sleep_level)
        self._sampling_cls = SamplingParams
        self._seed_everything(tc.seed)  # the vLLM engine reseeds the global RNGs when it starts
        self.state = RunState(self.ckpt_root, cfg, self.model, self.optimizer, self.scheduler, self.loader,
                              self.tokenizer, param_dtype=self.precision.param_dtype,
                              export_dtype=self.compute_dtype, ctx=self.dist)
        self.updater = PolicyUpdate(
            self.model, self.optimizer, self.scheduler, self.objective, self.precision, self.device, self.dist,
            temperature=cfg.rollout.temperature, share_prompt=cfg.actor.share_prompt, grad_clip=cfg.actor.grad_clip,
            max_response_length=cfg.rollout.response_length, lm_head=cfg.actor.lm_head,
            deferred_graphs=cfg.actor.deferred_graphs,
            layout=forward_layout(cfg.actor.use_remove_padding, cfg.model.attn_implementation))
        # mechanism.* measurements (stapo/train/mechanism.py): read the run, never change it; None when off
        self.mechanism = MechanismHook(self) if cfg.mechanism.enabled else None
        self.step = 0
        self._silent_in_a_row = 0  # training steps in a row whose mask kept no token (trainer.stop_after_silent_steps)

    # --- the run folder's (stapo/run/folder.py) -------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        """The run folder, ``<trainer.output_dir>/<run name>`` (:attr:`RunFolder.run_dir`)."""
        return self.folder.run_dir

    @property
    def ckpt_root(self) -> Path:
        """The run's ``checkpoints/`` folder."""
        return self.folder.ckpt_root

    @property
    def tracker(self) -> Tracker | None:
        """Where the metrics go (``metrics.jsonl``, W&B, ...; rank 0 once :meth:`train` started, else None)."""
        return self.folder.tracker

    @property
    def argv(self) -> list[str]:
        """The command line recorded in ``run_info.json`` and the W&B config (assignable before :meth:`train`)."""
        return self.folder.argv

    @argv.setter
    def argv(self, value: list[str]) -> None:
        self.folder.argv = list(value)

    def _init_device(self) -> tuple[dist.DistContext, torch.device, Any]:
        """The checks that need no model, first (:mod:`stapo.run.preflight`): ``trainer.device`` available; data
        parallelism (torchrun, WORLD_SIZE > 1; W = 1: nothing is initialised) and its config checked; this rank's
        device; ``model.compute_dtype=auto`` resolved in the config (bfloat16 where the device has native bf16, else
        float32: recorded resolved in the run's config and compared resolved on resume); the GPU memory of each phase
        of a step (:mod:`stapo.run.memory_plan`: a phase over the device is refused here, ``trainer.gpu_memory_gib``;
        a CPU run is planned for an assumed GPU, not checked). Returns ``(dist context, device, memory plan)``.

        Raises:
            stapo.config.ConfigError: the device is not available, a data-parallel setting cannot work, or a phase
                does not fit the GPU (naming the key; train.py: exit 2).
        """
        tc = self.cfg.trainer
        check_device(tc.device, "trainer.device")
        ctx = dist.init_distributed(tc.device, tc.data_parallel)
        dist.check_dp_config(self.cfg, ctx)
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = ctx.device if ctx.enabled else torch.device(auto if tc.device == "auto" else tc.device)
        self.cfg.model.compute_dtype = resolve_compute_dtype(self.cfg.model.compute_dtype, device)
        return ctx, device, check_memory_plan(self.cfg, ctx.world, device, ctx.strategy)

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over the policy's parameters (``actor.lr``, ``actor.weight_decay``, ``actor.betas``) and its
        learning-rate schedule: linear warm-up over ``actor.warmup_steps`` training steps (one scheduler step per
        training step, :class:`~stapo.train.update.PolicyUpdate`: training step s + 1 at lr × (s + 1) / warmup), then
        constant."""
        ac = self.cfg.actor
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=ac.lr, weight_decay=ac.weight_decay,
                                      betas=tuple(ac.betas))
        warmup = ac.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
        return optimizer, scheduler

    def _load_models(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """The policy in ``model.param_dtype`` and, when ``algorithm.kl_coef`` > 0 or ``algorithm.log_kl_to_ref``,
        the frozen reference (the initial policy again, in the compute dtype: no fp32 copy), both placed for data
        parallelism (:meth:`_place_model`). Collective under torchrun.

        Raises:
            stapo.config.ConfigError: the weights cannot be loaded; a trainable parameter below ``model.param_dtype``;
                ``actor.lm_head=fused`` with a model whose head is not ``logits = hidden @ Wᵀ``.
        """
        cfg = self.cfg
        # torchrun with model.meta_init: rank 0 alone reads the weights, the other ranks build the model on the meta
        # device and receive rank 0's weights when it is placed (one host copy of the weights per node)
        self._meta_init = self.dist.enabled and cfg.model.meta_init
        model = self._load_initial_model(self.precision.param_dtype)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # FSDP2: sharded in place (bf16 all-gathers, fp32 reduce-scatter when mixed), before the optimizer and before
        # the reference is loaded (rank 0 never holds both full copies); fully_shard moves each layer's shards to the
        # device itself, so the whole fp32 model never sits on one GPU
        model = self._place_model(model, mp_policy=self.precision.fsdp_mp_policy())
        ref_model = None
        # the initial policy, frozen, loaded again in the compute dtype (no fp32 copy); at β = 0 only for the
        # actor/kl_to_ref diagnostic (algorithm.log_kl_to_ref)
        if self.objective.kl_coef > 0 or cfg.algorithm.log_kl_to_ref:
            ref = self._load_initial_model(self.compute_dtype)
            ref = ref.eval().requires_grad_(False)
            # FSDP2: sharded like the policy (its no-grad forwards are collectives too); else on the device
            ref_model = self._place_model(ref, reference=True)
        self._check_param_dtype(model)
        if cfg.actor.lm_head == "fused":  # the fused head needs logits = hidden @ Wᵀ: say so now, not at step 1
            from stapo.train.policy import check_fused_head, policy_decoder

            try:
                check_fused_head(model)
                policy_decoder(model)
            except ValueError as e:
                raise ConfigError(f"invalid value for 'actor.lm_head' ('fused'): {e}") from None
        return model, ref_model

    def _engine_kwargs(self) -> dict[str, Any]:
        """The rollout engine's keyword arguments (:func:`stapo.rollout.engine_kwargs`, shared with evaluation)."""
        rc = self.cfg.rollout
        options = EngineOptions(
            dtype=self.compute_dtype,  # vLLM: fp32 master → bf16 engine weights at each sync; HF: autocast
            external_launcher=self.dist.enabled,  # one colocated engine per rank, inside torchrun's processes
            max_model_len=self.cfg.data.max_prompt_length + rc.response_length,
            gpu_memory_utilization=rc.gpu_memory_utilization, kv_cache_gib=rc.kv_cache_gib,
            enforce_eager=rc.enforce_eager, tensor_parallel_size=rc.tensor_parallel_size,
            # without per-request seeds each rank's engine draws from its own generator: seeded per rank
            seed=self.cfg.trainer.seed + (0 if rc.per_request_seeds else self.dist.rank),
            enable_sleep_mode=rc.sleep_during_update)
        return engine_kwargs(rc.backend, options)

    def _load_tokenizer(self):
        """The tokenizer of ``model.path`` (``"tiny"``: the embedded SmolLM2's), loaded before the model and checked
        (:func:`stapo.run.preflight.check_tokenizer`, and :func:`~stapo.run.preflight.check_chat_template` for
        ``data.prompt_style``).

        Raises:
            stapo.config.ConfigError: ``model.path`` is not a model folder with weights, an embedded alias or a
                reachable hub id, or its tokenizer cannot be loaded or fails a check (one line naming the key).
        """
        mc = self.cfg.model
        try:
            tokenizer = load_tokenizer(EMBEDDED_ALIASES[0] if mc.path == "tiny" else mc.path, cache_dir=mc.cache_dir)
        except ModelCacheError as e:  # where the embedded model is converted
            raise ConfigError(f"invalid value for 'model.cache_dir' ({mc.cache_dir}): {e.strerror}") from None
        except (OSError, ValueError) as e:  # FileNotFoundError naming the path; the hub's OSError; a bad tokenizer
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"invalid value for 'model.path' ({mc.path}): {first}") from None
        check_tokenizer(tokenizer, "model.path", mc.path)
        check_chat_template(tokenizer, self.cfg.data.prompt_style, "data.prompt_style", mc.path)
        return tokenizer

    def _load_initial_model(self, dtype: torch.dtype) -> torch.nn.Module:
        """The initial policy ``model.path`` (``"tiny"``: the seeded random test model) in ``dtype``, on the CPU,
        with :attr:`tokenizer`. Called for the policy (param dtype) and for the reference model (compute dtype).
        Under torchrun with ``model.meta_init`` only rank 0 reads it; the other ranks get the same architecture on
        the meta device (:func:`stapo.model.distributed.build_on_rank0`), filled by :meth:`_place_model`. Collective
        then.

        Raises:
            stapo.config.ConfigError: the weights cannot be loaded (a damaged or truncated file, named) — on every
                rank under torchrun.
        """
        if self._meta_init:
            return dist.build_on_rank0(lambda: self._read_initial_model(dtype), self.dist)
        return self._read_initial_model(dtype)

    def _place_model(self, model: torch.nn.Module, mp_policy: Any = None, reference: bool = False) -> torch.nn.Module:
        """``model`` (from :meth:`_load_initial_model`) on this rank's device, prepared for data parallelism: FSDP2
        sharded (:func:`stapo.model.distributed.wrap_policy`, ``mp_policy`` for the policy), replicate broadcast from
        rank 0 (the frozen ``reference`` is not: every rank loaded the same weights), W = 1 moved to the device. With
        ``model.meta_init`` the ranks ≠ 0 materialise their meta-device model and receive rank 0's weights
        (:func:`stapo.model.distributed.wrap_from_rank0`). Collective under torchrun."""
        if self._meta_init:
            return dist.wrap_from_rank0(model, self.dist, mp_policy=mp_policy)
        if self.dist.strategy != "fsdp2":
            model.to(self.device)
            if reference:
                return model
        return dist.wrap_policy(model, self.dist, mp_policy=mp_policy)

    def _read_initial_model(self, dtype: torch.dtype) -> torch.nn.Module:
        """:meth:`_load_initial_model`'s reading of the weights on this process (rank 0 alone with ``meta_init``).

        Raises:
            stapo.config.ConfigError: the weights cannot be loaded (a damaged or truncated file, named).
        """
        mc = self.cfg.model
        if mc.path == "tiny":  # tests: a randomly initialised Qwen3-architecture model (the same for every call)
            return build_tiny_model(seed=self.cfg.trainer.seed, dtype=dtype, cache_dir=mc.cache_dir,
                                    tokenizer=self.tokenizer)[0]
        try:
            return load_policy(mc.path, dtype=dtype, attn_implementation=mc.attn_implementation,
                               cache_dir=mc.cache_dir, tokenizer=self.tokenizer)[0]
        except (OSError, ValueError) as e:  # a damaged weight file (named), a hub failure
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"invalid value for 'model.path' ({mc.path}): {first}") from None

    def _check_param_dtype(self, model: torch.nn.Module) -> None:
        """Every trainable parameter holds at least ``model.param_dtype``'s precision (what the optimizer steps on).

        Raises:
            stapo.config.ConfigError: a trainable parameter in a 16-bit dtype while ``model.param_dtype`` is
                float32 (a model class that forces some weights into bf16), naming the parameter.
        """
        want = self.precision.param_dtype
        for name, p in model.named_parameters():
            if p.requires_grad and p.dtype != want and torch.finfo(p.dtype).eps > torch.finfo(want).eps:
                raise ConfigError(f"invalid value for 'model.param_dtype' ({str(want).removeprefix('torch.')}): "
                                  f"the policy's parameter {name} is {str(p.dtype).removeprefix('torch.')}")

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def train(self) -> list[dict[str, float]]:
        """Run (or resume) training to ``trainer.total_steps``, holding the run directory's lock
        (``<run_dir>/run.lock``, :mod:`stapo.run.runlock`). Returns each step's metrics.

        The run folder (:class:`~stapo.run.folder.RunFolder`) does everything around the steps: the lock, the files
        written at start, the tracker, the console, the interrupt guard, the checkpoint cadence, the throughput record.

        Raises:
            Interrupted: (a KeyboardInterrupt) Ctrl-C or SIGTERM stopped the run early: the first signal lets the
                step in progress finish and checkpoints it (``trainer.save_on_interrupt``, or a checkpoint is due),
                a second abandons the step at once; the checkpoints already written are kept either way.
            stapo.run.tracking.TrackerError: ``logging.wandb_mode=online`` cannot start and
                ``logging.wandb_fallback=error``.
            stapo.run.runlock.RunLockError: another live process is writing the run directory.
            stapo.run.tracking.CorruptJsonlError: ``metrics.jsonl`` / ``tables.jsonl`` hold a damaged line that is not a
                torn last line (the message names the file and line).
            CannotLearn: the run cannot learn (``trainer.stop_after_nonfinite_steps`` optimizer steps in a row with
                a non-finite loss or gradient, ``trainer.stop_after_silent_steps`` steps in a row without a kept
                token, or non-finite weights): stopped after the step, which is checkpointed when its weights are
                finite (one-line message).
        """
        tc = self.cfg.trainer
        with self.folder.locked():  # one process at a time writes a run folder
            self._start()  # resume (or fork) from a checkpoint; refused: another run's checkpoints
            self.folder.open(self.step, self.resume_plan, drop_after=(drop_rollouts_after,),
                             validation_subdir=getattr(self.validation_hook, "subdir", "validation"))
            self._validate_before_train()
            with self.folder.steps(lambda: self.step, close=(self.reward_fn, self.validation_hook)) as history:
                while self.step < tc.total_steps:
                    metrics = self.train_step()
                    self.step += 1
                    if self.validation_hook is not None and tc.val_every and self.step % tc.val_every == 0:
                        # every rank's engine generates its share (collective; stapo/evaluation/validation.py)
                        metrics.update(self.validation_hook(self, self.step))
                    self.folder.log(self.step, metrics)
                    # a run that cannot learn stops here (every rank alike), after saving the step when its weights
                    # are finite; a checkpoint of non-finite weights is never written
                    self._stop_if_cannot_learn(metrics, check_weights=self.folder.save_due(self.step))
                    if self.folder.maybe_save(self.step, self.save):  # a signal asked to stop (every rank alike)
                        break
            return history

    def _start(self) -> None:
        """Where the step loop starts (holding the lock): resume (or fork) from the checkpoint the resume plan chose
        (:meth:`_maybe_resume`), or refuse a folder that meanwhile got checkpoints (``trainer.resume=never``)."""
        tc = self.cfg.trainer
        fork = self.resume_plan.fork if self.resume_plan is not None else None
        if tc.resume != "never" or fork is not None:  # a fork loads its source checkpoint the way a resume does
            self._maybe_resume()
            if self.step >= tc.total_steps and self.dist.is_main:
                print(f"resume: the run is at step {self.step}, trainer.total_steps={tc.total_steps}: nothing to "
                      f"train (raise trainer.total_steps to continue)", file=sys.stderr, flush=True)
        else:
            refuse_checkpoints(self.ckpt_root)

    def _validate_before_train(self) -> None:
        """``trainer.val_before_train`` (verl's key): validate the initial policy at step 0, before the first update,
        once (a run restarted at step 0 whose metrics.jsonl already holds the step-0 row does not repeat it). Every
        rank validates its share (collective)."""
        if self.cfg.trainer.val_before_train and self.validation_hook is not None and self.step == 0:
            if not self.folder.logged(0):  # rank 0's answer
                self.folder.write_row(0, self.validation_hook(self, 0))

    def _stop_if_cannot_learn(self, metrics: dict[str, float], check_weights: bool) -> None:
        """Stop a run that cannot learn after the step just finished (:meth:`_cannot_learn`; with ``check_weights``,
        a checkpoint being due, or when it stops, also weights that are no longer finite): the step is checkpointed
        when its weights are finite. Collective (the decisions are all-reduced: every rank stops alike).

        Raises:
            CannotLearn: the step, the metric, the likely cause and what was checkpointed.
        """
        failure = self._cannot_learn(metrics)
        finite = self._weights_finite() if check_weights or failure is not None else True
        if not finite:
            failure = ("weights", "the policy's weights are no longer finite (NaN/inf): they diverged; "
                                  "likely cause: a learning rate too large for this model (actor.lr="
                                  f"{self.cfg.actor.lr:g}) or an overflow in model.compute_dtype")
        if failure is not None:
            raise self._stop_cannot_learn(*failure, save=finite)

    def _cannot_learn(self, metrics: dict[str, float]) -> tuple[str, str] | None:
        """``(metric, what happened and its likely cause)`` when the step just finished makes the run one that cannot
        learn (``trainer.stop_after_nonfinite_steps`` / ``trainer.stop_after_silent_steps``), else None. The counts
        are the same on every rank (the gradient norm is global, the losses and the kept-token count all-reduced);
        the decision is all-reduced too, so every rank stops after the same step (collective)."""
        tc = self.cfg.trainer
        kept = metrics.get("actor/num_kept_tokens")
        self._silent_in_a_row = self._silent_in_a_row + 1 if kept is not None and kept <= 0 else 0
        nonfinite = self.updater.nonfinite_in_a_row
        code = 0.0
        if tc.stop_after_nonfinite_steps is not None and nonfinite >= tc.stop_after_nonfinite_steps:
            code = 1.0
        elif tc.stop_after_silent_steps is not None and self._silent_in_a_row >= tc.stop_after_silent_steps:
            code = 2.0
        code = dist.all_reduce({"cannot_learn": code}, self.dist, op="max")["cannot_learn"]
        if code == 1.0:
            last = self.updater.last_nonfinite
            bad = ", ".join(f"{k}={v}" for k, v in last.items() if not math.isfinite(v)) or "actor/grad_norm"
            alg, obj = self.cfg.algorithm, self.objective
            if not math.isfinite(last.get("actor/kl_loss", 0.0)):
                cause = (f"the KL penalty (β = algorithm.kl_coef = {obj.kl_coef:g}) or the reference model's "
                         f"log-probabilities")
            elif not math.isfinite(last.get("actor/pg_loss", 0.0)):
                cause = (f"the policy loss of algorithm.objective={alg.objective} (loss formula {obj.policy_loss!r}, "
                         f"token mask {obj.token_mask!r}: a registered one returning NaN/inf?) or non-finite "
                         f"log-probabilities")
            else:
                cause = (f"a gradient that overflows although the loss is finite (a loss formula whose gradient is "
                         f"not finite, or model.compute_dtype={self.cfg.model.compute_dtype}); try a lower actor.lr")
            return ("actor/nonfinite_grad_steps",
                    f"{nonfinite} optimizer steps in a row had a non-finite loss or gradient ({bad}) and were "
                    f"skipped, so the weights did not change (actor/nonfinite_grad_steps; "
                    f"trainer.stop_after_nonfinite_steps={tc.stop_after_nonfinite_steps}); likely cause: {cause}")
        if code == 2.0:
            return ("actor/num_kept_tokens",
                    f"the token mask kept no token in {self._silent_in_a_row} training steps in a row "
                    f"(actor/num_kept_tokens=0; trainer.stop_after_silent_steps={tc.stop_after_silent_steps}): nothing "
                    f"was trained; likely cause: the mask {self.objective.token_mask!r} of algorithm.objective="
                    f"{self.cfg.algorithm.objective} silences every response token (its thresholds, algorithm.s2t.* / "
                    f"algorithm.masks.*, or a registered mask that keeps nothing)")
        return None

    def _weights_finite(self) -> bool:
        """Whether every parameter of the policy is finite, on every rank (this rank's shards under FSDP2; the
        answer all-reduced: collective)."""
        from torch.distributed.tensor import DTensor

        ok = True
        with torch.no_grad():
            for p in self.model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                if not bool(torch.isfinite(local).all()):
                    ok = False
                    break
        return dist.all_reduce({"finite": float(ok)}, self.dist, op="min")["finite"] > 0

    def _stop_cannot_learn(self, metric: str, what: str, *, save: bool) -> CannotLearn:
        """Checkpoint this step when ``save`` (its weights are finite; not twice) and build the :class:`CannotLearn`
        whose one-line message says the step, what happened and what is on disk. Collective (the save)."""
        step_ckpt = self.ckpt_root / f"step_{self.step:06d}"
        if save and latest_checkpoint(self.ckpt_root) != step_ckpt:
            self.save()
        ckpt = latest_checkpoint(self.ckpt_root)
        if save:
            kept = f"checkpointed step {self.step} ({ckpt})"
        else:
            kept = ("its weights are not saved; the latest checkpoint with finite weights: "
                    f"{ckpt if ckpt is not None else 'none'}")
        return CannotLearn(f"the run cannot learn, stopped after step {self.step}: {what}; {kept}",
                           step=self.step, metric=metric, checkpoint=ckpt)

    def close(self) -> None:
        """Release the rollout engine (vLLM: its workers and, under torchrun, its process groups — before
        :func:`stapo.model.distributed.teardown`). The trainer cannot generate afterwards."""
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()

    def _maybe_resume(self) -> None:
        """Resume from the latest complete checkpoint, if any (every rank; :meth:`RunState.resume`), then push
        the restored weights into the rollout engine."""
        resumed = self.state.resume(self.resume_plan)
        if resumed is None:
            return
        ckpt, self.step = resumed
        self.engine.sync_weights(self.model)
        if self.dist.is_main:
            fork = self.resume_plan.fork if self.resume_plan is not None else None
            tqdm.write(f"forked from {ckpt} at step {self.step} (trainer.seed={self.cfg.trainer.seed}, "
                       f"algorithm.objective={self.cfg.algorithm.objective})" if fork is not None else
                       f"resumed from {ckpt} at step {self.step}")

    def save(self) -> Path:
        """Write this step's checkpoint (:meth:`RunState.save`; collective under torchrun)."""
        return self.state.save(self.step)

    # ------------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One step of rollout and update at step ``self.step`` (its rollout seed; :meth:`train` advances the
        counter after validation and logging). Returns the step's metrics (verl names; docs/metrics.md)."""
        timing: dict[str, float] = {}
        t_step = time.perf_counter()
        progress = StepProgress(self.folder.bars and self.dist.is_main)
        try:
            with _timed(timing, "rollout"):  # 1. G responses per prompt, sampled from π_old at temperature T
                prompts, responses = self._generate(progress)
            with _timed(timing, "reward"):  # 2. rewards of the response text; 3. GRPO advantages
                rollout = self._score(prompts, responses)
            plan = self._plan(rollout)  # which rows are forwarded when (sizes the progress bar)
            progress.start(plan.num_forwards)
            with _timed(timing, "old_log_prob"):  # 4. old-policy (and reference) statistics: no grad, fp32
                old, ref = self._old_policy_stats(rollout, plan, progress)
            mechanism = self._measure_mechanism(rollout, plan, old, ref, timing)  # {} unless mechanism.enabled
            with _timed(timing, "update"):  # 5. one optimizer step per mini-batch
                result = self._update(plan, rollout, old, ref, progress)
            with _timed(timing, "sync"):  # 6. the new weights into the rollout engine
                self._sync_engine()
        finally:
            progress.close()
        timing["timing_s/step"] = time.perf_counter() - t_step
        sb = StepBatch(rollout=rollout, old=result.old, ref_logprobs=ref, keep=result.keep)
        self._log_examples(sb)  # the example / completions tables (every log_examples_every), the rollouts file
        return {**self._metrics(sb, result, timing), **mechanism}  # 7. metrics

    # --- the stages of a step -------------------------------------------------------------------------
    def _generate(self, progress: StepProgress | None = None) -> tuple[list, list]:
        """This rank's prompts of the step's batch and their G responses each (group-major); ``progress`` counts
        the responses (an engine whose ``generate`` takes no ``progress`` argument is called without it). The
        engine is awake for it and, with ``rollout.sleep_during_update``, asleep when it returns (before scoring
        and every trainer forward: :class:`~stapo.rollout.phases.EnginePhases`)."""
        cfg = self.cfg
        prompts, prompt_indices = dist.local_prompts(self.loader.next_batch(), cfg.actor.ppo_mini_batch_size,
                                                     self.dist)  # this rank's share (all when W = 1)
        # rollout.per_request_seeds: prompt i sampled with the seed of its global index (N ranks sample what one
        # process would); false: no per-request seeds (vLLM's batched sampler, the engine's own generator)
        seed = cfg.trainer.seed * 1_000_003 + self.step if cfg.rollout.per_request_seeds else None
        sampling = self._sampling_cls(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                      max_new_tokens=cfg.rollout.response_length,
                                      seed=seed, prompt_indices=prompt_indices if seed is not None else None)
        self.model.eval()
        extra = {}
        if progress is not None and _takes_progress(self.engine):
            extra["progress"] = progress.rollout(len(prompts) * cfg.rollout.n)
        self.engine_phases.wake()  # no-op: the sync of the previous step (or start-up) left it awake
        responses = self.engine.generate([p[0] for p in prompts], cfg.rollout.n, sampling, **extra)
        self.engine_phases.sleep()  # its memory is the trainer's until the next sync
        if cfg.rollout.stop_at_first_boxed:  # each response ends at its first complete \boxed{} (every objective)
            responses = cut_responses_at_first_boxed(responses, self.tokenizer)
        return prompts, responses

    def _score(self, prompts: list, responses: list) -> Rollout:
        """Rewards (the response text only, never the prompt), GRPO advantages and the collated batch."""
        alg = self.cfg.algorithm
        reward_out = self.reward_fn([r.text for r in responses], [prompts[r.group][1] for r in responses])
        rewards = torch.tensor(reward_out.rewards, dtype=torch.float32)  # [B]
        adv = grpo_advantages(rewards, self.cfg.rollout.n, eps=alg.adv_eps, norm_by_std=alg.norm_adv_by_std)
        return Rollout(batch=collate_responses(responses, self.tokenizer.pad_token_id), responses=responses,
                       rewards=rewards, advantages=adv.advantages, reward_stats=getattr(reward_out, "stats", None),
                       extracted=getattr(reward_out, "extracted", None), prompts=list(prompts))

    def _plan(self, rollout: Rollout, token_mask: str | None = None) -> UpdatePlan:
        """The step's update schedule (:func:`stapo.train.plan.build_plan`) from the actor settings (for the
        objective's token mask, or ``token_mask``). With ``actor.use_dynamic_bsz`` under FSDP2 one all-reduce (max)
        makes every rank's passes the same number of micro-batches (collective then)."""
        ac = self.cfg.actor
        batch = rollout.batch
        # FSDP2: every forward is a collective, so every rank runs the same number of micro-batches in each pass
        fsdp2 = self.dist.enabled and self.dist.strategy == "fsdp2"
        return build_plan(
            batch.attention_mask.sum(dim=1), rollout.advantages,  # [B] prompt + response tokens, [B] Â
            mini_batch_rows=self._mini_rows, micro_batch_size=ac.ppo_micro_batch_size,
            token_mask=token_mask or self.objective.token_mask, mask_stats_source=self.cfg.algorithm.mask_stats_source,
            fused_forward=ac.fused_forward, sort_by_length=ac.sort_by_length and not ac.share_prompt,
            has_reference=self.ref_model is not None, keep_all_graphs=self.dist.strategy == "fsdp2",
            token_budget=ac.ppo_max_token_len_per_gpu if ac.use_dynamic_bsz else None,
            layout=self.updater.layout, prompt_lengths=batch.attention_mask[:, :batch.prompt_width].sum(dim=1),
            sync_counts=max_over_ranks(self.dist) if ac.use_dynamic_bsz and fsdp2 else None)

    def _measure_mechanism(self, rollout: Rollout, plan: UpdatePlan, old: TokenStats, ref: torch.Tensor | None,
                           timing: dict[str, float]) -> dict[str, float]:
        """The ``mechanism.*`` measurements due at this step, at θ_t before the update (:class:`stapo.train.mechanism.
        MechanismHook`; ``timing_s/mechanism``) → their metrics; {} when off or none is due."""
        if self.mechanism is None:
            return {}
        with _timed(timing, "mechanism"):  # plan_for: the step's plan for another token mask (the counterfactual's)
            return self.mechanism.measure(self.step, rollout, plan, old, ref, functools.partial(self._plan, rollout))

    def _old_policy_stats(self, rollout: Rollout, plan: UpdatePlan,
                          progress: Progress) -> tuple[TokenStats, torch.Tensor | None]:
        """The plan's no-grad passes → old-policy statistics ([B, R] each; the fused first mini-batch's rows are
        computed by the update) and the reference log-probs [B, R] (β > 0) or None. The engine sleeps."""
        self.engine_phases.sleep()  # no-op: asleep since the end of generation
        old = self.updater.no_grad_stats(self.model, rollout.batch, plan.old_pass, progress, "old_log_prob")
        if self.ref_model is None:
            return old, None
        return old, self.updater.no_grad_stats(self.ref_model, rollout.batch, plan.ref_pass, progress, "ref").logprobs

    def _update(self, plan: UpdatePlan, rollout: Rollout, old: TokenStats, ref: torch.Tensor | None,
                progress: Progress) -> UpdateResult:
        """The policy update (the rollout engine sleeps meanwhile, if configured)."""
        self.engine_phases.sleep()  # no-op: asleep since the end of generation
        self.model.train()
        return self.updater.run(plan, rollout, old, ref, progress)

    def _sync_engine(self) -> None:
        """The updated weights into the engine, waking it in stages (weights → sync → the trainer's cached memory
        freed → KV cache); it is awake afterwards, for validation and the next rollout."""
        self.model.eval()
        self.engine_phases.sync(self.model)

    def wake_engine(self) -> None:
        """Make sure the rollout engine is awake (weights and KV cache) — validation calls it before generating
        (a no-op after a step's sync or at start-up, where it is awake already)."""
        self.engine_phases.wake()

    def _metrics(self, sb: StepBatch, result: UpdateResult, timing: dict[str, float]) -> dict[str, float]:
        """The step's metrics (whole batch, all ranks) with rank 0's timings."""
        reward_stats = dist.sum_reward_stats(sb.rollout.reward_stats, self.dist)
        extra = {**(reward_stats.as_dict() if reward_stats else {}), **result.metrics, **self.prompt_stats,
                 "data/epoch": float(self.loader.epoch)}
        metrics = step_metrics(gather_metric_rows(sb, self.dist), self.cfg, extra)
        metrics.update(timing)  # rank 0's wall-clock times
        metrics["perf/tokens_per_s"] = metrics["response_length/total_tokens"] / timing["timing_s/step"]
        metrics.update(self._utilisation(sb, timing))
        return metrics

    def _utilisation(self, sb: StepBatch, timing: dict[str, float]) -> dict[str, float]:
        """Rank 0's ``perf/max_memory_allocated_gb`` (:func:`stapo.common.perf.max_memory_gb`: the CUDA allocator's
        peak, else the process's peak RSS; GiB) and, when the device's peak FLOP/s is known (``trainer.peak_flops`` or
        :data:`stapo.common.perf.PEAK_FLOPS`), ``perf/mfu/actor``: this rank's update FLOPs at its rows' real lengths
        (:func:`stapo.common.perf.update_flops`) over ``timing_s/update`` × the peak
        (docs/metrics.md#timing-and-throughput).
        """
        out = {"perf/max_memory_allocated_gb": max_memory_gb(self.device)}
        if not hasattr(self, "_peak_flops"):  # once: the device's peak and the model's shape (None: unknown)
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
            self._peak_flops = peak_flops(name, str(self.cfg.model.compute_dtype), self.cfg.trainer.peak_flops)
            try:
                self._model_shape = ModelShape.from_hf_config(getattr(self.model, "config", None))
            except (AttributeError, TypeError, ValueError):
                self._model_shape = None
        seconds = timing.get("timing_s/update", 0.0)
        if self._peak_flops is not None and self._model_shape is not None and seconds > 0:
            batch = sb.rollout.batch
            responses = batch.response_mask.sum(dim=1)  # [B]
            prompts = batch.attention_mask.sum(dim=1) - responses  # [B]
            flops = update_flops(self._model_shape, prompts.tolist(), responses.tolist())
            out["perf/mfu/actor"] = mfu(flops, seconds, self._peak_flops)
        return out

    def _log_examples(self, sb: StepBatch) -> None:
        """Every ``trainer.log_examples_every`` steps the silenced-token table (:func:`stapo.train.metrics.
        silenced_examples`; rank 0's rows) and the completions table (every rank's responses;
        :func:`stapo.train.samples.completions_table`); with ``trainer.save_rollouts`` every step's rollouts file
        (:func:`stapo.train.samples.write_rollouts`). Collective under torchrun when either is due."""
        tc = self.cfg.trainer
        step = self.step + 1
        table_due = bool(tc.log_examples_every) and step % tc.log_examples_every == 0
        if not (table_due or tc.save_rollouts):
            return
        indices = dist.local_prompts(list(range(len(sb.rollout.prompts or []) * self.dist.world)),
                                     self.cfg.actor.ppo_mini_batch_size, self.dist)[1]  # None when W = 1
        records = response_records(sb, self.tokenizer, step, self.objective.token_mask, prompt_indices=indices,
                                   token_arrays=tc.save_rollouts)
        records = [r for part in dist.gather_objects(records, self.dist) for r in part]  # all ranks → rank 0
        if not self.dist.is_main:
            return
        records.sort(key=lambda r: (r["prompt_index"], r["sample"]))
        if tc.save_rollouts:
            write_rollouts(self.run_dir, step, records)
        if table_due and self.tracker is not None:
            s2t = self.cfg.algorithm.s2t
            # one incremental W&B table per name that grows by each logged step's rows (stapo/run/tracking.py)
            self.tracker.log_table(step, *silenced_examples(sb, self.tokenizer, self.objective.token_mask, s2t),
                                   incremental=True)
            self.tracker.log_table(step, *completions_table(step, records), incremental=True)
