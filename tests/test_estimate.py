"""train.py / evaluate.py --dry-run and the cost estimate behind them (stapo/tools/estimate.py): the numbers worked by
hand for small configs, the throughput lookups from hand-made files, and the CLIs (exit 0, resolved config printed,
nothing created; a bad config still one line, exit 2)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from stapo.tools import estimate as est
from stapo.config import load_config
from stapo.common.perf import ModelShape

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_test.yaml")
TINY_EVAL = str(REPO / "configs" / "eval" / "tiny_test.yaml")


def _cli(script: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"_{script}_cli_estimate", REPO / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(REPO / f"{script}.py")])
    return module


def _tiny(*overrides: str):
    return load_config(TINY, list(overrides))


# --- training: the numbers by hand -----------------------------------------------------------------------------
def test_train_cost_of_tiny_test_by_hand():
    # tiny_test: 2 prompts × G = 4 = 8 responses, response_length 8, 2 steps, mini-batches of 1 prompt (4 rows),
    # micro-batches of 3 rows, S2T with masks from the current policy, not fused, save_every 1, keep_last 2
    c = est.train_cost(_tiny(), prompt_lengths=[20, 30], size=est.ModelSize(params=1000))
    assert (c.prompts, c.responses, c.response_length) == (2, 8, 8)
    assert c.generated_tokens_bound == 64  # 8 responses × 8 tokens
    assert c.steps == 2 and c.generated_tokens_bound * c.steps == 128
    assert c.prompt_tokens == 50  # 2 prompts × mean(20, 30)
    assert c.optimizer_steps == 2  # 2 prompts / 1 prompt per mini-batch
    # old-policy pass over rows 0–7 in micro-batches of 3: 3; mini-batch 0 (rows 0–3): 2 update forwards;
    # mini-batch 1 (rows 4–7): a current-policy stats pass of 2 + 2 update forwards → 3 + 2 + 4 = 9, 4 with backward
    assert (c.forwards, c.backwards) == (9, 4)
    assert c.checkpoints == [1, 2] and c.checkpoints_kept == 2
    assert c.checkpoint_bytes == 1000 * (4 + 3 * 4)  # fp32 HF export + fp32 parameters and two AdamW moments
    assert c.validations == 0 and c.seconds_per_step is None and c.seconds_total is None


def test_train_cost_fused_recompute_resume_and_validation_by_hand():
    cfg = _tiny("actor.fused_forward=true", "actor.deferred_graphs=recompute", "trainer.val_every=1",
                "trainer.total_steps=3", "trainer.save_every=2", "model.compute_dtype=bfloat16")
    c = est.train_cost(cfg, start_step=1, size=est.ModelSize(params=10), validation_problems=3)
    # fused, every Â > 0: each mini-batch's 4 rows are deferred → 2 micro-batches each (3 + 1 rows); the first
    # mini-batch fills the old statistics of rows 0–3, so the old pass covers rows 4–7: 2 → 2 + 2 + 2 = 6
    # forwards; "recompute" forwards the 4 deferred micro-batches once more without grad → 10; backwards 4
    assert (c.forwards, c.backwards) == (10, 4)
    assert c.steps == 2 and c.checkpoints == [2, 3] and c.checkpoints_kept == 2  # steps 2, 3 of a resume at 1
    assert c.checkpoint_bytes == 10 * (2 + 3 * 4)  # bf16 export + fp32 training state
    assert c.validations == 2  # after steps 2 and 3
    assert c.validation_samples == 12  # 3 problems × validation.samples 4
    assert c.validation_tokens_bound == 96  # 12 × min(validation.max_new_tokens or 8, 8)
    assert c.prompt_tokens is None and c.flops_per_step is None  # no prompt lengths given


def test_validation_cost_per_rank_and_time_by_hand(tmp_path):
    cfg = _tiny("trainer.val_every=2", "trainer.val_before_train=true", "trainer.total_steps=4",
                "validation.samples=2", "validation.samples_per_call=6", "actor.ppo_mini_batch_size=2")
    # 7 problems in blocks of 6 // 2 = 3 problems: 3, 3, 1; on 2 ranks the busiest rank takes ⌈3/2⌉ + ⌈3/2⌉ + ⌈1/2⌉
    # = 5 problems × N 2 = 10 responses; one rank: all 14
    measured = est.Measured(seconds_per_step=10.0, tokens_per_s=None, responses=8, response_length=8,
                            rollout_seconds=4.0, ranks=1, steps=3, source="hand")
    c = est.train_cost(cfg, ranks=2, validation_problems=7, measured=measured)
    assert c.validations == 3  # step 0 (val_before_train), after steps 2 and 4
    assert (c.validation_samples, c.validation_tokens_bound) == (14, 112)  # 7 × 2; × min(None or 8, 8)
    assert (c.validation_samples_per_rank, c.validation_calls) == (10, 3)
    # the rollout took 4 s for 8 × 8 = 64 bound tokens on one rank: 10 × 8 = 80 per rank → 5 s
    assert c.validation_seconds == pytest.approx(5.0)
    text = est.format_train_cost(c, cfg)
    assert "validation: 3 run(s) (every 2 steps + step 0 (trainer.val_before_train)) × 14 responses" in text
    assert "split over 2 ranks: ≤ 10 responses (≤ 80 tokens) on the busiest rank, in 3 engine call(s)" in text
    assert "≈ 5 s per validation, ≈ 15 s in all" in text
    one = est.train_cost(cfg, validation_problems=7, measured=measured)
    assert one.validation_samples_per_rank == 14 and one.validation_seconds == pytest.approx(7.0)  # 112 / 64 × 4
    # measured on 2 ranks: each generated 32 bound tokens in the 4 s → 80 per rank takes 10 s
    two = est.train_cost(cfg, ranks=2, validation_problems=7, measured=est.Measured(
        seconds_per_step=10.0, tokens_per_s=None, responses=8, response_length=8, rollout_seconds=4.0, ranks=2))
    assert two.validation_seconds == pytest.approx(10.0)
    off = est.format_train_cost(est.train_cost(_tiny(), validation_problems=7), _tiny())
    assert "validation: off (trainer.val_every=0, trainer.val_before_train=false)" in off
    # the cache records the rollout time and the ranks
    cache = tmp_path / "throughput.json"
    rows = [{"timing_s/step": 2.0, "timing_s/rollout": 1.0}, {"timing_s/step": 4.0, "timing_s/rollout": 3.0}]
    est.record_train_throughput(cfg, "cpu", rows, "runs/x", path=cache)
    m = est.lookup_train_throughput("tiny", "cpu", "float32", est.machine_key("cpu"), path=cache)
    assert (m.rollout_seconds, m.ranks) == (2.0, 1)


def test_train_flops_at_the_bound_by_hand():
    # a 1-wide, 1-layer model: layer matmul weights 1 (q) + 2 (k, v) + 1 (o) + 3 (MLP) = 7, LM head 1;
    # forward FLOPs = 2·7·positions + 4·keys + 2·logit rows (stapo/common/perf.py)
    shape = ModelShape(hidden=1, intermediate=1, layers=1, heads=1, kv_heads=1, head_dim=1, vocab_rows=1)
    cfg = _tiny("data.train_batch_size=1", "rollout.n=2", "rollout.response_length=2", "actor.ppo_micro_batch_size=2")
    c = est.train_cost(cfg, prompt_lengths=[1], size=est.ModelSize(params=8, shape=shape))
    # rollout: prefill 2 prompts of 1 token: 2 positions, 2 keys, 2 logit rows → 28 + 8 + 4 = 40;
    # decode 1 more token each after a 1-token prompt: 2 positions, 2·2 keys, 2 rows → 28 + 16 + 4 = 48
    # one row's trainer forward (P = 1, R = 2): 3 positions, 1 + 2 + 3 = 6 keys, 3 logit rows → 42 + 24 + 6 = 72;
    # plan: old pass 1 micro-batch of 2 rows (no grad), 1 update micro-batch of 2 rows (forward + 2× backward)
    assert (c.forwards, c.backwards) == (2, 1)
    assert c.flops_per_step == 40 + 48 + 72 * (2 + 3 * 2)  # = 664
    # actor.share_prompt: the group's prompt pass once (1 position, 1 key) + 2 rows × 1 response position attending
    # to 2 keys, 2·2 logit rows → 2·7·3 + 4·(1 + 4) + 2·4 = 70 for 2 rows: 35 a row
    shared = est.train_cost(_tiny("data.train_batch_size=1", "rollout.n=2", "rollout.response_length=2",
                                  "actor.ppo_micro_batch_size=2", "actor.share_prompt=true"),
                            prompt_lengths=[1], size=est.ModelSize(params=8, shape=shape))
    assert shared.flops_per_step == 40 + 48 + 35 * (2 + 3 * 2)


def test_checkpoint_steps():
    assert est.checkpoint_steps(0, 25, 10) == [10, 20, 25]
    assert est.checkpoint_steps(0, 3, 0) == [3]
    assert est.checkpoint_steps(20, 25, 10) == [25]


def test_model_size_of_the_tiny_model_by_hand():
    from stapo.model.models import EMBEDDED_ALIASES, load_tokenizer

    tok = load_tokenizer(EMBEDDED_ALIASES[0])
    size = est.model_size("tiny", tokenizer=tok)
    V = len(tok)  # 49,152 (SmolLM2)
    # per layer: q 64·64 + k, v 64·32 each + o 64·64 + MLP 3·64·128 + q/k norms 32 each + 2 layer norms 64 each
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 32 + 2 * 64  # = 37,056
    assert size.params == 2 * V * 64 + 2 * layer + 64  # untied embedding and LM head, 2 layers, final norm
    assert (size.shape.layers, size.shape.hidden, size.shape.vocab_rows) == (2, 64, V)


# --- throughput ----------------------------------------------------------------------------------------------
def test_time_from_an_earlier_runs_metrics_jsonl(tmp_path):
    run = tmp_path / "stapo_tiny_seed0"
    run.mkdir()
    saved = {"model": {"path": "tiny", "compute_dtype": "float32"}, "data": {"train_batch_size": 1},
             "rollout": {"n": 4, "response_length": 8}}  # measured at 4 responses × 8 tokens = 32
    (run / "config.json").write_text(json.dumps(saved))
    rows = [{"step": 1, "timing_s/step": 4.0, "perf/tokens_per_s": 5.0, "response_length/mean": 6.0},
            {"step": 2, "timing_s/step": 2.0, "perf/tokens_per_s": 9.0, "response_length/mean": 8.0},
            {"step": 3, "timing_s/step": 3.0, "perf/tokens_per_s": 7.0, "response_length/mean": 7.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = est.measured_from_runs(tmp_path, "tiny", "float32")
    assert (m.seconds_per_step, m.tokens_per_s, m.mean_response_tokens, m.steps) == (3.0, 7.0, 7.0, 3)  # medians
    assert str(run / "metrics.jsonl") in m.source and "not recorded" in m.source
    assert est.measured_from_runs(tmp_path, "tiny", "bfloat16") is None  # another compute dtype
    assert est.measured_from_runs(tmp_path, "embedded:smollm2", "float32") is None  # another model
    c = est.train_cost(_tiny(), measured=m)  # 8 responses × 8 tokens = 64 = 2 × the measured 32
    assert c.seconds_per_step == 6.0 and c.seconds_total == 12.0
    text = est.format_train_cost(c, _tiny())
    assert "≈ 6 s per step, ≈ 12 s for 2 step(s)" in text and "scaled by the generated-token bound" in text


def test_record_and_look_up_the_throughput_cache(tmp_path):
    cfg = _tiny()
    cache = tmp_path / "throughput.json"
    history = [{"timing_s/step": 1.0, "perf/tokens_per_s": 64.0}, {"timing_s/step": 3.0, "perf/tokens_per_s": 20.0}]
    assert est.record_train_throughput(cfg, "cpu", history, "runs/x", path=cache) == cache
    machine = est.machine_key("cpu")
    m = est.lookup_train_throughput("tiny", "cpu", "float32", machine, path=cache)
    assert (m.seconds_per_step, m.tokens_per_s, m.responses, m.response_length, m.steps) == (2.0, 42.0, 8, 8, 2)
    assert "this machine" in m.source and "runs/x" in m.source
    assert est.lookup_train_throughput("tiny", "cpu", "float32", machine + " (other)", path=cache) is None
    assert est.lookup_train_throughput("tiny", "cpu", "bfloat16", machine, path=cache) is None
    assert est.record_train_throughput(cfg, "cpu", [{"step": 1}], "runs/x", path=cache) is None  # no timings
    c = est.train_cost(cfg, measured=m)  # the same shape: the measured median itself
    assert c.seconds_per_step == 2.0
    assert "measured at this shape" in est.format_train_cost(c, cfg)


# --- evaluation: the numbers by hand ---------------------------------------------------------------------------
def test_eval_cost_by_hand(tmp_path):
    benchmarks = {"aime24": {"problems": 2, "N": 3}, "math500": {"problems": 2, "N": 2}}
    c = est.eval_cost(benchmarks, ["t1.0_p1.0", "t0.7_p0.9"], pending=20, max_new_tokens=8)
    assert (c.samples_per_setting, c.samples, c.tokens_bound) == (10, 20, 160)  # 2·3 + 2·2; × 2 settings; × 8
    assert c.seconds_bound is None and "time: unknown" in est.format_eval_cost(c)
    # a sweep: 3 checkpoints still to evaluate, each 10 samples × 2 settings = 60; 50 not stored yet
    c3 = est.eval_cost(benchmarks, ["t1.0_p1.0", "t0.7_p0.9"], pending=50, max_new_tokens=8, checkpoints=3)
    assert (c3.samples_per_setting, c3.samples, c3.tokens_bound) == (10, 60, 400)  # 50 × 8
    text = est.format_eval_cost(c3)
    assert text.startswith("cost estimate (per checkpoint):")
    assert "× 2 setting(s) (t1.0_p1.0, t0.7_p0.9) × 3 checkpoint(s) = 60; to generate: 50" in text
    out = tmp_path / "earlier"
    out.mkdir()
    results = {"model": {"path": "/m", "dtype": "float32"}, "protocol": {"engine": {"backend": "hf"},
               "max_new_tokens": 8}, "run": {"tokens_per_s": 10.0, "generated": 20},
               "metrics": {"a": {"average": {"mean_response_tokens": 3.0, "samples": 10}},
                           "b": {"average": {"mean_response_tokens": 5.0, "samples": 10}}}}
    (out / "results.json").write_text(json.dumps(results))
    m = est.measured_from_evaluations(tmp_path, "/m", "hf", "float32")
    assert (m.tokens_per_s, m.mean_response_tokens) == (10.0, 4.0)  # (3·10 + 5·10) / 20
    assert est.measured_from_evaluations(tmp_path, "/m", "vllm", "float32") is None
    # a sweep's checkpoint (<root>/<sweep>/step_XXXXXX/results.json), looked up among several model paths
    (out / "results.json").rename(tmp_path / "x.json")
    (tmp_path / "sweep" / "step_000001").mkdir(parents=True)
    (tmp_path / "x.json").rename(tmp_path / "sweep" / "step_000001" / "results.json")
    assert est.measured_from_evaluations(tmp_path, ["/other", "/m"], "hf", "float32").tokens_per_s == 10.0
    assert est.measured_from_evaluations(tmp_path, ["/other"], "hf", "float32") is None
    c = est.eval_cost(benchmarks, ["t1.0_p1.0", "t0.7_p0.9"], pending=20, max_new_tokens=8, measured=m)
    assert c.seconds_bound == 16.0  # 160 tokens / 10 per s
    assert c.seconds_expected == 8.0  # 20 samples × 4 tokens / 10 per s


# --- the CLIs ----------------------------------------------------------------------------------------------------
def _yaml_part(out: str):
    from omegaconf import OmegaConf

    lines = out.splitlines()
    # the YAML between the header line and the first plain line (train: "run directory: ...", eval: "model: x (...")
    end = next(i for i, line in enumerate(lines) if line.startswith(("run directory: ", "model: ")))
    return OmegaConf.create("\n".join(lines[1:end]))


def test_train_py_dry_run_prints_the_resolved_config_and_cost_and_creates_nothing(tmp_path, shared_data_root,
                                                                                  monkeypatch, capsys):
    from stapo.model.precision import resolve_compute_dtype

    def must_not_run(*args, **kwargs):
        raise AssertionError("--dry-run loaded a model or started an engine")

    monkeypatch.setattr("stapo.train.trainer.Trainer._load_initial_model", must_not_run)
    monkeypatch.setattr("stapo.rollout.build_rollout_engine", must_not_run)
    monkeypatch.setattr("stapo.train.trainer.build_rollout_engine", must_not_run)  # the trainer's own name
    cache = tmp_path / "cache" / "throughput.json"
    monkeypatch.setenv("STAPO_THROUGHPUT_CACHE", str(cache))
    runs = tmp_path / "runs"
    argv = ["--config", TINY, f"data.root={shared_data_root}", f"trainer.output_dir={runs}",
            "model.compute_dtype=auto", "--dry-run"]
    assert _cli("train", monkeypatch).main(argv) == 0
    out = capsys.readouterr().out
    printed = _yaml_part(out)
    assert printed.model.compute_dtype == resolve_compute_dtype("auto", "cpu") != "auto"
    assert printed.trainer.output_dir == str(runs)
    assert f"run directory: {runs / 'stapo_tiny_seed0'} (not created by --dry-run)" in out
    assert "generated tokens ≤ (× 8)" in out and " 64  128" in out  # per step, total
    assert "time: unknown" in out
    assert not runs.exists() and not cache.exists()  # nothing created (the run folder, the cache)

    # a cached measurement of this machine: the time line names it
    cfg = _tiny(f"data.root={shared_data_root}", f"model.compute_dtype={printed.model.compute_dtype}")
    est.record_train_throughput(cfg, "cpu", [{"timing_s/step": 5.0}], "runs/earlier")
    assert _cli("train", monkeypatch).main(argv) == 0
    out = capsys.readouterr().out
    assert "time: ≈ 5 s per step, ≈ 10 s for 2 step(s)" in out and str(cache) in out


def test_train_py_dry_run_keeps_the_errors_of_a_real_run(tmp_path, shared_data_root, monkeypatch, capsys):
    train = _cli("train", monkeypatch)
    assert train.main(["--config", TINY, "rollout.n=1", "--dry-run"]) == 2  # the config check
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: invalid value for 'rollout.n' (1)")
    # a check of the trainer's start-up (before the model): --resume with no checkpoint in the run folder
    assert train.main(["--config", TINY, f"data.root={shared_data_root}", f"trainer.output_dir={tmp_path}",
                       "--resume", "--dry-run"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: --resume:") and "holds no checkpoint" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_overrides_on_both_sides_of_a_flag(monkeypatch, capsys):
    # overrides on both sides of a flag (`train.py --config X key=v --resume key=v`) once failed with "unrecognized
    # arguments": argparse fills a nargs="*" positional from its first run of values only
    train = _cli("train", monkeypatch)
    assert train.main(["--config", TINY, "rollout.n=3", "--dry-run", "rollout.n=1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: invalid value for 'rollout.n' (1)")
    evaluate = _cli("evaluate", monkeypatch)
    assert evaluate.main(["--config", str(REPO / "configs" / "eval" / "tiny_test.yaml"), "data.limit=2", "--dry-run",
                          "data.limit=0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "data.limit" in err[0]


def test_evaluate_py_dry_run_counts_problems_samples_and_what_is_stored(tmp_path, shared_data_root, monkeypatch,
                                                                        capsys):
    from stapo.evaluation.runner import load_problems

    def must_not_run(*args, **kwargs):
        raise AssertionError("--dry-run loaded a model or started an engine")

    monkeypatch.setattr("stapo.evaluation.runner._load_model", must_not_run)
    monkeypatch.setattr("stapo.evaluation.runner._build_engine", must_not_run)
    out_dir = tmp_path / "eval"
    argv = ["--config", TINY_EVAL, "--data-root", str(shared_data_root), "--output", str(out_dir), "--dry-run"]
    evaluate = _cli("evaluate", monkeypatch)
    assert evaluate.main(argv) == 0
    out = capsys.readouterr().out
    assert _yaml_part(out).data.root == str(shared_data_root)
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines() if line.startswith("  aime24")
            or line.startswith("  math500")}
    assert rows == {"aime24": ["2", "3", "6"], "math500": ["2", "2", "4"]}  # problems (--limit 2), N, problems × N
    # 6 + 4 = 10 per setting, 2 settings; ≤ 20 × 8 new tokens
    assert "samples: 10 per setting (avg@N) × 2 setting(s) (t1.0_p1.0, t0.7_p0.9) = 20; to generate: 20" in out
    assert "generated tokens ≤ 160 (20 × 8 max new tokens)" in out
    assert not out_dir.exists()

    # the first AIME24 problem complete under the first setting (3 samples), then a torn line: 20 − 3 = 17 to go,
    # and the file is left as it is
    pid = load_problems(shared_data_root, ["aime24"], 1)["aime24"][0].id
    store = out_dir / "generations" / "aime24__t1.0_p1.0.jsonl"
    store.parent.mkdir(parents=True)
    store.write_text("".join(json.dumps({"problem_id": pid, "sample": i}) + "\n" for i in range(3)) + '{"probl')
    before = store.read_bytes()
    assert evaluate.main(argv) == 0
    out = capsys.readouterr().out
    assert "to generate: 17 (the rest are stored: a rerun resumes)" in out
    assert "generated tokens ≤ 136 (17 × 8 max new tokens)" in out
    assert store.read_bytes() == before and sorted(p.name for p in out_dir.iterdir()) == ["generations"]


def test_evaluate_py_dry_run_keeps_the_errors_of_a_real_run(tmp_path, monkeypatch, capsys):
    argv = ["--config", TINY_EVAL, "--benchmarks", "aime2O", "--output", str(tmp_path / "e"), "--dry-run"]
    assert _cli("evaluate", monkeypatch).main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "unknown benchmark 'aime2O'" in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a real 2-step run (~20 s alone, minutes on a busy machine); the cache's record and lookup are
# covered fast by test_record_and_look_up_the_throughput_cache and the dry-run CLI test
def test_a_finished_run_records_its_step_time_for_the_next_dry_run(tmp_path, shared_data_root, monkeypatch, capsys):
    cache = tmp_path / "throughput.json"
    monkeypatch.setenv("STAPO_THROUGHPUT_CACHE", str(cache))
    argv = ["--config", TINY, f"data.root={shared_data_root}", f"trainer.output_dir={tmp_path / 'runs'}",
            "trainer.save_every=0"]
    train = _cli("train", monkeypatch)
    assert train.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "stapo_tiny_seed0" / "metrics.jsonl").open()]
    entry = next(iter(json.loads(cache.read_text())["train"].values()))
    # the median of the 2 steps' timing_s/step, at 2 prompts × G = 4 responses × 8 tokens
    assert entry["seconds_per_step"] == pytest.approx((rows[0]["timing_s/step"] + rows[1]["timing_s/step"]) / 2)
    assert (entry["responses_per_step"], entry["response_length"], entry["steps"]) == (8, 8, 2)
    capsys.readouterr()
    assert train.main([*argv, "trainer.run_name=next", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "measured at this shape" in out and str(cache) in out and "(this machine;" in out
