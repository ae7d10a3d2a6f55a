"""One W&B line per method (issue 33, item 1), checked against the run files: three tiny training runs of one
config family — STAPO seeds 0 and 1, GRPO seed 0 — logged offline. The two STAPO seeds share a W&B group, GRPO has
its own (W&B's grouped view: one line per group, the seeds aggregated inside it), in the recorded identity
(config.json) and in the offline W&B files that `wandb sync` uploads."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _train(out: Path, name: str, *overrides: str) -> Path:
    from toy_run import toy_reward

    from stapo.config import load_config
    from stapo.run.provenance import apply_identity
    from stapo.train import Trainer

    config = "configs/tiny_test.yaml"
    cfg = load_config(REPO / config, [f"trainer.output_dir={out}", f"trainer.run_name={name}", "trainer.total_steps=1",
                                      "logging.wandb_mode=offline", "logging.system_metrics=false", *overrides])
    apply_identity(cfg, config)  # what train.py does with --config before the trainer starts
    trainer = Trainer(cfg, reward_fn=toy_reward)
    try:
        trainer.train()
    finally:
        trainer.close()
    return out / name


def test_two_methods_are_two_groups_and_two_seeds_of_one_method_share_one(tmp_path, monkeypatch):
    from test_eval_sweep import offline_records

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    runs = {"stapo_seed0": _train(tmp_path, "stapo_seed0", "trainer.seed=0"),
            "stapo_seed1": _train(tmp_path, "stapo_seed1", "trainer.seed=1"),
            "grpo_seed0": _train(tmp_path, "grpo_seed0", "trainer.seed=0", "algorithm.objective=grpo",
                                 "trainer.peak_flops=1e12")}
    recorded = {n: json.loads((d / "config.json").read_text())["logging"] for n, d in runs.items()}
    in_wandb = {}
    for n, d in runs.items():
        (run,) = [r.run for r in offline_records(d) if r.WhichOneof("record_type") == "run"]
        in_wandb[n] = (run.run_group, list(run.tags), run.job_type)
    # configs/tiny_test.yaml: family tiny_test; the method is the objective
    assert {n: r["group"] for n, r in recorded.items()} == {
        "stapo_seed0": "tiny_test-stapo", "stapo_seed1": "tiny_test-stapo", "grpo_seed0": "tiny_test-grpo"}
    assert in_wandb == {
        "stapo_seed0": ("tiny_test-stapo", ["stapo", "tiny", "strict_box", "family:tiny_test"], "train"),
        "stapo_seed1": ("tiny_test-stapo", ["stapo", "tiny", "strict_box", "family:tiny_test"], "train"),
        "grpo_seed0": ("tiny_test-grpo", ["grpo", "tiny", "strict_box", "family:tiny_test"], "train")}
    assert {(r["family"], r["method"], r["study"]) for r in recorded.values()} == {
        ("tiny_test", "stapo", None), ("tiny_test", "grpo", None)}
    # grouping the runs table by Group: two lines (methods), the STAPO line holds both seeds
    lines: dict[str, list[str]] = {}
    for n, (group, _, _) in in_wandb.items():
        lines.setdefault(group, []).append(n)
    assert lines == {"tiny_test-stapo": ["stapo_seed0", "stapo_seed1"], "tiny_test-grpo": ["grpo_seed0"]}

    # the same runs' utilisation metrics: peak memory always (CPU: the process's peak RSS, > 0 GiB); the MFU only
    # where the peak FLOP/s is known (trainer.peak_flops on the GRPO run; a CPU is in no table)
    rows = {n: json.loads((d / "metrics.jsonl").read_text().splitlines()[-1]) for n, d in runs.items()}
    assert all(r["perf/max_memory_allocated_gb"] > 0 for r in rows.values())
    assert "perf/mfu/actor" not in rows["stapo_seed0"]
    assert 0 < rows["grpo_seed0"]["perf/mfu/actor"] < 1
