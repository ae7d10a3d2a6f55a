"""The training loop: STAPO and its baselines (GRPO, 20-Entropy, JustRL) — docs/method.md.

One training step, top to bottom in :meth:`Trainer.train_step`:

    rollout G responses per prompt → rewards → GRPO advantages → old-policy log-probs / entropies (no grad,
    fp32) and reference log-probs (β > 0) → for each mini-batch: token mask (S2T statistics from the current
    policy, Algorithm 1) → kept-token denominator of the whole mini-batch → micro-batch forward/backward →
    grad-norm clip → AdamW step (warm-up) → sync weights to the rollout engine → metrics → validation hook
    → checkpoint.

Under ``torchrun`` with W > 1 ranks (:mod:`stapo.distributed`) each rank does this for its share of the prompts;
the mask, the denominator and the metrics are mini-batch / step-global (the ``_dp_*`` helpers and
:meth:`Trainer._gather_metric_rows`), only rank 0 logs; every rank writes its shards of a checkpoint
(``torch.distributed.checkpoint``) and rank 0 the HF export (:mod:`stapo.checkpoint`).

Precision (:mod:`stapo.precision`): parameters, gradients and AdamW state in ``model.param_dtype`` (fp32 master
weights), every policy forward under ``model.compute_dtype`` (bf16 autocast; FSDP2 ``MixedPrecisionPolicy``).
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from stapo.advantages import grpo_advantages
from stapo.analysis import entropy_change_estimate, logit_grad_norm, quadrant_summary
from stapo.checkpoint import (DCP_DIR, CheckpointError, is_sharded, latest_checkpoint, load_trainer_state,
                              rng_state, save_checkpoint, set_rng_state)
from stapo.config import TrainConfig, objective_from_config, to_dict
from stapo import distributed as dist
from stapo.masks import get_mask_spec
from stapo.objectives import Objective, compute_token_mask, policy_loss
from stapo.precision import PrecisionPolicy
from stapo.tensor_utils import masked_mean
from stapo.tracking import Tracker

__all__ = ["Trainer", "build_objective", "PromptLoader", "StepBatch"]

ValidationHook = Callable[["Trainer", int], dict[str, float]]


def build_objective(cfg: TrainConfig) -> Objective:
    """The registered objective named by ``algorithm.objective`` with the config's overrides and mask parameters
    applied (:func:`stapo.config.objective_from_config`, the same mapping the verl plugin uses)."""
    return objective_from_config(cfg)


class PromptLoader:
    """Seeded, resumable iteration over training prompts: a fresh permutation each epoch.

    Args:
        prompts: list of (prompt token ids, gold answer, record id).
        batch_size: prompts per step.
        seed: the epoch-e permutation is ``np.random.default_rng([seed, e]).permutation``.
        shuffle: False keeps file order.
    """

    def __init__(self, prompts: list[tuple[list[int], str, str]], batch_size: int, seed: int, shuffle: bool = True):
        if not prompts:
            raise ValueError("no training prompts (all dropped or empty data set)")
        self.prompts = prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def next_batch(self) -> list[tuple[list[int], str, str]]:
        out = []
        while len(out) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[int(self._order[self.position])])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


@dataclass
class StepBatch:
    """What flows from the rollout stage to the update stage of one step (B = prompts × G, R = max response)."""

    batch: Any  # stapo.policy.RolloutBatch: input_ids [B, P+R], response_ids/response_mask [B, R]
    responses: list  # list[stapo.rollout.Response], length B
    rewards: torch.Tensor  # [B] fp32
    advantages: torch.Tensor  # [B] fp32
    old_logprobs: torch.Tensor  # [B, R] fp32
    old_entropy: torch.Tensor  # [B, R] fp32
    old_collision: torch.Tensor  # [B, R] fp32
    ref_logprobs: torch.Tensor | None  # [B, R] fp32 (β > 0 only)


class Trainer:
    """Builds everything from a :class:`TrainConfig` and runs :meth:`train`.

    Args:
        cfg: a validated config (:func:`stapo.config.load_config`).
        validation_hook: optional ``fn(trainer, step) -> metrics`` called every ``trainer.val_every`` steps
            (the evaluation harness provides one).
        reward_fn: optional ``fn(responses, golds) -> obj`` with ``obj.rewards`` (one float per response)
            replacing ``algorithm.reward`` (tests use a toy reward; see :func:`stapo.rewards.make_reward_fn`).
    """

    def __init__(self, cfg: TrainConfig, validation_hook: ValidationHook | None = None,
                 reward_fn: Callable[[list[str], list[str]], Any] | None = None) -> None:
        from stapo.rollout import SamplingParams, build_rollout_engine

        self.cfg = cfg
        self.objective = build_objective(cfg)
        self.validation_hook = validation_hook
        tc = cfg.trainer
        # data parallelism (torchrun, WORLD_SIZE > 1); W = 1: nothing is initialised and nothing below changes
        self.dist = dist.init_distributed(tc.device, tc.data_parallel)
        dist.check_dp_config(cfg, self.dist)  # ConfigError naming the key (train.py: exit 2)
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = self.dist.device if self.dist.enabled else torch.device(auto if tc.device == "auto" else tc.device)
        self._mini_rows = cfg.actor.ppo_mini_batch_size // self.dist.world * cfg.rollout.n  # this rank's rows
        model_tag = cfg.model.path.rstrip("/").split("/")[-1].replace(":", "-")
        self.run_name = tc.run_name or f"{self.objective.name}_{model_tag}_seed{tc.seed}"
        self.run_dir = Path(tc.output_dir) / self.run_name
        self.ckpt_root = self.run_dir / "checkpoints"
        if tc.resume != "auto" and latest_checkpoint(self.ckpt_root) is not None:  # before loading anything
            raise FileExistsError(f"{self.run_dir} already holds checkpoints; resume it with --resume "
                                  f"(trainer.resume=auto) or choose another trainer.run_name")
        self._seed_everything(tc.seed)

        # --- policy, reference, optimizer -------------------------------------------------------------
        # Precision policy (stapo/precision.py): parameters, gradients and AdamW state in param_dtype (fp32 master
        # weights), forward/backward in compute_dtype (autocast; FSDP2's MixedPrecisionPolicy).
        self.precision = PrecisionPolicy.from_config(cfg.model)
        self.compute_dtype = self.precision.compute_dtype
        self.model, self.tokenizer = self._load_initial_model(self.precision.param_dtype)
        if self.dist.strategy != "fsdp2":  # FSDP2: fully_shard moves each layer's shards to the device itself,
            self.model.to(self.device)     # so the whole fp32 model never sits on one GPU
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.ref_model = None
        if self.objective.kl_coef > 0:  # the initial policy, frozen, loaded again in the compute dtype (no fp32 copy)
            ref, _ = self._load_initial_model(self.compute_dtype)
            ref = ref.eval().requires_grad_(False)
            # FSDP2: sharded like the policy (its no-grad forwards are collectives too); else on the device
            self.ref_model = dist.wrap_policy(ref, self.dist) if self.dist.strategy == "fsdp2" else ref.to(self.device)
        # FSDP2: sharded in place (bf16 all-gathers, fp32 reduce-scatter when mixed); before the optimizer
        self.model = dist.wrap_policy(self.model, self.dist, mp_policy=self.precision.fsdp_mp_policy())
        self._check_param_dtype()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay,
            betas=tuple(cfg.actor.betas))
        warmup = cfg.actor.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)

        # --- data, reward, rollout engine -------------------------------------------------------------
        self.prompt_stats: dict[str, float] = {}
        self.loader = PromptLoader(self._load_prompts(), cfg.data.train_batch_size, tc.seed, cfg.data.shuffle)
        from stapo.rewards import make_reward_fn

        self.reward_fn = reward_fn if reward_fn is not None else make_reward_fn(cfg.algorithm.reward)
        self.engine = build_rollout_engine(
            cfg.rollout.backend, self.model, self.tokenizer,
            **self._engine_kwargs())
        self._sampling_cls = SamplingParams
        self._seed_everything(tc.seed)  # the vLLM engine reseeds the global RNGs when it starts

        self.step = 0
        self.tracker: Tracker | None = None
        self._phase_bar: Any = None  # the inner progress bar of the current step (rollout / old log-probs / update)

    # ------------------------------------------------------------------------------------------------
    def _engine_kwargs(self) -> dict[str, Any]:
        """The rollout engine's keyword arguments (:func:`stapo.rollout.engine_kwargs`, shared with evaluation)."""
        from stapo.rollout import EngineOptions, engine_kwargs

        rc = self.cfg.rollout
        options = EngineOptions(
            dtype=self.compute_dtype,  # vLLM: fp32 master → bf16 engine weights at each sync; HF: autocast
            external_launcher=self.dist.enabled,  # one colocated engine per rank, inside torchrun's processes
            max_model_len=self.cfg.data.max_prompt_length + rc.response_length,
            gpu_memory_utilization=rc.gpu_memory_utilization, kv_cache_gib=rc.kv_cache_gib,
            enforce_eager=rc.enforce_eager, tensor_parallel_size=rc.tensor_parallel_size, seed=self.cfg.trainer.seed,
            enable_sleep_mode=rc.sleep_during_update)
        return engine_kwargs(rc.backend, options)

    def _load_initial_model(self, dtype: torch.dtype):
        """The initial policy ``model.path`` (``"tiny"``: the seeded random test model) in ``dtype``, on the CPU →
        ``(model, tokenizer)``. Called for the policy (param dtype) and for the reference model (compute dtype)."""
        from stapo.models import build_tiny_model, load_policy

        mc = self.cfg.model
        if mc.path == "tiny":  # tests: a randomly initialised Qwen3-architecture model (the same for every call)
            return build_tiny_model(seed=self.cfg.trainer.seed, dtype=dtype, cache_dir=mc.cache_dir)
        return load_policy(mc.path, dtype=dtype, attn_implementation=mc.attn_implementation, cache_dir=mc.cache_dir)

    def _check_param_dtype(self) -> None:
        """Every trainable parameter holds at least ``model.param_dtype``'s precision (what the optimizer steps on).

        Raises:
            stapo.config.ConfigError: a trainable parameter in a 16-bit dtype while ``model.param_dtype`` is
                float32 (a model class that forces some weights into bf16), naming the parameter.
        """
        from stapo.config import ConfigError

        want = self.precision.param_dtype
        for name, p in self.model.named_parameters():
            if p.requires_grad and p.dtype != want and torch.finfo(p.dtype).eps > torch.finfo(want).eps:
                raise ConfigError(f"invalid value for 'model.param_dtype' ({str(want).removeprefix('torch.')}): "
                                  f"the policy's parameter {name} is {str(p.dtype).removeprefix('torch.')}")

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _load_prompts(self) -> list[tuple[list[int], str, str]]:
        """Training records → (prompt ids, gold, id); prompts over ``data.max_prompt_length`` are dropped (counted)."""
        from stapo.data import load_file_set, load_train_set
        from stapo.prompts import encode_prompt

        dc = self.cfg.data
        if dc.train_set == "synthetic":
            records = load_train_set("synthetic", n=dc.synthetic.num_problems, seed=dc.synthetic.seed,
                                     levels=tuple(dc.synthetic.levels))
        elif dc.train_set == "file":  # the user's file (data.train_file); source name = the file's stem
            name = Path(dc.train_file.path).stem if dc.train_file.path else "file"
            records = load_file_set(name, dc.train_file, key="data.train_file")
        else:
            records = load_train_set(dc.train_set, dc.root)
        out, dropped = [], 0
        for rec in records:
            ids = encode_prompt(rec.problem, self.tokenizer, use_chat_template=dc.prompt_style,
                                system_prompt=dc.system_prompt)
            if len(ids) > dc.max_prompt_length:
                dropped += 1
                continue
            out.append((ids, rec.answer, rec.id))
        self.prompt_stats = {"data/num_prompts": float(len(out)), "data/num_dropped_too_long": float(dropped),
                             "data/num_skipped_rows": float(records.stats.skipped)}
        return out

    # ------------------------------------------------------------------------------------------------
    def train(self) -> list[dict[str, float]]:
        """Run (or resume) training to ``trainer.total_steps``. Returns each step's metrics."""
        tc = self.cfg.trainer
        if tc.resume == "auto":
            self._maybe_resume()
        elif latest_checkpoint(self.ckpt_root) is not None:
            raise FileExistsError(f"{self.run_dir} already holds checkpoints; resume it with --resume "
                                  f"(trainer.resume=auto) or choose another trainer.run_name")
        main = self.dist.is_main  # only rank 0 writes the run directory, logs and shows progress bars
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=2))
            self.tracker = Tracker(self.run_dir, to_dict(self.cfg), mode=self.cfg.logging.wandb_mode,
                                   project=self.cfg.logging.project, entity=self.cfg.logging.entity,
                                   name=self.run_name)
            self.tracker.truncate_after(self.step)  # rows a crashed run wrote after its last checkpoint
            self._drop_stale_validation()
        history: list[dict[str, float]] = []
        bar = tqdm(total=tc.total_steps, initial=self.step, desc="train", disable=not (tc.progress_bar and main),
                   dynamic_ncols=True)
        try:
            while self.step < tc.total_steps:
                metrics = self.train_step()
                self.step += 1
                if self.validation_hook is not None and tc.val_every and self.step % tc.val_every == 0:
                    if main:  # rank 0 validates with its engine; the others wait
                        metrics.update(self.validation_hook(self, self.step))
                    dist.barrier(self.dist)
                if self.tracker is not None:
                    self.tracker.log(self.step, metrics)
                history.append(metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}",
                                ent=f"{metrics['actor/entropy']:.3f}",
                                masked=f"{metrics.get('s2t/masked_frac', 0.0):.2e}")
                if (tc.save_every and self.step % tc.save_every == 0) or self.step == tc.total_steps:
                    self.save()
        finally:
            bar.close()
            if self.tracker is not None:
                self.tracker.finish()
            for owner in (self.reward_fn, self.validation_hook):  # grader process pools
                close = getattr(owner, "close", None)
                if callable(close):
                    close()
        return history

    def close(self) -> None:
        """Release the rollout engine (vLLM: its workers and, under torchrun, its process groups — before
        :func:`stapo.distributed.teardown`). The trainer cannot generate afterwards."""
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()

    def _drop_stale_validation(self) -> None:
        """Remove validation outputs of steps after ``self.step`` (a crashed or earlier run's), so the
        evaluation store never resumes generations of other weights."""
        import shutil

        subdir = getattr(self.validation_hook, "subdir", "validation")
        root = self.run_dir / subdir if subdir else None
        if root is None or not root.is_dir():
            return
        for d in root.glob("step_*"):
            try:
                step = int(d.name.split("_", 1)[1])
            except ValueError:
                continue
            if step > self.step:
                shutil.rmtree(d, ignore_errors=True)

    def _maybe_resume(self) -> None:
        """Resume from the latest complete checkpoint, if any (every rank): model + optimizer from ``dcp/``,
        re-sharded to this run's ranks and strategy (checkpoints of the previous format: weights from the HF files,
        the full optimizer state from ``trainer_state.pt``); then scheduler, data loader, RNG (this rank's when the
        rank count is unchanged, else rank 0's) and step."""
        ckpt = latest_checkpoint(self.ckpt_root)
        if ckpt is None:
            return
        try:
            if is_sharded(ckpt):
                state = load_trainer_state(ckpt)
                dist.load_sharded_state(self.model, self.optimizer, ckpt / DCP_DIR)  # collective under torchrun
            else:
                state = load_trainer_state(ckpt, mmap=self.dist.enabled)  # every rank reads it (W > 1: mmap)
                self._load_full_checkpoint(ckpt, state)
        except (ValueError, OSError, RuntimeError, EOFError, KeyError) as e:  # torn / damaged / foreign files
            msg = " ".join(str(e).split())
            raise CheckpointError(f"cannot resume from {ckpt}: {msg[:600]} — move that folder out of "
                                  f"{self.ckpt_root} to resume from the previous checkpoint") from e
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        per_rank = state.get("rng_per_rank")
        set_rng_state(per_rank[self.dist.rank] if per_rank and len(per_rank) == self.dist.world else state["rng"])
        self.step = int(state["step"])
        self.engine.sync_weights(self.model)
        if self.dist.is_main:
            tqdm.write(f"resumed from {ckpt} at step {self.step}")

    def _load_full_checkpoint(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Previous checkpoint format: weights from the HF files, ``state["optimizer"]`` the full optimizer state."""
        from stapo.models import load_policy

        model_sd: dict[str, torch.Tensor] = {}
        if self.dist.is_main or self.dist.strategy != "fsdp2":  # FSDP2: rank 0 loads, the shards are broadcast
            model, _ = load_policy(str(ckpt), dtype=self.precision.param_dtype,
                                   attn_implementation=self.cfg.model.attn_implementation)
            model_sd = model.state_dict()
            del model
        dist.load_full_state(self.model, self.optimizer, model_sd, state["optimizer"], self.dist)

    def save(self) -> Path:
        """Write the step's checkpoint (:func:`stapo.checkpoint.save_checkpoint`; collective under torchrun: every
        rank writes its model/optimizer shards, rank 0 the HF export in ``compute_dtype`` — the parameters' dtype
        when the trainer has none — and the trainer state). Every rank returns the folder once it is complete."""
        rngs = dist.gather_objects(rng_state(), self.dist)
        state = {"scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(), "rng": rngs[0],
                 "config": to_dict(self.cfg)}
        if self.dist.enabled:
            state["rng_per_rank"] = rngs
        return save_checkpoint(self.ckpt_root, self.step, self.model, self.tokenizer, state,
                               optimizer=self.optimizer, keep_last=self.cfg.trainer.keep_last,
                               export_dtype=getattr(self, "compute_dtype", None), ctx=self.dist)

    # ------------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One step of rollout and update. Returns the step's metrics (verl names, ``s2t/…`` ours)."""
        cfg, G = self.cfg, self.cfg.rollout.n
        timing: dict[str, float] = {}
        t_step = time.perf_counter()
        self._phase_bar = tqdm(total=None, desc="rollout", unit="mb", position=1, leave=False, dynamic_ncols=True,
                               disable=not (cfg.trainer.progress_bar and self.dist.is_main))

        # 1. rollout: G responses per prompt, sampled from π_old at temperature T
        t0 = time.perf_counter()
        prompts, prompt_indices = self._dp_prompts(self.loader.next_batch())  # this rank's share (all when W = 1)
        sampling = self._sampling_cls(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                      max_new_tokens=cfg.rollout.response_length,
                                      seed=cfg.trainer.seed * 1_000_003 + self.step, prompt_indices=prompt_indices)
        self.model.eval()
        responses = self.engine.generate([p[0] for p in prompts], G, sampling)
        timing["timing_s/rollout"] = time.perf_counter() - t0
        self._phase_bar.reset(total=self._num_micro_batches(len(responses)))
        self._phase_bar.set_description("old_log_prob")

        # 2. rewards (score the response text only, never the prompt)
        t0 = time.perf_counter()
        golds = [prompts[r.group][1] for r in responses]
        reward_out = self.reward_fn([r.text for r in responses], golds)
        rewards = torch.tensor(reward_out.rewards, dtype=torch.float32)  # [B]
        timing["timing_s/reward"] = time.perf_counter() - t0

        # 3. GRPO advantages, one per response
        adv_out = grpo_advantages(rewards, G, eps=cfg.algorithm.adv_eps, norm_by_std=cfg.algorithm.norm_adv_by_std)

        # 4. old-policy (and reference) log-probs and entropies: no grad, fp32
        t0 = time.perf_counter()
        sb = self._prepare_batch(responses, rewards, adv_out.advantages)
        timing["timing_s/old_log_prob"] = time.perf_counter() - t0

        # 5. update: one optimizer step per mini-batch (the engine sleeps meanwhile, if configured)
        t0 = time.perf_counter()
        if cfg.rollout.sleep_during_update:
            self.engine.sleep()
        self._phase_bar.set_description("update")
        self.model.train()
        update_metrics = self._update(sb)
        timing["timing_s/update"] = time.perf_counter() - t0

        # 6. sync the new weights into the rollout engine
        t0 = time.perf_counter()
        self.model.eval()
        if cfg.rollout.sleep_during_update:
            self.engine.wake_up()
        self.engine.sync_weights(self.model)
        timing["timing_s/sync"] = time.perf_counter() - t0

        self._phase_bar.close()

        # 7. metrics
        timing["timing_s/step"] = time.perf_counter() - t_step
        metrics = self._step_metrics(self._gather_metric_rows(sb), self._dp_reward_stats(reward_out),
                                     update_metrics)
        metrics.update(timing)  # rank 0's wall-clock times
        metrics["perf/tokens_per_s"] = metrics["response_length/total_tokens"] / timing["timing_s/step"]
        if (cfg.trainer.log_examples_every and (self.step + 1) % cfg.trainer.log_examples_every == 0
                and self.tracker is not None):  # rank 0's rows only
            self._log_silenced_examples(sb)
        return metrics

    # --- stage helpers --------------------------------------------------------------------------------
    def _prepare_batch(self, responses, rewards: torch.Tensor, advantages: torch.Tensor) -> StepBatch:
        from stapo.policy import collate_responses

        batch = collate_responses(responses, self.tokenizer.pad_token_id)
        B, R = batch.response_mask.shape
        # With actor.fused_forward the first mini-batch's old-policy statistics come from its update forward
        # (π_θ = π_old there; filled in by _update), so only the later mini-batches' rows are computed here.
        first = self._mini_rows if self.cfg.actor.fused_forward else 0
        old = self._forward_all(self.model, batch, B, R, rows=torch.arange(min(first, B), B))
        ref = self._forward_all(self.ref_model, batch, B, R)[0] if self.ref_model is not None else None
        return StepBatch(batch=batch, responses=responses, rewards=rewards, advantages=advantages,
                         old_logprobs=old[0], old_entropy=old[1], old_collision=old[2], ref_logprobs=ref)

    @torch.no_grad()
    def _forward_all(self, model, batch, B: int, R: int, rows: torch.Tensor | None = None):
        """No-grad token statistics for ``rows`` (default: all) → (logprobs, entropy, collision), each [B, R]."""
        rows = torch.arange(B) if rows is None else rows
        out = [torch.zeros(B, R) for _ in range(3)]  # [B, R] fp32 each
        for idx in self._micro_batches(batch, rows):
            st = self._policy_forward(batch, idx, model)  # [b, r]
            r = st.logprobs.shape[1]
            for buf, t in zip(out, (st.logprobs, st.entropy, st.collision)):
                buf[idx, :r] = t.float().cpu()  # scatter back through the same permutation
            self._tick()
        return out

    def _num_micro_batches(self, B: int) -> int:
        """Forward passes of one step over ``B`` responses: old (+ reference) pass, current-policy statistics
        of later mini-batches (a mask reading p and H with ``algorithm.mask_stats_source=current``), and the update."""
        micro, rows_per_mini = self.cfg.actor.ppo_micro_batch_size, self._mini_rows
        n_all = math.ceil(B / micro)
        n_mini = math.ceil(B / rows_per_mini)
        per_mini = math.ceil(min(rows_per_mini, B) / micro)
        if self.cfg.actor.fused_forward:  # no old pass over the first mini-batch, no separate current-stats pass
            return (math.ceil(max(B - rows_per_mini, 0) / micro) + n_all * int(self.ref_model is not None)
                    + n_mini * per_mini)
        extra_stats = self._mask_uses_current_stats()
        return (n_all * (2 if self.ref_model is not None else 1) + n_mini * per_mini
                + (n_mini - 1) * per_mini * int(extra_stats))

    def _mask_uses_current_stats(self) -> bool:
        """Later mini-batches' masks need p and H of the current policy: the mask reads statistics
        (:attr:`stapo.masks.MaskSpec.needs_stats`) and ``algorithm.mask_stats_source`` is ``current``."""
        return (get_mask_spec(self.objective.token_mask).needs_stats
                and self.cfg.algorithm.mask_stats_source == "current")

    def _tick(self, **postfix: str) -> None:
        """Advance the step's inner progress bar by one micro-batch."""
        if self._phase_bar is not None:
            self._phase_bar.update(1)
            if postfix:
                self._phase_bar.set_postfix(postfix, refresh=False)

    def _micro_batches(self, batch, rows: torch.Tensor) -> list[torch.Tensor]:
        """Split ``rows`` into micro-batches of ``actor.ppo_micro_batch_size`` rows, sorted by length if asked
        (not with ``actor.share_prompt``: a group's rows stay together, in rollout order)."""
        size = self.cfg.actor.ppo_micro_batch_size
        if self.cfg.actor.sort_by_length and not self.cfg.actor.share_prompt:
            lengths = batch.attention_mask[rows].sum(dim=1)  # [n] prompt + response tokens
            rows = rows[torch.argsort(lengths, descending=True, stable=True)]
        return [rows[i:i + size] for i in range(0, len(rows), size)]

    def _update(self, sb: StepBatch) -> dict[str, float]:
        """All mini-batches of the step: mask → denominator → micro-batch forward/backward → clip → step."""
        cfg, obj, G = self.cfg, self.objective, self.cfg.rollout.n
        B, R = sb.batch.response_mask.shape
        rows_per_mini = self._mini_rows  # this rank's responses per optimizer step (whole groups)
        acc = _MetricAccumulator()
        self._last_keep = torch.zeros(B, R, dtype=torch.bool)  # [B, R] kept tokens, for the examples table
        for mb_i, start in enumerate(range(0, B, rows_per_mini)):
            rows = torch.arange(start, min(start + rows_per_mini, B))  # [n] this mini-batch's responses
            self.optimizer.zero_grad(set_to_none=True)
            # actor.fused_forward: the statistics come from this mini-batch's own update forward — always for
            # the first mini-batch (its old-policy pass was skipped), and for later ones when the mask uses the
            # current policy's statistics.
            fused = cfg.actor.fused_forward and (mb_i == 0 or self._mask_uses_current_stats())
            tm = (self._backward_fused(sb, rows, first=mb_i == 0, acc=acc) if fused
                  else self._backward_minibatch(sb, rows, first=mb_i == 0, acc=acc))
            self._last_keep[rows] = tm.keep
            acc.add_mask_stats(tm.stats)
            dist.average_gradients(self.model, self.dist)  # replicate: all-reduce; FSDP2 reduce-scattered already
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.actor.grad_clip)
            acc.add_mean("actor/grad_norm", dist.grad_norm_value(grad_norm))
            if torch.isfinite(grad_norm):
                self.optimizer.step()
            else:  # skip the step rather than write NaN into the weights; counted
                acc.add_sum("actor/nonfinite_grad_steps", 1.0)
        if self.dist.enabled:  # per-kept-token means over every rank's micro-batches
            acc.all_reduce(("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"), self.dist)
        out = acc.result()
        out["actor/lr"] = self.scheduler.get_last_lr()[0]  # the learning rate this step used
        # One scheduler step per TRAINING step (as verl's update_actor): warm-up counts training steps, whatever
        # the number of mini-batches (optimizer steps) per training step.
        self.scheduler.step()
        out["actor/num_kept_tokens"] = dist.all_reduce({"n": float(self._last_keep.sum())}, self.dist)["n"]
        return out

    def _backward_minibatch(self, sb: StepBatch, rows: torch.Tensor, first: bool, acc: "_MetricAccumulator"):
        """One mini-batch, the paper's order: token mask from statistics computed beforehand → denominator of the
        whole mini-batch → micro-batch forward/backward. Returns the mini-batch's :class:`TokenMask`."""
        cfg, obj = self.cfg, self.objective
        B, R = sb.batch.response_mask.shape
        response_mask = sb.batch.response_mask.bool()  # [B, R]
        # Token mask over the WHOLE mini-batch. S2T statistics come from the current policy (Algorithm 1);
        # for the first mini-batch π_θ = π_old, so the old-policy pass is reused.
        if not self._mask_uses_current_stats() or first:
            stat_logp, stat_ent = sb.old_logprobs[rows], sb.old_entropy[rows]  # [n, R]
        else:
            cur = self._forward_all(self.model, sb.batch, B, R, rows=rows)
            stat_logp, stat_ent = cur[0][rows], cur[1][rows]  # [n, R]
        tm = self._dp_token_mask(stat_logp, stat_ent, sb.advantages[rows], response_mask[rows])
        # The loss denominator of the whole mini-batch (all ranks), computed once, before the micro-batch loop.
        denom = self._dp_loss_denominator(tm.keep)
        loss_sums: dict[str, float] = {}
        for idx in self._micro_batches(sb.batch, rows):  # idx: [b] batch rows (possibly length-sorted)
            st = self._policy_forward(sb.batch, idx)  # [b, r], grad
            keep = self._keep_of(tm.keep, rows, idx, st.logprobs.shape[1])  # [b, r], same permutation
            self._backward_micro(sb, idx, st, keep, denom, sb.old_logprobs[idx, :st.logprobs.shape[1]], acc, loss_sums)
        for k, v in self._dp_sum_loss_shares(loss_sums).items():
            acc.add_mean(k, v)
        return tm

    def _backward_fused(self, sb: StepBatch, rows: torch.Tensor, first: bool, acc: "_MetricAccumulator"):
        """One mini-batch with ``actor.fused_forward``: the mask's statistics come from the update's own forward.

        1. Rows whose mask may depend on the statistics (:func:`stapo.masks.maskable_rows`: Â > 0 for S2T, all
           rows for 20-Entropy, none without a mask) are forwarded WITH grad and their graphs kept.
        2. The other rows are forwarded and backwarded at once: their keep-mask is their response mask.
        3. The mask is built from the detached statistics of the whole mini-batch; the kept rows' backwards run.
        4. The micro-batch losses were sums (denominator 1), so the gradient is divided by the mini-batch
           denominator once it is known — the same gradient as the loss divided by it (linearity).

        For the first mini-batch π_θ = π_old: the old log-probs are the forward's log-probs, detached (ratio 1),
        and its statistics fill ``sb.old_logprobs / old_entropy / old_collision``. Memory ≈ the activations of
        the kept micro-batches. Returns the mini-batch's :class:`TokenMask`.
        """
        from stapo.masks import maskable_rows

        obj = self.objective
        B, R = sb.batch.response_mask.shape
        response_mask = sb.batch.response_mask.bool()  # [B, R]
        deferred = maskable_rows(obj.token_mask, sb.advantages[rows])  # [n] bool
        if self.dist.strategy == "fsdp2":  # FSDP2's forwards/backwards are collectives: the same sequence on
            deferred[:] = True             # every rank, so no data-dependent split (all graphs kept)
        plan = ([(idx, True) for idx in self._micro_batches(sb.batch, rows[deferred])]
                + [(idx, False) for idx in self._micro_batches(sb.batch, rows[~deferred])])
        stat_logp, stat_ent = torch.zeros(B, R), torch.zeros(B, R)  # [B, R] fp32, this mini-batch's rows filled
        pending, loss_sums = [], {}
        for idx, is_deferred in plan:  # idx: [b] batch rows
            st = self._policy_forward(sb.batch, idx)  # [b, r], grad
            r = st.logprobs.shape[1]
            logp, ent = st.logprobs.detach().float().cpu(), st.entropy.detach().float().cpu()  # [b, r]
            stat_logp[idx, :r], stat_ent[idx, :r] = logp, ent
            if first:  # π_θ = π_old: these are the old-policy statistics
                sb.old_logprobs[idx, :r], sb.old_entropy[idx, :r] = logp, ent
                sb.old_collision[idx, :r] = st.collision.detach().float().cpu()
            old = sb.old_logprobs[idx, :r]  # [b, r]
            if is_deferred:
                pending.append((idx, st, old))
            else:
                self._backward_micro(sb, idx, st, response_mask[idx, :r], 1.0, old, acc, loss_sums)
        tm = self._dp_token_mask(stat_logp[rows], stat_ent[rows], sb.advantages[rows], response_mask[rows])
        if not torch.equal(tm.keep[~deferred], response_mask[rows][~deferred]):  # maskable_rows broken
            raise RuntimeError(f"the {obj.token_mask!r} mask silenced tokens of rows maskable_rows() excluded")
        for k, (idx, st, old) in enumerate(pending):
            pending[k] = None  # the backward frees this graph
            keep = self._keep_of(tm.keep, rows, idx, st.logprobs.shape[1])  # [b, r]
            self._backward_micro(sb, idx, st, keep, 1.0, old, acc, loss_sums)
        denom = self._dp_loss_denominator(tm.keep)  # N / W under torchrun (see there)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(denom)
        for k, v in self._dp_sum_loss_shares({k: v / denom for k, v in loss_sums.items()}).items():
            acc.add_mean(k, v)
        return tm

    def _policy_forward(self, batch, idx: torch.Tensor, model: torch.nn.Module | None = None):
        """Forward of ``batch`` rows ``idx`` ([b]) through ``model`` (default: the policy; grad if enabled) →
        :class:`TokenStats`, each [b, r] fp32 (r ≤ R: the micro-batch is trimmed)."""
        from stapo.policy import policy_token_stats

        with self.precision.autocast(self.device):  # bf16 matmuls when mixed; token statistics stay fp32
            return policy_token_stats(self.model if model is None else model,
                                      batch.select(idx).trim().to(self.device), self.cfg.rollout.temperature,
                                      share_prompt=self.cfg.actor.share_prompt)

    @staticmethod
    def _keep_of(keep: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, r: int) -> torch.Tensor:
        """The rows ``idx`` ([b] batch rows) of a mini-batch keep-mask ``keep`` ([n, R] over the contiguous batch
        rows ``rows``), cut to ``r`` columns → [b, r] bool, in ``idx``'s order."""
        return keep[idx - int(rows[0]), :r]

    def _backward_micro(self, sb: StepBatch, idx: torch.Tensor, st, keep: torch.Tensor, denom: float,
                        old_logprobs: torch.Tensor, acc: "_MetricAccumulator", loss_sums: dict[str, float]) -> None:
        """Loss of one micro-batch (rows ``idx`` [b]; ``keep``, ``old_logprobs`` [b, r]) and its backward."""
        r = st.logprobs.shape[1]
        loss, m = policy_loss(
            self.objective, st.logprobs, old_logprobs.to(self.device), sb.advantages[idx].to(self.device),
            keep.to(self.device), denom,
            ref_logprobs=None if sb.ref_logprobs is None else sb.ref_logprobs[idx, :r].to(self.device))
        loss.backward()
        for k in ("actor/pg_loss", "actor/kl_loss"):  # shares of the mini-batch loss: add up
            if k in m:
                loss_sums[k] = loss_sums.get(k, 0.0) + m[k]
        for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):  # per kept token
            acc.add_mean(k, m[k], weight=m["actor/num_kept_tokens"])
        self._tick(loss=f"{m['actor/pg_loss']:.4f}")

    # --- data-parallel helpers (each is the plain one-process computation when W = 1) --------------------------
    def _dp_prompts(self, prompts: list) -> tuple[list, list[int] | None]:
        """This rank's prompts of the step's global batch and their global indices (None when W = 1)."""
        if not self.dist.enabled:
            return prompts, None
        idx = dist.shard_prompt_indices(len(prompts), self.cfg.actor.ppo_mini_batch_size, self.dist.world,
                                        self.dist.rank)
        return [prompts[i] for i in idx], idx

    def _dp_token_mask(self, logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor):
        """The objective's token mask of the whole mini-batch: [n, R] inputs (this rank's rows) → ``.keep``
        [n, R] bool and ``.stats``, mini-batch-global (W > 1:
        :func:`~stapo.dp_mask.minibatch_token_mask`, an all-gather of 12 bytes per response token)."""
        if not self.dist.enabled:
            return compute_token_mask(self.objective, logprobs, entropy, advantages, response_mask)
        from stapo.dp_mask import minibatch_token_mask

        dev = self.dist.comm_device
        tm = minibatch_token_mask(self.objective, logprobs.to(dev), entropy.to(dev), advantages.to(dev),
                                  response_mask.to(dev))
        return SimpleNamespace(keep=tm.keep.cpu(), stats=tm.stats)

    def _dp_loss_denominator(self, keep: torch.Tensor) -> float:
        """The denominator each rank divides its loss share by: N / W (N of the whole mini-batch). Ranks' gradients
        are averaged (FSDP2 / :func:`stapo.distributed.average_gradients`), so the update is Σ ∇ℓ / N."""
        total = dist.minibatch_loss_denominator(keep, self.objective.loss_agg_mode, self.dist,
                                                max_response_length=self.cfg.rollout.response_length)  # W = 1: N
        return total / self.dist.world

    def _dp_sum_loss_shares(self, shares: dict[str, float]) -> dict[str, float]:
        """The mini-batch loss from every rank's share (each computed with denominator N / W): Σ_ranks / W."""
        if not self.dist.enabled:
            return shares
        return {k: v / self.dist.world for k, v in dist.all_reduce(shares, self.dist).items()}

    def _dp_reward_stats(self, reward_out) -> Any:
        """The reward function's counts (``reward_out.stats``, or None) summed over ranks."""
        stats = getattr(reward_out, "stats", None)
        return dist.merge_stats(dist.gather_objects(stats, self.dist)) if self.dist.enabled else stats

    def _gather_metric_rows(self, sb: StepBatch) -> SimpleNamespace:
        """What the step metrics need, for the step's WHOLE batch (rank-major rows when W > 1).

        Returns a namespace with ``mask`` [B, R] bool; ``rewards``, ``advantages``, ``truncated`` [B] fp32;
        ``old_logprobs``, ``old_entropy``, ``old_collision``, ``engine_logprobs`` [B, R] fp32 (engine log-probs NaN
        where the engine reported none). Communication (W > 1): one all-gather of 4 · (3 + 5R) bytes per row.
        """
        mask = sb.batch.response_mask.bool()  # [B, R]
        engine = torch.full(mask.shape, float("nan"))  # [B, R]
        for i, r in enumerate(sb.responses):
            if r.engine_logprobs:
                n = min(len(r.engine_logprobs), int(mask[i].sum()))
                engine[i, :n] = torch.tensor(r.engine_logprobs[:n], dtype=torch.float32)
        truncated = torch.tensor([r.finish_reason == "length" for r in sb.responses], dtype=torch.float32)
        per_row = {"rewards": sb.rewards, "advantages": sb.advantages, "truncated": truncated}
        per_tok = {"mask": mask.float(), "old_logprobs": sb.old_logprobs, "old_entropy": sb.old_entropy,
                   "old_collision": sb.old_collision, "engine_logprobs": engine}
        rows, toks = dist.all_gather_rows(per_row, per_tok, self.dist)
        out = SimpleNamespace(**rows, **toks)
        out.mask = toks["mask"] > 0.5
        out.engine_logprobs = torch.where(out.mask, toks["engine_logprobs"], torch.tensor(float("nan")))
        return out

    def _step_metrics(self, v: SimpleNamespace, reward_stats: Any,
                      update_metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics from :meth:`_gather_metric_rows` (the whole batch), the reward counts and the
        update's (already rank-reduced) metrics."""
        mask = v.mask  # [B, R]
        lengths = mask.sum(dim=1).float()  # [B] response tokens
        adv_tok = v.advantages[:, None].expand_as(mask)  # [B, R]
        m: dict[str, float] = {
            "critic/score/mean": v.rewards.mean().item(),
            "critic/score/max": v.rewards.max().item(),
            "critic/score/min": v.rewards.min().item(),
            "critic/rewards/mean": v.rewards.mean().item(),
            "actor/entropy": masked_mean(v.old_entropy, mask).item(),
            "response_length/mean": lengths.mean().item(),
            "response_length/max": lengths.max().item(),
            "response_length/min": lengths.min().item(),
            "response_length/clip_ratio": v.truncated.mean().item(),
            "response_length/total_tokens": lengths.sum().item(),
        }
        alg = self.cfg.algorithm  # advantage metrics of the whole batch (groups are whole on every rank)
        m.update(grpo_advantages(v.rewards, self.cfg.rollout.n, eps=alg.adv_eps,
                                 norm_by_std=alg.norm_adv_by_std).metrics)
        m.update(reward_stats.as_dict() if reward_stats else {})
        m.update(update_metrics)
        m.update(self.prompt_stats)
        m["data/epoch"] = float(self.loader.epoch)
        # train/inference mismatch: engine log-probs vs the trainer's recomputation (old policy)
        reported = ~torch.isnan(v.engine_logprobs)  # [B, R]
        if bool(reported.any()):
            d = (v.engine_logprobs - v.old_logprobs)[reported].abs()  # row-major, as the per-response loop was
            m["rollout/logprob_diff_mean"] = d.mean().item()
            m["rollout/logprob_diff_max"] = d.max().item()
        # docs/method.md#token-analysis analysis at the old policy (ρ = 1 → w = Â): quadrant summary of Â > 0 tokens
        gnorm = logit_grad_norm(v.old_logprobs, v.old_collision, adv_tok, temperature=self.cfg.rollout.temperature)
        dh = entropy_change_estimate(v.old_logprobs, v.old_entropy, adv_tok)
        q = quadrant_summary(v.old_logprobs, v.old_entropy, adv_tok, mask, grad_norm=gnorm, entropy_change=dh,
                             prob_threshold=self.cfg.algorithm.s2t.prob_threshold)
        m.update({f"s2t/{k}": val for k, val in q.items()})
        return m

    def _log_silenced_examples(self, sb: StepBatch, max_rows: int = 20, context: int = 6) -> None:
        """A table of silenced tokens (S2T, or any mask registered with ``silences=True``, under its prefix) — or, for
        the other objectives, tokens S2T *would* silence."""
        from stapo.masks import s2t_mask

        s2t = self.cfg.algorithm.s2t
        mask = sb.batch.response_mask.bool()
        spec = get_mask_spec(self.objective.token_mask)
        if spec.silences:  # S2T and masks like it: the tokens it silenced
            silenced = mask & ~self._last_keep
        else:
            tm = s2t_mask(sb.old_logprobs, sb.old_entropy, sb.advantages, mask, prob_threshold=s2t.prob_threshold,
                          entropy_quantile=s2t.entropy_quantile, quantile_scope=s2t.quantile_scope)
            silenced = mask & ~tm.keep
        rows = []
        for b, t in silenced.nonzero().tolist()[:max_rows]:
            ids = sb.batch.response_ids[b]
            rows.append([
                self.tokenizer.decode([int(ids[t])]),
                self.tokenizer.decode(ids[max(0, t - context):t].tolist()),
                math.exp(sb.old_logprobs[b, t].item()), sb.old_entropy[b, t].item(), sb.advantages[b].item(),
            ])
        if self.tracker is not None:
            table = f"{spec.prefix}/examples" if spec.silences else "s2t/examples"
            self.tracker.log_table(self.step + 1, table, ["token", "context", "p", "H", "advantage"], rows)


class _MetricAccumulator:
    """Combines per-mini-batch / per-micro-batch metrics into one value per step.

    ``add_mean`` → weighted mean; ``add_sum`` → sum; ``add_mask_stats`` (any mask, under its own prefix) → counts
    (``<prefix>/num_*``) summed, fractions ``<prefix>/<X>_frac`` recomputed as ``Σ num_<X> / Σ num_response_tokens``,
    other statistics (thresholds, means) averaged over mini-batches. NaN values (e.g. τ_h of an empty candidate
    set) are skipped.
    """

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._plain: dict[str, float] = {}
        self._fracs: dict[str, None] = {}  # "<prefix>/<X>_frac" keys seen, in order

    def add_mean(self, key: str, value: float, weight: float = 1.0) -> None:
        if isinstance(value, float) and math.isnan(value):
            return
        self._sum[key] = self._sum.get(key, 0.0) + value * weight
        self._weight[key] = self._weight.get(key, 0.0) + weight

    def add_sum(self, key: str, value: float) -> None:
        self._plain[key] = self._plain.get(key, 0.0) + value

    def add_mask_stats(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            leaf = k.rsplit("/", 1)[-1]
            if leaf.startswith("num_"):
                self.add_sum(k, v)
            elif leaf.endswith("_frac"):  # recomputed from the summed counts in result()
                self._fracs[k] = None
            else:
                self.add_mean(k, v)

    def all_reduce(self, keys: tuple[str, ...], ctx: "dist.DistContext") -> None:
        """Sum the weighted sums and weights of ``keys`` over the data-parallel ranks (collective; every rank
        passes the same keys, absent ones count 0), so their means are over every rank's contributions."""
        flat = {f"{k}\0{part}": (self._sum if part == "s" else self._weight).get(k, 0.0) for k in keys for part in "sw"}
        red = dist.all_reduce(flat, ctx)
        for k in keys:
            if red[f"{k}\0w"] > 0:
                self._sum[k], self._weight[k] = red[f"{k}\0s"], red[f"{k}\0w"]

    def result(self) -> dict[str, float]:
        out = {k: self._sum[k] / self._weight[k] for k in self._sum if self._weight[k] > 0}
        out.update(self._plain)
        for key in self._fracs:  # <prefix>/<X>_frac = Σ <prefix>/num_<X> / Σ <prefix>/num_response_tokens
            prefix, _, leaf = key.rpartition("/")
            total = self._plain.get(f"{prefix}/num_response_tokens")
            if total is not None:
                out[key] = self._plain.get(f"{prefix}/num_{leaf[:-len('_frac')]}", 0.0) / max(total, 1.0)
        return out
