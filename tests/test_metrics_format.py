"""metrics.jsonl stores non-finite values in one documented form (docs/metrics.md#non-finite-values): the JSON
strings "nan", "inf", "-inf", read back as floats by stapo.run.tracking.read_metrics. Before, +inf was written as 1e+308
(a finite number every mean averaged in) and NaN as null; old files are still read as they were meant."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.run.tracking import CorruptJsonlError, Tracker, read_metrics  # noqa: E402


def test_inf_and_nan_are_written_as_strings_and_read_back_as_floats(tmp_path):
    tracker = Tracker(tmp_path, {}, mode="disabled")
    tracker.log(1, {"a": math.inf, "b": -math.inf, "c": math.nan, "d": 0.5, "e": torch.tensor(math.inf), "n": 3})
    line = tracker.metrics_path.read_text()
    assert json.loads(line) == {"step": 1, "a": "inf", "b": "-inf", "c": "nan", "d": 0.5, "e": "inf", "n": 3}
    assert "1e+308" not in line and "NaN" not in line and "Infinity" not in line  # strict JSON, no clamped number
    (row,) = read_metrics(tracker.metrics_path)
    assert row["step"] == 1 and row["a"] == math.inf and row["b"] == -math.inf and math.isnan(row["c"])
    assert (row["d"], row["e"], row["n"]) == (0.5, math.inf, 3)


def test_a_table_cell_that_is_not_finite_is_a_string_too(tmp_path):
    tracker = Tracker(tmp_path, {}, mode="disabled")
    tracker.log_table(2, "t", ["x", "y"], [[math.inf, None]])
    assert json.loads(tracker.tables_path.read_text())["rows"] == [["inf", None]]


def test_files_written_before_the_form_read_1e308_as_inf_and_null_as_nan(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1e+308, "b": -1e+308, "c": null, "d": 2.0}\n')
    (row,) = read_metrics(path)
    assert row["a"] == math.inf and row["b"] == -math.inf and math.isnan(row["c"]) and row["d"] == 2.0


def test_a_resume_keeps_the_form_when_it_rewrites_the_file(tmp_path):
    tracker = Tracker(tmp_path, {}, mode="disabled")
    tracker.log(1, {"a": math.inf})
    tracker.log(2, {"a": 1.0})
    tracker.truncate_after(1)
    assert tracker.metrics_path.read_text() == '{"step": 1, "a": "inf"}\n'


def test_a_damaged_line_is_named_not_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(CorruptJsonlError, match="line 2"):
        read_metrics(path)
