"""scripts/wandb_workspace.py (issue 33, item 2): the saved workspace's layout, built offline.

The layout is a plain dict (``workspace_spec``, pure); the W&B objects (``wandb-workspaces``) are built from it
without a network; only ``.save()`` (not called here) talks to W&B.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec_ = importlib.util.spec_from_file_location("wandb_workspace", REPO / "scripts" / "wandb_workspace.py")
ww = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(ww)


def _panels(spec: dict) -> dict[str, dict]:
    return {p["title"]: p for s in spec["sections"] for p in s["panels"]}


def test_the_spec_lays_out_the_comparison_panels_against_the_training_step_grouped_by_method():
    spec = ww.workspace_spec("me", "stapo", ["aime24", "math500"], filter_tag="family:cpu_smollm2")
    assert (spec["entity"], spec["project"], spec["x_axis"], spec["groupby"], spec["filter_tag"]) == (
        "me", "stapo", "training/global_step", "Group", "family:cpu_smollm2")
    assert [s["name"] for s in spec["sections"]] == ["Training", "Accuracy", "Utilisation"]
    panels = list(_panels(spec).values())
    # 6 training + (2 benchmarks + average) x 2 accuracy + 4 utilisation panels
    assert len(panels) == 6 + 3 * 2 + 4
    assert all(p["x"] == "training/global_step" and p["groupby"] == "Group" for p in panels)
    keys = {k for p in panels for k in p["y"]}
    assert {"critic/score/mean", "actor/entropy", "s2t/would_mask/masked_frac",
            "response_length/mean", "perf/max_memory_allocated_gb", "perf/mfu/actor"} <= keys
    # every plain key of a training panel is a documented metric (docs/metrics.md)
    from test_docs_metrics import undocumented

    assert undocumented(keys) == []


def test_the_accuracy_panels_match_validation_and_evaluation_keys_of_their_benchmark_only():
    from stapo.evaluation.validation import validation_metrics

    stats = {"N": 4, "avg@N": 0.5, "pass@N": 1.0, "maj@N": 0.5}
    avg = {"avg@N": 0.5, "samples": 8, "mean_response_tokens": 9.0, "truncation_rate": 0.0,
           "grader": {"no_answer": 0, "timeout": 0, "error": 0}}
    one = validation_metrics({"t1.0_p1.0": {"benchmarks": {"aime24": stats, "aime25": stats}, "average": avg}})
    two = validation_metrics({s: {"benchmarks": {"aime24": {**stats, "N": 32}}, "average": avg}
                              for s in ("t1.0_p1.0", "t0.7_p0.9")})
    pat = re.compile(ww.accuracy_regex("aime24"))
    # in-training validation (one setting, N = 4) and the paper protocol's evaluation (two settings, N = 32)
    assert sorted(k for k in [*one, *two] if pat.match(k)) == [
        "val-core/aime24/acc/mean@4", "val-core/aime24@t0.7_p0.9/acc/mean@32", "val-core/aime24@t1.0_p1.0/acc/mean@32"]
    assert re.match(ww.accuracy_regex("average"), "val-core/average/acc/mean@4")
    assert re.match(ww.eval_regex("aime24"), "eval/t1.0_p1.0/aime24/avg@N")
    assert not re.match(ww.eval_regex("aime24"), "eval/t1.0_p1.0/aime25/avg@N")
    spec = ww.workspace_spec("me", "stapo", ["aime24"])
    acc = _panels(spec)["aime24: validation and evaluation accuracy (mean@N)"]
    assert (acc["y"], acc["metric_regex"]) == ([], ww.accuracy_regex("aime24"))


def test_the_spec_refuses_an_empty_project_or_no_benchmark():
    with pytest.raises(ValueError, match="entity and project"):
        ww.workspace_spec("me", "", ["aime24"])
    with pytest.raises(ValueError, match="no benchmark"):
        ww.workspace_spec("me", "stapo", [])


def test_the_wandb_workspace_objects_are_built_offline_from_the_spec():
    pytest.importorskip("wandb_workspaces")
    spec = ww.workspace_spec("me", "stapo", ["aime24"], filter_tag="study:s1")
    workspace = ww.to_workspace(spec)
    assert (workspace.entity, workspace.project, workspace.name) == ("me", "stapo", spec["name"])
    assert workspace.settings.x_axis == "training/global_step"
    assert [g.name for g in workspace.runset_settings.groupby] == ["Group"]
    assert [s.name for s in workspace.sections] == ["Training", "Accuracy", "Utilisation"]
    reward = workspace.sections[0].panels[0]
    assert (reward.x, reward.y, reward.groupby_aggfunc, reward.groupby_rangefunc) == (
        "training/global_step", ["critic/score/mean"], "mean", "minmax")
    assert workspace.sections[1].panels[0].metric_regex == ww.accuracy_regex("aime24")
    workspace._to_model()  # W&B's saved form, still offline


def test_print_spec_needs_no_network():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "wandb_workspace.py"), "--entity", "me",
                          "--project", "stapo", "--benchmarks", "aime24", "--print-spec"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ww.workspace_spec("me", "stapo", ["aime24"])
    # no entity: the offline modes write a placeholder; saving refuses in one line (argparse's usage + error)
    assert ww.main(["--project", "stapo", "--benchmarks", "aime24", "--print-spec"]) == 0
    with pytest.raises(SystemExit) as exit_:
        ww.main(["--project", "stapo"])
    assert exit_.value.code == 2


def test_the_mask_panels_draw_every_mask_on_a_linear_scale():
    """S2T silences about 0.01 % of the tokens (none at most steps: a log axis would drop those zeros) and 20-Entropy
    keeps 20 %: one linear panel for every mask's masked fraction, one for the kept fraction."""
    panels = _panels(ww.workspace_spec("me", "stapo", ["aime24"])).values()
    masked = next(p for p in panels if p["metric_regex"] == ww.MASKED_FRAC_REGEX)
    kept = next(p for p in panels if p["metric_regex"] == ww.KEPT_FRAC_REGEX)
    assert masked["log_y"] is False and kept["log_y"] is False and masked["y"] == kept["y"] == []
    pat, keep = re.compile(masked["metric_regex"]), re.compile(kept["metric_regex"])
    for key in ("actor/s2t/masked_frac", "actor/s2t_random/masked_frac", "actor/full_low_prob/masked_frac"):
        assert pat.match(key) and not keep.match(key), key
    assert keep.match("actor/top_entropy/kept_frac") and not pat.match("actor/top_entropy/kept_frac")
    assert not pat.match("s2t/would_mask/masked_frac") and not pat.match("actor/s2t/num_masked")
