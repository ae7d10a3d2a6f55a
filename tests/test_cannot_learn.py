"""A run that cannot learn stops (docs/runs.md#a-run-that-cannot-learn), and the config values that make one are
refused before any model loads.

Before: a loss returning NaN had every optimizer step skipped and only counted in ``actor/nonfinite_grad_steps``
(exit 0, weights unchanged); a mask silencing every token trained nothing (exit 0); ``actor.lr=inf``,
``rollout.temperature=inf``, ``algorithm.kl_coef=inf``, ratio bounds given as clip ε (1.2) and a warm-up longer than
the run were accepted.

tiny_test.yaml: 2 prompts per step, 1 per mini-batch, so a training step is 2 optimizer steps.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stapo.model.checkpoint import latest_checkpoint  # noqa: E402
from stapo.config import ConfigError, load_config  # noqa: E402
from stapo.core.masks import MASKS  # noqa: E402
from stapo.core.objectives import OBJECTIVES, POLICY_LOSSES  # noqa: E402
from stapo.run.tracking import read_metrics  # noqa: E402
from stapo.train.trainer import CannotLearn  # noqa: E402
from toy_run import make_trainer  # noqa: E402

TINY = str(REPO / "configs" / "tiny_test.yaml")
FAST = ["trainer.log_examples_every=0", "rollout.response_length=4"]  # no tables; 4 new tokens a response

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLUGIN = '''
import torch
from stapo.core.masks import TokenMask, register_token_mask
from stapo.core.objectives import get_objective, register_objective, register_policy_loss


@register_policy_loss("test_nan_loss")
def nan_loss(logprobs, old_logprobs, advantages, keep, objective):
    """The surrogate's shape and flags, every value NaN (a bug in a user's loss)."""
    flags = torch.zeros_like(logprobs)
    return logprobs * float("nan"), {"pg_clipfrac": flags, "pg_clipfrac_lower": flags}


@register_token_mask("test_silence_all", maskable_rows="all")
def silence_all(logprobs, entropy, advantages, response_mask):
    """Keeps no token at all (a threshold bug in a user's mask)."""
    return TokenMask(keep=torch.zeros_like(response_mask, dtype=torch.bool), stats={})


register_objective(get_objective("justrl").replace(name="test_nan_objective", policy_loss="test_nan_loss"))
register_objective(get_objective("justrl").replace(name="test_silent_objective", token_mask="test_silence_all"))
'''


@pytest.fixture
def plugin(tmp_path):
    """A user module (trainer.import_modules) registering a NaN loss and an all-silencing mask; unregistered after."""
    module = tmp_path / "cannot_learn_plugin.py"
    module.write_text(PLUGIN)
    yield f"trainer.import_modules=[{module}]"
    for table, name in ((OBJECTIVES, "test_nan_objective"), (OBJECTIVES, "test_silent_objective"),
                        (POLICY_LOSSES, "test_nan_loss"), (MASKS, "test_silence_all")):
        table.pop(name, None)
    sys.modules.pop("cannot_learn_plugin", None)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_a_nan_loss_stops_the_run_after_the_budget_and_checkpoints_the_unchanged_weights(tmp_path, plugin):
    trainer = make_trainer(str(tmp_path), [plugin, "algorithm.objective=test_nan_objective", "trainer.total_steps=5",
                                           "trainer.save_every=0", "trainer.stop_after_nonfinite_steps=3", *FAST])
    before = _weights(trainer)
    with pytest.raises(CannotLearn) as info:
        trainer.train()
    e = info.value
    # 2 optimizer steps per training step: 2 skipped after step 1, 4 ≥ 3 after step 2
    assert (e.step, e.metric) == (2, "actor/nonfinite_grad_steps")
    msg = str(e)
    assert "\n" not in msg and msg.startswith("the run cannot learn, stopped after step 2: 4 optimizer steps in a row")
    assert "actor/pg_loss=nan" in msg and "trainer.stop_after_nonfinite_steps=3" in msg
    assert ("likely cause: the policy loss of algorithm.objective=test_nan_objective (loss formula 'test_nan_loss'"
            in msg)
    run = tmp_path / "toy"
    assert e.checkpoint == latest_checkpoint(run / "checkpoints") and e.checkpoint.name == "step_000002"
    assert msg.endswith(f"checkpointed step 2 ({e.checkpoint})")
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and [r["actor/nonfinite_grad_steps"] for r in rows] == [2.0, 2.0]
    after = _weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)  # every step skipped: the weights never changed


def test_train_py_says_it_in_one_line_and_exits_1(tmp_path, plugin, capsys):
    import train as train_py

    rc = train_py.main(["--config", TINY, plugin, "algorithm.objective=test_nan_objective", "trainer.total_steps=5",
                        f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "trainer.stop_after_nonfinite_steps=1",
                        *FAST])
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [line for line in err.splitlines() if line.startswith("train.py:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("train.py: the run cannot learn, stopped after step 1: 2 optimizer steps in a row had "
                               "a non-finite loss or gradient (actor/pg_loss=nan")
    assert (tmp_path / "r" / "checkpoints" / "step_000001").is_dir()


def test_a_mask_silencing_every_token_stops_after_k_steps(tmp_path, plugin):
    trainer = make_trainer(str(tmp_path), [plugin, "algorithm.objective=test_silent_objective",
                                           "trainer.total_steps=5", "trainer.stop_after_silent_steps=2", *FAST])
    with pytest.raises(CannotLearn) as info:
        trainer.train()
    e = info.value
    assert (e.step, e.metric) == (2, "actor/num_kept_tokens")
    assert str(e).startswith("the run cannot learn, stopped after step 2: the token mask kept no token in 2 training "
                             "steps in a row (actor/num_kept_tokens=0; trainer.stop_after_silent_steps=2): nothing "
                             "was trained; likely cause: the mask 'test_silence_all'")
    rows = read_metrics(tmp_path / "toy" / "metrics.jsonl")
    assert [(r["step"], r["actor/num_kept_tokens"]) for r in rows] == [(1, 0.0), (2, 0.0)]
    assert e.checkpoint.name == "step_000002"  # tiny_test saves every step; not written twice


def test_null_keeps_the_old_behaviour_skip_and_count(tmp_path, plugin):
    trainer = make_trainer(str(tmp_path), [plugin, "algorithm.objective=test_silent_objective",
                                           "trainer.total_steps=1", "trainer.stop_after_silent_steps=null", *FAST])
    assert [m["actor/num_kept_tokens"] for m in trainer.train()] == [0.0]


def test_weights_that_are_no_longer_finite_are_never_checkpointed(tmp_path):
    """Weights turned NaN in step 2 (as a divergence would): step 2's due checkpoint is not written, the run stops
    naming the weights and the last checkpoint with finite ones (step 1)."""
    trainer = make_trainer(str(tmp_path), ["trainer.total_steps=4", "trainer.save_every=1", *FAST])
    run = trainer.updater.run

    def diverging(*args, **kwargs):
        out = run(*args, **kwargs)
        if trainer.step == 1:  # the update of step 2
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))
        return out

    trainer.updater.run = diverging
    with pytest.raises(CannotLearn) as info:
        trainer.train()
    e = info.value
    assert (e.step, e.metric) == (2, "weights")
    assert "the policy's weights are no longer finite (NaN/inf)" in str(e)
    ckpts = sorted(p.name for p in (tmp_path / "toy" / "checkpoints").iterdir())
    assert ckpts == ["step_000001"] and e.checkpoint.name == "step_000001"
    assert str(e).endswith(f"its weights are not saved; the latest checkpoint with finite weights: {e.checkpoint}")


# --- the config: refused before any model loads, naming the key (exit 2) -------------------------------------------
@pytest.mark.parametrize("override, line", [
    ("actor.lr=inf", "invalid value for 'actor.lr' (inf): must be a finite number"),
    ("actor.lr=nan", "invalid value for 'actor.lr' (nan): must be a finite number"),
    ("rollout.temperature=inf", "invalid value for 'rollout.temperature' (inf): must be a finite number"),
    ("algorithm.kl_coef=inf", "invalid value for 'algorithm.kl_coef' (inf): must be a finite number"),
    ("validation.temperature=-inf", "invalid value for 'validation.temperature' (-inf): must be a finite number"),
    ("actor.betas=[0.9,.nan]", "invalid value for 'actor.betas[1]' (nan): must be a finite number"),
    ("rollout.gpu_memory_utilization=1.5", "invalid value for 'rollout.gpu_memory_utilization' (1.5): must be in "
                                           "(0, 1]"),
    ("validation.top_p=0", "invalid value for 'validation.top_p' (0.0): must be in (0, 1]"),
    ("validation.max_new_tokens=0", "invalid value for 'validation.max_new_tokens' (0): must be ≥ 1 or null"),
    ("trainer.seed=-1", "invalid value for 'trainer.seed' (-1): must be in [0, 2^32)"),
    ("trainer.stop_after_nonfinite_steps=0",
     "invalid value for 'trainer.stop_after_nonfinite_steps' (0): must be ≥ 1"),
])
def test_a_non_finite_or_out_of_range_number_is_refused_naming_the_key(override, line):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert str(err.value).startswith(line)


def test_clip_ratio_bounds_given_as_epsilon_are_refused_saying_so():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["algorithm.clip_ratio_low=0.8", "algorithm.clip_ratio_high=1.2"])
    assert str(err.value).startswith("invalid value for 'algorithm.clip_ratio_high' (1.2): ε must be < 1")
    assert "not a ratio bound — for the bounds 0.8 / 1.2 give clip_ratio_low=0.2 and clip_ratio_high=0.2" in str(
        err.value)
    with pytest.raises(ConfigError, match=r"^invalid value for 'algorithm.clip_ratio_low' \(1.0\): ε must be < 1"):
        load_config(TINY, ["algorithm.clip_ratio_low=1.0"])
    assert load_config(TINY, ["algorithm.clip_ratio_high=0.28"]).algorithm.clip_ratio_high == 0.28  # clip-higher


def test_a_warm_up_longer_than_the_run_is_refused():
    # the factor at training step t is min(1, t / warmup_steps): 3 warm-up steps in a 2-step run end at 2/3 of lr
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["actor.warmup_steps=3", "trainer.total_steps=2"])
    assert str(err.value) == ("invalid value for 'actor.warmup_steps' (3): the linear warm-up is longer than the run "
                              "(trainer.total_steps=2): the learning rate would never reach actor.lr (0.001; at most "
                              "2/3 of it); lower actor.warmup_steps (it counts training steps)")
    assert load_config(TINY, ["actor.warmup_steps=2", "trainer.total_steps=2"]).actor.warmup_steps == 2  # reaches it


@pytest.mark.parametrize("override", ["algorithm.kl_coef=inf", "actor.lr=inf", "rollout.temperature=inf",
                                      "algorithm.clip_ratio_high=1.2", "actor.warmup_steps=30"])
def test_train_py_exits_2_with_one_line_naming_the_key(override, tmp_path, capsys):
    import train as train_py

    rc = train_py.main(["--config", TINY, f"trainer.output_dir={tmp_path}", override])
    err = capsys.readouterr().err.splitlines()
    key = override.split("=")[0]
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"train.py: invalid value for '{key}'"), err
    assert not (tmp_path / "stapo_tiny_seed0").exists()  # nothing written: refused before the model loads


def test_the_stop_keys_may_change_on_resume():
    from stapo.config import RESUME_MUTABLE_KEYS

    assert {"trainer.stop_after_nonfinite_steps", "trainer.stop_after_silent_steps"} <= set(RESUME_MUTABLE_KEYS)


def test_metrics_of_a_nan_loss_run_are_written_in_the_documented_form(tmp_path, plugin):
    """A diverged step's non-finite values reach metrics.jsonl as the strings of docs/metrics.md, not 1e308."""
    trainer = make_trainer(str(tmp_path), [plugin, "algorithm.objective=test_nan_objective", "trainer.total_steps=1",
                                           "trainer.stop_after_nonfinite_steps=null", *FAST])
    trainer.train()
    text = (tmp_path / "toy" / "metrics.jsonl").read_text()
    assert "1e+308" not in text and "NaN" not in text
    row = json.loads(text.splitlines()[0])
    assert all(isinstance(v, (int, float)) or v in ("nan", "inf", "-inf") for v in row.values())
    assert all(not isinstance(v, float) or math.isfinite(v) for v in row.values())


@pytest.mark.slow  # two gloo ranks under torchrun (~1 min); the one-process tests above are the fast ones
def test_two_ranks_stop_after_the_same_step_with_one_line(tmp_path):
    """Under torchrun every rank stops after the same step (no rank left waiting in a collective), the step is
    checkpointed (a collective save), rank 0 alone prints the line, exit code 1 (torchrun names the failed ranks)."""
    import os
    import socket
    import subprocess

    module = tmp_path / "cannot_learn_plugin.py"
    module.write_text(PLUGIN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           str(REPO / "train.py"), "--config", TINY, f"trainer.import_modules=[{module}]",
           "algorithm.objective=test_nan_objective", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
           "trainer.total_steps=5", "trainer.save_every=0", f"trainer.output_dir={tmp_path}", "trainer.run_name=r",
           "trainer.stop_after_nonfinite_steps=2", *FAST]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    # torchrun reports the failed ranks itself (its own ChildFailedError); no traceback of train.py or stapo
    assert res.returncode != 0 and "exitcode  : 1" in res.stderr, res.stderr[-4000:]
    assert f'File "{REPO / "stapo"}' not in res.stderr and f'File "{REPO / "train.py"}' not in res.stderr
    assert "lr_scheduler.step()" not in res.stderr  # torch's warning when no optimizer step was taken: silenced
    lines = [line for line in res.stderr.splitlines() if line.startswith("train.py:")]
    # 2 mini-batches (optimizer steps) per training step: 2 ≥ 2 after step 1
    assert len(lines) == 1 and lines[0].startswith("train.py: the run cannot learn, stopped after step 1: 2 "
                                                   "optimizer steps in a row"), res.stderr[-4000:]
    assert latest_checkpoint(tmp_path / "r" / "checkpoints").name == "step_000001"
    assert [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [1]
