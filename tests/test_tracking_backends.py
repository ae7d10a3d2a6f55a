"""Tracker backends and paper-scale hygiene (issue 33, items 4 and 5): logging.backends (wandb, tensorboard, none),
W&B's system metrics and console capture switches, incremental tables under one key, and the config checks."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from stapo.config import ConfigError, load_config
from stapo.run.tracking import TENSORBOARD_DIR, Tracker

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


class _FakeRun:
    def __init__(self, **init):
        self.init, self.rows, self.summary, self.dir = init, [], {}, str(init.get("dir"))

    def define_metric(self, *a, **k):
        pass

    def log(self, row, step=None):
        self.rows.append((row, step))

    def finish(self):
        pass


@pytest.fixture
def fake_wandb(monkeypatch):
    import wandb

    runs: list[_FakeRun] = []
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1])
    return runs


def _scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the TensorBoard event files in ``tb_dir``, read by tensorboard itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_every_scalar_at_its_step_and_a_resume_purges_the_redone_steps(tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    t = Tracker(run, {}, backends=["tensorboard"])
    assert t.mode == "disabled"  # no "wandb" in the list: W&B off whatever the mode
    for step in (1, 2, 3):
        t.log(step, {"critic/score/mean": step / 4, "actor/entropy": math.nan, "note": "text", "flag": True})
    t.finish()
    got = _scalars(run / TENSORBOARD_DIR)
    assert got["critic/score/mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [s for s, v in got["actor/entropy"]] == [1, 2, 3] and all(math.isnan(v) for _, v in got["actor/entropy"])
    assert "note" not in got and "flag" not in got and "step" not in got  # strings and booleans left out
    # a resume from the checkpoint of step 2 redoes step 3: the crashed launch's step-3 event is purged
    t = Tracker(run, {}, backends=["tensorboard"])
    t.log(3, {"critic/score/mean": 0.875})  # exact in float32 (TensorBoard stores float32)
    t.finish()
    assert _scalars(run / TENSORBOARD_DIR)["critic/score/mean"] == [(1, 0.25), (2, 0.5), (3, 0.875)]
    assert not (run / "wandb").exists() and len((run / "metrics.jsonl").read_text().splitlines()) == 4


def test_none_is_the_jsonl_files_alone(tmp_path, fake_wandb):
    t = Tracker(tmp_path / "r", {}, backends=["none"])
    t.log(1, {"x": 1.0})
    t.log_table(1, "completions", ["step", "a"], [[1, "x"]], incremental=True)
    t.finish()
    assert fake_wandb == [] and not (tmp_path / "r" / TENSORBOARD_DIR).exists()
    assert json.loads((tmp_path / "r" / "metrics.jsonl").read_text()) == {"step": 1, "x": 1.0}


@pytest.mark.parametrize("on", [True, False])
def test_system_metrics_and_console_capture_switch_wandbs_settings(tmp_path, fake_wandb, on):
    Tracker(tmp_path / "r", {}, mode="offline", system_metrics=on, console_capture=on).finish()
    settings = fake_wandb[0].init["settings"]
    assert settings.x_disable_stats is (not on)
    # on: console="auto", which wandb resolves to its capture method ("wrap" on Linux); off: "off"
    assert (settings.console != "off") is on


def test_an_incremental_table_is_one_key_that_grows_by_each_steps_rows(tmp_path, fake_wandb):
    t = Tracker(tmp_path / "r", {}, mode="offline", step_metric="training/global_step", wandb_step=True)
    t.log_table(5, "completions", ["step", "response"], [[5, "a"], [5, "b"]], incremental=True)
    t.log_table(5, "s2t/examples", ["token"], [["x"]], incremental=True)
    t.log_table(10, "completions", ["step", "response"], [[10, "c"]], incremental=True)
    t.log_table(10, "s2t/examples", ["token"], [["y"]], incremental=True)
    t.finish()
    rows = fake_wandb[0].rows
    names = [k for row, _ in rows for k in row if k != "training/global_step"]
    assert names == ["completions", "s2t/examples", "completions", "s2t/examples"]  # one key each, every step
    table = rows[2][0]["completions"]
    assert table is rows[0][0]["completions"] and table.log_mode == "INCREMENTAL"
    assert table.columns == ["step", "response"] and table.data == [[5, "a"], [5, "b"], [10, "c"]]
    examples = rows[3][0]["s2t/examples"]
    assert examples.columns == ["step", "token"] and examples.data == [[5, "x"], [10, "y"]]  # a step column added
    assert [step for _, step in rows] == [5, 5, 10, 10]
    # tables.jsonl: one row per (step, table), as before
    lines = [json.loads(x) for x in (tmp_path / "r" / "tables.jsonl").read_text().splitlines()]
    assert [(x["step"], x["name"], len(x["rows"])) for x in lines] == [
        (5, "completions", 2), (5, "s2t/examples", 1), (10, "completions", 1), (10, "s2t/examples", 1)]


def test_the_incremental_table_in_the_offline_wandb_files(tmp_path, monkeypatch):
    from test_eval_sweep import offline_records

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    t = Tracker(tmp_path / "r", {}, mode="offline", step_metric="training/global_step", wandb_step=True)
    for step in (1, 2):
        t.log_table(step, "completions", ["step", "response"], [[step, "a"]], incremental=True)
    t.finish()
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in offline_records(tmp_path / "r") if r.WhichOneof("record_type") == "history"]
    kinds = [h.get("completions/_type") or h.get("completions") for h in history]
    assert [h["training/global_step"] for h in history] == [1, 2]
    assert kinds == ["incremental-table-file", "incremental-table-file"], history
    assert not any(k.startswith("completions/step_") for h in history for k in h)


@pytest.mark.parametrize("override, match", [
    ("logging.backends=[wandb,mlflow]", "logging.backends"),
    ("logging.backends=[]", "logging.backends"),
    ("logging.backends=[none,wandb]", "logging.backends"),
    ("trainer.peak_flops=0", "trainer.peak_flops"),
    ("logging.method=' '", "logging.method")])
def test_bad_tracker_keys_are_one_line_errors(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(REPO / "configs" / "tiny_test.yaml", [override])
    assert "\n" not in str(e.value)


def test_the_defaults_log_to_wandb_with_system_metrics_and_console_capture():
    lc = load_config(REPO / "configs" / "cpu_smollm2_stapo.yaml").logging
    assert (lc.backends, lc.system_metrics, lc.console_capture) == (["wandb"], True, True)
