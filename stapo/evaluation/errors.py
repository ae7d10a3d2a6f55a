"""The one exception type of the evaluation harness.

``evaluate.py`` and ``scripts/compare.py`` print an :class:`EvalError` as a one-line message and exit
non-zero (no stack trace): every problem a user can cause — an unknown benchmark, a missing data root, a
malformed model or checkpoint path, a run directory made with other generation settings — raises it with a
message that names the offending value.
"""
from __future__ import annotations

__all__ = ["EvalError"]


class EvalError(ValueError):
    """A user-facing evaluation problem; ``str(error)`` is a complete one-line explanation."""
