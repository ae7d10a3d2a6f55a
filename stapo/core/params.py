"""The paper's values and the parameter dataclasses of the S2T and 20-Entropy masks, written once and without torch
(the config schema, stapo/config.py, imports them at start-up; the masks, stapo/core/masks.py, use them as defaults).

Sources: docs/method.md#s2t-mask (τ_p, q, the quantile's pool) and docs/method.md#20-entropy (the kept ratio).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["QuantileScope", "QUANTILE_SCOPES", "PROB_THRESHOLD", "ENTROPY_QUANTILE", "QUANTILE_SCOPE",
           "TOP_ENTROPY_RATIO", "S2TParams", "TopEntropyParams"]

QuantileScope = Literal["candidates", "all"]
QUANTILE_SCOPES: tuple[str, ...] = get_args(QuantileScope)  # the values S2T's quantile pool may take

#: The paper's values: every mask default, the config schema (:class:`S2TParams` is the ``algorithm.s2t`` section),
#: the objectives and the verl plugin read them.
PROB_THRESHOLD = 0.002  # τ_p: S2T's absolute probability threshold
ENTROPY_QUANTILE = 0.75  # q: τ_h is the q-quantile of the candidates' entropy (paper v4)
QUANTILE_SCOPE: QuantileScope = "candidates"  # the pool of that quantile ("all": the v1 text, with q = 0.80)
TOP_ENTROPY_RATIO = 0.2  # 20-Entropy keeps the top 20 % highest-entropy tokens


@dataclass
class S2TParams:
    """Parameters of :func:`stapo.core.masks.s2t_mask` (docs/method.md#s2t-mask): the config section
    ``algorithm.s2t`` itself (:class:`stapo.config.AlgorithmConfig`), read by the S2T ablations too."""

    prob_threshold: float = PROB_THRESHOLD  # τ_p
    entropy_quantile: float = ENTROPY_QUANTILE  # q
    # "candidates" (v4) or "all" (v1 text). Typed str, not QuantileScope: the verl plugin checks mask parameters
    # with verl's OmegaConf 2.3, which refuses Literal fields; stapo.config.validate checks the two values.
    quantile_scope: str = QUANTILE_SCOPE


@dataclass
class TopEntropyParams:
    """Parameters of :func:`stapo.core.masks.top_entropy_mask` (docs/method.md#20-entropy), config key
    ``algorithm.top_entropy_ratio``."""

    ratio: float = TOP_ENTROPY_RATIO
