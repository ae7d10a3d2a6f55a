"""Policy objectives: clipped surrogate, k3 KL, loss aggregation and the registry of named objectives.

Each named objective is a small declarative :class:`Objective` (aggregation, clip, β, token mask):

| name          | aggregation         | ε low, high | dual c | β (KL) | token mask  | source                         |
|---------------|---------------------|-------------|--------|--------|-------------|--------------------------------|
| ``grpo``      | seq-mean-token-mean | 0.2, 0.2    | none   | 0.04   | none        | docs/method.md#grpo-baseline   |
| ``justrl``    | token-mean          | 0.2, 0.28   | 10     | 0      | none        | docs/method.md#justrl          |
| ``entropy20`` | token-mean          | 0.2, 0.28   | 10     | 0      | top_entropy | docs/method.md#20-entropy      |
| ``stapo``     | token-mean          | 0.2, 0.28   | 10     | 0      | s2t         | docs/method.md#stapo-objective |

Ablations of S2T (JustRL settings; masks in :mod:`stapo.core.masks`): ``stapo_high_entropy`` (mask
``s2t_high_entropy``), ``stapo_random`` (``s2t_random``), ``justrl_fullmask`` (``full_low_prob``).

A new objective is one :func:`register_objective` call; a new per-token loss formula is one function decorated with
:func:`register_policy_loss` and named in ``Objective.policy_loss``; a new mask is one function decorated with
:func:`stapo.core.masks.register_token_mask`. train.py reaches all three through :func:`build_objective`.

The loss of one optimizer mini-batch is accumulated over micro-batches. Its denominator is a property of
the WHOLE mini-batch and is computed once, before the micro-batch loop, by :func:`loss_denominator`;
:func:`policy_loss` then returns each micro-batch's share, so the shares add up to the mini-batch loss
(e.g. micro-batch A = 4 tokens of loss 1, B = 1 token of loss 5 → (4 + 5) / 5 = 1.8, not (1 + 5) / 2 = 3).

Typical use in a trainer::

    obj = get_objective("stapo")
    tm = compute_token_mask(obj, logprobs_mb, entropy_mb, adv_mb, response_mask_mb)   # whole mini-batch
    denom = loss_denominator(tm.keep, obj.loss_agg_mode)                               # once, visibly
    for micro in micro_batches:
        loss, metrics = policy_loss(obj, logp[micro], old_logp[micro], adv[micro], tm.keep[micro], denom)
        loss.backward()
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, NamedTuple, get_args

import torch

from stapo.common.registry import ExtensionError, add_entry, lookup
from stapo.core.masks import (
    PROB_THRESHOLD,
    TOP_ENTROPY_RATIO,
    S2TParams,
    TokenMask,
    check_mask_result,
    get_mask_spec,
    get_token_mask,
)
from stapo.core.metric_names import mask_stat_key
from stapo.core.tensor_utils import as_bool_mask, check_same_shape, masked_mean

__all__ = [
    "LossAggMode",
    "Objective",
    "OBJECTIVES",
    "register_objective",
    "get_objective",
    "build_objective",
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss",
    "clipped_surrogate",
    "kl_k3",
    "KeptCounts",
    "loss_denominator",
    "aggregate_loss",
    "compute_token_mask",
    "policy_loss",
    "objective_loss",
]

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

# verl clamps the log-ratio before exp to keep ρ finite (core_algos.compute_policy_loss).
_LOG_RATIO_CLAMP = 20.0
# verl's "low_var_kl" clamps the k3 estimate to [-10, 10].
_KL_CLAMP = 10.0


@dataclass(frozen=True)
class Objective:
    """A named policy objective.

    Attributes:
        name: registry key.
        loss_agg_mode: how per-token losses become one number (see :func:`loss_denominator`).
        clip_ratio_low: ε_low, ρ is clipped below at 1 − ε_low.
        clip_ratio_high: ε_high, ρ is clipped above at 1 + ε_high (clip-higher when > ε_low).
        clip_ratio_c: dual-clip constant c for Â < 0 (the token loss is capped at −c·Â); None disables.
        kl_coef: β of the k3 KL penalty to a frozen reference policy; 0 disables (no reference model).
        token_mask: key of :data:`stapo.core.masks.MASKS` (``none``, ``s2t``, ``top_entropy``, the S2T ablations...).
        mask_params: keyword arguments for the token mask (e.g. ``prob_threshold``, ``entropy_quantile``).
        policy_loss: key of :data:`POLICY_LOSSES`, the per-token loss formula (default: the clipped surrogate).
    """

    name: str
    loss_agg_mode: LossAggMode
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    kl_coef: float
    token_mask: str
    mask_params: dict[str, Any] = field(default_factory=dict)
    policy_loss: str = "clipped_surrogate"

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"objective {self.name!r}: loss_agg_mode must be one of {LOSS_AGG_MODES}, "
                             f"got {self.loss_agg_mode!r}")
        if not (0.0 <= self.clip_ratio_low < 1.0) or self.clip_ratio_high < 0.0:
            raise ValueError(f"objective {self.name!r}: need 0 ≤ clip_ratio_low < 1 and clip_ratio_high ≥ 0, got "
                             f"{self.clip_ratio_low}, {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"objective {self.name!r}: dual-clip constant clip_ratio_c must be > 1, "
                             f"got {self.clip_ratio_c}")
        if self.kl_coef < 0.0:
            raise ValueError(f"objective {self.name!r}: kl_coef must be ≥ 0, got {self.kl_coef}")
        get_token_mask(self.token_mask)  # raises KeyError listing the valid names
        get_policy_loss(self.policy_loss)

    def replace(self, **changes: Any) -> "Objective":
        """A copy with some fields changed (e.g. from a config), re-validated."""
        return dataclasses.replace(self, **changes)


OBJECTIVES: dict[str, Objective] = {}


def register_objective(objective: Objective) -> Objective:
    """Add ``objective`` to :data:`OBJECTIVES` under its name. Raises ``ValueError`` on a duplicate name."""
    return add_entry(OBJECTIVES, "objective", objective.name, objective)


def get_objective(name: str) -> Objective:
    """Look up a registered objective. Raises ``KeyError`` listing the valid names."""
    return lookup(OBJECTIVES, "objective", name)


#: Objective fields a config may override (None there = keep the registered objective's value).
OVERRIDABLE_FIELDS: tuple[str, ...] = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "kl_coef", "loss_agg_mode")


def build_objective(
    name: str,
    overrides: Mapping[str, Any] | None = None,
    mask_param: Callable[[str], Any] | None = None,
) -> Objective:
    """The ONE mapping from a configuration to an :class:`Objective` (train.py's trainer and the verl plugin).

    Args:
        name: a registered objective.
        overrides: values for :data:`OVERRIDABLE_FIELDS`; a missing key or None keeps the objective's value.
        mask_param: ``fn(config_key) -> value or None``, asked for each parameter of the objective's token mask by
            its config key (:attr:`stapo.core.masks.MaskSpec.config_keys`, e.g. ``"algorithm.s2t.prob_threshold"``);
            None keeps the objective's value. The result holds every parameter of the mask
            (:meth:`~stapo.core.masks.MaskSpec.check_params`).

    Returns:
        The objective itself when nothing changes, else a re-validated copy.

    Raises:
        KeyError: unknown objective name. ValueError: invalid values.

    Example: ``build_objective("stapo", {"clip_ratio_high": 0.3}, {"algorithm.s2t.entropy_quantile": 0.8}.get)``
    → stapo with ε_high 0.3 and mask_params ``{"prob_threshold": 0.002, "entropy_quantile": 0.8,
    "quantile_scope": "candidates"}``.
    """
    obj = get_objective(name)
    changes = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(changes) - set(OVERRIDABLE_FIELDS))
    if unknown:
        raise KeyError(f"objective field {unknown[0]!r} cannot be overridden; valid: {OVERRIDABLE_FIELDS}")
    spec = get_mask_spec(obj.token_mask)
    if spec.params is not None:
        params = dict(obj.mask_params)
        for param, key in spec.config_keys.items():
            value = mask_param(key) if mask_param is not None else None
            if value is not None:
                params[param] = value
        changes["mask_params"] = spec.check_params(params)
    return obj.replace(**changes) if changes else obj


# --- per-token loss formulas (verl's register_policy_loss) ----------------------------------------------
PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
#: name → ``fn(logprobs [B,T], old_logprobs [B,T], advantages [B,T] or [B], keep [B,T] bool, objective)
#: -> (loss [B,T] fp32, {"pg_clipfrac": [B,T] bool, "pg_clipfrac_lower": [B,T] bool})``; :func:`policy_loss`
#: aggregates the loss over ``keep`` and reports the flags' kept-token means as ``actor/<flag>``.
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a per-token loss formula under ``name`` (``Objective.policy_loss``); a duplicate raises
    ``ValueError``. The formula reads its constants (clip ε, c...) from the :class:`Objective` it is given."""
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        return add_entry(POLICY_LOSSES, "policy loss", name, fn)

    return deco


def _check_policy_loss_output(name: str, out: Any, keep: torch.Tensor) -> None:
    """A loss formula returns ``(loss [B, T] float tensor, {"pg_clipfrac": [B, T], "pg_clipfrac_lower": [B, T]})``.

    Raises:
        stapo.common.registry.ExtensionError: one line naming the formula and what its output lacks.
    """
    want = (f"(loss {tuple(keep.shape)} float tensor, {{'pg_clipfrac': ..., 'pg_clipfrac_lower': ...}} "
            f"{tuple(keep.shape)})")
    ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and isinstance(out[1], dict)
    if ok and out[0].shape == keep.shape and out[0].dtype.is_floating_point:
        missing = [k for k in ("pg_clipfrac", "pg_clipfrac_lower") if not isinstance(out[1].get(k), torch.Tensor)]
        if not missing and all(out[1][k].shape == keep.shape for k in ("pg_clipfrac", "pg_clipfrac_lower")):
            return
        raise ExtensionError(f"policy loss {name!r} returned flags without {missing or 'the shape of keep'}; it must "
                             f"return {want}")
    raise ExtensionError(f"policy loss {name!r} returned {type(out).__name__}; it must return {want}")


def get_policy_loss(name: str) -> PolicyLossFn:
    """Look up a registered loss formula. Raises ``KeyError`` listing the valid names."""
    return lookup(POLICY_LOSSES, "policy loss", name)


# --- pure per-token functions ---------------------------------------------------------------------------
def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped-surrogate loss with clip-higher and dual clip (docs/method.md#justrl; verl core_algos).

        ρ = exp(clamp(log p − log p_old, ±20))
        L = max(−Â ρ, −Â clip(ρ, 1 − ε_low, 1 + ε_high))          (the usual −min(ρÂ, clip(ρ)Â))
        if Â < 0 and c is set:  L = min(L, −c Â)                    (dual clip)

    Args:
        logprobs: [B, T] log p under π_θ (nats), carries gradient.
        old_logprobs: [B, T] log p under π_old (nats); detached inside.
        advantages: [B, T] token advantages (or [B], broadcast); detached inside.
        clip_ratio_low, clip_ratio_high: ε_low, ε_high.
        clip_ratio_c: dual-clip constant c > 1, or None.

    Returns:
        (loss [B, T] fp32, clipped [B, T] bool — the ε clip is active (ρ outside the band in the direction
        that removes the gradient), dual_clipped [B, T] bool — the dual clip is active, ratio [B, T] fp32).
        Where either clip is active the token's gradient is exactly zero.

    Example: Â = 1, ρ = 1.5, ε_high = 0.28 → L = max(−1.5, −1.28) = −1.28 (clipped, no gradient).
    """
    if advantages.dim() == 1:
        if logprobs.dim() != 2 or advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B] with "
                             f"B = {logprobs.shape[0]} or the shape of logprobs {tuple(logprobs.shape)}")
        advantages = advantages[:, None].expand_as(logprobs)  # [B, T]
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages)
    adv = advantages.detach().float()  # [B, T]
    log_ratio = (logprobs.float() - old_logprobs.detach().float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -adv * ratio  # [B, T]
    loss_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # [B, T]
    loss = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    clipped = loss_clipped > loss_unclipped  # [B, T] bool
    dual_clipped = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        loss_cap = -adv * clip_ratio_c  # [B, T]
        dual_clipped = (adv < 0) & (loss > loss_cap)  # [B, T] bool
        loss = torch.where(dual_clipped, loss_cap, loss)
    return loss, clipped, dual_clipped, ratio.detach()


@register_policy_loss("clipped_surrogate")
def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    objective: "Objective",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The default formula: :func:`clipped_surrogate` with the objective's ε_low, ε_high and c (``keep`` unused).

    Returns (loss [B, T] fp32, {"pg_clipfrac": clipped [B, T] bool, "pg_clipfrac_lower": dual-clipped [B, T] bool}).
    Example: Â = 1, ρ = 1.5, ε_high = 0.28 → loss −1.28, pg_clipfrac flag True.
    """
    loss, clipped, dual_clipped, _ = clipped_surrogate(
        logprobs, old_logprobs, advantages,
        objective.clip_ratio_low, objective.clip_ratio_high, objective.clip_ratio_c)
    return loss, {"pg_clipfrac": clipped, "pg_clipfrac_lower": dual_clipped}


@register_policy_loss("gspo")
def gspo_loss(logprobs, old_logprobs, advantages, keep, objective: "Objective"):
    """A GSPO-style sequence-level ratio (arXiv 2507.18071): one ratio per response, s_i = exp(mean over its kept
    tokens of log p − log p_old), clipped to [1 − ε_low, 1 + ε_high]; every token of the response gets the loss
    −min(s_i Â, clip(s_i) Â) (aggregate with ``seq-mean-token-mean`` for GSPO's per-sequence mean). The token value
    is s_i, its gradient s_i·∇log p_t (GSPO-token: sg(s_i)·p_t / sg(p_t)). No dual clip.

    Shapes as :func:`clipped_surrogate_loss`; ``pg_clipfrac`` flags the tokens of clipped responses.
    Example: kept log ρ = [ln 2, 0], Â = 1 → s = √2 > 1.28 = 1 + ε_high → loss −1.28 on both tokens, no gradient.
    """
    keep = as_bool_mask(keep, "keep")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)  # [B, T]
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, keep=keep)
    adv, logp = advantages.detach().float(), logprobs.float()  # [B, T]
    d = torch.where(keep, logp.detach() - old_logprobs.detach().float(), torch.zeros((), device=logp.device))
    seq = (d.sum(-1) / keep.sum(-1).clamp(min=1)).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B] log s_i
    ratio = torch.exp(seq[:, None] + logp - logp.detach())  # [B, T]: value s_i, gradient s_i·∇log p_t
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - objective.clip_ratio_low, 1.0 + objective.clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    return loss, {"pg_clipfrac": loss_clipped > loss_unclipped, "pg_clipfrac_lower": torch.zeros_like(keep)}


# --- the four objectives of the paper -------------------------------------------------------------------
# JustRL (docs/method.md#clipped-surrogate): DAPO clip-higher, dual clip, token-mean over the whole mini-batch, no KL.
JUSTRL = register_objective(Objective(
    name="justrl", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
    clip_ratio_c=10.0, kl_coef=0.0, token_mask="none"))
# STAPO (docs/method.md#stapo-objective) = JustRL + the S2T mask; the loss is renormalised over the kept tokens.
STAPO = register_objective(JUSTRL.replace(
    name="stapo", token_mask="s2t",
    mask_params=dataclasses.asdict(S2TParams())))  # τ_p, q and the quantile pool: stapo.core.masks
# 20-Entropy (docs/method.md#20-entropy) = JustRL with only the top-20 % entropy tokens receiving gradient.
ENTROPY20 = register_objective(JUSTRL.replace(
    name="entropy20", token_mask="top_entropy", mask_params={"ratio": TOP_ENTROPY_RATIO}))
# GRPO (DeepSeekMath; docs/method.md#grpo-baseline): per-sequence token mean, symmetric clip, k3 KL with β = 0.04.
GRPO = register_objective(Objective(
    name="grpo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
    clip_ratio_c=None, kl_coef=0.04, token_mask="none"))

# --- the paper's ablations of the S2T mask: STAPO with another mask over the same candidates (Â > 0, p < τ_p) -------
# high-entropy masking: silence the candidates ABOVE the (1 − q)-quantile of entropy instead of below the q-quantile
STAPO_HIGH_ENTROPY = register_objective(STAPO.replace(name="stapo_high_entropy", token_mask="s2t_high_entropy"))
# random masking: silence as many candidates as S2T would, chosen at random (seeded, stapo.core.masks.s2t_random_mask)
STAPO_RANDOM = register_objective(STAPO.replace(
    name="stapo_random", token_mask="s2t_random", mask_params={**STAPO.mask_params, "seed": 0}))
# JustRL-FullMask: silence every low-probability token (p < τ_p) of the correct responses (Â > 0)
JUSTRL_FULLMASK = register_objective(JUSTRL.replace(
    name="justrl_fullmask", token_mask="full_low_prob", mask_params={"prob_threshold": PROB_THRESHOLD}))



def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref) per token (Schulman's "low-variance" estimator; verl ``low_var_kl``).

        d = clamp(log π_ref − log π_θ, ±20),  k3 = exp(d) − d − 1 ≥ 0, clamped to [−10, 10] as in verl.

    Args:
        logprobs: [B, T] log π_θ (nats), carries gradient.
        ref_logprobs: [B, T] log π_ref (nats); detached inside.

    Returns:
        [B, T] fp32. Example: log π_θ = log 0.5, log π_ref = log 0.25 → 0.5 − ln 0.5 − 1 ≈ 0.1931.
    """
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    # clamp the log-ratio before exp (as verl does): exp overflow would give 0·inf = NaN gradients
    d = (ref_logprobs.detach().float() - logprobs.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    return (torch.exp(d) - d - 1.0).clamp(-_KL_CLAMP, _KL_CLAMP)


class KeptCounts(NamedTuple):
    """What the loss denominators read from a keep-mask: kept tokens N and sequences S with ≥ 1 kept token.

    Counts add up over the parts of a mini-batch (micro-batches, data-parallel ranks), which is how
    :func:`stapo.core.minibatch.minibatch_loss_denominator` sums them over the ranks before
    :func:`loss_denominator`. Example: keep [[1, 1, 0], [0, 0, 0]] → ``KeptCounts(tokens=2, sequences=1)``.
    """

    tokens: int
    sequences: int

    @classmethod
    def of(cls, keep: torch.Tensor) -> "KeptCounts":
        """The counts of a [B, T] bool (or integer 0/1) keep-mask. Raises TypeError / ValueError: not a mask."""
        keep = as_bool_mask(keep, "keep")
        return cls(int(keep.sum()), int(keep.any(dim=-1).sum()))


def loss_denominator(
    keep: torch.Tensor | KeptCounts,
    loss_agg_mode: LossAggMode,
    *,
    max_response_length: int | None = None,
) -> float:
    """The denominator of a mini-batch's loss, from the keep-mask of the WHOLE mini-batch
    (docs/method.md#loss-aggregation): the one-process formula.

    - ``token-mean``: N = number of kept tokens (clamped ≥ 1).
    - ``seq-mean-token-mean``: S = number of sequences with ≥ 1 kept token (clamped ≥ 1).
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): S · L, with L = ``max_response_length`` (a constant).

    Args:
        keep: [B, T] bool (or integer 0/1) keep-mask of the whole mini-batch, or its :class:`KeptCounts` (those
            of every data-parallel rank summed: :func:`stapo.core.minibatch.minibatch_loss_denominator`).
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        max_response_length: L, required for ``seq-mean-token-sum-norm``.

    Returns:
        A Python float ≥ 1.

    Raises:
        ValueError: unknown mode, or a missing/invalid ``max_response_length``.

    Example: keep [[1, 1, 0], [0, 0, 0]] → token-mean 2.0, seq-mean-token-mean 1.0, seq-mean-token-sum-norm with
    L = 10 → 10.0; an all-False keep → 1.0 (clamped).
    """
    counts = keep if isinstance(keep, KeptCounts) else KeptCounts.of(keep)
    if loss_agg_mode == "token-mean":
        return float(max(counts.tokens, 1))
    num_seqs = max(counts.sequences, 1)
    if loss_agg_mode == "seq-mean-token-mean":
        return float(num_seqs)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if max_response_length is None or max_response_length < 1:
            raise ValueError("seq-mean-token-sum-norm needs max_response_length ≥ 1 "
                             f"(the constant L of Dr. GRPO), got {max_response_length}")
        return float(num_seqs * max_response_length)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {LOSS_AGG_MODES}")


def aggregate_loss(
    loss_mat: torch.Tensor,
    keep: torch.Tensor,
    loss_agg_mode: LossAggMode,
    denominator: float | torch.Tensor,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    - ``token-mean``: Σ_{kept} ℓ / N.
    - ``seq-mean-token-mean``: Σ_i (Σ_t kept ℓ_it / |kept_i|) / S (sequences without kept tokens add 0).
    - ``seq-mean-token-sum-norm``: Σ_{kept} ℓ / (S · L).

    Masked-out tokens are removed with ``torch.where``, so they get exactly zero gradient and a NaN/inf
    there cannot leak. An all-masked micro-batch gives 0 (never 0/0).

    Args:
        loss_mat: [B, T] per-token loss.
        keep: [B, T] bool (or 0/1).
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        denominator: from :func:`loss_denominator` over the whole mini-batch, > 0.

    Returns:
        0-dim fp32 tensor.

    Raises:
        TypeError / ValueError: ``keep`` is not a mask, shapes disagree, ``denominator`` ≤ 0, unknown mode.
    """
    keep = as_bool_mask(keep, "keep")
    check_same_shape("loss_mat", loss_mat, keep=keep)
    if float(denominator) <= 0:
        raise ValueError(f"loss denominator must be > 0, got {float(denominator)}")
    return _aggregate(loss_mat, keep, loss_agg_mode, denominator)


def _aggregate(loss_mat: torch.Tensor, keep: torch.Tensor, loss_agg_mode: str,
               denominator: float | torch.Tensor) -> torch.Tensor:
    """:func:`aggregate_loss` of a checked ``keep`` ([B, T] bool, ``loss_mat``'s shape) and denominator (> 0)."""
    zero = torch.zeros((), dtype=torch.float32, device=loss_mat.device)
    kept_loss = torch.where(keep, loss_mat.float(), zero)  # [B, T]
    if loss_agg_mode in ("token-mean", "seq-mean-token-sum-norm"):
        return kept_loss.sum() / denominator
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mean = kept_loss.sum(dim=-1) / keep.sum(dim=-1).clamp(min=1)  # [B]
        return seq_mean.sum() / denominator
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {LOSS_AGG_MODES}")


# --- objective-level functions --------------------------------------------------------------------------
def compute_token_mask(
    objective: Objective,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> TokenMask:
    """Apply the objective's token mask to the statistics of a whole mini-batch in one process: the one call of a
    registered mask function, and the one check of its result (:func:`stapo.core.masks.check_mask_result`: a bool
    keep of the response mask's shape, no padding kept, no token silenced that the ``maskable_rows`` rule leaves
    untouched). Over data-parallel ranks, :func:`stapo.core.minibatch.minibatch_token_mask` gathers the
    mini-batch and calls this.

    Args:
        objective: an :class:`Objective` (its ``token_mask`` and ``mask_params``).
        logprobs, entropy: [B, T] float (nats).
        advantages: [B] per-row or [B, T] per-token Â.
        response_mask: [B, T] bool (or 0/1).

    Returns:
        :class:`stapo.core.masks.TokenMask`: ``keep`` [B, T] bool, ``num_kept`` = its sum, and the statistics under
        their metric keys ``actor/<mask prefix>/<stat>`` (:func:`stapo.core.metric_names.mask_stat_key`:
        ``actor/s2t/num_masked``, ``actor/top_entropy/kept_frac``...), the same in the native trainer and the verl
        plugin (docs/metrics.md).

    Raises:
        stapo.common.registry.ExtensionError: the mask broke its contract. ValueError / TypeError: from the mask
        function (shapes, NaN entropy, parameters).
    """
    spec = get_mask_spec(objective.token_mask)
    tm = spec.fn(logprobs, entropy, advantages, response_mask, **objective.mask_params)
    check_mask_result(spec.name, getattr(tm, "keep", tm), response_mask, advantages)
    stats = {mask_stat_key(spec.prefix, k): v for k, v in tm.stats.items()}
    return TokenMask(keep=tm.keep, stats=stats, num_kept=int(tm.keep.sum()))


def policy_loss(
    objective: Objective,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    denominator: float | torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's share of the objective's loss, with verl-named metrics.

    loss = agg(per-token loss formula ``objective.policy_loss``, by default the clipped surrogate) + β · agg(k3 KL),
    both aggregated over ``keep`` with the same mini-batch ``denominator`` (docs/method.md#loss-aggregation).

    Args:
        objective: an :class:`Objective`.
        logprobs: [B, T] fp32 log p under π_θ at the rollout temperature (nats), with gradient.
        old_logprobs: [B, T] log p under π_old (nats).
        advantages: [B, T] or [B].
        keep: [B, T] bool — response tokens that receive gradient (after the token mask).
        denominator: :func:`loss_denominator` of the whole mini-batch's keep-mask.
        ref_logprobs: [B, T] log π_ref, required when ``objective.kl_coef > 0``.

    Returns:
        (loss: 0-dim fp32 tensor, metrics) with ``actor/pg_loss`` (this micro-batch's share),
        ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` (dual clip), ``actor/ppo_kl``
        (mean of log p_old − log p) — means over this micro-batch's kept tokens — ``actor/num_kept_tokens``
        and, with a reference policy, ``actor/kl_loss`` and ``actor/kl_coef``.

    Raises:
        ValueError: shapes disagree, ``denominator`` ≤ 0, or ``ref_logprobs`` is missing while β > 0.
        stapo.common.registry.ExtensionError: the loss formula returned the wrong output.
    """
    keep = as_bool_mask(keep, "keep")  # keep, the formula's output and the denominator are checked once, here
    out = get_policy_loss(objective.policy_loss)(logprobs, old_logprobs, advantages, keep, objective)
    _check_policy_loss_output(objective.policy_loss, out, keep)
    pg_mat, flags = out  # [B, T] each
    check_same_shape("logprobs", logprobs, keep=keep)
    if float(denominator) <= 0:
        raise ValueError(f"loss denominator must be > 0, got {float(denominator)}")
    pg_loss = _aggregate(pg_mat, keep, objective.loss_agg_mode, denominator)
    loss = pg_loss
    metrics: dict[str, float] = {"actor/pg_loss": pg_loss.item()}
    for name in ("pg_clipfrac", "pg_clipfrac_lower"):
        metrics[f"actor/{name}"] = masked_mean(flags[name].float(), keep).item()
    metrics.update({
        "actor/ppo_kl": masked_mean(old_logprobs.detach().float() - logprobs.detach().float(), keep).item(),
        "actor/num_kept_tokens": float(keep.sum()),
    })
    if objective.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"objective {objective.name!r} has kl_coef={objective.kl_coef} > 0 "
                             "but no ref_logprobs were given")
        kl_loss = _aggregate(kl_k3(logprobs, ref_logprobs), keep, objective.loss_agg_mode, denominator)
        loss = loss + objective.kl_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.item()
        metrics["actor/kl_coef"] = objective.kl_coef
    return loss, metrics


def objective_loss(
    objective: Objective | str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The whole objective on one mini-batch processed as a single micro-batch: mask → denominator → loss.

    A convenience (and the reference in tests) for :func:`compute_token_mask` + :func:`loss_denominator` +
    :func:`policy_loss`. The mask statistics use ``logprobs`` and ``entropy`` of the current policy, as in
    the paper's Algorithm 1.

    Args:
        objective: an :class:`Objective` or a registered name.
        logprobs, old_logprobs: [B, T] (nats).
        advantages: [B, T] or [B].
        response_mask: [B, T] bool (or 0/1).
        entropy: [B, T] (nats); required by the ``s2t`` and ``top_entropy`` masks.
        ref_logprobs: [B, T], required when β > 0.
        max_response_length: L for ``seq-mean-token-sum-norm``.

    Returns:
        (loss, metrics) — :func:`policy_loss`'s metrics plus the mask statistics.

    Raises:
        KeyError: unknown objective name (lists the valid ones). ValueError: see the functions above.
    """
    obj = get_objective(objective) if isinstance(objective, str) else objective
    if get_mask_spec(obj.token_mask).needs_stats and entropy is None:
        raise ValueError(f"objective {obj.name!r} uses the {obj.token_mask!r} mask, which needs entropy")
    tm = compute_token_mask(obj, logprobs, entropy, advantages, response_mask)
    denom = loss_denominator(tm.keep, obj.loss_agg_mode, max_response_length=max_response_length)
    loss, metrics = policy_loss(obj, logprobs, old_logprobs, advantages, tm.keep, denom, ref_logprobs=ref_logprobs)
    metrics.update(tm.stats)
    return loss, metrics
