"""The command-line parser of train.py and evaluate.py (docs/runs.md, "Errors and exit codes")."""
from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose usage errors are one line, as every other start-up error:
    ``train.py: error: argument --limit: invalid int value: 'abc' (see --help)``, exit code 2 (argparse prints
    its whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
