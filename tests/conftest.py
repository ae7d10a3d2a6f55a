"""Shared pytest fixtures."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data_root() -> Path:
    """The real data root (../shared/data beside the repository, or $STAPO_DATA_ROOT)."""
    root = Path(os.environ.get("STAPO_DATA_ROOT", REPO_ROOT.parent / "shared" / "data"))
    if not root.is_dir():
        pytest.fail(f"data root {root} not found: set STAPO_DATA_ROOT or place shared/data beside the repo")
    return root


@pytest.fixture(scope="session", autouse=True)
def _throughput_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Runs the tests start (subprocesses included) record their step times in a temporary throughput cache, not
    in the user's ~/.cache/stapo/throughput.json (stapo/run/throughput.py)."""
    os.environ["STAPO_THROUGHPUT_CACHE"] = str(tmp_path_factory.mktemp("stapo_cache") / "throughput.json")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): tiny
    models are dominated by per-op overhead, so one thread is as fast and immune to a busy second core."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def python_default_signal_handlers():
    """Python's own SIGINT / SIGTERM / SIGHUP handlers for the test, whatever pytest inherited (started in the
    background of a non-interactive shell, `pytest &` or nohup, SIGINT (SIGHUP) is ignored and the trainer rightly
    leaves it so)."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)
