"""The end-of-run summary (stapo/train/summary.py, shared by train.py and scripts/summarize_run.py) on hand-made
metrics, and the console's progress: responses in the rollout bar, the mini-batch loss in the update bar."""
from __future__ import annotations

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from stapo.train.summary import (end_of_run_text, markdown_report, masked_fraction_key, start_end, training_rows,
                                 window_size)

REPO = Path(__file__).resolve().parents[1]

# six steps; reward, entropy, masked fraction, step time (one value missing, one null = a NaN the tracker wrote)
ROWS = [
    {"step": 1, "critic/score/mean": -1.0, "actor/entropy": 2.0, "actor/s2t/masked_frac": 0.010, "timing_s/step": 10.0},
    {"step": 2, "critic/score/mean": -0.5, "actor/entropy": 1.8, "actor/s2t/masked_frac": 0.020, "timing_s/step": 12.0},
    {"step": 3, "critic/score/mean": 0.0, "actor/entropy": None, "actor/s2t/masked_frac": 0.030, "timing_s/step": 11.0},
    {"step": 4, "critic/score/mean": 0.25, "actor/entropy": 1.2, "actor/s2t/masked_frac": 0.005, "timing_s/step": 9.0},
    {"step": 5, "critic/score/mean": 0.5, "actor/entropy": 1.0, "timing_s/step": 9.0},
    {"step": 6, "critic/score/mean": 0.75, "actor/entropy": 0.9, "actor/s2t/masked_frac": 0.001, "timing_s/step": 8.0},
]


def test_window_is_capped_at_half_the_steps():
    assert window_size(6, 5) == 3   # 6 // 2
    assert window_size(20, 5) == 5
    assert window_size(1, 5) == 1   # one step: start = end
    assert window_size(3, 5) == 1


def test_start_end_means_by_hand():
    w, changes = start_end(ROWS, ["critic/score/mean", "actor/entropy", "actor/s2t/masked_frac", "timing_s/step",
                                  "reward/grader/accuracy"], window=5)
    assert w == 3
    by_key = {c.key: c for c in changes}
    assert "reward/grader/accuracy" not in by_key  # no row holds it: left out
    # reward: start (-1 - 0.5 + 0) / 3 = -0.5; end (0.25 + 0.5 + 0.75) / 3 = 0.5
    assert by_key["critic/score/mean"].start == pytest.approx(-0.5)
    assert by_key["critic/score/mean"].end == pytest.approx(0.5)
    # entropy: step 3 is null → start (2.0 + 1.8) / 2 = 1.9; end (1.2 + 1.0 + 0.9) / 3 = 1.0333
    assert by_key["actor/entropy"].start == pytest.approx(1.9)
    assert by_key["actor/entropy"].end == pytest.approx(3.1 / 3)
    # masked fraction: step 5 lacks it → start (0.01 + 0.02 + 0.03) / 3 = 0.02; end (0.005 + 0.001) / 2 = 0.003
    assert by_key["actor/s2t/masked_frac"].start == pytest.approx(0.02)
    assert by_key["actor/s2t/masked_frac"].end == pytest.approx(0.003)
    assert by_key["timing_s/step"].text() == "11.0 → 8.7"  # (10+12+11)/3 = 11.0, (9+9+8)/3 = 8.67


def test_masked_fraction_key_of_each_kind_of_run():
    assert masked_fraction_key(ROWS) == "actor/s2t/masked_frac"
    assert masked_fraction_key([{"step": 1, "actor/s2t_random/masked_frac": 0.1}]) == "actor/s2t_random/masked_frac"
    assert masked_fraction_key([{"step": 1, "actor/entropy": 1.0}]) is None  # GRPO: no mask
    assert masked_fraction_key([]) is None


def test_end_of_run_text_lists_changes_files_and_next_commands(tmp_path):
    run = tmp_path / "runs" / "stapo_x_seed0"
    text = end_of_run_text(ROWS, run, window=5, checkpoint=run / "checkpoints" / "step_000006",
                           wandb_mode="offline", wandb_dirs=[run / "wandb" / "offline-run-1-abc"],
                           eval_config="configs/eval/cpu_smollm2.yaml")
    lines = text.splitlines()
    # the sum of step times: 10 + 12 + 11 + 9 + 9 + 8 = 59 s = 1.0 min
    assert lines[0] == "finished: steps 1–6, 1.0 min of step time; start → end (means of steps 1–3 / steps 4–6):"
    assert any("(critic/score/mean)" in line and line.endswith("-0.500 → +0.500") for line in lines)
    assert any("(actor/s2t/masked_frac)" in line and line.endswith("0.0200 → 0.0030") for line in lines)
    assert any("(timing_s/step)" in line and line.endswith("11.0 → 8.7") for line in lines)
    assert f"  metrics      {run}/metrics.jsonl" in lines
    assert f"  checkpoints  {run}/checkpoints (latest: step_000006)" in lines
    assert f"  W&B          {run}/wandb/offline-run-* (offline: not uploaded yet)" in lines
    assert f"  summarise    python scripts/summarize_run.py {run}" in lines
    assert (f"  evaluate     python evaluate.py --config configs/eval/cpu_smollm2.yaml --model {run} "
            f"--all-checkpoints") in lines
    assert f"  sync         wandb sync {run}/wandb/offline-run-*" in lines
    assert any(line.startswith("  compare      python scripts/compare.py") for line in lines)


def test_end_of_run_text_without_wandb_or_checkpoints(tmp_path):
    text = end_of_run_text(ROWS[:1], tmp_path / "r", wandb_mode="disabled")
    assert "W&B " not in text and "wandb sync" not in text and "(none)" in text
    assert text.splitlines()[0].endswith("(means of step 1 / step 1):")  # one step: start = end = it


def test_markdown_report_table_by_hand():
    text = markdown_report(ROWS, "r", "python scripts/summarize_run.py r --window 5")
    assert "- Steps: 6 (start = mean of steps 1–3, end = mean of steps 4–6)" in text
    assert "- Sum of step times: 1.0 min" in text
    assert "| reward (mean, ±1) (`critic/score/mean`) | -0.500 | +0.500 |" in text
    assert "| 3 | +0.000 | n/a | 0.0300 | n/a | n/a | 11.0 |" in text  # null entropy, missing keys: n/a


# trainer.val_before_train: a step-0 row with validation keys only, then training steps 1–4
VAL_ROWS = [
    {"step": 0, "val-core/math500/acc/mean@4": 0.25, "val-aux/response_length/mean": 40.0},
    {"step": 1, "critic/score/mean": -1.0, "actor/entropy": 2.0, "actor/s2t/masked_frac": 0.01, "timing_s/step": 10.0},
    {"step": 2, "critic/score/mean": -0.5, "actor/entropy": 1.6, "actor/s2t/masked_frac": 0.03, "timing_s/step": 12.0},
    {"step": 3, "critic/score/mean": 0.0, "actor/entropy": 1.2, "actor/s2t/masked_frac": 0.02, "timing_s/step": 8.0},
    {"step": 4, "critic/score/mean": 0.5, "actor/entropy": 1.0, "actor/s2t/masked_frac": 0.0, "timing_s/step": 6.0,
     "val-core/math500/acc/mean@4": 0.5},
]


def test_step_zero_validation_row_is_not_a_training_step(tmp_path):
    """4 training rows → window min(5, 4 // 2) = 2: start = steps 1–2, end = steps 3–4 (by their `step` values; the
    step-0 row, which holds no critic/score/mean, is neither counted nor averaged)."""
    assert [r["step"] for r in training_rows(VAL_ROWS)] == [1, 2, 3, 4]
    assert masked_fraction_key(VAL_ROWS) == "actor/s2t/masked_frac"  # read from step 1, not the validation row
    w, changes = start_end(VAL_ROWS, ["critic/score/mean", "actor/entropy", "actor/s2t/masked_frac",
                                      "timing_s/step"], window=5)
    assert w == 2
    by_key = {c.key: c for c in changes}
    # reward: start (-1.0 - 0.5) / 2 = -0.75; end (0.0 + 0.5) / 2 = +0.25
    assert (by_key["critic/score/mean"].start, by_key["critic/score/mean"].end) == (pytest.approx(-0.75),
                                                                                      pytest.approx(0.25))
    # entropy: (2.0 + 1.6) / 2 = 1.8 → (1.2 + 1.0) / 2 = 1.1; masked: (0.01 + 0.03) / 2 = 0.02 → (0.02 + 0) / 2 = 0.01
    assert by_key["actor/entropy"].text() == "1.800 → 1.100"
    assert by_key["actor/s2t/masked_frac"].text() == "0.0200 → 0.0100"
    # s / step: (10 + 12) / 2 = 11.0 → (8 + 6) / 2 = 7.0 (the step-0 row has no step time: not "n/a → ...")
    assert by_key["timing_s/step"].text() == "11.0 → 7.0"
    lines = end_of_run_text(VAL_ROWS, tmp_path / "r").splitlines()
    # step time 10 + 12 + 8 + 6 = 36 s = 0.6 min
    assert lines[0] == "finished: steps 1–4, 0.6 min of step time; start → end (means of steps 1–2 / steps 3–4):"
    assert any("(critic/score/mean)" in line and line.endswith("-0.750 → +0.250") for line in lines)
    assert any("(actor/s2t/masked_frac)" in line and line.endswith("0.0200 → 0.0100") for line in lines)
    text = markdown_report(VAL_ROWS, "r", "python scripts/summarize_run.py r")
    assert ("- Steps: 4 (start = mean of steps 1–2, end = mean of steps 3–4); 1 row without training metrics "
            "(validation only: step 0) not counted") in text
    assert "- Sum of step times: 0.6 min" in text
    assert "| reward (mean, ±1) (`critic/score/mean`) | -0.750 | +0.250 |" in text
    assert "| 1 | -1.000 | 2.000 | 0.0100 | n/a | n/a | 10.0 |" in text
    assert "\n| 0 |" not in text  # no per-step line for the validation-only row


def test_a_run_with_only_the_validation_row(tmp_path):
    assert start_end(VAL_ROWS[:1], ["critic/score/mean"]) == (1, [])
    assert end_of_run_text(VAL_ROWS[:1], tmp_path / "r").splitlines()[0] == "finished: no training step was logged"
    assert "- Steps: 0 (no training step was logged); 1 row without training metrics" in markdown_report(
        VAL_ROWS[:1], "r", "s")


def test_summarize_run_script_reads_a_torn_file(tmp_path):
    import json

    # a step-0 validation row, the six steps of ROWS, a torn last line
    rows = [VAL_ROWS[0]] + ROWS
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "crit')
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_run.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # the torn last line is left out; the step-0 row is not a training step
    assert ("- Steps: 6 (start = mean of steps 1–3, end = mean of steps 4–6); 1 row without training metrics "
            "(validation only: step 0) not counted") in out.stdout


# --- the console ---------------------------------------------------------------------------------------------
def test_rotary_reload_warning_is_dropped_unless_verbose():
    from stapo.run import console

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        console.set_verbose(False)
        console.drop_rotary_reload_warning()
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure: kept
        assert [r.getMessage() for r in records] == ["QKVParallelLinear: Failed to load weights"]
        logger.filters.clear()
        worker = logging.getLogger("vllm.v1.worker.cpu_worker")  # an expected CPU start-up warning: dropped
        worker.addHandler(handler)
        console.quiet_libraries()
        worker.warning("%s is not found in LD_PRELOAD. For best performance, ...", "libtcmalloc")
        worker.warning("something else")  # kept
        assert records[-1].getMessage() == "something else" and len(records) == 2
        worker.filters.clear()
        worker.removeHandler(handler)
        console.set_verbose(True)  # train.py --verbose: nothing is dropped
        console.drop_rotary_reload_warning()
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        assert records[-1].getMessage() == "RotaryEmbedding: Failed to load weights"
    finally:
        console.set_verbose(False)
        logger.filters.clear()
        logger.removeHandler(handler)


def test_validation_notes_skipped_long_prompts_in_one_plain_line(shared_data_root, capsys):
    """Validation prompts longer than data.max_prompt_length: one line on stderr, no Python warning (with its source
    line). The first 2 MATH500 problems in a plain prompt are longer than 4 tokens: both are skipped."""
    import warnings
    from types import SimpleNamespace

    from stapo.evaluation import make_validation_hook
    from stapo.model.models import load_tokenizer

    hook = make_validation_hook(benchmarks=["math500"], limit=2, samples=1, data_root=str(shared_data_root))
    trainer = SimpleNamespace(tokenizer=load_tokenizer("embedded:smollm2"), cfg=SimpleNamespace(data=SimpleNamespace(
        prompt_style="plain", system_prompt=None, max_prompt_length=4, root=str(shared_data_root))))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning would raise here
            problems = hook._load(trainer)
    finally:
        hook.close()
    assert problems["math500"] == []
    err = capsys.readouterr().err
    assert err == "validation: 2 math500 prompt(s) longer than data.max_prompt_length=4 tokens are skipped\n"


def test_update_bar_shows_the_logged_mini_batch_loss_and_rollout_counts_responses(tmp_path):
    """Two mini-batches (ppo_mini_batch_size=1 of train_batch_size=2), fused path (deferred graphs, loss divided by
    the kept-token count at the end): the loss postfixes are the two mini-batches' policy losses, whose mean is the
    step's actor/pg_loss; the rollout callback counts the step's 2 × 4 = 8 responses."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from toy_run import make_trainer

    from stapo.train import trainer as trainer_module

    seen: dict[str, list] = {"losses": [], "responses": [], "ticks": 0, "total": []}

    class Recorder(trainer_module.StepProgress):
        def rollout(self, num_responses):
            seen["total"].append(num_responses)
            return super().rollout(num_responses)

        def responses(self, n):
            seen["responses"].append(n)
            super().responses(n)

        def __call__(self, phase, n=1, **postfix):
            seen["ticks"] += n
            if "loss" in postfix:
                seen["losses"].append(float(postfix["loss"]))
            super().__call__(phase, n, **postfix)

    trainer = make_trainer(str(tmp_path), ["trainer.total_steps=1", "trainer.save_every=0",
                                           "actor.fused_forward=true"])
    original = trainer_module.StepProgress
    trainer_module.StepProgress = Recorder
    try:
        metrics = trainer.train()[0]
    finally:
        trainer_module.StepProgress = original
    assert seen["total"] == [8] and sum(seen["responses"]) == 8
    assert len(seen["losses"]) == 2  # one per mini-batch
    # the bar shows 4 decimals; actor/pg_loss is the mean of the mini-batch losses
    assert math.isclose(sum(seen["losses"]) / 2, metrics["actor/pg_loss"], abs_tol=1e-4)


def test_summarize_run_script_refuses_what_is_not_a_run_in_one_line(tmp_path):
    script = [sys.executable, str(REPO / "scripts" / "summarize_run.py")]
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "eval_manifest.json").write_text("{}")
    (sweep / "sweep.md").write_text("# sweep\n")
    for folder, expected in ((sweep, f"{sweep} is an evaluate.py output folder, not a train.py run: its "
                                     f"checkpoints' results are in {sweep / 'sweep.md'}"),
                             (tmp_path / "none", "metrics.jsonl not found")):
        out = subprocess.run([*script, str(folder)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and expected in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_a_non_finite_step_in_the_window_makes_its_mean_non_finite_not_dropped():
    """Steps 3 and 4 in the window, step 4 diverged (inf entropy, NaN reward): the window's means are inf and NaN,
    not step 3's values alone (the step is never silently left out)."""
    import math

    from stapo.train.summary import _mean

    rows = [{"step": 3, "actor/entropy": 3.0, "critic/score/mean": -0.5},
            {"step": 4, "actor/entropy": math.inf, "critic/score/mean": math.nan}]
    assert _mean(rows, "actor/entropy") == math.inf
    assert math.isnan(_mean(rows, "critic/score/mean"))
    assert _mean(rows[:1], "actor/entropy") == 3.0
