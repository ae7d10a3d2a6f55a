"""What a training run was made from (stapo/run/run_identity.py): every run records ``fingerprint.json``; a resume whose
model weights or training data changed under the same path is refused in one line naming the key and the file; a
resume on another kind of machine is recorded, not refused.

Before: no fingerprint was written, and a resume after the weights at ``model.path`` (or the rows of
``data.train_file.path``) had been replaced went on silently, mixing two inputs in one run.

In process, on the tiny model saved to a local folder and a four-row JSONL training file (one 1-step run, then
start-up checks only: ``preflight_only`` loads no model).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from stapo.config import ConfigError, load_config
from stapo.common.fingerprint import file_sha256, machine_kind, model_digest, read_fingerprint
from stapo.run.run_identity import (HOW_KEYS, NEUTRAL_KEYS, config_digest, config_matches_fingerprint,
                                plan_differences)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import toy_reward  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 5)]


def _cfg(tmp: Path, *extra: str):
    return load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tmp / 'model'}", "data.train_set=file", f"data.train_file.path={tmp / 'train.jsonl'}",
        f"trainer.output_dir={tmp / 'out'}", "trainer.run_name=r", "trainer.total_steps=1", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 1-step run ``out/r`` of the tiny model saved in ``model/`` on ``train.jsonl``; ``model.seed1``
    holds the weights of another seed (a replacement of the same shape)."""
    from stapo.model.models import EMBEDDED_ALIASES, build_tiny_model, load_tokenizer
    from stapo.train import Trainer

    tmp = tmp_path_factory.mktemp("identity")
    tok = load_tokenizer(EMBEDDED_ALIASES[0])
    for name, seed in (("model", 0), ("model.seed1", 1)):
        model, _ = build_tiny_model(seed=seed, tokenizer=tok)
        model.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    Trainer(_cfg(tmp), reward_fn=toy_reward).train()
    return tmp


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """The trained folder (model, data, run) to change in place (the run's paths are part of its config), put
    back as it was after the test."""
    shutil.copytree(trained, tmp_path / "backup", symlinks=True)
    yield trained
    shutil.rmtree(trained)
    shutil.copytree(tmp_path / "backup", trained, symlinks=True)


def _resume(tmp: Path, *extra: str, preflight: bool = True):
    from stapo.train import Trainer

    cfg = _cfg(tmp, "trainer.resume=required", "trainer.total_steps=2", *extra)
    return Trainer(cfg, reward_fn=toy_reward, preflight_only=preflight)


def test_a_run_records_its_fingerprint(trained):
    run_dir = trained / "out" / "r"
    fp = read_fingerprint(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert set(fp) == {"config", "model", "data", "machine", "compute_dtype", "seed"}
    assert fp["config"] == config_digest(config) and config_matches_fingerprint(run_dir) is True
    assert fp["model"] == model_digest(trained / "model") and len(fp["model"]) == 64
    assert fp["data"] == file_sha256(trained / "train.jsonl")
    assert (fp["machine"], fp["compute_dtype"], fp["seed"]) == (machine_kind(), "float32", 0)


def test_the_config_part_leaves_out_only_neutral_keys(trained):
    config = json.loads((trained / "out" / "r" / "config.json").read_text())
    moved = json.loads(json.dumps(config))
    moved["trainer"].update(output_dir="/elsewhere", run_name="other", progress_bar=True, keep_last=9)
    moved["logging"]["group"] = "g"
    assert config_digest(moved) == config_digest(config)  # where it is and how it is logged: the same run
    lr = json.loads(json.dumps(config))
    lr["actor"]["lr"] = 2e-3
    assert config_digest(lr) != config_digest(config)
    assert not set(NEUTRAL_KEYS) & set(HOW_KEYS) and "actor.lr" not in HOW_KEYS


def test_replaced_weights_under_the_same_model_path_are_refused_on_resume(run):
    for f in ("model.safetensors", "config.json"):
        shutil.copy2(run / "model.seed1" / f, run / "model" / f)
    with pytest.raises(ConfigError) as e:
        _resume(run)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cannot resume {run / 'out' / 'r'}: the model of 'model.path'")
    assert str(run / "model") in msg and "weights or config files changed" in msg
    assert "trainer.run_name" in msg  # what to do


def test_train_py_refuses_it_in_one_line_with_exit_2(run, capsys):
    import train

    shutil.copy2(run / "model.seed1" / "model.safetensors", run / "model" / "model.safetensors")
    rc = train.main(["--config", str(REPO / "configs" / "tiny_test.yaml"), f"model.path={run / 'model'}",
                     "data.train_set=file", f"data.train_file.path={run / 'train.jsonl'}",
                     f"trainer.output_dir={run / 'out'}", "trainer.run_name=r", "trainer.total_steps=2", "--resume",
                     "--dry-run"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train.py:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"train.py: cannot resume {run / 'out' / 'r'}: the model of 'model.path'")


def test_changed_training_rows_under_the_same_file_are_refused_on_resume(run):
    rows = [*ROWS[:2], {"problem": "What is 9 + 9?", "answer": "18"}, *ROWS[2:]]  # a row inserted
    (run / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as e:
        _resume(run)
    msg = str(e.value)
    assert "\n" not in msg and "'data.train_file.path'" in msg and str(run / "train.jsonl") in msg


def test_an_unchanged_resume_passes_and_another_machine_kind_is_recorded(run, capsys):
    run_dir = run / "out" / "r"
    fp = read_fingerprint(run_dir)
    (run_dir / "fingerprint.json").write_text(json.dumps({**fp, "machine": "cpu:Other CPU:avx2"}))
    trainer = _resume(run, preflight=False)
    assert "resume on another kind of machine: cpu:Other CPU:avx2 → " + machine_kind() in capsys.readouterr().err
    trainer.train()
    rows = [json.loads(x) for x in (run_dir / "config_changes.jsonl").read_text().splitlines()]
    assert {"step": 1, "key": "fingerprint.machine", "old": "cpu:Other CPU:avx2", "new": machine_kind()} in rows
    new = read_fingerprint(run_dir)
    assert new["machine"] == machine_kind() and new["model"] == fp["model"] and new["data"] == fp["data"]
    assert new["config"] != fp["config"]  # trainer.total_steps 1 → 2 (an allowed change, in config.json too)
    assert config_matches_fingerprint(run_dir) is True


def test_a_run_without_a_fingerprint_resumes_and_says_so(run, capsys):
    (run / "out" / "r" / "fingerprint.json").unlink()
    _resume(run)
    assert "has no fingerprint.json (a run from before fingerprints)" in capsys.readouterr().err


def test_plan_differences_classify_keys():
    from stapo.config import to_dict

    rec = to_dict(load_config(REPO / "configs" / "tiny_test.yaml"))
    plan = to_dict(load_config(REPO / "configs" / "tiny_test.yaml", [
        "actor.lr=2e-3", "actor.ppo_micro_batch_size=2", "trainer.total_steps=5", "trainer.run_name=x",
        "model.compute_dtype=auto"]))
    refused, tolerated = plan_differences(rec, plan)
    assert refused == ["actor.lr: 0.001 → 0.002"]  # total_steps raised: an extension; run_name neutral; auto
    assert tolerated == ["actor.ppo_micro_batch_size: 3 → 2"]
    shorter = to_dict(load_config(REPO / "configs" / "tiny_test.yaml", ["trainer.total_steps=1"]))
    assert plan_differences(rec, shorter)[0] == ["trainer.total_steps: 2 → 1"]
    del rec["algorithm"]["mask_stats_source"]  # a config.json older than the key: compared with its default
    assert plan_differences(rec, to_dict(load_config(REPO / "configs" / "tiny_test.yaml"))) == ([], [])


def test_stop_rules_gold_threshold_and_measurements_are_neutral_keys():
    """Keys that decide when a run stops or is refused, and measurements that leave it bit-identical, do not change
    the config part; a key that changes the update does."""
    from stapo.run.run_identity import config_digest

    base = {"trainer": {"seed": 0, "stop_after_silent_steps": 3, "stop_after_nonfinite_steps": 3},
            "data": {"max_unparsable_gold_fraction": 0.05}, "mechanism": {"enabled": False}, "actor": {"lr": 1e-6}}
    other = {"trainer": {"seed": 0, "stop_after_silent_steps": None, "stop_after_nonfinite_steps": 10},
             "data": {"max_unparsable_gold_fraction": 0.5}, "mechanism": {"enabled": True}, "actor": {"lr": 1e-6}}
    assert config_digest(base) == config_digest(other)
    assert config_digest(base) != config_digest({**base, "actor": {"lr": 2e-6}})


def test_a_run_stopped_by_sighup_counts_as_stopped_not_failed():
    import signal

    from stapo.study.runner import _STOPPED, _stop_code

    assert 129 in _STOPPED and -signal.SIGHUP in _STOPPED  # train.py's exit 129, or killed by SIGHUP
    assert _stop_code(129, None) == 129 and _stop_code(-signal.SIGHUP, None) == 129
    assert _stop_code(143, None) == 143 and _stop_code(-signal.SIGINT, None) == 130
    assert _stop_code(129, signal.SIGTERM) == 143  # the runner's own signal names its code
