"""The step's metrics (verl names; docs/metrics.md) and the silenced-token examples table.

:func:`gather_metric_rows` collects what the metrics need for the step's WHOLE batch (all ranks),
:func:`step_metrics` computes them with the one-process code, :class:`MetricAccumulator` combines the update's
per-micro-batch / per-mini-batch values into one per step, :func:`silenced_examples` lists silenced tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from stapo.core.advantages import grpo_advantages
from stapo.core.analysis import entropy_change_estimate, logit_grad_norm, quadrant_summary
from stapo.core.masks import get_mask_spec, s2t_mask
from stapo.core.objectives import kl_k3
from stapo.core.tensor_utils import masked_mean
from stapo.model import distributed as dist
from stapo.train.probes import first_k_entropy

__all__ = ["MetricAccumulator", "MetricRows", "gather_metric_rows", "step_metrics", "silenced_examples"]


class MetricAccumulator:
    """Combines per-mini-batch / per-micro-batch metrics into one value per step.

    ``add_mean`` → weighted mean; ``add_sum`` → sum; ``add_mask_stats`` (any mask, under its own prefix) → counts
    (``<prefix>/num_*``) summed, fractions ``<prefix>/<X>_frac`` recomputed as ``Σ num_<X> / Σ num_response_tokens``
    when the mask reports both counts (else averaged like the rest), other statistics (thresholds, means) averaged
    over mini-batches. NaN values (e.g. τ_h of an empty candidate set) are skipped.

    Example: ``add_mean("k", 1.0, weight=3); add_mean("k", 2.0, weight=1)`` → ``result()["k"] == 1.25``.
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
            elif leaf.endswith("_frac"):  # recomputed from the summed counts in result(), when both are reported
                self._fracs[k] = None
                self.add_mean(k, v)
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
            count = self._plain.get(f"{prefix}/num_{leaf[:-len('_frac')]}")
            if total is not None and count is not None:
                out[key] = count / max(total, 1.0)
        return out


@dataclass(frozen=True)
class MetricRows:
    """The step's whole batch (rank-major rows when W > 1), for the metrics.

    Attributes:
        mask: [B, R] bool response tokens.
        rewards, advantages, truncated: [B] fp32 (truncated: 1 where the response hit the length budget).
        old_logprobs, old_entropy, old_collision: [B, R] fp32 old-policy statistics.
        engine_logprobs: [B, R] fp32 the rollout engine's log-probs, NaN where it reported none.
        ref_logprobs: [B, R] fp32 reference-policy log-probs (a reference is loaded: β > 0 or
            ``algorithm.log_kl_to_ref``), else None.
    """

    mask: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    truncated: torch.Tensor
    old_logprobs: torch.Tensor
    old_entropy: torch.Tensor
    old_collision: torch.Tensor
    engine_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None


def gather_metric_rows(sb, ctx: "dist.DistContext") -> MetricRows:
    """:class:`MetricRows` of a :class:`~stapo.train.batch.StepBatch`, all-gathered over the ranks.
    Communication (W > 1): one all-gather of 4 · (3 + 5R) bytes per row."""
    ro = sb.rollout
    mask = ro.batch.response_mask.bool()  # [B, R]
    engine = torch.full(mask.shape, float("nan"))  # [B, R]
    for i, r in enumerate(ro.responses):
        if r.engine_logprobs:
            n = min(len(r.engine_logprobs), int(mask[i].sum()))
            engine[i, :n] = torch.tensor(r.engine_logprobs[:n], dtype=torch.float32)
    truncated = torch.tensor([r.finish_reason == "length" for r in ro.responses], dtype=torch.float32)
    per_row = {"rewards": ro.rewards, "advantages": ro.advantages, "truncated": truncated}
    per_tok = {"mask": mask.float(), "old_logprobs": sb.old.logprobs, "old_entropy": sb.old.entropy,
               "old_collision": sb.old.collision, "engine_logprobs": engine}
    if sb.ref_logprobs is not None:  # every rank has it or none does (the reference is loaded on all)
        per_tok["ref_logprobs"] = sb.ref_logprobs
    rows, toks = dist.all_gather_rows(per_row, per_tok, ctx)
    full_mask = toks["mask"] > 0.5
    return MetricRows(mask=full_mask, rewards=rows["rewards"], advantages=rows["advantages"],
                      truncated=rows["truncated"], old_logprobs=toks["old_logprobs"],
                      old_entropy=toks["old_entropy"], old_collision=toks["old_collision"],
                      engine_logprobs=torch.where(full_mask, toks["engine_logprobs"], torch.tensor(float("nan"))),
                      ref_logprobs=toks.get("ref_logprobs"))


def step_metrics(v: MetricRows, cfg, extra: dict[str, float]) -> dict[str, float]:
    """The step's metrics from the whole batch ``v``; ``extra`` (reward counts, the update's rank-reduced
    metrics, data counts) is inserted after the advantage metrics. ``cfg``: the :class:`~stapo.config.TrainConfig`
    (G, advantage settings, T, τ_p). Keys and units: docs/metrics.md."""
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
    alg = cfg.algorithm  # advantage metrics of the whole batch (groups are whole on every rank)
    m.update(grpo_advantages(v.rewards, cfg.rollout.n, eps=alg.adv_eps, norm_by_std=alg.norm_adv_by_std).metrics)
    mc = getattr(cfg, "mechanism", None)
    if mc is not None and mc.enabled and mc.first_k:  # docs/metrics.md#mechanism-measurements-mechanism-probe
        m["actor/entropy_first_k"] = first_k_entropy(v.old_entropy, mask, mc.first_k)
    if v.ref_logprobs is not None:  # the rollout policy's k3 KL to the reference (a diagnostic; in the loss only β > 0)
        m["actor/kl_to_ref"] = masked_mean(kl_k3(v.old_logprobs, v.ref_logprobs), mask).item()
    m.update(extra)
    # train/inference mismatch: engine log-probs vs the trainer's recomputation (old policy)
    reported = ~torch.isnan(v.engine_logprobs)  # [B, R]
    if bool(reported.any()):
        d = (v.engine_logprobs - v.old_logprobs)[reported].abs()  # row-major
        m["rollout/logprob_diff_mean"] = d.mean().item()
        m["rollout/logprob_diff_max"] = d.max().item()
    # docs/method.md#token-analysis at the old policy (ρ = 1 → w = Â): quadrant summary of Â > 0 tokens
    gnorm = logit_grad_norm(v.old_logprobs, v.old_collision, adv_tok, temperature=cfg.rollout.temperature)
    dh = entropy_change_estimate(v.old_logprobs, v.old_entropy, adv_tok)
    q = quadrant_summary(v.old_logprobs, v.old_entropy, adv_tok, mask, grad_norm=gnorm, entropy_change=dh,
                         prob_threshold=alg.s2t.prob_threshold)
    m.update({f"s2t/{k}": val for k, val in q.items()})
    # what S2T would silence on this batch at the old policy, for every objective (STAPO's own mask with one
    # mini-batch per step gives the same numbers under actor/s2t/*): the paper's C1 (rarity) for the baselines too
    s2t = alg.s2t
    would = s2t_mask(v.old_logprobs, v.old_entropy, v.advantages, mask, prob_threshold=s2t.prob_threshold,
                     entropy_quantile=s2t.entropy_quantile, quantile_scope=s2t.quantile_scope)
    for stat in ("num_candidates", "num_masked", "masked_frac"):
        m[f"s2t/would_mask/{stat}"] = float(would.stats[stat])
    return m


def silenced_examples(sb, tokenizer: Any, token_mask: str, s2t_cfg: Any, max_rows: int = 20, context: int = 6
                      ) -> tuple[str, list[str], list[list[Any]]]:
    """A table of silenced tokens: the mask's own (S2T, or any mask registered with ``silences=True``, under its
    prefix) or, for the other objectives, those S2T *would* silence at the old policy.

    Returns:
        ``(table key, columns, rows)`` — columns token, context (the ``context`` preceding tokens), p, H,
        advantage; at most ``max_rows`` rows, row-major order.
    """
    ro = sb.rollout
    mask = ro.batch.response_mask.bool()  # [B, R]
    spec = get_mask_spec(token_mask)
    if spec.silences:  # S2T and masks like it: the tokens it silenced
        silenced = mask & ~sb.keep
    else:
        tm = s2t_mask(sb.old.logprobs, sb.old.entropy, ro.advantages, mask, prob_threshold=s2t_cfg.prob_threshold,
                      entropy_quantile=s2t_cfg.entropy_quantile, quantile_scope=s2t_cfg.quantile_scope)
        silenced = mask & ~tm.keep
    rows = []
    for b, t in silenced.nonzero().tolist()[:max_rows]:
        ids = ro.batch.response_ids[b]
        rows.append([tokenizer.decode([int(ids[t])]), tokenizer.decode(ids[max(0, t - context):t].tolist()),
                     math.exp(sb.old.logprobs[b, t].item()), sb.old.entropy[b, t].item(), ro.advantages[b].item()])
    table = f"{spec.prefix}/examples" if spec.silences else "s2t/examples"
    return table, ["token", "context", "p", "H", "advantage"], rows
