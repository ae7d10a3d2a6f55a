"""The command-line parser of train.py and evaluate.py (docs/runs.md, "Errors and exit codes")."""
from __future__ import annotations

import argparse
import signal
import threading
from typing import Any, NoReturn

__all__ = ["ArgumentParser", "Terminated", "sigterm_as_interrupt", "STOP_SIGNALS", "signal_name",
           "survive_closed_terminal"]

#: Signals that stop a run as Ctrl-C does (finish or abandon the step, checkpoint, one line, exit 128 + signal):
#: SIGTERM (``kill``, a scheduler's preemption) and SIGHUP (the terminal closed, an ssh session dropped). Each only
#: where it has its default action (a process started under ``nohup`` ignores SIGHUP, and keeps ignoring it).
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int) -> str:
    """How the one-line messages name a stop signal: ``SIGTERM``, ``SIGHUP (the terminal closed)``, ..."""
    name = signal.Signals(signum).name
    return f"{name} (the terminal closed)" if signum == signal.SIGHUP else name


class ArgumentParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose usage errors are one line, as every other start-up error:
    ``train.py: error: argument --limit: invalid int value: 'abc' (see --help)``, exit code 2 (argparse prints
    its whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's preemption) or SIGHUP (the terminal closed) received while
    :func:`sigterm_as_interrupt` is in force: unwinds like Ctrl-C (``finally`` blocks run, locks are released); the
    scripts exit with 128 + :attr:`signum` (143, 129)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = int(signum)


class _SurvivingStream:
    """A text stream whose writes and flushes that fail (``OSError``: EIO once the terminal is gone; ``ValueError``:
    closed) are dropped instead of raised, so the clean-up after SIGHUP (the checkpoint, the lock) still runs."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def survive_closed_terminal() -> None:
    """After SIGHUP: ``sys.stdout`` / ``sys.stderr`` drop what they can no longer write (a closed terminal answers
    every write with EIO) rather than raise it in the middle of the step or the checkpoint. Idempotent."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _SurvivingStream):
            setattr(sys, name, _SurvivingStream(stream))


def raise_terminated(signum: int, frame: Any) -> None:
    """The SIGTERM / SIGHUP handler of :func:`sigterm_as_interrupt`."""
    if signum == signal.SIGHUP:
        survive_closed_terminal()
    raise Terminated(signum)


def sigterm_as_interrupt() -> None:
    """Make SIGTERM and SIGHUP (:data:`STOP_SIGNALS`) raise :class:`Terminated` in the main thread (only over the
    default action, which kills the process without running any clean-up: a stale lock, a partial checkpoint). The
    trainer's step loop replaces it with its own graceful handler (:meth:`stapo.run.folder.RunFolder.steps`: finish
    the step, checkpoint, stop)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, raise_terminated)
