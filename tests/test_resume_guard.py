"""Resuming a run (stapo/train/state.py, stapo/model/checkpoint.py): the config guard, the changes it allows and
records, ``--resume`` without a checkpoint, and damaged latest checkpoints (COMPLETE.json) — through train.py on
the tiny config where practical."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stapo.model import checkpoint as ck
from stapo.config import RESUME_MUTABLE_KEYS, TrainConfig, load_config, resume_key_changes, to_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(REPO)}


def _train(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny_test.yaml"),
           f"trainer.output_dir={out}", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _errors(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("train.py:")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Iterator[Path]:
    """A 2-step tiny run ``<out>/r`` with checkpoints step_000001 and step_000002 (each with COMPLETE.json)."""
    out = tmp_path_factory.mktemp("finished")
    res = _train(out, "trainer.run_name=r")
    assert res.returncode == 0, res.stderr[-3000:]
    yield out
    shutil.rmtree(out, ignore_errors=True)  # a module's ~200 MB of checkpoints freed when its tests are done (pytest keeps factory folders to the end)


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run's output folder (``<copy>/r``)."""
    shutil.copytree(finished, tmp_path / "out")
    return tmp_path / "out"


def test_checkpoints_carry_a_complete_marker_with_sizes_and_checksums(finished):
    ckpt = finished / "r" / "checkpoints" / "step_000002"
    manifest = json.loads((ckpt / ck.MARKER).read_text())
    assert manifest["step"] == 2
    files = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != ck.MARKER}
    assert set(manifest["files"]) == files and "dcp/.metadata" in files and "trainer_state.pt" in files
    for name, entry in manifest["files"].items():
        assert entry["size"] == (ckpt / name).stat().st_size and len(entry["sha256"]) == 64, name
    assert ck.verify_checkpoint(ckpt) is None


def test_a_change_of_a_key_that_cannot_change_is_refused_in_one_line_before_training(run):
    before = (run / "r" / "metrics.jsonl").read_text()
    res = _train(run, "trainer.run_name=r", "trainer.total_steps=3", "rollout.n=8", "actor.ppo_mini_batch_size=2",
                 "data.train_batch_size=4", "algorithm.objective=grpo", "--resume")
    assert res.returncode == 2, res.stderr[-3000:]
    lines = _errors(res)
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    for diff in ("actor.ppo_mini_batch_size: 1 → 2", "data.train_batch_size: 2 → 4", "rollout.n: 4 → 8",
                 "algorithm.objective: 'stapo' → 'grpo'"):
        assert diff in lines[0], lines[0]
    assert "trainer.total_steps" not in lines[0]  # allowed: not listed as refused
    assert (run / "r" / "metrics.jsonl").read_text() == before  # nothing trained, nothing logged
    assert not (run / "r" / "checkpoints" / "step_000003").exists()
    assert not (run / "r" / "config_changes.jsonl").exists()


def test_allowed_changes_are_applied_recorded_and_printed(finished, run):
    res = _train(run, "trainer.run_name=r", "trainer.total_steps=3", "actor.lr=5e-4", "actor.ppo_micro_batch_size=2",
                 "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    changes = _rows(run / "r" / "config_changes.jsonl")
    assert changes == [
        {"step": 2, "key": "actor.lr", "old": 1e-3, "new": 5e-4},
        {"step": 2, "key": "actor.ppo_micro_batch_size", "old": 3, "new": 2},
        {"step": 2, "key": "trainer.output_dir", "old": str(finished), "new": str(run)},
        {"step": 2, "key": "trainer.total_steps", "old": 2, "new": 3},
    ]  # the run folder was copied from the fixture's: trainer.output_dir changed too
    assert "config change on resume at step 2: actor.lr: 0.001 → 0.0005" in res.stderr
    rows = _rows(run / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["actor/lr"] for r in rows] == pytest.approx([1e-3, 1e-3, 5e-4])
    state = ck.load_trainer_state(run / "r" / "checkpoints" / "step_000003")
    assert state["scheduler"]["base_lrs"] == [5e-4] and state["config"]["actor"]["lr"] == 5e-4
    # the new checkpoint holds the new config: resuming it again with the same values records nothing more
    again = _train(run, "trainer.run_name=r", "trainer.total_steps=3", "actor.lr=5e-4",
                   "actor.ppo_micro_batch_size=2", "--resume")
    assert again.returncode == 0 and "config change" not in again.stderr, again.stderr[-3000:]
    assert len(_rows(run / "r" / "config_changes.jsonl")) == 4


def test_a_changed_lr_is_what_the_next_optimizer_steps_use(run):
    """In process: after the resume every param group's lr and the scheduler's base lr are the new lr, and every
    optimizer step of the next training step runs at it (warm-up 0: factor 1)."""
    trainer = make_trainer(str(run), ["trainer.run_name=r", "trainer.total_steps=3", "actor.lr=2e-4",
                                      "trainer.resume=required"])
    seen: list[list[float]] = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append([g["lr"] for g in trainer.optimizer.param_groups])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.train()
    assert trainer.scheduler.base_lrs == [2e-4]
    assert seen[0] == [0.0]  # loading dcp/ initialises the AdamW state with one step at lr 0 (torch's own)
    assert seen[1:] == [[pytest.approx(2e-4)]] * 2, seen  # step 3: 2 mini-batches, 2 optimizer steps at the new lr


def test_resume_without_a_checkpoint_is_refused_naming_the_folder_and_the_runs(run):
    res = _train(run, "trainer.run_name=typo", "--resume")
    assert res.returncode == 2, res.stderr[-3000:]
    lines = _errors(res)
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert str(run / "typo") in lines[0] and f"runs with checkpoints in {run}: r)" in lines[0], lines[0]
    assert not (run / "typo").exists()


def test_resume_auto_without_a_checkpoint_starts_at_step_0_and_says_so(tmp_path):
    res = _train(tmp_path, "trainer.run_name=new", "trainer.total_steps=1", "trainer.resume=auto")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resume: no checkpoint in {tmp_path / 'new' / 'checkpoints'}: starting at step 0" in res.stderr
    assert [r["step"] for r in _rows(tmp_path / "new" / "metrics.jsonl")] == [1]


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_first_bytes(path: Path) -> None:  # same size: only the checksum tells
    with open(path, "r+b") as f:
        head = f.read(64)
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in head))


@pytest.mark.parametrize("damage,name,reason", [
    pytest.param(_truncate, "model.safetensors", "model.safetensors is ", marks=pytest.mark.slow),
    (_flip_first_bytes, "dcp/__0_0.distcp", "dcp/__0_0.distcp does not match its checksum"),
    pytest.param(_truncate, "trainer_state.pt", "trainer_state.pt is ", marks=pytest.mark.slow),
])
def test_a_damaged_latest_checkpoint_is_reported_and_the_previous_one_is_used(run, damage, name, reason):
    last = run / "r" / "checkpoints" / "step_000002"
    damage(last / name)
    res = _train(run, "trainer.run_name=r", "trainer.total_steps=3", "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("resuming from")]
    assert len(lines) == 1 and lines[0].startswith(f"resuming from step_000001: {last} is damaged: {reason}"), lines
    assert f"resumed from {run / 'r' / 'checkpoints' / 'step_000001'} at step 1" in res.stdout + res.stderr
    assert [r["step"] for r in _rows(run / "r" / "metrics.jsonl")] == [1, 2, 3]
    assert ck.verify_checkpoint(last) is None  # step 2 was saved again, intact


def test_no_intact_checkpoint_is_one_line_and_exit_2(run):
    root = run / "r" / "checkpoints"
    _truncate(root / "step_000002" / "trainer_state.pt")
    _flip_first_bytes(root / "step_000001" / "model.safetensors")
    res = _train(run, "trainer.run_name=r", "trainer.total_steps=3", "--resume")
    assert res.returncode == 2, res.stderr[-3000:]
    lines = _errors(res)
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "no intact checkpoint" in lines[0] and str(root / "step_000002") in lines[0] \
        and str(root / "step_000001") in lines[0], lines[0]


def test_checkpoints_without_the_marker_still_resume(run):
    """Written before COMPLETE.json existed: judged by the file rule, the config still checked (in process, no
    weights loaded)."""
    from stapo.run.provenance import apply_identity
    from stapo.train.state import plan_resume

    root = run / "r" / "checkpoints"
    for marker in root.glob(f"step_*/{ck.MARKER}"):
        marker.unlink()
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [f"trainer.output_dir={run}", "trainer.run_name=r"])
    apply_identity(cfg, REPO / "configs" / "tiny_test.yaml")  # as train.py does: the W&B group / tags resolved
    plan = plan_resume(root, cfg, required=True)
    assert plan is not None and plan.checkpoint == root / "step_000002" and plan.step == 2
    assert [k for k, _, _ in plan.changes] == ["trainer.output_dir"]  # the copied run folder
    assert ck.latest_checkpoint(root) == root / "step_000002"
    (root / "step_000002" / "trainer_state.pt").unlink()  # without a marker: the file rule
    assert plan_resume(root, cfg, required=True, report=False).checkpoint == root / "step_000001"


def test_key_classification():
    """Keys the saved config lacks compare with the schema default; trainer.resume is never compared; every
    mutable entry names a key or section of the schema."""
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", ["trainer.resume=required", "model.compute_dtype=bfloat16",
                                                            "model.gradient_checkpointing=true"])
    saved = to_dict(load_config(REPO / "configs" / "tiny_test.yaml"))
    del saved["algorithm"]["mask_stats_source"]  # an older checkpoint: compared with the default ("current")
    refused, allowed = resume_key_changes(saved, cfg)
    assert refused == [("model.compute_dtype", "float32", "bfloat16")]
    assert allowed == [("model.gradient_checkpointing", False, True)]
    for key in RESUME_MUTABLE_KEYS:
        node = to_dict(TrainConfig())
        for part in key.split("."):
            assert part in node, key
            node = node[part]


def test_a_damaged_newer_checkpoint_never_counts_for_keep_last(tmp_path):
    """Resumed from step 2 past a damaged step 4, the save of step 3 with keep_last=1 keeps step 3 (the damaged
    step 4 stays, is never picked, and would be replaced by the next save of step 4)."""
    from stapo.model.models import EMBEDDED_ALIASES, build_tiny_model, load_tokenizer

    tokenizer = load_tokenizer(EMBEDDED_ALIASES[0])
    model, _ = build_tiny_model(seed=0, tokenizer=tokenizer)
    for step in (2, 4):
        ck.save_checkpoint(tmp_path, step, model, tokenizer, {}, keep_last=2)
    _truncate(tmp_path / "step_000004" / "model.safetensors")
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    ck.save_checkpoint(tmp_path, 3, model, tokenizer, {}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_000003"
    assert ck.verify_checkpoint(tmp_path / "step_000004").startswith("model.safetensors is ")
