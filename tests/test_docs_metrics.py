"""Every metric key the trainer writes is documented in docs/metrics.md.

One tiny training step of ``stapo`` (toy reward: varied groups, S2T statistics) and one of ``grpo`` (the real
strict-box reward: ``reward/*`` counts, ``actor/kl_loss``) on the tiny model; the keys of each ``metrics.jsonl``
must match a key documented in docs/metrics.md. The validation keys (``val/*``) come from the hook's flattening
of a hand-made evaluation summary (no generation). A documented key may hold placeholders in angle brackets
(``val/<setting>/<benchmark>/avg@N``), matched as one path segment.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "metrics.md"


def documented_patterns() -> list[re.Pattern]:
    """Every code span of docs/metrics.md that looks like a metric key, as a full-match pattern."""
    spans = re.findall(r"`([^`\s]+)`", DOC.read_text())
    keys = {s for s in spans if "/" in s or s in ("step", "frac_reward_zero_std")}
    pats = []
    for key in keys:
        parts = re.split(r"(<[^<>/]+>)", key)
        pats.append(re.compile("".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts)))
    return pats


def undocumented(keys) -> list[str]:
    pats = documented_patterns()
    return sorted(k for k in keys if not any(p.fullmatch(k) for p in pats))


def _keys_of(path: Path) -> set[str]:
    keys: set[str] = set()
    for line in path.read_text().splitlines():
        if line:
            keys |= set(json.loads(line))
    return keys


@pytest.mark.parametrize("objective, toy", [("stapo", True), ("grpo", False)])
def test_every_trainer_metric_is_documented(tmp_path, objective, toy):
    trainer = make_trainer(str(tmp_path), [f"algorithm.objective={objective}", "trainer.total_steps=1",
                                           "trainer.save_every=0"])
    if not toy:  # the configured reward (strict box): reward/* counts are logged
        from stapo.rewards import make_reward_fn

        trainer.reward_fn = make_reward_fn(trainer.cfg.algorithm.reward)
    try:
        trainer.train()
    finally:
        trainer.close()
    keys = _keys_of(tmp_path / "toy" / "metrics.jsonl")
    expected = {"stapo": "s2t/num_candidates", "grpo": "reward/n"}[objective]
    assert expected in keys and "s2t/quadrant/low_p_low_h/share" in keys
    assert undocumented(keys) == [], f"add these keys to {DOC.relative_to(REPO)}"


def test_every_validation_metric_is_documented():
    from stapo.evaluation.metrics import summarize_benchmark
    from stapo.evaluation.validation import ValidationHook

    sample = {"correct": True, "extracted": "1", "status": "correct", "response_tokens": 3, "finish_reason": "eos"}
    summary = summarize_benchmark([[sample, dict(sample, correct=False, status="incorrect")]], 2)
    hook = ValidationHook(benchmarks=["math500"], limit=1, samples=2)
    hook._dropped = {"math500": 0}
    flat = hook._flatten({"t1.0_p1.0": {"benchmarks": {"math500": summary}, "average": summary}})
    assert "val/t1.0_p1.0/math500/avg@N" in flat and "val/math500/dropped_long_prompt" in flat
    assert undocumented(flat) == [], f"add these keys to {DOC.relative_to(REPO)}"


def test_the_pattern_matcher_rejects_unknown_keys():
    assert undocumented(["s2t/num_masked", "val/t0.7_p0.9/aime24/maj@N", "s2t/quadrant/low_p_low_h/count"]) == []
    assert undocumented(["s2t/not_a_metric", "val/a/b/c/avg@N"]) == ["s2t/not_a_metric", "val/a/b/c/avg@N"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("loss_mode", ["stapo", "entropy20", "stapo_high_entropy", "stapo_random", "justrl_fullmask"])
def test_every_verl_plugin_metric_is_documented(loss_mode):
    """The metrics the registered verl losses return (verl optional; its import is shared with test_verl_plugin)."""
    pytest.importorskip("verl", reason="verl is not installed")
    pytest.importorskip("ray", reason="verl needs ray to import")
    import torch

    import stapo.integrations.verl as plugin
    from test_verl_plugin import _actor_config

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 6, dtype=torch.bool)
    logp = torch.log(torch.rand(4, 6, generator=g) * 0.004 + 1e-5)  # p < τ_p: S2T candidates in the Â > 0 rows
    old = logp + 0.01 * torch.randn(4, 6, generator=g)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])[:, None].expand(4, 6)
    fn = plugin.PLUGIN_LOSS_FNS[loss_mode]
    with plugin.mask_context(entropy=torch.rand(4, 6, generator=g)):
        _, metrics = fn(old, logp, adv, mask, "token-mean", _actor_config(loss_mode))
    assert f"actor/{loss_mode}/num_kept_tokens" in metrics
    assert undocumented(metrics) == [], f"add these keys to {DOC.relative_to(REPO)}"
