"""The command-line parser of train.py and evaluate.py (docs/runs.md, "Errors and exit codes")."""
from __future__ import annotations

import argparse
import signal
import threading
from typing import Any, NoReturn

__all__ = ["ArgumentParser", "Terminated", "sigterm_as_interrupt"]


class ArgumentParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose usage errors are one line, as every other start-up error:
    ``train.py: error: argument --limit: invalid int value: 'abc' (see --help)``, exit code 2 (argparse prints
    its whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's preemption) received while :func:`sigterm_as_interrupt` is in force:
    unwinds like Ctrl-C (``finally`` blocks run, locks are released); the scripts exit with 143."""

    signum = int(signal.SIGTERM)


def raise_terminated(signum: int, frame: Any) -> None:
    """The SIGTERM handler of :func:`sigterm_as_interrupt`."""
    raise Terminated()


def sigterm_as_interrupt() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (only over the default action, which kills the
    process without running any clean-up). The trainer's step loop replaces it with its own graceful handler
    (``stapo.train.trainer``: finish the step, checkpoint, stop)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, raise_terminated)
