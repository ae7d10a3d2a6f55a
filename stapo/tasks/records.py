"""The one record type every data source produces (benchmarks, training sets, synthetic arithmetic).

Its own module so that :mod:`stapo.tasks.data` and :mod:`stapo.tasks.synthetic` both import it without importing each
other; ``stapo.tasks.data.Record`` re-exports it.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Record"]


@dataclass(frozen=True)
class Record:
    """One problem.

    Attributes:
        id: unique within its source, ``"<source>/<original id or row index>"``.
        problem: problem statement (no instruction suffix; see :mod:`stapo.tasks.prompts`).
        answer: normalised gold answer (LaTeX, no ``$`` delimiters).
        source: dataset name (``"aime24"``, ..., ``"dapo_math_17k"``, ``"synthetic_arithmetic"``, or the name of
            a file-backed set from a config).
    """

    id: str
    problem: str
    answer: str
    source: str
