"""The error boundary of train.py and evaluate.py: a failure outside the known user errors is one line (its type,
its first message line, the hint to rerun with --debug), exit code 1; --debug (or STAPO_DEBUG=1) shows the full
traceback. An empty config file is refused instead of meaning the paper-scale defaults."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BOOM_MASK = """
from stapo.core.masks import register_token_mask
from stapo.core.objectives import get_objective, register_objective


@register_token_mask("boom", maskable_rows="all")
def boom(logprobs, entropy, advantages, response_mask):
    raise RuntimeError("the mask blew up\\nsecond line")


register_objective(get_objective("justrl").replace(name="justrl_boom", token_mask="boom"))
"""

BOOM_BACKEND = """
from stapo.rollout import BACKENDS, Backend, register_backend


class BoomEngine:
    def __init__(self, model, tokenizer, **kwargs):
        pass

    def generate(self, *args, **kwargs):
        raise OSError("disk on fire")

    def close(self):
        pass


register_backend(Backend("boom", "boom_backend:BoomEngine", BACKENDS["hf"].kwargs, model_in_place=True))
"""


def _run(args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("debug", [None, pytest.param("--debug", marks=pytest.mark.slow), "STAPO_DEBUG=1"])
def test_train_py_turns_an_unexpected_failure_into_one_line_exit_1(tmp_path, debug):
    module = tmp_path / "boom_mask.py"
    module.write_text(BOOM_MASK)
    args = [str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
            f"trainer.import_modules=[{module}]", "algorithm.objective=justrl_boom",
            f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "trainer.total_steps=1"]
    out = _run(args + (["--debug"] if debug == "--debug" else []),
               env={"STAPO_DEBUG": "1"} if debug == "STAPO_DEBUG=1" else {"STAPO_DEBUG": "0"})
    assert out.returncode == 1, out.stderr[-2000:]
    if debug is None:
        assert "Traceback" not in out.stderr
        assert out.stderr.strip().splitlines()[-1] == ("train.py: RuntimeError: the mask blew up (rerun with --debug "
                                                       "or STAPO_DEBUG=1 for the traceback)")
    else:
        assert "Traceback" in out.stderr and "RuntimeError: the mask blew up" in out.stderr


def test_evaluate_py_turns_an_unexpected_failure_into_one_line_exit_1(tmp_path):
    module = tmp_path / "boom_backend.py"
    module.write_text(BOOM_BACKEND)
    out = _run([str(REPO / "evaluate.py"), "--config", str(REPO / "configs/eval/tiny_test.yaml"),
                "--output", str(tmp_path / "eval"), "--data-root", str(REPO.parent / "shared" / "data"),
                f"import_modules=[{module}]", "engine.backend=boom"], env={"STAPO_DEBUG": "0"})
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("evaluate.py: OSError: disk on fire (rerun the same command to "
                                                   "resume; --debug or STAPO_DEBUG=1 shows the traceback)")


def test_an_empty_config_file_is_refused_in_one_line(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    out = _run([str(REPO / "train.py"), "--config", str(empty)])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"train.py: config file {empty} is empty; start from one of configs/ (e.g. "
                                  f"configs/cpu_smollm2_stapo.yaml), or list one under 'defaults:'")
    only_parent = tmp_path / "child.yaml"  # a file of nothing but a parent is fine
    only_parent.write_text(f"defaults: [{REPO / 'configs/tiny_test.yaml'}]\n")
    from stapo.config import load_config

    assert load_config(only_parent).model.path == "tiny"


@pytest.mark.parametrize("script, argv, message", [
    ("evaluate", ["--limit", "abc"], "evaluate.py: error: argument --limit: invalid int value: 'abc' (see --help)"),
    ("train", [], "train.py: error: the following arguments are required: --config (see --help)"),
])
def test_a_command_line_usage_error_is_one_line(capsys, monkeypatch, script, argv, message):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_{script}_cli", REPO / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(REPO / f"{script}.py")])  # argparse names the program after argv[0]
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [message]  # no usage block before it
