"""Every metric key the trainer and the verl plugin write is documented in docs/metrics.md, in ONE vocabulary.

One tiny training step of ``stapo`` (toy reward: varied groups, S2T statistics) and one of ``grpo`` (the real
strict-box reward: ``reward/*`` counts, ``actor/kl_loss``) on the tiny model; the keys of each ``metrics.jsonl``
must match a key documented in docs/metrics.md. The validation keys come from the hook's flattening of a
hand-made evaluation summary (no generation). A documented key may hold placeholders in angle brackets
(``val-core/<benchmark>/acc/mean@<N>``), matched as one path segment (or the part of one).

The vocabulary tests (verl optional) compare what the native trainer logs with what a verl run logs: the
plugin's loss on small tensors (after verl's own ``actor/`` prefixing) and verl's own validation metrics on the
same graded samples as the native validation hook. The keys only one side can produce are listed explicitly.
"""
from __future__ import annotations

import json
import re
import shutil
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


def _train_one_step(out: Path, objective: str, toy: bool) -> set[str]:
    trainer = make_trainer(str(out), [f"algorithm.objective={objective}", "trainer.total_steps=1",
                                      "trainer.save_every=0"])
    if not toy:  # the configured reward (strict box): reward/* counts are logged
        from stapo.tasks.rewards import make_reward_fn

        trainer.reward_fn = make_reward_fn(trainer.cfg.algorithm.reward)
    try:
        trainer.train()
    finally:
        trainer.close()
    return _keys_of(out / "toy" / "metrics.jsonl")


@pytest.fixture(scope="module")
def stapo_step_keys(tmp_path_factory) -> set[str]:
    """The keys of one native ``stapo`` step (toy reward), shared by the tests of this module."""
    out = tmp_path_factory.mktemp("stapo_step")
    keys = _train_one_step(out, "stapo", toy=True)
    shutil.rmtree(out, ignore_errors=True)  # only the keys are kept: free the run's checkpoint now
    return keys


def test_every_trainer_metric_is_documented_stapo(stapo_step_keys):
    keys = stapo_step_keys
    assert "actor/s2t/num_candidates" in keys and "s2t/quadrant/low_p_low_h/share" in keys
    assert not any(k.startswith("s2t/num_") for k in keys)  # the mask statistics are under actor/ only
    assert undocumented(keys) == [], f"add these keys to {DOC.relative_to(REPO)}"


def test_every_trainer_metric_is_documented_grpo(tmp_path):
    keys = _train_one_step(tmp_path, "grpo", toy=False)
    assert "reward/n" in keys and "actor/kl_loss" in keys and "s2t/quadrant/low_p_low_h/share" in keys
    assert undocumented(keys) == [], f"add these keys to {DOC.relative_to(REPO)}"


def _summary_and_samples():
    """Two MATH500 problems × N = 4 graded samples: problem a has 1 correct (answers 1, 2, 2, 3; the majority 2 is
    wrong), problem b 3 correct (5, 5, 5, 7; majority 5 right) → avg@4 = (1/4 + 3/4) / 2 = 0.5, pass@4 = 1,
    maj@4 = (0 + 1) / 2 = 0.5."""
    from stapo.evaluation.metrics import summarize_benchmark

    def sample(ans, ok):
        return {"correct": ok, "extracted": ans, "status": "correct" if ok else "incorrect", "response_tokens": 3,
                "finish_reason": "eos"}

    problems = [[sample("1", True), sample("2", False), sample("2", False), sample("3", False)],
                [sample("5", True), sample("5", True), sample("5", True), sample("7", False)]]
    return summarize_benchmark(problems, 4), problems


def _native_validation_keys(summary) -> dict[str, float]:
    from stapo.evaluation.validation import ValidationHook

    hook = ValidationHook(benchmarks=["math500"], limit=2, samples=4)
    hook._dropped = {"math500": 0}
    return hook._flatten({"t1.0_p1.0": {"benchmarks": {"math500": summary}, "average": summary}})


def test_every_validation_metric_is_documented():
    summary, _ = _summary_and_samples()
    flat = _native_validation_keys(summary)
    assert flat["val-core/math500/acc/mean@4"] == pytest.approx(0.5)  # avg@N, worked out in _summary_and_samples
    assert flat["val-core/math500/acc/pass@4"] == 1.0 and flat["val-core/math500/acc/maj@4"] == 0.5
    assert flat["val-core/average/acc/mean@4"] == pytest.approx(0.5)
    assert flat["val-aux/math500/dropped_long_prompt"] == 0.0 and flat["val-aux/response_length/mean"] == 3.0
    assert undocumented(flat) == [], f"add these keys to {DOC.relative_to(REPO)}"


def test_several_validation_settings_tag_the_source():
    from stapo.evaluation.validation import ValidationHook

    summary, _ = _summary_and_samples()
    hook = ValidationHook(benchmarks=["math500"], limit=2, samples=4)
    m = {"benchmarks": {"math500": summary}, "average": summary}
    flat = hook._flatten({"t1.0_p1.0": m, "t0.7_p0.9": m})
    assert {"val-core/math500@t1.0_p1.0/acc/mean@4", "val-core/math500@t0.7_p0.9/acc/mean@4",
            "val-aux/grader@t0.7_p0.9/timeouts", "val-core/average@t1.0_p1.0/acc/mean@4"} <= set(flat)
    assert undocumented(flat) == []


def test_the_pattern_matcher_rejects_unknown_keys():
    assert undocumented(["actor/s2t/num_masked", "val-core/aime24/acc/mean@32", "s2t/quadrant/low_p_low_h/count",
                         "val-core/aime24@t0.7_p0.9/acc/maj@8"]) == []
    assert undocumented(["actor/s2t/not_a_metric", "val-core/a/b/c/mean@4", "s2t/num_masked"]) == [
        "actor/s2t/not_a_metric", "s2t/num_masked", "val-core/a/b/c/mean@4"]


def test_legacy_names_map_old_runs_to_the_vocabulary():
    from stapo.core.metric_names import LEGACY_NAMES, current_name, rename_legacy

    assert current_name("s2t/masked_frac") == "actor/s2t/masked_frac"
    assert current_name("top_entropy/kept_frac") == "actor/top_entropy/kept_frac"
    assert current_name("actor/stapo/num_kept_tokens") == "actor/num_kept_tokens"
    assert current_name("val/t1.0_p1.0/math500/avg@N", 4) == "val-core/math500/acc/mean@4"
    assert current_name("val/t1.0_p1.0/math500/avg@N") == "val-core/math500/acc/mean@N"  # N unknown: kept literal
    assert current_name("val/math500/dropped_long_prompt") == "val-aux/math500/dropped_long_prompt"
    assert current_name("s2t/quadrant/low_p_low_h/share") == "s2t/quadrant/low_p_low_h/share"  # not renamed
    assert current_name("actor/s2t/masked_frac") == "actor/s2t/masked_frac"  # already current
    # every new name is documented, and a reference row of results/reference/ reads in the new vocabulary
    assert undocumented(set(LEGACY_NAMES.values())) == []
    row = json.loads((REPO / "results/reference/cpu_smollm2_stapo_seed0_metrics.jsonl").read_text().splitlines()[0])
    new = rename_legacy(row)
    assert new["actor/s2t/num_masked"] == row["s2t/num_masked"] == 9.0 and "s2t/num_masked" not in new
    assert rename_legacy(new) == new
    with pytest.raises(ValueError, match="actor/s2t/num_masked"):
        rename_legacy({"s2t/num_masked": 1.0, "actor/s2t/num_masked": 1.0})


# --- the verl side (verl optional) ------------------------------------------------------------------------
#: actor/* keys verl itself logs around a plugin loss (ppo_loss: pg_loss; the driver: the old policy's entropy;
#: the engine: grad_norm, lr), i.e. the native keys of the same name come from verl in a cluster run.
VERL_OWN_ACTOR_KEYS = {"actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/lr"}
#: actor/* keys only the native trainer logs (verl has no counterpart): skipped non-finite gradient steps.
NATIVE_ONLY_ACTOR_KEYS = {"actor/nonfinite_grad_steps"}


def _plugin_metrics(loss_mode: str) -> dict[str, float]:
    """The plugin loss's metrics on a small batch, with verl's own ``actor/`` prefixing (ray_trainer._update_actor)."""
    import torch
    from verl.utils.py_functional import rename_dict

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
    return rename_dict(metrics, "actor/")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("loss_mode", ["stapo", "entropy20", "stapo_high_entropy", "stapo_random", "justrl_fullmask"])
def test_every_verl_plugin_metric_is_documented(loss_mode):
    """The metrics the registered verl losses return (verl optional; its import is shared with test_verl_plugin)."""
    pytest.importorskip("verl", reason="verl is not installed")
    pytest.importorskip("ray", reason="verl needs ray to import")
    metrics = _plugin_metrics(loss_mode)
    assert "actor/num_kept_tokens" in metrics
    assert undocumented(metrics) == [], f"add these keys to {DOC.relative_to(REPO)}"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_native_and_verl_runs_share_the_actor_keys(stapo_step_keys):
    """The native stapo step's actor/* keys are exactly the plugin's plus verl's own, modulo the listed one-sided keys
    (``actor/s2t/entropy_threshold`` and the silenced-token means are present on both sides here: the small batch
    has candidates and silenced tokens)."""
    pytest.importorskip("verl", reason="verl is not installed")
    pytest.importorskip("ray", reason="verl needs ray to import")
    native = {k for k in stapo_step_keys if k.startswith("actor/")}
    verl_run = set(_plugin_metrics("stapo")) | VERL_OWN_ACTOR_KEYS
    assert native - NATIVE_ONLY_ACTOR_KEYS == verl_run - NATIVE_ONLY_ACTOR_KEYS, (
        sorted(native ^ verl_run))
    assert {"actor/s2t/num_masked", "actor/s2t/masked_frac", "actor/num_kept_tokens"} <= native & verl_run


def _verl_val_metrics(data_sources, uids, infos) -> dict[str, float]:
    """verl's validation metrics: ``process_validation_metrics`` (verl/trainer/ppo/metric_utils.py) and the key
    layout of ``RayPPOTrainer._val_metrics_update`` (verl/trainer/ppo/ray_trainer.py, verl 0.9.1; copied here
    because ray_trainer imports torchdata, which the check environment lacks)."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    out = {}
    for source, var2metric2val in process_validation_metrics(data_sources, uids, infos).items():
        core_var = "acc" if "acc" in var2metric2val else "reward"
        for var_name, metric2val in var2metric2val.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric2val)
            for metric_name, val in metric2val.items():
                core = (var_name == core_var and any(metric_name.startswith(p) for p in ("mean", "maj", "best"))
                        and f"@{n_max}" in metric_name)
                out[f"{'val-core' if core else 'val-aux'}/{source}/{var_name}/{metric_name}"] = val
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_native_validation_shares_verls_core_key_and_value():
    """verl's own validation metrics on the samples of :func:`_summary_and_samples`, with our reward's columns
    (score, acc, pred): the native hook logs ``val-core/math500/acc/mean@4`` with the same value; verl's bootstrap
    keys (``best@4/mean``, ``maj@4/mean``) and our exact ones (``pass@4``, ``maj@4``) are the one-sided keys."""
    pytest.importorskip("verl", reason="verl is not installed")
    import numpy as np

    summary, problems = _summary_and_samples()
    sources, uids, infos = [], [], {"reward": [], "score": [], "acc": [], "pred": []}
    for i, samples in enumerate(problems):
        for s in samples:
            sources.append("math500")
            uids.append(f"p{i}")
            infos["reward"].append(1.0 if s["correct"] else -1.0)
            infos["score"].append(1.0 if s["correct"] else -1.0)
            infos["acc"].append(1.0 if s["correct"] else 0.0)
            infos["pred"].append(s["extracted"])
    verl_metrics = _verl_val_metrics(np.array(sources, dtype=object), uids, infos)
    native = _native_validation_keys(summary)
    verl_core = {k for k in verl_metrics if k.startswith("val-core/")}
    native_core = {k for k in native if k.startswith("val-core/")}
    assert verl_core == {"val-core/math500/acc/mean@4", "val-core/math500/acc/best@4/mean",
                         "val-core/math500/acc/best@4/std", "val-core/math500/acc/maj@4/mean",
                         "val-core/math500/acc/maj@4/std"}
    assert native_core - verl_core == {"val-core/math500/acc/pass@4", "val-core/math500/acc/maj@4",
                                       "val-core/average/acc/mean@4"}  # exact estimators; the benchmark average
    assert native_core & verl_core == {"val-core/math500/acc/mean@4"}
    assert native["val-core/math500/acc/mean@4"] == pytest.approx(float(verl_metrics["val-core/math500/acc/mean@4"]))
    assert undocumented(verl_core | {k for k in verl_metrics if k.startswith("val-aux/math500/acc/")}) == []
