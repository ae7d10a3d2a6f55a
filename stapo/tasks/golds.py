"""Gold answers checked at load: the golds the grader cannot parse, counted and reported per file.

The grader (:mod:`stapo.tasks.grader`) parses every gold answer with math-verify
(:func:`stapo.tasks.grader.parse_gold`). A gold that math-verify cannot turn into a mathematical object (``\\frac{``,
``\\sqrt``, ``\\begin{cases}...``, ``-1./3``, ``np.arcsin(10/13)``; :func:`stapo.tasks.grader.gold_parses`) can only
match a response that repeats it as text, so every other response to its problem would read as a wrong answer.
:func:`check_golds` finds them when a training or evaluation file is loaded and says so in one line (file, count, first
rows); the grader grades their other responses ``error`` (``GoldUnparseable``), never ``incorrect``. More than a
configurable fraction of a file refuses it (:class:`stapo.tasks.data.DataError`, one line naming the file and the key):
``data.max_unparsable_gold_fraction`` of train.py and of evaluate.py, default :data:`DEFAULT_MAX_FRACTION`.

Measured on the shipped data (math-verify 0.9.0): AIME24, AIME25, AMC23, MATH500 and DAPO-Math-17k 0; Minerva 6 of
272 (2.2 %); OlympiadBench 4 of 675 (0.6 %); MATH train 12 of 7,470 (0.16 %): all load with the default 0.05.

A check parses each distinct gold once; its result is cached (``$STAPO_CACHE_DIR/gold_checks.json`` or
``~/.cache/stapo/gold_checks.json``, keyed by the math-verify version and the golds), so a file is parsed once, not
per launch. On the main thread math-verify's own parsing timeout (5 s) applies; a gold that times out counts as
unparsable.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from stapo.common.fingerprint import json_digest
from stapo.tasks.data import DataError
from stapo.tasks.grader import gold_parses

__all__ = ["DEFAULT_MAX_FRACTION", "GRADED_AS_ERRORS", "GoldCheck", "unparsable_golds", "check_golds"]

#: Default of ``data.max_unparsable_gold_fraction`` (train.py and evaluate.py): a file with more unparsable golds is
#: refused. The shipped files have at most 2.2 % (Minerva).
DEFAULT_MAX_FRACTION = 0.05
#: What :meth:`GoldCheck.line` says becomes of the problems of unparsable golds (the evaluation's grader).
GRADED_AS_ERRORS = ("their responses are graded 'error' (GoldUnparseable) unless they repeat the gold as text, "
                    "never 'incorrect'")
_PARSE_TIMEOUT_S = 5
_CACHE_ENTRIES = 64
_SHOWN = 5


def _cache_file() -> Path:
    root = os.environ.get("STAPO_CACHE_DIR")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "stapo") / "gold_checks.json"


def _cache_key(golds: Sequence[str]) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        mv = version("math-verify")
    except PackageNotFoundError:
        mv = "unknown"
    return json_digest([mv, sorted(golds)])


def _cache_read() -> dict:
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _cache_write(key: str, bad: list[str]) -> None:
    path = _cache_file()
    try:
        data = _cache_read()
        data.pop(key, None)
        data[key] = bad
        while len(data) > _CACHE_ENTRIES:  # oldest first (dicts keep insertion order)
            data.pop(next(iter(data)))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass  # a failed cache write costs a re-parse next time, nothing else


def unparsable_golds(golds: Sequence[str]) -> set[str]:
    """The distinct golds of ``golds`` that math-verify cannot parse (:func:`stapo.tasks.grader.gold_parses`), cached.

    Example: ``unparsable_golds(["34", "\\\\frac{", "34"])`` → ``{"\\\\frac{"}``.
    """
    distinct = sorted(set(golds))
    if not distinct:
        return set()
    key = _cache_key(distinct)
    hit = _cache_read().get(key)
    if isinstance(hit, list):
        return set(hit)

    timeout = _PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    bad = [g for g in distinct if not gold_parses(g, timeout)]
    _cache_write(key, bad)
    return set(bad)


@dataclass
class GoldCheck:
    """The golds of one file that the grader cannot parse.

    Attributes:
        where: the file (or the set's name for a generated set).
        total: golds checked (records loaded from the file).
        positions: positions in the records list of the unparsable golds.
        rows: their file rows (0-based, as in the loaders' messages).
        golds: their gold answers (same order).
    """

    where: str
    total: int
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    golds: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Unparsable golds."""
        return len(self.positions)

    @property
    def fraction(self) -> float:
        """``count / total`` (0 for an empty file)."""
        return self.count / self.total if self.total else 0.0

    def _first(self) -> str:
        rows = ", ".join(str(r) for r in self.rows[:_SHOWN]) + (", ..." if self.count > _SHOWN else "")
        return f"rows {rows}; first {self.golds[0][:60]!r}"

    def line(self, key: str, limit: float, consequence: str = GRADED_AS_ERRORS) -> str:
        """The one-line report of a file whose unparsable golds are accepted (``count`` ≤ ``limit`` · ``total``);
        ``consequence`` says what becomes of their problems."""
        return (f"{self.where}: {self.count} of {self.total} gold answers cannot be parsed by math-verify, the "
                f"grader's parser ({self._first()}): {consequence}; {key}={limit:g} refuses a file above that "
                f"fraction")

    def refusal(self, key: str, limit: float) -> str:
        """The one-line refusal of a file with more unparsable golds than ``limit`` · ``total``."""
        return (f"{self.where}: {self.count} of {self.total} gold answers ({100 * self.fraction:.1f} %) cannot be "
                f"parsed by math-verify, the grader's parser ({self._first()}): more than {key}={limit:g}; fix the "
                f"golds (or the column they are read from), or raise {key} (1 accepts every file)")


def check_golds(golds: Sequence[str], *, where: str, key: str, max_fraction: float,
                rows: Sequence[int] | None = None, report: Callable[[str], None] | None = None,
                consequence: str = GRADED_AS_ERRORS) -> GoldCheck:
    """Count the golds of one file that the grader cannot parse; report them in one line; refuse too many.

    Args:
        golds: the file's gold answers (normalised, :attr:`stapo.tasks.records.Record.answer`), in record order.
        where: the file (for the messages).
        key: the config key of the threshold (``data.max_unparsable_gold_fraction``), named in the messages.
        max_fraction: the largest accepted fraction of unparsable golds (0 refuses any, 1 accepts all).
        rows: the file row of each gold (:attr:`stapo.tasks.data.LoadedSet.rows`); default their positions.
        report: where the one-line report goes when some golds are unparsable and the file is accepted (default:
            stderr); not called when every gold parses.
        consequence: what the report says becomes of their problems (default :data:`GRADED_AS_ERRORS`).

    Returns:
        :class:`GoldCheck`.

    Raises:
        stapo.tasks.data.DataError: more than ``max_fraction`` of the golds are unparsable (one line: file, count,
            first rows, the key).
    """
    golds = list(golds)
    rows = list(rows) if rows is not None and len(rows) == len(golds) else list(range(len(golds)))
    bad = unparsable_golds(golds)
    check = GoldCheck(where=where, total=len(golds))
    for i, g in enumerate(golds):
        if g in bad:
            check.positions.append(i)
            check.rows.append(rows[i])
            check.golds.append(g)
    if check.count and check.fraction > max_fraction:
        raise DataError(check.refusal(key, max_fraction))
    if check.count:
        (report or (lambda text: print(text, file=sys.stderr, flush=True)))(check.line(key, max_fraction, consequence))
    return check
