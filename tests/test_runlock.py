"""One writer per run folder (stapo/run/runlock.py): the lock itself, its stale-lock takeover, the no-flock fallback,
and two real processes on one folder — train.py on a run directory, evaluate.py on an output directory.

The two-process tests never assume a speed: the first process is made to hold its lock for as long as the test
needs (a training run far longer than the test; an evaluation whose rollout backend waits for a file), the test
polls the lock file until it names that process, and only then starts the second one.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.run import runlock  # noqa: E402
from stapo.run.runlock import LOCK_NAME, Holder, RunLock, RunLockError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONHASHSEED": "0"}
TIMEOUT = 600  # generous: two CPU-loaded processes; never a bound on speed, only on hanging


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_holder(folder: Path, pid: int, host: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                "started": "2026-01-01T00:00:00+00:00", "program": "train.py"}))


def wait_for_holder(lock_file: Path, pid: int, proc: subprocess.Popen) -> Holder:
    """Poll the lock file until it names ``pid`` (``proc`` must stay alive meanwhile)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert proc.poll() is None, f"the first process ended (rc {proc.returncode}) before it held the lock"
        assert time.monotonic() < deadline, "the first process never took the lock"
        try:
            holder = Holder.parse(lock_file.read_text())
        except OSError:
            holder = None
        if holder is not None and holder.pid == pid:
            return holder
        time.sleep(0.1)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# --- the lock -------------------------------------------------------------------------------------------
def test_lock_file_names_the_holder_and_goes_away_on_release(tmp_path):
    folder = tmp_path / "runs" / "a"  # created by acquire, removed by release: it held nothing else
    with RunLock(folder, "train.py") as lock:
        holder = Holder.parse((folder / LOCK_NAME).read_text())
        assert holder == Holder(os.getpid(), socket.gethostname(), holder.started, "train.py")
        assert lock.held and lock.took_over is None
        with pytest.raises(RunLockError) as err:  # a second lock on it in this same process
            RunLock(folder).acquire()
        assert str(err.value).startswith(f"{folder} is in use by") and "\n" not in str(err.value)
        (folder / "metrics.jsonl").write_text("")
    assert not (folder / LOCK_NAME).exists() and folder.is_dir()  # kept: it holds a file now
    with RunLock(folder):  # free again
        pass
    empty = tmp_path / "empty"
    with RunLock(empty):
        pass
    assert not empty.exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over_saying_so(tmp_path):
    pid = dead_pid()
    write_holder(tmp_path, pid)
    said = []
    lock = RunLock(tmp_path, "evaluate.py", announce=said.append).acquire()
    try:
        assert lock.took_over is not None and lock.took_over.pid == pid
        assert said == [f"evaluate.py: took over the stale lock of {tmp_path} (train.py, pid {pid} on host "
                        f"{socket.gethostname()}, started 2026-01-01T00:00:00+00:00): that process is gone"]
        assert Holder.parse((tmp_path / LOCK_NAME).read_text()).pid == os.getpid()
    finally:
        lock.release()


def test_a_live_pid_in_the_file_without_the_flock_is_stale_too(tmp_path):
    """flock is the authority: a file naming a live process that does not hold the lock (a reused pid, e.g.
    after a reboot or in a fresh container) is taken over."""
    write_holder(tmp_path, os.getppid())
    said = []
    with RunLock(tmp_path, announce=said.append):
        assert len(said) == 1 and "does not hold the lock (a reused pid)" in said[0]


@pytest.fixture
def no_flock(monkeypatch):
    """A file system without flock (some FUSE / Lustre mounts): the lock file's holder decides."""
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", refuse)


def test_without_flock_a_live_holder_refuses_and_a_dead_one_is_taken_over(tmp_path, no_flock):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        write_holder(tmp_path, sleeper.pid)
        with pytest.raises(RunLockError, match=f"in use by train.py \\(pid {sleeper.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    said = []
    with RunLock(tmp_path, announce=said.append) as lock:  # the same file, its process now gone
        assert lock.took_over.pid == sleeper.pid and said[0].endswith("that process is gone")
    write_holder(tmp_path, 1, host="some-other-host")
    with pytest.raises(RunLockError, match="another host cannot be checked: once that process is gone, delete"):
        RunLock(tmp_path).acquire()


# --- two real processes ---------------------------------------------------------------------------------
def test_a_second_train_py_on_a_run_directory_is_refused_and_a_dead_ones_lock_taken_over(tmp_path):
    run_dir = tmp_path / "r"
    base = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
            f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "trainer.save_every=0"]
    first = subprocess.Popen(base + ["trainer.total_steps=1000000"], env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        holder = wait_for_holder(run_dir / LOCK_NAME, first.pid, first)
        second = subprocess.run(base + ["trainer.total_steps=1"], env=ENV, capture_output=True, text=True,
                                timeout=TIMEOUT)
        assert second.returncode == 2
        assert one_line(second.stderr) == (
            f"train.py: {run_dir} is in use by train.py (pid {first.pid} on host {socket.gethostname()}, started "
            f"{holder.started}; lock file {run_dir / LOCK_NAME}): wait for it to finish or stop it, or choose "
            f"another folder")
        assert first.poll() is None  # untouched by the refused one
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert Holder.parse((run_dir / LOCK_NAME).read_text()).pid == first.pid  # left behind by the kill
    third = subprocess.run(base + ["trainer.total_steps=1"], env=ENV, capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert third.returncode == 0, third.stderr
    assert (f"took over the stale lock of {run_dir} (train.py, pid {first.pid} on host {socket.gethostname()}, "
            f"started {holder.started}): that process is gone") in third.stderr
    assert not (run_dir / LOCK_NAME).exists()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]


HOLD_BACKEND = '''
"""A test rollout backend: the HF engine, whose generate() first waits until the file $HOLD_RELEASE exists."""
import os
import time

from stapo.rollout import BACKENDS, Backend, register_backend
from stapo.rollout.hf import HFRolloutEngine


class HoldEngine(HFRolloutEngine):
    def generate(self, *args, **kwargs):
        deadline = time.monotonic() + 600
        while not os.path.exists(os.environ["HOLD_RELEASE"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().generate(*args, **kwargs)


register_backend(Backend("hold", "eval_hold_backend:HoldEngine", BACKENDS["hf"].kwargs, model_in_place=True))
'''


def test_a_second_evaluate_py_on_an_output_directory_is_refused(shared_data_root, tmp_path):
    """Other --max-new-tokens → refused (the manifest check cannot race); the same settings → refused as well
    (one writer, rather than every record generated twice); after the first has finished, the manifest decides."""
    module = tmp_path / "eval_hold_backend.py"
    module.write_text(HOLD_BACKEND)
    release = tmp_path / "release"
    out = tmp_path / "eval"
    env = {**ENV, "HOLD_RELEASE": str(release)}
    base = [sys.executable, str(REPO / "evaluate.py"), "--config", str(REPO / "configs/eval/tiny_test.yaml"),
            "--data-root", str(shared_data_root), "--output", str(out), "--backend", "hold",
            f"import_modules=[{module}]", "data.benchmarks=[math500]", "data.limit=1"]
    log = (tmp_path / "first.err").open("w")  # a file, not a pipe: a full pipe would block the first process
    first = subprocess.Popen(base, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        holder = wait_for_holder(out / LOCK_NAME, first.pid, first)
        expected = (f"evaluate.py: error: {out} is in use by evaluate.py (pid {first.pid} on host "
                    f"{socket.gethostname()}, started {holder.started}; lock file {out / LOCK_NAME}): wait for it "
                    f"to finish or stop it, or choose another folder")
        for extra in (["--max-new-tokens", "9"], []):
            second = subprocess.run(base + extra, env=env, capture_output=True, text=True, timeout=TIMEOUT)
            assert second.returncode == 2 and one_line(second.stderr) == expected, extra
        release.write_text("")
        first.wait(timeout=TIMEOUT)
        assert first.returncode == 0, (tmp_path / "first.err").read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        log.close()
    assert not (out / LOCK_NAME).exists()
    records = [json.loads(line) for f in sorted((out / "generations").glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    assert len(records) == 2 * 2  # math500: 1 problem × N=2 × 2 settings, each once
    later = subprocess.run(base + ["--max-new-tokens", "9"], env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert later.returncode == 2 and "max_new_tokens = 8, this run asks for 9" in one_line(later.stderr)


def test_under_torchrun_rank_0_takes_the_lock_and_every_rank_is_told(tmp_path):
    """train.py on 2 ranks (torchrun's environment) on a run directory that this test holds: both ranks exit 2,
    rank 0 prints the one line, rank 1 nothing (it never touches the lock: rank 0 answers for it)."""
    import socket as sock

    with sock.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    run_dir = tmp_path / "r"
    with RunLock(run_dir, "holder.py"):
        procs = []
        for rank in (0, 1):
            env = {**ENV, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny_test.yaml"),
                 f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "data.train_batch_size=4",
                 "actor.ppo_mini_batch_size=2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        errs = [p.communicate(timeout=TIMEOUT)[1] for p in procs]
        assert [p.returncode for p in procs] == [2, 2], errs
        assert one_line(errs[0]).startswith(f"train.py: {run_dir} is in use by holder.py (pid {os.getpid()} on host")
        assert [line for line in errs[1].splitlines() if line.startswith("train.py:")] == []
        assert "Traceback" not in errs[1]
        assert Holder.parse((run_dir / LOCK_NAME).read_text()).pid == os.getpid()  # still ours, untouched
