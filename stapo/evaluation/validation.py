"""In-training validation: the evaluation harness on a small benchmark subset, as a ``Trainer`` hook.

``stapo.train.Trainer(cfg, validation_hook=hook)`` calls ``hook(trainer, step)`` every ``trainer.val_every``
steps, after the new weights were synced into the rollout engine, and logs the returned dict; with
``trainer.val_before_train`` also once at step 0, before the first update (verl's key of that name). The hook samples
with the trainer's own engine (``trainer.engine``), tokenizer and training prompt (``cfg.data.prompt_style``,
``cfg.data.system_prompt``), grades with math-verify and computes the same metrics as ``evaluate.py``
(:func:`stapo.evaluation.runner.evaluate_problems`); the generations go to
``<run_dir>/validation/step_XXXXXX/generations/*.jsonl`` (resumable like an evaluation run), the metrics to
``.../metrics.json`` and the generation settings to ``.../validation_manifest.json`` (a step folder left with other
settings is emptied before it is resumed).

Under ``torchrun`` (W > 1 ranks, ``trainer.dist``) every rank calls the hook (it is collective): each block of the
validation's engine calls is split over the ranks' engines, each rank grades its share with its own grader pool,
rank 0 gathers the records and writes the step's files, and every rank returns the same metrics — those of one
process (:func:`stapo.evaluation.runner.evaluate_problems` with ``ctx``; the samples follow the seed of each
problem's position in its block, not the rank). With the HF backend on an FSDP2-sharded policy the ranks' calls are
padded to the same size (``lockstep``), since every decode step all-gathers the parameters.

Returned keys (verl's validation layout, shared with the verl plugin's runs; docs/metrics.md):
``val-core/<benchmark>/acc/{mean,pass,maj}@<N>`` (mean@N = avg@N), ``val-core/average/acc/mean@<N>``,
``val-aux/response_length/{mean,clip_ratio}``, ``val-aux/grader/{no_answer_rate,timeouts,errors}`` and
``val-aux/<benchmark>/dropped_long_prompt``; with several decoding settings the second segment is
``<benchmark>@<setting>`` (``average@<setting>``, ``grader@<setting>``...).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from tqdm import tqdm

from stapo.evaluation.config import PAPER_SETTINGS, DecodingSetting, canonical_benchmark
from stapo.evaluation.errors import EvalError
from stapo.evaluation.metrics import validation_metrics
from stapo.evaluation.runner import (
    PromptSpec,
    _error_line,
    _raise_any,
    encode_problems,
    evaluate_problems,
    load_problems,
)

__all__ = ["ValidationHook", "make_validation_hook", "make_validation_hook_from_config", "validation_metrics"]

MANIFEST = "validation_manifest.json"  # a step folder's generation settings (ValidationHook._claim)


def _settings(settings: Sequence[Any] | None) -> list[DecodingSetting]:
    if settings is None:
        return [DecodingSetting(PAPER_SETTINGS[0].name, PAPER_SETTINGS[0].temperature, PAPER_SETTINGS[0].top_p)]
    out = []
    for s in settings:
        if isinstance(s, DecodingSetting):
            out.append(s)
        elif isinstance(s, str):
            match = [p for p in PAPER_SETTINGS if p.name == s]
            if not match:
                raise EvalError(f"unknown decoding setting {s!r}; named settings: {[p.name for p in PAPER_SETTINGS]}")
            out.append(DecodingSetting(match[0].name, match[0].temperature, match[0].top_p))
        else:
            t, p = (float(x) for x in s)
            out.append(DecodingSetting(f"t{t}_p{p}", t, p))
    return out


class ValidationHook:
    """``fn(trainer, step) -> dict[str, float]`` running the evaluation harness on a subset.

    Args:
        benchmarks: benchmark names (aliases allowed).
        limit: first K problems of each benchmark (``None`` = all).
        samples: N per problem — an int for every benchmark, or ``{benchmark: N}``.
        settings: decoding settings: :class:`~stapo.evaluation.config.DecodingSetting`, a paper setting name
            (``"t1.0_p1.0"``, ``"t0.7_p0.9"``) or a ``(temperature, top_p)`` pair; default the first paper setting.
        max_new_tokens: generation limit; default (and at most) the trainer's ``rollout.response_length``,
            which with ``data.max_prompt_length`` sizes the vLLM engine's context.
        data_root: benchmark data root; default the trainer's ``cfg.data.root``.
        samples_per_call, seed: see :func:`stapo.evaluation.runner.evaluate_problems`.
        grader_workers, grader_timeout_s: the math-verify grader pool (created on first use, reused).
        grader_require_value: grade unevaluated expressions as incorrect (``MathGrader(require_value=True)``);
            :func:`make_validation_hook_from_config` sets it when the training reward is ``math_verify_value``.
        subdir: output folder under the trainer's run directory.
        prefix: metric-name prefix: the sections are ``<prefix>-core`` and ``<prefix>-aux``.

    Prompts longer than the trainer's ``data.max_prompt_length`` are skipped (they do not fit the engine), and
    counted in ``<prefix>-aux/<benchmark>/dropped_long_prompt``.

    Raises:
        EvalError: unknown benchmark or setting (at construction); missing data (at the first call).
    """

    def __init__(self, *, benchmarks: Sequence[str] = ("math500",), limit: int | None = 32,
                 samples: int | Mapping[str, int] = 4, settings: Sequence[Any] | None = None,
                 max_new_tokens: int | None = None, data_root: str | None = None, samples_per_call: int = 256,
                 seed: int = 0, grader_workers: int = 1, grader_timeout_s: float = 5.0, subdir: str = "validation",
                 prefix: str = "val", grader_require_value: bool = False) -> None:
        self.benchmarks = [canonical_benchmark(b) for b in benchmarks]
        if isinstance(samples, Mapping):
            canon = {canonical_benchmark(k): int(v) for k, v in samples.items()}
            missing = [b for b in self.benchmarks if b not in canon]
            if missing:
                raise EvalError(f"validation samples: no N for {missing}")
            self.samples = {b: canon[b] for b in self.benchmarks}
        else:
            self.samples = {b: int(samples) for b in self.benchmarks}
        if any(n < 1 for n in self.samples.values()):
            raise EvalError(f"validation samples must be >= 1, got {self.samples}")
        if limit is not None and limit < 1:
            raise EvalError(f"validation limit must be >= 1 or None, got {limit}")
        self.limit = limit
        self.settings = _settings(settings)
        several = {b: n for b, n in self.samples.items() if n > 1}
        greedy = [s.name for s in self.settings if s.temperature == 0]
        if greedy and several:
            raise EvalError(f"invalid value for 'validation.temperature': 0 (setting {greedy[0]!r}) is greedy "
                            f"decoding, whose N samples of a problem are identical, and validation.samples is "
                            f"{max(several.values())}; set validation.samples=1 for greedy, or a temperature > 0")
        self.max_new_tokens = max_new_tokens
        self.data_root = data_root
        self.samples_per_call = int(samples_per_call)
        self.seed = int(seed)
        self.grader_workers = int(grader_workers)
        self.grader_timeout_s = float(grader_timeout_s)
        self.grader_require_value = bool(grader_require_value)
        self.subdir = subdir
        self.prefix = prefix
        self._grader = None
        self._problems: dict[str, Any] | None = None
        self._dropped: dict[str, int] = {}
        if data_root is not None:  # fail before training starts, not after val_every steps
            from stapo.evaluation.runner import load_problems

            self._raw_problems = load_problems(data_root, self.benchmarks, self.limit)

    def _load(self, trainer: Any) -> dict[str, Any]:
        if self._problems is None:
            dc = trainer.cfg.data
            problems = getattr(self, "_raw_problems", None) or load_problems(self.data_root or dc.root,
                                                                             self.benchmarks, self.limit)
            prompt = PromptSpec(style=dc.prompt_style, system_prompt=dc.system_prompt, source="train config")
            self._dropped = encode_problems(problems, trainer.tokenizer, prompt, dc.max_prompt_length)
            for bench, n in self._dropped.items():
                if n and _is_main(trainer):
                    # one plain line on stderr (tqdm.write: above a live progress bar), like the trainer's notices
                    tqdm.write(f"validation: {n} {bench} prompt(s) longer than data.max_prompt_length="
                               f"{dc.max_prompt_length} tokens are skipped", file=sys.stderr)
            self._problems = problems
        return self._problems

    def __call__(self, trainer: Any, step: int) -> dict[str, float]:
        """Validate the trainer's current policy; returns flat metrics (keys in the module docstring).

        Collective under ``torchrun`` (``trainer.dist`` with W > 1): every rank calls it, generates and grades its
        share, and returns the same dict; rank 0 writes the files. An error on one rank is raised on every rank.
        """
        limit = int(trainer.cfg.rollout.response_length)
        max_new = min(int(self.max_new_tokens), limit) if self.max_new_tokens else limit
        out_dir = Path(trainer.run_dir) / self.subdir / f"step_{int(step):06d}"
        ctx = getattr(trainer, "dist", None)
        sharded = bool(getattr(ctx, "enabled", False))
        main = _is_main(trainer)
        error = None
        try:  # W > 1: an error here on one rank is told to every rank below (none may wait forever)
            problems = self._load(trainer)
            if self._grader is None:
                from stapo.tasks.grader import MathGrader

                self._grader = MathGrader(num_workers=self.grader_workers, timeout_s=self.grader_timeout_s,
                                          require_value=self.grader_require_value)
            if main:
                self._claim(out_dir, trainer, max_new)
        except Exception as e:  # noqa: BLE001
            if not sharded:
                raise
            error = e
        if sharded:
            from stapo.model.distributed import gather_objects

            _raise_any(gather_objects(None if error is None else _error_line(error), ctx), error, "validation")
        wake = getattr(trainer, "wake_engine", None)  # the engine awake (a no-op after a step's weight sync)
        if callable(wake):
            wake()
        # HF generate on an FSDP2-sharded policy all-gathers at every decode step: the ranks' calls must match
        lockstep = sharded and ctx.strategy == "fsdp2" and getattr(trainer.engine, "backend", None) == "hf"
        model = getattr(trainer, "model", None)
        was_training = bool(getattr(model, "training", False))
        if model is not None:
            model.eval()
        try:
            res = evaluate_problems(trainer.engine, self._grader, problems, samples=self.samples,
                                    settings=self.settings, max_new_tokens=max_new, out_dir=out_dir, seed=self.seed,
                                    samples_per_call=self.samples_per_call, ctx=ctx if sharded else None,
                                    lockstep=lockstep)
        finally:
            if model is not None:
                model.train(was_training)
        if main:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / "metrics.json").write_text(json.dumps(
                    {"step": int(step), "metrics": res["metrics"], "run": res["run"],
                     "dropped_long_prompt": self._dropped}, indent=2, default=lambda x: None))
            except Exception as e:  # noqa: BLE001 - W > 1: told to every rank (none may wait forever)
                if not sharded:
                    raise
                error = e
        if sharded:
            from stapo.model.distributed import gather_objects

            _raise_any(gather_objects(None if error is None else _error_line(error), ctx), error, "validation")
        return self._flatten(res["metrics"])

    def _claim(self, out_dir: Path, trainer: Any, max_new: int) -> None:
        """Rank 0, before generating: the step folder's generation settings (``validation_manifest.json``). A folder
        left with other settings (a crash in the step-0 validation, restarted with a changed ``validation.*`` or
        prompt) is emptied first (one line on stderr), so its store never resumes samples of other settings."""
        import shutil

        dc = trainer.cfg.data
        want = {"seed": self.seed, "samples": self.samples, "samples_per_call": self.samples_per_call,
                "max_new_tokens": int(max_new), "prompt_style": dc.prompt_style, "system_prompt": dc.system_prompt,
                "settings": [[s.name, float(s.temperature), float(s.top_p)] for s in self.settings]}
        path = out_dir / MANIFEST
        if path.is_file():
            try:
                have = json.loads(path.read_text())
            except ValueError:
                have = None
            if have == want:
                return
            tqdm.write(f"validation: {out_dir} holds generations of other settings; they are removed",
                       file=sys.stderr)
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(want, indent=2))

    def _flatten(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        return validation_metrics(metrics, self._dropped, prefix=self.prefix)

    def close(self) -> None:
        """Stop the grader pool (also stopped at interpreter exit)."""
        if self._grader is not None:
            self._grader.close()
            self._grader = None


def _is_main(trainer: Any) -> bool:
    """Rank 0 of ``trainer.dist`` (True without one: one process)."""
    return bool(getattr(getattr(trainer, "dist", None), "is_main", True))


def make_validation_hook(**kwargs: Any) -> ValidationHook:
    """A :class:`ValidationHook` (keyword arguments as its constructor) for
    ``Trainer(cfg, validation_hook=make_validation_hook(...))``."""
    return ValidationHook(**kwargs)


def make_validation_hook_from_config(cfg: Any) -> ValidationHook | None:
    """The hook described by a train config, or ``None`` when ``trainer.val_every == 0`` and
    ``trainer.val_before_train`` is false (the trainer calls it at step 0 for the latter).

    Reads ``cfg.validation`` when the schema has it (fields ``benchmarks``, ``limit``, ``samples``,
    ``temperature``, ``top_p``, ``max_new_tokens``, ``seed``, ``samples_per_call``); otherwise uses the
    :class:`ValidationHook` defaults (MATH500, first 32 problems, N = 4, T = 1.0, top-p = 1.0). Validation grades
    with the training reward's answer rule: ``algorithm.reward: math_verify_value`` → ``grader_require_value=True``.
    """
    if not getattr(cfg.trainer, "val_every", 0) and not getattr(cfg.trainer, "val_before_train", False):
        return None
    vc = getattr(cfg, "validation", None)
    require_value = getattr(getattr(cfg, "algorithm", None), "reward", None) == "math_verify_value"
    if vc is None:
        return ValidationHook(grader_require_value=require_value)
    return ValidationHook(benchmarks=list(vc.benchmarks), limit=vc.limit, samples=int(vc.samples),
                          settings=[(float(vc.temperature), float(vc.top_p))], max_new_tokens=vc.max_new_tokens,
                          seed=int(vc.seed), samples_per_call=int(getattr(vc, "samples_per_call", 256)),
                          data_root=getattr(getattr(cfg, "data", None), "root", None),
                          grader_require_value=require_value)
