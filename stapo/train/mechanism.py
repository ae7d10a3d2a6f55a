"""The trainer's mechanism measurements: config section ``mechanism``, metrics in
docs/metrics.md#mechanism-measurements-mechanism-probe.

:class:`MechanismHook` runs inside :meth:`stapo.train.trainer.Trainer.train_step` between the old-policy pass and the
update, at θ_t (the weights the step's rollouts came from) with the optimizer state before the step, and returns
metrics; the formulas are in :mod:`stapo.train.probes`. Per measured step:

* ``probe/entropy`` (every ``mechanism.probe_every`` steps): H_probe(θ_t), one no-grad pass over the probe set.
* attribution (every ``mechanism.attribution_every``): ∇_θ H_probe(θ_t) (one forward + backward of the probe set),
  then per mini-batch of the step's plan — the run's token mask and loss denominator from the old-policy statistics,
  S2T's groups (:func:`stapo.train.probes.token_groups`), one forward of its rows with grad and one backward per token
  group present in each micro-batch (:func:`stapo.train.probes.weighted_token_gradients`), AdamW linearised from the
  pre-step state with that mini-batch's whole gradient (:class:`stapo.train.probes.AdamWLinearisation`). Each
  mini-batch is linearised as if it were the step's first optimizer step (exact for one mini-batch per step; for
  more, the interactions between the step's optimizer steps — ρ ≠ 1, clipping, momentum carried over — are second
  order in the learning rate and are what the counterfactual measures in full). The parts are summed over the
  mini-batches.
* counterfactual (every ``mechanism.counterfactual_every``): a copy of the policy and of the optimizer state, the
  step's whole update (:class:`stapo.train.update.PolicyUpdate`, the same plan, batch, old statistics and learning
  rate) with the run's recipe plus the S2T mask, then — reloaded to θ_t and the same optimizer state — without a
  token mask, the probe entropy after each. Both arms follow one plan (built for S2T); when S2T silences nothing the
  unmasked arm is the same update, so it is not run and δ is exactly 0.

The real run is not disturbed: its weights, gradients, optimizer state, learning-rate scheduler and updater are only
read (the arms work on copies), the model's train/eval mode and the Python, NumPy and torch random states are
restored afterwards (tests/test_mechanism.py compares runs with the measurements on and off bit for bit).
"""
from __future__ import annotations

import copy
import functools
import inspect
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from stapo.config import ConfigError
from stapo.core.masks import get_mask_spec
from stapo.core.objectives import compute_token_mask, get_policy_loss, kl_k3, loss_denominator
from stapo.core.token_stats import TokenStats
from stapo.train.policy import policy_token_stats
from stapo.train.probes import (
    GROUPS,
    AdamWLinearisation,
    ProbeSetError,
    probe_batch,
    probe_digest,
    probe_entropy,
    read_probe_set,
    shares,
    token_groups,
    token_weights,
    weighted_token_gradients,
    write_probe_set,
)
from stapo.train.update import PolicyUpdate

__all__ = ["MechanismHook", "PROBE_COPY"]

#: The run's copy of its probe set (written at the first measured step; compared on resume).
PROBE_COPY = "mechanism_probe.jsonl"


class _FixedLR:
    """The scheduler a counterfactual arm's :class:`~stapo.train.update.PolicyUpdate` steps: the learning rate the
    real step uses, unchanged (the real scheduler is never stepped by the hook)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def step(self) -> None:
        return None


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _due(step: int, every: int) -> bool:
    """Measured at the 0-based step ``step`` (logged as step + 1): steps 1, 1 + N, 1 + 2N, ... (N = 0: never)."""
    return every > 0 and step % every == 0


class MechanismHook:
    """The ``mechanism`` measurements of one trainer (module docstring). Built by the trainer when
    ``mechanism.enabled``; :meth:`measure` is called once per step.

    Args:
        trainer: the :class:`~stapo.train.trainer.Trainer` (its model, optimizer, updater, config and run folder are
            read).

    Raises:
        stapo.config.ConfigError: a probe measurement under torchrun (W > 1), an unreadable or invalid probe set
            (naming ``mechanism.probe_file``, the file and line), or a resumed run whose probe set changed.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        mc = self.mc = trainer.cfg.mechanism
        self.micro = mc.micro_batch_size or trainer.cfg.actor.ppo_micro_batch_size
        self.rows = None
        self.batch = None
        if not (mc.probe_every or mc.attribution_every or mc.counterfactual_every):
            return
        if trainer.dist.enabled:
            raise ConfigError("invalid value for 'mechanism.enabled' (True): the probe, attribution and "
                              "counterfactual measurements run in one process, not under torchrun; set "
                              "mechanism.probe_every, mechanism.attribution_every and mechanism.counterfactual_every "
                              "to 0 (actor/entropy_first_k works on every rank count)")
        emb = trainer.model.get_input_embeddings()
        vocab = getattr(emb, "num_embeddings", None)
        try:
            self.rows = read_probe_set(mc.probe_file, trainer.tokenizer, vocab_size=vocab)
        except ProbeSetError as e:
            raise ConfigError(f"invalid value for 'mechanism.probe_file' ({mc.probe_file}): {e}") from None
        self.digest = probe_digest(self.rows)
        copy_path = Path(trainer.run_dir) / PROBE_COPY
        self._resuming = getattr(trainer, "resume_plan", None) is not None  # a fresh run rewrites a stale copy
        if self._resuming and copy_path.is_file():  # a resumed run measures on the probe set it started with
            try:
                recorded = probe_digest(read_probe_set(copy_path))
            except ProbeSetError as e:
                raise ConfigError(f"invalid value for 'mechanism.probe_file' ({mc.probe_file}): the run's copy of "
                                  f"its probe set is unreadable: {e}") from None
            if recorded != self.digest:
                raise ConfigError(f"invalid value for 'mechanism.probe_file' ({mc.probe_file}): its token ids differ "
                                  f"from the probe set this run started with ({copy_path}); a run's probe set is "
                                  f"fixed: point mechanism.probe_file at that copy or start a new run")
        pad = trainer.tokenizer.pad_token_id
        self.batch = probe_batch(self.rows, 0 if pad is None else int(pad))

    # --- the step -----------------------------------------------------------------------------------------------
    def measure(self, step: int, rollout: Any, plan: Any, old: TokenStats, ref: torch.Tensor | None,
                plan_for: Callable[[str], Any] | None = None) -> dict[str, float]:
        """The measurements due at the 0-based ``step``, at θ_t before the step's update → metrics (empty when none
        is due).

        Args:
            step: the trainer's ``step`` counter (0-based; the metrics row is step + 1).
            rollout: the step's :class:`~stapo.train.batch.Rollout`.
            plan: the step's :class:`~stapo.train.plan.UpdatePlan`.
            old: the old-policy statistics from the plan's old pass ([B, R] each; rows the update fills are 0).
            ref: [B, R] reference log-probs (β > 0) or None.
            plan_for: ``fn(token_mask) -> UpdatePlan``, the step's plan for another token mask (the counterfactual
                follows the plan for ``"s2t"``); None: ``plan`` itself.
        """
        mc = self.mc
        probe, attr, cf = (_due(step, mc.probe_every), _due(step, mc.attribution_every),
                           _due(step, mc.counterfactual_every))
        if self.rows is None or not (probe or attr or cf):
            return {}
        tr = self.trainer
        self._record_probe_set()
        rng, training = _rng_state(), tr.model.training
        out: dict[str, float] = {}
        try:
            tr.model.eval()
            if attr:
                h0, metrics = self._attribution(rollout, plan, old, ref)
                out.update(metrics)
            else:
                h0 = probe_entropy(functools.partial(self._stats, tr.model), self.batch, self.micro).value
            if probe or attr:
                out["probe/entropy"] = h0
            if cf:
                s2t_plan = plan_for("s2t") if plan_for is not None else plan
                out.update(self._counterfactual(rollout, s2t_plan, old, ref, h0))
        finally:
            tr.model.train(training)
            _set_rng_state(rng)
        return out

    # --- pieces ------------------------------------------------------------------------------------------------
    def _record_probe_set(self) -> None:
        """Write the run's copy of the probe set (once per launch, when a fresh run starts or a resumed run has
        none; the run folder exists by the first step)."""
        path = Path(self.trainer.run_dir) / PROBE_COPY
        if not self._resuming or not path.is_file():
            write_probe_set(path, self.rows)
            self._resuming = True

    def _stats(self, model: torch.nn.Module, batch: Any, idx: torch.Tensor, entropy_grad: bool) -> TokenStats:
        """Rows ``idx`` of ``batch`` through ``model`` as the update's forwards run (precision, temperature, LM head,
        layout) → :class:`TokenStats` [b, r] fp32; the entropy differentiable with ``entropy_grad``."""
        up = self.trainer.updater
        with up.precision.autocast(up.device):
            return policy_token_stats(model, batch.select(idx).trim().to(up.device), up.temperature,
                                      entropy_grad=entropy_grad, share_prompt=up.share_prompt, lm_head=up.lm_head,
                                      layout=up.layout)

    def _complete_old(self, rollout: Any, plan: Any, old: TokenStats) -> TokenStats:
        """``old`` with the rows the plan leaves to the update's own forwards (``actor.fused_forward``'s first
        mini-batch) computed here by one no-grad pass at θ_t (= π_old). A copy; ``old`` is not changed."""
        B = rollout.batch.response_mask.shape[0]
        covered = torch.zeros(B, dtype=torch.bool)
        for idx in plan.old_pass:
            covered[idx] = True
        missing = (~covered).nonzero().squeeze(1)  # [m]
        if missing.numel() == 0:
            return old
        micro = tuple(missing[i:i + self.micro] for i in range(0, missing.numel(), self.micro))
        fill = self.trainer.updater.no_grad_stats(self.trainer.model, rollout.batch, micro)
        out = TokenStats(old.logprobs.clone(), old.entropy.clone(), old.collision.clone())
        out.logprobs[missing], out.entropy[missing] = fill.logprobs[missing], fill.entropy[missing]
        out.collision[missing] = fill.collision[missing]
        return out

    def _token_losses(self, rollout: Any, old: TokenStats, ref: torch.Tensor | None, keep: torch.Tensor,
                      idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token losses of rows ``idx`` at θ_t with a graph: ``pg`` — the run's loss formula (ρ = 1 up to
        rounding), ``kl`` — k3 to the reference (β > 0)."""
        obj = self.trainer.objective
        st = self._stats(self.trainer.model, rollout.batch, idx, False)  # [b, r]
        r, dev = st.logprobs.shape[1], st.logprobs.device
        pg, _ = get_policy_loss(obj.policy_loss)(st.logprobs, old.logprobs[idx, :r].to(dev),
                                                 rollout.advantages[idx].to(dev), keep[idx, :r].to(dev), obj)
        out = {"pg": pg}
        if obj.kl_coef > 0 and ref is not None:
            out["kl"] = kl_k3(st.logprobs, ref[idx, :r].to(dev))
        return out

    def _attribution(self, rollout: Any, plan: Any, old: TokenStats, ref: torch.Tensor | None
                     ) -> tuple[float, dict[str, float]]:
        """H_probe(θ_t) and the ``mechanism/dH_probe/*``, ``mechanism/abs_share/*``, ``mechanism/token_share/*`` and
        ``mechanism/num_tokens/*`` metrics (module docstring; docs/metrics.md)."""
        tr = self.trainer
        obj, s2t, mode = tr.objective, tr.cfg.algorithm.s2t, tr.objective.loss_agg_mode
        L = tr.cfg.rollout.response_length
        params = [p for p in tr.model.parameters() if p.requires_grad]
        with torch.enable_grad():
            probe = probe_entropy(functools.partial(self._stats, tr.model), self.batch, self.micro, params=params)
        h = probe.grad
        old = self._complete_old(rollout, plan, old)
        mask = rollout.batch.response_mask.bool()  # [B, R]
        adv = rollout.advantages  # [B]
        B, R = mask.shape
        dh: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        beta = obj.kl_coef if ref is not None else 0.0
        for mb in plan.minibatches:
            rows = mb.rows  # [n]
            lp, ent, a, m = old.logprobs[rows], old.entropy[rows], adv[rows], mask[rows]
            keep_mb = compute_token_mask(obj, lp, ent, a, m).keep  # [n, R] the run's mask at θ_t
            w_run = token_weights(keep_mb, mode, loss_denominator(keep_mb, mode, max_response_length=L))
            w_unmasked = token_weights(m, mode, loss_denominator(m, mode, max_response_length=L))
            groups = token_groups(lp, ent, a, m, prob_threshold=s2t.prob_threshold,
                                  entropy_quantile=s2t.entropy_quantile, quantile_scope=s2t.quantile_scope)
            for name, sel in groups.items():
                counts[name] += int(sel.sum())
            zero = torch.zeros(())
            parts = {g: torch.where(groups[g] & keep_mb, w_run, zero) for g in GROUPS}
            parts["silenced_would"] = torch.where(groups["silenced"] & ~keep_mb, w_unmasked, zero)
            if beta > 0:
                parts["kl"] = beta * w_run
            weights = {}
            for key, w in parts.items():
                full = torch.zeros(B, R)
                full[rows] = w
                weights[key] = ("kl" if key == "kl" else "pg", full)
            keep = torch.zeros(B, R, dtype=torch.bool)
            keep[rows] = keep_mb
            micro = [rows[i:i + tr.cfg.actor.ppo_micro_batch_size]
                     for i in range(0, rows.numel(), tr.cfg.actor.ppo_micro_batch_size)]
            with torch.enable_grad():
                grads = weighted_token_gradients(functools.partial(self._token_losses, rollout, old, ref, keep),
                                                 micro, weights, params)
            grads = {k: g for k, g in grads.items() if g is not None}  # keys with no token here weigh 0
            in_update = [k for k in grads if k != "silenced_would"]
            whole = [torch.zeros_like(p) for p in params]  # the run's gradient
            for key in in_update:
                for acc, g in zip(whole, grads[key]):
                    acc.add_(g)
            lin = AdamWLinearisation(params, tr.optimizer, whole, tr.cfg.actor.grad_clip)
            for key, g in grads.items():
                dh[key] += lin.dH(h, g)
            dh["momentum"] += lin.momentum_dH(h)
            dh["weight_decay"] += lin.weight_decay_dH(h)
            del grads, whole, lin
        group_dh = {g: dh[g] + (dh["silenced_would"] if g == "silenced" else 0.0) for g in GROUPS}
        update = sum(dh[g] for g in GROUPS) + dh["kl"]
        out = {f"mechanism/dH_probe/{g}": v for g, v in group_dh.items()}
        out.update({"mechanism/dH_probe/update": update, "mechanism/dH_probe/momentum": dh["momentum"],
                    "mechanism/dH_probe/weight_decay": dh["weight_decay"],
                    "mechanism/dH_probe/step": update + dh["momentum"] + dh["weight_decay"]})
        if beta > 0:
            out["mechanism/dH_probe/kl"] = dh["kl"]
        out.update({f"mechanism/abs_share/{g}": v for g, v in shares(group_dh).items()})
        moving = sum(counts[g] for g in GROUPS)  # response tokens with Â ≠ 0
        out.update({f"mechanism/token_share/{g}": counts[g] / moving if moving else float("nan") for g in GROUPS})
        out.update({f"mechanism/num_tokens/{g}": float(counts[g]) for g in (*GROUPS, "adv_zero")})
        return probe.value, out

    def _optimizer_copy(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """A new optimizer of the real one's class and settings on ``model``'s parameters, holding a deep copy of the
        real one's state (the real one is not touched)."""
        real = self.trainer.optimizer
        accepted = inspect.signature(type(real).__init__).parameters
        opt = type(real)(model.parameters(), **{k: v for k, v in real.defaults.items() if k in accepted})
        opt.load_state_dict(copy.deepcopy(real.state_dict()))
        return opt

    def _counterfactual(self, rollout: Any, plan: Any, old: TokenStats, ref: torch.Tensor | None,
                        h0: float) -> dict[str, float]:
        """The step's update with the S2T mask and with none, from θ_t and the same optimizer state, on a copy of
        the policy → ``mechanism/counterfactual/*`` (docs/metrics.md)."""
        tr = self.trainer
        s2t = tr.cfg.algorithm.s2t
        params = get_mask_spec("s2t").check_params({"prob_threshold": s2t.prob_threshold,
                                                    "entropy_quantile": s2t.entropy_quantile,
                                                    "quantile_scope": s2t.quantile_scope})
        arms = (("s2t", tr.objective.replace(token_mask="s2t", mask_params=params)),
                ("unmasked", tr.objective.replace(token_mask="none", mask_params={})))
        up = tr.updater
        scratch = copy.deepcopy(tr.model)
        dH: dict[str, float] = {}
        silenced = 0.0
        try:
            for name, obj in arms:
                scratch.load_state_dict(tr.model.state_dict())  # θ_t (the real model is not updated yet)
                opt = self._optimizer_copy(scratch)
                arm = PolicyUpdate(scratch, opt, _FixedLR(opt), obj, up.precision, up.device, up.ctx,
                                   temperature=up.temperature, share_prompt=up.share_prompt, grad_clip=up.grad_clip,
                                   max_response_length=up.max_response_length, lm_head=up.lm_head,
                                   deferred_graphs=up.deferred_graphs, layout=up.layout)
                scratch.train()
                with torch.enable_grad():
                    result = arm.run(plan, rollout, old, ref)
                scratch.eval()
                h1 = probe_entropy(functools.partial(self._stats, scratch), self.batch, self.micro).value
                dH[name] = h1 - h0
                del opt, arm
                if name == "s2t":
                    silenced = float(result.metrics.get("actor/s2t/num_masked", 0.0))
                    if silenced == 0:  # an empty mask in every mini-batch: the unmasked arm is the same update
                        dH["unmasked"] = dH["s2t"]  # (δ = 0 exactly, not a float-rounding difference of two paths)
                        break
                del result
        finally:
            del scratch
        out = {"mechanism/counterfactual/dH_s2t": dH["s2t"], "mechanism/counterfactual/dH_unmasked": dH["unmasked"],
               "mechanism/counterfactual/delta": dH["s2t"] - dH["unmasked"],
               "mechanism/counterfactual/num_silenced": silenced}
        if silenced >= 1:
            out["mechanism/counterfactual/delta_masked"] = out["mechanism/counterfactual/delta"]
        return out
