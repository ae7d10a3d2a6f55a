"""Typed configuration of evaluate.py: OmegaConf YAML files (``configs/eval/*.yaml``) + dotted overrides.

    python evaluate.py --config configs/eval/cpu_smollm2.yaml data.limit=2 generation.max_new_tokens=256

The schema defaults are the paper's protocol (docs/method.md#evaluation-protocol): the six benchmarks, N = 32 for
AIME24, AIME25
and AMC23 and N = 4 for MATH500, Minerva and OlympiadBench, the two decoding settings (T=1.0, top-p=1.0) and
(T=0.7, top-p=0.9), at most 20,480 new tokens. As for train.py, a YAML file may name parent files with
``defaults: [...]``; an unknown key fails with the closest valid key, a bad value names the key
(:class:`stapo.config.ConfigError`).

Benchmark names accept aliases and any case (``AIME24``, ``minerva``, ``olympiad``, ``MATH-500``); they are
stored canonically (:data:`stapo.tasks.data.BENCHMARKS`).

``import_modules`` (top level) lists Python modules imported before the values are checked, as train.py's
``trainer.import_modules``: a module that registers a rollout backend makes its name valid in ``engine.backend``.
The modules of ``prompt.from_train_config``'s ``trainer.import_modules`` are imported at the same time.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

from stapo.config import (
    ConfigError,
    LoggingConfig,
    TrainConfig,
    check_logging_identity,
    check_registered,
    import_modules,
    merge_config,
)
from stapo.evaluation.errors import EvalError
from stapo.tasks.data import BENCHMARK_REGISTRY, BENCHMARKS, FileSetConfig
from stapo.tasks.synthetic import GENERATED_BENCHMARKS

__all__ = [
    "PAPER_SAMPLES",
    "PAPER_SETTINGS",
    "BENCHMARK_ALIASES",
    "DecodingSetting",
    "EvalModelConfig",
    "EvalPromptConfig",
    "EvalDataConfig",
    "CustomBenchmarkConfig",
    "EvalGenerationConfig",
    "EvalEngineConfig",
    "EvalGraderConfig",
    "VerifierConfig",
    "EvalOutputConfig",
    "EvalLoggingConfig",
    "EvalConfig",
    "canonical_benchmark",
    "load_eval_config",
    "import_eval_modules",
    "validate_eval_config",
    "eval_config_to_dict",
    "checkpoint_selection",
]

#: Samples per problem N (docs/method.md#evaluation-protocol), from :data:`stapo.tasks.data.BENCHMARK_REGISTRY`.
PAPER_SAMPLES: dict[str, int] = {b.name: b.samples for b in BENCHMARK_REGISTRY}

#: Other spellings of the benchmark names (lower case), from :data:`stapo.tasks.data.BENCHMARK_REGISTRY`.
BENCHMARK_ALIASES: dict[str, str] = {alias: b.name for b in BENCHMARK_REGISTRY for alias in b.aliases}


@dataclass
class DecodingSetting:
    """One decoding setting: a name (used in file names and tables), temperature and top-p."""

    name: str = "t1.0_p1.0"
    temperature: float = 1.0
    top_p: float = 1.0


#: The paper's two settings, in table order: "training-aligned" first, the JustRL default in parentheses.
PAPER_SETTINGS = (DecodingSetting("t1.0_p1.0", 1.0, 1.0), DecodingSetting("t0.7_p0.9", 0.7, 0.9))


@dataclass
class EvalModelConfig:
    # A local HF folder, a train.py checkpoint (runs/<name>/checkpoints/step_XXXXXX) or run folder (its latest
    # checkpoint), a hub id, "embedded:smollm2", or "tiny" (a random tiny model, tests only).
    path: str = "embedded:smollm2"
    label: Optional[str] = None  # row name in tables; default derived from the path
    # "auto": bfloat16 where the device computes it natively (AVX512-BF16 / AMX CPUs, bf16 GPUs), else float32 — the
    # rule of the training configs' model.compute_dtype (stapo.model.precision.resolve_compute_dtype); resolved at load
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    cache_dir: Optional[str] = None  # where the embedded model is converted to
    # Which checkpoints of a train.py run (model.path: the run folder, its checkpoints/ or one of them) to evaluate,
    # each in turn at its training step (a sweep, stapo.evaluation.sweep; evaluate.py --all-checkpoints): null — just
    # the model model.path names (a run folder: its latest intact checkpoint); "all"; "latest"; or a list of
    # training steps ([20, 40]). Resumable: a rerun skips the checkpoints already evaluated.
    checkpoints: Any = None


@dataclass
class EvalPromptConfig:
    # The boxed prompt of training (stapo.tasks.prompts). Resolution, later wins: "auto" and no system prompt →
    # from_train_config → the run config of a train.py checkpoint (from_checkpoint) → style / system_prompt.
    style: Optional[Literal["auto", "chat", "plain"]] = None
    system_prompt: Optional[str] = None  # "" forces no system prompt
    from_train_config: Optional[str] = None  # a train.py YAML: take its data.prompt_style / data.system_prompt
    from_checkpoint: bool = True


@dataclass
class CustomBenchmarkConfig(FileSetConfig):
    """A benchmark from the user's own file (``data.custom_benchmarks.<name>``): the file and its field mapping
    (:class:`stapo.tasks.data.FileSetConfig`) plus its samples per problem N (``data.samples.<name>`` wins when set).
    It is evaluated when ``<name>`` is listed in ``data.benchmarks``."""

    samples: int = 4


@dataclass
class EvalDataConfig:
    root: str = "data"  # data root with benchmarks/<name>/test.jsonl (tests use ../shared/data)
    benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    limit: Optional[int] = None  # evaluate the first K problems of each benchmark
    samples: dict[str, int] = field(default_factory=lambda: dict(PAPER_SAMPLES))  # N per benchmark
    max_prompt_tokens: Optional[int] = None  # longer prompts are skipped (and counted); null keeps all
    # a benchmark file whose gold answers math-verify (the grader's parser) cannot parse is reported in one line
    # (file, count, first rows; stapo/tasks/golds.py; their responses graded 'error', never 'incorrect') and refused
    # above this fraction of its rows (0 refuses any, 1 accepts all). The shipped files: at most 2.2 % (Minerva).
    max_unparsable_gold_fraction: float = 0.05
    # {name: CustomBenchmarkConfig}: benchmarks from your own files (docs/extending.md); list them in benchmarks
    custom_benchmarks: dict[str, CustomBenchmarkConfig] = field(default_factory=dict)


@dataclass
class EvalGenerationConfig:
    settings: list[DecodingSetting] = field(default_factory=lambda: [dataclasses.replace(s) for s in PAPER_SETTINGS])
    max_new_tokens: int = 20480
    seed: int = 0
    samples_per_call: int = 256  # responses per engine call (whole problems); also the unit of resumption


@dataclass
class EvalEngineConfig:
    backend: str = "vllm"  # a registered rollout backend (stapo.rollout.BACKENDS: vllm, hf, or one registered)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # HF backend: where the model runs
    max_model_len: Optional[int] = None  # vLLM; default: longest prompt + max_new_tokens, capped by the model
    kv_cache_gib: float = 4.0  # vLLM on CPU
    gpu_memory_utilization: float = 0.85  # vLLM on GPU
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    max_num_seqs: Optional[int] = None  # vLLM: concurrent sequences (engine default 128 on CPU)
    hf_max_batch_size: Optional[int] = None  # HF: rows per generate call


@dataclass
class EvalGraderConfig:
    num_workers: int = 2
    timeout_s: float = 5.0
    # an answer math-verify finds equivalent but still an unevaluated expression ("9 + 5" for 14) is incorrect
    # (stapo.tasks.grader.is_unevaluated_expression; the math_verify_value training reward); for the synthetic
    # benchmarks
    require_value: bool = False


@dataclass
class VerifierConfig:
    # Optional LLM-verifier fallback (the paper uses CompassVerifier-3B) for answers the rules reject.
    enabled: bool = False
    model: str = "opencompass/CompassVerifier-3B"
    backend: Literal["hf", "vllm"] = "hf"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    max_new_tokens: int = 8
    max_response_chars: int = 4000  # the tail of the response shown to the verifier
    batch_size: int = 32
    prompt_template: Optional[str] = None  # {question} {gold_answer} {response}; default stapo's A/B/C prompt
    apply_to: list[str] = field(default_factory=lambda: ["incorrect", "no_answer"])


@dataclass
class EvalOutputConfig:
    dir: Optional[str] = None  # default: <root>/<label>
    root: str = "runs/eval"
    plot: bool = True


@dataclass
class EvalLoggingConfig(LoggingConfig):
    """The train config's logging section (``wandb_mode``, ``wandb_fallback``, ``project``, ``entity``, the
    identity, ``backends``: without ``wandb`` no W&B run, with ``tensorboard`` the points also in
    ``<output>/tensorboard``) plus the progress bar: true, false or ``auto`` (bars only when stdout and stderr are
    terminals, as ``trainer.progress_bar``: no cursor-code lines in a Slurm or nohup log). ``system_metrics`` and
    ``console_capture`` do not apply: the evaluation's W&B run opens after the evaluation finished, to log it."""

    progress_bar: Any = "auto"


@dataclass
class EvalConfig:
    # Python modules imported before the values are checked (the same rule and function as train.py's
    # trainer.import_modules, stapo.config.import_modules): dotted names or paths to .py files. A module that
    # registers a rollout backend makes its name valid in engine.backend (and in evaluate.py's --backend).
    import_modules: list[str] = field(default_factory=list)
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    prompt: EvalPromptConfig = field(default_factory=EvalPromptConfig)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    generation: EvalGenerationConfig = field(default_factory=EvalGenerationConfig)
    engine: EvalEngineConfig = field(default_factory=EvalEngineConfig)
    grader: EvalGraderConfig = field(default_factory=EvalGraderConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    output: EvalOutputConfig = field(default_factory=EvalOutputConfig)
    logging: EvalLoggingConfig = field(default_factory=EvalLoggingConfig)


# --- benchmark names ----------------------------------------------------------------------------------
def canonical_benchmark(name: str, custom: Iterable[str] = ()) -> str:
    """The canonical name of a benchmark (:data:`stapo.tasks.data.BENCHMARKS`) from any case or alias, or ``name``
    itself when it is one of the ``custom`` benchmark names (``data.custom_benchmarks``; exact spelling).

    Raises:
        EvalError: an unknown name (the message lists the known names and the closest one).
    """
    custom = list(custom)
    if str(name).strip() in custom:
        return str(name).strip()
    key = str(name).strip().lower()
    key = BENCHMARK_ALIASES.get(key, key)
    if key in BENCHMARKS or key in GENERATED_BENCHMARKS:
        return key
    known = [*BENCHMARKS, *GENERATED_BENCHMARKS, *custom]
    close = difflib.get_close_matches(key, known + list(BENCHMARK_ALIASES), n=1, cutoff=0.6)
    hint = f" (did you mean {BENCHMARK_ALIASES.get(close[0], close[0])!r}?)" if close else ""
    raise EvalError(f"unknown benchmark {name!r}{hint}; known: {', '.join(known)}")


# --- loading ------------------------------------------------------------------------------------------
def load_eval_config(path: str | Path | None = None, overrides: list[str] | None = None) -> EvalConfig:
    """Build a validated :class:`EvalConfig` from a YAML file (with ``defaults`` parents) and overrides.

    Args:
        path: YAML file (``configs/eval/*.yaml``), or ``None`` for the schema defaults (the paper protocol).
        overrides: dotted ``key=value`` strings applied last (e.g. ``data.limit=2``,
            ``data.samples.aime24=4``, ``data.benchmarks=[aime24,math500]``).

    Returns:
        :class:`EvalConfig` (plain dataclasses), benchmark names canonicalised.

    Raises:
        ConfigError: missing / unparsable file, unknown key (with the closest valid key), wrong type.
        EvalError: a module of ``import_modules`` (or of ``prompt.from_train_config``'s ``trainer.import_modules``)
            that cannot be imported, an impossible value (see :func:`validate_eval_config`).
    """
    obj = merge_config(EvalConfig, path, overrides)
    validate_eval_config(obj)
    return obj


def import_eval_modules(cfg: EvalConfig) -> None:
    """Import the modules of ``import_modules``, then those of the ``trainer.import_modules`` of the train config
    named by ``prompt.from_train_config`` (:func:`stapo.config.import_modules`; a module already imported is not
    run again), so that what they register (a rollout backend) is known when the values are checked.

    Raises:
        EvalError: one line naming the key and the module (``prompt.from_train_config: invalid value for
            'trainer.import_modules' ...`` for the train config's), or the train config cannot be read.
    """
    try:
        import_modules(cfg.import_modules, "import_modules")
    except ConfigError as e:
        raise EvalError(str(e)) from None
    if cfg.prompt.from_train_config:
        try:
            train = merge_config(TrainConfig, cfg.prompt.from_train_config, None)
            import_modules(train.trainer.import_modules, "trainer.import_modules")
        except ConfigError as e:
            raise EvalError(f"prompt.from_train_config: {e}") from None


def validate_eval_config(cfg: EvalConfig) -> None:
    """Import the config's modules (:func:`import_eval_modules`), then check values that types cannot express;
    canonicalise benchmark names and ``data.samples`` keys (in place).

    Raises:
        EvalError: naming the key — a module that cannot be imported, an unregistered ``engine.backend``, unknown
            benchmark, a benchmark without N, duplicate setting names, a temperature < 0 or not finite, a
            temperature of 0 (greedy) with some N > 1 (N identical samples), top-p outside (0, 1], non-positive
            sizes or limits, ``data.max_unparsable_gold_fraction`` outside [0, 1], a ``logging`` identity past
            W&B's limits or ``logging.backends`` not a list of wandb / tensorboard (or ``[none]``)
            (:func:`stapo.config.check_logging_identity`).
    """
    import_eval_modules(cfg)  # they may register the rollout backend checked below

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise EvalError(f"invalid value for '{key}': {msg}")

    from stapo.rollout import BACKENDS

    try:
        check_registered("engine.backend", cfg.engine.backend, "rollout backend", BACKENDS)
        check_logging_identity(cfg.logging, "logging")  # W&B's limits; logging.backends as train.py's
    except ConfigError as e:
        raise EvalError(str(e)) from None
    cfg.model.checkpoints = checkpoint_selection(cfg.model.checkpoints)
    if cfg.model.dtype == "auto":  # the training rule: bf16 where native (results/benchmarks/train_step.md)
        import torch

        from stapo.model.precision import resolve_compute_dtype

        cuda = cfg.engine.device != "cpu" and torch.cuda.is_available()
        cfg.model.dtype = resolve_compute_dtype("auto", "cuda" if cuda else "cpu")
    need(isinstance(cfg.logging.progress_bar, bool) or cfg.logging.progress_bar == "auto", "logging.progress_bar",
         f"must be true, false or auto, got {cfg.logging.progress_bar!r}")
    need(len(cfg.data.benchmarks) > 0, "data.benchmarks", "at least one benchmark is needed")
    custom = cfg.data.custom_benchmarks
    for cname in custom:
        need(bool(cname) and all(c.isalnum() or c in "._-" for c in cname), f"data.custom_benchmarks.{cname}",
             "the name must be non-empty letters, digits, '.', '_' or '-' (it names files)")
        clash = cname.lower() in BENCHMARKS or cname.lower() in BENCHMARK_ALIASES or cname.lower() in GENERATED_BENCHMARKS
        need(not clash, f"data.custom_benchmarks.{cname}", "the name is a built-in benchmark or alias")
        need(custom[cname].samples >= 1, f"data.custom_benchmarks.{cname}.samples", "N must be >= 1")
    names = [canonical_benchmark(b, custom) for b in cfg.data.benchmarks]
    need(len(set(names)) == len(names), "data.benchmarks", f"duplicate benchmark in {cfg.data.benchmarks}")
    cfg.data.benchmarks = names
    samples: dict[str, int] = {name: g.samples for name, g in GENERATED_BENCHMARKS.items() if name in names}
    samples.update({name: entry.samples for name, entry in custom.items()})
    for key, n in cfg.data.samples.items():
        samples[canonical_benchmark(key, custom)] = int(n)
    for name in names:
        need(name in samples, f"data.samples.{name}", "no samples-per-problem N for this benchmark")
        need(samples[name] >= 1, f"data.samples.{name}", f"N must be >= 1, got {samples[name]}")
    cfg.data.samples = samples
    need(cfg.data.limit is None or cfg.data.limit >= 1, "data.limit", f"must be >= 1 or null, got {cfg.data.limit}")
    need(cfg.data.max_prompt_tokens is None or cfg.data.max_prompt_tokens >= 1, "data.max_prompt_tokens",
         "must be >= 1 or null")
    need(0 <= cfg.data.max_unparsable_gold_fraction <= 1, "data.max_unparsable_gold_fraction",
         f"must be in [0, 1] (a fraction of a benchmark file's rows), got {cfg.data.max_unparsable_gold_fraction}")
    settings = cfg.generation.settings
    need(len(settings) > 0, "generation.settings", "at least one decoding setting is needed")
    seen: set[str] = set()
    for i, s in enumerate(settings):
        need(bool(s.name) and all(c.isalnum() or c in "._-" for c in s.name), f"generation.settings[{i}].name",
             f"{s.name!r} must be non-empty letters, digits, '.', '_' or '-' (it names files)")
        need(s.name not in seen, f"generation.settings[{i}].name", f"duplicate setting name {s.name!r}")
        seen.add(s.name)
        need(math.isfinite(s.temperature) and s.temperature >= 0, f"generation.settings[{i}].temperature",
             f"must be a finite number >= 0, got {s.temperature}")
        need(0 < s.top_p <= 1, f"generation.settings[{i}].top_p", f"must be in (0, 1], got {s.top_p}")
        several = {b: n for b, n in samples.items() if b in names and n > 1}
        need(s.temperature > 0 or not several, f"generation.settings[{i}].temperature",
             f"0 is greedy decoding: its N samples of a problem are identical, and data.samples asks for "
             f"{', '.join(f'{b}={n}' for b, n in several.items())}; set data.samples.<benchmark>=1 for greedy "
             f"(avg@1), or a temperature > 0")
    need(cfg.generation.max_new_tokens >= 1, "generation.max_new_tokens", "must be >= 1")
    need(cfg.generation.samples_per_call >= 1, "generation.samples_per_call", "must be >= 1")
    need(cfg.generation.seed >= 0, "generation.seed", "must be >= 0")
    need(cfg.grader.num_workers >= 1, "grader.num_workers", "must be >= 1")
    need(cfg.grader.timeout_s > 0, "grader.timeout_s", "must be > 0")
    need(cfg.engine.max_model_len is None or cfg.engine.max_model_len >= 2, "engine.max_model_len", "must be >= 2")
    need(cfg.engine.kv_cache_gib > 0, "engine.kv_cache_gib", "must be > 0")
    need(cfg.verifier.max_new_tokens >= 1, "verifier.max_new_tokens", "must be >= 1")
    need(cfg.verifier.batch_size >= 1, "verifier.batch_size", "must be >= 1")
    bad = [s for s in cfg.verifier.apply_to if s not in ("incorrect", "no_answer", "timeout", "error")]
    need(not bad, "verifier.apply_to", f"unknown grader status {bad}; use incorrect, no_answer, timeout, error")


def checkpoint_selection(value: Any) -> str | list[int] | None:
    """``model.checkpoints`` normalised: ``None``, ``"all"``, ``"latest"``, or a sorted list of distinct training
    steps (from a list, one integer, or a string of comma-separated integers such as ``"20,40"``).

    Raises:
        EvalError: anything else (one line naming the key and the accepted forms).
    """
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("all", "latest"):
            return text
        value = [v for v in text.split(",") if v.strip()]
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        steps = sorted({int(v) for v in items if not isinstance(v, bool) and str(v).strip().lstrip("+").isdigit()})
    except (TypeError, ValueError):
        steps = []
    if not items or len(steps) != len({str(v).strip() for v in items}):
        raise EvalError(f"invalid value for 'model.checkpoints' ({given!r}): use all, latest, or a list of "
                        f"training steps such as [20, 40]")
    return steps


def eval_config_to_dict(cfg: EvalConfig) -> dict[str, Any]:
    """The config as a plain nested dict (for results.json and W&B)."""
    return dataclasses.asdict(cfg)
