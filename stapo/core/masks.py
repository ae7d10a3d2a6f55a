"""Token masks: which response tokens of an optimizer mini-batch receive gradient.

Every mask takes the per-token statistics of the WHOLE mini-batch (the S2T quantile and the 20-Entropy
top-k are mini-batch quantities, not micro-batch ones) and returns a boolean keep-mask plus statistics.
The objective then renormalises the loss over the kept tokens (:mod:`stapo.core.objectives`).

Registry ``MASKS`` (name → :class:`MaskSpec`): pure functions with the common signature

    fn(logprobs [B,T], entropy [B,T], advantages [B,T] or [B], response_mask [B,T], **params) -> TokenMask

- ``"none"``        every response token is kept (GRPO, JustRL).
- ``"s2t"``         the S2T mask of STAPO (docs/method.md#s2t-mask).
- ``"top_entropy"`` keep the top 20 % highest-entropy tokens (20-Entropy, arXiv 2506.01939; docs/method.md#20-entropy).
- Ablations of S2T (same candidates Â > 0, p < τ_p): ``"s2t_high_entropy"`` silences the HIGH-entropy candidates,
  ``"s2t_random"`` random candidates at S2T's count, ``"full_low_prob"`` every candidate (JustRL-FullMask).

A mask is registered once, with :func:`register_token_mask`: its function, its parameter dataclass (which defines
its config keys), its "which rows can it touch" rule, whether it reads the row structure (the layout rule,
:attr:`MaskSpec.reads_rows`) and its metric prefix (:class:`MaskSpec`, :data:`MASKS`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from stapo.common.registry import ExtensionError, check_new, lookup
from stapo.core.params import (
    ENTROPY_QUANTILE,
    PROB_THRESHOLD,
    QUANTILE_SCOPE,
    QUANTILE_SCOPES,
    TOP_ENTROPY_RATIO,
    QuantileScope,
    S2TParams,
    TopEntropyParams,
)
from stapo.core.tensor_utils import as_bool_mask, check_same_shape, quantile

__all__ = [
    "TokenMask",
    "no_mask",
    "s2t_mask",
    "top_entropy_mask",
    "MASKS",
    "MaskSpec",
    "register_token_mask",
    "unregister_token_mask",
    "get_mask_spec",
    "get_token_mask",
    "maskable_rows",
    "check_mask_result",
    "PROB_THRESHOLD",
    "ENTROPY_QUANTILE",
    "QUANTILE_SCOPE",
    "TOP_ENTROPY_RATIO",
]



@dataclass
class TokenMask:
    """A keep-mask and its statistics.

    The one result type of every mask: the registered mask functions return it, :func:`stapo.core.objectives.
    compute_token_mask` adds the mask's prefix to the statistics and ``num_kept``, and
    :func:`stapo.core.minibatch.minibatch_token_mask` (data-parallel ranks) returns this rank's ``keep`` with the
    ``num_kept`` of the whole mini-batch.

    Attributes:
        keep: [B, T] bool — True where the token is a response token that receives gradient.
        stats: scalar statistics (Python floats); keys depend on the mask (see each function).
        num_kept: N, kept tokens of the whole mini-batch (over every data-parallel rank); None straight from a
            mask function (then ``int(keep.sum())``).
    """

    keep: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)
    num_kept: int | None = None


def _prepare(
    logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    advantages: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Validate shapes, cast to bool / fp32, broadcast [B] advantages to [B, T]."""
    mask = as_bool_mask(response_mask, "response_mask")
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(mask.shape)}")
    out: dict[str, torch.Tensor] = {}
    for name, t in (("logprobs", logprobs), ("entropy", entropy), ("advantages", advantages)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if name == "advantages" and t.dim() == 1:
            if t.shape[0] != mask.shape[0]:
                raise ValueError(f"advantages has shape {tuple(t.shape)}; expected [B]={mask.shape[0]} or [B, T]")
            t = t[:, None].expand_as(mask)  # [B, T]
        check_same_shape("response_mask", mask, **{name: t})
        out[name] = t.float()  # fp32, [B, T]
    return mask, out


def no_mask(
    logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    advantages: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> TokenMask:
    """Keep every response token (GRPO, JustRL). ``keep`` = ``response_mask`` as bool, [B, T]."""
    mask, _ = _prepare(None, None, None, response_mask)
    return TokenMask(keep=mask.clone(), stats={})


def s2t_mask(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    prob_threshold: float = PROB_THRESHOLD,
    entropy_quantile: float = ENTROPY_QUANTILE,
    quantile_scope: QuantileScope = QUANTILE_SCOPE,
) -> TokenMask:
    """The S2T (Silencing Spurious Tokens) mask of STAPO (docs/method.md#s2t-mask, paper Algorithm 1).

    A response token is silenced iff  Â > 0  AND  p < τ_p  AND  H < τ_h  (strict inequalities), where
    τ_h is the ``entropy_quantile``-quantile of H over
      - ``"candidates"`` (v4, default): the tokens of the mini-batch with Â > 0 and p < τ_p;
      - ``"all"`` (v1 text / seed summary, used with q = 0.80): all response tokens of the mini-batch.
    An empty candidate set silences nothing. Thresholds are fp32 from ``kthvalue`` (linear interpolation,
    :func:`stapo.core.tensor_utils.quantile`), never ``torch.quantile``.

    Args:
        logprobs: [B, T] log p of the sampled tokens under π_θ at the rollout temperature (nats), any float
            dtype (compared in fp32). Detached inside.
        entropy: [B, T] full-vocabulary entropy H (nats), any float dtype (bf16 is fine).
        advantages: [B, T] token advantages, or [B] per-response advantages (broadcast).
        response_mask: [B, T] bool (or integer 0/1) — True on response tokens.
        prob_threshold: τ_p, absolute probability (0.002 ⇒ log p < ln 0.002 ≈ −6.2146).
        entropy_quantile: q ∈ (0, 1).
        quantile_scope: ``"candidates"`` or ``"all"``.

    Returns:
        :class:`TokenMask` with ``keep`` [B, T] bool = response tokens that are not silenced, and stats:
        ``num_response_tokens``, ``num_candidates``, ``num_masked``, ``masked_frac`` (silenced / response
        tokens), ``entropy_threshold`` (τ_h; NaN when it is undefined), ``masked_prob_mean``,
        ``masked_entropy_mean``, ``masked_adv_mean`` (NaN when nothing is silenced).

    Raises:
        ValueError: shapes disagree, τ_p ∉ (0, 1], q ∉ (0, 1), unknown scope, a NaN/inf entropy or NaN
            log-prob on a response token.
        TypeError: a float mask, or non-float statistics.

    With strict inequalities and a linearly interpolated quantile, a single candidate, or candidates whose
    entropies are all equal, are never silenced (τ_h equals their entropy).

    Example (scope = "candidates", q = 0.75, τ_p = 0.002): four candidates with H = [0.1, 0.2, 0.3, 0.4]
    → τ_h = 0.3 + 0.25·(0.4 − 0.3) = 0.325 → the tokens with H 0.1, 0.2, 0.3 are silenced, 0.4 is kept.
    """
    if not 0.0 < prob_threshold <= 1.0:
        raise ValueError(f"prob_threshold (tau_p) must be in (0, 1], got {prob_threshold}")
    if not 0.0 < entropy_quantile < 1.0:
        raise ValueError(f"entropy_quantile (q) must be in (0, 1), got {entropy_quantile}")
    if quantile_scope not in QUANTILE_SCOPES:
        raise ValueError(f"quantile_scope must be 'candidates' or 'all', got {quantile_scope!r}")
    c = _s2t_candidates(logprobs, entropy, advantages, response_mask, prob_threshold, "s2t_mask")
    pool = c.candidates if quantile_scope == "candidates" else c.mask  # [B, T] bool
    if not bool(c.candidates.any()) or not bool(pool.any()):
        tau_h = float("nan")
        silenced = torch.zeros_like(c.mask)  # [B, T] bool, nothing silenced
    else:
        tau_h_t = quantile(c.ent[pool], entropy_quantile)  # 0-dim fp32
        tau_h = tau_h_t.item()
        silenced = c.candidates & (c.ent < tau_h_t)  # [B, T] bool
    return _silencing_mask(c, silenced, tau_h)


@dataclass
class _Candidates:
    """The S2T candidate set of a mini-batch and its fp32 statistics, all [B, T]."""

    mask: torch.Tensor  # response tokens, bool
    logp: torch.Tensor
    ent: torch.Tensor
    adv: torch.Tensor
    candidates: torch.Tensor  # mask & Â > 0 & p < τ_p, bool


def _s2t_candidates(logprobs, entropy, advantages, response_mask, prob_threshold: float, who: str) -> _Candidates:
    """Validated fp32 statistics and the candidates Â > 0 AND p < τ_p (strict) of docs/method.md#s2t-mask."""
    mask, t = _prepare(logprobs, entropy, advantages, response_mask)
    logp, ent, adv = t["logprobs"].detach(), t["entropy"].detach(), t["advantages"].detach()  # [B, T] fp32
    bad = mask & ~(torch.isfinite(ent) & ~torch.isnan(logp))
    if bool(bad.any()):  # a NaN in the quantile pool would make τ_h NaN and silently silence nothing
        b, t_ = bad.nonzero()[0].tolist()
        raise ValueError(f"{who}: non-finite entropy or NaN log-prob at response token ({b}, {t_}); "
                         f"{int(bad.sum())} such tokens")
    candidates = mask & (adv > 0) & (logp < math.log(prob_threshold))  # [B, T] bool
    return _Candidates(mask=mask, logp=logp, ent=ent, adv=adv, candidates=candidates)


def _silencing_mask(c: _Candidates, silenced: torch.Tensor, tau_h: float) -> TokenMask:
    """keep = response tokens not ``silenced`` ([B, T] bool), with the statistics of :func:`s2t_mask`."""
    num_response, num_masked = int(c.mask.sum()), int(silenced.sum())
    nan = float("nan")
    stats = {
        "num_response_tokens": float(num_response),
        "num_candidates": float(int(c.candidates.sum())),
        "num_masked": float(num_masked),
        "masked_frac": num_masked / max(num_response, 1),
        "entropy_threshold": tau_h,
        "masked_prob_mean": c.logp[silenced].exp().mean().item() if num_masked else nan,
        "masked_entropy_mean": c.ent[silenced].mean().item() if num_masked else nan,
        "masked_adv_mean": c.adv[silenced].mean().item() if num_masked else nan,
    }
    return TokenMask(keep=c.mask & ~silenced, stats=stats)


def top_entropy_mask(
    logprobs: torch.Tensor | None,
    entropy: torch.Tensor,
    advantages: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    ratio: float = TOP_ENTROPY_RATIO,
) -> TokenMask:
    """20-Entropy: keep only the top ⌈ratio · n⌉ highest-entropy response tokens of the mini-batch.

    Source: "Beyond the 80/20 Rule" (arXiv 2506.01939); docs/method.md#20-entropy. n = number of response tokens.
    Ties are broken deterministically: among equal entropies, the token that comes first in row-major
    order of [B, T] (lower batch index, then lower position) is kept (stable descending sort).

    Args:
        logprobs, advantages: unused (common signature).
        entropy: [B, T] entropy (nats), any float dtype (compared in fp32).
        response_mask: [B, T] bool (or integer 0/1).
        ratio: fraction kept, in (0, 1].

    Returns:
        :class:`TokenMask` with stats ``num_response_tokens``, ``num_kept``, ``kept_frac`` and
        ``entropy_threshold`` (the smallest kept entropy; NaN when there are no response tokens).

    Raises:
        ValueError: ratio ∉ (0, 1] or shapes disagree.

    Example: entropies of 5 response tokens [0.5, 2.0, 1.0, 2.0, 0.1], ratio 0.2 → k = ⌈1.0⌉ = 1; the two
    2.0 tie and the first (index 1) is kept.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"top-entropy ratio must be in (0, 1], got {ratio}")
    mask, t = _prepare(None, entropy, None, response_mask)
    ent = t["entropy"].detach()  # [B, T] fp32
    if bool((mask & torch.isnan(ent)).any()):  # sort would rank NaN above every entropy and keep it
        raise ValueError(f"top_entropy_mask: {int((mask & torch.isnan(ent)).sum())} response tokens have NaN entropy")
    n = int(mask.sum())
    keep_flat = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)  # [B*T] bool
    threshold = float("nan")
    if n > 0:
        k = math.ceil(ratio * n - 1e-9)  # guard: 0.2 * 15 = 3.0000000000000004 in floats
        k = min(max(k, 1), n)
        flat_idx = mask.reshape(-1).nonzero().squeeze(1)  # [n] int64, increasing
        vals = ent.reshape(-1)[flat_idx]  # [n] fp32
        order = torch.sort(vals, descending=True, stable=True).indices[:k]  # [k]
        keep_flat[flat_idx[order]] = True
        threshold = vals[order[-1]].item()
    keep = keep_flat.view(mask.shape)  # [B, T] bool
    num_kept = int(keep.sum())
    stats = {
        "num_response_tokens": float(n),
        "num_kept": float(num_kept),
        "kept_frac": num_kept / max(n, 1),
        "entropy_threshold": threshold,
    }
    return TokenMask(keep=keep, stats=stats)


TokenMaskFn = Callable[..., TokenMask]


# --- "which rows can a mask touch" rules (MaskSpec.maskable_rows) ---------------------------------------
def no_rows(advantages: torch.Tensor) -> torch.Tensor:
    """No row: the mask keeps every response token (``none``). [B] → [B] bool, all False."""
    return torch.zeros_like(advantages, dtype=torch.bool)


def positive_advantage_rows(advantages: torch.Tensor) -> torch.Tensor:
    """Rows with Â > 0: masks that silence only candidates of positive advantage (S2T). [B] → [B] bool."""
    return advantages > 0


def all_rows(advantages: torch.Tensor) -> torch.Tensor:
    """Every row: masks where all tokens compete (20-Entropy's top-k). [B] → [B] bool, all True."""
    return torch.ones_like(advantages, dtype=torch.bool)


@dataclass(frozen=True)
class MaskSpec:
    """Everything the rest of the code needs to know about a registered token mask.

    Attributes:
        name: registry key (``Objective.token_mask``).
        fn: the pure mask function (common signature, see the module docstring).
        params: a dataclass whose fields are the mask's keyword parameters, with the paper's defaults (or None:
            no parameters). Its fields define the config keys (``config_keys``).
        maskable_rows: ``fn(advantages [B]) -> [B] bool`` — rows whose keep-mask may differ from their response
            mask whatever p and H turn out to be (used by the trainer's ``actor.fused_forward``). Row-local: row
            i's answer depends on Â_i alone (the fused path asks it about each rank's rows, and
            :func:`check_mask_result` about each token's Â where the call has no rows).
        prefix: metric prefix of the mask's statistics (logged as ``actor/<prefix>/num_masked``...).
        config_keys: parameter name → dotted key of :class:`stapo.config.TrainConfig` it is read from. Default
            for a parameter: ``algorithm.masks.<name>.<param>``; the verl plugin reads the same key without
            ``algorithm.`` / ``masks.`` and with ``_`` for ``.`` (``algorithm.s2t.prob_threshold`` →
            ``policy_loss.s2t_prob_threshold``).
        needs_stats: the mask reads log p / H (False for ``none``: no statistics pass is needed).
        silences: the mask silences a few tokens (S2T-like) rather than keeping a subset; the trainer's examples
            table then shows the tokens it silenced (else the tokens S2T would silence).
        reads_rows: the layout rule (docs/extending.md#the-layout-rule). True (the default): the mask may read
            the row structure (a token's row, its position in it, per-row counts), so it is always called on the
            mini-batch's rows [rows, T] — under data parallelism the ranks' rows are gathered, padded to a common
            T, in rank order (:func:`stapo.core.minibatch.minibatch_token_mask`). False: the mask declares that its
            keep-mask and statistics depend only on the response tokens' statistics in row-major order, not on the
            rows, the padding or T; under data parallelism it is then called on the ranks' response tokens
            concatenated into ONE row [1, N] (12 bytes per token instead of 16 per padded position). Every
            built-in mask declares False; tests/test_dp_mask.py checks each registered mask's declaration.
    """

    name: str
    fn: TokenMaskFn
    params: type | None
    maskable_rows: Callable[[torch.Tensor], torch.Tensor]
    prefix: str
    config_keys: dict[str, str]
    needs_stats: bool = True
    silences: bool = True
    reads_rows: bool = True

    def default_params(self) -> dict[str, Any]:
        """The parameters' defaults as a dict (``{}`` without a params dataclass)."""
        return {} if self.params is None else dataclasses.asdict(self.params())

    def check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with every field of the params dataclass (defaults filled in), each value checked against the
        field's type by OmegaConf (the config library: ``"2"`` → 2 for an ``int``, but ``2.5`` or ``True`` is refused).

        Raises:
            KeyError: an unknown parameter (naming it and the valid ones).
            ValueError: a value of the wrong type, naming its config key and the type.
        """
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        defaults = self.default_params()
        unknown = sorted(set(params) - set(defaults))
        if unknown:
            raise KeyError(f"token mask {self.name!r} has no parameter {unknown[0]!r}; valid: {sorted(defaults)}")
        if self.params is None:
            return {}
        schema = OmegaConf.structured(self.params)
        types = {f.name: f.type for f in dataclasses.fields(self.params)}
        for k, v in params.items():
            try:
                OmegaConf.merge(schema, {k: v})
            except OmegaConfBaseException:
                want = types[k] if isinstance(types[k], str) else getattr(types[k], "__name__", str(types[k]))
                raise ValueError(f"invalid value for '{self.config_keys[k]}' ({v!r}): token mask {self.name!r} needs "
                                 f"a value of type {want}") from None
        return OmegaConf.to_container(OmegaConf.merge(schema, params))  # type: ignore[return-value]

    @property
    def rule_name(self) -> str:
        """The ``maskable_rows`` rule's name (``"positive_advantage"``...; a function's own name)."""
        return next((k for k, v in _ROW_RULES.items() if v is self.maskable_rows),
                    getattr(self.maskable_rows, "__name__", "custom"))


MASKS: dict[str, MaskSpec] = {}

_ROW_RULES = {"none": no_rows, "positive_advantage": positive_advantage_rows, "all": all_rows}
#: Metric prefixes of the trainer's own keys (docs/metrics.md), and the ``actor/*`` keys next to which a mask's
#: statistics are logged (``actor/<prefix>/<stat>``, stapo/core/metric_names.py); a mask's prefix may not be one of
#: them.
RESERVED_PREFIXES = frozenset({"actor", "critic", "response_length", "timing_s", "perf", "data", "val", "val-core",
                               "val-aux", "rollout", "reward", "grader", "training", "global_seqlen",
                               "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy",
                               "entropy_loss", "grad_norm", "lr", "num_kept_tokens", "nonfinite_grad_steps"})


def register_token_mask(
    name: str,
    *,
    params: type | None = None,
    maskable_rows: str | Callable[[torch.Tensor], torch.Tensor] = "all",
    prefix: str | None = None,
    config_keys: dict[str, str] | None = None,
    needs_stats: bool = True,
    silences: bool = True,
    reads_rows: bool = True,
) -> Callable[[TokenMaskFn], TokenMaskFn]:
    """Decorator: register a mask function under ``name`` with its parameters, row rule, layout rule and metric prefix.

    Args:
        name: registry key; a duplicate raises ``ValueError``.
        params: dataclass of the keyword parameters (paper defaults), or None.
        maskable_rows: ``"none"``, ``"positive_advantage"``, ``"all"`` or a function [B] → [B] bool.
        prefix: metric prefix (default ``name``).
        config_keys: parameter → dotted config key, for parameters not under ``algorithm.masks.<name>``.
        needs_stats, silences: see :class:`MaskSpec`.
        reads_rows: the layout rule (:attr:`MaskSpec.reads_rows`): True (default) — the mask may read the row
            structure and is always called on the mini-batch's rows; False — its result depends only on the
            response tokens in row-major order, so data-parallel ranks may hand it their tokens as one row [1, N].

    Raises:
        ValueError: an unknown ``maskable_rows`` rule, a taken metric prefix, a ``config_keys`` entry that is not a
            field of ``params``, or (when decorating) a name already registered.

    Example::

        @dataclass
        class MyParams:
            prob_threshold: float = 0.002

        @register_token_mask("my_mask", params=MyParams, maskable_rows="positive_advantage", reads_rows=False)
        def my_mask(logprobs, entropy, advantages, response_mask, *, prob_threshold=0.002) -> TokenMask: ...

    registers ``my_mask`` with the config key ``algorithm.masks.my_mask.prob_threshold`` and metrics
    ``actor/my_mask/...``; it declares that it reads no row structure (a per-token threshold).
    """
    if isinstance(maskable_rows, str) and maskable_rows not in _ROW_RULES:
        raise ValueError(f"token mask {name!r}: unknown maskable_rows rule {maskable_rows!r}; use one of "
                         f"{', '.join(repr(r) for r in _ROW_RULES)} or a function [B] advantages → [B] bool")
    rule = _ROW_RULES[maskable_rows] if isinstance(maskable_rows, str) else maskable_rows
    pre = prefix or name
    taken = {spec.prefix: spec.name for spec in MASKS.values()}
    if pre in RESERVED_PREFIXES or (pre in taken and taken[pre] != name):
        owner = "the trainer's own metrics" if pre in RESERVED_PREFIXES else f"token mask {taken[pre]!r}"
        raise ValueError(f"token mask {name!r}: metric prefix {pre!r} is taken by {owner}; choose another prefix")

    def deco(fn: TokenMaskFn) -> TokenMaskFn:
        check_new(MASKS, "token mask", name)
        fields = [] if params is None else [f.name for f in dataclasses.fields(params)]
        stray = sorted(set(config_keys or {}) - set(fields))
        if stray:
            raise ValueError(f"token mask {name!r}: config_keys names {stray[0]!r}, which is not a field of its params "
                             f"dataclass (fields: {', '.join(fields) or 'none'})")
        keys = {f: (config_keys or {}).get(f, f"algorithm.masks.{name}.{f}") for f in fields}
        MASKS[name] = MaskSpec(name=name, fn=fn, params=params, maskable_rows=rule, prefix=pre,
                               config_keys=keys, needs_stats=needs_stats, silences=silences, reads_rows=reads_rows)
        return fn

    return deco


def unregister_token_mask(name: str) -> None:
    """Remove a registered mask (tests that register their own)."""
    MASKS.pop(name, None)


_S2T_KEYS = {k: f"algorithm.s2t.{k}" for k in ("prob_threshold", "entropy_quantile", "quantile_scope")}
# the layout rule: every built-in mask reads the response tokens in row-major order, never the rows (reads_rows=False)
register_token_mask("none", maskable_rows="none", needs_stats=False, silences=False, reads_rows=False)(no_mask)
register_token_mask("s2t", params=S2TParams, maskable_rows="positive_advantage", config_keys=_S2T_KEYS,
                    reads_rows=False)(s2t_mask)
register_token_mask("top_entropy", params=TopEntropyParams, maskable_rows="all",
                    config_keys={"ratio": "algorithm.top_entropy_ratio"}, silences=False,
                    reads_rows=False)(top_entropy_mask)



# --- the paper's ablations of S2T (each a registered mask; objectives in stapo.core.objectives) ---------------------
@register_token_mask("s2t_high_entropy", params=S2TParams, maskable_rows="positive_advantage", config_keys=_S2T_KEYS,
                     reads_rows=False)
def s2t_high_entropy_mask(logprobs, entropy, advantages, response_mask, *, prob_threshold: float = PROB_THRESHOLD,
                          entropy_quantile: float = ENTROPY_QUANTILE,
                          quantile_scope: QuantileScope = QUANTILE_SCOPE) -> TokenMask:
    """Ablation "high-entropy masking": the S2T candidates (Â > 0, p < τ_p) whose entropy is ABOVE the
    (1 − q)-quantile of the pool (S2T silences those BELOW the q-quantile), so about the same number of tokens.

    Args, returns, raises: as :func:`s2t_mask` (``entropy_threshold`` = the (1 − q)-quantile; strict ``>``).

    Example (q = 0.75, candidates H = [0.1, 0.2, 0.3, 0.4]): τ = 0.25-quantile = 0.1 + 0.75·(0.2 − 0.1) = 0.175
    → H 0.2, 0.3, 0.4 are silenced, 0.1 is kept (S2T would silence 0.1, 0.2, 0.3).
    """
    s2t_mask(logprobs, entropy, advantages, response_mask, prob_threshold=prob_threshold,
             entropy_quantile=entropy_quantile, quantile_scope=quantile_scope)  # validates the arguments
    c = _s2t_candidates(logprobs, entropy, advantages, response_mask, prob_threshold, "s2t_high_entropy_mask")
    pool = c.candidates if quantile_scope == "candidates" else c.mask  # [B, T] bool
    if not bool(c.candidates.any()) or not bool(pool.any()):
        return _silencing_mask(c, torch.zeros_like(c.mask), float("nan"))
    tau = quantile(c.ent[pool], 1.0 - entropy_quantile)  # 0-dim fp32
    return _silencing_mask(c, c.candidates & (c.ent > tau), tau.item())


@dataclass
class S2TRandomParams(S2TParams):
    """:class:`S2TParams` (read from ``algorithm.s2t``) plus the seed (``algorithm.masks.s2t_random.seed``)."""

    seed: int = 0


@register_token_mask("s2t_random", params=S2TRandomParams, maskable_rows="positive_advantage", config_keys=_S2T_KEYS,
                     reads_rows=False)
def s2t_random_mask(logprobs, entropy, advantages, response_mask, *, prob_threshold: float = PROB_THRESHOLD,
                    entropy_quantile: float = ENTROPY_QUANTILE, quantile_scope: QuantileScope = QUANTILE_SCOPE,
                    seed: int = 0) -> TokenMask:
    """Ablation "random masking": silence k uniformly chosen S2T candidates, k = what :func:`s2t_mask` would silence.

    Seed: a fresh ``torch.Generator`` seeded with ``seed·1_000_003 + 1009·N_resp + N_cand`` (response tokens and
    candidates of this mini-batch) draws ``randperm(N_cand)[:k]`` over the candidates in row-major order. The mask
    is thus a pure function of its inputs — identical on every data-parallel rank (which all see the same gathered
    mini-batch), on resume and in tests — while different mini-batches (other counts) draw other permutations.
    Stats as :func:`s2t_mask`; ``entropy_threshold`` is S2T's τ_h, whose silenced count is matched.

    Layout: the draw depends only on the candidates' order among the response tokens in row-major order and on
    the counts N_resp (response tokens, not padded positions) and N_cand — not on the [B, T] shape, the padding or
    the rank. The one-process trainer's [n, R] mini-batch and the [1, N_resp] rank-major concatenation of
    :func:`stapo.core.minibatch.minibatch_token_mask` (rank-major = the one-process row order) therefore silence the
    same tokens (tests/test_masks.py, tests/test_dp_mask.py, tests/test_distributed.py); putting the rows in another
    order changes the candidate sequence, and so the draw.

    Example: 4 candidates, S2T silences 3 → 3 of the 4 candidates, chosen by the seeded permutation, are silenced.
    """
    ref = s2t_mask(logprobs, entropy, advantages, response_mask, prob_threshold=prob_threshold,
                   entropy_quantile=entropy_quantile, quantile_scope=quantile_scope)
    c = _s2t_candidates(logprobs, entropy, advantages, response_mask, prob_threshold, "s2t_random_mask")
    cand = c.candidates.reshape(-1).nonzero().squeeze(1)  # [N_cand] flat indices, row-major
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 1009 * int(c.mask.sum()) + cand.numel())
    pick = cand[torch.randperm(cand.numel(), generator=g)[: int(ref.stats["num_masked"])].to(cand.device)]
    silenced = torch.zeros(c.mask.numel(), dtype=torch.bool, device=c.mask.device)
    silenced[pick] = True
    return _silencing_mask(c, silenced.view(c.mask.shape), ref.stats["entropy_threshold"])


@dataclass
class FullLowProbParams:
    """Parameter of :func:`full_low_prob_mask`: τ_p, read from ``algorithm.s2t.prob_threshold``."""

    prob_threshold: float = PROB_THRESHOLD


@register_token_mask("full_low_prob", params=FullLowProbParams, maskable_rows="positive_advantage",
                     config_keys={"prob_threshold": "algorithm.s2t.prob_threshold"}, reads_rows=False)
def full_low_prob_mask(logprobs, entropy, advantages, response_mask, *,
                       prob_threshold: float = PROB_THRESHOLD) -> TokenMask:
    """Ablation "JustRL-FullMask": silence EVERY low-probability token of the correct responses — all S2T candidates
    (Â > 0 and p < τ_p, strict), with no entropy condition. ``entropy`` only feeds the statistics (it must be finite on
    response tokens, as for S2T); ``entropy_threshold`` is NaN (no entropy threshold is used).

    Example: tokens with p = [0.001, 0.001, 0.5] in a response with Â = 1, and p = 0.001 with Â = −1 → the first two
    are silenced; the Â < 0 token and the p = 0.5 token are kept.
    """
    if not 0.0 < prob_threshold <= 1.0:
        raise ValueError(f"prob_threshold (tau_p) must be in (0, 1], got {prob_threshold}")
    c = _s2t_candidates(logprobs, entropy, advantages, response_mask, prob_threshold, "full_low_prob_mask")
    return _silencing_mask(c, c.candidates, float("nan"))

def get_mask_spec(name: str) -> MaskSpec:
    """The :class:`MaskSpec` of a registered mask. Raises ``KeyError`` listing the valid names."""
    return lookup(MASKS, "token mask", name)


def get_token_mask(name: str) -> TokenMaskFn:
    """Look up a token mask function by name. Raises ``KeyError`` listing the valid names."""
    return get_mask_spec(name).fn


def maskable_rows(name: str, advantages: torch.Tensor) -> torch.Tensor:
    """Rows whose keep-mask may differ from their response mask, whatever the token statistics turn out to be.

    The rule is the mask's registered ``maskable_rows`` (:class:`MaskSpec`):

    - ``"none"`` (GRPO, JustRL: no mask): no row.
    - ``"positive_advantage"`` (S2T and its ablations): rows with Â > 0 — S2T silences only candidates, and
      candidates need Â > 0 (docs/method.md#s2t-mask); rows with Â ≤ 0 keep every response token for any p, H, τ_h.
    - ``"all"`` (20-Entropy): every row (all tokens compete for the top 20 %).
    - a function ``[B] advantages → [B] bool`` registered by the mask.

    The trainer's ``actor.fused_forward`` uses this to run the backward of the other rows before the
    mini-batch's statistics are complete.

    Args:
        name: a registered mask name.
        advantages: [B] per-response advantages (fp32).

    Returns:
        [B] bool.

    Raises:
        KeyError: unknown mask name.

    Example: ``maskable_rows("s2t", torch.tensor([0.5, 0.0, -0.5]))`` → ``[True, False, False]``.
    """
    spec = get_mask_spec(name)
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be [B] per-response values, got shape {tuple(advantages.shape)}")
    return spec.maskable_rows(advantages)


def check_mask_result(name: str, keep: Any, response_mask: torch.Tensor, advantages: torch.Tensor | None = None
                      ) -> None:
    """The contract of a registered mask's output, checked once per mask call (by
    :func:`stapo.core.objectives.compute_token_mask`, the one caller of a mask function).

    ``keep`` must be a bool tensor of ``response_mask``'s shape [B, T] that keeps no padding; with ``advantages``,
    rows outside the mask's ``maskable_rows`` rule must keep every response token (the fused update back-propagates
    those rows before the mask is known). ``advantages`` [B] are the rows' Â; [B, T] token advantages (a call with
    token advantages, e.g. the ranks' tokens as one row [1, N]) are judged token by token: the rule is row-local,
    so a token whose Â its rule leaves untouched must be kept.

    Args:
        name: a registered mask name.
        keep: the mask's keep-mask (anything: its type is part of the check).
        response_mask: [B, T] bool (or 0/1).
        advantages: [B] or [B, T] float, or None (only the form of ``keep`` is checked).

    Raises:
        stapo.common.registry.ExtensionError: one line naming the mask, what is wrong and the fix.
        ValueError: ``advantages`` fit neither [B] nor [B, T].

    Example: rule ``positive_advantage``, Â = [1, −1]: silencing a token of row 1 raises, of row 0 does not.
    """
    spec = get_mask_spec(name)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != response_mask.shape:
        got = (f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__)
        raise ExtensionError(f"token mask {name!r} returned keep as {got}; it must be a bool tensor of the response "
                             f"mask's shape {tuple(response_mask.shape)}")
    mask = response_mask.bool()
    if bool((keep & ~mask).any()):
        raise ExtensionError(f"token mask {name!r} keeps {int((keep & ~mask).sum())} padding token(s); return "
                             f"keep = response_mask & ... so only response tokens are kept")
    if advantages is None:
        return
    if tuple(advantages.shape) not in ((mask.shape[0],), tuple(mask.shape)):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B] = ({mask.shape[0]},) or "
                         f"[B, T] = {tuple(mask.shape)}")
    if advantages.dim() == 2:  # token advantages: the row-local rule asked about each token's Â
        broken = ~spec.maskable_rows(advantages.reshape(-1)).view(advantages.shape) & mask & ~keep  # [B, T]
        bad = broken.any(dim=1)  # [B] rows with a silenced token the rule leaves untouched
    else:
        broken = None
        bad = ~spec.maskable_rows(advantages) & (keep != mask).any(dim=1)  # [B] untouchable rows that were touched
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        adv = advantages[row] if broken is None else advantages[row, int(broken[row].nonzero()[0])]
        raise ExtensionError(f"token mask {name!r} silenced tokens of {int(bad.sum())} row(s) its maskable_rows rule "
                             f"{spec.rule_name!r} leaves untouched (e.g. row {row}, advantage "
                             f"{float(adv):.4g}); register it with maskable_rows='all' or a rule that "
                             f"includes those rows")

