"""Ctrl-C (SIGINT) or SIGTERM while training: the first lets the step in progress finish and checkpoints it
(``trainer.save_on_interrupt``), a second abandons the step; ``train.py`` prints one line with the ``--resume``
command, no traceback, and exits 130 (143 for SIGTERM); the resumed run has exactly one metrics row per step.

In-process tests send the signal from inside a step (the toy reward), so they are deterministic; the ``train.py``
test sends it to a real process group (as a terminal's Ctrl-C does) once the first metrics row is written.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer, toy_reward  # noqa: E402

from stapo.model.checkpoint import latest_checkpoint  # noqa: E402
from stapo.train.trainer import Interrupted  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line] if path.exists() else []


pytestmark = pytest.mark.usefixtures("python_default_signal_handlers")  # tests/conftest.py


def _signal_in_reward(at_call: int, times: int = 1, signum: int = signal.SIGINT):
    """The toy reward, sending ``times`` signals ``signum`` to this process during its ``at_call``-th call
    (1-based)."""
    calls = {"n": 0}

    def reward(responses, golds):
        calls["n"] += 1
        if calls["n"] == at_call:
            for _ in range(times):
                os.kill(os.getpid(), signum)
                time.sleep(0.01)  # the handler runs between the two signals
        return toy_reward(responses, golds)

    return reward


def _default_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def _trainer(tmp_path, overrides, reward=None):
    trainer = make_trainer(str(tmp_path), ["trainer.total_steps=5", *overrides])
    if reward is not None:
        trainer.reward_fn = reward
    return trainer


@pytest.mark.parametrize("save_on_interrupt", [True, False])
def test_first_ctrl_c_finishes_the_step_and_checkpoints_it(tmp_path, save_on_interrupt):
    trainer = _trainer(tmp_path, ["trainer.save_every=0", f"trainer.save_on_interrupt={save_on_interrupt}"],
                       _signal_in_reward(at_call=2, times=1))
    with pytest.raises(Interrupted) as info:
        trainer.train()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    e = info.value
    assert (e.step, e.abandoned) == (2, False)
    run_dir = tmp_path / "toy"
    assert _steps(run_dir) == [1, 2]  # step 2 finished and was logged
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if save_on_interrupt:
        assert e.checkpoint == ckpt and ckpt is not None and ckpt.name == "step_000002"
    else:  # save_every=0: nothing was due
        assert e.checkpoint is None and ckpt is None


def test_second_ctrl_c_abandons_the_step_and_keeps_the_checkpoints(tmp_path):
    trainer = _trainer(tmp_path, ["trainer.save_every=1"], _signal_in_reward(at_call=2, times=2))
    with pytest.raises(Interrupted) as info:
        trainer.train()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    e = info.value
    run_dir = tmp_path / "toy"
    assert (e.step, e.abandoned) == (1, True)
    assert e.checkpoint is not None and e.checkpoint.name == "step_000001"
    assert not (run_dir / "checkpoints" / "step_000002").exists()
    assert _steps(run_dir) == [1]

    resumed = make_trainer(str(tmp_path), ["trainer.total_steps=3", "trainer.save_every=1", "trainer.resume=auto"])
    resumed.train()
    assert _steps(run_dir) == [1, 2, 3]


def test_resume_after_an_unsaved_interrupt_drops_the_rows_after_the_checkpoint(tmp_path):
    trainer = _trainer(tmp_path, ["trainer.save_every=2", "trainer.save_on_interrupt=false"],
                       _signal_in_reward(at_call=3, times=1))
    with pytest.raises(Interrupted) as info:
        trainer.train()
    run_dir = tmp_path / "toy"
    assert info.value.step == 3 and info.value.checkpoint.name == "step_000002"
    assert _steps(run_dir) == [1, 2, 3]
    make_trainer(str(tmp_path), ["trainer.total_steps=4", "trainer.resume=auto"]).train()
    assert _steps(run_dir) == [1, 2, 3, 4]  # row 3 of the interrupted run was dropped and redone


def test_sigterm_finishes_the_step_and_checkpoints_it(tmp_path):
    """SIGTERM (a scheduler's preemption) is handled as the first Ctrl-C: the step finishes and is saved."""
    trainer = _trainer(tmp_path, ["trainer.save_every=0"], _signal_in_reward(at_call=2, signum=signal.SIGTERM))
    with pytest.raises(Interrupted) as info:
        trainer.train()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    e = info.value
    assert (e.step, e.abandoned, e.signum) == (2, False, signal.SIGTERM)
    assert e.checkpoint is not None and e.checkpoint.name == "step_000002"
    assert _steps(tmp_path / "toy") == [1, 2]


def test_a_signal_during_a_due_save_stops_after_that_step(tmp_path):
    """SIGTERM arriving while step 1's (due) checkpoint is written: the run stops after step 1 (it is saved),
    not after one more step."""
    trainer = _trainer(tmp_path, ["trainer.save_every=1"])
    save = trainer.save

    def save_and_get_signalled():
        out = save()
        if trainer.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.save = save_and_get_signalled
    with pytest.raises(Interrupted) as info:
        trainer.train()
    e = info.value
    assert (e.step, e.abandoned, e.signum, e.checkpoint.name) == (1, False, signal.SIGTERM, "step_000001")
    assert _steps(tmp_path / "toy") == [1]


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, id="SIGINT"),
                                    pytest.param(signal.SIGTERM, id="SIGTERM", marks=pytest.mark.slow)])
def test_train_py_ctrl_c_saves_prints_one_resume_line_exits_130_and_resumes(tmp_path, signum):
    """A real Ctrl-C: SIGINT to train.py's process group after its first metrics row (SIGTERM: to the process,
    as ``kill`` or a scheduler sends it; exit code 143), then the printed command (with a smaller
    trainer.total_steps appended, so the test stays short) finishes the run."""
    out_dir = tmp_path / "runs"
    run_dir = out_dir / "ctrlc"
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny_test.yaml"),
           f"trainer.output_dir={out_dir}", "trainer.run_name=ctrlc", "trainer.total_steps=1000",
           "trainer.save_every=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the child's SIGINT / SIGTERM at their defaults: pytest started in the background of a non-interactive shell
    # (`pytest &`, nohup) inherits SIGINT ignored, and Python then leaves Ctrl-C ignored in the child too
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals)
    try:
        deadline = time.time() + 600
        while not _steps(run_dir):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.time() < deadline, "no metrics row within 600 s"
            time.sleep(0.1)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the group
        else:
            os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err, err
    hints = [line for line in err.splitlines() if "--resume" in line and line.startswith("train.py:")]
    assert len(hints) == 1, err
    steps = _steps(run_dir)
    k = steps[-1]
    assert steps == list(range(1, k + 1))
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.name == f"step_{k:06d}"  # save_on_interrupt (default true)
    how = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    assert f"train.py: {how} after step {k}; resume" in hints[0] and str(ckpt) in hints[0]

    command = shlex.split(hints[0].split("): ", 1)[1])
    assert command[0] == "python" and command[-1] == "--resume"
    resume = subprocess.run([sys.executable, *command[1:-1], f"trainer.total_steps={k + 2}", "--resume"], env=env,
                            capture_output=True, text=True, timeout=600, cwd=os.getcwd())
    assert resume.returncode == 0, resume.stderr
    assert "Traceback" not in resume.stderr
    assert _steps(run_dir) == list(range(1, k + 3))  # exactly one row per step


def test_sighup_finishes_the_step_and_checkpoints_it(tmp_path, monkeypatch):
    """SIGHUP (a closed terminal) is handled as SIGTERM: the step finishes and is saved. Before, it killed the
    process at once (a stale lock, a partial checkpoint, no line)."""
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # SIGHUP makes them drop failed writes; restored after the test
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    trainer = _trainer(tmp_path, ["trainer.save_every=0"], _signal_in_reward(at_call=2, signum=signal.SIGHUP))
    with pytest.raises(Interrupted) as info:
        trainer.train()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # restored
    e = info.value
    assert (e.step, e.abandoned, e.signum) == (2, False, signal.SIGHUP)
    assert e.checkpoint is not None and e.checkpoint.name == "step_000002"
    assert _steps(tmp_path / "toy") == [1, 2]
    assert not (tmp_path / "toy" / "run.lock").exists()  # released


def _controlling_terminal() -> None:
    """In the child (a new session): the terminal on stdin becomes its controlling terminal, so closing the
    terminal's master side sends it SIGHUP, as closing a terminal window does; the signals at their defaults."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    _default_signals()
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # pytest under nohup: SIGHUP ignored, and inherited


@pytest.mark.slow  # a real train.py; test_sighup_finishes_the_step_and_checkpoints_it is the fast one
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal semantics of Linux")
def test_train_py_on_a_closed_terminal_checkpoints_the_step_and_exits_129(tmp_path):
    """train.py on a terminal (stdin and stdout on a pseudo-terminal, stderr kept in a pipe to read its line) whose
    window is closed after the first metrics row: it finishes the step, checkpoints it, releases the run lock,
    writes one resume line and exits 128 + SIGHUP; its writes to the gone terminal (EIO) do not break the clean-up."""
    import pty

    out_dir = tmp_path / "runs"
    run_dir = out_dir / "hup"
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny_test.yaml"),
           f"trainer.output_dir={out_dir}", "trainer.run_name=hup", "trainer.total_steps=1000",
           "trainer.save_every=0", "trainer.log_examples_every=0", "trainer.progress_bar=true"]
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=slave, stdout=slave,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_controlling_terminal)
    os.close(slave)
    try:
        deadline = time.time() + 600
        while not _steps(run_dir):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.time() < deadline, "no metrics row within 600 s"
            time.sleep(0.1)
        os.close(master)  # the terminal window closes: the kernel sends SIGHUP to the session's processes
        master = None
        _, err = proc.communicate(timeout=600)
    finally:
        if master is not None:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGHUP, err
    assert "Traceback" not in err, err
    steps = _steps(run_dir)
    k = steps[-1]
    assert steps == list(range(1, k + 1))
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.name == f"step_{k:06d}"
    assert not (run_dir / "run.lock").exists()  # released, not stale
    hints = [line for line in err.splitlines() if line.startswith("train.py:")]
    assert len(hints) == 1 and hints[0].startswith(f"train.py: stopped by SIGHUP (the terminal closed) after step "
                                                   f"{k}; resume (continues from {ckpt}): "), err
