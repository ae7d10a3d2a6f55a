"""Loaders for the six evaluation benchmarks and the RL training sets, into one record type.

Data root layout (``data.root`` in the configs; ``../shared/data`` in the sandbox; built by
``scripts/prepare_data.py``)::

    <root>/benchmarks/<name>/test.jsonl   aime24 aime25 amc23 math500 minerva_math olympiadbench
    <root>/train/dapo_math_17k.parquet    DAPO-Math-17k, deduplicated, verl format
    <root>/train/math_train_7474.json     MATH train with final answers (JSON list)

Every built-in set is one entry of :data:`BENCHMARK_REGISTRY` (:class:`Benchmark`) or :data:`TRAIN_REGISTRY`
(:class:`TrainSet`); the name tables (``BENCHMARKS``, ``EXPECTED_ROWS``, the eval config's ``PAPER_SAMPLES`` and
``BENCHMARK_ALIASES``, the reports' ``DISPLAY_NAMES``, ...) derive from them.  A user's own JSONL / JSON / parquet
file is loaded by config with :class:`FileSetConfig` / :func:`load_file_set` (read with Hugging Face
``datasets``; see docs/extending.md).

Every loader returns a :class:`LoadedSet`: ``records`` (:class:`Record`: ``id, problem, answer,
source``) and ``stats`` (:class:`LoadStats`: rows read, rows kept, rows skipped by reason).
Errors name the file and the row.  Benchmarks default to ``on_bad_row="raise"`` (an evaluation set
must be complete); training sets default to ``on_bad_row="skip"`` (a row without a usable answer is
dropped and *counted* in ``stats.skipped``, and a warning is logged).

Gold-answer normalisation per source (:func:`normalize_gold`; see
``shared/data/benchmarks/SOURCES.md`` for the raw fields):

* aime24 ``answer`` (str; an enclosing ``\\boxed{}`` is removed if present) and aime25 ``answer``:
  integer strings are canonicalised (``"025"`` -> ``"25"``);
* amc23 ``answer`` is a float: ``27.0`` -> ``"27"``;
* math500 ``answer`` as is (whitespace and ``$`` delimiters stripped);
* minerva_math has no answer field: gold = content of the last ``\\boxed{}`` of ``solution``;
* olympiadbench ``final_answer`` is a list with one string; its ``$`` delimiters are removed
  (``"$69$,$84$"`` -> ``"69,84"``); the problem is ``question`` (preceded by ``context`` when set);
* aime25 uses ``question`` for the problem text;
* dapo_math_17k: problem = ``prompt[0].content``, answer = ``reward_model.ground_truth``;
* math_train: ``problem`` / ``answer``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Optional, Sequence

from stapo.boxed import BOX_OPEN, last_boxed_content
from stapo.records import Record
from stapo.synthetic import generate_arithmetic
from stapo.word_problems import generate_word_problems

__all__ = [
    "Benchmark",
    "TrainSet",
    "BENCHMARK_REGISTRY",
    "TRAIN_REGISTRY",
    "BENCHMARKS",
    "TRAIN_SETS",
    "EXPECTED_ROWS",
    "Record",
    "LoadStats",
    "LoadedSet",
    "DataError",
    "DataFileNotFoundError",
    "resolve_data_root",
    "benchmark_path",
    "train_path",
    "normalize_gold",
    "load_benchmark",
    "load_benchmarks",
    "load_dapo_math_17k",
    "load_math_train",
    "load_train_set",
    "FileSetConfig",
    "load_file_set",
    "save_records_jsonl",
    "load_records_jsonl",
]

logger = logging.getLogger(__name__)

_INT_RE = re.compile(r"[+-]?\d+")

OnBadRow = Literal["raise", "skip"]


@dataclass
class LoadStats:
    """What a loader read.

    Attributes:
        source: dataset name.
        path: file read (``""`` for generated sets).
        rows_read: rows found in the file (blank JSONL lines are not rows).
        rows_loaded: records returned.
        skipped_by_reason: ``{reason: count}`` of rows dropped (``on_bad_row="skip"``).
        first_skipped: up to 10 ``"row N: reason"`` strings, for the log.
    """

    source: str
    path: str
    rows_read: int = 0
    rows_loaded: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    first_skipped: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        """Total rows skipped."""
        return sum(self.skipped_by_reason.values())

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable), with ``skipped`` added."""
        out = asdict(self)
        out["skipped"] = self.skipped
        return out


@dataclass
class LoadedSet:
    """Records plus the :class:`LoadStats` of the load.  Iterable and indexable like a list.

    ``rows``: the file row (0-based, as in error messages) of each record, for messages that name rows (skipped rows
    make them differ from the record's position); empty for a set built without a file."""

    records: list[Record]
    stats: LoadStats
    rows: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __getitem__(self, index: int) -> Record:
        return self.records[index]


class DataError(ValueError):
    """A data file is missing, unreadable, or has a bad row; the message names file and row."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """An expected data file does not exist."""


class _RowError(Exception):
    """Internal: one row cannot be converted (message = reason)."""


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


def resolve_data_root(root: str | os.PathLike | None = None) -> Path:
    """The data root: ``root`` if given, else ``$STAPO_DATA_ROOT``, else ``./data``.

    Raises:
        DataFileNotFoundError: the directory does not exist.
    """
    chosen = root if root is not None else os.environ.get("STAPO_DATA_ROOT", "data")
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise DataFileNotFoundError(
            f"data root {path} is not a directory (set data.root or $STAPO_DATA_ROOT, "
            f"or build it with scripts/prepare_data.py)"
        )
    return path


def benchmark_path(root: str | os.PathLike, name: str) -> Path:
    """``<root>/benchmarks/<name>/test.jsonl``.  Raises ``ValueError`` for an unknown name."""
    if name not in BENCHMARK_BY_NAME:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    return Path(root) / BENCHMARK_BY_NAME[name].relpath


def train_path(root: str | os.PathLike, name: str) -> Path:
    """``<root>/train/<file>`` for ``dapo_math_17k`` / ``math_train``.  ``ValueError`` otherwise."""
    if name not in TRAIN_FILES:
        raise ValueError(f"no training file for {name!r}; file-backed sets: {', '.join(TRAIN_FILES)}")
    return Path(root) / "train" / TRAIN_FILES[name]


def _require_file(path: Path, what: str) -> None:
    """A file under the data root (or given to a built-in loader): a missing one is built by scripts/prepare_data.py."""
    if not path.is_file():
        raise DataFileNotFoundError(
            f"{what}: file not found: {path} (build the data root with scripts/prepare_data.py)"
        )


def _require_user_file(path: Path, key: str) -> None:
    """The user's own file of config key ``key`` (``data.train_file.path``, ...): the message names the key (and, for
    a relative path, the working directory it is read from), not the data root."""
    if not path.is_file():
        where = "" if path.is_absolute() else f" (a relative path is read from the working directory {Path.cwd()})"
        raise DataFileNotFoundError(f"{key}: file not found: {path}{where}")


# ---------------------------------------------------------------------------------------------
# Gold-answer normalisation
# ---------------------------------------------------------------------------------------------


def _strip_dollars(text: str) -> str:
    """Remove unescaped ``$`` math delimiters (``\\$`` currency signs are kept)."""
    return re.sub(r"(?<!\\)\$", "", text)


def _whole_box_content(text: str) -> str | None:
    """Content of ``\\boxed{...}`` when that box spans all of ``text``, else ``None``."""
    if not text.startswith(BOX_OPEN):
        return None
    depth = 0
    for i in range(len(BOX_OPEN) - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[len(BOX_OPEN) : i] if i == len(text) - 1 else None
    return None


def normalize_gold(source: str, raw: Any, *, integer: bool | None = None) -> str:
    """Normalise a raw gold answer from ``source`` into the LaTeX string stored in :class:`Record`.

    Steps: numbers -> text (``27.0`` -> ``"27"``; a non-integral float keeps ``repr``); strip
    whitespace; remove unescaped ``$`` delimiters; remove one enclosing ``\\boxed{...}`` spanning
    the whole string; for integer-answer sources (aime24, aime25, amc23, dapo_math_17k) an integer
    string is canonicalised (``"025"`` -> ``"25"``, ``"+7"`` -> ``"7"``).

    Args:
        source: dataset name (decides the integer canonicalisation: its registry entry's
            ``integer_answers``).
        raw: ``str``, ``int`` or ``float`` (olympiadbench's list must be unpacked by the caller).
        integer: canonicalise integer strings; ``None`` (default) = as the registry says for ``source``
            (``False`` for a name not in the registry).

    Returns:
        Non-empty normalised string.

    Raises:
        ValueError: ``raw`` is ``None``, a bool, a non-finite float, another type, or empty after
            normalisation.
    """
    if raw is None:
        raise ValueError("answer is null")
    if isinstance(raw, bool):
        raise ValueError(f"answer is a bool ({raw})")
    if isinstance(raw, int):
        text = str(raw)
    elif isinstance(raw, float):
        if not math.isfinite(raw):
            raise ValueError(f"answer is {raw}")
        text = str(int(raw)) if raw.is_integer() else repr(raw)
    elif isinstance(raw, str):
        text = raw
    else:
        raise ValueError(f"answer has type {type(raw).__name__}, expected str or number")
    text = _strip_dollars(text.strip()).strip()
    inner = _whole_box_content(text)
    if inner is not None:
        text = inner.strip()
    if (source in _INTEGER_SOURCES if integer is None else integer) and _INT_RE.fullmatch(text):
        text = str(int(text))
    if not text:
        raise ValueError("answer is empty")
    return text


# ---------------------------------------------------------------------------------------------
# Row conversion per source
# ---------------------------------------------------------------------------------------------


def _field(row: dict, key: str) -> Any:
    if key not in row:
        raise _RowError(f"missing field {key!r} (fields present: {', '.join(sorted(row)) or 'none'})")
    return row[key]


def _text_field(row: dict, key: str) -> str:
    value = _field(row, key)
    if not isinstance(value, str):
        raise _RowError(f"field {key!r} is {type(value).__name__}, expected str")
    if not value.strip():
        raise _RowError(f"field {key!r} is empty")
    return value


def _gold(source: str, raw: Any, key: str) -> str:
    try:
        return normalize_gold(source, raw)
    except ValueError as exc:
        raise _RowError(f"field {key!r}: {exc}") from None


def _conv_aime24(row: dict, i: int) -> Record:
    return Record(f"aime24/{_field(row, 'id')}", _text_field(row, "problem"), _gold("aime24", _field(row, "answer"), "answer"), "aime24")


def _conv_aime25(row: dict, i: int) -> Record:
    return Record(f"aime25/{i}", _text_field(row, "question"), _gold("aime25", _field(row, "answer"), "answer"), "aime25")


def _conv_amc23(row: dict, i: int) -> Record:
    return Record(f"amc23/{_field(row, 'id')}", _text_field(row, "problem"), _gold("amc23", _field(row, "answer"), "answer"), "amc23")


def _conv_math500(row: dict, i: int) -> Record:
    return Record(
        f"math500/{_field(row, 'unique_id')}", _text_field(row, "problem"), _gold("math500", _field(row, "answer"), "answer"), "math500"
    )


def _conv_minerva(row: dict, i: int) -> Record:
    solution = _text_field(row, "solution")
    boxed = last_boxed_content(solution)
    if boxed is None:
        raise _RowError("field 'solution' has no closed \\boxed{...} to take the gold answer from")
    idx = row.get("idx", i)
    return Record(f"minerva_math/{idx}", _text_field(row, "problem"), _gold("minerva_math", boxed, "solution (last \\boxed{})"), "minerva_math")


def _conv_olympiad(row: dict, i: int) -> Record:
    final = _field(row, "final_answer")
    if not isinstance(final, list) or len(final) != 1:
        shape = f"list of {len(final)}" if isinstance(final, list) else type(final).__name__
        raise _RowError(f"field 'final_answer' is {shape}, expected a list with one string")
    question = _text_field(row, "question")
    context = row.get("context")
    problem = f"{context.strip()}\n\n{question}" if isinstance(context, str) and context.strip() else question
    return Record(f"olympiadbench/{_field(row, 'id')}", problem, _gold("olympiadbench", final[0], "final_answer[0]"), "olympiadbench")


def _conv_dapo(row: dict, i: int) -> Record:
    prompt = _field(row, "prompt")
    if not isinstance(prompt, (list, tuple)) or not prompt or not isinstance(prompt[0], dict):
        raise _RowError("field 'prompt' is not a non-empty list of {content, role} messages")
    problem = prompt[0].get("content")
    if not isinstance(problem, str) or not problem.strip():
        raise _RowError("field 'prompt[0].content' is missing or empty")
    reward_model = _field(row, "reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise _RowError("field 'reward_model' has no 'ground_truth'")
    extra = row.get("extra_info") or {}
    index = extra.get("index", i) if isinstance(extra, dict) else i
    return Record(f"dapo_math_17k/{index}", problem, _gold("dapo_math_17k", reward_model["ground_truth"], "reward_model.ground_truth"), "dapo_math_17k")


def _conv_math_train(row: dict, i: int) -> Record:
    return Record(f"math_train/{i}", _text_field(row, "problem"), _gold("math_train", _field(row, "answer"), "answer"), "math_train")


# ---------------------------------------------------------------------------------------------
# The registry: one entry per built-in data set; every table derives from it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Benchmark:
    """One evaluation benchmark: everything the loaders, the eval config and the reports know about it.

    Attributes:
        name: canonical name (config value, file folder, ``Record.source``).
        display: column title in tables (``"AIME24"``).
        samples: the paper's samples per problem N (docs/method.md#evaluation-protocol).
        aliases: other spellings accepted in eval configs (lower case).
        expected_rows: rows of the reference file (SOURCES.md); :mod:`scripts.prepare_data` checks it.
        integer_answers: canonicalise integer gold answers (``"025"`` -> ``"25"``).
        convert: ``(row dict, row index) -> Record``; raises ``_RowError`` naming the field.
        file: path under the data root (default ``benchmarks/<name>/test.jsonl``).
    """

    name: str
    display: str
    samples: int
    aliases: tuple[str, ...]
    expected_rows: int
    integer_answers: bool
    convert: Callable[[dict, int], Record]
    file: str = ""

    @property
    def relpath(self) -> str:
        """The file under the data root."""
        return self.file or f"benchmarks/{self.name}/test.jsonl"


@dataclass(frozen=True)
class TrainSet:
    """One file-backed training set (``synthetic_arithmetic`` is generated, not registered here).

    Attributes:
        name: config value of ``data.train_set`` and ``Record.source``.
        file: path under ``<root>/train``.
        read: ``Path -> iterator of (row index, row dict or _RowError)``.
        convert: as :attr:`Benchmark.convert`.
        expected_rows: rows of the reference file.
        integer_answers: as :attr:`Benchmark.integer_answers`.
    """

    name: str
    file: str
    read: Callable[[Path], Iterator[tuple[int, Any]]]
    convert: Callable[[dict, int], Record]
    expected_rows: int
    integer_answers: bool


#: The six benchmarks, in table order (docs/method.md#evaluation-protocol; raw fields in SOURCES.md).
BENCHMARK_REGISTRY: tuple[Benchmark, ...] = (
    Benchmark("aime24", "AIME24", 32, ("aime2024",), 30, True, _conv_aime24),
    Benchmark("aime25", "AIME25", 32, ("aime2025",), 30, True, _conv_aime25),
    Benchmark("amc23", "AMC23", 32, ("amc2023", "amc"), 40, True, _conv_amc23),
    Benchmark("math500", "MATH500", 4, ("math", "math_500", "math-500"), 500, False, _conv_math500),
    Benchmark("minerva_math", "Minerva", 4, ("minerva", "minervamath"), 272, False, _conv_minerva),
    Benchmark("olympiadbench", "OlympiadBench", 4, ("olympiad", "olympiad_bench"), 675, False, _conv_olympiad),
)


# ---------------------------------------------------------------------------------------------
# Raw readers (yield (row number, row dict or exception))
# ---------------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_index, parsed object or _RowError)``; row_index counts non-blank lines from 0."""
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot open: {exc}") from None
    with handle:
        row = 0
        try:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield row, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield row, _RowError(f"line {lineno} is not valid JSON ({exc.msg} at column {exc.colno})")
                row += 1
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text after row {row}: {exc}") from None


def _read_json_list(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    yield from enumerate(data)


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet: {type(exc).__name__}: {exc}") from None
    for name in ("prompt", "reward_model"):
        if name not in table.column_names:
            raise DataError(f"{path}: missing column {name!r} (columns: {', '.join(table.column_names)})")
    yield from enumerate(table.to_pylist())


#: The file-backed training sets.  math_train keeps 7,470 of its 7,474 rows (4 have no answer).
TRAIN_REGISTRY: tuple[TrainSet, ...] = (
    TrainSet("dapo_math_17k", "dapo_math_17k.parquet", _read_parquet, _conv_dapo, 17917, True),
    TrainSet("math_train", "math_train_7474.json", _read_json_list, _conv_math_train, 7474, False),
)

# Derived tables (do not edit: add an entry to BENCHMARK_REGISTRY / TRAIN_REGISTRY instead).
BENCHMARKS: tuple[str, ...] = tuple(b.name for b in BENCHMARK_REGISTRY)
BENCHMARK_BY_NAME: dict[str, Benchmark] = {b.name: b for b in BENCHMARK_REGISTRY}
TRAIN_SETS: tuple[str, ...] = tuple(t.name for t in TRAIN_REGISTRY) + ("synthetic_arithmetic", "synthetic_word")
TRAIN_FILES: dict[str, str] = {t.name: t.file for t in TRAIN_REGISTRY}
TRAIN_BY_NAME: dict[str, TrainSet] = {t.name: t for t in TRAIN_REGISTRY}
EXPECTED_ROWS: dict[str, int] = {e.name: e.expected_rows for e in (*BENCHMARK_REGISTRY, *TRAIN_REGISTRY)}
_INTEGER_SOURCES = frozenset(e.name for e in (*BENCHMARK_REGISTRY, *TRAIN_REGISTRY) if e.integer_answers)
_CONVERTERS: dict[str, Callable[[dict, int], Record]] = {
    e.name: e.convert for e in (*BENCHMARK_REGISTRY, *TRAIN_REGISTRY)}


def _row_object(row: Any) -> dict:
    """A row of :func:`_read_jsonl` (or a table) as the object it must be. Raises :class:`_RowError`: the row's own
    read error, or a row that is not an object."""
    if isinstance(row, _RowError):
        raise row
    if not isinstance(row, dict):
        raise _RowError(f"row is {type(row).__name__}, expected an object")
    return row


def _bad_row(stats: LoadStats, path: Path, i: int, reason: str, on_bad_row: OnBadRow, key: str | None = None) -> None:
    """A bad row ``i``: ``on_bad_row="raise"`` raises ``DataError("<path>: row <i>: <reason>")``; otherwise it is
    counted in ``stats`` (``skipped_by_reason[key]``, ``key`` defaulting to ``reason``; the first 10 in
    ``first_skipped``)."""
    if on_bad_row == "raise":
        raise DataError(f"{path}: row {i}: {reason}") from None
    key = reason if key is None else key
    stats.skipped_by_reason[key] = stats.skipped_by_reason.get(key, 0) + 1
    if len(stats.first_skipped) < 10:
        stats.first_skipped.append(f"row {i}: {reason}")


def _load(
    source: str,
    path: Path,
    rows: Iterable[tuple[int, Any]],
    on_bad_row: OnBadRow,
    convert: Callable[[dict, int], Record] | None = None,
) -> LoadedSet:
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    convert = convert if convert is not None else _CONVERTERS[source]
    stats = LoadStats(source=source, path=str(path))
    records: list[Record] = []
    kept_rows: list[int] = []
    seen_ids: set[str] = set()
    for i, row in rows:
        stats.rows_read += 1
        try:
            record = convert(_row_object(row), i)
            if record.id in seen_ids:
                raise _RowError(f"duplicate id {record.id!r} (is the id key the right column?)")
        except _RowError as exc:
            reason = str(exc)
            key = re.sub(r"line \d+ ", "line N ", reason)  # group JSON errors by kind
            _bad_row(stats, path, i, reason, on_bad_row, key=key)
            continue
        seen_ids.add(record.id)
        records.append(record)
        kept_rows.append(int(i))
    stats.rows_loaded = len(records)
    if stats.skipped and records:  # none left: the caller's error gives the same counts (stapo/train/prompts.py)
        logger.warning(
            "%s: skipped %d of %d rows (%s)", path, stats.skipped, stats.rows_read,
            "; ".join(f"{k}: {v}" for k, v in stats.skipped_by_reason.items()),
        )
    return LoadedSet(records=records, stats=stats, rows=kept_rows)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """``datasets`` with its progress bars and its log lines off (a bad file is reported by us, in one line;
    "Generating train split" bars for a small local file are noise), restored afterwards → the module."""
    import datasets
    from datasets.utils import logging as ds_logging

    bars, level = datasets.is_progress_bar_enabled(), ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity(logging.CRITICAL)
    try:
        yield datasets
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


# ---------------------------------------------------------------------------------------------
# Public loaders
# ---------------------------------------------------------------------------------------------


def load_benchmark(name: str, root: str | os.PathLike, *, on_bad_row: OnBadRow = "raise") -> LoadedSet:
    """Load one benchmark from ``<root>/benchmarks/<name>/test.jsonl``.

    Args:
        name: one of :data:`BENCHMARKS`.
        root: data root.
        on_bad_row: ``"raise"`` (default) or ``"skip"`` (count skipped rows in the stats).

    Returns:
        :class:`LoadedSet`; with the reference files: 30/30/40/500/272/675 records.

    Raises:
        ValueError: unknown benchmark name or ``on_bad_row``.
        DataFileNotFoundError: the file is missing.
        DataError: unreadable file, or a bad row (``"<file>: row <i>: <reason>"``).

    Source: docs/method.md#evaluation-protocol (the six benchmarks); SOURCES.md (raw fields).
    """
    path = benchmark_path(root, name)
    _require_file(path, f"benchmark {name}")
    return _load(name, path, _read_jsonl(path), on_bad_row)


def load_benchmarks(root: str | os.PathLike, names: Sequence[str] = BENCHMARKS, *, on_bad_row: OnBadRow = "raise") -> dict[str, LoadedSet]:
    """Load several benchmarks: ``{name: LoadedSet}`` in the order of ``names``.  Errors as
    :func:`load_benchmark`."""
    return {name: load_benchmark(name, root, on_bad_row=on_bad_row) for name in names}


def load_dapo_math_17k(path: str | os.PathLike, *, on_bad_row: OnBadRow = "skip") -> LoadedSet:
    """Load DAPO-Math-17k (deduplicated, verl parquet: ``prompt[0].content``,
    ``reward_model.ground_truth``, ``extra_info.index``).

    Returns:
        :class:`LoadedSet` (17,917 records with the reference file; ids ``dapo_math_17k/<index>``).

    Raises:
        DataFileNotFoundError / DataError: missing or unreadable file, missing columns, or (with
            ``on_bad_row="raise"``) a bad row.

    Source: docs/method.md#training-recipe (training set); SOURCES.md.
    """
    return _load_train_file("dapo_math_17k", Path(path), on_bad_row)


def load_math_train(path: str | os.PathLike, *, on_bad_row: OnBadRow = "skip") -> LoadedSet:
    """Load MATH train with final answers (JSON list of ``{problem, answer, difficulty, type}``).

    With the reference file 7,474 rows are read and 7,470 kept: rows 886 and 1009 have a null
    answer and rows 5328 and 5330 an empty one (``on_bad_row="skip"`` counts them in
    ``stats.skipped_by_reason``; ``"raise"`` raises on row 886).

    Raises:
        DataFileNotFoundError / DataError: as :func:`load_dapo_math_17k`.
    """
    return _load_train_file("math_train", Path(path), on_bad_row)


def _load_train_file(name: str, path: Path, on_bad_row: OnBadRow) -> LoadedSet:
    """Load ``path`` as the registered training set ``name`` (its reader and converter from the registry)."""
    _require_file(path, name)
    return _load(name, path, TRAIN_BY_NAME[name].read(path), on_bad_row)


def load_train_set(
    name: str,
    root: str | os.PathLike | None = None,
    *,
    on_bad_row: OnBadRow = "skip",
    **synthetic_kwargs: Any,
) -> LoadedSet:
    """Load a training set by name (a config value).

    Args:
        name: ``"dapo_math_17k"``, ``"math_train"`` (files under ``<root>/train``) or
            ``"synthetic_arithmetic"`` (alias ``"synthetic"``; generated in memory, no file: the default CPU training
            set; ``synthetic_kwargs`` go to :func:`stapo.synthetic.generate_arithmetic`) or ``"synthetic_word"``
            (alias ``"word"``; the word problems, ``synthetic_kwargs`` to
            :func:`stapo.word_problems.generate_word_problems`).
        root: data root (required for the file-backed sets).
        on_bad_row: see the module docstring.

    Returns:
        :class:`LoadedSet`.

    Raises:
        ValueError: unknown name, missing ``root``, or options that do not apply.
        DataFileNotFoundError / DataError: as the specific loaders.
    """
    name = {"synthetic": "synthetic_arithmetic", "word": "synthetic_word"}.get(name, name)  # config spelling
    if name in ("synthetic_arithmetic", "synthetic_word"):
        generate = generate_arithmetic if name == "synthetic_arithmetic" else generate_word_problems
        records = generate(**synthetic_kwargs)
        stats = LoadStats(source=name, path="", rows_read=len(records), rows_loaded=len(records))
        return LoadedSet(records=records, stats=stats)
    if synthetic_kwargs:
        raise ValueError(f"options {sorted(synthetic_kwargs)} only apply to synthetic_arithmetic and synthetic_word")
    if name not in TRAIN_FILES:
        raise ValueError(f"unknown training set {name!r}; known: {', '.join(TRAIN_SETS)}")
    if root is None:
        raise ValueError(f"training set {name!r} needs a data root")
    return _load_train_file(name, train_path(root, name), on_bad_row)


@dataclass
class FileSetConfig:
    """A data set from the user's own JSONL / JSON / parquet file, by config (no code): which column holds what.

    Used for ``data.train_file`` (train.py, with ``data.train_set: file``) and each entry of
    ``data.custom_benchmarks`` (evaluate.py).  Read with Hugging Face ``datasets``; the format follows the suffix
    (``.jsonl`` / ``.json``: JSON lines or a JSON list; ``.parquet``).

    Attributes:
        path: the file (``~`` expanded; relative paths from the working directory).
        problem_key: column with the problem text (non-empty str).
        answer_key: column with the gold answer (str or number; normalised by :func:`normalize_gold`).
        id_key: column with a unique id (``Record.id`` = ``"<name>/<value>"``); ``None``: the row index.
        integer_answers: canonicalise integer gold answers (``"025"`` -> ``"25"``) as for AIME.
    """

    path: Optional[str] = None
    problem_key: str = "problem"
    answer_key: str = "answer"
    id_key: Optional[str] = None
    integer_answers: bool = False


_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_file_set(name: str, spec: FileSetConfig, *, key: str = "data.train_file",
                  on_bad_row: OnBadRow = "skip") -> LoadedSet:
    """Load a user data set described by ``spec`` (see :class:`FileSetConfig`) into records of source ``name``.

    Args:
        name: ``Record.source`` and id prefix (``"my_set"`` -> ids ``"my_set/0"``, ...).
        spec: the file and its field mapping.
        key: the config key of ``spec`` (``"data.train_file"``, ``"data.custom_benchmarks.my_set"``), for errors.
        on_bad_row: ``"skip"`` (count rows without a usable problem/answer) or ``"raise"``.

    Returns:
        :class:`LoadedSet`, rows in file order.

    Raises:
        DataFileNotFoundError: ``spec.path`` unset or not a file (``"<key>.path: file not found: <file>"``, plus the
            working directory for a relative path).
        DataError: one line naming the file and the problem: an unknown suffix; a file without rows
            (``"<file>: no rows (the file is empty)"``); a line that is not JSON, not a JSON object or not UTF-8
            (``"<file>: row <i> (line <n>): not valid JSON (...)"``: found with the stdlib when ``datasets`` fails;
            the whole file is refused, whatever ``on_bad_row``); another unreadable file; a mapped column that the
            file lacks (``"<file>: no column 'q' (<key>.problem_key); columns: ..."``) or whose values mix types
            (strings and numbers: ``datasets`` would decode ``"007"`` to ``7``); or (with ``on_bad_row="raise"``) a
            bad row (``"<file>: row <i>: <reason>"``).
    """
    if not spec.path:
        raise DataFileNotFoundError(f"{key}.path is not set (the file of data set {name!r})")
    path = Path(spec.path).expanduser()
    _require_user_file(path, f"{key}.path")
    fmt = _FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unknown format {path.suffix!r} for {key}.path; use {', '.join(_FILE_FORMATS)}")
    try:
        with _quiet_datasets() as datasets:
            table = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many types for a bad file
        # datasets names neither the row nor an empty file: find the cause with the stdlib / pyarrow (only now,
        # so that a good file is read by datasets alone)
        reason = _json_file_problem(path) if fmt == "json" else _parquet_file_problem(path)
        if reason is None:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            reason = f"cannot read as {fmt}: {type(exc).__name__}: {first}"
        raise DataError(f"{path}: {reason}") from None
    if len(table) == 0:
        raise DataError(f"{path}: no rows ({key}.path)")
    columns = list(table.column_names)
    for attr in ("problem_key", "answer_key", "id_key"):
        column = getattr(spec, attr)
        if column is not None and column not in columns:
            raise DataError(f"{path}: no column {column!r} ({key}.{attr}); columns: {', '.join(columns)}")
        # a JSON column mixing types (strings and numbers) is read by datasets as JSON values, which decodes
        # number-like strings ("007" -> 7): refuse it rather than change gold answers silently
        if column is not None and type(table.features[column]).__name__ == "Json":
            raise DataError(f"{path}: column {column!r} ({key}.{attr}) mixes value types (e.g. strings and "
                            f"numbers); write every value of it with one type")

    def convert(row: dict, i: int) -> Record:
        rid = row[spec.id_key] if spec.id_key is not None else i
        answer = _field(row, spec.answer_key)
        try:
            gold = normalize_gold(name, answer, integer=spec.integer_answers)
        except ValueError as exc:
            raise _RowError(f"field {spec.answer_key!r}: {exc}") from None
        return Record(f"{name}/{rid}", _text_field(row, spec.problem_key), gold, name)

    return _load(name, path, _table_rows(table, path, fmt), on_bad_row, convert=convert)


def _table_rows(table: Any, path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
    """``enumerate(table)``; a string that is not UTF-8 (datasets reads the file but fails on the row) is a
    :class:`DataError` naming the file and the line."""
    try:
        yield from enumerate(table)
    except UnicodeDecodeError:
        reason = _json_file_problem(path) if fmt == "json" else None
        raise DataError(f"{path}: {reason or 'a value is not UTF-8 text'}") from None


def _json_file_problem(path: Path) -> str | None:
    """Why ``datasets`` could not read the JSON lines / JSON list file ``path``: no rows, the first line that is not
    UTF-8, not valid JSON or not an object (``"row <i> (line <n>): ..."``; rows count non-blank lines from 0), or
    ``None`` when none of these is found."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"cannot read: {exc}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        return f"line {lineno} is not UTF-8 text (byte {exc.start})"
    if not text.strip():
        return "no rows (the file is empty)" if not text else "no rows (the file has only blank lines)"
    if text.lstrip().startswith("["):  # one JSON list (a .json file, or a .jsonl holding a list)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        if not isinstance(rows, list):
            return None
        if not rows:
            return "no rows (an empty JSON list)"
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                return f"row {i}: row is {type(row).__name__}, expected an object"
        return None
    row = 0
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 may sit in a JSON string
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"row {row} (line {lineno}): not valid JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(value, dict):
            return f"row {row} (line {lineno}): row is {type(value).__name__}, expected an object"
        row += 1
    return None


def _parquet_file_problem(path: Path) -> str | None:
    """Why ``datasets`` could not read the parquet file ``path``: no rows, or ``None`` (pyarrow's own error is
    then the message)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except Exception:  # noqa: BLE001 - not parquet: datasets' message says so
        return None
    if meta.num_rows == 0:
        return f"no rows (a parquet table with 0 rows; columns: {', '.join(meta.schema.names)})"
    return None


def save_records_jsonl(records: Iterable[Record], path: str | os.PathLike) -> int:
    """Write records as JSON lines ``{"id", "problem", "answer", "source"}``; returns the count.
    Parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
            count += 1
    return count


def load_records_jsonl(path: str | os.PathLike, *, on_bad_row: OnBadRow = "raise") -> LoadedSet:
    """Read a file written by :func:`save_records_jsonl`.

    Raises:
        DataFileNotFoundError / DataError: missing file, or a row without the four string fields
            (``"<file>: row <i>: <reason>"``) when ``on_bad_row="raise"``.
    """
    path = Path(path)
    _require_file(path, "records")
    stats = LoadStats(source="records", path=str(path))
    records: list[Record] = []
    for i, row in _read_jsonl(path):
        stats.rows_read += 1
        try:
            obj = _row_object(row)
            values = {key: _text_field(obj, key) for key in ("id", "problem", "answer", "source")}
        except _RowError as exc:
            _bad_row(stats, path, i, str(exc), on_bad_row)
            continue
        records.append(Record(**values))
    stats.rows_loaded = len(records)
    if records:
        stats.source = records[0].source
    return LoadedSet(records=records, stats=stats)
