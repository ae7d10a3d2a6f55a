"""Evaluation joins training (issue 16, item 2): a train.py checkpoint is evaluated at its training step in the
training run's W&B group, a sweep over a run's checkpoints (resumable, damaged ones skipped, one curve),
trainer.val_before_train, and the validation presets.

The training run is the tiny model (configs/tiny_test.yaml, HF rollouts, toy reward): 2 steps, a checkpoint after
each. The evaluation is configs/eval/tiny_test.yaml cut to AIME24's first problem, N = 2, one decoding setting:
2 samples of 8 tokens per checkpoint.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stapo.evaluation import EvalError, load_eval_config  # noqa: E402
from stapo.evaluation.config import checkpoint_selection  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Iterator[Path]:
    """runs/toy: 2 training steps of the tiny model (objective stapo, seed 0), checkpoints step_000001, step_000002."""
    from toy_run import make_trainer

    out = tmp_path_factory.mktemp("runs")
    trainer = make_trainer(str(out), ["trainer.total_steps=2", "trainer.save_every=1", "trainer.keep_last=2"])
    try:
        trainer.train()
    finally:
        trainer.close()
    yield out / "toy"
    shutil.rmtree(out, ignore_errors=True)  # a module's ~200 MB of checkpoints freed when its tests are done (pytest keeps factory folders to the end)


def sweep_cfg(root: Path, run: Path, out: Path, *overrides: str):
    return load_eval_config(REPO / "configs" / "eval" / "tiny_test.yaml", [
        f"data.root={root}", f"model.path={run}", f"output.dir={out}", "data.benchmarks=[aime24]", "data.limit=1",
        "data.samples.aime24=2", "generation.settings=[{name: t1.0_p1.0, temperature: 1.0, top_p: 1.0}]",
        *overrides])


class FakeWandbRun:
    """What the Tracker gives wandb: wandb.init's keywords, define_metric calls and logged rows."""

    def __init__(self, **init):
        self.init, self.defined, self.rows, self.dir = init, [], [], str(init.get("dir"))
        self.summary: dict = {}

    def define_metric(self, name, step_metric=None, **_):
        self.defined.append((name, step_metric))

    def log(self, row, step=None):
        self.rows.append((row, step))

    def finish(self):
        pass


@pytest.fixture
def fake_wandb(monkeypatch):
    import wandb

    runs: list[FakeWandbRun] = []

    def init(**kw):
        runs.append(FakeWandbRun(**kw))
        return runs[-1]

    monkeypatch.setattr(wandb, "init", init)
    return runs


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- the sweep ------------------------------------------------------------------------------------------------
def test_a_sweep_of_two_checkpoints_is_two_points_on_the_training_step_axis(shared_data_root, tmp_path, tiny_run,
                                                                             fake_wandb, capsys):
    from stapo.evaluation.sweep import run_sweep

    out = tmp_path / "sweep"
    res = run_sweep(sweep_cfg(shared_data_root, tiny_run, out, "model.checkpoints=all", "logging.wandb_mode=offline"))
    assert (res["evaluated"], res["skipped"], res["damaged"]) == ([1, 2], [], [])
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith("step_")) == [
        "step_000001", "step_000002"]
    # metrics.jsonl of the sweep folder: one row per checkpoint, at its training step
    got = rows(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2]
    assert all("eval/t1.0_p1.0/aime24/avg@N" in r and "eval/t1.0_p1.0/average/avg@N" in r for r in got)
    # ... and the in-training validation's names of the same numbers (one decoding setting, N = 2): the same charts
    for r in got:
        assert r["val-core/aime24/acc/mean@2"] == r["eval/t1.0_p1.0/aime24/avg@N"]
        assert r["val-core/average/acc/mean@2"] == r["eval/t1.0_p1.0/average/avg@N"]
        assert r["val-aux/response_length/mean"] == r["eval/t1.0_p1.0/average/mean_response_tokens"]
    # sweep.csv: (step, setting, benchmark) rows; AIME24 and the average per checkpoint
    with (out / "sweep.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(r["step"], r["benchmark"]) for r in table] == [("1", "aime24"), ("1", "average"), ("2", "aime24"),
                                                            ("2", "average")]
    assert "| step |" in (out / "sweep.md").read_text()
    # W&B: ONE run for the sweep, in the training run's group, job_type eval, plotted against training/global_step
    assert len(fake_wandb) == 1
    run = fake_wandb[0]
    train_cfg = json.loads((tiny_run / "config.json").read_text())
    assert run.init["group"] == (train_cfg["logging"].get("group") or "toy")
    assert run.init["job_type"] == "eval"
    assert run.init["tags"] == (train_cfg["logging"].get("tags") or ["stapo", "tiny", "strict_box"])
    assert run.init["config"]["algorithm"]["objective"] == "stapo"
    assert run.init["config"]["trainer"]["seed"] == 0
    assert run.init["config"]["train_run"]["model"] == "tiny" and run.init["config"]["train_run"]["run"] == "toy"
    # the W&B config's logging section is the identity the run is logged under, not the eval config's unset keys
    logged = run.init["config"]["logging"]
    assert (logged["group"], logged["tags"], logged["job_type"]) == (run.init["group"], run.init["tags"], "eval")
    assert (logged["family"], logged["method"]) == (train_cfg["logging"]["family"], train_cfg["logging"]["method"])
    # the final numbers in the training run's folder (its W&B summary too when it has a W&B run; this one has none)
    final = json.loads((tiny_run / "eval_summary.json").read_text())
    assert final["step"] == 2 and final["values"]["eval/global_step"] == 2
    assert final["values"]["eval/t1.0_p1.0/aime24/avg@N"] == got[1]["eval/t1.0_p1.0/aime24/avg@N"]
    assert ("*", "training/global_step") in run.defined
    scalars = [row for row, _ in run.rows if "eval/t1.0_p1.0/aime24/avg@N" in row]
    assert [row["training/global_step"] for row in scalars] == [1, 2]
    assert all(step is None for _, step in run.rows)  # W&B's own _step only counts rows


def test_a_rerun_skips_finished_checkpoints_and_redoes_a_missing_one(shared_data_root, tmp_path, tiny_run, capsys):
    from stapo.evaluation.sweep import run_sweep

    out = tmp_path / "sweep"
    cfg = lambda: sweep_cfg(shared_data_root, tiny_run, out, "model.checkpoints=all")  # noqa: E731
    run_sweep(cfg())
    gens = {p: p.read_bytes() for p in out.rglob("generations/*.jsonl")}
    capsys.readouterr()
    again = run_sweep(cfg())
    assert (again["evaluated"], again["skipped"]) == ([], [1, 2])
    err = capsys.readouterr().err
    assert err.count("already evaluated") == 2 and "step_000001" in err and "step_000002" in err
    assert {p: p.read_bytes() for p in out.rglob("generations/*.jsonl")} == gens  # nothing generated again
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2]  # the rows replaced, not appended
    # a checkpoint whose evaluation did not finish (no results.json): evaluated again, its stored samples reused
    (out / "step_000002" / "results.json").unlink()
    third = run_sweep(cfg())
    assert (third["evaluated"], third["skipped"]) == ([2], [1])
    assert third["results"][1]["run"]["generated"] == 0
    # a sweep of step 2 alone keeps step 1 (evaluated before, same settings) on the curve
    only = run_sweep(sweep_cfg(shared_data_root, tiny_run, out, "model.checkpoints=[2]"))
    assert (only["skipped"], only["earlier"], [r["step"] for r in rows(out / "metrics.jsonl")]) == ([2], [1], [1, 2])
    # a wider protocol (a second benchmark) is not "finished": both checkpoints are extended
    wider = run_sweep(sweep_cfg(shared_data_root, tiny_run, out, "model.checkpoints=[1,2]",
                                "data.benchmarks=[aime24,math500]", "data.samples.math500=1"))
    assert wider["evaluated"] == [1, 2] and all("math500" in r["metrics"]["t1.0_p1.0"]["benchmarks"]
                                                for r in wider["results"])


def test_one_checkpoint_is_logged_at_its_step_in_the_training_run_group(shared_data_root, tmp_path, tiny_run,
                                                                         fake_wandb):
    from stapo.evaluation import run_evaluation

    cfg = sweep_cfg(shared_data_root, tiny_run / "checkpoints" / "step_000001", tmp_path / "one",
                    "logging.wandb_mode=offline", "logging.notes=hello")
    res = run_evaluation(cfg)
    assert res["training"]["step"] == 1 and res["training"]["objective"] == "stapo"
    assert [r["step"] for r in rows(tmp_path / "one" / "metrics.jsonl")] == [1]
    (run,) = fake_wandb
    assert (run.init["job_type"], run.init["notes"]) == ("eval", "hello")
    assert [row["training/global_step"] for row, _ in run.rows] == [1, 1, 1]  # scalars, eval/summary, eval/details


def test_a_rerun_logs_only_new_points_and_starts_no_wandb_when_there_are_none(shared_data_root, tmp_path, tiny_run,
                                                                            fake_wandb):
    """Defect #10: a sweep of step 1, then of every checkpoint, then again: W&B gets step 1, then step 2 alone (in
    the same W&B run), then nothing (no wandb.init); metrics.jsonl always holds every point."""
    from stapo.evaluation.report import WANDB_LOGGED
    from stapo.evaluation.sweep import run_sweep

    out = tmp_path / "sweep"
    cfg = lambda sel: sweep_cfg(shared_data_root, tiny_run, out, f"model.checkpoints={sel}",  # noqa: E731
                                "logging.wandb_mode=offline")

    def steps(run):  # the training steps of the rows logged to one W&B run: scalars, eval/summary, eval/details
        return [row["training/global_step"] for row, _ in run.rows]

    run_sweep(cfg("[1]"))
    assert len(fake_wandb) == 1 and steps(fake_wandb[0]) == [1, 1, 1]
    record = json.loads((out / WANDB_LOGGED).read_text())
    assert record["run_id"] == (out / "wandb_run_id").read_text().strip() == fake_wandb[0].init["id"]
    assert sorted(record["points"]) == ["1"]
    run_sweep(cfg("all"))  # step 1 skipped (already evaluated and logged), step 2 new
    assert len(fake_wandb) == 2 and steps(fake_wandb[1]) == [2, 2, 2]
    assert fake_wandb[1].init["id"] == fake_wandb[0].init["id"]  # the same W&B run, resumed
    assert sorted(json.loads((out / WANDB_LOGGED).read_text())["points"]) == ["1", "2"]
    run_sweep(cfg("all"))  # nothing new: W&B not started at all
    assert len(fake_wandb) == 2
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2]  # the local mirror keeps every point
    assert [(r["step"], r["name"]) for r in rows(out / "tables.jsonl")] == [
        (1, "eval/summary"), (1, "eval/details"), (2, "eval/summary"), (2, "eval/details")]
    # another W&B run (its id file replaced, e.g. a copied folder): the record is not its, so every point is logged
    (out / "wandb_run_id").write_text("other123")
    run_sweep(cfg("all"))
    assert len(fake_wandb) == 3 and steps(fake_wandb[2]) == [1, 1, 1, 2, 2, 2]


def test_a_rerun_of_one_checkpoint_evaluation_logs_it_once(shared_data_root, tmp_path, tiny_run, fake_wandb):
    """Defect #10, single evaluation: a plain rerun does not log the summary again; a rerun that extends the
    evaluation (data.limit 1 → 2: new samples, new numbers) logs the changed point."""
    from stapo.evaluation import run_evaluation

    ckpt = tiny_run / "checkpoints" / "step_000001"
    run_evaluation(sweep_cfg(shared_data_root, ckpt, tmp_path / "one", "logging.wandb_mode=offline"))
    run_evaluation(sweep_cfg(shared_data_root, ckpt, tmp_path / "one", "logging.wandb_mode=offline"))
    assert len(fake_wandb) == 1
    assert [r["step"] for r in rows(tmp_path / "one" / "metrics.jsonl")] == [1]
    run_evaluation(sweep_cfg(shared_data_root, ckpt, tmp_path / "one", "logging.wandb_mode=offline", "data.limit=2"))
    assert len(fake_wandb) == 2 and [row["training/global_step"] for row, _ in fake_wandb[1].rows] == [1, 1, 1]
    assert fake_wandb[1].rows[0][0]["eval/t1.0_p1.0/aime24/avg@N"] is not None


def test_a_base_model_is_logged_at_step_0_without_a_training_run():
    from stapo.evaluation.report import result_step, wandb_identity

    res = {"label": "smollm2", "model": {"step": None}, "config": {"a": 1}, "training": None}
    ident = wandb_identity(res, group="mine")
    assert result_step(res) == 0
    assert (ident["group"], ident["job_type"], ident["tags"]) == ("mine", "eval", [])
    assert ident["config"] == {"a": 1, "logging": {"project": "stapo", "entity": None, "group": "mine", "tags": [],
                                                   "job_type": "eval", "family": None, "study": None,
                                                   "method": None}}


def _result(run_dir: Path, step: int, avg: float) -> dict:
    """A results.json of a train.py checkpoint at ``step``: AIME24 avg@N = ``avg``, N = 4, one setting."""
    stats = {"N": 4, "problems": 2, "avg@N": avg, "pass@1": avg, "pass@N": 1.0, "maj@N": 0.5,
             "mean_response_tokens": 10.0, "truncation_rate": 0.0, "samples": 8,
             "grader": {"no_answer": 2, "timeout": 0, "error": 0}}
    return {"label": f"r@{step}", "model": {"step": step},
            "training": {"run": run_dir.name, "run_dir": str(run_dir), "step": step},
            "metrics": {"t1.0_p1.0": {"benchmarks": {"aime24": stats}, "average": stats}}}


def _train_run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "stapo_seed0"
    run.mkdir(parents=True)
    (run / "wandb_run_id").write_text("abc12345")
    (run / "config.json").write_text(json.dumps({"logging": {
        "project": "p", "entity": None, "group": "cpu_smollm2-stapo", "tags": ["stapo", "family:cpu_smollm2"],
        "job_type": "train"}}))
    return run


def test_the_final_numbers_go_into_the_training_runs_wandb_summary(tmp_path, fake_wandb, capsys):
    from stapo.evaluation.report import write_train_summary

    run = _train_run(tmp_path)
    # a sweep of steps 1 and 3: the latest step's numbers (0.75), into the training run resumed by its id
    got = write_train_summary([_result(run, 3, 0.75), _result(run, 1, 0.25)], mode="offline")
    assert got == {"eval/t1.0_p1.0/aime24/avg@N": 0.75, "eval/t1.0_p1.0/aime24/pass@1": 0.75,
                   "eval/t1.0_p1.0/aime24/pass@N": 1.0, "eval/t1.0_p1.0/aime24/maj@N": 0.5,
                   "eval/t1.0_p1.0/aime24/mean_response_tokens": 10.0,
                   "eval/t1.0_p1.0/aime24/truncation_rate": 0.0, "eval/t1.0_p1.0/average/avg@N": 0.75,
                   "eval/t1.0_p1.0/average/pass@1": 0.75, "eval/t1.0_p1.0/average/pass@N": 1.0,
                   "eval/t1.0_p1.0/average/maj@N": 0.5, "eval/t1.0_p1.0/average/mean_response_tokens": 10.0,
                   "eval/t1.0_p1.0/average/truncation_rate": 0.0, "eval/global_step": 3}
    (w,) = fake_wandb
    assert (w.init["id"], w.init["resume"], w.init["dir"], w.init["mode"]) == ("abc12345", "allow", str(run),
                                                                               "offline")
    assert (w.init["project"], w.init["name"], w.init["group"], w.init["job_type"]) == (
        "p", "stapo_seed0", "cpu_smollm2-stapo", "train")
    assert w.summary == got and w.rows == []  # the summary only: no history row
    assert json.loads((run / "eval_summary.json").read_text()) == {"step": 3, "values": got}
    # an evaluation of an earlier checkpoint afterwards does not replace the final numbers
    assert write_train_summary(_result(run, 2, 0.5), mode="offline") is None
    assert "holds the evaluation of step 3" in capsys.readouterr().err and len(fake_wandb) == 1
    # disabled: the file only; a base model (no training run): nothing
    assert write_train_summary(_result(run, 4, 0.5), mode="disabled")["eval/global_step"] == 4
    assert len(fake_wandb) == 1
    assert write_train_summary({**_result(run, 5, 0.5), "training": None}) is None


def _tensorboard_scalars(folder: Path, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``key`` in the TensorBoard event files of ``folder`` (purged events left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def _full_result(run_dir: Path, step: int, avg: float) -> dict:
    """:func:`_result` with every field the reports read (verifier count, every grader status)."""
    from stapo.evaluation.metrics import GRADER_STATUSES

    res = _result(run_dir, step, avg)
    stats = res["metrics"]["t1.0_p1.0"]["average"]  # the same dict as AIME24's
    stats.update(verifier_accepted=0, grader={k: 0 for k in GRADER_STATUSES})
    return res


def test_evaluate_follows_logging_backends(tmp_path, fake_wandb):
    """evaluate.py's logging.backends, as train.py's: without wandb no W&B run at all (neither the evaluation's nor
    the training run's summary update), tensorboard: the points in <output>/tensorboard; [none]: the JSONL files."""
    pytest.importorskip("tensorboard")
    from stapo.evaluation.runner import log_results_to_wandb

    run = _train_run(tmp_path)
    cfg = load_eval_config(REPO / "configs" / "eval" / "tiny_test.yaml",
                           ["logging.wandb_mode=offline", "logging.backends=[tensorboard]"])
    out = tmp_path / "eval"
    log_results_to_wandb([_full_result(run, 1, 0.25), _full_result(run, 3, 0.75)], out, cfg)
    assert fake_wandb == [] and not (out / "wandb").exists() and not (run / "wandb").exists()
    assert json.loads((run / "eval_summary.json").read_text())["values"]["eval/t1.0_p1.0/aime24/avg@N"] == 0.75
    key = "eval/t1.0_p1.0/aime24/avg@N"
    assert _tensorboard_scalars(out / "tensorboard", key) == [(1, 0.25), (3, 0.75)]
    # a rerun with a checkpoint more (step 2, 0.5) rewrites the points from the lowest step: 1, 2, 3 once each
    log_results_to_wandb([_full_result(run, 1, 0.25), _full_result(run, 2, 0.5), _full_result(run, 3, 0.75)], out, cfg)
    assert _tensorboard_scalars(out / "tensorboard", key) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    # the same numbers under the validation's name (N = 4, one setting): val-core/aime24/acc/mean@4
    assert _tensorboard_scalars(out / "tensorboard", "val-core/aime24/acc/mean@4") == [(1, 0.25), (2, 0.5),
                                                                                        (3, 0.75)]
    # [none]: metrics.jsonl only
    cfg = load_eval_config(REPO / "configs" / "eval" / "tiny_test.yaml",
                           ["logging.wandb_mode=offline", "logging.backends=[none]"])
    log_results_to_wandb(_full_result(run, 4, 1.0), tmp_path / "eval_none", cfg)
    assert fake_wandb == [] and sorted(p.name for p in (tmp_path / "eval_none").iterdir()) == ["metrics.jsonl",
                                                                                               "tables.jsonl"]
    assert [r["step"] for r in rows(tmp_path / "eval_none" / "metrics.jsonl")] == [4]


@pytest.mark.parametrize("override, key", [("logging.backends=[tensorbord]", "logging.backends"),
                                           ("logging.backends=[none,wandb]", "logging.backends"),
                                           ("logging.group=' '", "logging.group")])
def test_evaluate_refuses_a_bad_logging_section_in_one_line(override, key):
    with pytest.raises(EvalError) as e:
        load_eval_config(REPO / "configs" / "eval" / "tiny_test.yaml", [override])
    assert f"'{key}'" in str(e.value) and "\n" not in str(e.value)


def test_the_training_runs_summary_in_its_offline_wandb_files(tmp_path, monkeypatch):
    from stapo.evaluation.report import write_train_summary

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = _train_run(tmp_path)
    write_train_summary(_result(run, 3, 0.75), mode="offline")
    recs = offline_records(run)
    (rec,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert (rec.run_id, rec.run_group) == ("abc12345", "cpu_smollm2-stapo")  # the training run, resumed by its id
    summary = {i.key: json.loads(i.value_json) for r in recs if r.WhichOneof("record_type") == "summary"
               for i in r.summary.update}
    assert summary["eval/t1.0_p1.0/aime24/avg@N"] == 0.75 and summary["eval/global_step"] == 3


def offline_records(run_dir: Path) -> list:
    """The records of the newest offline W&B run under ``run_dir/wandb``, parsed with wandb's own protobuf schema
    (``wandb.proto.wandb_internal_pb2.Record``). The file is wandb's transaction log (the LevelDB log layout: a
    7-byte ``:W&B`` header, 32 KiB blocks, each record chunk ``crc32 (4) | length (2) | type (1: full, 2: first,
    3: middle, 4: last)``); wandb 0.31 has no Python reader for it any more (its Go core reads it)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    path = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))[-1]
    data, pos, block, chunks, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # block padding
            pos += left
            continue
        chunks = (b"" if kind in (1, 2) else chunks) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(chunks)
            out.append(rec)
    return out


def test_the_offline_wandb_file_holds_the_curve_in_the_training_group(shared_data_root, tmp_path, tiny_run,
                                                                        monkeypatch):
    from stapo.evaluation.sweep import run_sweep

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "sweep"
    run_sweep(sweep_cfg(shared_data_root, tiny_run, out, "model.checkpoints=all", "logging.wandb_mode=offline"))
    recs = offline_records(out)
    kinds = [r.WhichOneof("record_type") for r in recs]
    assert kinds.count("run") == 1, kinds
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    group = json.loads((tiny_run / "config.json").read_text())["logging"].get("group") or "toy"
    assert (run.run_group, run.job_type) == (group, "eval")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["algorithm"]["objective"] == "stapo" and config["train_run"]["run"] == "toy"
    metrics = [(r.metric.name, r.metric.glob_name, r.metric.step_metric) for r in recs
               if r.WhichOneof("record_type") == "metric"]
    assert ("", "*", "training/global_step") in metrics
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in recs
               if r.WhichOneof("record_type") == "history"]
    points = [h["training/global_step"] for h in history if "eval/t1.0_p1.0/aime24/avg@N" in h]
    assert points == [1, 2]  # two points on the training-step axis


# --- selection, damaged checkpoints and folders -----------------------------------------------------------------
def fake_checkpoints(run: Path, steps=(1, 2, 3)) -> None:
    from stapo.common.checkpoint_files import _write_marker

    for step in steps:
        ckpt = run / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text("{}")
        (ckpt / "model.safetensors").write_bytes(b"w" * 100)
        (ckpt / "trainer_state.pt").write_bytes(b"s" * 10)
        _write_marker(ckpt, step)


def test_checkpoint_selection_forms():
    assert checkpoint_selection(None) is None
    assert checkpoint_selection("ALL") == "all" and checkpoint_selection("latest") == "latest"
    assert checkpoint_selection([20, 10, 20]) == [10, 20] and checkpoint_selection("10,20") == [10, 20]
    assert checkpoint_selection(5) == [5]
    for bad in ("every", [1.5], [], True, [1, "x"]):
        with pytest.raises(EvalError, match="model.checkpoints"):
            checkpoint_selection(bad)


def test_plan_skips_a_damaged_checkpoint_and_names_missing_steps(tmp_path):
    from stapo.evaluation.sweep import plan_sweep

    run = tmp_path / "run"
    fake_checkpoints(run)
    (run / "checkpoints" / "step_000002" / "model.safetensors").write_bytes(b"w" * 40)  # truncated after the save
    for spec in (run, run / "checkpoints", run / "checkpoints" / "step_000001"):
        plan = plan_sweep(str(spec), "all")
        assert [s for s, _ in plan.checkpoints] == [1, 3]
        assert [(s, why) for s, _, why in plan.damaged] == [(2, "model.safetensors is 40 bytes, 100 were written")]
    assert [s for s, _ in plan_sweep(str(run), "latest").checkpoints] == [3]
    assert [s for s, _ in plan_sweep(str(run), [1, 3]).checkpoints] == [1, 3]
    with pytest.raises(EvalError, match=r"no checkpoint of step\(s\) \[4\].*steps there: \[1, 2, 3\]"):
        plan_sweep(str(run), [3, 4])
    with pytest.raises(EvalError, match="needs a train.py run folder"):
        plan_sweep(str(tmp_path), "all")


def test_sweep_cli_names_a_damaged_checkpoint_in_one_line(shared_data_root, tmp_path, capsys):
    """evaluate.py --all-checkpoints on a run whose only checkpoint is damaged: refused before anything loads, in
    one line naming the checkpoint and the reason (exit 2). (With intact ones beside it, each damaged one is one
    line on stderr and skipped: test_plan_skips_a_damaged_checkpoint_and_names_missing_steps, run_sweep.)"""
    import runpy

    run = tmp_path / "run"
    fake_checkpoints(run, steps=(1,))
    (run / "checkpoints" / "step_000001" / "trainer_state.pt").write_bytes(b"")
    main = runpy.run_path(str(REPO / "evaluate.py"), run_name="evaluate_cli")["main"]
    rc = main(["--config", str(REPO / "configs/eval/tiny_test.yaml"), "--model", str(run), "--all-checkpoints",
               "--data-root", str(shared_data_root), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "step_000001: trainer_state.pt is 0 bytes" in err


def test_sweep_dry_run_plans_the_real_sweep_and_refuses_what_it_refuses(shared_data_root, tmp_path, tiny_run,
                                                                         monkeypatch, capsys):
    """Defect #6: evaluate.py --dry-run with --all-checkpoints / --checkpoints shows the sweep's checkpoints, their
    folders, which are already evaluated (skipped) or damaged, and the cost of the rest; writes and loads nothing;
    refuses an unknown step with the real sweep's one line (exit 2)."""
    import runpy
    import shutil

    from stapo.evaluation.sweep import plan_sweep, run_sweep

    def must_not_run(*args, **kwargs):
        raise AssertionError("--dry-run loaded a model or started an engine")

    # a run with tiny_run's two checkpoints (linked) and a damaged third one
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(tiny_run / "config.json", run / "config.json")
    for name in ("step_000001", "step_000002"):
        (run / "checkpoints" / name).symlink_to(tiny_run / "checkpoints" / name, target_is_directory=True)
    fake_checkpoints(run, steps=(3,))
    (run / "checkpoints" / "step_000003" / "trainer_state.pt").write_bytes(b"")
    out = tmp_path / "sweep"
    run_sweep(sweep_cfg(shared_data_root, run, out, "model.checkpoints=[1]"))  # step 1 evaluated for real
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    monkeypatch.setattr("stapo.evaluation.runner._load_model", must_not_run)
    monkeypatch.setattr("stapo.evaluation.runner._build_engine", must_not_run)
    main = runpy.run_path(str(REPO / "evaluate.py"), run_name="evaluate_cli")["main"]
    argv = ["--config", str(REPO / "configs/eval/tiny_test.yaml"), "data.benchmarks=[aime24]", "data.limit=1",
            "data.samples.aime24=2", "generation.settings=[{name: t1.0_p1.0, temperature: 1.0, top_p: 1.0}]",
            "--model", str(run), "--data-root", str(shared_data_root), "--output", str(out), "--dry-run"]
    capsys.readouterr()
    assert main(argv + ["--all-checkpoints"]) == 0
    text = capsys.readouterr().out
    assert f"sweep of {run} (model.checkpoints=all): sweep folder {out} (exists)" in text
    assert "checkpoints: 3 selected — 1 to evaluate, 1 already evaluated (skipped), 1 damaged (skipped)" in text
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("  step ")}
    assert f"{out / 'step_000001'}  already evaluated: skipped" in lines["1"]
    # step 2: 1 AIME24 problem × N = 2 under 1 setting = 2 samples, none stored
    assert f"{out / 'step_000002'}  to evaluate (2 samples to generate)" in lines["2"]
    assert "damaged (trainer_state.pt is 0 bytes, 10 were written): skipped" in lines["3"]
    assert "samples: 2 per setting (avg@N) × 1 setting(s) (t1.0_p1.0) = 2; to generate: 2" in text
    assert "generated tokens ≤ 16 (2 × 8 max new tokens)" in text  # 2 samples × 8 new tokens
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing written
    # a list of steps: the same refusal as the real sweep, one line, exit 2
    with pytest.raises(EvalError) as real:
        plan_sweep(str(run), [1, 7])
    assert main(argv + ["--checkpoints", "1", "7"]) == 2
    err = capsys.readouterr().err
    assert err == f"evaluate.py: error: {real.value}\n" and "no checkpoint of step(s) [7]" in err


def test_a_run_folder_names_every_damaged_checkpoint(tmp_path, capsys):
    """Defect #13c: --model <run> where step 3 fails its checksum and step 2 has lost trainer_state.pt: one line
    for each, then the one-line error."""
    from stapo.evaluation.model_source import resolve_model_source

    run = tmp_path / "run"
    fake_checkpoints(run, steps=(2, 3))
    (run / "checkpoints" / "step_000003" / "model.safetensors").write_bytes(b"x" * 100)  # same size, other bytes
    (run / "checkpoints" / "step_000002" / "trainer_state.pt").unlink()
    with pytest.raises(EvalError, match="has no intact checkpoint"):
        resolve_model_source(str(run))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert "step_000003 is damaged (model.safetensors does not match its checksum" in err[0]
    assert "step_000002 is damaged (trainer_state.pt is missing)" in err[1]


def test_loading_weights_bar_follows_logging_progress_bar(tiny_run, capsys):
    """Defect #13a: transformers' "Loading weights" bar only with logging.progress_bar (and its setting restored)."""
    from transformers.utils import logging as hf_logging

    from stapo.evaluation.model_source import resolve_model_source
    from stapo.evaluation.runner import _load_model

    source = resolve_model_source(str(tiny_run / "checkpoints" / "step_000001"))
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as a fresh process has it (unless HF_HUB_DISABLE_PROGRESS_BARS is set)
    try:
        for progress_bar in (False, True):
            cfg = load_eval_config(REPO / "configs" / "eval" / "tiny_test.yaml",
                                   [f"logging.progress_bar={progress_bar}"])
            _load_model(source, cfg, tokenizer=None)
            assert ("Loading weights" in capsys.readouterr().err) is progress_bar
            assert hf_logging.is_progress_bar_enabled()  # restored after the load
    finally:
        if not was:
            hf_logging.disable_progress_bar()


def test_sweep_and_training_folders_never_mix(tmp_path):
    from stapo.evaluation.runner import MANIFEST, _check_manifest
    from stapo.evaluation.sweep import _claim

    run = tmp_path / "run"
    fake_checkpoints(run, steps=(1,))
    with pytest.raises(EvalError, match="is a train.py run folder"):
        _claim(run, run)
    sweep = tmp_path / "sweep"
    _claim(sweep, run)
    _claim(sweep, run)  # the same run again: fine
    with pytest.raises(EvalError, match="is the sweep of"):
        _claim(sweep, tmp_path / "other")
    with pytest.raises(EvalError, match="folder of a checkpoint sweep"):  # a single evaluation into it
        _check_manifest(sweep, {})
    single = tmp_path / "single"
    single.mkdir()
    (single / MANIFEST).write_text(json.dumps({"model": {}}))
    with pytest.raises(EvalError, match="evaluation of one model"):
        _claim(single, run)


def test_train_py_refuses_a_sweep_folder(tmp_path):
    from stapo.config import ConfigError, load_config
    from stapo.evaluation.sweep import _claim
    from stapo.train import Trainer

    _claim(tmp_path / "sweep", tmp_path / "run")
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [f"trainer.output_dir={tmp_path}", "trainer.run_name=sweep"])
    with pytest.raises(ConfigError, match="evaluate.py output folder"):
        Trainer(cfg)
    # defect #13f: nor a run inside a sweep folder (its step_XXXXXX folders are evaluations), at any depth
    for out, name in ((tmp_path / "sweep", "step_000009"), (tmp_path / "sweep" / "a", "b")):
        cfg = load_config(REPO / "configs" / "tiny_test.yaml",
                          [f"trainer.output_dir={out}", f"trainer.run_name={name}"])
        with pytest.raises(ConfigError, match=f"'trainer.output_dir' .*inside {tmp_path / 'sweep'}, an evaluate.py "
                                              f"output folder"):
            Trainer(cfg)
        assert not (out / name).exists()


# --- trainer.val_before_train -----------------------------------------------------------------------------------
def test_val_before_train_logs_a_step_0_row_once(shared_data_root, tmp_path):
    from stapo.config import load_config
    from stapo.evaluation import make_validation_hook_from_config
    from stapo.train import Trainer
    from toy_run import toy_reward

    calls: list[int] = []

    def trainer(total: int, *extra: str) -> Trainer:
        cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
            f"trainer.output_dir={tmp_path}", "trainer.run_name=v", f"trainer.total_steps={total}",
            "trainer.val_before_train=true", f"data.root={shared_data_root}", "validation.benchmarks=[math500]",
            "validation.limit=1", "validation.samples=2", "data.max_prompt_length=512", *extra])
        hook = make_validation_hook_from_config(cfg)  # val_every=0: the hook exists for step 0 alone
        assert hook is not None

        def counted(tr, step):
            calls.append(step)
            return hook(tr, step)

        counted.close = hook.close
        return Trainer(cfg, validation_hook=counted, reward_fn=toy_reward)

    history = trainer(1).train()
    got = rows(tmp_path / "v" / "metrics.jsonl")
    assert calls == [0] and [r["step"] for r in got] == [0, 1]
    val_keys = [k for k in got[0] if k != "step"]
    assert val_keys and all(k.startswith("val") for k in val_keys)  # the step-0 row: validation only
    assert not any(k.startswith("val") for k in history[0])  # val_every=0: no validation after step 1
    assert (tmp_path / "v" / "validation" / "step_000000" / "metrics.json").is_file()
    trainer(2, "trainer.resume=required").train()  # resumed at step 1: step 0 is not validated again
    assert calls == [0] and [r["step"] for r in rows(tmp_path / "v" / "metrics.jsonl")] == [0, 1, 2]


def test_val_before_train_may_change_on_resume():
    from stapo.config import TrainConfig, resume_key_changes, to_dict

    cfg = TrainConfig()
    cfg.trainer.val_before_train = True
    refused, allowed = resume_key_changes(to_dict(TrainConfig()), cfg)
    assert refused == [] and allowed == [("trainer.val_before_train", False, True)]


# --- validation presets -----------------------------------------------------------------------------------------
def verl_script_defaults() -> dict[str, str]:
    """``NAME=${NAME:-value}`` defaults of the verl launch script."""
    text = (REPO / "scripts" / "verl" / "run_stapo_qwen3_1.7b.sh").read_text()
    return dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, flags=re.M))


def test_the_verl_preset_equals_the_launch_script():
    from stapo.config import TrainConfig, load_config, merge_config

    script = (REPO / "scripts" / "verl" / "run_stapo_qwen3_1.7b.sh").read_text()
    env = verl_script_defaults()
    assert (env["VAL_N"], env["VAL_TEMPERATURE"], env["VAL_TOP_P"]) == ("32", "0.7", "0.9")
    val_files = re.search(r"data\.val_files=\[([^\]]*)\]", script).group(1)
    assert re.findall(r"/(\w+)\.parquet", val_files) == ["aime24", "aime25", "amc23"]
    assert "trainer.test_freq=20" in script and "trainer.val_before_train=True" in script
    preset = merge_config(TrainConfig, REPO / "configs" / "validation" / "verl.yaml", None)  # the file alone
    paper = load_config(REPO / "configs" / "paper" / "qwen3_1.7b_stapo.yaml")  # layered under the paper configs
    for cfg in (preset, paper):
        v = cfg.validation
        assert (v.benchmarks, v.limit, v.samples, v.temperature, v.top_p, v.max_new_tokens) == (
            ["aime24", "aime25", "amc23"], None, 32, 0.7, 0.9, None)  # None: up to rollout.response_length
        assert (cfg.trainer.val_every, cfg.trainer.val_before_train) == (20, True)


def test_the_cpu_preset_layers_under_a_cpu_config(tmp_path):
    """configs/validation/cpu.yaml is off in the CPU configs (its comment: the measured cost); the documented way to
    turn it on — a file listing the CPU config and the preset under defaults — gives its values."""
    from stapo.config import load_config

    assert load_config(REPO / "configs" / "cpu_smollm2_stapo.yaml").trainer.val_every == 0
    mine = tmp_path / "mine.yaml"  # the preset's recipe, with absolute paths (relative ones are to the file)
    mine.write_text(f"defaults: [{REPO / 'configs/cpu_smollm2_stapo.yaml'}, {REPO / 'configs/validation/cpu.yaml'}]\n")
    cfg = load_config(mine)
    v = cfg.validation
    assert (v.benchmarks, v.limit, v.samples, v.temperature, v.top_p, v.max_new_tokens) == (
        ["math500"], 32, 4, 1.0, 1.0, None)
    assert (cfg.trainer.val_every, cfg.trainer.val_before_train, cfg.algorithm.objective) == (5, True, "stapo")
    assert cfg.rollout.response_length == 64  # the responses of a validation: up to the recipe's 64 tokens
