"""The run folder on its own (stapo/run/folder.py::RunFolder), without a model: its name and paths, the pre-flight
check of an evaluation folder, the files written at start and the clean-up of a crashed run's later steps, the
checkpoint cadence, a signal that stops the run after the step (one more save, :class:`Interrupted`) or abandons it,
and a trainer handed a folder uses it. The whole run through the trainer: tests/test_trainer.py, test_interrupt.py."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from stapo.config import ConfigError, load_config
from stapo.model.distributed import DistContext
from stapo.evaluation.runner import MANIFEST
from stapo.run.folder import Interrupted, RunFolder, default_run_name

REPO = Path(__file__).resolve().parents[1]
#: the keys the step's console postfix reads (RunFolder.log), with made-up values
METRICS = {"critic/score/mean": 0.5, "actor/entropy": 1.25, "actor/num_kept_tokens": 3.0,
           "response_length/total_tokens": 8.0}


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(REPO / "configs" / "tiny_test.yaml", [f"trainer.output_dir={tmp_path}", *overrides])


def _folder(tmp_path: Path, *overrides: str, **kw) -> RunFolder:
    return RunFolder(_cfg(tmp_path, "trainer.run_name=r", *overrides), DistContext(), "cpu", objective="stapo",
                     evaluation_manifest=MANIFEST, argv=["train.py", "--config", "x.yaml"], **kw)


def test_the_default_run_name_and_the_folders(tmp_path):
    # <objective>_<last part of model.path, ':' written '-'>_seed<trainer.seed>
    cfg = _cfg(tmp_path, "trainer.seed=3")
    cfg.model.path = "Qwen/Qwen3-8B-Base/"
    assert default_run_name(cfg, "grpo") == "grpo_Qwen3-8B-Base_seed3"
    cfg.model.path = "org/model:rev"
    assert default_run_name(cfg, "stapo") == "stapo_model-rev_seed3"
    folder = _folder(tmp_path)  # trainer.run_name=r wins
    assert (folder.run_name, folder.run_dir, folder.ckpt_root) == ("r", tmp_path / "r", tmp_path / "r" / "checkpoints")


def test_check_refuses_an_evaluation_folder_and_a_folder_inside_one(tmp_path):
    _folder(tmp_path).check()  # no manifest anywhere: fine
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / MANIFEST).write_text("{}")  # the run folder itself is an evaluation folder
    with pytest.raises(ConfigError, match=r"^invalid value for 'trainer.run_name' \(r\): .* is an evaluate.py"):
        _folder(tmp_path).check()
    (tmp_path / "r" / MANIFEST).unlink()
    (tmp_path / MANIFEST).write_text("{}")  # tmp_path is an evaluation folder; the run would be inside
    with pytest.raises(ConfigError, match=r"^invalid value for 'trainer.output_dir' .* is inside .*evaluate.py"):
        _folder(tmp_path).check()
    assert not any((tmp_path / "r").iterdir())  # the checks create nothing


def test_open_writes_the_start_files_and_drops_a_crashed_runs_later_steps(tmp_path):
    run = tmp_path / "r"
    (run / "validation" / "step_000001").mkdir(parents=True)
    (run / "validation" / "step_000003").mkdir()
    # a crashed run's rows 1..3; the resume starts at step 2
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)))
    dropped = []
    folder = _folder(tmp_path)
    folder.open(2, None, drop_after=(lambda run_dir, step: dropped.append((run_dir, step)),))
    assert json.loads((run / "config.json").read_text())["trainer"]["run_name"] == "r"
    launches = json.loads((run / "run_info.json").read_text())["launches"]
    assert [(r["argv"], r["start_step"]) for r in launches] == [(["train.py", "--config", "x.yaml"], 2)]
    assert not (run / "fingerprint.json").exists()  # no check_identity: no fingerprint to record
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run / "validation" / "step_000001").is_dir() and not (run / "validation" / "step_000003").exists()
    assert dropped == [(run, 2)]
    assert folder.logged(2) and not folder.logged(3)


def test_save_due_every_save_every_steps_and_at_the_last(tmp_path):
    # save_every=2, total_steps=5: after steps 2 and 4, and 5 (the last); save_every=0: the last only
    folder = _folder(tmp_path, "trainer.save_every=2", "trainer.total_steps=5")
    assert [s for s in range(1, 6) if folder.save_due(s)] == [2, 4, 5]
    folder = _folder(tmp_path, "trainer.save_every=0", "trainer.total_steps=5")
    assert [s for s in range(1, 6) if folder.save_due(s)] == [5]


class _Pool:
    closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.mark.usefixtures("python_default_signal_handlers")
def test_a_signal_stops_after_the_step_with_one_more_save(tmp_path, capsys):
    # total_steps=3, no checkpoint due at step 1 (save_every=0): Ctrl-C during step 1 → the step finishes, is logged,
    # saved once (save_on_interrupt), and the loop stops; leaving the steps raises Interrupted(step 1, not abandoned)
    folder = _folder(tmp_path, "trainer.save_every=0", "trainer.total_steps=3", "trainer.save_on_interrupt=true")
    folder.open(0)
    saves, pool, step = [], _Pool(), {"done": 0}
    with pytest.raises(Interrupted) as info:
        with folder.steps(lambda: step["done"], close=(pool, None)) as history:
            os.kill(os.getpid(), signal.SIGINT)  # handled by the guard: the step in progress goes on
            time.sleep(0.01)
            step["done"] = 1
            folder.log(1, dict(METRICS))
            stop = folder.maybe_save(1, lambda: saves.append(step["done"]))
    assert stop and saves == [1] and history == [METRICS] and pool.closed == 1
    assert (info.value.step, info.value.abandoned, info.value.signum) == (1, False, signal.SIGINT)
    err = capsys.readouterr().err
    assert "Ctrl-C: finishing step 1 and writing its checkpoint, then stopping" in err
    assert [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the guard is gone


@pytest.mark.usefixtures("python_default_signal_handlers")
def test_a_second_signal_abandons_the_step(tmp_path, capsys):
    folder = _folder(tmp_path, "trainer.total_steps=3")
    with pytest.raises(Interrupted) as info:
        with folder.steps(lambda: 0):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)  # the second: KeyboardInterrupt where the code is
            time.sleep(5)
            pytest.fail("the second signal did not stop the step")
    assert (info.value.step, info.value.abandoned, info.value.checkpoint) == (0, True, None)
    capsys.readouterr()


def test_a_trainer_handed_a_folder_uses_it(tmp_path):
    """preflight_only: the checks that need no model, none loaded."""
    from stapo.train import Trainer

    cfg = _cfg(tmp_path)
    folder = RunFolder(cfg, DistContext(), "cpu", objective="mine", evaluation_manifest=MANIFEST, argv=["mine.py"])
    trainer = Trainer(cfg, preflight_only=True, folder=folder, argv=["ignored.py"])
    assert trainer.folder is folder and trainer.run_dir == tmp_path / "mine_tiny_seed0"
    assert trainer.argv == ["mine.py"] and trainer.ckpt_root == tmp_path / "mine_tiny_seed0" / "checkpoints"
    trainer.argv = ["set.py"]  # the trainer's argv is the folder's
    assert folder.argv == ["set.py"]
