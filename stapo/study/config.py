"""Typed configuration of a study (``python -m stapo.study --config configs/study/<name>.yaml``; docs/study.md).

A study is a grid of methods × seeds run with train.py. The file is loaded like a train config
(:func:`stapo.config.merge_config`: OmegaConf over these dataclasses, unknown keys fail with the closest valid key,
``defaults: [...]`` parents allowed); paths in it (``base``, ``methods.<name>.config``, ``final_eval.config``)
are relative to the study file. Every run's train config is built and checked at load time
(:func:`stapo.config.load_config`), and so is the final evaluation's (when enabled), so a typo in an override fails
before anything runs. Overrides of the keys the runner sets itself (:data:`RUNNER_TRAIN_KEYS`) are refused.

Run ``<method>_seed<k>`` is::

    train.py --config <methods.<name>.config or base> <overrides> <methods.<name>.overrides>
             trainer.seed=<k> trainer.output_dir=<output_dir>/runs trainer.run_name=<method>_seed<k>
             logging.study=<name> logging.method=<method>

so its W&B group is ``<name>-<method>`` (:func:`stapo.run.provenance.default_group`: the seeds of a method share a
group, each method has its own) and it carries the tags ``study:<name>`` and ``family:<config family>``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from stapo.config import ConfigError, TrainConfig, load_config, merge_config
from stapo.study.keys import METRICS

__all__ = ["RUNNER_TRAIN_KEYS", "RUNNER_EVAL_KEYS", "MethodConfig", "ReportConfig", "FinalEvalConfig", "RunnerConfig",
           "StudyConfig", "RunSpec", "load_study_config", "run_specs"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: Train keys the runner sets for every run (:func:`run_specs`; ``logging.group`` follows from ``logging.study`` and
#: ``logging.method``): an override of one in the study is refused.
RUNNER_TRAIN_KEYS = ("trainer.output_dir", "trainer.run_name", "trainer.seed", "logging.group", "logging.study",
                     "logging.method")
#: Evaluation keys the runner sets for a final evaluation (``--model``, ``--label``, ``--output``, the identity).
RUNNER_EVAL_KEYS = ("model.path", "model.label", "output.dir", "logging.group", "logging.study", "logging.method")


def _override_key(override: str) -> str:
    """The dotted key of a ``key=value`` override (a leading ``+`` / ``~`` left out)."""
    return override.split("=", 1)[0].strip().lstrip("+~")


@dataclass
class MethodConfig:
    # A train.py YAML for this method (relative to the study file); null: the study's ``base``.
    config: Optional[str] = None
    # Dotted key=value overrides of this method, applied after the study's shared ``overrides``.
    overrides: list[str] = field(default_factory=list)
    # This method's seeds (null: the study's ``seeds``), e.g. fewer seeds for ablations; differences to the
    # reference are paired over the seeds both have.
    seeds: Optional[list[int]] = None


@dataclass
class ReportConfig:
    window: int = 5  # the final value of a run = the mean over the last W steps at which the metric was logged
    smooth: int = 1  # trailing moving average (steps) applied to each run's curve before averaging; 1 = none
    confidence: float = 0.95  # of the t-bands and the bootstrap intervals
    bootstrap_samples: int = 10_000  # replicates of the paired bootstrap
    bootstrap_seed: int = 0  # the bootstrap's RNG seed (the report is reproducible)
    # Report names of stapo.study.keys.METRICS to report (empty: all of them).
    metrics: list[str] = field(default_factory=list)
    # The figure's comparisons: each a list of methods drawn together in one panel per metric (empty: one panel of
    # every method), e.g. [[grpo, entropy20, justrl, stapo], [stapo, stapo_random]].
    panels: list[list[str]] = field(default_factory=list)


@dataclass
class FinalEvalConfig:
    """An evaluate.py run of each finished run's final checkpoint (both decoding settings by default); off by
    default (the in-training validation, ``trainer.val_every``, is the study's evaluation on the step axis)."""

    enabled: bool = False
    config: Optional[str] = None  # an evaluate.py YAML (relative to the study file), e.g. ../eval/cpu_smollm2.yaml
    overrides: list[str] = field(default_factory=list)  # dotted key=value overrides of that config


@dataclass
class RunnerConfig:
    # Threads a run uses, for the report's CPU-hours where a run's run_info.json does not record its own (and the
    # attempts' wall seconds × threads); null: $OMP_NUM_THREADS if set, else this machine's core count.
    threads: Optional[int] = None
    # A failed run (exit code other than an interrupt's): true stops the grid, false (default) goes on with the
    # next run and exits 1 at the end.
    stop_on_error: bool = False
    # With final_eval: evaluate each run right after its training (true) instead of after the whole grid (false):
    # the final checkpoint is then needed only until its evaluation, so a grid spread over several machines or
    # sessions can keep just the exported small files of its finished runs (python -m stapo.study --export DIR).
    eval_after_each_run: bool = False


@dataclass
class StudyConfig:
    name: str = ""  # the study's name: logging.study of every run (group <name>-<method>), output runs/study/<name>
    base: Optional[str] = None  # the train.py YAML of methods without their own ``config``
    output_dir: Optional[str] = None  # default runs/study/<name> (relative to the current directory)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # trainer.seed of each run (methods.<m>.seeds: its own)
    overrides: list[str] = field(default_factory=list)  # shared dotted overrides (e.g. trainer.total_steps=20)
    methods: dict[str, MethodConfig] = field(default_factory=dict)  # name → its config / overrides (grid order)
    reference: Optional[str] = None  # the method the paired differences are taken against (default: the first)
    report: ReportConfig = field(default_factory=ReportConfig)
    final_eval: FinalEvalConfig = field(default_factory=FinalEvalConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    source: str = ""  # set by load_study_config: the study file (absolute), for messages


@dataclass(frozen=True)
class RunSpec:
    """One run of the grid.

    Attributes:
        method, seed: its cell; name: ``<method>_seed<seed>`` (the run folder's name).
        config: the train YAML (absolute path); overrides: every override train.py gets (without ``--resume``).
        run_dir: ``<output_dir>/runs/<name>``; total_steps: its resolved ``trainer.total_steps``.
        train: the resolved train config.
    """

    method: str
    seed: int
    name: str
    config: str
    overrides: tuple[str, ...]
    run_dir: Path
    total_steps: int
    train: TrainConfig


def _resolve(study_file: Path, path: str) -> str:
    p = Path(path)
    return str(p if p.is_absolute() else (study_file.parent / p).resolve())


def _absolute_paths(study_file: Path, layer) -> None:
    """Make the paths one study file sets (``base``, ``methods.<m>.config``, ``final_eval.config``) absolute against
    that file's folder, before the files are merged: a study that starts from another in another folder
    (``defaults: [../other/study.yaml]``) keeps the parent's paths pointing where the parent meant."""
    if isinstance(layer.get("base"), str):
        layer["base"] = _resolve(study_file, layer["base"])
    methods = layer.get("methods")
    if hasattr(methods, "items"):
        for m in methods.values():
            if hasattr(m, "get") and isinstance(m.get("config"), str):
                m["config"] = _resolve(study_file, m["config"])
    fe = layer.get("final_eval")
    if hasattr(fe, "get") and isinstance(fe.get("config"), str):
        fe["config"] = _resolve(study_file, fe["config"])


def load_study_config(path: str | Path, overrides: list[str] | None = None) -> StudyConfig:
    """Load and check a study config; paths become absolute (relative ones are relative to the study file).

    Raises:
        ConfigError: one line naming the file and the key: a missing or unparsable file, an unknown key, no
            methods or seeds, a method or reference name that is not a folder name / not a method, a method
            without a train config, repeated seeds, bad report values, an override of a key the runner sets
            (:data:`RUNNER_TRAIN_KEYS`, :data:`RUNNER_EVAL_KEYS`), a final-evaluation config that
            :func:`stapo.evaluation.config.load_eval_config` refuses (with its overrides; when
            ``final_eval.enabled``).
    """
    src = Path(path).resolve()
    cfg: StudyConfig = merge_config(StudyConfig, src, overrides, file_layer_hook=_absolute_paths)
    cfg.source = str(src)

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{src}: invalid value for '{key}': {msg}")

    need(bool(cfg.name) and bool(_NAME.match(cfg.name)), "name",
         f"{cfg.name!r} must be a non-empty folder name (letters, digits, '_', '.', '-')")
    need(bool(cfg.methods), "methods", "list at least one method (name → config / overrides)")
    need(bool(cfg.seeds), "seeds", "list at least one seed")
    need(len(set(cfg.seeds)) == len(cfg.seeds), "seeds", f"{cfg.seeds} repeats a seed")
    for name, m in cfg.methods.items():
        need(bool(_NAME.match(name)), f"methods.{name}", "a method name must be a folder name (letters, digits, "
             "'_', '.', '-')")
        need(m.config is not None or cfg.base is not None, f"methods.{name}.config",
             "no train config: give one here or the study's 'base'")
        need(m.seeds is None or (bool(m.seeds) and len(set(m.seeds)) == len(m.seeds)), f"methods.{name}.seeds",
             f"{m.seeds} must be null or a non-empty list without repeats")
    if cfg.reference is None:
        cfg.reference = next(iter(cfg.methods))
    need(cfg.reference in cfg.methods, "reference", f"{cfg.reference!r} is not a method ({', '.join(cfg.methods)})")
    r = cfg.report
    need(r.window >= 1, "report.window", f"{r.window} must be >= 1")
    need(r.smooth >= 1, "report.smooth", f"{r.smooth} must be >= 1")
    need(0 < r.confidence < 1, "report.confidence", f"{r.confidence} must be in (0, 1)")
    need(r.bootstrap_samples >= 1, "report.bootstrap_samples", f"{r.bootstrap_samples} must be >= 1")
    need(cfg.runner.threads is None or cfg.runner.threads >= 1, "runner.threads", "must be >= 1 or null")
    need(not cfg.final_eval.enabled or cfg.final_eval.config is not None, "final_eval.config",
         "an evaluate.py YAML is needed when final_eval.enabled is true")
    owned = [("overrides", cfg.overrides, RUNNER_TRAIN_KEYS)]
    owned += [(f"methods.{name}.overrides", m.overrides, RUNNER_TRAIN_KEYS) for name, m in cfg.methods.items()]
    owned += [("final_eval.overrides", cfg.final_eval.overrides, RUNNER_EVAL_KEYS)]
    for key, overrides, runner_keys in owned:
        taken = [ov for ov in overrides if _override_key(ov) in runner_keys]
        need(not taken, key, f"{taken[0] if taken else ''!r}: the runner sets {', '.join(runner_keys)} itself "
             f"(from the study's output_dir, name, seeds and run names), so an override of them is refused")
    unknown = [m for m in r.metrics if m not in METRICS]
    need(not unknown, "report.metrics", f"unknown {unknown}; known: {', '.join(METRICS)}")
    stray = [m for panel in r.panels for m in panel if m not in cfg.methods]
    need(not stray and all(r.panels), "report.panels",
         f"{stray or 'an empty panel'}: each panel is a non-empty list of the study's methods "
         f"({', '.join(cfg.methods)})")
    if cfg.base is not None:
        cfg.base = _resolve(src, cfg.base)
    for m in cfg.methods.values():
        if m.config is not None:
            m.config = _resolve(src, m.config)
    if cfg.final_eval.config is not None:
        cfg.final_eval.config = _resolve(src, cfg.final_eval.config)
    if cfg.final_eval.enabled:
        _check_final_eval(src, cfg)
    if cfg.output_dir is None:
        cfg.output_dir = str(Path("runs") / "study" / cfg.name)
    return cfg


def _check_final_eval(src: Path, cfg: StudyConfig) -> None:
    """Load the final evaluation's config with its overrides as the runner will pass them
    (:func:`stapo.evaluation.config.load_eval_config`, which validates it), so that a missing file or a bad key
    fails at load time, not after the grid has trained.

    Raises:
        ConfigError: one line: the study file, ``final_eval.config`` / ``final_eval.overrides`` and the evaluation
            config's own message (which names its file or key).
    """
    from stapo.evaluation.config import load_eval_config
    from stapo.evaluation.errors import EvalError

    fe = cfg.final_eval
    assert fe.config is not None
    if not Path(fe.config).is_file():
        raise ConfigError(f"{src}: invalid value for 'final_eval.config': {fe.config} is not a file (an evaluate.py "
                          f"YAML, relative to the study file)")
    try:
        load_eval_config(fe.config, [*fe.overrides, f"logging.group={cfg.name}"])
    except (ConfigError, EvalError) as e:
        raise ConfigError(f"{src}: final_eval (config {fe.config}, overrides {fe.overrides}): {e}") from None


def run_specs(cfg: StudyConfig) -> list[RunSpec]:
    """The grid in run order: seed-major (every method of the first seed, then of the next, ...; a method with its
    own ``seeds`` takes part in the seeds it lists), so a study stopped early holds complete pairs of seeds.

    Raises:
        ConfigError: a run's train config is refused by :func:`stapo.config.load_config` (the message starts with
            the study file and the run's name).
    """
    out = []
    runs = Path(cfg.output_dir) / "runs"
    all_seeds = list(dict.fromkeys([*cfg.seeds, *(sd for m in cfg.methods.values() for sd in m.seeds or [])]))
    for seed in all_seeds:
        for method, m in cfg.methods.items():
            if seed not in (m.seeds if m.seeds is not None else cfg.seeds):
                continue
            name = f"{method}_seed{seed}"
            config = m.config or cfg.base
            assert config is not None
            overrides = (*cfg.overrides, *m.overrides, f"trainer.seed={seed}", f"trainer.output_dir={runs}",
                         f"trainer.run_name={name}", f"logging.study={cfg.name}", f"logging.method={method}")
            try:
                train = load_config(config, list(overrides))
            except ConfigError as e:
                raise ConfigError(f"{cfg.source}: run {name}: {e}") from None
            out.append(RunSpec(method=method, seed=seed, name=name, config=config, overrides=overrides,
                               run_dir=runs / name, total_steps=train.trainer.total_steps, train=train))
    return out
