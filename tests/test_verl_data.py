"""scripts/verl/prepare_verl_data.py: DAPO-Math-17k and benchmarks as verl RL parquet with the JustRL prompt."""
from __future__ import annotations

import importlib.util

import pyarrow.parquet as pq

from conftest import REPO_ROOT
from stapo.tasks.prompts import BOXED_SUFFIX

_spec = importlib.util.spec_from_file_location("prepare_verl_data", REPO_ROOT / "scripts" / "verl" / "prepare_verl_data.py")
prep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prep)


def test_writes_verl_rows_with_the_boxed_suffix(shared_data_root, tmp_path):
    assert prep.main(["--data-root", str(shared_data_root), "--out", str(tmp_path), "--val", "aime24"]) == 0
    train = pq.read_table(tmp_path / "train.parquet")
    assert train.num_rows == 17917
    assert set(train.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    row = train.slice(0, 1).to_pylist()[0]
    assert row["data_source"] == "dapo_math_17k" and row["ability"] == "math"
    (msg,) = row["prompt"]
    assert msg["role"] == "user" and msg["content"].endswith("\n\n" + BOXED_SUFFIX)
    assert msg["content"].startswith("In triangle $ABC$")
    assert row["reward_model"] == {"style": "rule", "ground_truth": "34"}
    assert row["extra_info"] == {"index": 0, "id": "dapo_math_17k/0", "split": "train"}
    val = pq.read_table(tmp_path / "aime24.parquet")
    assert val.num_rows == 30 and set(val.column("data_source").to_pylist()) == {"aime24"}


def test_missing_data_root_exits_2(tmp_path):
    assert prep.main(["--data-root", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
