"""Append-only JSONL store of graded generations, one file per (benchmark, decoding setting).

Each line is one sample: ``{"problem_id", "sample", ...}`` (fields listed in :mod:`stapo.evaluation.runner`).
The key ``(problem_id, sample)`` is unique in a file: :meth:`GenerationStore.append` skips keys already
present, so a rerun never duplicates a generation.

Crash safety: a block of samples is written with one ``write`` of whole lines, then flushed and fsync'ed. A
process killed during that write can leave a last line without its newline; opening the store cuts such a
torn tail off (counted in :attr:`GenerationStore.torn_bytes`, one line on stderr) before anything is appended
— the rule of the training run's ``metrics.jsonl`` / ``tables.jsonl`` (:mod:`stapo.run.tracking`); the cut samples
are generated again. A *complete* line
that is not valid JSON is never dropped silently: it raises :class:`~stapo.evaluation.errors.EvalError`
naming the file and line.

Content keys: a record carries the ``content`` key of its problem (:func:`stapo.evaluation.identity.content_key`
over the problem text and gold). Opened with ``current`` (``{problem_id: (content key, gold)}``, the problems as
loaded now), the store sets aside the stored samples of a problem whose text or gold changed since (another
``content``; a record written before content keys is matched by its ``gold``): they are moved to
``superseded/<file name>`` beside the file (appended; never deleted), the file keeps the others, one line on stderr
says so, and the problem counts as not stored (it is generated and graded again).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

from stapo.evaluation.errors import EvalError

__all__ = ["GenerationStore"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class GenerationStore:
    """The samples of one JSONL file, loaded on construction.

    Args:
        path: the JSONL file (created with its parent folders on the first append).
        read_only: leave the file as it is (``evaluate.py --dry-run``): a torn last line and superseded samples are
            only left out.
        current: ``{problem_id: (content key, gold)}`` of the problems as loaded now; samples of these problems made
            from other content are superseded (module docstring). None: every stored sample counts.

    Attributes:
        records: ``{(problem_id, sample): record dict}`` in file order.
        torn_bytes: bytes of an incomplete last line that were cut off (left out, ``read_only``) when the file was
            opened.
        superseded: samples set aside because their problem's text or gold changed.

    Raises:
        EvalError: a complete line is not a JSON object with ``problem_id`` (str) and ``sample`` (int).
    """

    def __init__(self, path: str | os.PathLike, read_only: bool = False,
                 current: Mapping[str, tuple[str, str]] | None = None) -> None:
        self.path = Path(path)
        self.read_only = read_only  # a dry run: a torn last line is left out in memory, not cut from the file
        self.current = dict(current) if current is not None else None
        self.records: dict[tuple[str, int], dict[str, Any]] = {}
        self._by_problem: dict[str, dict[int, dict[str, Any]]] = {}
        self.torn_bytes = 0
        self.duplicates_ignored = 0
        self.superseded = 0
        if self.path.exists():
            self._load()

    def _stale(self, rec: dict[str, Any]) -> bool:
        """Whether ``rec`` was made from other content than its problem's current one (module docstring)."""
        if self.current is None or rec["problem_id"] not in self.current:
            return False
        key, gold = self.current[rec["problem_id"]]
        if rec.get("content") is not None:
            return rec["content"] != key
        return "gold" in rec and rec["gold"] != gold  # a record from before content keys: its gold is all we have

    def _set_aside(self, stale_lines: list[str], kept_lines: list[str], problems: set[str]) -> None:
        """Move the superseded lines to ``superseded/<name>`` (appended, fsync'ed), then rewrite the file with the
        others (temporary file + rename): a crash between the two leaves copies, never a loss."""
        aside = self.path.parent / "superseded" / self.path.name
        try:
            aside.parent.mkdir(parents=True, exist_ok=True)
            with open(aside, "a", encoding="utf-8") as f:
                f.write("".join(stale_lines))
                f.flush()
                os.fsync(f.fileno())
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(kept_lines))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            from stapo.run.preflight import write_error

            raise write_error(e, aside) from None
        print(f"{self.path}: {len(stale_lines)} samples of {len(problems)} problems whose text or gold changed since "
              f"they were made (e.g. {sorted(problems)[0]}) moved to {aside}; those problems are generated and "
              f"graded again", file=sys.stderr, flush=True)

    def _load(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1  # 0 when the only line is torn
            self.torn_bytes = len(data) - cut
            data = data[:cut]
            if not self.read_only:
                with open(self.path, "r+b") as f:
                    f.truncate(cut)
                    f.flush()
                    os.fsync(f.fileno())
                # one line on stderr, as stapo.run.tracking.Tracker.truncate_after says it for metrics.jsonl /
                # tables.jsonl
                print(f"{self.path}: cut {self.torn_bytes} bytes of a torn last line (an interrupted write)",
                      file=sys.stderr, flush=True)
        kept_lines: list[str] = []
        stale_lines: list[str] = []
        stale_problems: set[str] = set()
        # split on "\n" only: str.splitlines would also cut at U+2028 / U+0085, which a response may hold (JSON
        # written with ensure_ascii=False keeps them raw inside a string)
        for lineno, line in enumerate(data.decode("utf-8").split("\n"), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = (rec["problem_id"], rec["sample"])
                if not isinstance(key[0], str) or not isinstance(key[1], int):
                    raise TypeError("problem_id must be str and sample int")
            except (ValueError, KeyError, TypeError) as exc:
                raise EvalError(f"{self.path}: line {lineno} is not a valid generation record ({exc}); "
                                f"move the file away to regenerate it") from None
            if self._stale(rec):
                stale_lines.append(line + "\n")
                stale_problems.add(key[0])
                continue
            kept_lines.append(line + "\n")
            if key in self.records:
                self.duplicates_ignored += 1
                continue
            self._add(key, rec)
        self.superseded = len(stale_lines)
        if stale_lines and not self.read_only:
            self._set_aside(stale_lines, kept_lines, stale_problems)

    def _add(self, key: tuple[str, int], rec: dict[str, Any]) -> None:
        self.records[key] = rec
        self._by_problem.setdefault(key[0], {})[key[1]] = rec

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self.records

    def samples_of(self, problem_id: str) -> list[dict[str, Any]]:
        """The stored records of one problem, sorted by sample index."""
        by_sample = self._by_problem.get(problem_id, {})
        return [by_sample[j] for j in sorted(by_sample)]

    def complete(self, problem_id: str, n: int) -> bool:
        """Whether samples ``0..n-1`` of ``problem_id`` are all stored."""
        by_sample = self._by_problem.get(problem_id, {})
        return all(j in by_sample for j in range(n))

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        """Append the records whose ``(problem_id, sample)`` is new, in one write, then flush and fsync.

        Args:
            records: dicts with at least ``problem_id`` (str) and ``sample`` (int); values must be JSON-serialisable
                (non-finite floats are written as ``null``).

        Returns:
            Number of records written.

        Raises:
            OSError: the write failed (full disk, quota, read-only): same errno, the message names the file.
        """
        lines = []
        for rec in records:
            key = (rec["problem_id"], int(rec["sample"]))
            if key in self.records:
                continue
            self._add(key, rec)
            lines.append(json.dumps({k: _jsonable(v) for k, v in rec.items()}, ensure_ascii=False) + "\n")
        if not lines:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # full disk, quota: name the file (a torn last line is cut when the store reopens)
            from stapo.run.preflight import write_error

            raise write_error(e, self.path) from None
        return len(lines)
