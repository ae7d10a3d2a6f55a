"""Loaders for the six evaluation benchmarks and the RL training sets, into one record type.

Data root layout (``data.root`` in the configs; ``../shared/data`` in the sandbox; built by
``scripts/prepare_data.py``)::

    <root>/benchmarks/<name>/test.jsonl   aime24 aime25 amc23 math500 minerva_math olympiadbench
    <root>/train/dapo_math_17k.parquet    DAPO-Math-17k, deduplicated, verl format
    <root>/train/math_train_7474.json     MATH train with final answers (JSON list)

Every built-in set is one entry of :data:`BENCHMARK_REGISTRY` (:class:`Benchmark`) or :data:`TRAIN_REGISTRY`
(:class:`TrainSet`); the name tables (``BENCHMARKS``, ``EXPECTED_ROWS``, the eval config's ``PAPER_SAMPLES`` and
``BENCHMARK_ALIASES``, the reports' ``DISPLAY_NAMES``, ...) derive from them.  The user's own data is loaded by
config with :class:`FileSetConfig` / :func:`load_file_set`: a JSONL / JSON / parquet file, a list of files or a hub
dataset (``hf:<id>``), columns named by (dotted) keys, a chat-list column giving its user message (a verl-format
parquet loads as is; see docs/extending.md).  Every file, built-in or the user's, is read by one function,
:func:`_read_table` (Hugging Face ``datasets``, imported on first use); a file ``datasets`` cannot read (a line
that is not JSON, not UTF-8, no rows) is refused whole, in one line naming the file (and the row and line).

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

from stapo.common.fingerprint import file_sha256, json_digest
from stapo.tasks.boxed import BOX_OPEN, last_boxed_content
from stapo.tasks.records import Record
from stapo.tasks.synthetic import generate_arithmetic
from stapo.tasks.word_problems import generate_word_problems

__all__ = [
    "PAPER_BENCHMARKS",
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
    "HUB_PREFIX",
    "file_set_sources",
    "file_set_name",
    "file_set_digest",
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
    if value is None:  # datasets reads a key absent from some rows of a file as null
        raise _RowError(f"field {key!r} is null or missing")
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
    idx = row.get("idx")
    idx = i if idx is None else idx
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
    index = extra.get("index") if isinstance(extra, dict) else None
    index = i if index is None else index
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
        columns: the columns ``convert`` needs (a file without one is refused in one line, before any row).
        file: path under the data root (default ``benchmarks/<name>/test.jsonl``); read, like every data file, by
            :func:`_read_table` (Hugging Face ``datasets``; the format follows the suffix).
    """

    name: str
    display: str
    samples: int
    aliases: tuple[str, ...]
    expected_rows: int
    integer_answers: bool
    convert: Callable[[dict, int], Record]
    columns: tuple[str, ...] = ()
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
        file: path under ``<root>/train`` (read by :func:`_read_table`, as every data file).
        convert: as :attr:`Benchmark.convert`.
        expected_rows: rows of the reference file.
        integer_answers: as :attr:`Benchmark.integer_answers`.
        columns: as :attr:`Benchmark.columns`.
    """

    name: str
    file: str
    convert: Callable[[dict, int], Record]
    expected_rows: int
    integer_answers: bool
    columns: tuple[str, ...] = ()


#: The six benchmarks, in table order (docs/method.md#evaluation-protocol; raw fields in SOURCES.md).
BENCHMARK_REGISTRY: tuple[Benchmark, ...] = (
    Benchmark("aime24", "AIME24", 32, ("aime2024",), 30, True, _conv_aime24, ("id", "problem", "answer")),
    Benchmark("aime25", "AIME25", 32, ("aime2025",), 30, True, _conv_aime25, ("question", "answer")),
    Benchmark("amc23", "AMC23", 32, ("amc2023", "amc"), 40, True, _conv_amc23, ("id", "problem", "answer")),
    Benchmark("math500", "MATH500", 4, ("math", "math_500", "math-500"), 500, False, _conv_math500,
              ("unique_id", "problem", "answer")),
    Benchmark("minerva_math", "Minerva", 4, ("minerva", "minervamath"), 272, False, _conv_minerva,
              ("problem", "solution")),
    Benchmark("olympiadbench", "OlympiadBench", 4, ("olympiad", "olympiad_bench"), 675, False, _conv_olympiad,
              ("id", "question", "final_answer")),
)


#: The file-backed training sets.  math_train keeps 7,470 of its 7,474 rows (4 have no answer).
TRAIN_REGISTRY: tuple[TrainSet, ...] = (
    TrainSet("dapo_math_17k", "dapo_math_17k.parquet", _conv_dapo, 17917, True, ("prompt", "reward_model")),
    TrainSet("math_train", "math_train_7474.json", _conv_math_train, 7474, False, ("problem", "answer")),
)

# Derived tables (do not edit: add an entry to BENCHMARK_REGISTRY / TRAIN_REGISTRY instead).
BENCHMARKS: tuple[str, ...] = tuple(b.name for b in BENCHMARK_REGISTRY)
#: The paper's six, in its table's order (docs/method.md#evaluation-protocol): what an evaluation must cover, in full,
#: for its average to be the paper's (results.json "paper_protocol"), whatever else is added to the registry.
PAPER_BENCHMARKS: tuple[str, ...] = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench")
BENCHMARK_BY_NAME: dict[str, Benchmark] = {b.name: b for b in BENCHMARK_REGISTRY}
TRAIN_SETS: tuple[str, ...] = tuple(t.name for t in TRAIN_REGISTRY) + ("synthetic_arithmetic", "synthetic_word")
TRAIN_FILES: dict[str, str] = {t.name: t.file for t in TRAIN_REGISTRY}
TRAIN_BY_NAME: dict[str, TrainSet] = {t.name: t for t in TRAIN_REGISTRY}
EXPECTED_ROWS: dict[str, int] = {e.name: e.expected_rows for e in (*BENCHMARK_REGISTRY, *TRAIN_REGISTRY)}
_INTEGER_SOURCES = frozenset(e.name for e in (*BENCHMARK_REGISTRY, *TRAIN_REGISTRY) if e.integer_answers)
_CONVERTERS: dict[str, Callable[[dict, int], Record]] = {
    e.name: e.convert for e in (*BENCHMARK_REGISTRY, *TRAIN_REGISTRY)}


def _row_object(row: Any) -> dict:
    """A row of a table (:func:`_read_table`) as the object it must be. Raises :class:`_RowError`: a row that is
    not an object."""
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
    seen_ids: set[str] | None = None,
) -> LoadedSet:
    """Convert ``rows`` (``(row index, row)``) of the file ``path`` with ``convert`` (default: the registry's
    converter of ``source``); ``seen_ids``: ids already taken (the earlier files of a list), updated in place."""
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    convert = convert if convert is not None else _CONVERTERS[source]
    stats = LoadStats(source=source, path=str(path))
    records: list[Record] = []
    kept_rows: list[int] = []
    seen_ids = set() if seen_ids is None else seen_ids
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
        # the first skipped rows by number (0-based, as in error messages), so a user can find them in the file
        nums = [m.group(1) for e in stats.first_skipped[:5] if (m := re.match(r"row (\d+):", e))]
        logger.warning(
            "%s: skipped %d of %d rows (%s; row%s %s%s)", path, stats.skipped, stats.rows_read,
            "; ".join(f"{k}: {v}" for k, v in stats.skipped_by_reason.items()), "s" if len(nums) > 1 else "",
            ", ".join(nums), ", ..." if stats.skipped > len(nums) else "",
        )
    return LoadedSet(records=records, stats=stats, rows=kept_rows)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """``datasets`` with its progress bars and its log lines off (a bad file is reported by us, in one line;
    "Generating train split" bars for a small local file are noise), restored afterwards → the module."""
    import datasets
    from datasets.utils import logging as ds_logging

    hub_logger = logging.getLogger("huggingface_hub")  # "Retrying in 1s" lines of an unreachable hub
    bars, level, hub_level = datasets.is_progress_bar_enabled(), ds_logging.get_verbosity(), hub_logger.level
    datasets.disable_progress_bars()
    ds_logging.set_verbosity(logging.CRITICAL)
    hub_logger.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        ds_logging.set_verbosity(level)
        hub_logger.setLevel(hub_level)
        if bars:
            datasets.enable_progress_bars()


# ---------------------------------------------------------------------------------------------
# Reading files: one datasets path for the built-in sets, the user's files and hub datasets
# ---------------------------------------------------------------------------------------------

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
#: ``FileSetConfig.path`` values starting with this name a hub dataset: ``hf:<id>[:<config>][@<split>]``.
HUB_PREFIX = "hf:"


def _file_format(path: Path, key: str | None) -> str:
    """``"json"`` / ``"parquet"`` from the suffix of ``path``; another suffix: :class:`DataError` (``key``: the
    config key that named the file, for the message)."""
    fmt = _FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        where = f" for {key}" if key else ""
        raise DataError(f"{path}: unknown format {path.suffix!r}{where}; use {', '.join(_FILE_FORMATS)}")
    return fmt


def _read_table(path: Path, *, key: str | None = None) -> Any:
    """Read one JSON-lines / JSON-list / parquet file with Hugging Face ``datasets`` (imported here, on first use:
    its import takes about 1.5 s) → a ``datasets.Dataset`` with at least one row.

    Every data file goes through here: the six benchmarks, the training sets and the user's own files
    (:func:`load_file_set`).  ``key``: the config key that named the file (``data.train_file.path``), for messages.

    Raises:
        DataError: one line naming the file: an unknown suffix; no rows; a line that is not JSON, not an object or
            not UTF-8 (``"row <i> (line <n>): ..."``, found with the stdlib after ``datasets`` failed: the whole
            file is refused); another unreadable file (``"cannot read as <format>: <error>"``).
    """
    fmt = _file_format(path, key)
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
        raise DataError(f"{path}: no rows" + (f" ({key})" if key else ""))
    return table


def _hub_source(source: str) -> tuple[str, str | None, str]:
    """``"hf:<id>[:<config>][@<split>]"`` → ``(id, config or None, split)`` (split ``"train"`` by default)."""
    rest, _, split = source[len(HUB_PREFIX):].partition("@")
    repo, _, config = rest.partition(":")
    return repo.strip(), (config.strip() or None), (split.strip() or "train")


def _read_hub(source: str, key: str) -> Any:
    """Load the hub dataset ``source`` (``hf:<id>[:<config>][@<split>]``) with ``datasets.load_dataset`` (from the
    local cache when the hub cannot be reached) → a ``datasets.Dataset`` with at least one row.

    Raises:
        DataError: one line naming ``key``, the dataset and the reason (not reachable and not cached, no such
            dataset / config / split, no rows).
    """
    repo, config, split = _hub_source(source)
    if not repo:
        raise DataError(f"{key}: {source!r} names no hub dataset "
                        f"(write {HUB_PREFIX}<owner>/<name>[:<config>][@<split>])")
    what = f"hub dataset {repo}" + (f" (config {config})" if config else "") + f" split {split}"
    try:
        with _quiet_datasets() as datasets:
            table = datasets.load_dataset(repo, config, split=split)
    except Exception as exc:  # noqa: BLE001 - hub, network and builder errors have many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = (" (the hub cannot be reached from here and the dataset is not in the local datasets cache: load it "
                "once where the hub is reachable, or name a local file)" if isinstance(exc, ConnectionError) else "")
        raise DataError(f"{key}: cannot load {what}: {type(exc).__name__}: {first}{hint}") from None
    if not hasattr(table, "column_names"):
        raise DataError(f"{key}: {what} is not one table (name a split with @<split>)")
    if len(table) == 0:
        raise DataError(f"{key}: {what} has no rows")
    return table


def _key_parts(key: str, columns: Sequence[str]) -> list[str]:
    """A column key as path segments: a column named ``key`` itself, else ``key`` split at its dots
    (``reward_model.ground_truth`` → ``["reward_model", "ground_truth"]``; a digit segment indexes a list)."""
    return [key] if key in columns or "." not in key else key.split(".")


def _check_columns(table: Any, where: Any, needed: Sequence[tuple[str, str]]) -> None:
    """Refuse, in one line naming ``where`` (the file or the hub dataset), a table that lacks a needed column or
    nested field, or whose column mixes value types (``datasets`` reads such a JSON column as JSON values, which
    decodes number-like strings: ``"007"`` -> ``7``).

    Args:
        table: a ``datasets.Dataset``.
        where: the file (or the hub source), for the message.
        needed: ``(key, what)`` pairs: a column key (dotted keys reach into struct columns) and what asks for it
            (``data.train_file.answer_key``, ``needed by dapo_math_17k``).

    Raises:
        DataError: ``"<where>: no column 'q' (<what>); columns: a, b"``, ``"<where>: no field 'x' in column 'c'
            (<what>); its fields: ..."`` or ``"<where>: column 'c' (<what>) mixes value types ..."``.
    """
    columns = list(table.column_names)
    for key, what in needed:
        parts = _key_parts(key, columns)
        if parts[0] not in columns:
            raise DataError(f"{where}: no column {parts[0]!r} ({what}); columns: {', '.join(columns)}")
        feature = table.features[parts[0]]
        for depth, part in enumerate(parts[1:], start=1):
            if type(feature).__name__ == "Json":
                break
            if isinstance(feature, dict):  # a struct column (or field)
                if part not in feature:
                    inside = ".".join(parts[:depth])
                    raise DataError(f"{where}: no field {part!r} in column {inside!r} ({what}); its fields: "
                                    f"{', '.join(feature)}")
                feature = feature[part]
            elif part.isdigit() and hasattr(feature, "feature"):  # a list: item <part>
                feature = feature.feature
            else:
                break  # not checkable from the schema: the rows say
        if type(feature).__name__ == "Json":
            raise DataError(f"{where}: column {key!r} ({what}) mixes value types (e.g. strings and numbers); write "
                            f"every value of it with one type")


def _value_at(row: dict, key: str, parts: Sequence[str]) -> Any:
    """The value of column key ``key`` (segments ``parts``, :func:`_key_parts`) in ``row``.

    Raises:
        _RowError: a missing field, a null or out-of-range step, or a step into a value that has no fields."""
    value: Any = row
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth + 1])
        if isinstance(value, dict):
            if part not in value:
                raise _RowError(f"missing field {here!r} (fields present: {', '.join(sorted(value)) or 'none'})")
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit():
            if int(part) >= len(value):
                raise _RowError(f"field {key!r}: the list {'.'.join(parts[:depth])!r} has {len(value)} items")
            value = value[int(part)]
        else:
            kind = "null" if value is None else type(value).__name__
            raise _RowError(f"field {key!r}: {'.'.join(parts[:depth])!r} is {kind}, not an object")
    return value


def _problem_text(value: Any, key: str) -> str:
    """The problem text of a value: a non-empty string, or a chat (a list of ``{role, content}`` messages, as verl's
    ``prompt`` column) with one user message: its content.

    Raises:
        _RowError: anything else (naming ``key``)."""
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) for m in value):
        users = [m for m in value if m.get("role") == "user"]
        if len(users) != 1:
            raise _RowError(f"field {key!r} is a chat of {len(value)} messages with {len(users)} user messages; "
                            f"expected one")
        value, key = users[0].get("content"), f"{key}[user].content"
    if value is None:
        raise _RowError(f"field {key!r} is null or missing")
    if not isinstance(value, str):
        raise _RowError(f"field {key!r} is {type(value).__name__}, expected str")
    if not value.strip():
        raise _RowError(f"field {key!r} is empty")
    return value


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
    return _load_registered(name, path, BENCHMARK_BY_NAME[name].columns, on_bad_row)


def _load_registered(name: str, path: Path, columns: Sequence[str], on_bad_row: OnBadRow) -> LoadedSet:
    """Read ``path`` with :func:`_read_table` (as a user's file), check the registry's ``columns`` and convert the
    rows with ``name``'s converter."""
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    table = _read_table(path)
    _check_columns(table, path, [(c, f"needed by {name}") for c in columns])
    return _load(name, path, _table_rows(table, path, _file_format(path, None)), on_bad_row)


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
    """Load ``path`` as the registered training set ``name`` (its columns and converter from the registry)."""
    _require_file(path, name)
    return _load_registered(name, path, TRAIN_BY_NAME[name].columns, on_bad_row)


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
            set; ``synthetic_kwargs`` go to :func:`stapo.tasks.synthetic.generate_arithmetic`) or ``"synthetic_word"``
            (alias ``"word"``; the word problems, ``synthetic_kwargs`` to
            :func:`stapo.tasks.word_problems.generate_word_problems`).
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
    """A data set from the user's own files or a hub dataset, by config (no code): where, and which column holds what.

    Used for ``data.train_file`` (train.py, with ``data.train_set: file``) and each entry of
    ``data.custom_benchmarks`` (evaluate.py).  Read with Hugging Face ``datasets``, as the built-in sets
    (:func:`_read_table`).

    Attributes:
        path: where the rows come from: a file (``.jsonl`` / ``.json``: JSON lines or a JSON list; ``.parquet``,
            e.g. a verl-format parquet; ``~`` expanded, relative paths from the working directory); a list of such
            files (rows in list order; ids without ``id_key`` count across them); or a hub dataset
            ``hf:<id>[:<config>][@<split>]`` (``hf:openai/gsm8k:main@test``; split ``train`` by default) loaded with
            ``datasets.load_dataset``, from its local cache when the hub cannot be reached.
        problem_key: column with the problem text (non-empty str).  A dotted key reaches into a nested column
            (``extra_info.question``; a digit indexes a list); a chat column (a list of ``{role, content}``
            messages, as verl's ``prompt``) gives the content of its one user message (the other messages, e.g. a
            system prompt, are not used: ``data.system_prompt`` sets that).
        answer_key: column with the gold answer (str or number; normalised by :func:`normalize_gold`); dotted keys
            as above (verl: ``reward_model.ground_truth``).
        id_key: column with a unique id (``Record.id`` = ``"<name>/<value>"``; dotted keys as above, verl:
            ``extra_info.index``); ``None``: the row index.
        integer_answers: canonicalise integer gold answers (``"025"`` -> ``"25"``) as for AIME.
    """

    path: Any = None
    problem_key: str = "problem"
    answer_key: str = "answer"
    id_key: Optional[str] = None
    integer_answers: bool = False


def file_set_sources(spec: FileSetConfig, *, key: str = "data.train_file") -> list[Path] | str:
    """Where ``spec`` reads from: its files (``~`` expanded; nothing checked on disk) or its hub source (a str
    ``hf:...``).

    Raises:
        DataFileNotFoundError: ``spec.path`` unset or empty.
        DataError: ``spec.path`` is not a string or a list of strings, or a list holds a hub source."""
    value = spec.path
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataFileNotFoundError(f"{key}.path is not set (the file of the data set)")
    if isinstance(value, str):
        return value.strip() if value.strip().startswith(HUB_PREFIX) else [Path(value).expanduser()]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v.strip() for v in value):
        if any(v.strip().startswith(HUB_PREFIX) for v in value):
            raise DataError(f"{key}.path: a list holds files only; name one hub dataset as {key}.path itself")
        return [Path(v).expanduser() for v in value]
    raise DataError(f"{key}.path: expected a file, a list of files or {HUB_PREFIX}<hub id>, got {value!r}")


def file_set_name(spec: FileSetConfig) -> str:
    """A name for the records of ``spec`` (``Record.source`` and id prefix): the stem of its (first) file, or the
    hub dataset's name (``hf:openai/gsm8k:main`` -> ``gsm8k``); ``"file"`` when ``spec.path`` is unset."""
    try:
        sources = file_set_sources(spec)
    except DataError:
        return "file"
    if isinstance(sources, str):
        return _hub_source(sources)[0].rsplit("/", 1)[-1] or "file"
    return sources[0].stem


def file_set_digest(spec: FileSetConfig, *, name: str = "file", key: str = "data.train_file") -> str:
    """The content digest of the data ``spec`` names (a run's or an evaluation's ``data`` fingerprint part).

    Returns:
        one file: its SHA-256 (:func:`stapo.common.fingerprint.file_sha256`; 64 hex characters); a list of files:
        :func:`stapo.common.fingerprint.json_digest` of their SHA-256 in list order; a hub dataset:
        ``"hub:<source>:"`` + the ``json_digest`` of its records' ``[id, problem, answer]`` (loaded as
        :func:`load_file_set` does).

    Raises:
        OSError: a file cannot be read.  DataError: as :func:`load_file_set`, for a hub dataset.
    """
    sources = file_set_sources(spec, key=key)
    if isinstance(sources, str):
        records = load_file_set(name, spec, key=key).records
        return f"hub:{sources}:" + json_digest([[r.id, r.problem, r.answer] for r in records])
    if len(sources) == 1:
        return file_sha256(sources[0])
    return json_digest([file_sha256(p) for p in sources])


def load_file_set(name: str, spec: FileSetConfig, *, key: str = "data.train_file",
                  on_bad_row: OnBadRow = "skip") -> LoadedSet:
    """Load a user data set described by ``spec`` (see :class:`FileSetConfig`) into records of source ``name``.

    Args:
        name: ``Record.source`` and id prefix (``"my_set"`` -> ids ``"my_set/0"``, ...).
        spec: the file(s) or hub dataset and the column mapping.
        key: the config key of ``spec`` (``"data.train_file"``, ``"data.custom_benchmarks.my_set"``), for errors.
        on_bad_row: ``"skip"`` (count rows without a usable problem/answer) or ``"raise"``.

    Returns:
        :class:`LoadedSet`, rows in file order (files in list order).  With several files, ``rows`` and the
        default ids count rows across the files, ``stats.path`` lists the files (``", "``-separated) and
        ``stats.first_skipped`` names the file of each row.

    Raises:
        DataFileNotFoundError: ``spec.path`` unset or a file missing (``"<key>.path: file not found: <file>"``, plus
            the working directory for a relative path).
        DataError: one line naming the file (or ``key`` for a hub dataset) and the problem: an unknown suffix or
            files of two formats; a file without rows (``"<file>: no rows (the file is empty)"``); a line that is
            not JSON, not a JSON object or not UTF-8 (``"<file>: row <i> (line <n>): not valid JSON (...)"``: found
            with the stdlib when ``datasets`` fails; the whole file is refused, whatever ``on_bad_row``); another
            unreadable file; a hub dataset that cannot be loaded (not reachable and not cached, no such split:
            ``"<key>.path: cannot load hub dataset <id> split <split>: ..."``); a mapped column or nested field
            that the data lacks (``"<file>: no column 'q' (<key>.problem_key); columns: ..."``) or whose values mix
            types (strings and numbers: ``datasets`` would decode ``"007"`` to ``7``); or (with
            ``on_bad_row="raise"``) a bad row (``"<file>: row <i>: <reason>"``).
    """
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    sources = file_set_sources(spec, key=key)
    if isinstance(sources, str):
        tables: list[tuple[Any, Any, str]] = [(sources, _read_hub(sources, f"{key}.path"), "")]
    else:
        for path in sources:
            _require_user_file(path, f"{key}.path")
        formats = {path: _file_format(path, f"{key}.path") for path in sources}
        if len(set(formats.values())) > 1:
            mix = ", ".join(f"{p.name}: {f}" for p, f in formats.items())
            raise DataError(f"{key}.path: the files mix formats ({mix}); list files of one format")
        tables = [(path, _read_table(path, key=f"{key}.path"), formats[path]) for path in sources]
    needed = [(getattr(spec, attr), f"{key}.{attr}") for attr in ("problem_key", "answer_key", "id_key")
              if getattr(spec, attr) is not None]
    for where, table, _ in tables:
        _check_columns(table, where, needed)

    def converter(columns: Sequence[str], offset: int) -> Callable[[dict, int], Record]:
        problem_parts = _key_parts(spec.problem_key, columns)
        answer_parts = _key_parts(spec.answer_key, columns)
        id_parts = _key_parts(spec.id_key, columns) if spec.id_key is not None else None

        def convert(row: dict, i: int) -> Record:
            rid = _value_at(row, spec.id_key, id_parts) if id_parts is not None else offset + i
            answer = _value_at(row, spec.answer_key, answer_parts)
            try:
                gold = normalize_gold(name, answer, integer=spec.integer_answers)
            except ValueError as exc:
                raise _RowError(f"field {spec.answer_key!r}: {exc}") from None
            problem = _problem_text(_value_at(row, spec.problem_key, problem_parts), spec.problem_key)
            return Record(f"{name}/{rid}", problem, gold, name)

        return convert

    parts: list[LoadedSet] = []
    seen_ids: set[str] = set()
    offset = 0
    for where, table, fmt in tables:
        parts.append(_load(name, where, _table_rows(table, where, fmt), on_bad_row,
                           convert=converter(table.column_names, offset), seen_ids=seen_ids))
        offset += len(table)
    if len(parts) == 1:
        return parts[0]
    stats = LoadStats(source=name, path=", ".join(str(w) for w, _, _ in tables))
    records: list[Record] = []
    rows: list[int] = []
    offset = 0
    for (where, table, _), part in zip(tables, parts):
        records += part.records
        rows += [offset + r for r in part.rows]
        offset += len(table)
        stats.rows_read += part.stats.rows_read
        for reason, count in part.stats.skipped_by_reason.items():
            stats.skipped_by_reason[reason] = stats.skipped_by_reason.get(reason, 0) + count
        stats.first_skipped += [f"{Path(str(where)).name}: {s}" for s in part.stats.first_skipped]
    stats.rows_loaded = len(records)
    stats.first_skipped = stats.first_skipped[:10]
    return LoadedSet(records=records, stats=stats, rows=rows)


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
    """Read a file written by :func:`save_records_jsonl` (with :func:`_read_table`, as every data file).

    Raises:
        DataFileNotFoundError / DataError: missing or unreadable file (as :func:`_read_table`), or a row without
            the four string fields (``"<file>: row <i>: <reason>"``) when ``on_bad_row="raise"``.
    """
    path = Path(path)
    _require_file(path, "records")
    stats = LoadStats(source="records", path=str(path))
    records: list[Record] = []
    for i, row in _table_rows(_read_table(path), path, "json"):
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
