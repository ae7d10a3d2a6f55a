"""STAPO, 20-Entropy and the S2T ablations as verl policy losses (verified against verl 0.9.1).

Importing this module

1. registers every objective of :data:`stapo.core.objectives.OBJECTIVES` that has a token mask, token-mean aggregation
   and no KL as a verl loss mode of the same name (:data:`PLUGIN_LOSSES`, :func:`register_plugin_loss`):
   ``stapo`` (S2T mask, docs/method.md#s2t-mask), ``entropy20`` (top-20 %-entropy mask,
   docs/method.md#20-entropy) and the paper's ablations ``stapo_high_entropy``, ``stapo_random`` and
   ``justrl_fullmask`` (masks ``s2t_high_entropy``, ``s2t_random``, ``full_low_prob`` of :mod:`stapo.core.masks`) — an
   objective you register before importing this module is one too. They go into
   verl's own policy-loss registry, ``verl.trainer.ppo.core_algos.register_policy_loss`` (core_algos.py:53;
   the registry dict ``POLICY_LOSS_REGISTRY`` is at :50 and ``get_policy_loss_fn`` at :70). All use the
   registered-loss signature of the installed verl (``PolicyLossFn``, core_algos.py:37; same as the built-in
   ``vanilla`` loss, :1285)::

       fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
          rollout_is_weights=None) -> (pg_loss: 0-dim tensor, pg_metrics: dict[str, float])

   The loss itself is ours: :func:`stapo.core.objectives.policy_loss` (JustRL clipped surrogate, dual clip,
   token-mean) over the keep-mask of :func:`stapo.core.objectives.compute_token_mask` (which calls
   the objective's registered mask, e.g. :func:`stapo.core.masks.s2t_mask`). Nothing is re-implemented here.
2. installs a small hook on verl's actor worker, ``verl.workers.engine_workers.TrainingWorker.train_batch``
   (engine_workers.py:343, called once per optimizer mini-batch by ``train_mini_batch``, :243), that computes
   the mask over the WHOLE mini-batch before its micro-batch loop. The hook does nothing unless the worker's
   loss is ``partial(ppo_loss, config=<ActorConfig>)`` (engine_workers.py:643) with
   ``policy_loss.loss_mode`` ∈ :data:`PLUGIN_LOSSES`; the critic and the reference model pass through.

Why a hook, and where the entropy comes from
--------------------------------------------
verl 0.9.1 has no ``DataParallelPPOActor`` / ``dp_actor.py`` any more: the actor is a model *engine*
(``verl/workers/engine/fsdp/transformer_impl.py``) driven by ``TrainingWorker``. The registered loss is called
by ``verl.workers.utils.losses.ppo_loss`` (losses.py:57, call at :103) once per MICRO-batch with the seven
arguments above only — no entropy, no token statistics of the other micro-batches or ranks. The engine does
compute the per-token entropy when the mini-batch carries ``calculate_entropy=True`` (fsdp
transformer_impl.py ``prepare_model_outputs``; ``model_output["entropy"]``, read by ppo_loss at losses.py:60),
but (a) verl's driver sets that flag for the update only when ``actor.calculate_entropy`` or
``entropy_coeff != 0`` (ray_trainer.py:1336), (b) ppo_loss does not pass it on, and (c) even then each call
would see only its own micro-batch, while the S2T entropy quantile τ_h, the 20-Entropy top-k and the
token-mean denominator N are mini-batch quantities (docs/method.md#data-parallelism). The old-policy entropy that verl
computes in ``_compute_old_log_prob`` is dropped before the update (ray_trainer.py:1601), and the paper's
Algorithm 1 takes p and H from the CURRENT policy at each mini-batch anyway.

So, per optimizer mini-batch, on every data-parallel rank, the hook (:func:`_stapo_train_batch`):

1. runs one extra no-grad forward of the local mini-batch with ``calculate_entropy=True`` through verl's own
   engine (``engine.infer_batch`` in ``engine.eval_mode``, exactly what verl's ``compute_log_prob`` does),
   giving log p and H of the current π_θ at the rollout temperature for every response token
   (cost: one forward per mini-batch, ≈ +⅓ of the update's FLOPs, no activation memory kept);
2. all-gathers (log p, H, Â) of the response tokens of all ranks of the data-parallel group
   (``engine.get_data_parallel_group()``; 12 bytes per token, ≈ 25–95 MB per mini-batch for the paper's
   512 responses × 4k–15k tokens) and applies OUR mask function once to the concatenation
   (:func:`stapo.core.minibatch.minibatch_token_mask`, the trainer's entry point too) — every rank computes the
   same global mask: the same τ_h over the global candidate set, the same top-k with the same tie-break
   (rank-major, then row-major order); a rank with no candidates is fine. A registered mask that reads rows
   (``reads_rows=True``, docs/extending.md#the-layout-rule) gets the ranks' rows, padded to a common length, instead;
3. gets the loss denominator of the whole mini-batch from the ranks' kept counts
   (:func:`stapo.core.minibatch.minibatch_loss_denominator`, the native trainer's one denominator: one all-reduce
   of two numbers; N = max(kept tokens, 1) for token-mean);
4. stores this rank's keep-mask as a per-sample field ``stapo_keep`` of the mini-batch TensorDict (in the
   layout of ``response_mask``: padded in the v0 trainer, jagged in the v1 TransferQueue trainer), so that
   verl's own micro-batch split (``prepare_micro_batches``, also with dynamic batch size) carries it along;
5. runs verl's original ``train_batch`` with its loss function wrapped: before each micro-batch's
   ``ppo_loss`` call, the micro-batch's ``stapo_keep`` and the mini-batch's denominator are put into a context variable
   (:func:`mask_context`) that the registered loss reads.

The denominator and verl's "global batch info"
----------------------------------------------
verl passes mini-batch information to registered losses through ``config.global_batch_info``
(``ActorConfig.global_batch_info``, workers/config/actor.py:192), filled by ppo_loss before each call
(losses.py:65–68) with ``dp_size``, ``batch_num_tokens``, ``global_batch_size`` and ``loss_scale_factor``.
``batch_num_tokens`` is the number of RESPONSE tokens of the whole mini-batch, all-reduced over the
data-parallel group by the engine (fsdp transformer_impl.py:730–735) — the right denominator for JustRL but
not for STAPO/20-Entropy, whose token-mean is renormalised over the KEPT tokens. So the registered losses use
the denominator N from the hook and only ``dp_size`` from verl, with verl's convention for FSDP gradient averaging
(``agg_loss``, core_algos.py:1140: ``masked_sum / batch_num_tokens * dp_size``):

    pg_loss = Σ_{kept tokens of this micro-batch} ℓ / max(N, 1) · dp_size

After FSDP averages the gradients over the ``dp_size`` ranks and the micro-batch gradients are summed, this is
exactly the token-mean of docs/method.md#loss-aggregation over the kept tokens of the whole mini-batch.

Without the hook (a call outside verl's worker, e.g. in tests) the loss accepts per-token entropy through
``mask_context(entropy=...)`` and computes the mask itself — allowed only when the call provably covers the
whole mini-batch (``dp_size == 1`` and ``batch_num_tokens`` absent or equal to this call's response-token
count); otherwise it raises instead of silently using a per-micro-batch quantile.

Configuration (hydra overrides of ``python -m verl.trainer.main_ppo``)
---------------------------------------------------------------------
- ``actor_rollout_ref.actor.policy_loss.loss_mode=stapo`` (or ``entropy20``, ``stapo_high_entropy``,
  ``stapo_random``, ``justrl_fullmask``: :data:`PLUGIN_LOSSES`).
- Loading the plugin in every Ray worker: ``actor_rollout_ref.model.external_lib=stapo.integrations.verl``.
  verl imports it with ``importlib`` in ``HFModelConfig.__post_init__`` (workers/config/model.py:149), which
  runs in ``ActorRolloutRefWorker.init_model`` (engine_workers.py:540) before the loss is built (:643) — so the
  registry lookup (losses.py:103) and the hook both happen in the worker process. (Alternative: the
  environment variable ``VERL_USE_EXTERNAL_MODULES=stapo.integrations.verl``, imported by ``import verl``,
  verl/__init__.py:49, in every process that sees it.)
- Mask parameters (S2T, 20-Entropy, the ablations' seed): verl's ``PolicyLossConfig`` rejects unknown keys, so set
  ``actor_rollout_ref.actor.policy_loss._target_=stapo.integrations.verl.StapoPolicyLossConfig`` (a subclass
  with the extra fields of :class:`StapoPolicyLossConfig`) and then e.g.
  ``+actor_rollout_ref.actor.policy_loss.s2t_prob_threshold=0.002``. Without it the paper defaults of
  :data:`stapo.core.objectives.OBJECTIVES` are used (τ_p = 0.002, q = 0.75 over the candidates; ratio 0.2; seed 0).
- Clip ε_low, ε_high and the dual-clip c come from verl's actor config (``clip_ratio_low``,
  ``clip_ratio_high``, ``clip_ratio_c``) like for every verl loss; set them to the paper's 0.2 / 0.28 / 10
  (verl's defaults are 0.2 / 0.2 / 3 — a warning is emitted once when they differ from the paper's).
- ``actor.loss_agg_mode`` must be ``token-mean``; no KL (``use_kl_loss=False``), ``entropy_coeff=0``; rollout
  importance weights (``algorithm.rollout_correction``) are not supported (``NotImplementedError``).

Metrics: the native trainer's keys (docs/metrics.md#one-vocabulary-native-trainer-and-verl-plugin,
:mod:`stapo.core.metric_names`) — ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``,
``actor/num_kept_tokens`` and the mask statistics ``actor/<mask prefix>/<stat>`` (``actor/s2t/masked_frac``...);
verl's driver prefixes the worker's metrics with ``actor/`` only where they lack it, so they reach W&B unchanged.

Supported engines: those whose ``infer_batch`` returns the model outputs on every data-parallel rank — verl's
FSDP / FSDP2 engine (the paper's setup). The Megatron and MindSpeed engines raise ``NotImplementedError``.
Not run on GPUs in this repository: the registered function and the hook's mask/denominator logic are tested
on CPU against verl 0.9.1's real registry, ``ppo_loss`` and padding utilities (tests/test_verl_plugin.py).
"""
from __future__ import annotations

import contextvars
import functools
import logging
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from stapo.core.masks import (
    ENTROPY_QUANTILE,
    PROB_THRESHOLD,
    QUANTILE_SCOPE,
    TOP_ENTROPY_RATIO,
    TokenMask,
    get_mask_spec,
)
from stapo.core.metric_names import NUM_KEPT_TOKENS
from stapo.core.minibatch import minibatch_loss_denominator, minibatch_token_mask
from stapo.core.objectives import (
    LOSS_AGG_MODES,
    OBJECTIVES,
    Objective,
    build_objective,
    compute_token_mask,
    get_objective,
    loss_denominator,
    policy_loss,
)
from stapo.core.tensor_utils import as_bool_mask

try:  # verl is optional for `import stapo`, required for this module
    from verl.trainer.ppo import core_algos as _core_algos
    from verl.workers.config import PolicyLossConfig as _PolicyLossConfig
except ImportError as e:  # pragma: no cover - exercised only without verl
    raise ImportError(
        "stapo.integrations.verl needs verl (tested with verl==0.9.1): "
        "pip install --no-deps verl==0.9.1 plus its runtime dependencies"
    ) from e

__all__ = [
    "PLUGIN_LOSSES",
    "PLUGIN_LOSS_FNS",
    "plugin_loss_problem",
    "register_plugin_loss",
    "KEEP_KEY",
    "StapoPolicyLossConfig",
    "MaskContext",
    "mask_context",
    "current_mask_context",
    "objective_from_verl_config",
    "verl_param_key",
    "objective_of_verl_actor",
    "registered_objective_name",
    "VERL_MAX_RATIO",
    "minibatch_token_mask",
    "compute_policy_loss_stapo",
    "compute_policy_loss_entropy20",
    "install_worker_hook",
    "WORKER_HOOK_ERROR",
]

logger = logging.getLogger(__name__)

#: verl ``policy_loss.loss_mode`` name → our objective name (stapo.core.objectives.OBJECTIVES): every registered
#: objective with a token mask, token-mean aggregation and no KL (:func:`plugin_loss_problem`), under its own name —
#: ``stapo``, ``entropy20`` and the ablations ``stapo_high_entropy``, ``stapo_random``, ``justrl_fullmask`` — filled at
#: import and by :func:`register_plugin_loss`.
PLUGIN_LOSSES: dict[str, str] = {}
#: loss mode → its function in verl's registry (``compute_policy_loss_<loss_mode>``, an attribute of this module).
PLUGIN_LOSS_FNS: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}
#: Per-sample TensorDict field that carries the mini-batch-wide keep-mask into verl's micro-batches.
KEEP_KEY = "stapo_keep"
#: Why the worker hook could not be installed (None when it is installed).
WORKER_HOOK_ERROR: str | None = None


# --- configuration ---------------------------------------------------------------------------------------
@dataclass
class StapoPolicyLossConfig(_PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the mask parameters of the plugin losses (:data:`PLUGIN_LOSSES`).

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=stapo.integrations.verl.StapoPolicyLossConfig``
    (hydra instantiates the actor config recursively, so the ``_target_`` import also loads this plugin).
    A field is the verl key of a mask parameter's train-config key (:func:`verl_param_key`); a mask of your own
    needs its fields in a subclass (tests/test_verl_plugin.py checks that every registered mask's are here).

    Attributes (defaults = the paper's, docs/method.md#s2t-mask, docs/method.md#20-entropy):
        s2t_prob_threshold: τ_p, absolute probability (0.002); also of the S2T ablations.
        s2t_entropy_quantile: q of the entropy quantile τ_h (0.75); also of ``stapo_high_entropy`` / ``stapo_random``.
        s2t_quantile_scope: ``"candidates"`` (v4) or ``"all"`` (v1 text, used with q = 0.80).
        top_entropy_ratio: fraction of response tokens kept by ``entropy20`` (0.2).
        s2t_random_seed: seed of ``stapo_random``'s draw (0; :func:`stapo.core.masks.s2t_random_mask`).
    """

    _target_: str = "stapo.integrations.verl.StapoPolicyLossConfig"
    s2t_prob_threshold: float = PROB_THRESHOLD
    s2t_entropy_quantile: float = ENTROPY_QUANTILE
    s2t_quantile_scope: str = QUANTILE_SCOPE
    top_entropy_ratio: float = TOP_ENTROPY_RATIO
    s2t_random_seed: int = 0


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` for verl's BaseConfig dataclasses, OmegaConf DictConfig and plain dicts alike."""
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    getter = getattr(cfg, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except Exception:  # noqa: BLE001 - fall back to attribute access
            pass
    return getattr(cfg, key, default)


_WARNED_CLIP: set[tuple] = set()


def verl_param_key(config_key: str) -> str:
    """The ``policy_loss`` field of a mask parameter, from its train-config key
    (:attr:`stapo.core.masks.MaskSpec.config_keys`).

    Example: ``"algorithm.s2t.prob_threshold"`` → ``"s2t_prob_threshold"``, ``"algorithm.top_entropy_ratio"`` →
    ``"top_entropy_ratio"``, ``"algorithm.masks.s2t_random.seed"`` → ``"s2t_random_seed"``.
    """
    parts = config_key.split(".")
    parts = parts[1:] if parts[0] == "algorithm" else parts
    parts = parts[1:] if parts and parts[0] == "masks" else parts
    return "_".join(parts)


def objective_from_verl_config(loss_mode: str, config: Any) -> Objective:
    """Our :class:`~stapo.core.objectives.Objective` for a verl ``loss_mode`` and actor config.

    Clip parameters come from verl's actor config (``clip_ratio_low``/``clip_ratio_high``, falling back to
    ``clip_ratio``; ``clip_ratio_c``), mask parameters from ``config.policy_loss`` (the fields of
    :class:`StapoPolicyLossConfig`, falling back to the objective's paper defaults).

    Args:
        loss_mode: a plugin loss mode (:data:`PLUGIN_LOSSES`: ``"stapo"``, ``"entropy20"``, ``"stapo_random"``...).
        config: verl ``ActorConfig`` (or a dict / DictConfig with the same keys).

    Returns:
        A validated :class:`Objective` (``Objective.__post_init__`` checks the values).

    Raises:
        KeyError: unknown ``loss_mode``. ValueError: invalid clip or mask values.
    """
    if loss_mode not in PLUGIN_LOSSES:
        raise KeyError(f"unknown plugin loss {loss_mode!r}; valid: {sorted(PLUGIN_LOSSES)}")
    base = get_objective(PLUGIN_LOSSES[loss_mode])
    clip = _cfg_get(config, "clip_ratio", None)
    low = _cfg_get(config, "clip_ratio_low", None)
    high = _cfg_get(config, "clip_ratio_high", None)
    low = float(low if low is not None else (clip if clip is not None else base.clip_ratio_low))
    high = float(high if high is not None else (clip if clip is not None else base.clip_ratio_high))
    c = _cfg_get(config, "clip_ratio_c", base.clip_ratio_c)
    c = None if c is None else float(c)
    pl = _cfg_get(config, "policy_loss", None)
    # the trainer's mapping (stapo.core.objectives.build_objective); a mask parameter's verl key is its train-config key
    # without "algorithm." / "masks." and with "_" for "." (algorithm.s2t.prob_threshold → s2t_prob_threshold)
    obj = build_objective(PLUGIN_LOSSES[loss_mode],
                          {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c},
                          lambda key: _cfg_get(pl, verl_param_key(key), None))
    if c is None:  # build_objective reads None as "keep the objective's value"; here it means "dual clip off"
        obj = obj.replace(clip_ratio_c=None)
    paper = (base.clip_ratio_low, base.clip_ratio_high, base.clip_ratio_c)
    if (low, high, c) != paper and (low, high, c) not in _WARNED_CLIP:
        _WARNED_CLIP.add((low, high, c))
        warnings.warn(
            f"verl loss {loss_mode!r}: clip (ε_low, ε_high, c) = {(low, high, c)} from the actor config differ from "
            f"the paper's {paper} (set actor.clip_ratio_low/clip_ratio_high/clip_ratio_c)", stacklevel=2)
    return obj


#: verl clamps log ρ to ±20 before exp (core_algos.compute_policy_loss_vanilla), so ρ ≤ e^20 ≈ 4.9e8 and a dual-clip
#: constant c > e^20 never binds: "dual clip off" in verl, ``clip_ratio_c=None`` in :class:`Objective`.
VERL_MAX_RATIO: float = math.exp(20.0)


def objective_of_verl_actor(config: Any) -> Objective:
    """The objective verl's actor optimises with this actor config, as a :class:`~stapo.core.objectives.Objective`.

    ``policy_loss.loss_mode`` a plugin loss (:data:`PLUGIN_LOSSES`) → :func:`objective_from_verl_config`; ``vanilla``
    (verl's clipped surrogate, core_algos.compute_policy_loss_vanilla) → aggregation ``loss_agg_mode``, clip
    ``clip_ratio_low``/``clip_ratio_high``, dual clip ``clip_ratio_c`` (None when > :data:`VERL_MAX_RATIO`),
    β = ``kl_loss_coef`` when ``use_kl_loss`` (KL type ``low_var_kl``/``k3`` = our k3, clamped as verl does),
    no token mask. The result is named ``verl:<loss_mode>``; :func:`registered_objective_name` says which of
    our registered objectives it equals.

    Args:
        config: verl ``ActorConfig`` (or a dict / DictConfig with the same keys).

    Returns:
        A validated :class:`Objective`.

    Raises:
        ValueError: settings with no counterpart in :mod:`stapo.core.objectives` (another loss_mode, loss_agg_mode or
            KL type, an entropy bonus; with a plugin loss a KL term or an aggregation other than token-mean).
    """
    pl = _cfg_get(config, "policy_loss", None)
    loss_mode = _cfg_get(pl, "loss_mode", "vanilla")
    if _cfg_get(config, "entropy_coeff", 0) not in (0, 0.0, None):
        raise ValueError(f"actor.entropy_coeff={_cfg_get(config, 'entropy_coeff')}: our objectives have no "
                         "entropy bonus (docs/method.md#justrl); set it to 0")
    use_kl = bool(_cfg_get(config, "use_kl_loss", False))
    if loss_mode in PLUGIN_LOSSES:
        if use_kl:
            raise ValueError(f"verl loss {loss_mode!r} takes no KL term (docs/method.md#objective-registry): set actor.use_kl_loss=False")
        obj = objective_from_verl_config(loss_mode, config)
        agg = _cfg_get(config, "loss_agg_mode", "token-mean")
        if agg != obj.loss_agg_mode:
            raise ValueError(f"verl loss {loss_mode!r} needs actor.loss_agg_mode={obj.loss_agg_mode!r} (renormalised "
                             f"over the kept tokens), got {agg!r}")
        return obj.replace(name=f"verl:{loss_mode}")
    if loss_mode != "vanilla":
        raise ValueError(f"verl policy_loss.loss_mode={loss_mode!r} has no stapo.core.objectives counterpart "
                         f"(supported: vanilla, {', '.join(sorted(PLUGIN_LOSSES))})")
    agg = _cfg_get(config, "loss_agg_mode", "token-mean")
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode={agg!r} has no stapo.core.objectives counterpart; valid: {LOSS_AGG_MODES}")
    clip = _cfg_get(config, "clip_ratio", 0.2)
    low, high = _cfg_get(config, "clip_ratio_low", None), _cfg_get(config, "clip_ratio_high", None)
    c = float(_cfg_get(config, "clip_ratio_c", 3.0))  # verl's default dual clip is 3
    kl_coef = 0.0
    if use_kl:
        kl_type = str(_cfg_get(config, "kl_loss_type", "low_var_kl"))
        if kl_type not in ("low_var_kl", "k3"):
            raise ValueError(f"actor.kl_loss_type={kl_type!r}: our KL penalty is k3 (verl low_var_kl)")
        kl_coef = float(_cfg_get(config, "kl_loss_coef", 0.0))
    return Objective(
        name="verl:vanilla", loss_agg_mode=agg,
        clip_ratio_low=float(low if low is not None else clip),
        clip_ratio_high=float(high if high is not None else clip),
        clip_ratio_c=None if c > VERL_MAX_RATIO else c, kl_coef=kl_coef, token_mask="none")


def registered_objective_name(objective: Objective) -> str | None:
    """The name of the registered objective (:data:`stapo.core.objectives.OBJECTIVES`) equal to ``objective`` in every
    field but the name, or None (e.g. ``objective_of_verl_actor(cfg)`` of the launch script's ``grpo`` → ``"grpo"``).
    """
    for name, reg in OBJECTIVES.items():
        if objective.replace(name=name) == reg:
            return name
    return None


# --- the context that carries mini-batch information into the registered loss ----------------------------
@dataclass(frozen=True)
class MaskContext:
    """What the registered loss needs beyond verl's seven arguments, for ONE call (one micro-batch).

    Attributes:
        keep: [b, T] bool — the mini-batch-wide keep-mask restricted to this micro-batch (same shape as the
            ``response_mask`` verl passes), or None.
        num_kept: N, kept tokens of the whole mini-batch over all data-parallel ranks (required with ``keep``).
        denominator: the loss denominator of the whole mini-batch, :func:`stapo.core.minibatch.
            minibatch_loss_denominator` (max(N, 1) for token-mean; required with ``keep``).
        entropy: [b, T] float per-token entropy (nats) of the current policy — used only when ``keep`` is None,
            to compute the mask in the call itself (whole-mini-batch calls only).
        stats: mask statistics of the whole mini-batch under their metric keys (``actor/s2t/num_masked``...),
            reported as metrics.
    """

    keep: torch.Tensor | None = None
    num_kept: int | None = None
    denominator: float | None = None
    entropy: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)


_CONTEXT: contextvars.ContextVar[MaskContext | None] = contextvars.ContextVar("stapo_verl_mask_context", default=None)


@contextmanager
def mask_context(
    *,
    keep: torch.Tensor | None = None,
    num_kept: int | None = None,
    denominator: float | None = None,
    entropy: torch.Tensor | None = None,
    stats: dict[str, float] | None = None,
) -> Iterator[MaskContext]:
    """Make a :class:`MaskContext` visible to the registered losses inside the ``with`` block.

    Use ``keep`` + ``num_kept`` + ``denominator`` (what the worker hook does for each micro-batch) or ``entropy``
    alone (a call that covers the whole mini-batch, e.g. a test).

    Raises:
        ValueError: ``keep``, ``num_kept`` and ``denominator`` not given together, or neither ``keep`` nor
            ``entropy``.
    """
    if len({keep is None, num_kept is None, denominator is None}) != 1:
        raise ValueError("mask_context: keep, num_kept and denominator go together")
    if keep is None and entropy is None:
        raise ValueError("mask_context: give keep + num_kept + denominator, or entropy")
    token = _CONTEXT.set(MaskContext(keep=keep, num_kept=num_kept, denominator=denominator, entropy=entropy,
                                     stats=dict(stats or {})))
    try:
        yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


def current_mask_context() -> MaskContext | None:
    """The :class:`MaskContext` of the innermost active :func:`mask_context`, or None."""
    return _CONTEXT.get()


# --- the registered losses -------------------------------------------------------------------------------
def _plugin_policy_loss(
    loss_mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    if config is None:
        raise ValueError(f"verl loss {loss_mode!r} needs the actor config (clip ratios, mask parameters)")
    if rollout_is_weights is not None:
        raise NotImplementedError(
            f"verl loss {loss_mode!r}: rollout importance weights (algorithm.rollout_correction) are not part of "
            "the STAPO objective; disable rollout correction")
    obj = objective_from_verl_config(loss_mode, config)
    if loss_agg_mode != obj.loss_agg_mode:
        raise ValueError(f"verl loss {loss_mode!r} is defined with loss_agg_mode={obj.loss_agg_mode!r} "
                         f"(renormalised over the kept tokens), got {loss_agg_mode!r}")
    info = _cfg_get(config, "global_batch_info", None) or {}
    dp_size = int(info.get("dp_size") or 1)
    mask = as_bool_mask(response_mask, "response_mask")
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError(
            f"verl loss {loss_mode!r} needs the mini-batch keep-mask or per-token entropy, which verl's loss "
            "signature does not carry. Inside verl this comes from the worker hook of stapo.integrations.verl "
            f"(installed: {WORKER_HOOK_ERROR is None}; error: {WORKER_HOOK_ERROR}); load the plugin in the workers "
            "with actor_rollout_ref.model.external_lib=stapo.integrations.verl. Outside verl, call it inside "
            "stapo.integrations.verl.mask_context(entropy=...).")
    if ctx.keep is not None:
        keep = as_bool_mask(ctx.keep, "keep").to(mask.device)
        if tuple(keep.shape) != tuple(mask.shape):
            raise ValueError(f"keep-mask shape {tuple(keep.shape)} != response_mask shape {tuple(mask.shape)}")
        num_kept = int(ctx.num_kept)  # the keep-mask's own checks ran once, in minibatch_token_mask
        stats = ctx.stats
        # Σ_kept ℓ / N · dp_size (verl agg_loss convention: FSDP averages gradients over the dp ranks), N from the
        # one denominator the native trainer uses too (stapo.core.minibatch.minibatch_loss_denominator)
        denominator = float(ctx.denominator) / dp_size
    else:
        batch_num_tokens = info.get("batch_num_tokens")
        n_here = int(mask.sum())
        if dp_size != 1 or (batch_num_tokens is not None and int(batch_num_tokens) != n_here):
            raise RuntimeError(
                f"verl loss {loss_mode!r}: this call sees {n_here} response tokens but the mini-batch has "
                f"{batch_num_tokens} over dp_size={dp_size}; the mask needs the whole mini-batch. Use the worker "
                "hook (mask_context(keep=..., num_kept=..., denominator=...)) instead of "
                "mask_context(entropy=...).")
        tm = compute_token_mask(obj, log_prob, ctx.entropy, advantages, mask)
        keep = tm.keep
        num_kept = int(keep.sum())
        stats = tm.stats
        denominator = loss_denominator(keep, obj.loss_agg_mode)
    loss, metrics = policy_loss(obj, log_prob, old_log_prob, advantages, keep, denominator)
    metrics.pop("actor/pg_loss", None)  # ppo_loss reports pg_loss itself (losses.py)
    # the shared vocabulary (stapo/core/metric_names.py): N of the whole mini-batch, not of this micro-batch; the mask
    # statistics already carry their keys actor/<mask prefix>/<stat> (compute_token_mask)
    metrics[NUM_KEPT_TOKENS] = float(num_kept)
    for k, v in stats.items():
        if isinstance(v, (int, float)) and math.isfinite(float(v)):
            metrics[k] = float(v)
    return loss, metrics


_LOSS_DOC = """verl policy loss ``{name}``: the registered objective ``{name}`` of :mod:`stapo.core.objectives` (token mask
``{mask}``, per-token loss ``{formula}``), token-mean renormalised over the kept tokens of the whole mini-batch
(docs/method.md#objective-registry; for ``stapo`` docs/method.md#stapo-objective, arXiv 2602.15620 Alg. 1).
Made by :func:`register_plugin_loss`.

Args:
    old_log_prob: [b, T] fp32 log p under π_old (nats).
    log_prob: [b, T] fp32 log p under π_θ (nats), with gradient.
    advantages: [b, T] token advantages (GRPO Â broadcast over the response).
    response_mask: [b, T] bool (or 0/1) response tokens of this micro-batch.
    loss_agg_mode: must be ``"token-mean"``.
    config: verl ``ActorConfig`` — clip ratios, ``policy_loss`` mask parameters and ``global_batch_info``
        (``dp_size``; ``batch_num_tokens`` for the whole-mini-batch check).
    rollout_is_weights: must be None.

The keep-mask and N come from the active :func:`mask_context` (set per micro-batch by the worker hook), or
the mask is computed here from ``mask_context(entropy=...)`` when the call is the whole mini-batch.

Returns:
    (pg_loss 0-dim fp32 = Σ_kept ℓ / max(N, 1) · dp_size, metrics: ``actor/pg_clipfrac``,
    ``actor/pg_clipfrac_lower``, ``actor/ppo_kl`` (this micro-batch's kept tokens),
    ``actor/num_kept_tokens`` and the mask statistics ``actor/{prefix}/...`` of the whole mini-batch; keys:
    docs/metrics.md, the vocabulary shared with the native trainer).

Raises:
    RuntimeError: no mask context, or an entropy-only context on a partial mini-batch.
    ValueError: loss_agg_mode ≠ token-mean, no config, mask/shape mismatch, invalid parameters.
    NotImplementedError: ``rollout_is_weights`` given.
"""


def _make_policy_loss_fn(loss_mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """verl's registered-loss function of the plugin loss ``loss_mode`` (signature ``PolicyLossFn``, core_algos.py:37),
    named ``compute_policy_loss_<loss_mode>`` in this module."""

    def fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return _plugin_policy_loss(loss_mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                   config, rollout_is_weights)

    obj = get_objective(loss_mode)
    fn.__name__ = fn.__qualname__ = f"compute_policy_loss_{loss_mode}"
    fn.__module__ = __name__
    fn.__doc__ = _LOSS_DOC.format(name=loss_mode, mask=obj.token_mask, formula=obj.policy_loss,
                                  prefix=get_mask_spec(obj.token_mask).prefix)
    return fn


def plugin_loss_problem(objective: Objective) -> str | None:
    """Why ``objective`` cannot be a plugin loss mode (None: it can). The registered loss is Σ_kept ℓ / N over the
    mini-batch's kept tokens with no KL term, so the objective must aggregate ``token-mean`` and have β = 0
    (``grpo``: seq-mean-token-mean and β = 0.04, is verl's ``vanilla`` loss with its own KL instead)."""
    if objective.loss_agg_mode != "token-mean":
        return f"its aggregation is {objective.loss_agg_mode!r}, the plugin's is 'token-mean' over the kept tokens"
    if objective.kl_coef != 0.0:
        return f"it has a KL term (kl_coef={objective.kl_coef}), the plugin's losses have none"
    return None


def register_plugin_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """Register the registered objective ``name`` (:data:`stapo.core.objectives.OBJECTIVES`) as verl loss mode ``name``.

    Done at import for every registered objective that :func:`plugin_loss_problem` accepts, whose token mask reads
    p / H (:attr:`stapo.core.masks.MaskSpec.needs_stats`) and whose name is not one of verl's own losses; call it for an
    objective registered after importing this module (its mask parameters are read from
    ``policy_loss.<verl_param_key>``: add the fields to a subclass of :class:`StapoPolicyLossConfig`). Idempotent.

    Returns:
        The registered function ``compute_policy_loss_<name>`` (also an attribute of this module).

    Raises:
        KeyError: no such objective. ValueError: the objective cannot be a plugin loss, or ``name`` is a verl loss.
    """
    problem = plugin_loss_problem(get_objective(name))
    if problem is not None:
        raise ValueError(f"objective {name!r} cannot be a verl plugin loss: {problem}")
    existing = _core_algos.POLICY_LOSS_REGISTRY.get(name)
    fn = PLUGIN_LOSS_FNS.get(name)
    if existing is not None and existing is fn:
        return fn
    if _is_verl_loss(existing):
        raise ValueError(f"{name!r} is one of verl's own policy losses ({existing.__module__}.{existing.__name__})")
    if existing is not None:
        warnings.warn(f"verl policy loss {name!r} was already registered ({existing!r}); "
                      "stapo.integrations.verl replaces it", stacklevel=2)
    fn = _make_policy_loss_fn(name)
    PLUGIN_LOSSES[name] = name
    PLUGIN_LOSS_FNS[name] = fn
    globals()[fn.__name__] = fn
    _core_algos.register_policy_loss(name)(fn)
    return fn


def _is_verl_loss(fn: Any) -> bool:
    return fn is not None and str(getattr(fn, "__module__", "")).startswith("verl.")


def _register_losses() -> None:
    """Every registered objective with a token mask that reads p / H, token-mean and no KL, becomes a loss mode. An
    objective without such a mask (``justrl``) is verl's ``vanilla`` loss and would pay the hook's extra forward for
    nothing; :func:`register_plugin_loss` still accepts it."""
    for name, obj in OBJECTIVES.items():
        if (plugin_loss_problem(obj) is None and get_mask_spec(obj.token_mask).needs_stats
                and not _is_verl_loss(_core_algos.POLICY_LOSS_REGISTRY.get(name))):
            register_plugin_loss(name)


_register_losses()
compute_policy_loss_stapo = PLUGIN_LOSS_FNS["stapo"]
compute_policy_loss_entropy20 = PLUGIN_LOSS_FNS["entropy20"]


# --- the worker hook -------------------------------------------------------------------------------------
_MISSING = object()


def _actor_loss_mode(worker: Any) -> tuple[str | None, Any]:
    """(plugin loss mode, actor config) of a TrainingWorker's loss function, or (None, None)."""
    loss_fn = getattr(worker, "loss_fn", None)
    cfg = loss_fn.keywords.get("config") if isinstance(loss_fn, functools.partial) else None
    mode = _cfg_get(_cfg_get(cfg, "policy_loss", None), "loss_mode", None)
    return (mode, cfg) if mode in PLUGIN_LOSSES else (None, None)


def _fit_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """[b, T'] → [b, width]: truncate or right-pad with zeros."""
    if x.shape[1] >= width:
        return x[:, :width]
    return F.pad(x, (0, width - x.shape[1]))


def _padded(x: torch.Tensor) -> torch.Tensor:
    """A per-response tensor as padded [b, T] (jagged nested tensors are padded with 0)."""
    return x.to_padded_tensor(0) if x.is_nested else x


def _minibatch_keep_for_worker(worker: Any, data: Any, loss_mode: str, config: Any) -> tuple[TokenMask, float]:
    """Steps 1–3 of the hook (module docstring): current-policy stats of the local mini-batch, global mask, and
    the whole mini-batch's loss denominator (:func:`stapo.core.minibatch.minibatch_loss_denominator`)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    engine_module = type(worker.engine).__module__
    if "megatron" in engine_module or "mindspeed" in engine_module:  # same answer on every rank: no hang
        raise NotImplementedError(
            f"verl loss {loss_mode!r}: the stapo mini-batch hook supports the FSDP/FSDP2 engine, not "
            f"{type(worker.engine).__name__} (model outputs exist only on the last pipeline stage)")
    # the engineering keys TrainingWorker.train_batch sets when absent (engine_workers.py:350-360)
    model_config = getattr(worker, "model_config", None)
    engine_config = getattr(worker, "engine_config", None)
    defaults = dict(
        use_remove_padding=_cfg_get(model_config, "use_remove_padding", False),
        use_dynamic_bsz=_cfg_get(engine_config, "use_dynamic_bsz", False),
        max_token_len_per_gpu=_cfg_get(engine_config, "max_token_len_per_gpu", None),
        micro_batch_size_per_gpu=_cfg_get(engine_config, "micro_batch_size_per_gpu", None),
        use_fused_kernels=_cfg_get(engine_config, "use_fused_kernels", False),
    )
    for key, val in defaults.items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: val})
    previous = tu.get(data, "calculate_entropy", _MISSING)
    tu.assign_non_tensor(data, calculate_entropy=True)
    try:
        disable_auto_offload = tu.get(data, "disable_auto_offload", False)
        with worker.engine.eval_mode(disable_auto_offload=disable_auto_offload):
            out = worker.engine.infer_batch(data, loss_function=None)
    finally:
        if previous is _MISSING:
            data.pop("calculate_entropy", None)
        else:
            tu.assign_non_tensor(data, calculate_entropy=previous)
    model_output = (out or {}).get("model_output", {}) if isinstance(out, dict) else {}
    if "log_probs" not in model_output or "entropy" not in model_output:
        raise NotImplementedError(
            f"verl loss {loss_mode!r}: the engine {type(worker.engine).__name__} returned no per-token log-probs/"
            "entropy on this rank (pipeline parallelism?); the stapo hook supports FSDP/FSDP2 engines")
    response_mask = _padded(data["response_mask"]).bool()  # [b, T]
    width = response_mask.shape[1]
    logp = _fit_width(no_padding_2_padding(model_output["log_probs"], data), width)  # [b, T]
    ent = _fit_width(no_padding_2_padding(model_output["entropy"], data), width)  # [b, T]
    adv = _fit_width(_padded(data["advantages"]), width)  # [b, T]
    objective = objective_from_verl_config(loss_mode, config)
    group = worker.engine.get_data_parallel_group()
    tm = minibatch_token_mask(objective, logp, ent, adv.to(logp.device), response_mask.to(logp.device),
                              group=group)  # keep [b, T], num_kept over the ranks
    return tm, minibatch_loss_denominator(tm.keep, objective.loss_agg_mode, group=group)


def _keep_in_layout_of(keep: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The padded [b, T] keep-mask in the layout of ``response_mask`` (padded tensor or jagged nested)."""
    if response_mask.is_nested:
        from verl.workers.utils.padding import response_to_nested

        return response_to_nested(keep.cpu(), response_mask.cpu())
    return keep.to(response_mask.device)


def _loss_fn_with_mask(loss_fn: Any, num_kept: int, denominator: float, stats: dict[str, float]) -> Any:
    """Wrap verl's per-micro-batch loss function so the registered loss sees this micro-batch's keep-mask."""

    def wrapped(model_output: Any, data: Any, dp_group: Any = None):
        # ppo_loss pads its fields with `data.select(...).to_padded_tensor()` (losses.py); do the same so the
        # keep-mask has exactly the shape of the response_mask the registered loss receives.
        sel = data.select("response_mask", KEEP_KEY)
        if any(sel[k].is_nested for k in ("response_mask", KEEP_KEY)):
            sel = sel.to_padded_tensor()
        with mask_context(keep=sel[KEEP_KEY].bool(), num_kept=num_kept, denominator=denominator, stats=stats):
            return loss_fn(model_output=model_output, data=data, dp_group=dp_group)

    wrapped.__wrapped__ = loss_fn  # type: ignore[attr-defined]
    return wrapped


def _wrap_train_batch(orig: Any) -> Any:
    """Wrap ``TrainingWorker.train_batch`` (see the module docstring, steps 1–5)."""
    if getattr(orig, "_stapo_hook", False):
        return orig

    @functools.wraps(orig)  # keeps verl's @register dispatch attributes (__dict__ is copied)
    def train_batch(self: Any, data: Any) -> Any:
        loss_mode, config = _actor_loss_mode(self)
        if loss_mode is None:
            return orig(self, data)
        mb, denominator = _minibatch_keep_for_worker(self, data, loss_mode, config)
        data[KEEP_KEY] = _keep_in_layout_of(mb.keep, data["response_mask"])
        loss_fn = self.loss_fn
        self.loss_fn = _loss_fn_with_mask(loss_fn, mb.num_kept, denominator, mb.stats)
        try:
            return orig(self, data)
        finally:
            self.loss_fn = loss_fn
            data.pop(KEEP_KEY, None)

    train_batch._stapo_hook = True  # type: ignore[attr-defined]
    return train_batch


def install_worker_hook() -> bool:
    """Install the mini-batch hook on ``verl.workers.engine_workers.TrainingWorker.train_batch`` (idempotent).

    Returns:
        True when installed (or already installed); False when verl's worker module cannot be imported in this
        process — the reason is kept in :data:`WORKER_HOOK_ERROR` and repeated by the loss's error message.
    """
    global WORKER_HOOK_ERROR
    try:
        from verl.workers.engine_workers import TrainingWorker
    except Exception as e:  # noqa: BLE001 - e.g. a verl build without the engine workers
        WORKER_HOOK_ERROR = f"{type(e).__name__}: {e}"
        logger.warning("stapo.integrations.verl: worker hook not installed (%s)", WORKER_HOOK_ERROR)
        return False
    TrainingWorker.train_batch = _wrap_train_batch(TrainingWorker.train_batch)
    WORKER_HOOK_ERROR = None
    return True


install_worker_hook()
