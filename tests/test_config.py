"""Config loading: typed schema, defaults chain, and clear errors naming the key."""
import glob

import pytest

from stapo.config import ConfigError, load_config
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_config_loads():
    files = sorted(f for f in glob.glob(str(REPO_ROOT / "configs" / "**" / "*.yaml"), recursive=True)
                   if "/configs/eval/" not in f)  # evaluation configs have their own schema (stapo.evaluation)
    assert len(files) >= 18  # 12 paper + base, 4 CPU + base, tiny
    for f in files:
        load_config(f)


def test_paper_configs_follow_the_recipe_and_differ_only_by_method():
    stapo = load_config(REPO_ROOT / "configs/paper/qwen3_8b_stapo.yaml")
    grpo = load_config(REPO_ROOT / "configs/paper/qwen3_8b_grpo.yaml")
    assert stapo.model.path == "Qwen/Qwen3-8B-Base"
    assert (stapo.data.train_batch_size, stapo.rollout.n, stapo.actor.ppo_mini_batch_size) == (256, 8, 64)
    assert (stapo.actor.lr, stapo.actor.warmup_steps, stapo.actor.weight_decay, stapo.actor.grad_clip) == \
        (1e-6, 10, 0.1, 1.0)
    assert (stapo.rollout.response_length, stapo.data.max_prompt_length) == (15360, 1024)
    assert (stapo.algorithm.s2t.prob_threshold, stapo.algorithm.s2t.entropy_quantile) == (0.002, 0.75)
    assert stapo.algorithm.objective == "stapo" and grpo.algorithm.objective == "grpo"
    grpo.algorithm.objective = "stapo"
    assert grpo == stapo


def test_overrides_apply_last():
    cfg = load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", ["actor.lr=3e-6", "rollout.n=4"])
    assert cfg.actor.lr == 3e-6 and cfg.rollout.n == 4
    assert cfg.model.path == "embedded:smollm2" and cfg.algorithm.objective == "stapo"


@pytest.mark.parametrize("override, message", [
    ("actor.lrr=1", "unknown config key 'actor.lrr'; did you mean 'actor.lr'?"),
    ("algorithm.s2t.entropy_quantil=0.5", "did you mean 'algorithm.s2t.entropy_quantile'?"),
    ("rolout.n=4", "unknown config key 'rolout'"),
    ("actor.lr=fast", "invalid value for 'actor.lr'"),
    ("algorithm.objective=stapoo", "invalid value for 'algorithm.objective'"),
    ("rollout.n=1", "invalid value for 'rollout.n' (1): the group size G must be ≥ 2"),
    ("algorithm.s2t.entropy_quantile=1.0", "invalid value for 'algorithm.s2t.entropy_quantile'"),
    ("actor.ppo_mini_batch_size=2", "'actor.ppo_mini_batch_size' (2): must divide data.train_batch_size (3)"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", [override])
    assert message in str(e.value)


def test_bad_yaml_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lr: 1e-6\n  gradclip: 1.0\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'actor.gradclip'; did you mean 'actor.grad_clip'"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
