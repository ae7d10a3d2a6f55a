"""Study runner: a grid of methods × seeds trained with train.py, resumable, with a report of curves and paired
differences (docs/study.md).

    python -m stapo.study --config configs/study/cpu_methods.yaml [--dry-run | --report-only]

:mod:`stapo.study.config` (the typed study config), :mod:`stapo.study.runner` (run states and the grid),
:mod:`stapo.study.report` (report.md / curves.png / curves.csv / final.csv), :mod:`stapo.study.stats` (t-bands and
the paired bootstrap).
"""
from stapo.study.__main__ import main as _main
from stapo.study.config import RunSpec, StudyConfig, load_study_config, run_specs
from stapo.study.report import METRICS, write_report
from stapo.study.runner import describe_plan, run_grid, run_status

__all__ = ["StudyConfig", "RunSpec", "load_study_config", "run_specs", "run_status", "describe_plan", "run_grid",
           "write_report", "METRICS", "main"]


def main(argv: list[str] | None = None) -> int:
    """The ``python -m stapo.study`` command (:mod:`stapo.study.__main__`)."""
    return _main(argv)
