"""W&B identity (group / tags / job_type defaults) and run provenance (run_info.json); the offline W&B files are read
back with wandb's own reader of its transaction log (``wandb leet inspect --json``, wandb-core's record dump)."""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo.config import ConfigError, load_config
from stapo.run.provenance import (RUN_INFO, TRAIN_STEP_METRIC, apply_identity, config_family, config_method, git_state,
                              method_overrides,
                              launch_record, read_launches, record_launch, resolve_identity)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OBJECTIVES = ["stapo", "grpo", "justrl", "entropy20", "stapo_random", "stapo_high_entropy", "justrl_fullmask"]


# --- identity -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, family", [
    ("configs/cpu_smollm2_stapo.yaml", "cpu_smollm2"),
    ("configs/cpu_smollm2_grpo.yaml", "cpu_smollm2"),
    ("configs/cpu_smollm2_justrl.yaml", "cpu_smollm2"),
    ("configs/cpu_smollm2_entropy20.yaml", "cpu_smollm2"),
    ("configs/cpu_smollm2_stapo_random.yaml", "cpu_smollm2"),       # an ablation: the same family
    ("configs/cpu_smollm2_justrl_fullmask.yaml", "cpu_smollm2"),    # cut at the first objective piece ("justrl")
    ("configs/paper/qwen3_8b_stapo.yaml", "paper_qwen3_8b"),        # the folder under configs/ prefixes it
    ("configs/paper/qwen3_1.7b_entropy20.yaml", "paper_qwen3_1.7b"),
    ("/abs/repo/configs/paper/qwen3_14b_grpo.yaml", "paper_qwen3_14b"),
    ("configs/tiny_test.yaml", "tiny_test"),                        # no objective piece: the whole stem
    ("/home/me/my_grpo.yaml", "my"),                                # outside configs/: no prefix
    ("stapo.yaml", "stapo"),                                        # the first piece is never cut
])
def test_config_family(path, family):
    assert config_family(path, OBJECTIVES) == family


def test_config_family_without_a_file_is_none():
    assert config_family(None, OBJECTIVES) is None


def test_the_four_methods_of_a_family_get_one_group_each_and_share_the_family():
    idents = {}
    for objective in ("grpo", "justrl", "entropy20", "stapo"):
        cfg = load_config(REPO / f"configs/cpu_smollm2_{objective}.yaml")
        idents[objective] = apply_identity(cfg, f"configs/cpu_smollm2_{objective}.yaml")
        assert (cfg.logging.group, cfg.logging.tags, cfg.logging.job_type) == (
            idents[objective].group, idents[objective].tags, "train")
        assert (cfg.logging.family, cfg.logging.method, cfg.logging.study) == ("cpu_smollm2", objective, None)
    # group = <family>-<method>: four groups, W&B's grouped view draws four lines
    assert {o: i.group for o, i in idents.items()} == {"grpo": "cpu_smollm2-grpo", "justrl": "cpu_smollm2-justrl",
                                                       "entropy20": "cpu_smollm2-entropy20",
                                                       "stapo": "cpu_smollm2-stapo"}
    assert idents["stapo"].tags == ["stapo", "embedded-smollm2", "math_verify", "family:cpu_smollm2"]
    assert idents["grpo"].tags == ["grpo", "embedded-smollm2", "math_verify", "family:cpu_smollm2"]


@pytest.mark.parametrize("path, objective, method", [
    ("configs/cpu_smollm2_justrl_fullmask.yaml", "justrl_fullmask", "justrl_fullmask"),
    ("configs/cpu_smollm2_stapo_high_entropy.yaml", "stapo_high_entropy", "stapo_high_entropy"),
    ("configs/cpu_smollm2_stapo.yaml", "grpo", "grpo"),  # an override changed the objective: the objective wins
    ("configs/tiny_test.yaml", "stapo", "stapo"),  # no method part in the name
    (None, "justrl", "justrl")])
def test_config_method(path, objective, method):
    assert config_method(path, objective, OBJECTIVES) == method


def test_a_study_run_is_grouped_by_study_and_method_and_tagged_with_both():
    cfg = load_config(REPO / "configs/cpu_smollm2_stapo.yaml", ["logging.study=s1", "logging.method=stapo_lr2"])
    ident = apply_identity(cfg, "configs/cpu_smollm2_stapo.yaml")
    assert (ident.group, ident.family, ident.study, ident.method) == ("s1-stapo_lr2", "cpu_smollm2", "s1",
                                                                      "stapo_lr2")
    assert ident.tags == ["stapo", "embedded-smollm2", "math_verify", "family:cpu_smollm2", "study:s1"]


def test_the_paper_family_and_a_changed_objective_stay_in_their_config_family():
    cfg = load_config(REPO / "configs/paper/qwen3_8b_stapo.yaml", ["algorithm.objective=grpo"])
    ident = apply_identity(cfg, "configs/paper/qwen3_8b_stapo.yaml")
    assert (ident.group, ident.family) == ("paper_qwen3_8b-grpo", "paper_qwen3_8b")
    assert ident.tags[:2] == ["grpo", "Qwen3-8B-Base"]


def test_changed_algorithm_parameters_make_a_group_of_their_own():
    """STAPO with tau_p = 0.001 is another setting than the config's tau_p = 0.002: its own W&B line. A seed or a
    non-algorithm override stays in the config's group (seeds aggregate); logging.method set by hand wins."""
    assert method_overrides("stapo", ["algorithm.s2t.prob_threshold=0.001", "trainer.seed=2"]) == (
        "stapo[s2t.prob_threshold=0.001]")
    assert method_overrides("stapo", ["trainer.seed=2", "algorithm.objective=grpo"]) == "stapo"
    over = ["algorithm.s2t.prob_threshold=0.001", "algorithm.clip_ratio_high=0.3", "trainer.seed=1"]
    cfg = load_config(REPO / "configs/cpu_smollm2_stapo.yaml", over)
    ident = apply_identity(cfg, REPO / "configs/cpu_smollm2_stapo.yaml", overrides=over)
    assert ident.group == "cpu_smollm2-stapo[clip_ratio_high=0.3,s2t.prob_threshold=0.001]"  # sorted by key
    seed = load_config(REPO / "configs/cpu_smollm2_stapo.yaml", ["trainer.seed=1"])
    assert apply_identity(seed, REPO / "configs/cpu_smollm2_stapo.yaml", overrides=["trainer.seed=1"]).group == (
        "cpu_smollm2-stapo")
    named = load_config(REPO / "configs/cpu_smollm2_stapo.yaml", [*over, "logging.method=tau1e-3"])
    assert apply_identity(named, REPO / "configs/cpu_smollm2_stapo.yaml", overrides=over).group == (
        "cpu_smollm2-tau1e-3")


@pytest.mark.parametrize("over, group", [
    # one setting whatever the order: keys sorted (c < s)
    (["algorithm.s2t.prob_threshold=0.001", "algorithm.clip_ratio_high=0.28"],
     "tiny_test-stapo[clip_ratio_high=0.28,s2t.prob_threshold=0.001]"),
    (["algorithm.clip_ratio_high=0.28", "algorithm.s2t.prob_threshold=0.001"],
     "tiny_test-stapo[clip_ratio_high=0.28,s2t.prob_threshold=0.001]"),
    # ... or spelling: 1e-3 is the float 0.001, written as the config holds it
    (["algorithm.s2t.prob_threshold=1e-3"], "tiny_test-stapo[s2t.prob_threshold=0.001]"),
    # the config's own value (tau_p = 0.002, the schema default tiny_test.yaml keeps) is no other setting
    (["algorithm.s2t.prob_threshold=0.002"], "tiny_test-stapo"),
    (["algorithm.clip_ratio_high=null"], "tiny_test-stapo"),  # unset in the file too
    # the last override of a key wins: 0.01 then 0.002 leaves the file's value
    (["algorithm.s2t.prob_threshold=0.01", "algorithm.s2t.prob_threshold=0.002"], "tiny_test-stapo"),
    (["algorithm.s2t.prob_threshold=0.002", "algorithm.s2t.prob_threshold=0.01"],
     "tiny_test-stapo[s2t.prob_threshold=0.01]"),
    # a diagnostic (kl_to_ref logged, never in the loss; a resume may switch it) is no other setting
    (["algorithm.log_kl_to_ref=true"], "tiny_test-stapo"),
    (["algorithm.log_kl_to_ref=true", "algorithm.s2t.prob_threshold=0.01"], "tiny_test-stapo[s2t.prob_threshold=0.01]"),
])
def test_one_setting_is_one_group_whatever_the_command_line_order_or_spelling(over, group):
    """Two runs of the same parameters must share a W&B group (their seeds are averaged into one line): the
    method's suffix does not depend on the overrides' order, on how a number is written, or on an override that
    repeats the config file's value."""
    cfg = load_config(REPO / "configs/tiny_test.yaml", over)
    assert apply_identity(cfg, REPO / "configs/tiny_test.yaml", overrides=over).group == group


def test_values_set_in_the_config_are_kept_and_a_second_call_changes_nothing():
    cfg = load_config(REPO / "configs/tiny_test.yaml", ["logging.group=study1", "logging.tags=[a,b]",
                                                        "logging.job_type=ablation", "logging.notes=hello"])
    ident = apply_identity(cfg, "configs/tiny_test.yaml")
    assert (ident.group, ident.tags, ident.job_type, ident.notes) == ("study1", ["a", "b"], "ablation", "hello")
    cfg2 = load_config(REPO / "configs/tiny_test.yaml")
    apply_identity(cfg2, "configs/tiny_test.yaml")
    apply_identity(cfg2)  # the trainer's call without a file: the family stays
    assert (cfg2.logging.group, cfg2.logging.family) == ("tiny_test-stapo", "tiny_test")


def test_without_a_config_file_the_family_is_the_model_short_name():
    ident = resolve_identity(group=None, tags=[], job_type=None, notes=None, objective="stapo",
                             model_path="Qwen/Qwen3-8B-Base", reward="math_verify", default_job_type="eval")
    assert (ident.group, ident.tags, ident.job_type) == (
        "Qwen3-8B-Base-stapo", ["stapo", "Qwen3-8B-Base", "math_verify", "family:Qwen3-8B-Base"], "eval")


@pytest.mark.parametrize("override, key", [("logging.group=' '", "logging.group"),
                                           (f"logging.group={'g' * 129}", "logging.group"),
                                           (f"logging.tags=[ok,{'t' * 65}]", "logging.tags"),
                                           ("logging.job_type=''", "logging.job_type")])
def test_identity_values_beyond_wandb_limits_are_one_line_errors(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/tiny_test.yaml", [override])
    assert f"'{key}'" in str(info.value) and "\n" not in str(info.value)


# --- provenance ---------------------------------------------------------------------------------------------
def test_launch_record_fields():
    now = dt.datetime(2026, 12, 2, 10, 0, 0, tzinfo=dt.timezone.utc)
    rec = launch_record(["train.py", "--config", "configs/a b.yaml", "actor.lr=1e-6"], start_step=7, world_size=2,
                        now=now)
    assert rec["started_at"] == "2026-12-02T10:00:00+00:00"
    assert rec["start_step"] == 7 and rec["world_size"] == 2
    assert rec["argv"] == ["train.py", "--config", "configs/a b.yaml", "actor.lr=1e-6"]
    assert rec["command"].endswith("train.py --config 'configs/a b.yaml' actor.lr=1e-6")  # shell-quoted
    assert rec["python"] == ".".join(map(str, sys.version_info[:3]))
    import torch
    import wandb

    assert rec["packages"]["torch"] == torch.__version__ and rec["packages"]["wandb"] == wandb.__version__
    assert "trl-not-a-package" not in rec["packages"]
    assert "cores" in rec["machine"] and rec["host"]
    json.dumps(rec)  # JSON-able


def test_git_state_of_this_repository_and_outside_one(tmp_path):
    here = git_state(REPO)
    if here["commit"] is not None:  # a source checkout (an unpacked archive has no .git)
        assert len(here["commit"]) == 40 and isinstance(here["dirty"], bool)
    assert git_state(tmp_path) == {"commit": None, "dirty": None}  # not a repository: no error


def test_git_missing_is_null_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git binary on PATH
    assert git_state(REPO) == {"commit": None, "dirty": None}
    assert launch_record(["train.py"])["git"] == {"commit": None, "dirty": None}


def test_record_launch_keeps_the_history(tmp_path, capsys):
    assert read_launches(tmp_path) == []
    assert record_launch(tmp_path, {"start_step": 0}) == [{"start_step": 0}]
    assert record_launch(tmp_path, {"start_step": 10}) == [{"start_step": 0}, {"start_step": 10}]
    assert json.loads((tmp_path / RUN_INFO).read_text()) == {"launches": [{"start_step": 0}, {"start_step": 10}]}
    (tmp_path / RUN_INFO).write_text("[1, 2")  # damaged: moved aside (kept), a new history, one line
    assert record_launch(tmp_path, {"start_step": 20}) == [{"start_step": 20}]
    assert (tmp_path / (RUN_INFO + ".bad")).read_text() == "[1, 2"
    err = [line for line in capsys.readouterr().err.splitlines() if RUN_INFO in line]
    assert len(err) == 1 and "moved to" in err[0]


@pytest.mark.slow  # two trainer runs; record_launch's history is checked in the default suite above
def test_a_resumed_run_appends_its_launch_and_keeps_the_first(tmp_path):
    trainer = make_trainer(str(tmp_path), ["trainer.total_steps=1"])
    trainer.argv = ["train.py", "--config", "first"]
    trainer.train()
    trainer = make_trainer(str(tmp_path), ["trainer.total_steps=2", "trainer.resume=required"])
    trainer.argv = ["train.py", "--config", "second", "--resume"]
    trainer.train()
    launches = read_launches(tmp_path / "toy")
    assert [(r["argv"][2], r["start_step"]) for r in launches] == [("first", 0), ("second", 1)]
    config = json.loads((tmp_path / "toy" / "config.json").read_text())["logging"]
    # resolved and recorded; without a config file (make_trainer) the family is the model's short name
    assert config["group"] == "tiny-stapo" and config["tags"] == ["stapo", "tiny", "strict_box", "family:tiny"]
    assert config["job_type"] == "train"


# --- the offline W&B files, read back by wandb ---------------------------------------------------------------
def _wandb_records(wandb_file: Path, until: str, timeout_s: float = 120.0) -> list[dict]:
    """The records of an offline run's ``.wandb`` transaction log as wandb itself dumps them
    (``wandb leet inspect FILE --json``: one JSON record per line). wandb writes the file from its service process,
    so the dump is retried until a record of type ``until`` is there (or ``timeout_s`` passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(wandb_file), "--json"],
                             capture_output=True, text=True, timeout=120)
        records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if any(r.get("type") == until for r in records) or time.monotonic() > deadline:
            assert out.returncode == 0, out.stderr[-2000:]
            return records
        time.sleep(1.0)


def _one_wandb_file(run_dir: Path) -> Path:
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


def test_offline_tracker_files_carry_group_tags_job_type_and_the_step_metric(tmp_path):
    from stapo.run.tracking import Tracker

    tracker = Tracker(tmp_path / "run", {"run_info": {"command": "python train.py"}}, mode="offline",
                      group="cpu_smollm2", tags=["stapo", "embedded-smollm2", "math_verify"], job_type="train",
                      notes="a note", step_metric=TRAIN_STEP_METRIC)
    tracker.log(3, {"actor/entropy": 0.5})
    tracker.finish()
    records = _wandb_records(_one_wandb_file(tmp_path / "run"), until="history")
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["run_group"] == "cpu_smollm2" and run["job_type"] == "train" and run["notes"] == "a note"
    assert run["tags"] == ["stapo", "embedded-smollm2", "math_verify"]
    assert run["config"]["update"]["run_info"] == {"command": "python train.py"}
    metrics = [r["metric"] for r in records if r["type"] == "metric"]
    assert any(m.get("glob_name") == "*" and m.get("step_metric") == TRAIN_STEP_METRIC for m in metrics)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert history[0][TRAIN_STEP_METRIC] == 3 and history[0]["actor/entropy"] == 0.5


def test_train_py_offline_run_carries_its_identity_and_provenance(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
                          f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "trainer.total_steps=1",
                          "logging.wandb_mode=offline"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "r"
    records = _wandb_records(_one_wandb_file(run_dir), until="run")
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["run_group"] == "tiny_test-stapo" and run["job_type"] == "train"
    assert run["tags"] == ["stapo", "tiny", "strict_box", "family:tiny_test"]
    launch = read_launches(run_dir)[0]
    assert launch["argv"][1:] == ["--config", str(REPO / "configs/tiny_test.yaml"), f"trainer.output_dir={tmp_path}",
                                  "trainer.run_name=r", "trainer.total_steps=1", "logging.wandb_mode=offline"]
    assert launch["start_step"] == 0 and "torch" in launch["packages"]
    config = run["config"]["update"]
    assert config["run_info"]["argv"] == launch["argv"] and config["run_info"]["launch"] == 1
    assert config["logging"]["group"] == "tiny_test-stapo" and config["logging"]["family"] == "tiny_test"
    # the end-of-run summary on stdout: the files and the next commands
    assert "next:" in out.stdout and f"wandb sync {run_dir}/wandb/offline-run-*" in out.stdout
