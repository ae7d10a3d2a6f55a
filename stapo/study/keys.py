"""Every metrics.jsonl key a study report reads (:mod:`stapo.study.report`), in one place: the keys of the one
metric vocabulary (docs/metrics.md, :mod:`stapo.core.metric_names`). The study config checks ``report.metrics``
against :data:`METRICS`."""
from __future__ import annotations

__all__ = ["METRICS", "LABELS", "COST_KEYS", "QUADRANTS", "QUADRANT_STATS", "quadrant_key"]

#: Every metrics.jsonl key the report's curves and final table read: report name → candidate keys. A run uses the
#: first candidate it logs (the S2T ablations log their mask under their own prefix); a candidate with ``*`` is a
#: pattern (:mod:`fnmatch`) and gives one series per matching key (one per validation decoding setting).
METRICS: dict[str, tuple[str, ...]] = {
    "reward": ("critic/score/mean",),
    "accuracy": ("reward/grader/accuracy",),
    "entropy": ("actor/entropy",),
    "masked_frac": ("actor/s2t/masked_frac", "actor/s2t_random/masked_frac", "actor/s2t_high_entropy/masked_frac",
                    "actor/full_low_prob/masked_frac"),
    # what S2T would silence at the old policy, logged by every objective (docs/metrics.md)
    "s2t_would_masked_frac": ("s2t/would_mask/masked_frac",),
    "response_length": ("response_length/mean",),
    "grad_norm": ("actor/grad_norm",),
    "val_accuracy": ("val-core/average*/acc/mean@*",),
}
#: Axis titles of :data:`METRICS`.
LABELS: dict[str, str] = {
    "reward": "reward (mean, ±1)", "accuracy": "accuracy (math-verify)", "entropy": "entropy (nats / token)",
    "masked_frac": "masked fraction (own mask)",
    "s2t_would_masked_frac": "S2T masked fraction (every method)", "response_length": "response length (tokens)",
    "grad_norm": "grad norm", "val_accuracy": "validation avg@N", "final_eval": "final evaluation avg@N",
}
#: The cost line's keys: response tokens per step and wall seconds per step.
COST_KEYS: dict[str, str] = {"response_tokens": "response_length/total_tokens", "step_time": "timing_s/step"}

#: The token taxonomy's quadrants and statistics (stapo.core.analysis.quadrant_summary, logged by every objective as
#: ``s2t/quadrant/<quadrant>/<stat>``; docs/metrics.md): the report's quadrant table.
QUADRANTS: tuple[str, ...] = ("high_p_high_h", "high_p_low_h", "low_p_high_h", "low_p_low_h")
QUADRANT_STATS: tuple[str, ...] = ("share", "grad_norm", "entropy_change")


def quadrant_key(quadrant: str, stat: str) -> str:
    """The metrics.jsonl key of a quadrant statistic, e.g. ``s2t/quadrant/low_p_low_h/grad_norm``."""
    return f"s2t/quadrant/{quadrant}/{stat}"
