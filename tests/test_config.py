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


def test_unknown_objective_names_the_key_and_the_closest_registered_one():
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", ["algorithm.objective=stapo_randm"])
    assert "invalid value for 'algorithm.objective' ('stapo_randm'): unknown objective; did you mean 'stapo_random'?" \
        in str(e.value)
    assert "justrl_fullmask" in str(e.value)  # the registered names are listed


def test_renamed_stats_source_key_says_what_replaced_it():
    with pytest.raises(ConfigError, match=r"'algorithm.s2t.stats_source' was replaced by algorithm.mask_stats_source"):
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", ["algorithm.s2t.stats_source=old"])
    assert load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml",
                       ["algorithm.mask_stats_source=old"]).algorithm.mask_stats_source == "old"
    assert load_config(REPO_ROOT / "configs/paper/qwen3_8b_stapo.yaml").algorithm.mask_stats_source == "current"


@pytest.mark.parametrize("name, mask", [("stapo_high_entropy", "s2t_high_entropy"), ("stapo_random", "s2t_random"),
                                        ("justrl_fullmask", "full_low_prob")])
def test_ablation_configs_differ_from_stapo_only_by_the_objective(name, mask):
    from stapo.config import objective_from_config

    cfg = load_config(REPO_ROOT / f"configs/cpu_smollm2_{name}.yaml")
    stapo = load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml")
    assert cfg.algorithm.objective == name
    cfg.algorithm.objective = "stapo"
    assert cfg == stapo
    cfg.algorithm.objective = name
    obj = objective_from_config(cfg)
    assert obj.token_mask == mask and (obj.clip_ratio_low, obj.clip_ratio_high, obj.clip_ratio_c) == (0.2, 0.28, 10.0)


def test_mask_parameters_come_from_their_registered_config_keys():
    from stapo.config import objective_from_config

    # stapo_random reads τ_p and q from algorithm.s2t (shared with S2T) and its seed from algorithm.masks.s2t_random
    cfg = load_config(REPO_ROOT / "configs/cpu_smollm2_stapo_random.yaml",
                      ["algorithm.s2t.prob_threshold=0.01", "algorithm.masks.s2t_random.seed=7"])
    assert objective_from_config(cfg).mask_params == {"prob_threshold": 0.01, "entropy_quantile": 0.75,
                                                      "quantile_scope": "candidates", "seed": 7}
    assert objective_from_config(load_config(REPO_ROOT / "configs/cpu_smollm2_justrl_fullmask.yaml", [
        "algorithm.s2t.prob_threshold=0.05"])).mask_params == {"prob_threshold": 0.05}
    with pytest.raises(ConfigError, match=r"'algorithm.masks.s2t_random.prob_threshold'; this parameter is read "
                                          r"from 'algorithm.s2t.prob_threshold'"):
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", ["algorithm.masks.s2t_random.prob_threshold=0.1"])
    with pytest.raises(ConfigError, match=r"'algorithm.masks.s2t_random.sed'; did you mean 'algorithm.masks.s2t_random.seed'"):
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", ["algorithm.masks.s2t_random.sed=1"])
    with pytest.raises(ConfigError, match=r"'algorithm.masks.s2t_random.prob_threshol'; did you mean "
                                          r"'algorithm.s2t.prob_threshold'"):
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", ["algorithm.masks.s2t_random.prob_threshol=0.1"])
    with pytest.raises(ConfigError, match=r"invalid value for 'algorithm.masks.s2t_random.seed' \('abc'\)"):
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo_random.yaml", ["algorithm.masks.s2t_random.seed=abc"])
    with pytest.raises(ConfigError, match=r"'algorithm.masks.s2t_randm': no registered token mask; did you mean "
                                          r"'algorithm.masks.s2t_random'"):
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", ["algorithm.masks.s2t_randm.seed=1"])
