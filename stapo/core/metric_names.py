"""The one metric vocabulary of the native trainer and the verl plugin, and the names of runs logged before it.

Every chart is shared between a native run (``train.py``) and a cluster run (verl + :mod:`stapo.integrations.verl`)
when both log the same quantity under the same key. verl's own keys cannot change, so the vocabulary is verl's
wherever verl has the quantity, and ours follow the two constraints verl puts on a plugin:

* verl's driver prefixes every metric the actor worker returns with ``actor/`` (``rename_dict(..., "actor/")``,
  verl/trainer/ppo/ray_trainer.py ``_update_actor``), so the plugin's mask statistics can only be ``actor/<...>``:
  the mask statistics are ``actor/<mask prefix>/<statistic>`` in both (:func:`mask_stat_key`; the prefix is the
  mask's registered one, :attr:`stapo.core.masks.MaskSpec.prefix`: ``actor/s2t/num_masked``,
  ``actor/top_entropy/kept_frac``), applied once by :func:`stapo.core.objectives.compute_token_mask`;
* verl logs validation as ``val-core/<data_source>/<var>/<metric>`` (``_val_metrics_update``, ray_trainer.py;
  ``process_validation_metrics``, verl/trainer/ppo/metric_utils.py) with ``<var>`` = ``acc`` when the reward returns
  an ``acc`` column (ours does, :mod:`stapo.integrations.verl_reward`), ``<data_source>`` the benchmark name
  (scripts/verl/prepare_verl_data.py) and ``<metric>`` = ``mean@<N>`` — the mean over problems of the share of the
  N samples that are correct, i.e. our avg@N. The native validation uses the same key (:func:`val_key`).

The table of every key is docs/metrics.md. :data:`LEGACY_NAMES` and :func:`current_name` map the keys of runs
logged before this vocabulary (``s2t/*``, ``val/<setting>/<benchmark>/avg@N``, the plugin's
``actor/<loss_mode>/num_kept_tokens``) to the current ones, so scripts/summarize_run.py and
scripts/compare_metrics.py read old runs and results/reference/*.jsonl.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

__all__ = [
    "ACTOR_PREFIX",
    "NUM_KEPT_TOKENS",
    "VAL_VAR",
    "mask_stat_key",
    "val_key",
    "val_source",
    "LEGACY_NAMES",
    "current_name",
    "rename_legacy",
    "masked_fraction_key",
]

#: Section of everything the policy update logs (verl adds it to every actor-worker metric).
ACTOR_PREFIX = "actor"
#: Response tokens that received gradient this step (after the token mask), native and plugin.
NUM_KEPT_TOKENS = "actor/num_kept_tokens"
#: verl's validation variable: ``acc`` (1.0 correct / 0.0 not) when the reward returns it, as ours does.
VAL_VAR = "acc"

#: The mask prefixes and statistics of the masks this package registers (stapo/core/masks.py), for LEGACY_NAMES.
_MASK_STATS = {
    "s2t": ("num_response_tokens", "num_candidates", "num_masked", "masked_frac", "entropy_threshold",
            "masked_prob_mean", "masked_entropy_mean", "masked_adv_mean"),
    "top_entropy": ("num_response_tokens", "num_kept", "kept_frac", "entropy_threshold"),
}
_MASK_STATS.update({p: _MASK_STATS["s2t"] for p in ("s2t_high_entropy", "s2t_random", "full_low_prob")})
#: verl loss modes of the plugin (stapo/integrations/verl.py PLUGIN_LOSSES at the time of the rename).
_PLUGIN_LOSS_MODES = ("stapo", "entropy20", "stapo_high_entropy", "stapo_random", "justrl_fullmask")


def mask_stat_key(mask_prefix: str, stat: str) -> str:
    """The key of a token mask's statistic: ``actor/<mask prefix>/<stat>`` (e.g. ``actor/s2t/num_masked``)."""
    return f"{ACTOR_PREFIX}/{mask_prefix}/{stat}"


def val_source(benchmark: str, setting: str | None = None) -> str:
    """The ``<data_source>`` segment of a validation key: the benchmark name (verl's data_source), or
    ``<benchmark>@<setting>`` when one validation samples several decoding settings (``aime24@t0.7_p0.9``)."""
    return benchmark if setting is None else f"{benchmark}@{setting}"


def val_key(source: str, metric: str, *, core: bool = True, var: str | None = VAL_VAR, prefix: str = "val") -> str:
    """A validation key in verl's layout ``val-core/<source>/<var>/<metric>`` (``val-aux`` when ``core`` is False;
    without the ``<var>`` segment when ``var`` is None; ``prefix`` replaces ``val`` in the section name).

    Example: ``val_key("aime24", "mean@32")`` → ``"val-core/aime24/acc/mean@32"``, verl's key for avg@32 on AIME24.
    """
    section = f"{prefix}-core" if core else f"{prefix}-aux"
    return "/".join(p for p in (section, source, var, metric) if p is not None)


LEGACY_NAMES: dict[str, str] = {
    # native mask statistics: <prefix>/<stat> → actor/<prefix>/<stat>
    **{f"{p}/{s}": mask_stat_key(p, s) for p, stats in _MASK_STATS.items() for s in stats},
    # the plugin's kept-token count: actor/<loss_mode>/num_kept_tokens → actor/num_kept_tokens
    **{f"actor/{m}/num_kept_tokens": NUM_KEPT_TOKENS for m in _PLUGIN_LOSS_MODES},
    # the plugin's mask statistics were already actor/<prefix>/<stat>: unchanged.
}
#: Old in-training validation keys (``val/<setting>/<benchmark>/<metric>``, ``val/<setting>/<aggregate>``,
#: ``val/<benchmark>/dropped_long_prompt``) → a template of the new key; ``{n}`` is the number of samples N.
_LEGACY_VAL = [
    (re.compile(r"val/[^/]+/(?P<src>[^/]+)/avg@N"), "val-core/{src}/acc/mean@{n}"),
    (re.compile(r"val/[^/]+/(?P<src>[^/]+)/pass@N"), "val-core/{src}/acc/pass@{n}"),
    (re.compile(r"val/[^/]+/(?P<src>[^/]+)/maj@N"), "val-core/{src}/acc/maj@{n}"),
    (re.compile(r"val/[^/]+/mean_response_tokens"), "val-aux/response_length/mean"),
    (re.compile(r"val/[^/]+/truncation_rate"), "val-aux/response_length/clip_ratio"),
    (re.compile(r"val/[^/]+/no_answer_rate"), "val-aux/grader/no_answer_rate"),
    (re.compile(r"val/[^/]+/grader_timeouts"), "val-aux/grader/timeouts"),
    (re.compile(r"val/[^/]+/grader_errors"), "val-aux/grader/errors"),
    (re.compile(r"val/(?P<src>[^/]+)/dropped_long_prompt"), "val-aux/{src}/dropped_long_prompt"),
]


def current_name(key: str, samples: int | None = None) -> str:
    """The current name of a metric key (unchanged when it is current or unknown).

    Args:
        key: a key of a ``metrics.jsonl`` row or W&B history, old or new.
        samples: N of the run's in-training validation (``validation.samples`` of its config.yaml); the old
            validation keys wrote a literal ``@N``, the new ones the number. None keeps the literal ``N``.

    Example: ``current_name("s2t/masked_frac")`` → ``"actor/s2t/masked_frac"``;
    ``current_name("val/t1.0_p1.0/math500/avg@N", 4)`` → ``"val-core/math500/acc/mean@4"``.
    (One decoding setting per old run is assumed, as the train config's validation has: the setting is dropped.)
    """
    if key in LEGACY_NAMES:
        return LEGACY_NAMES[key]
    if key.startswith("val/"):
        for pattern, template in _LEGACY_VAL:
            m = pattern.fullmatch(key)
            if m:
                return template.format(n="N" if samples is None else int(samples), **m.groupdict())
    return key


def rename_legacy(row: Mapping[str, Any], samples: int | None = None) -> dict[str, Any]:
    """A ``metrics.jsonl`` row with every key under its current name (:func:`current_name`); a row already in the
    current vocabulary comes back equal. Raises ValueError if two keys of the row map to the same name."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        new = current_name(k, samples)
        if new in out:
            raise ValueError(f"metrics row has both {new!r} and a legacy key mapping to it ({k!r})")
        out[new] = v
    return out


def masked_fraction_key(rows: Sequence[dict[str, Any]]) -> str | None:
    """The run's masked-fraction metric: ``actor/s2t/masked_frac`` (STAPO), else the first
    ``actor/<mask>/masked_frac`` of the first row that has one (the S2T ablations' masks; not the step-0
    validation-only row), else None (GRPO, JustRL, 20-Entropy mask no token). Keys as in docs/metrics.md."""
    for row in rows:
        keys = [k for k in row if k.startswith("actor/") and k.endswith("/masked_frac") and k.count("/") == 2]
        if keys:
            return "actor/s2t/masked_frac" if "actor/s2t/masked_frac" in keys else keys[0]
    return None
