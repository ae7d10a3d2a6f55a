"""The run's resumable state: writing a step's checkpoint and resuming from the latest one (:mod:`stapo.checkpoint`).

A checkpoint holds the policy and AdamW state (``dcp/``, sharded, re-shardable to another rank count or strategy),
an HF export in the compute dtype (for evaluation) and ``trainer_state.pt``: the scheduler, the prompt loader's
position, every rank's RNG state, the step and the config.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stapo import distributed as dist
from stapo.checkpoint import (DCP_DIR, CheckpointError, is_sharded, latest_checkpoint, load_trainer_state,
                              rng_state, save_checkpoint, set_rng_state)
from stapo.config import to_dict

__all__ = ["RunState"]


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
        """Write step ``step``'s checkpoint (:func:`stapo.checkpoint.save_checkpoint`; collective under torchrun:
        every rank writes its model/optimizer shards, rank 0 the HF export and the trainer state). Every rank
        returns the folder once it is complete; older ones beyond ``trainer.keep_last`` are removed."""
        rngs = dist.gather_objects(rng_state(), self.ctx)
        state = {"scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(), "rng": rngs[0],
                 "config": to_dict(self.cfg)}
        if self.ctx.enabled:
            state["rng_per_rank"] = rngs
        return save_checkpoint(self.root, step, self.model, self.tokenizer, state, optimizer=self.optimizer,
                               keep_last=self.cfg.trainer.keep_last, export_dtype=self.export_dtype, ctx=self.ctx)

    def resume(self) -> tuple[Path, int] | None:
        """Restore the latest complete checkpoint, if any (every rank) → ``(folder, its step)``, or None.

        Model + optimizer from ``dcp/``, re-sharded to this run's ranks and strategy (checkpoints of the previous
        format: weights from the HF files, the full optimizer state from ``trainer_state.pt``); then scheduler,
        prompt loader and RNG (this rank's when the rank count is unchanged, else rank 0's).

        Raises:
            stapo.checkpoint.CheckpointError: a torn, damaged or foreign checkpoint (naming the folder).
        """
        ckpt = self.latest()
        if ckpt is None:
            return None
        try:
            if is_sharded(ckpt):
                state = load_trainer_state(ckpt)
                dist.load_sharded_state(self.model, self.optimizer, ckpt / DCP_DIR)  # collective under torchrun
            else:
                state = load_trainer_state(ckpt, mmap=self.ctx.enabled)  # every rank reads it (W > 1: mmap)
                self._load_full_checkpoint(ckpt, state)
        except (ValueError, OSError, RuntimeError, EOFError, KeyError) as e:  # torn / damaged / foreign files
            msg = " ".join(str(e).split())
            raise CheckpointError(f"cannot resume from {ckpt}: {msg[:600]} — move that folder out of "
                                  f"{self.root} to resume from the previous checkpoint") from e
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        per_rank = state.get("rng_per_rank")
        set_rng_state(per_rank[self.ctx.rank] if per_rank and len(per_rank) == self.ctx.world else state["rng"])
        return ckpt, int(state["step"])

    def _load_full_checkpoint(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Previous checkpoint format: weights from the HF files, ``state["optimizer"]`` the full optimizer state."""
        from stapo.models import load_policy

        model_sd: dict[str, torch.Tensor] = {}
        if self.ctx.is_main or self.ctx.strategy != "fsdp2":  # FSDP2: rank 0 loads, the shards are broadcast
            model, _ = load_policy(str(ckpt), dtype=self.param_dtype,
                                   attn_implementation=self.cfg.model.attn_implementation)
            model_sd = model.state_dict()
            del model
        dist.load_full_state(self.model, self.optimizer, model_sd, state["optimizer"], self.ctx)
