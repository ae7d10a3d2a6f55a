"""Data by config (issue 33, item 8): one ``datasets`` path for the built-in sets and the user's files, nested keys
and verl-format parquet, lists of files, hub datasets (offline: the one-line error).

The built-in sets' digests below were computed with the hand-written readers (``_read_jsonl`` / ``_read_json_list``
/ ``_read_parquet``) that the ``datasets`` path replaced, at commit 83da1ae (the last commit of stapo/tasks/data.py
before the change), with::

    mkdir -p /tmp/old && git archive 83da1ae stapo | tar -x -C /tmp/old
    .venv/bin/python tests/test_data_sources.py /tmp/old      # prints the table; without an argument: this checkout

(run from the repository root, with ``../shared/data``).  The digest is the SHA-256 over the records in order, one
JSON line ``[id, problem, answer, source]`` each (:func:`records_digest`).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# {name: (records, digest)} from the hand-written readers (module docstring); math_train keeps 7,470 of 7,474 rows.
OLD_READER_DIGESTS = {
    "aime24": (30, "8e541d95b72dab1a05d0a00eab76eb56068659805de9ac2e3b2450c574b9f953"),
    "aime25": (30, "b867d4c309315c4c07eeb7fb0a4590805e3d5c6636cd07629b26dc3fb4a9fdf9"),
    "amc23": (40, "7ea7bbd43474367caa7cfe9103b9a36cdb1461cbb464f8e581fe13b4aa0db0fc"),
    "math500": (500, "cab5c221eba17a9718050851764dcefd114ff2e1535353b58cd273bffc02f8d5"),
    "minerva_math": (272, "549ea21fcc672b41468cb25d40a80d4e8d99725f21f2c7faece58c562452aa19"),
    "olympiadbench": (675, "1c395393ccae0a5acd1237fa657a9ce4438694ce047cabed37f3458dd37d6f04"),
    "dapo_math_17k": (17917, "db3c0bfc9bcddd060673bfe08672b0186fc1d1fc1f67acdc5ca7eab004401017"),
    "math_train": (7470, "c684afd5b6e17557b4c9bfe6aba8a42ee635bbd3ee1dd5f1006404218f376292"),
}


def records_digest(records) -> str:
    """SHA-256 over one JSON line ``[id, problem, answer, source]`` per record, in order."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.id, r.problem, r.answer, r.source], ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def _load_builtin(data_module, name: str, root):
    if name in data_module.BENCHMARKS:
        return data_module.load_benchmark(name, root)
    return data_module.load_train_set(name, root)


@pytest.mark.parametrize("name", list(OLD_READER_DIGESTS))
def test_builtin_sets_read_by_datasets_keep_every_record(shared_data_root, name, monkeypatch):
    """Every record (id, problem, normalised gold, source, order) of each built-in set is what the hand-written
    readers gave, and the file was read by the one ``datasets`` reader the user's files use."""
    import stapo.tasks.data as data

    read = []
    real = data._read_table
    monkeypatch.setattr(data, "_read_table", lambda path, **kw: read.append(Path(path).name) or real(path, **kw))
    loaded = _load_builtin(data, name, shared_data_root)
    count, digest = OLD_READER_DIGESTS[name]
    assert (len(loaded), records_digest(loaded.records)) == (count, digest)
    assert read == [Path(data.benchmark_path(shared_data_root, name) if name in data.BENCHMARKS
                         else data.train_path(shared_data_root, name)).name]


# --- verl-format parquet: nested keys and a chat-list prompt ------------------------------------------------------


def _verl_parquet(path: Path, rows: list[dict] | None = None) -> Path:
    """A tiny verl-style RL parquet: data_source, prompt (chat list), ability, reward_model {style, ground_truth},
    extra_info {split, index} (verl's examples/data_preprocess layout)."""
    rows = rows if rows is not None else [
        {"data_source": "toy", "prompt": [{"role": "user", "content": "What is 1+1?"}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "train", "index": 10}},
        {"data_source": "toy", "prompt": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What is 3*3?"}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "$9$"}, "extra_info": {"split": "train", "index": 11}},
        {"data_source": "toy", "prompt": [{"role": "user", "content": "Pad 007?"}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "007"}, "extra_info": {"split": "train", "index": 12}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


VERL_KEYS = dict(problem_key="prompt", answer_key="reward_model.ground_truth", id_key="extra_info.index")


def test_verl_parquet_by_nested_keys_and_the_chat_prompt(tmp_path):
    from stapo.tasks.data import FileSetConfig, load_file_set

    path = _verl_parquet(tmp_path / "train.parquet")
    got = load_file_set("toy", FileSetConfig(path=str(path), **VERL_KEYS))
    # problem = the one user message's content (row 1's system message is not part of it); gold "$9$" -> "9";
    # "007" kept as is (integer_answers off); ids from extra_info.index
    assert [(r.id, r.problem, r.answer) for r in got] == [
        ("toy/10", "What is 1+1?", "2"), ("toy/11", "What is 3*3?", "9"), ("toy/12", "Pad 007?", "007")]
    spec = FileSetConfig(path=str(path), problem_key="prompt.0.content", answer_key="reward_model.ground_truth")
    assert [r.problem for r in load_file_set("toy", spec)] == ["What is 1+1?", "Be brief.", "Pad 007?"]  # item 0


def test_verl_parquet_by_train_config(tmp_path):
    """The same file named in a train.py config (dotted overrides of data.train_file)."""
    from stapo.config import load_config
    from stapo.tasks.data import file_set_name, load_file_set

    path = _verl_parquet(tmp_path / "dapo_like.parquet")
    cfg = load_config(None, ["data.train_set=file", f"data.train_file.path={path}", "data.train_file.problem_key=prompt",
                             "data.train_file.answer_key=reward_model.ground_truth",
                             "data.train_file.id_key=extra_info.index", "data.train_file.integer_answers=true"])
    name = file_set_name(cfg.data.train_file)
    assert name == "dapo_like"
    got = load_file_set(name, cfg.data.train_file)
    assert [(r.id, r.answer) for r in got] == [("dapo_like/10", "2"), ("dapo_like/11", "9"), ("dapo_like/12", "7")]


def test_skipped_rows_of_a_verl_parquet_are_named_in_the_warning(tmp_path, caplog):
    """Rows 1 (a chat without a user message) and 3 (a null ground truth) of 4 are skipped; the one warning counts
    them by reason and names them by their 0-based rows, so they can be found in the file."""
    from stapo.tasks.data import FileSetConfig, load_file_set

    def row(i: int, prompt: list, gold: str | None) -> dict:
        return {"data_source": "toy", "prompt": prompt, "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": gold}, "extra_info": {"split": "train", "index": i}}

    user = [{"role": "user", "content": "What is 1+1?"}]
    path = _verl_parquet(tmp_path / "bad.parquet", [row(0, user, "2"), row(1, [{"role": "system", "content": "x"}],
                                                                             "2"), row(2, user, "2"),
                                                    row(3, user, None)])
    with caplog.at_level("WARNING", logger="stapo.tasks.data"):
        got = load_file_set("toy", FileSetConfig(path=str(path), **VERL_KEYS))
    assert [r.id for r in got] == ["toy/0", "toy/2"]
    (msg,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert msg.startswith(f"{path}: skipped 2 of 4 rows (") and msg.endswith("; rows 1, 3)")
    assert "user message" in msg and "'reward_model.ground_truth': answer is null: 1" in msg
    # one bad row: "row 1"
    path = _verl_parquet(tmp_path / "one.parquet", [row(0, user, "2"), row(1, user, None)])
    caplog.clear()
    with caplog.at_level("WARNING", logger="stapo.tasks.data"):
        load_file_set("toy", FileSetConfig(path=str(path), **VERL_KEYS))
    (msg,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert msg == f"{path}: skipped 1 of 2 rows (field 'reward_model.ground_truth': answer is null: 1; row 1)"


def test_nested_key_errors_are_one_line(tmp_path):
    from stapo.tasks.data import DataError, FileSetConfig, load_file_set

    path = _verl_parquet(tmp_path / "v.parquet")
    with pytest.raises(DataError) as err:  # a field the struct column lacks: refused before any row
        load_file_set("v", FileSetConfig(path=str(path), problem_key="prompt", answer_key="reward_model.truth"))
    assert str(err.value) == (f"{path}: no field 'truth' in column 'reward_model' (data.train_file.answer_key); "
                              f"its fields: style, ground_truth")
    with pytest.raises(DataError) as err:
        load_file_set("v", FileSetConfig(path=str(path), problem_key="prompt", answer_key="reward.ground_truth"))
    assert str(err.value) == (f"{path}: no column 'reward' (data.train_file.answer_key); columns: data_source, "
                              f"prompt, ability, reward_model, extra_info")
    two_users = _verl_parquet(tmp_path / "two.parquet", [
        {"prompt": [{"role": "user", "content": "a"}], "reward_model": {"ground_truth": "1"}},
        {"prompt": [{"role": "user", "content": "b"}, {"role": "user", "content": "c"}],
         "reward_model": {"ground_truth": "2"}},
    ])
    spec = FileSetConfig(path=str(two_users), problem_key="prompt", answer_key="reward_model.ground_truth")
    with pytest.raises(DataError) as err:  # a bad row: the file and the row, in one line
        load_file_set("t", spec, on_bad_row="raise")
    assert str(err.value) == (f"{two_users}: row 1: field 'prompt' is a chat of 2 messages with 2 user messages; "
                              f"expected one")
    got = load_file_set("t", spec)  # training default: skipped and counted
    assert [r.problem for r in got] == ["a"] and got.stats.skipped == 1


def test_nested_keys_in_jsonl(tmp_path):
    """Dotted keys work in JSON lines too; a row whose nested value is null names the key."""
    from stapo.tasks.data import DataError, FileSetConfig, load_file_set

    path = tmp_path / "n.jsonl"
    path.write_text('{"q": {"text": "1+1?"}, "meta": {"gold": "2"}}\n{"q": {"text": "2+2?"}, "meta": {"gold": null}}\n')
    spec = FileSetConfig(path=str(path), problem_key="q.text", answer_key="meta.gold")
    with pytest.raises(DataError) as err:
        load_file_set("n", spec, on_bad_row="raise")
    assert str(err.value) == f"{path}: row 1: field 'meta.gold': answer is null"
    assert [(r.id, r.problem, r.answer) for r in load_file_set("n", spec)] == [("n/0", "1+1?", "2")]


# --- lists of files -----------------------------------------------------------------------------------------------


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_list_of_files(tmp_path):
    from stapo.config import load_config
    from stapo.tasks.data import DataError, FileSetConfig, load_file_set

    a = _jsonl(tmp_path / "a.jsonl", [{"problem": "p0", "answer": "1"}, {"problem": "p1", "answer": "2"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"problem": "p2", "answer": ""}, {"problem": "p3", "answer": "4"}])
    cfg = load_config(None, ["data.train_set=file", f"data.train_file.path=[{a},{b}]"])
    assert cfg.data.train_file.path == [str(a), str(b)]
    got = load_file_set("ab", cfg.data.train_file)
    # rows in list order; default ids count across the files (b's rows are 2 and 3); b's row 0 has an empty answer
    assert [(r.id, r.answer) for r in got] == [("ab/0", "1"), ("ab/1", "2"), ("ab/3", "4")]
    assert got.rows == [0, 1, 3] and got.stats.rows_read == 4 and got.stats.rows_loaded == 3
    assert got.stats.path == f"{a}, {b}"
    assert got.stats.first_skipped == ["b.jsonl: row 0: field 'answer': answer is empty"]
    with pytest.raises(DataError) as err:  # a bad row names its own file and its row in that file
        load_file_set("ab", cfg.data.train_file, on_bad_row="raise")
    assert str(err.value) == f"{b}: row 0: field 'answer': answer is empty"
    # ids from a column must be unique across the files
    c = _jsonl(tmp_path / "c.jsonl", [{"problem": "p", "answer": "1", "k": "x"}])
    d = _jsonl(tmp_path / "d.jsonl", [{"problem": "q", "answer": "2", "k": "x"}])
    with pytest.raises(DataError) as err:
        load_file_set("cd", FileSetConfig(path=[str(c), str(d)], id_key="k"), on_bad_row="raise")
    assert str(err.value) == f"{d}: row 0: duplicate id 'cd/x' (is the id key the right column?)"
    pq.write_table(pa.table({"problem": ["p"], "answer": ["1"]}), tmp_path / "e.parquet")
    with pytest.raises(DataError) as err:
        load_file_set("ae", FileSetConfig(path=[str(a), str(tmp_path / "e.parquet")]))
    assert str(err.value) == ("data.train_file.path: the files mix formats (a.jsonl: json, e.parquet: parquet); "
                              "list files of one format")
    with pytest.raises(DataError) as err:
        load_file_set("x", FileSetConfig(path=[str(a), "hf:openai/gsm8k"]))
    assert str(err.value) == ("data.train_file.path: a list holds files only; name one hub dataset as "
                              "data.train_file.path itself")


def test_file_set_digest_of_one_file_and_of_a_list(tmp_path):
    """The run fingerprint's data part: one file keeps its SHA-256 (as before); a list: the digest of the files'
    digests in order, so reordering or changing a file changes it."""
    from stapo.tasks.data import FileSetConfig, file_set_digest
    from stapo.common.fingerprint import file_sha256, json_digest
    from stapo.run.run_identity import data_part

    a = _jsonl(tmp_path / "a.jsonl", [{"problem": "p0", "answer": "1"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"problem": "p1", "answer": "2"}])
    assert file_set_digest(FileSetConfig(path=str(a))) == file_sha256(a)
    both = file_set_digest(FileSetConfig(path=[str(a), str(b)]))
    assert both == json_digest([file_sha256(a), file_sha256(b)])
    assert both != file_set_digest(FileSetConfig(path=[str(b), str(a)]))

    class Data:  # the fields of a config's data section that data_part reads
        train_set, root, train_file = "file", "data", FileSetConfig(path=[str(a), str(b)])

    assert data_part(Data) == (both, "data.train_file.path", f"{a}, {b}")


# --- hub datasets ---------------------------------------------------------------------------------------------------


def test_hub_dataset_unreachable_is_one_line(monkeypatch):
    """No network here: a hub id that is neither reachable nor cached gives one line naming the key and the dataset
    (offline mode is forced so that the test does not wait on retries)."""
    import datasets.config
    import huggingface_hub.constants

    from stapo.tasks.data import DataError, FileSetConfig, load_file_set

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as err:
        load_file_set("x", FileSetConfig(path="hf:stapo-tests/no-such-dataset:main@test", **VERL_KEYS),
                      key="data.custom_benchmarks.x")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("data.custom_benchmarks.x.path: cannot load hub dataset stapo-tests/no-such-dataset "
                          "(config main) split test: ConnectionError: ")
    assert msg.endswith("(the hub cannot be reached from here and the dataset is not in the local datasets cache: "
                        "load it once where the hub is reachable, or name a local file)")


def test_hub_source_loads_through_datasets(tmp_path):
    """``hf:<id>`` goes to ``datasets.load_dataset(<id>, <config>, split=<split>)``; a local dataset folder is an id
    it can load without the network (a verl-style parquet named by split)."""
    from stapo.tasks.data import FileSetConfig, _hub_source, file_set_digest, file_set_name, load_file_set

    assert _hub_source("hf:openai/gsm8k:main@test") == ("openai/gsm8k", "main", "test")
    assert _hub_source("hf:openai/gsm8k") == ("openai/gsm8k", None, "train")
    folder = tmp_path / "toy_verl"
    folder.mkdir()
    _verl_parquet(folder / "train.parquet")
    spec = FileSetConfig(path=f"hf:{folder}@train", **VERL_KEYS)
    assert file_set_name(spec) == "toy_verl"
    got = load_file_set("toy", spec)
    assert [(r.id, r.answer) for r in got] == [("toy/10", "2"), ("toy/11", "9"), ("toy/12", "007")]
    assert got.stats.path == f"hf:{folder}@train"
    from stapo.common.fingerprint import json_digest

    assert file_set_digest(spec, name="toy") == f"hub:hf:{folder}@train:" + json_digest(
        [["toy/10", "What is 1+1?", "2"], ["toy/11", "What is 3*3?", "9"], ["toy/12", "Pad 007?", "007"]])


def test_a_custom_benchmark_from_a_verl_parquet_and_a_list(tmp_path):
    """evaluate.py's data.custom_benchmarks go through the same FileSetConfig: a verl parquet by nested keys, and a
    list of files (benchmark_file, the file the evaluation fingerprints, is its first; a hub dataset has none)."""
    from stapo.evaluation.config import CustomBenchmarkConfig
    from stapo.evaluation.runner import benchmark_file, load_problems

    path = _verl_parquet(tmp_path / "bench.parquet")
    custom = {"mine": CustomBenchmarkConfig(path=str(path), samples=1, **VERL_KEYS)}
    problems = load_problems(tmp_path / "no_root", ["mine"], None, custom)  # no data root needed for custom sets
    assert [(p.record.id, p.record.problem, p.record.answer) for p in problems["mine"]] == [
        ("mine/10", "What is 1+1?", "2"), ("mine/11", "What is 3*3?", "9"), ("mine/12", "Pad 007?", "007")]
    a = _jsonl(tmp_path / "a.jsonl", [{"problem": "p0", "answer": "1"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"problem": "p1", "answer": "2"}])
    custom = {"two": CustomBenchmarkConfig(path=[str(a), str(b)]), "hub": CustomBenchmarkConfig(path="hf:x/y")}
    assert [p.record.id for p in load_problems(tmp_path, ["two"], None, custom)["two"]] == ["two/0", "two/1"]
    assert benchmark_file(tmp_path, "two", custom) == a and benchmark_file(tmp_path, "hub", custom) is None


if __name__ == "__main__":  # the digest table of OLD_READER_DIGESTS, from the stapo package under argv[1]
    sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))
    import stapo.tasks.data as _data

    for _name in OLD_READER_DIGESTS:
        _loaded = _load_builtin(_data, _name, "../shared/data")
        print(f'    "{_name}": ({len(_loaded)}, "{records_digest(_loaded.records)}"),')
