"""Evaluation harness: six math benchmarks × two decoding settings, avg@N / pass@k / maj@N, resumable.

One file per concern:

  config        EvalConfig schema (configs/eval/*.yaml), the paper's N and decoding settings
  model_source  what ``--model`` names (HF folder, train.py checkpoint or run, embedded SmolLM2, hub id)
  store         append-only JSONL of graded generations (torn-write repair, no duplicates)
  metrics       avg@N, unbiased pass@k, maj@N (deterministic tie-break), benchmark summaries
  runner        blocks → engine → grader (→ verifier) → JSONL → metrics; :func:`run_evaluation`
  report        paper-layout Markdown table, CSV, bar chart, W&B summary (at the training step), comparisons,
                the sweep's accuracy-against-step table and chart
  sweep         every checkpoint of a train.py run in turn (``model.checkpoints``; resumable), one W&B curve
  verifier      optional LLM-verifier fallback (CompassVerifier-style A/B/C verdicts)
  validation    the in-training validation hook for ``Trainer(cfg, validation_hook=...)``
  errors        EvalError (one-line user-facing messages)

Entry points: ``python evaluate.py`` and ``python scripts/compare.py``. Importing this package does not import
torch; the model and engine are loaded only when generations are missing.
"""
from stapo.evaluation.config import (
                                     PAPER_SAMPLES,
                                     PAPER_SETTINGS,
                                     DecodingSetting,
                                     EvalConfig,
                                     canonical_benchmark,
                                     load_eval_config,
)
from stapo.evaluation.errors import EvalError
from stapo.evaluation.metrics import avg_at_n, majority_vote, pass_at_k, summarize_benchmark
from stapo.evaluation.model_source import ModelSource, resolve_model_source
from stapo.evaluation.runner import evaluate_problems, run_evaluation
from stapo.evaluation.validation import ValidationHook, make_validation_hook, make_validation_hook_from_config

__all__ = [
    "PAPER_SAMPLES",
    "PAPER_SETTINGS",
    "DecodingSetting",
    "EvalConfig",
    "EvalError",
    "ModelSource",
    "ValidationHook",
    "avg_at_n",
    "canonical_benchmark",
    "evaluate_problems",
    "load_eval_config",
    "majority_vote",
    "make_validation_hook",
    "make_validation_hook_from_config",
    "pass_at_k",
    "resolve_model_source",
    "run_evaluation",
    "summarize_benchmark",
]
