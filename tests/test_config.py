"""Config loading: typed schema, defaults chain, and clear errors naming the key."""
import glob

import pytest

from stapo.config import ConfigError, load_config
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_config_loads():
    files = sorted(f for f in glob.glob(str(REPO_ROOT / "configs" / "**" / "*.yaml"), recursive=True)
                   if "/configs/eval/" not in f and "/configs/study/" not in f)  # evaluation and study configs
    # have their own schemas (stapo.evaluation, stapo.study: tests/test_study.py loads every study config)
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
    ("algorithm.s2t.quantile_scope=batch", "invalid value for 'algorithm.s2t.quantile_scope' ('batch'): must be "),
    ("actor.ppo_mini_batch_size=2", "'actor.ppo_mini_batch_size' (2): must divide data.train_batch_size (3)"),
    ("trainer.run_name=..", "invalid value for 'trainer.run_name' ('..'): must be one folder name (no '/', not '.' "
                            "or '..'): the run folder is trainer.output_dir/<run_name>"),
    ("trainer.run_name=a/b", "invalid value for 'trainer.run_name' ('a/b'): must be one folder name"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/cpu_smollm2_stapo.yaml", [override])
    assert message in str(e.value)


def test_unreadable_config_files_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\nmodel:\n  path: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == (f"cannot parse config file {bad}: line 2, column 6: did not find expected ',' or ']' "
                            f"(while parsing a flow sequence)")
    bad.write_text("actor: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == f"{bad}: invalid value for 'actor' (3): must be a section of keys (such as 'actor.lr')"
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/tiny_test.yaml", ["rollout=[1]"])
    assert str(e.value) == "invalid value for 'rollout' ([1]): must be a section of keys (such as 'rollout.backend')"
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == (f"config path {tmp_path} is a folder; give a YAML file (e.g. "
                            f"configs/cpu_smollm2_stapo.yaml)")


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


def test_unknown_rollout_backend_is_one_line_naming_the_key_and_the_registered_backends():
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/tiny_test.yaml", ["rollout.backend=vlm"])
    assert str(e.value) == ("invalid value for 'rollout.backend' ('vlm'): unknown rollout backend; did you mean "
                            "'vllm'? (registered: hf, vllm)")
    with pytest.raises(ConfigError, match=r"^invalid value for 'rollout.backend' \('sglang'\): unknown rollout "
                                          r"backend; \(registered: hf, vllm\)$"):
        load_config(REPO_ROOT / "configs/tiny_test.yaml", ["rollout.backend=sglang"])


def test_a_rollout_backend_registered_by_user_code_is_accepted():
    from stapo.rollout import BACKENDS, Backend, register_backend

    backend = Backend("test_echo", "stapo.rollout.hf:HFRolloutEngine", lambda options: {})
    try:
        assert register_backend(backend) is backend
        assert load_config(REPO_ROOT / "configs/tiny_test.yaml", ["rollout.backend=test_echo"]).rollout.backend \
            == "test_echo"
        with pytest.raises(ValueError, match="rollout backend 'test_echo' is already registered"):
            register_backend(backend)
    finally:
        BACKENDS.pop("test_echo", None)
    with pytest.raises(ConfigError, match="unknown rollout backend"):
        load_config(REPO_ROOT / "configs/tiny_test.yaml", ["rollout.backend=test_echo"])


@pytest.fixture
def user_module(tmp_path):
    """Write a module file in tmp_path; everything it registers and the module itself are removed afterwards."""
    import sys

    from stapo.core.objectives import OBJECTIVES

    written = []

    def write(name, source):
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        written.append(name)
        return path

    yield write
    for name in written:
        sys.modules.pop(name, None)
        OBJECTIVES.pop(f"{name}_obj", None)


def test_import_modules_run_before_the_objective_is_checked(user_module, tmp_path):
    import sys

    path = user_module("cfg_user_objective", (
        "from stapo.core.objectives import get_objective, register_objective\n"
        "register_objective(get_objective('justrl').replace(name='cfg_user_objective_obj', kl_coef=0.5))\n"))
    overrides = ["algorithm.objective=cfg_user_objective_obj"]
    with pytest.raises(ConfigError, match="unknown objective"):
        load_config(REPO_ROOT / "configs/tiny_test.yaml", overrides)
    yaml = tmp_path / "my.yaml"
    yaml.write_text(f"defaults: [{REPO_ROOT / 'configs/tiny_test.yaml'}]\n"
                    f"trainer:\n  import_modules: [{path}]\nalgorithm:\n  objective: cfg_user_objective_obj\n")
    cfg = load_config(yaml)
    assert cfg.trainer.import_modules == [str(path)] and cfg.algorithm.objective == "cfg_user_objective_obj"
    assert sys.modules["cfg_user_objective"].__file__ == str(path)
    from stapo.config import objective_from_config

    assert objective_from_config(cfg).kl_coef == 0.5
    assert load_config(yaml) == cfg  # a second load does not run the module again (no duplicate registration)
    # a dotted name, from the override list
    sys.path.insert(0, str(tmp_path))
    try:
        sys.modules.pop("cfg_user_objective")
        from stapo.core.objectives import OBJECTIVES

        OBJECTIVES.pop("cfg_user_objective_obj")
        assert load_config(REPO_ROOT / "configs/tiny_test.yaml",
                           overrides + ["trainer.import_modules=[cfg_user_objective]"]).algorithm.objective \
            == "cfg_user_objective_obj"
    finally:
        sys.path.remove(str(tmp_path))


def test_import_modules_failures_are_one_line_naming_the_key_and_the_module(user_module, tmp_path):
    def error(entry):
        with pytest.raises(ConfigError) as e:
            load_config(REPO_ROOT / "configs/tiny_test.yaml", [f"trainer.import_modules=['{entry}']"])
        assert "\n" not in str(e.value)
        return str(e.value)

    assert error("no_such_module_xyz") == ("invalid value for 'trainer.import_modules' ('no_such_module_xyz'): "
                                           "cannot import it: ModuleNotFoundError: No module named 'no_such_module_xyz'")
    missing = tmp_path / "missing.py"
    assert error(missing) == f"invalid value for 'trainer.import_modules' ('{missing}'): file not found: {missing}"
    broken = user_module("cfg_broken", "raise RuntimeError('registry is not ready\\nsecond line')\n")
    assert error(broken) == (f"invalid value for 'trainer.import_modules' ('{broken}'): cannot import it: "
                             "RuntimeError: registry is not ready")
    import sys

    assert "cfg_broken" not in sys.modules  # a failed import leaves nothing half-imported
    bad_syntax = user_module("cfg_bad_syntax", "def f(:\n")
    assert error(bad_syntax).startswith(f"invalid value for 'trainer.import_modules' ('{bad_syntax}'): cannot import "
                                        "it: SyntaxError: ")
    clash = tmp_path / "json.py"  # not through user_module: its clean-up would drop the real json module
    clash.write_text("x = 1\n")
    assert "a module named 'json' is already imported" in error(clash) and sys.modules["json"].__file__ != str(clash)


def test_train_set_is_checked_against_the_training_set_registry():
    """data.train_set: synthetic, word, file or a TRAIN_REGISTRY name; anything else is one line with the closest
    name."""
    assert load_config(REPO_ROOT / "configs/tiny_test.yaml", ["data.train_set=math_train"]).data.train_set == "math_train"
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/tiny_test.yaml", ["data.train_set=math_trian"])
    assert str(e.value) == ("invalid value for 'data.train_set' ('math_trian'): unknown training set; did you mean "
                            "'math_train'? (registered: dapo_math_17k, file, math_train, synthetic, word)")


def test_import_modules_given_as_a_string_is_one_line_asking_for_a_list(tmp_path):
    """trainer.import_modules=mymask.py (no brackets) used to give OmegaConf's 'AnyNode is not a ListConfig'."""
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/tiny_test.yaml", ["trainer.import_modules=mymask.py"])
    assert str(e.value) == ("invalid value for 'trainer.import_modules' ('mymask.py'): must be a list, e.g. "
                            "trainer.import_modules=[mymask.py]")
    yaml = tmp_path / "my.yaml"
    yaml.write_text(f"defaults: [{REPO_ROOT / 'configs/tiny_test.yaml'}]\ntrainer:\n  import_modules: mymask.py\n")
    with pytest.raises(ConfigError) as e:
        load_config(yaml)
    assert str(e.value) == (f"{yaml}: invalid value for 'trainer.import_modules' ('mymask.py'): must be a list, e.g. "
                            "import_modules: [mymask.py]")
    with pytest.raises(ConfigError) as e:  # a mapping where a list belongs (was a TypeError traceback)
        load_config(REPO_ROOT / "configs/tiny_test.yaml", ["trainer.import_modules={a: 1}"])
    assert str(e.value) == "invalid value for 'trainer.import_modules' ({'a': 1}): must be a list"
    with pytest.raises(ConfigError) as e:  # any list key
        load_config(REPO_ROOT / "configs/tiny_test.yaml", ["actor.betas=0.9"])
    assert str(e.value) == "invalid value for 'actor.betas' (0.9): must be a list, e.g. actor.betas=[0.9]"


def test_import_modules_refuses_a_file_named_like_an_importable_module(tmp_path):
    """A user file whose stem is an installed module that is NOT imported yet (here a module of a sys.path folder
    made for the test) would become sys.modules[<stem>] and replace that module for every later import: refused."""
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / "cfg_installed_mod.py").write_text("x = 'installed'\n")
    user = tmp_path / "user"
    user.mkdir()
    clash = user / "cfg_installed_mod.py"
    clash.write_text("x = 'user'\n")
    sys.path.insert(0, str(site))
    try:
        assert "cfg_installed_mod" not in sys.modules
        with pytest.raises(ConfigError) as e:
            load_config(REPO_ROOT / "configs/tiny_test.yaml", [f"trainer.import_modules=['{clash}']"])
        assert str(e.value) == (f"invalid value for 'trainer.import_modules' ('{clash}'): a module named "
                                f"'cfg_installed_mod' is installed ({site / 'cfg_installed_mod.py'}); rename the file")
        assert "cfg_installed_mod" not in sys.modules
        # the installed file itself, named by its path, is that module: accepted
        installed = site / "cfg_installed_mod.py"
        load_config(REPO_ROOT / "configs/tiny_test.yaml", [f"trainer.import_modules=['{installed}']"])
        assert sys.modules["cfg_installed_mod"].x == "installed"
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("cfg_installed_mod", None)
    tqdm_file = user / "tqdm.py"
    tqdm_file.write_text("raise RuntimeError('must not run')\n")
    with pytest.raises(ConfigError, match=r"a module named 'tqdm' is (installed|already imported) \(.*tqdm.*\); "
                                          r"rename the file$"):
        load_config(REPO_ROOT / "configs/tiny_test.yaml", [f"trainer.import_modules=['{tqdm_file}']"])
    assert getattr(sys.modules.get("tqdm"), "__file__", "") != str(tqdm_file)
    dotted = user / "my.masks.py"
    dotted.write_text("x = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(REPO_ROOT / "configs/tiny_test.yaml", [f"trainer.import_modules=['{dotted}']"])
    assert str(e.value) == (f"invalid value for 'trainer.import_modules' ('{dotted}'): the module name 'my.masks' "
                            "holds a '.'; rename the file")


def test_a_mask_config_key_missing_from_the_schema_is_one_line_naming_the_mask_the_parameter_and_the_key():
    """A mask registered with config_keys={"tau": "algorithm.s2t.prob_treshold"} (typo) used to load and silently
    keep tau's default: the key is checked against the TrainConfig schema when the objective is built."""
    from dataclasses import dataclass

    from stapo.config import objective_from_config
    from stapo.core.masks import TokenMask, register_token_mask, unregister_token_mask
    from stapo.core.objectives import OBJECTIVES, get_objective, register_objective

    @dataclass
    class TauParams:
        tau: float = 0.002

    def keep_all(logprobs, entropy, advantages, response_mask, *, tau=0.002):
        return TokenMask(keep=response_mask, stats={})

    overrides = ["algorithm.objective=cfg_tau_obj"]
    try:
        register_token_mask("cfg_tau_typo", params=TauParams, config_keys={"tau": "algorithm.s2t.prob_treshold"})(
            keep_all)
        register_token_mask("cfg_tau_section", params=TauParams, config_keys={"tau": "algorithm.s2t"})(keep_all)
        register_token_mask("cfg_tau_far", params=TauParams, config_keys={"tau": "algorithm.tau"})(keep_all)
        register_token_mask("cfg_tau_ok", params=TauParams, config_keys={"tau": "algorithm.s2t.prob_threshold"})(
            keep_all)
        register_objective(get_objective("justrl").replace(name="cfg_tau_obj", token_mask="cfg_tau_typo"))
        for mask, message in [
            ("cfg_tau_typo", "token mask 'cfg_tau_typo' reads its parameter 'tau' from config key "
                             "'algorithm.s2t.prob_treshold', which is not a config key; did you mean "
                             "'algorithm.s2t.prob_threshold'? (fix the config_keys of register_token_mask)"),
            ("cfg_tau_section", "token mask 'cfg_tau_section' reads its parameter 'tau' from config key "
                                "'algorithm.s2t', which is a config section, not a value (fix the config_keys of "
                                "register_token_mask)"),
            ("cfg_tau_far", "token mask 'cfg_tau_far' reads its parameter 'tau' from config key 'algorithm.tau', "
                            "which is not a config key (fix the config_keys of register_token_mask)")]:
            OBJECTIVES["cfg_tau_obj"] = OBJECTIVES["cfg_tau_obj"].replace(token_mask=mask)
            with pytest.raises(ConfigError) as e:
                load_config(REPO_ROOT / "configs/tiny_test.yaml", overrides)
            assert str(e.value) == message
        OBJECTIVES["cfg_tau_obj"] = OBJECTIVES["cfg_tau_obj"].replace(token_mask="cfg_tau_ok")
        cfg = load_config(REPO_ROOT / "configs/tiny_test.yaml", overrides + ["algorithm.s2t.prob_threshold=0.05"])
        assert objective_from_config(cfg).mask_params == {"tau": 0.05}  # the key is read
    finally:
        OBJECTIVES.pop("cfg_tau_obj", None)
        for name in ("cfg_tau_typo", "cfg_tau_section", "cfg_tau_far", "cfg_tau_ok"):
            unregister_token_mask(name)
