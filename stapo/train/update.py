"""The policy update of one training step: executes an :class:`~stapo.train.plan.UpdatePlan`.

Per mini-batch (one optimizer step; docs/method.md#loss-aggregation, Algorithm 1):

    token mask over the WHOLE mini-batch (statistics from the plan's source) → kept-token denominator N of the
    whole mini-batch (all ranks) → micro-batch forward / backward of Σ_kept ℓ / N → average gradients over
    ranks → clip the grad norm → AdamW step

and one learning-rate scheduler step per training step; the gradients are freed (``set_to_none``) after the last
optimizer step. An optimizer step whose loss or gradient norm is not finite is skipped (the weights and the AdamW
moments stay as they were), counted in ``actor/nonfinite_grad_steps`` and in :attr:`PolicyUpdate.nonfinite_in_a_row`
(the trainer stops a run that cannot learn: ``trainer.stop_after_nonfinite_steps``). With the fused path
(``stats="own_forward"``) the micro-batch losses are sums (denominator 1) and the gradient is divided by N once
the mask is known — the same gradient by linearity. The mask and the denominator of the whole mini-batch are
:func:`stapo.core.minibatch.minibatch_token_mask` and :func:`stapo.core.minibatch.minibatch_loss_denominator`, the
other data-parallel pieces ``stapo.model.distributed`` helpers; each is the one-process computation when W = 1.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from stapo.core.masks import TokenMask
from stapo.core.minibatch import minibatch_loss_denominator, minibatch_token_mask
from stapo.core.objectives import Objective, policy_loss
from stapo.core.token_stats import TokenStats
from stapo.model import distributed as dist
from stapo.model.precision import PrecisionPolicy
from stapo.train.batch import Rollout
from stapo.train.metrics import MetricAccumulator
from stapo.train.plan import MiniBatchPlan, UpdatePlan
from stapo.train.policy import policy_token_stats

__all__ = ["PolicyUpdate", "UpdateResult", "Progress"]

Progress = Callable[..., None]
"""``progress(phase, n=1, **postfix)``: called once after every forward (``phase``: ``old_log_prob``, ``ref``,
``update``), and with ``n=0`` when a mini-batch is done, its ``postfix`` ``loss="0.0123"`` being the mini-batch's
policy loss as logged in ``actor/pg_loss`` (known only once the whole mini-batch is: the fused path divides by
the kept-token count at the end)."""


def _no_progress(phase: str, n: int = 1, **postfix: str) -> None:
    return None


@dataclass(frozen=True)
class UpdateResult:
    """What the update hands back to the step.

    Attributes:
        metrics: the update's metrics, reduced over ranks (``actor/*`` and the mask's ``<prefix>/*``).
        keep: [B, R] bool — the tokens that received gradient (this rank's rows).
        old: the old-policy statistics of every row, [B, R] fp32 each (the rows the plan's ``fills_old``
            mini-batch computed in its own forwards included).
    """

    metrics: dict[str, float]
    keep: torch.Tensor
    old: TokenStats


class PolicyUpdate:
    """Runs the forwards of a step (no-grad passes and the update) for one policy and optimizer.

    Args:
        model, optimizer, scheduler: the policy (possibly FSDP2-wrapped), its AdamW and the warm-up scheduler.
        objective: the resolved :class:`~stapo.core.objectives.Objective` (mask, loss formula, aggregation, β).
        precision: autocast for every policy forward (token statistics stay fp32).
        device: where forwards run.
        ctx: the data-parallel context (W = 1: no communication).
        temperature: the rollout temperature T (log-probs and entropies of logits / T).
        share_prompt: ``actor.share_prompt``.
        grad_clip: ``actor.grad_clip`` (max total grad norm).
        max_response_length: L of ``seq-mean-token-sum-norm``.
        lm_head: ``actor.lm_head`` (``logits`` | ``fused``: :func:`stapo.train.policy.policy_token_stats`).
        deferred_graphs: ``actor.deferred_graphs`` (``keep`` | ``recompute``: :meth:`_MiniBatch.backward_own_forward`).
        layout: the forwards' row layout (``padded`` | ``trailing`` | ``packed``:
        :func:`stapo.train.policy.forward_layout`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 objective: Objective, precision: PrecisionPolicy, device: torch.device, ctx: dist.DistContext, *,
                 temperature: float, share_prompt: bool, grad_clip: float, max_response_length: int,
                 lm_head: str = "logits", deferred_graphs: str = "keep", layout: str = "padded") -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.objective, self.precision, self.device, self.ctx = objective, precision, device, ctx
        self.temperature, self.share_prompt = temperature, share_prompt
        self.grad_clip, self.max_response_length = grad_clip, max_response_length
        self.lm_head, self.deferred_graphs = lm_head, deferred_graphs
        self.layout = layout
        #: optimizer steps in a row (across training steps) skipped for a non-finite loss or gradient norm; 0 after a
        #: step that was taken. The same on every rank (the norm is global, the losses all-reduced).
        self.nonfinite_in_a_row = 0
        #: the last skipped step's values (``actor/pg_loss``, ``actor/kl_loss``, ``actor/grad_norm``), for the stop line
        self.last_nonfinite: dict[str, float] = {}

    # --- forwards --------------------------------------------------------------------------------------------
    def forward(self, batch, idx: torch.Tensor, model: torch.nn.Module | None = None) -> TokenStats:
        """Rows ``idx`` ([b]) of ``batch`` through ``model`` (default: the policy; grad if enabled) →
        :class:`TokenStats`, each [b, r] fp32 (r ≤ R: the micro-batch is trimmed)."""
        with self.precision.autocast(self.device):  # bf16 matmuls when mixed; token statistics stay fp32
            return policy_token_stats(self.model if model is None else model, batch.select(idx).trim().to(self.device),
                                      self.temperature, share_prompt=self.share_prompt, lm_head=self.lm_head,
                                      layout=self.layout)

    @torch.no_grad()
    def no_grad_stats(self, model: torch.nn.Module, batch, micro: tuple[torch.Tensor, ...],
                      progress: Progress = _no_progress, phase: str = "old_log_prob") -> TokenStats:
        """No-grad token statistics of the rows in ``micro`` (micro-batches of batch rows) → each [B, R] fp32 on
        the CPU, 0 in rows not forwarded."""
        B, R = batch.response_mask.shape
        out = TokenStats(torch.zeros(B, R), torch.zeros(B, R), torch.zeros(B, R))  # [B, R] fp32 each
        for idx in micro:
            st = self.forward(batch, idx, model)  # [b, r]
            r = st.logprobs.shape[1]
            out.logprobs[idx, :r] = st.logprobs.float().cpu()  # scattered back through the same indices
            out.entropy[idx, :r] = st.entropy.float().cpu()
            out.collision[idx, :r] = st.collision.float().cpu()
            progress(phase)
        return out

    # --- the update ------------------------------------------------------------------------------------------
    def run(self, plan: UpdatePlan, rollout: Rollout, old: TokenStats, ref_logprobs: torch.Tensor | None,
            progress: Progress = _no_progress) -> UpdateResult:
        """Every mini-batch of ``plan``: mask → denominator → micro-batch forward/backward → clip → step; then the
        gradients are freed (``optimizer.zero_grad(set_to_none=True)``).

        Args:
            plan: the step's schedule.
            rollout: the scored rollout (batch, Â).
            old: old-policy statistics [B, R] for the rows of ``plan.old_pass`` (not modified: a completed copy
                is returned).
            ref_logprobs: [B, R] reference log-probs (β > 0) or None.
            progress: called after every forward.

        Raises:
            stapo.common.registry.ExtensionError: the mask broke its contract (checked once per mini-batch by
                :func:`stapo.core.masks.check_mask_result`), or the loss formula returned the wrong output.
        """
        old = TokenStats(old.logprobs.clone(), old.entropy.clone(), old.collision.clone())  # [B, R] each
        B, R = rollout.batch.response_mask.shape
        acc = MetricAccumulator()
        keep_all = torch.zeros(B, R, dtype=torch.bool)  # [B, R] kept tokens of the step
        for mb in plan.minibatches:
            self.optimizer.zero_grad(set_to_none=True)
            step = _MiniBatch(self, mb, rollout, old, ref_logprobs, acc, progress)
            tm = step.backward_own_forward() if mb.stats == "own_forward" else step.backward_precomputed()
            keep_all[mb.rows] = tm.keep
            acc.add_mask_stats(tm.stats)
            dist.average_gradients(self.model, self.ctx)  # replicate: all-reduce; FSDP2 reduce-scattered already
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            norm = dist.grad_norm_value(grad_norm)  # the global norm: the same on every rank
            acc.add_mean("actor/grad_norm", norm)
            if math.isfinite(norm) and all(math.isfinite(v) for v in step.losses.values()):
                self.optimizer.step()
                self.nonfinite_in_a_row = 0
            else:  # skip the step rather than write NaN into the weights; counted (the trainer may stop the run)
                acc.add_sum("actor/nonfinite_grad_steps", 1.0)
                self.nonfinite_in_a_row += 1
                self.last_nonfinite = {**step.losses, "actor/grad_norm": norm}
        # the gradients are freed after the last optimizer step, not kept through the sync, the rollout and the next
        # old-policy pass (4 bytes per parameter ÷ W); verl's dp_actor.update_policy ends the same way
        self.optimizer.zero_grad(set_to_none=True)
        if self.ctx.enabled:  # per-kept-token means over every rank's micro-batches
            acc.all_reduce(("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"), self.ctx)
        metrics = acc.result()
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]  # the learning rate this step used
        # One scheduler step per TRAINING step (as verl's update_actor): warm-up counts training steps, whatever
        # the number of mini-batches (optimizer steps) per training step.
        with warnings.catch_warnings():  # every optimizer step skipped so far (non-finite): torch's warning is noise
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        metrics["actor/num_kept_tokens"] = dist.all_reduce({"n": float(keep_all.sum())}, self.ctx)["n"]
        return UpdateResult(metrics=metrics, keep=keep_all, old=old)


class _MiniBatch:
    """One mini-batch of :meth:`PolicyUpdate.run` (its two paths share the micro-batch loss and backward)."""

    def __init__(self, up: PolicyUpdate, mb: MiniBatchPlan, rollout: Rollout, old: TokenStats,
                 ref_logprobs: torch.Tensor | None, acc: MetricAccumulator, progress: Progress) -> None:
        self.up, self.mb, self.rollout, self.old, self.ref = up, mb, rollout, old, ref_logprobs
        self.acc, self.progress = acc, progress
        self.response_mask = rollout.batch.response_mask.bool()  # [B, R]
        self.loss_sums: dict[str, float] = {}
        self.losses: dict[str, float] = {}  # the mini-batch's losses (every rank's shares), once known

    def backward_precomputed(self) -> TokenMask:
        """The paper's order: mask from statistics computed beforehand (the old-policy pass, or a no-grad pass
        of the current policy) → denominator of the whole mini-batch → micro-batch forward/backward."""
        up, mb, rows = self.up, self.mb, self.mb.rows
        stats = self.old
        if mb.stats == "current_pass":
            stats = up.no_grad_stats(up.model, self.rollout.batch, mb.stats_pass, self.progress, "update")
        tm = minibatch_token_mask(up.objective, stats.logprobs[rows], stats.entropy[rows],
                                  self.rollout.advantages[rows], self.response_mask[rows],
                                  device=up.ctx.comm_device)  # keep [n, R]
        denom = minibatch_loss_denominator(tm.keep, up.objective.loss_agg_mode,
                                           max_response_length=up.max_response_length,
                                           device=up.ctx.comm_device) / up.ctx.world  # N / W, before the loop
        for micro in mb.forwards:  # idx: [b] batch rows (possibly length-sorted)
            st = up.forward(self.rollout.batch, micro.rows)  # [b, r], grad
            self._backward(micro.rows, st, self._keep_of(tm.keep, micro.rows, st), denom)
        self._add_losses(dist.sum_loss_shares(self.loss_sums, up.ctx))
        return tm

    def backward_own_forward(self) -> TokenMask:
        """The fused path: the mask's statistics come from the update's own forwards.

        1. Deferred rows (those the mask may touch) are forwarded WITH grad and their graphs kept
           (``deferred_graphs="keep"``), or forwarded without grad (``"recompute"``).
        2. The other rows are forwarded and backwarded at once: their keep-mask is their response mask.
        3. The mask is built from the detached statistics of the whole mini-batch; the deferred backwards run
           (``"recompute"``: each deferred micro-batch is forwarded again with grad just before its backward).
        4. The micro-batch losses were sums (denominator 1); the gradient is divided by N once it is known.

        With ``fills_old`` (first mini-batch, π_θ = π_old) the forwards' detached statistics are the old-policy
        statistics (ratio 1, up to rounding under ``"recompute"``). Memory ≈ the activations of the deferred
        micro-batches (``"keep"``) or of one micro-batch (``"recompute"``).
        """
        up, mb, rows, old = self.up, self.mb, self.mb.rows, self.old
        B, R = self.response_mask.shape
        stat_logp, stat_ent = torch.zeros(B, R), torch.zeros(B, R)  # [B, R] fp32, this mini-batch's rows filled
        pending = []
        recompute = up.deferred_graphs == "recompute"
        for micro in mb.forwards:
            idx = micro.rows  # [b]
            with torch.no_grad() if micro.deferred and recompute else contextlib.nullcontext():
                st = up.forward(self.rollout.batch, idx)  # [b, r], grad unless recomputed later
            r = st.logprobs.shape[1]
            logp, ent = st.logprobs.detach().float().cpu(), st.entropy.detach().float().cpu()  # [b, r]
            stat_logp[idx, :r], stat_ent[idx, :r] = logp, ent
            if mb.fills_old:  # π_θ = π_old: these are the old-policy statistics
                old.logprobs[idx, :r], old.entropy[idx, :r] = logp, ent
                old.collision[idx, :r] = st.collision.detach().float().cpu()
            if micro.deferred:
                pending.append((idx, None if recompute else st))
            else:
                self._backward(idx, st, self.response_mask[idx, :r], 1.0)
        # checked inside: the rows backwarded already keep every token, as their maskable_rows rule promised
        tm = minibatch_token_mask(up.objective, stat_logp[rows], stat_ent[rows], self.rollout.advantages[rows],
                                  self.response_mask[rows], device=up.ctx.comm_device)  # keep [n, R]
        for k, (idx, st) in enumerate(pending):
            pending[k] = None  # the backward frees this graph
            if st is None:  # "recompute": this micro-batch's graph is built now
                st = up.forward(self.rollout.batch, idx)  # [b, r], grad
            self._backward(idx, st, self._keep_of(tm.keep, idx, st), 1.0)
        denom = minibatch_loss_denominator(tm.keep, up.objective.loss_agg_mode,
                                           max_response_length=up.max_response_length,
                                           device=up.ctx.comm_device) / up.ctx.world  # N / W
        for p in up.model.parameters():
            if p.grad is not None:
                p.grad.div_(denom)
        self._add_losses(dist.sum_loss_shares({k: v / denom for k, v in self.loss_sums.items()}, up.ctx))
        return tm

    def _add_losses(self, losses: dict[str, float]) -> None:
        """The mini-batch's losses (its micro-batch shares summed, all ranks) into the step's means, and its policy
        loss into the progress bar."""
        self.losses = dict(losses)
        for k, v in losses.items():
            self.acc.add_mean(k, v)
        if "actor/pg_loss" in losses:
            self.progress("update", n=0, loss=f"{losses['actor/pg_loss']:.4f}")

    def _keep_of(self, keep: torch.Tensor, idx: torch.Tensor, st: TokenStats) -> torch.Tensor:
        """Rows ``idx`` ([b] batch rows) of the mini-batch keep-mask ``keep`` ([n, R] over ``mb.rows``), cut to
        the micro-batch's r columns → [b, r] bool, in ``idx``'s order."""
        return keep[idx - int(self.mb.rows[0]), :st.logprobs.shape[1]]

    def _backward(self, idx: torch.Tensor, st: TokenStats, keep: torch.Tensor, denom: float) -> None:
        """Loss of one micro-batch (rows ``idx`` [b]; ``keep`` [b, r]) and its backward."""
        up, dev = self.up, self.up.device
        r = st.logprobs.shape[1]
        loss, m = policy_loss(
            up.objective, st.logprobs, self.old.logprobs[idx, :r].to(dev), self.rollout.advantages[idx].to(dev),
            keep.to(dev), denom, ref_logprobs=None if self.ref is None else self.ref[idx, :r].to(dev))
        loss.backward()
        for k in ("actor/pg_loss", "actor/kl_loss"):  # shares of the mini-batch loss: add up
            if k in m:
                self.loss_sums[k] = self.loss_sums.get(k, 0.0) + m[k]
        for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):  # per kept token
            self.acc.add_mean(k, m[k], weight=m["actor/num_kept_tokens"])
        self.progress("update")
