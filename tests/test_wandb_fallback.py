"""``logging.wandb_mode=online`` when W&B cannot start: no credentials (checked before ``wandb.init``, so it
never prompts or waits) or a server that does not answer (a short init timeout). ``logging.wandb_fallback=error``:
a one-line :class:`~stapo.run.tracking.TrackerError` (train.py: exit 2, no traceback); ``offline`` (the default): one
line saying so, then offline W&B files. A finished evaluation never fails because of W&B. No network is used:
the "server" is a closed local port.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo.run.tracking import INIT_TIMEOUT_S, Tracker, TrackerError

REPO = Path(__file__).resolve().parents[1]
_CRED_VARS = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL", "WANDB_MODE",
              "WANDB_INIT_TIMEOUT")


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A HOME without ~/.netrc or W&B settings, and no W&B credential variables."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    for var in _CRED_VARS:
        monkeypatch.delenv(var, raising=False)
    return home


def test_online_without_a_key_fails_fast_in_one_line(tmp_path, no_credentials):
    t0 = time.perf_counter()
    with pytest.raises(TrackerError) as info:
        Tracker(tmp_path / "run", {}, mode="online", fallback="error")
    assert time.perf_counter() - t0 < 30  # a generous bound: no wait for a server or a prompt
    msg = str(info.value)
    assert "\n" not in msg and "WANDB_API_KEY" in msg and "logging.wandb_mode=offline" in msg


def test_online_without_a_key_falls_back_offline_and_says_so(tmp_path, no_credentials, capsys):
    t0 = time.perf_counter()
    tracker = Tracker(tmp_path / "run", {}, mode="online", fallback="offline")
    try:
        assert time.perf_counter() - t0 < 30
        assert tracker.mode == "offline"
        tracker.log(1, {"x": 1.0})
    finally:
        tracker.finish()
    lines = [line for line in capsys.readouterr().err.splitlines() if "logging offline instead" in line]
    assert len(lines) == 1 and "wandb sync" in lines[0]
    assert any((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert (tmp_path / "run" / "metrics.jsonl").read_text().strip() == '{"step": 1, "x": 1.0}'


def test_online_with_an_unreachable_server_times_out_and_falls_back(tmp_path):
    """In a fresh process (wandb keeps its settings per process): a key, but the server is a closed local port."""
    env = {**_clean_env(tmp_path), "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"}
    script = ("import sys, time; from stapo.run.tracking import Tracker; t = time.perf_counter(); "
              "tr = Tracker(sys.argv[1], {}, mode='online', fallback='offline'); "
              "print(tr.mode, time.perf_counter() - t); tr.log(1, {'x': 1.0}); tr.finish()")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    mode, seconds = out.stdout.split()
    assert mode == "offline"
    assert float(seconds) < 60 + INIT_TIMEOUT_S  # generous; wandb's own default waits 90 s and more
    lines = [line for line in out.stderr.splitlines() if "logging offline instead" in line]
    assert len(lines) == 1 and "W&B did not start online" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert any((tmp_path / "run" / "wandb").glob("offline-run-*"))


def _clean_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _CRED_VARS}
    return {**env, "HOME": str(home), "WANDB_DIR": str(tmp_path / "wandb_dir"),
            "WANDB_CONFIG_DIR": str(home / ".config" / "wandb"), "PYTHONPATH": str(REPO)}


def _train_online(tmp_path, *overrides):
    """train.py, one tiny step, W&B online, without credentials (a clean HOME and W&B folders)."""
    return subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
                           f"trainer.output_dir={tmp_path}", "trainer.total_steps=1", "logging.wandb_mode=online",
                           *overrides], capture_output=True, text=True, env=_clean_env(tmp_path), timeout=600)


@pytest.mark.slow  # `pytest -m slow` (keeps the default suite near 10 min)
def test_train_py_online_without_a_key_is_one_line_and_exits_2(tmp_path):
    out = _train_online(tmp_path, "logging.wandb_fallback=error")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert len(lines) == 1 and "logging.wandb_mode=offline" in lines[0], out.stderr


@pytest.mark.slow  # `pytest -m slow` (keeps the default suite near 10 min)
def test_train_py_online_without_a_key_trains_offline_by_default(tmp_path):
    out = _train_online(tmp_path, "trainer.run_name=r")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert sum("logging offline instead" in line for line in out.stderr.splitlines()) == 1, out.stderr
    assert any((tmp_path / "r" / "wandb").glob("offline-run-*"))
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 1


def test_finished_evaluation_never_fails_because_of_wandb(tmp_path, no_credentials, capsys):
    from stapo.evaluation.metrics import GRADER_STATUSES
    from stapo.evaluation.report import log_wandb

    stats = {"avg@N": 0.5, "pass@1": 0.5, "pass@N": 1.0, "maj@N": 0.5, "mean_response_tokens": 7.0,
             "truncation_rate": 0.0, "N": 2, "problems": 1, "samples": 2, "verifier_accepted": 0,
             "grader": {k: 0 for k in GRADER_STATUSES}}
    results = {"label": "x", "config": {}, "metrics": {"t1.0_p1.0": {"benchmarks": {"math500": stats},
                                                                     "average": stats}}}
    log_wandb(results, tmp_path / "eval", mode="online", fallback="error")  # no raise
    err = capsys.readouterr().err
    assert "W&B skipped" in err and "Traceback" not in err
    assert "avg@N" in (tmp_path / "eval" / "metrics.jsonl").read_text()  # the JSONL files are still written


def test_a_bad_wandb_environment_variable_is_named(tmp_path):
    """wandb reads WANDB_MODE from the environment; a bad value makes even offline fail: the message says which.
    In a fresh process: wandb keeps the settings of an earlier run of the same process."""
    code = ("import sys\nfrom stapo.run.tracking import Tracker, TrackerError\n"
            "try:\n    Tracker(sys.argv[1], {}, mode='offline')\nexcept TrackerError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**_clean_env(tmp_path), "WANDB_MODE": "garbage"})
    message = out.stdout.strip()
    assert message.startswith("W&B failed to start in mode 'offline' (the environment sets "), out.stderr[-2000:]
    assert "WANDB_MODE='garbage'" in message.split("): ")[0]
    assert message.endswith(". Use logging.wandb_mode=disabled.") and "\n" not in message
