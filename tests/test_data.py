"""Tests for stapo/tasks/data.py and scripts/prepare_data.py --from-local, on the real files in ../shared/data."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stapo.tasks.data import (
    BENCHMARKS,
    DataError,
    DataFileNotFoundError,
    Record,
    load_benchmark,
    load_dapo_math_17k,
    load_math_train,
    load_records_jsonl,
    load_train_set,
    normalize_gold,
    resolve_data_root,
    save_records_jsonl,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

# Row counts from SOURCES.md / issue 3.
EXPECTED = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva_math": 272, "olympiadbench": 675}


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_row_counts(shared_data_root, name):
    loaded = load_benchmark(name, shared_data_root)
    assert len(loaded) == EXPECTED[name]
    assert loaded.stats.rows_read == EXPECTED[name] and loaded.stats.skipped == 0
    assert len({r.id for r in loaded}) == EXPECTED[name]  # ids unique
    assert all(r.source == name and r.problem.strip() and r.answer for r in loaded)


# (benchmark, row index, expected id, expected normalised gold, start of the problem) — read off the files.
SPOT_CHECKS = [
    ("aime24", 0, "aime24/60", "204", "Every morning Aya goes for a $9$-kilometer-long walk"),
    ("aime24", 7, "aime24/67", "25", "There exist real numbers $x$ and $y$"),  # raw "025"
    ("aime25", 0, "aime25/0", "70", "Find the sum of all integer bases $b>9$"),  # "question" field
    ("amc23", 0, "amc23/0", "27", "Cities $A$ and $B$ are $45$ miles apart."),  # raw 27.0
    ("amc23", 15, "amc23/17", "-1", None),  # raw -1.0
    ("math500", 0, "math500/test/precalculus/807.json", "\\left( 3, \\frac{\\pi}{2} \\right)", "Convert the point $(0,3)$"),
    ("minerva_math", 0, "minerva_math/0", "1.6", "Each of the two Magellan telescopes"),  # last \boxed{1.6} of solution
    ("olympiadbench", 0, "olympiadbench/1606", "2", "Xenia and Sergey play the following game."),
    ("olympiadbench", 1, "olympiadbench/1610", "\\frac{1}{2 n+2}", None),  # raw ["$\frac{1}{2 n+2}$"]
    ("olympiadbench", 13, "olympiadbench/1664", "69,84", None),  # raw ["$69$,$84$"]
]


@pytest.mark.parametrize("name,row,rid,gold,problem_start", SPOT_CHECKS)
def test_benchmark_spot_checks(shared_data_root, name, row, rid, gold, problem_start):
    record = load_benchmark(name, shared_data_root)[row]
    assert record.id == rid
    assert record.answer == gold
    if problem_start is not None:
        assert record.problem.startswith(problem_start)


def test_dapo_math_17k(shared_data_root):
    loaded = load_train_set("dapo_math_17k", shared_data_root)
    assert len(loaded) == 17917 and loaded.stats.rows_read == 17917 and loaded.stats.skipped == 0
    first = loaded[0]
    assert first.id == "dapo_math_17k/0" and first.answer == "34" and first.source == "dapo_math_17k"
    assert first.problem.startswith("In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$")
    assert len({r.id for r in loaded}) == 17917
    assert all(r.answer.lstrip("-").isdigit() for r in loaded)  # SOURCES.md: all integer ground truths


def test_math_train_counts_skipped_rows(shared_data_root):
    loaded = load_train_set("math_train", shared_data_root)
    # 7,474 rows read; rows 886 and 1009 have "answer": null, rows 5328 and 5330 have "answer": "".
    assert loaded.stats.rows_read == 7474
    assert len(loaded) == 7470 and loaded.stats.skipped == 4
    assert loaded.stats.skipped_by_reason == {"field 'answer': answer is null": 2, "field 'answer': answer is empty": 2}
    assert [s.split(":")[0] for s in loaded.stats.first_skipped] == ["row 886", "row 1009", "row 5328", "row 5330"]
    assert loaded[0] == Record("math_train/0", loaded[0].problem, "0", "math_train")
    with pytest.raises(DataError, match=r"math_train_7474\.json: row 886: field 'answer': answer is null"):
        load_math_train(Path(shared_data_root) / "train" / "math_train_7474.json", on_bad_row="raise")


def test_synthetic_train_set_needs_no_root():
    loaded = load_train_set("synthetic_arithmetic", n=10, seed=3)
    assert len(loaded) == 10 and loaded.stats.rows_loaded == 10
    assert load_train_set("synthetic", n=10, seed=3).records == loaded.records  # config alias
    with pytest.raises(ValueError, match="only apply to synthetic"):
        load_train_set("math_train", "/nonexistent", n=3)
    with pytest.raises(ValueError, match="unknown training set"):
        load_train_set("gsm8k", "/nonexistent")


# --------------------------------------------------------------------------------------------
# normalisation and error paths (small files written here)
# --------------------------------------------------------------------------------------------


def test_normalize_gold():
    assert normalize_gold("amc23", 27.0) == "27"
    assert normalize_gold("amc23", -1.0) == "-1"
    assert normalize_gold("amc23", 2.5) == "2.5"
    assert normalize_gold("aime24", "\\boxed{204}") == "204"  # issue text: AIME24 golds may be boxed
    assert normalize_gold("aime24", "025") == "25"
    assert normalize_gold("math500", "025") == "025"  # no integer canonicalisation outside integer sets
    assert normalize_gold("olympiadbench", "$69$,$84$") == "69,84"
    assert normalize_gold("math_train", "\\$42409") == "\\$42409"  # escaped currency sign kept
    assert normalize_gold("math500", " \\boxed{1}+\\boxed{2} ") == "\\boxed{1}+\\boxed{2}"  # box not spanning all
    for bad, msg in ((None, "null"), ("  ", "empty"), (True, "bool"), (float("nan"), "nan"), ([1], "type list")):
        with pytest.raises(ValueError, match=msg):
            normalize_gold("math500", bad)


def _write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(DataFileNotFoundError, match=r"benchmark aime24: file not found: .*aime24/test\.jsonl"):
        load_benchmark("aime24", tmp_path)
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("gsm8k", tmp_path)
    with pytest.raises(DataFileNotFoundError, match="not a directory"):
        resolve_data_root(tmp_path / "nope")


def test_bad_rows_raise_with_file_and_row(tmp_path):
    path = _write_jsonl(
        tmp_path / "benchmarks" / "math500" / "test.jsonl",
        [
            {"problem": "p0", "answer": "1", "unique_id": "a"},
            "",  # blank line: not a row
            {"problem": "p1", "answer": "2", "unique_id": "b"},
            {"problem": "p2", "unique_id": "c"},  # row 2: no answer (datasets reads it as null)
            {"problem": "p3", "answer": "4", "unique_id": "d"},
            {"problem": "p4", "answer": "5", "unique_id": "a"},  # row 4: duplicate id
        ],
    )
    with pytest.raises(DataError, match=r"math500/test\.jsonl: row 2: field 'answer': answer is null"):
        load_benchmark("math500", tmp_path)
    loaded = load_benchmark("math500", tmp_path, on_bad_row="skip")
    assert [r.answer for r in loaded] == ["1", "2", "4"]
    assert loaded.stats.rows_read == 5 and loaded.stats.skipped == 2
    assert loaded.rows == [0, 1, 3]  # file rows (blank lines are not rows)
    assert loaded.stats.first_skipped[1] == "row 4: duplicate id 'math500/a' (is the id key the right column?)"
    assert path.exists()
    # a line that is not JSON: the file is read by datasets, as a user's file, and refused whole, naming the row
    # (0-based, blank lines not counted) and the line, whatever on_bad_row
    _write_jsonl(path, [{"problem": "p0", "answer": "1", "unique_id": "a"}, "", "{not json"])
    for on_bad_row in ("raise", "skip"):
        with pytest.raises(DataError) as err:
            load_benchmark("math500", tmp_path, on_bad_row=on_bad_row)
        assert str(err.value) == (f"{path}: row 1 (line 3): not valid JSON "
                                  f"(Expecting property name enclosed in double quotes at column 2)")


def test_benchmark_specific_row_errors(tmp_path):
    _write_jsonl(tmp_path / "benchmarks" / "olympiadbench" / "test.jsonl", [{"id": 1, "question": "q", "final_answer": ["1", "2"]}])
    with pytest.raises(DataError, match=r"row 0: field 'final_answer' is list of 2, expected a list with one string"):
        load_benchmark("olympiadbench", tmp_path)
    _write_jsonl(tmp_path / "benchmarks" / "minerva_math" / "test.jsonl", [{"problem": "q", "solution": "no box", "idx": 0}])
    with pytest.raises(DataError, match=r"row 0: field 'solution' has no closed \\boxed"):
        load_benchmark("minerva_math", tmp_path)
    aime25 = _write_jsonl(tmp_path / "benchmarks" / "aime25" / "test.jsonl", [{"problem": "q", "answer": "1"}])
    with pytest.raises(DataError) as err:  # a column the converter needs: refused before any row, in one line
        load_benchmark("aime25", tmp_path)
    assert str(err.value) == f"{aime25}: no column 'question' (needed by aime25); columns: problem, answer"
    _write_jsonl(tmp_path / "benchmarks" / "amc23" / "test.jsonl", [{"id": 0, "problem": "q", "answer": None}])
    with pytest.raises(DataError, match=r"row 0: field 'answer': answer is null"):
        load_benchmark("amc23", tmp_path)


def test_parquet_errors(tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["x"]}), bad)
    with pytest.raises(DataError) as err:
        load_dapo_math_17k(bad)
    assert str(err.value) == f"{bad}: no column 'reward_model' (needed by dapo_math_17k); columns: prompt"
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"garbage\.parquet: cannot read as parquet: "):
        load_dapo_math_17k(garbage)
    rows = pa.table(
        {
            "prompt": [[{"content": "p0", "role": "user"}], []],
            "reward_model": [{"ground_truth": "7", "style": "rule"}, {"ground_truth": "8", "style": "rule"}],
        }
    )
    mixed = tmp_path / "mixed.parquet"
    pq.write_table(rows, mixed)
    loaded = load_dapo_math_17k(mixed)  # training default: skip and count
    assert [r.answer for r in loaded] == ["7"] and loaded.stats.skipped == 1
    with pytest.raises(DataError, match=r"mixed\.parquet: row 1: field 'prompt' is not a non-empty list"):
        load_dapo_math_17k(mixed, on_bad_row="raise")


def test_records_jsonl_roundtrip(tmp_path):
    records = [Record("s/0", "What is 1 + 1?", "2", "synthetic_arithmetic"), Record("s/1", "Ünïcode?", "\\frac{1}{2}", "x")]
    assert save_records_jsonl(records, tmp_path / "sub" / "r.jsonl") == 2
    assert load_records_jsonl(tmp_path / "sub" / "r.jsonl").records == records
    _write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "problem": "p", "answer": "1"}])
    with pytest.raises(DataError, match=r"bad\.jsonl: row 0: missing field 'source'"):
        load_records_jsonl(tmp_path / "bad.jsonl")


# --------------------------------------------------------------------------------------------
# scripts/prepare_data.py --from-local on a subset copied to a temp dir
# --------------------------------------------------------------------------------------------


def _prepare_data_module():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO_ROOT / "scripts" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def subset_root(shared_data_root, tmp_path):
    """A data root with the first 3 rows of each benchmark, 5 DAPO rows and MATH rows 884..889
    (which include the null-answer row 886)."""
    src = tmp_path / "subset"
    for name in BENCHMARKS:
        lines = (shared_data_root / "benchmarks" / name / "test.jsonl").read_text(encoding="utf-8").splitlines()[:3]
        _write_jsonl(src / "benchmarks" / name / "test.jsonl", lines)
    (src / "train").mkdir(parents=True)
    table = pq.read_table(shared_data_root / "train" / "dapo_math_17k.parquet").slice(0, 5)
    pq.write_table(table, src / "train" / "dapo_math_17k.parquet")
    math_rows = json.loads((shared_data_root / "train" / "math_train_7474.json").read_text(encoding="utf-8"))[884:890]
    (src / "train" / "math_train_7474.json").write_text(json.dumps(math_rows), encoding="utf-8")
    return src


def test_prepare_data_from_local(subset_root, tmp_path, capsys):
    prepare = _prepare_data_module()
    out = tmp_path / "out"
    assert prepare.main(["--from-local", str(subset_root), "--out", str(out), "--synthetic", "12"]) == 0
    manifest = json.loads((out / "MANIFEST.json").read_text())
    for name in BENCHMARKS:
        rel = Path("benchmarks") / name / "test.jsonl"
        assert (out / rel).read_bytes() == (subset_root / rel).read_bytes()  # copied byte for byte
        assert manifest[name]["rows_read"] == 3 and manifest[name]["rows_loaded"] == 3
    assert manifest["dapo_math_17k"]["rows_loaded"] == 5
    # MATH rows 884..889: row 886 of the full file (index 2 here) has a null answer.
    assert manifest["math_train"]["rows_read"] == 6 and manifest["math_train"]["rows_loaded"] == 5
    assert manifest["math_train"]["skipped_by_reason"] == {"field 'answer': answer is null": 1}
    assert manifest["synthetic_arithmetic"]["rows_read"] == 12
    assert len(load_records_jsonl(out / "train" / "synthetic_arithmetic.jsonl")) == 12
    # the copy loads with the normal loaders
    assert [r.answer for r in load_benchmark("amc23", out)] == ["27", "36", "45"]
    printed = capsys.readouterr().out
    assert "differs from the reference count" in printed  # subset: 3 != 30 is reported
    # --check-counts turns that into exit code 1
    assert prepare.main(["--from-local", str(subset_root), "--out", str(out), "--only", "aime24", "--check-counts"]) == 1


def test_prepare_data_from_local_errors(subset_root, tmp_path, capsys):
    prepare = _prepare_data_module()
    (subset_root / "benchmarks" / "aime25" / "test.jsonl").unlink()
    assert prepare.main(["--from-local", str(subset_root), "--out", str(tmp_path / "o1")]) == 2
    assert "aime25/test.jsonl" in capsys.readouterr().err
    _write_jsonl(subset_root / "benchmarks" / "aime25" / "test.jsonl", [{"question": "q", "answer": "1"}, {"question": "r"}])
    assert prepare.main(["--from-local", str(subset_root), "--out", str(tmp_path / "o2"), "--only", "aime25"]) == 2
    assert "aime25/test.jsonl: row 1: field 'answer': answer is null" in capsys.readouterr().err


def test_prepare_data_refuses_an_unknown_name_in_one_line(subset_root, tmp_path, capsys):
    """A name prepare_data.py does not know is refused before anything is read, copied or downloaded (it was read
    as, or fetched as, MATH-train: `_load_any` / `download_hub` sent every other name there)."""
    prepare = _prepare_data_module()
    known = "aime24, aime25, amc23, math500, minerva_math, olympiadbench, dapo_math_17k, math_train"
    assert prepare.ALL_SETS == tuple(known.split(", "))
    math_file = subset_root / "train" / "math_train_7474.json"
    for call in (lambda: prepare._load_any("gsm8k", math_file),
                 lambda: prepare.copy_local(subset_root, tmp_path / "o", ["aime24", "gsm8k"]),
                 lambda: prepare.download_hub(tmp_path / "h", ["gsm8k"])):  # refused before any network access
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == f"unknown data set 'gsm8k'; known: {known}"
    assert not (tmp_path / "o").exists() and not (tmp_path / "h").exists()  # nothing copied (not even aime24)
    # a training set registered in stapo.tasks.data but unknown to this script is refused too, not read as MATH-train
    with pytest.raises(ValueError, match=r"^unknown data set 'new_set'; known: aime24, "):
        prepare._load_any("new_set", math_file)
    with pytest.raises(SystemExit) as exit_info:  # the command line: argparse's one-line refusal, exit 2
        prepare.main(["--from-local", str(subset_root), "--out", str(tmp_path / "o"), "--only", "gsm8k"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'gsm8k'" in capsys.readouterr().err


def test_every_benchmark_table_derives_from_the_registry():
    """One registry entry per benchmark; the seven tables are views of it (values written out by hand)."""
    from stapo.tasks.data import _CONVERTERS, _INTEGER_SOURCES, BENCHMARK_REGISTRY, EXPECTED_ROWS, TRAIN_REGISTRY
    from stapo.evaluation.config import BENCHMARK_ALIASES, PAPER_SAMPLES
    from stapo.evaluation.report import DISPLAY_NAMES

    assert BENCHMARKS == ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench")
    assert EXPECTED_ROWS == {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva_math": 272,
                             "olympiadbench": 675, "dapo_math_17k": 17917, "math_train": 7474}
    assert _INTEGER_SOURCES == {"aime24", "aime25", "amc23", "dapo_math_17k"}
    assert set(_CONVERTERS) == set(EXPECTED_ROWS)
    assert PAPER_SAMPLES == {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva_math": 4,
                             "olympiadbench": 4}
    assert BENCHMARK_ALIASES["minerva"] == "minerva_math" and BENCHMARK_ALIASES["amc"] == "amc23"
    assert len(BENCHMARK_ALIASES) == 11
    assert DISPLAY_NAMES == {"aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23", "math500": "MATH500",
                             "minerva_math": "Minerva", "olympiadbench": "OlympiadBench"}
    assert [b.relpath for b in BENCHMARK_REGISTRY][0] == "benchmarks/aime24/test.jsonl"
    assert [t.name for t in TRAIN_REGISTRY] == ["dapo_math_17k", "math_train"]


# --- user data sets by config (stapo.tasks.data.FileSetConfig) ---------------------------------------------------


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_file_set_jsonl_maps_columns_and_normalises_gold(tmp_path):
    from stapo.tasks.data import FileSetConfig, load_file_set

    path = _write_rows(tmp_path / "my.jsonl", [
        {"question": "What is 1+1?", "sol": "$2$", "uid": "a"},
        {"question": "What is 3*3?", "sol": "9", "uid": "b"},
        {"question": "Pad?", "sol": "007", "uid": "c"},
    ])
    spec = FileSetConfig(path=str(path), problem_key="question", answer_key="sol", id_key="uid")
    got = load_file_set("my", spec)
    assert [(r.id, r.problem, r.answer, r.source) for r in got] == [
        ("my/a", "What is 1+1?", "2", "my"), ("my/b", "What is 3*3?", "9", "my"), ("my/c", "Pad?", "007", "my")]
    assert got.stats.rows_read == 3 and got.stats.rows_loaded == 3
    spec.integer_answers, spec.id_key = True, None  # "007" -> "7"; ids from the row index
    assert [(r.id, r.answer) for r in load_file_set("my", spec)] == [("my/0", "2"), ("my/1", "9"), ("my/2", "7")]


def test_file_set_parquet_and_skipped_rows(tmp_path):
    from stapo.tasks.data import FileSetConfig, load_file_set

    path = tmp_path / "set.parquet"
    pq.write_table(pa.table({"problem": ["p0", "p1", "p2"], "answer": ["\\frac{1}{2}", "", "x"]}), path)
    got = load_file_set("pq", FileSetConfig(path=str(path)))
    assert [(r.id, r.answer) for r in got] == [("pq/0", "\\frac{1}{2}"), ("pq/2", "x")]
    assert got.stats.skipped_by_reason == {"field 'answer': answer is empty": 1}
    with pytest.raises(DataError, match=r"set\.parquet: row 1: field 'answer': answer is empty"):
        load_file_set("pq", FileSetConfig(path=str(path)), on_bad_row="raise")


def test_file_set_bad_field_name_is_one_line_naming_file_and_key(tmp_path):
    from stapo.tasks.data import FileSetConfig, load_file_set

    path = _write_rows(tmp_path / "my.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(DataError) as err:
        load_file_set("my", FileSetConfig(path=str(path), problem_key="problem"), key="data.train_file")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg == f"{path}: no column 'problem' (data.train_file.problem_key); columns: question, answer"
    with pytest.raises(DataFileNotFoundError, match=r"data.train_file.path is not set"):
        load_file_set("my", FileSetConfig())
    mixed = _write_rows(tmp_path / "mixed.jsonl", [{"problem": "q", "answer": "007"}, {"problem": "r", "answer": 9}])
    with pytest.raises(DataError, match=r"mixed\.jsonl: column 'answer' \(data.train_file.answer_key\) mixes value types"):
        load_file_set("m", FileSetConfig(path=str(mixed)))
    with pytest.raises(DataError, match=r"unknown format '.csv'"):
        (tmp_path / "x.csv").write_text("a\n1\n")
        load_file_set("x", FileSetConfig(path=str(tmp_path / "x.csv")))


def test_file_set_without_rows_is_one_line_naming_the_file(tmp_path):
    """An empty user file (no bytes, only blank lines, an empty JSON list, a parquet table of 0 rows): one line naming
    the file and saying it has no rows (datasets said `cannot read as json: StopIteration: `)."""
    from stapo.tasks.data import FileSetConfig, load_file_set

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "list.json").write_text("[]\n")
    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "zero.parquet")
    expected = {
        "empty.jsonl": "no rows (the file is empty)",
        "blank.jsonl": "no rows (the file has only blank lines)",
        "list.json": "no rows (an empty JSON list)",
        "zero.parquet": "no rows (a parquet table with 0 rows; columns: problem, answer)",
    }
    for file, reason in expected.items():
        with pytest.raises(DataError) as err:
            load_file_set("x", FileSetConfig(path=str(tmp_path / file)))
        assert str(err.value) == f"{tmp_path / file}: {reason}"


def test_file_set_bad_json_names_the_file_the_row_and_the_line(tmp_path):
    """A line json.loads rejects (datasets said only `DatasetGenerationError: An error occurred ...`): the file, the
    row (0-based, blank lines not counted, as in the ids) and the line number; also a row that is not an object, a
    broken JSON list (line and column) and bytes that are not UTF-8."""
    from stapo.tasks.data import FileSetConfig, load_file_set

    cases = {
        "bad.jsonl": ('{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": \n{"problem": "c", "answer": "3"}\n',
                      "row 1 (line 3): not valid JSON (Expecting value at column 28)"),
        "extra.jsonl": ('{"problem": "a", "answer": "1"} x\n', "row 0 (line 1): not valid JSON (Extra data at column 33)"),
        "scalar.jsonl": ('{"problem": "a", "answer": "1"}\n5\n', "row 1 (line 2): row is int, expected an object"),
        "list.json": ('[\n  {"problem": "a", "answer": "1"},\n  {"problem": "b" "answer": "2"}\n]\n',
                      "not valid JSON (Expecting ',' delimiter at line 3, column 19)"),
    }
    for file, (text, reason) in cases.items():
        (tmp_path / file).write_text(text, encoding="utf-8")
        for on_bad_row in ("skip", "raise"):  # the file cannot be read at all: both raise
            with pytest.raises(DataError) as err:
                load_file_set("x", FileSetConfig(path=str(tmp_path / file)), on_bad_row=on_bad_row)
            assert str(err.value) == f"{tmp_path / file}: {reason}"
    (tmp_path / "latin1.jsonl").write_bytes(b'{"problem": "a", "answer": "1"}\n{"problem": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataError) as err:
        load_file_set("x", FileSetConfig(path=str(tmp_path / "latin1.jsonl")))
    assert str(err.value) == f"{tmp_path / 'latin1.jsonl'}: line 2 is not UTF-8 text (byte 48)"


def test_file_set_missing_file_names_the_config_key_not_the_data_root(tmp_path, monkeypatch):
    """A user's file that does not exist: the config key (and the working directory of a relative path); the hint
    `build the data root with scripts/prepare_data.py` is for the built-in sets only."""
    from stapo.tasks.data import FileSetConfig, load_file_set

    with pytest.raises(DataFileNotFoundError) as err:
        load_file_set("x", FileSetConfig(path=str(tmp_path / "nope.jsonl")))
    assert str(err.value) == f"data.train_file.path: file not found: {tmp_path / 'nope.jsonl'}"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataFileNotFoundError) as err:
        load_file_set("mine", FileSetConfig(path="nope.jsonl"), key="data.custom_benchmarks.mine")
    assert str(err.value) == (f"data.custom_benchmarks.mine.path: file not found: nope.jsonl "
                              f"(a relative path is read from the working directory {tmp_path})")
    with pytest.raises(DataFileNotFoundError) as err:  # a built-in set keeps its data-root hint
        load_train_set("math_train", tmp_path)
    assert str(err.value) == (f"math_train: file not found: {tmp_path / 'train' / 'math_train_7474.json'} "
                              f"(build the data root with scripts/prepare_data.py)")


def test_train_config_selects_a_user_file(tmp_path):
    from stapo.config import load_config

    path = _write_rows(tmp_path / "my.jsonl", [{"question": "q", "answer": "1"}])
    cfg = load_config(None, ["data.train_set=file", f"data.train_file.path={path}", "data.train_file.problem_key=question"])
    assert cfg.data.train_set == "file" and cfg.data.train_file.path == str(path)
    assert cfg.data.train_file.problem_key == "question" and cfg.data.train_file.answer_key == "answer"
