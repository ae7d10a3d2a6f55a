"""The training loop end to end on the tiny model (HF rollouts, CPU)."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from stapo.model.checkpoint import latest_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


@pytest.mark.parametrize("objective", ["stapo", "justrl", "grpo", "entropy20"])
def test_two_steps_of_each_objective(tmp_path, objective):
    trainer = make_trainer(str(tmp_path), [f"algorithm.objective={objective}", "trainer.save_every=0"])
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    history = trainer.train()
    assert len(history) == 2
    for m in history:
        for key in ("critic/score/mean", "critic/advantages/mean", "actor/entropy", "actor/pg_loss",
                    "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "response_length/mean",
                    "response_length/clip_ratio", "frac_reward_zero_std", "timing_s/rollout", "timing_s/reward",
                    "timing_s/old_log_prob", "timing_s/update", "timing_s/sync", "perf/tokens_per_s",
                    "s2t/quadrant/low_p_low_h/share", "s2t/would_mask/masked_frac", "s2t/would_mask/num_masked"):
            assert key in m, key
        assert torch.isfinite(torch.tensor(m["actor/pg_loss"]))
    assert any(m["frac_reward_zero_std"] < 1.0 for m in history)  # the toy reward varies within groups
    if objective == "stapo":
        for key in ("actor/s2t/masked_frac", "actor/s2t/num_candidates", "actor/s2t/num_masked",
                    "actor/s2t/entropy_threshold"):
            assert key in history[0] or key == "actor/s2t/entropy_threshold", key  # τ_h is absent when NaN everywhere

    if objective == "entropy20":
        # 2 prompts × G=4 × ≤8 tokens: about a fifth of the response tokens keep gradient
        assert 0.15 < history[0]["actor/top_entropy/kept_frac"] <= 0.35
    if objective == "grpo":
        assert "actor/kl_loss" in history[0]
    changed = sum(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    assert changed > 0
    rows = _rows(tmp_path / "toy" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    ckpt = latest_checkpoint(tmp_path / "toy" / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000002"  # the final checkpoint is always written


def test_would_mask_diagnostic_is_s2t_own_mask_with_one_mini_batch(tmp_path):
    # one mini-batch per step (ppo_mini_batch_size = train_batch_size = 2): the S2T mask STAPO applies and the
    # diagnostic every objective logs (s2t/would_mask/*, at the old policy on the whole batch) see the same policy,
    # the same tokens and the same candidate set, so their counts agree exactly
    trainer = make_trainer(str(tmp_path), ["algorithm.objective=stapo", "trainer.save_every=0", "trainer.total_steps=1",
                                           "actor.ppo_mini_batch_size=2"])
    (m,) = trainer.train()
    assert m["s2t/would_mask/num_candidates"] == m["actor/s2t/num_candidates"]
    assert m["s2t/would_mask/num_masked"] == m["actor/s2t/num_masked"]
    assert m["s2t/would_mask/masked_frac"] == pytest.approx(m["actor/s2t/masked_frac"])


def test_checkpoint_is_loadable_by_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(str(tmp_path), ["trainer.total_steps=1"])
    trainer.train()
    ckpt = latest_checkpoint(tmp_path / "toy" / "checkpoints")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    for (k, a), (_, b) in zip(trainer.model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), k


_NOISY = ("timing_s/", "perf/")


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(_NOISY)} for r in rows]


def test_sigkill_and_resume_gives_the_same_metrics(tmp_path):
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, str(REPO / "tests" / "toy_run.py")]
    steps = ["trainer.total_steps=4", "trainer.save_every=1"]
    # uninterrupted reference run
    subprocess.run(cmd + [str(tmp_path / "ref"), *steps], check=True, env=env, capture_output=True)
    reference = _rows(tmp_path / "ref" / "toy" / "metrics.jsonl")
    assert [r["step"] for r in reference] == [1, 2, 3, 4]

    # killed run: SIGKILL as soon as the step-2 checkpoint exists (it may have started step 3)
    run_dir = tmp_path / "killed" / "toy"
    proc = subprocess.Popen(cmd + [str(tmp_path / "killed"), *steps], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run_dir / "checkpoints" / "step_000002" / "trainer_state.pt").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = latest_checkpoint(run_dir / "checkpoints")
    assert killed_at is not None and killed_at.name in ("step_000002", "step_000003")
    assert not (run_dir / "checkpoints" / "step_000004").exists()

    # resume
    subprocess.run(cmd + [str(tmp_path / "killed"), *steps, "trainer.resume=auto"], check=True, env=env,
                   capture_output=True)
    resumed = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # no duplicated or missing steps
    assert _comparable(resumed) == _comparable(reference)


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path):
    make_trainer(str(tmp_path), ["trainer.total_steps=1"]).train()
    with pytest.raises(FileExistsError, match="--resume"):
        make_trainer(str(tmp_path), ["trainer.total_steps=1"]).train()


def test_wandb_offline_run_directory_holds_the_metrics(tmp_path, monkeypatch):
    """An offline W&B run in the run directory that received exactly the metrics of metrics.jsonl.

    wandb ships no public reader for its offline ``.wandb`` file (and writes it asynchronously: on a busy machine
    it may hold only its header when ``finish()`` returns, and offline runs write no ``wandb-summary.json``), so
    the test records what the tracker hands to the W&B run object (``wandb.Run.log``, wandb's public API) and
    checks that the offline run's files exist, instead of reading wandb's private binary format."""
    import wandb

    logged: list[dict] = []
    original = wandb.Run.log

    def spy(self, data, step=None, *args, **kwargs):
        logged.append({**data, "<wandb step>": step})
        return original(self, data, step, *args, **kwargs)

    monkeypatch.setattr(wandb.Run, "log", spy)
    trainer = make_trainer(str(tmp_path), ["trainer.total_steps=1", "logging.wandb_mode=offline"])
    trainer.train()
    run_dir = tmp_path / "toy"
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert offline[0].name.endswith(f"-{run_id}") and (offline[0] / f"run-{run_id}.wandb").exists()
    row = _rows(run_dir / "metrics.jsonl")[0]
    scalars = [data for data in logged if "actor/entropy" in data]
    # the step travels as W&B's x axis training/global_step (stapo.run.provenance.TRAIN_STEP_METRIC) and as W&B's own
    # step (increasing, so a resumed offline run's rows continue the earlier ones on `wandb sync`)
    assert len(scalars) == 1 and scalars[0].pop("training/global_step") == row["step"] == 1
    assert scalars[0].pop("<wandb step>") == 1
    data = scalars[0]
    for key in ("critic/score/mean", "actor/entropy", "actor/pg_loss", "actor/s2t/num_masked"):
        assert key in data, key
    finite = {k: v for k, v in data.items() if isinstance(v, float) and math.isfinite(v)}
    assert finite and all(row[k] == v for k, v in finite.items())  # the same values as metrics.jsonl
    assert set(data) <= set(row)


def test_train_py_reports_bad_config_and_exits_2(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
                          "actor.lrr=1"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown config key 'actor.lrr'; did you mean 'actor.lr'?" in out.stderr
    assert "Traceback" not in out.stderr


def test_validation_hook_from_the_config_runs_every_val_every_steps(tmp_path, shared_data_root):
    """train.py's wiring: cfg.validation → stapo.evaluation hook; 2 steps, val_every=2 → one validation row."""
    from stapo.config import load_config
    from stapo.evaluation import make_validation_hook_from_config
    from stapo.train import Trainer
    from toy_run import toy_reward

    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=val", "trainer.save_every=0", "trainer.val_every=2",
        f"data.root={shared_data_root}", "validation.benchmarks=[math500]", "validation.limit=1",
        "validation.samples=2", "data.max_prompt_length=512"])  # MATH500's first prompt is longer than 64
    hook = make_validation_hook_from_config(cfg)
    assert hook is not None
    history = Trainer(cfg, validation_hook=hook, reward_fn=toy_reward).train()
    val_keys = [k for k in history[1] if k.startswith("val-core/")]  # verl's layout (docs/metrics.md)
    assert set(val_keys) == {"val-core/math500/acc/mean@2", "val-core/math500/acc/pass@2",
                             "val-core/math500/acc/maj@2", "val-core/average/acc/mean@2"}
    assert val_keys and not any(k.startswith("val") for k in history[0])  # step 2 only
    # the random tiny model never answers a MATH500 problem: mean@2 (avg@N) = 0 over 1 problem × 2 samples
    assert all(history[1][k] == 0.0 for k in val_keys), {k: history[1][k] for k in val_keys}
    assert history[1]["val-aux/math500/dropped_long_prompt"] == 0.0
    assert (tmp_path / "val").is_dir()
    assert make_validation_hook_from_config(load_config(REPO / "configs" / "tiny_test.yaml")) is None


@pytest.mark.parametrize("case", ["bad_validation_root", "existing_run_dir", "missing_model"])
def test_train_py_start_up_errors_are_one_line_and_exit_2(tmp_path, case):
    args = [f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]
    if case == "bad_validation_root":
        args += ["trainer.val_every=1", f"data.root={tmp_path / 'nowhere'}"]
        expect = "nowhere"
    elif case == "existing_run_dir":
        (tmp_path / "r" / "checkpoints" / "step_000001").mkdir(parents=True)
        (tmp_path / "r" / "checkpoints" / "step_000001" / "trainer_state.pt").write_bytes(b"")
        expect = "already holds checkpoints"
    else:
        args += [f"model.path={tmp_path / 'no_model'}"]
        expect = "no_model"
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
                          *args], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-2000:]
    assert expect in out.stderr and "Traceback" not in out.stderr


def test_warm_up_counts_training_steps_and_logs_the_lr_used(tmp_path):
    # tiny_test: 2 prompts per step, ppo_mini_batch_size=1 → 2 optimizer steps per training step.
    # warmup_steps=2 training steps at lr 1e-3: step 1 uses 1e-3·1/2 = 5e-4 (both mini-batches), step 2 uses 1e-3.
    trainer = make_trainer(str(tmp_path), ["trainer.save_every=0", "actor.warmup_steps=2"])
    stale = trainer.run_dir / "validation" / "step_000007"  # a previous run's validation output
    stale.mkdir(parents=True)
    history = trainer.train()
    assert [m["actor/lr"] for m in history] == pytest.approx([5e-4, 1e-3])
    assert not stale.exists()  # outputs of steps after the start step are removed, never resumed


@pytest.mark.parametrize("objective,mini", [("stapo", 1), ("stapo", 2), ("grpo", 2), ("entropy20", 1)])
def test_fused_forward_gives_the_same_masks_loss_and_update(tmp_path, objective, mini):
    """actor.fused_forward takes the mask statistics (and the first mini-batch's old log-probs) from the update's
    own forward instead of separate no-grad passes: the masks, losses and weights must not change.
    mini=1: two mini-batches per step (the second needs the old pass and current-policy statistics);
    mini=2: one mini-batch per step (no old-policy pass at all)."""
    common = [f"algorithm.objective={objective}", f"actor.ppo_mini_batch_size={mini}", "trainer.save_every=0"]
    runs = {}
    for fused in (False, True):
        trainer = make_trainer(str(tmp_path / str(fused)), [*common, f"actor.fused_forward={fused}"])
        history = trainer.train()
        runs[fused] = (_comparable(history), {k: v.detach().clone() for k, v in trainer.model.named_parameters()})
    (h0, p0), (h1, p1) = runs[False], runs[True]
    assert h0[0].get("actor/s2t/num_masked", 1) > 0 or objective != "stapo"  # the mask is exercised
    # Adam divides by sqrt(v): a gradient near 0 turns rounding-level differences (another summation order) into
    # update differences up to ~lr; 2 steps at lr 1e-3 move weights by up to 2e-3, so 5e-5 is 2.5 % of that (seen:
    # ≤ 1.4e-5 on one weight of 2048; a wrong mask or denominator moves most weights by ~lr).
    _assert_same_runs(h0, p0, h1, p1)


def test_training_prompts_from_a_user_file(tmp_path):
    """data.train_set=file reads data.train_file with its column mapping: the trainer's (prompt ids, gold, id)
    are those of encode_prompt on each row; a bad column name is one line naming the file and the key."""
    from stapo.config import load_config
    from stapo.tasks.data import DataError
    from stapo.model.models import load_tokenizer
    from stapo.tasks.prompts import encode_prompt
    from stapo.train import load_prompts

    path = tmp_path / "my_set.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 2?", "ans": "4"}) + "\n"
                    + json.dumps({"question": "What is 5 - 3?", "ans": "$2$"}) + "\n")
    tok = load_tokenizer("embedded:smollm2")
    cfg = load_config(None, ["data.train_set=file", f"data.train_file.path={path}",
                             "data.train_file.problem_key=question", "data.train_file.answer_key=ans"])
    got, stats = load_prompts(cfg, tok)
    assert got == [(encode_prompt("What is 2 + 2?", tok, use_chat_template="chat"), "4", "my_set/0"),
                   (encode_prompt("What is 5 - 3?", tok, use_chat_template="chat"), "2", "my_set/1")]
    assert stats == {"data/num_prompts": 2.0, "data/num_dropped_too_long": 0.0, "data/num_skipped_rows": 0.0,
                     "data/num_unparsable_gold": 0.0}
    cfg.data.train_file.answer_key = "answer"
    with pytest.raises(DataError) as err:
        load_prompts(cfg, tok)
    assert str(err.value) == f"{path}: no column 'answer' (data.train_file.answer_key); columns: question, ans"


def test_no_training_prompts_names_the_source_the_counts_and_the_key(tmp_path):
    """Every row skipped and/or every prompt longer than data.max_prompt_length: one DataError line from load_prompts
    naming the file (or the set), rows read / skipped (with the reasons) / too long and the key to change (it was a
    ValueError from PromptLoader naming neither)."""
    from stapo.config import load_config
    from stapo.tasks.data import DataError
    from stapo.model.models import load_tokenizer
    from stapo.train import load_prompts

    tok = load_tokenizer("embedded:smollm2")
    path = tmp_path / "rows.jsonl"
    file_set = ["data.train_set=file", f"data.train_file.path={path}", "data.train_file.problem_key=q",
                "data.train_file.answer_key=a"]

    def message(rows, *overrides):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(DataError) as err:
            load_prompts(load_config(None, [*file_set, *overrides]), tok)
        return str(err.value)

    assert message([{"q": "What is 2 + 2?", "a": "4"}, {"q": "What is 3 + 3?", "a": "6"}],
                   "data.max_prompt_length=4") == (
        f"no training prompts from data.train_file.path={path}: 2 rows read, 0 skipped, 2 longer than "
        f"data.max_prompt_length=4 tokens; raise data.max_prompt_length")
    assert message([{"q": "x", "a": ""}, {"q": "y", "a": None}]) == (
        f"no training prompts from data.train_file.path={path}: 2 rows read, 2 skipped (field 'a': answer is empty: 1; "
        f"field 'a': answer is null: 1), 0 longer than data.max_prompt_length=1024 tokens; "
        f"check data.train_file.problem_key / data.train_file.answer_key")
    assert message([{"q": "What is 2 + 2?", "a": "4", "k": "p"}, {"q": "What is 3 + 3?", "a": "", "k": "r"}],
                   "data.max_prompt_length=4", "data.train_file.id_key=k") == (
        f"no training prompts from data.train_file.path={path}: 2 rows read, 1 skipped (field 'a': answer is empty: 1), "
        f"1 longer than data.max_prompt_length=4 tokens; check data.train_file.problem_key / data.train_file.answer_key "
        f"/ data.train_file.id_key, and raise data.max_prompt_length")
    with pytest.raises(DataError) as err:  # a built-in set: its name
        load_prompts(load_config(None, ["data.max_prompt_length=3", "data.synthetic.num_problems=5"]), tok)
    assert str(err.value) == ("no training prompts from data.train_set=synthetic: 5 rows read, 0 skipped, 5 longer "
                              "than data.max_prompt_length=3 tokens; raise data.max_prompt_length")


def test_train_py_no_training_prompts_from_a_file_is_one_line_and_exits_2(tmp_path):
    """train.py on a user file whose prompts are all too long: exit 2, the one line of load_prompts, no traceback."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"q": "What is 2 + 2?", "a": "4"}) + "\n" + json.dumps({"q": "What is 3 + 3?", "a": "6"}) + "\n")
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
                          f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "data.train_set=file",
                          f"data.train_file.path={path}", "data.train_file.problem_key=q", "data.train_file.answer_key=a",
                          "data.max_prompt_length=2"], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert lines == [f"train.py: no training prompts from data.train_file.path={path}: 2 rows read, 0 skipped, "
                     f"2 longer than data.max_prompt_length=2 tokens; raise data.max_prompt_length"]


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_mask_registered_in_a_test_file_trains_from_the_config_path(tmp_path, fused):
    """A NEW mask, registered here only (function + parameter dataclass + row rule + prefix), selected by a config
    (an objective registered here too), its parameter set by a dotted override of algorithm.masks.<name>.<param>:
    one training step through load_config + Trainer, its statistics in metrics.jsonl under its own prefix."""
    from dataclasses import dataclass

    from stapo.core.masks import TokenMask, register_token_mask, unregister_token_mask
    from stapo.core.objectives import OBJECTIVES, get_objective, register_objective

    calls = []

    @dataclass
    class FirstKParams:
        k: int = 1

    @register_token_mask("test_first_k", params=FirstKParams, maskable_rows="positive_advantage", reads_rows=True,
                         prefix="first_k")
    def first_k(logprobs, entropy, advantages, response_mask, *, k=1):
        """Silence the first k response tokens of every Â > 0 response."""
        pos = response_mask.long().cumsum(dim=1)  # [B, T] 1-based position among the response tokens
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(response_mask)
        silenced = response_mask & (pos <= k) & (adv > 0)
        calls.append((adv[:, 0].clone(), response_mask.sum(dim=1).clone()))
        n = int(response_mask.sum())
        return TokenMask(keep=response_mask & ~silenced, stats={
            "num_response_tokens": float(n), "num_masked": float(silenced.sum()), "masked_frac": 0.0})

    try:
        register_objective(get_objective("justrl").replace(name="test_first_k_obj", token_mask="test_first_k"))
        trainer = make_trainer(str(tmp_path), ["algorithm.objective=test_first_k_obj", "algorithm.masks.test_first_k.k=2",
                                               "trainer.total_steps=1", f"actor.fused_forward={fused}"])
        assert trainer.objective.mask_params == {"k": 2}
        trainer.train()
    finally:
        OBJECTIVES.pop("test_first_k_obj", None)
        unregister_token_mask("test_first_k")
    row = _rows(tmp_path / "toy" / "metrics.jsonl")[0]
    # expected by hand from what the mask saw: each Â > 0 response loses min(2, its length) tokens
    assert len(calls) == 2  # tiny_test: 2 prompts, ppo_mini_batch_size=1 → 2 mini-batches of G = 4 responses
    masked = sum(int(torch.minimum(lengths, torch.tensor(2))[adv > 0].sum()) for adv, lengths in calls)
    total = sum(int(lengths.sum()) for _, lengths in calls)
    assert masked > 0
    assert row["actor/first_k/num_masked"] == masked and row["actor/first_k/num_response_tokens"] == total
    assert row["actor/first_k/masked_frac"] == pytest.approx(masked / total)  # recomputed from the summed counts
    assert row["actor/num_kept_tokens"] == total - masked
    assert total == row["response_length/total_tokens"]


USER_MODULE = """
from dataclasses import dataclass

from stapo.core.masks import TokenMask, register_token_mask
from stapo.core.objectives import get_objective, register_objective


@dataclass
class HeadParams:
    k: int = 4                                    # config key: algorithm.masks.user_head.k


@register_token_mask("user_head", params=HeadParams, maskable_rows="all", prefix="user_head")
def user_head(logprobs, entropy, advantages, response_mask, *, k=4):
    \"\"\"Silence the first k response tokens of every response.\"\"\"
    silenced = response_mask & (response_mask.long().cumsum(dim=1) <= k)
    return TokenMask(keep=response_mask & ~silenced, stats={
        "num_response_tokens": float(response_mask.sum()), "num_masked": float(silenced.sum()), "masked_frac": 0.0,
        "num_rows": float(response_mask.shape[0]), "k": float(k)})


register_objective(get_objective("justrl").replace(name="user_head_obj", token_mask="user_head"))
"""


def test_a_mask_and_objective_from_trainer_import_modules_train_through_train_py(tmp_path):
    """A user's module (a .py file) that registers a mask and an objective, listed in trainer.import_modules of a
    plain YAML config: `python train.py --config my.yaml` imports it before the objective name is checked, trains
    one step, and logs the mask's statistics under its own prefix."""
    module = tmp_path / "user_head.py"
    module.write_text(USER_MODULE)
    config = tmp_path / "my.yaml"
    config.write_text(f"defaults: [{REPO / 'configs/tiny_test.yaml'}]\n"
                      f"trainer:\n  import_modules: [{module}]\n  total_steps: 1\n  save_every: 0\n"
                      f"  output_dir: {tmp_path}\n  run_name: r\n"
                      "algorithm:\n  objective: user_head_obj\n")
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(config),
                          "algorithm.masks.user_head.k=1"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    row = _rows(tmp_path / "r" / "metrics.jsonl")[0]
    # tiny_test: 2 prompts × G = 4 responses, 2 mini-batches of 4; every response has ≥ 1 token, k = 1 (the
    # override, not the default 4) → exactly one silenced token per response: 8 in all
    total = row["response_length/total_tokens"]
    assert row["actor/user_head/num_rows"] == 8 and row["actor/user_head/k"] == 1.0
    assert row["actor/user_head/num_masked"] == 8 and row["actor/user_head/num_response_tokens"] == total
    assert row["actor/user_head/masked_frac"] == pytest.approx(8 / total)  # recomputed from the summed counts
    assert row["actor/num_kept_tokens"] == total - 8


def test_train_py_reports_a_failed_import_module_in_one_line_and_exits_2(tmp_path):
    broken = tmp_path / "broken_user.py"
    broken.write_text("from stapo.core.masks import no_such_name\n")
    for entry, expect in [("no_such_module_xyz", "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
                          (str(broken), "ImportError: cannot import name 'no_such_name'")]:
        out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
                              f"trainer.import_modules=['{entry}']"], capture_output=True, text=True)
        assert out.returncode == 2
        assert out.stderr.startswith(f"train.py: invalid value for 'trainer.import_modules' ('{entry}'): cannot import "
                                     f"it: {expect}")
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def _recording_trainer(tmp_path, overrides, monkeypatch):
    """A toy trainer whose mask inputs (per mini-batch) and step batches are recorded (the mask through
    ``stapo.train.update``'s name for the one entry point, ``minibatch_token_mask``)."""
    import stapo.train.update as update_mod
    from stapo.core.minibatch import minibatch_token_mask as orig_mask  # the real one (not an earlier patch)

    trainer = make_trainer(str(tmp_path), ["trainer.save_every=0", "trainer.total_steps=1", *overrides])
    seen = {"mask_logp": [], "batches": [], "forward_all": 0}
    up = trainer.updater
    orig_run, orig_forward = up.run, up.no_grad_stats

    def token_mask(objective, logprobs, *a, **kw):
        seen["mask_logp"].append(logprobs.clone())
        return orig_mask(objective, logprobs, *a, **kw)

    def run(*a, **kw):  # the update's result holds the step's complete old-policy statistics
        result = orig_run(*a, **kw)
        seen["batches"].append(SimpleNamespace(old_logprobs=result.old.logprobs))
        return result

    def no_grad_stats(*a, **kw):  # a no-grad pass over rows of the batch (old policy, or current-policy stats)
        seen["forward_all"] += 1
        return orig_forward(*a, **kw)

    monkeypatch.setattr(update_mod, "minibatch_token_mask", token_mask)
    up.run, up.no_grad_stats = run, no_grad_stats
    return trainer, seen


@pytest.mark.parametrize("objective", ["stapo", "entropy20"])
def test_mask_stats_source_old_uses_the_old_policy_statistics_for_later_mini_batches(tmp_path, objective,
                                                                                     monkeypatch):
    """tiny_test: 2 mini-batches per step (rows 0–3, 4–7). The first one's statistics are π_old's either way; the
    second's are the old-policy pass itself with mask_stats_source=old (no extra forward), a forward of the policy
    after the first optimizer step (lr 1e-3: different log-probs) with current (one more _forward_all)."""
    runs = {}
    for source in ("old", "current"):
        trainer, seen = _recording_trainer(tmp_path / source, [f"algorithm.objective={objective}",
                                                               f"algorithm.mask_stats_source={source}"],
                                           monkeypatch)
        trainer.train()
        runs[source] = seen
    for source, seen in runs.items():
        sb = seen["batches"][0]
        assert len(seen["mask_logp"]) == 2
        assert torch.equal(seen["mask_logp"][0], sb.old_logprobs[0:4])  # first mini-batch: π_old = π_θ
    old, cur = runs["old"], runs["current"]
    assert torch.equal(old["mask_logp"][1], old["batches"][0].old_logprobs[4:8])
    assert not torch.allclose(cur["mask_logp"][1], cur["batches"][0].old_logprobs[4:8])
    assert (old["forward_all"], cur["forward_all"]) == (1, 2)  # the old pass; + the current-policy pass


def _assert_same_runs(h0, p0, h1, p1) -> None:
    """Two runs that must agree up to float rounding: every step's metrics (rel 1e-4) and the final weights
    (tolerance: see test_fused_forward_gives_the_same_masks_loss_and_update)."""
    for m0, m1 in zip(h0, h1):
        assert m0.keys() == m1.keys()
        for k in m0:
            assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-5, nan_ok=True), k
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], rtol=1e-4, atol=5e-5)


def test_fused_lm_head_gives_the_same_masks_loss_and_update(tmp_path, monkeypatch):
    """actor.lm_head=fused (stapo/model/lm_head.py: tiled LM head + token statistics, shared prompt and fused forward
    on, as in the CPU configs) against the model's own LM head: the same masks, losses and weights after 2 steps;
    a model whose logits are not hidden @ Wᵀ is refused at start-up naming the key."""
    common = ["trainer.save_every=0", "actor.share_prompt=true", "actor.fused_forward=true"]
    runs = {}
    for head in ("logits", "fused"):
        t = make_trainer(str(tmp_path / head), [*common, f"actor.lm_head={head}"])
        runs[head] = (_comparable(t.train()), {k: v.detach().clone() for k, v in t.model.named_parameters()})
    (h0, p0), (h1, p1) = runs["logits"], runs["fused"]
    assert h0[0]["actor/s2t/num_masked"] > 0  # the mask is exercised
    _assert_same_runs(h0, p0, h1, p1)
    import stapo.train.policy
    from stapo.config import ConfigError

    def soft_capped(model):
        raise ValueError("Qwen3ForCausalLM scales its logits (config.final_logit_softcapping=30.0): use "
                         "actor.lm_head=logits")

    monkeypatch.setattr(stapo.train.policy, "check_fused_head", soft_capped)
    with pytest.raises(ConfigError, match=r"'actor.lm_head' \('fused'\): .*final_logit_softcapping"):
        make_trainer(str(tmp_path / "capped"), [*common, "actor.lm_head=fused"])


@pytest.mark.parametrize("mini", [1, 2])
def test_recomputed_deferred_graphs_give_the_same_masks_loss_and_update(tmp_path, mini):
    """actor.deferred_graphs=recompute: the Â > 0 rows are forwarded without grad for the mask's statistics and
    again with grad after the mask, one micro-batch at a time, instead of keeping their graphs — the same masks,
    losses and weights after 2 steps. tiny_test: 2 prompts × G = 4 per step, micro-batches of 2 responses."""
    common = ["trainer.save_every=0", "actor.fused_forward=true", f"actor.ppo_mini_batch_size={mini}"]
    runs, calls = {}, {}
    for mode in ("keep", "recompute"):
        t = make_trainer(str(tmp_path / mode), [*common, f"actor.deferred_graphs={mode}"])
        forward, seen = t.updater.forward, []

        def recording(batch, idx, model=None, forward=forward, seen=seen):
            seen.append((tuple(idx.tolist()), torch.is_grad_enabled()))
            return forward(batch, idx, model)

        t.updater.forward = recording
        runs[mode] = (_comparable(t.train()), {k: v.detach().clone() for k, v in t.model.named_parameters()})
        calls[mode] = seen
    (h0, p0), (h1, p1) = runs["keep"], runs["recompute"]
    assert h0[0]["actor/s2t/num_masked"] > 0  # the mask is exercised
    _assert_same_runs(h0, p0, h1, p1)
    # recompute = keep's forwards (mini=1 adds the second mini-batch's no-grad old-policy pass to both) plus one
    # no-grad forward of each deferred micro-batch, whose rows are then forwarded with grad as under keep
    from collections import Counter

    keep_grad = sorted(r for r, g in calls["keep"] if g)
    rec_grad = sorted(r for r, g in calls["recompute"] if g)
    extra = Counter(r for r, g in calls["recompute"] if not g) - Counter(r for r, g in calls["keep"] if not g)
    rec_nograd = list(extra.elements())
    assert rec_nograd and len(calls["recompute"]) == len(calls["keep"]) + len(rec_nograd)
    assert rec_grad == keep_grad and set(rec_nograd) <= set(rec_grad)


@pytest.mark.slow  # `pytest -m slow` (keeps the default suite near 10 min)
def test_sort_by_length_false_keeps_rollout_order_with_the_same_results(tmp_path):
    from stapo.train.plan import micro_batches

    # prompt + response lengths 3, 5, 4, 5; micro-batches of 3 rows
    attention_mask = torch.tensor([[1, 1, 1, 0, 0], [1] * 5, [1, 1, 1, 1, 0], [1] * 5])
    lengths, rows = attention_mask.sum(dim=1), torch.arange(4)
    # sorted: descending length, ties in rollout order (stable) → 1, 3 (5 tokens), 2 (4), 0 (3)
    assert [m.tolist() for m in micro_batches(lengths, rows, 3, sort_by_length=True)] == [[1, 3, 2], [0]]
    assert [m.tolist() for m in micro_batches(lengths, rows, 3, sort_by_length=False)] == [[0, 1, 2], [3]]
    # two steps with and without sorting: other micro-batch groupings, the same masks, losses and update
    runs = {}
    for sort in (True, False):
        t = make_trainer(str(tmp_path / str(sort)), ["trainer.save_every=0", f"actor.sort_by_length={sort}"])
        runs[sort] = (_comparable(t.train()), {k: v.detach().clone() for k, v in t.model.named_parameters()})
    (h0, p0), (h1, p1) = runs[True], runs[False]
    assert h0[0]["actor/s2t/num_masked"] > 0  # the mask is exercised
    _assert_same_runs(h0, p0, h1, p1)


@pytest.mark.parametrize("objective, prefix", [("stapo_high_entropy", "s2t_high_entropy"),
                                               ("stapo_random", "s2t_random"), ("justrl_fullmask", "full_low_prob")])
def test_each_s2t_ablation_trains_from_its_config_name(tmp_path, objective, prefix):
    """The ablations run from the config path, their statistics under their own prefix (the candidates are S2T's;
    FullMask silences every candidate)."""
    trainer = make_trainer(str(tmp_path), [f"algorithm.objective={objective}", "trainer.total_steps=1",
                                           "trainer.save_every=0"])
    m = trainer.train()[0]
    pre = f"actor/{prefix}"
    n, cand, masked = m[f"{pre}/num_response_tokens"], m[f"{pre}/num_candidates"], m[f"{pre}/num_masked"]
    assert n == m["response_length/total_tokens"] and 0 < masked <= cand
    assert m[f"{pre}/masked_frac"] == pytest.approx(masked / n)
    assert m["actor/num_kept_tokens"] == n - masked
    if objective == "justrl_fullmask":
        assert masked == cand
    assert _rows(tmp_path / "toy" / "metrics.jsonl")[0][f"{pre}/num_masked"] == masked
