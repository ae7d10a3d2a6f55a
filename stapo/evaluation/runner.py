"""The evaluation run: problems → blocks → engine → grader (→ verifier) → JSONL → metrics → reports.

:func:`run_evaluation` is what ``evaluate.py`` calls; :func:`evaluate_problems` is the engine-level core that the
in-training validation hook (:mod:`stapo.evaluation.validation`) shares.

Run directory (``output.dir``, default ``runs/eval/<label>``)::

    run.lock                              held while a process evaluates into it (stapo.run.runlock; one writer)
    eval_manifest.json                    what the generations were made with (checked on every rerun)
    generations/<benchmark>__<setting>.jsonl   one line per sample (fields below)
    results.json  results.md  results.csv  results.png   metrics and reports (stapo.evaluation.report)
    metrics.jsonl  tables.jsonl  wandb/   the W&B summary (stapo.run.tracking.Tracker; offline by default), at the
                                          checkpoint's training step in its training run's group (report.log_wandb)
    wandb_run_id  wandb_logged.json       its W&B run id, and the points logged to it (a rerun logs only new ones)

A JSONL record holds: ``problem_id, sample`` (0..N−1; the unique key), ``benchmark, setting, problem_index,
block, seed, temperature, top_p, gold, response, prompt_tokens, response_tokens, finish_reason`` (``"eos"`` /
``"length"``), ``extracted`` (the graded answer or null), ``status`` (the rule-based grader's verdict:
correct / incorrect / no_answer / timeout / error), ``grader_error``, ``grade_seconds``, ``verifier_verdict``
(A/B/C/null), ``verifier_accepted``, ``verifier_raw`` (its output, null when not asked) and ``correct`` (the
final verdict: rule-based correct, or accepted by the verifier).

Blocks and resumption. For each decoding setting the problems of the benchmarks that share an N are taken in
benchmark order and cut into blocks of ``floor(samples_per_call / N)`` problems (at least one); one block is
one ``engine.generate`` call (N samples per problem) seeded from (``generation.seed``, setting, N, the
block's problem ids), then graded and appended to the JSONL files in one write per file. A rerun skips every
problem whose N samples are all stored; a block some of whose samples were written before a crash is
generated again whole (same composition and seed → the same samples; only the missing ones are written), so
a killed and resumed run ends with exactly the generations of an uninterrupted one. Changing the model, the
prompt, the backend, the dtype, ``max_new_tokens``, ``seed``, ``samples_per_call``, an N or a setting's
temperature / top-p for an existing run directory is refused (:class:`~stapo.evaluation.errors.EvalError`);
adding benchmarks, settings or raising ``--limit`` extends it.

One writer. :func:`run_evaluation` holds the run directory's lock (``run.lock``, :mod:`stapo.run.runlock`) from the
manifest check to the last report, so a second process on the same directory is refused with one line naming the
holder (:class:`~stapo.evaluation.errors.EvalError`) — with other generation settings (the manifest check would
otherwise race) and with the same ones (it would duplicate the work) alike. A lock left by a dead process is
taken over, saying so.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from stapo.common.fingerprint import write_fingerprint
from stapo.config import ConfigError
from stapo.evaluation.config import DecodingSetting, EvalConfig, eval_config_to_dict, validate_eval_config
from stapo.evaluation.errors import EvalError
from stapo.evaluation.identity import content_key, data_part, eval_fingerprint, model_part
from stapo.evaluation.metrics import GRADER_STATUSES, average_over_benchmarks, summarize_benchmark
from stapo.evaluation.model_source import ModelSource, resolve_model_source
from stapo.evaluation.report import log_wandb, write_train_summary
from stapo.evaluation.store import GenerationStore
from stapo.run.console import use_progress_bars
from stapo.run.preflight import check_chat_template, check_device, check_tokenizer, os_reason
from stapo.run.runlock import LOCK_NAME, RunLock, RunLockError
from stapo.tasks.data import (
    BENCHMARKS,
    PAPER_BENCHMARKS,
    DataError,
    Record,
    benchmark_path,
    load_benchmark,
    load_file_set,
    resolve_data_root,
)
from stapo.tasks.golds import DEFAULT_MAX_FRACTION, check_golds
from stapo.tasks.prompts import encode_prompt
from stapo.tasks.synthetic import GENERATED_BENCHMARKS, generated_benchmark

__all__ = [
    "PromptSpec",
    "Problem",
    "Block",
    "resolve_prompt",
    "load_problems",
    "encode_problems",
    "plan_blocks",
    "call_seed",
    "shard_positions",
    "evaluate_problems",
    "summarize_run",
    "default_run_dir",
    "run_evaluation",
    "log_results_to_wandb",
]

log = logging.getLogger(__name__)

MANIFEST = "eval_manifest.json"
SWEEP_KIND = "checkpoint_sweep"  # the "kind" of a sweep folder's manifest (stapo.evaluation.sweep)
GENERATIONS_DIR = "generations"


@dataclass(frozen=True)
class PromptSpec:
    """How prompts are built (:func:`stapo.tasks.prompts.encode_prompt`).

    Attributes:
        style: ``"auto"`` / ``"chat"`` / ``"plain"`` (``use_chat_template``).
        system_prompt: system message (chat template only) or ``None``.
        source: where the values came from (for results.json).
    """

    style: str = "auto"
    system_prompt: str | None = None
    source: str = "default"


@dataclass
class Problem:
    """One problem to sample: its benchmark, position in the benchmark file, record and prompt token ids.

    ``gold_parses``: math-verify parses its gold (:func:`stapo.tasks.golds.check_golds`); False: its responses are
    graded ``error`` (GoldUnparseable) unless they repeat the gold as text, and results.json counts it."""

    benchmark: str
    index: int
    record: Record
    prompt_ids: list[int] = field(default_factory=list)
    gold_parses: bool = True

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def content(self) -> str:
        """The content key of the problem (:func:`stapo.evaluation.identity.content_key`: text and gold)."""
        return content_key(self.record.problem, self.record.answer)


@dataclass(frozen=True)
class Block:
    """One engine call's worth of problems (all with the same N).

    Attributes:
        key: ``"N<n>/b<index>-<8 hex digits of the problem ids' SHA-256>"``, stored in each record.
        n: samples per problem.
        problems: the problems, in plan order.
    """

    key: str
    n: int
    problems: tuple[Problem, ...]


# --- prompt ---------------------------------------------------------------------------------------------
def resolve_prompt(prompt_cfg: Any, source: ModelSource | None = None) -> PromptSpec:
    """The prompt settings: defaults (``auto``, no system prompt) → ``prompt_cfg.from_train_config`` (a train.py
    YAML, for a model without a run config, e.g. the base model of a CPU recipe) → the run config of a train.py
    checkpoint (when ``prompt_cfg.from_checkpoint``; what the checkpoint was actually trained with) → explicit
    ``style`` / ``system_prompt`` (``""`` = no system prompt). Later wins.

    Args:
        prompt_cfg: :class:`~stapo.evaluation.config.EvalPromptConfig`.
        source: the resolved model (for a train.py checkpoint's run config).

    Raises:
        EvalError: ``from_train_config`` cannot be loaded (the message names the file and the problem).
    """
    style, system, origin = "auto", None, "default"
    if prompt_cfg.from_train_config:
        from stapo.config import ConfigError, load_config

        try:
            train_cfg = load_config(prompt_cfg.from_train_config)
        except ConfigError as e:
            raise EvalError(f"prompt.from_train_config: {e}") from None
        style, system, origin = train_cfg.data.prompt_style, train_cfg.data.system_prompt, prompt_cfg.from_train_config
    if prompt_cfg.from_checkpoint and source is not None:
        found = source.train_prompt()
        if found is not None:
            style, system, origin = found["style"] or "auto", found["system_prompt"], f"{source.run_dir}/config.json"
    if prompt_cfg.style is not None:
        style, origin = prompt_cfg.style, "eval config"
    if prompt_cfg.system_prompt is not None:
        system, origin = (prompt_cfg.system_prompt or None), "eval config"
    return PromptSpec(style=style, system_prompt=system, source=origin)


# --- problems and blocks --------------------------------------------------------------------------------
def benchmark_file(root: str | os.PathLike, name: str, custom: Mapping[str, Any] | None = None) -> Path | None:
    """The file benchmark ``name`` is read from: ``data.custom_benchmarks.<name>.path`` (the first of a list of
    files), or its file under the data root; None for a generated benchmark or a hub dataset (no file). Nothing is
    checked here (:func:`load_problems` does)."""
    custom = dict(custom or {})
    if name in GENERATED_BENCHMARKS:
        return None
    if name in custom:
        from stapo.tasks.data import file_set_sources

        sources = file_set_sources(custom[name], key=f"data.custom_benchmarks.{name}")
        return None if isinstance(sources, str) else sources[0]

    return benchmark_path(resolve_data_root(root), name)


def load_problems(root: str | os.PathLike, benchmarks: Sequence[str],
                  limit: int | None = None, custom: Mapping[str, Any] | None = None,
                  max_unparsable_gold: float | None = None,
                  report: Callable[[str], None] | None = None) -> dict[str, list[Problem]]:
    """The first ``limit`` problems (all when ``None``) of each benchmark, without prompts yet.

    ``custom`` maps the names of user benchmarks to their :class:`stapo.tasks.data.FileSetConfig`
    (``data.custom_benchmarks``); they are read from their own files (bad rows raise, as for the built-in benchmarks).
    The generated benchmarks (:data:`stapo.tasks.synthetic.GENERATED_BENCHMARKS`: ``arith_test``, ``arith_hard``) need
    no data root.

    The golds of each file (all its rows, whatever ``limit``) are checked with math-verify
    (:func:`stapo.tasks.golds.check_golds`): a file with unparsable golds is reported in one line (file, count, first
    rows; to ``report``, default stderr), its problems marked (``Problem.gold_parses``), and refused above
    ``max_unparsable_gold`` (``data.max_unparsable_gold_fraction``; default
    :data:`stapo.tasks.golds.DEFAULT_MAX_FRACTION`).

    Returns:
        ``{benchmark: [Problem]}`` in the order of ``benchmarks``.

    Raises:
        EvalError: unknown benchmark name, missing data root or file, a bad row, or too many unparsable golds (the
            message names the file and the row or key).
    """
    custom = dict(custom or {})
    data_root = None
    out: dict[str, list[Problem]] = {}
    for name in benchmarks:
        if name not in BENCHMARKS and name not in custom and name not in GENERATED_BENCHMARKS:
            raise EvalError(f"unknown benchmark {name!r}; known: {', '.join([*BENCHMARKS, *GENERATED_BENCHMARKS, *custom])}")
        try:
            if name in GENERATED_BENCHMARKS:  # the synthetic task's held-out split, generated (stapo/tasks/synthetic.py)
                records, bad = generated_benchmark(name), set()
            else:
                if name in custom:
                    loaded = load_file_set(name, custom[name], key=f"data.custom_benchmarks.{name}", on_bad_row="raise")
                else:
                    data_root = data_root or resolve_data_root(root)
                    loaded = load_benchmark(name, data_root)
                records = loaded.records
                bad = set(check_golds([r.answer for r in records], where=loaded.stats.path,
                                      key="data.max_unparsable_gold_fraction", rows=loaded.rows, report=report,
                                      max_fraction=DEFAULT_MAX_FRACTION if max_unparsable_gold is None
                                      else max_unparsable_gold).positions)
        except DataError as e:
            raise EvalError(str(e)) from None
        records = records[:limit] if limit is not None else records
        out[name] = [Problem(name, i, rec, gold_parses=i not in bad) for i, rec in enumerate(records)]
    return out


def encode_problems(problems: Mapping[str, list[Problem]], tokenizer: Any, prompt: PromptSpec,
                    max_prompt_tokens: int | None = None) -> dict[str, int]:
    """Fill ``Problem.prompt_ids`` (the training prompt) in place; drop problems whose prompt is longer than
    ``max_prompt_tokens`` (when set).

    Returns:
        ``{benchmark: problems dropped for a too-long prompt}``.

    Raises:
        EvalError: the prompt cannot be built (e.g. a system prompt with plain-text prompts).
    """
    dropped: dict[str, int] = {}
    for name, plist in problems.items():
        kept = []
        for p in plist:
            try:
                p.prompt_ids = encode_prompt(p.record.problem, tokenizer, use_chat_template=prompt.style,
                                             system_prompt=prompt.system_prompt)
            except (TypeError, ValueError) as e:
                raise EvalError(f"cannot build the prompt of {p.id}: {e}") from None
            if max_prompt_tokens is None or len(p.prompt_ids) <= max_prompt_tokens:
                kept.append(p)
        dropped[name] = len(plist) - len(kept)
        plist[:] = kept
    return dropped


def plan_blocks(problems: Mapping[str, Sequence[Problem]], samples: Mapping[str, int],
                samples_per_call: int) -> list[Block]:
    """Cut the problems into engine calls (rule in the module docstring).

    Args:
        problems: ``{benchmark: problems}`` in benchmark order.
        samples: N per benchmark.
        samples_per_call: target responses per call (a block holds ``max(1, samples_per_call // N)`` problems).

    Returns:
        Blocks grouped by N in order of first appearance, each group's problems in benchmark order.
    """
    by_n: dict[int, list[Problem]] = {}
    for name, plist in problems.items():
        by_n.setdefault(int(samples[name]), []).extend(plist)
    blocks = []
    for n, plist in by_n.items():
        per = max(1, samples_per_call // n)
        for b, start in enumerate(range(0, len(plist), per)):
            chunk = tuple(plist[start:start + per])
            digest = hashlib.sha256(json.dumps([p.id for p in chunk]).encode()).hexdigest()[:8]
            blocks.append(Block(f"N{n}/b{b:05d}-{digest}", n, chunk))
    return blocks


def call_seed(base_seed: int, setting: str, n: int, problem_ids: Sequence[str]) -> int:
    """The sampling seed of one engine call: 31 bits of SHA-256 over (seed, setting, N, problem ids)."""
    text = json.dumps([int(base_seed), setting, int(n), list(problem_ids)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") >> 1


def _store_path(out_dir: Path, benchmark: str, setting: str) -> Path:
    return out_dir / GENERATIONS_DIR / f"{benchmark}__{setting}.jsonl"


def _open_stores(out_dir: Path, problems: Mapping[str, Sequence[Problem]], settings: Sequence[DecodingSetting],
                 read_only: bool = False) -> dict[tuple[str, str], GenerationStore]:
    """The store of every (benchmark, setting), each told its problems' current content (samples of a problem
    whose text or gold changed are superseded: :class:`~stapo.evaluation.store.GenerationStore`)."""
    current = {b: {p.id: (p.content, p.record.answer) for p in plist} for b, plist in problems.items()}
    return {(b, s.name): GenerationStore(_store_path(out_dir, b, s.name), read_only=read_only, current=current[b])
            for b in problems for s in settings}


# --- generation + grading -------------------------------------------------------------------------------
def shard_positions(count: int, world: int, rank: int) -> list[int]:
    """The positions ``0 … count−1`` of a block's engine call that rank ``rank`` of ``world`` generates: every
    W-th one, starting at ``rank`` (interleaved, so the shares differ by at most one problem).

    Example: ``shard_positions(5, 2, 0)`` → ``[0, 2, 4]``; ``shard_positions(5, 2, 1)`` → ``[1, 3]``;
    ``shard_positions(1, 2, 1)`` → ``[]``.
    """
    return list(range(int(rank), int(count), int(world)))


def _block_records(engine: Any, grader: Any, call: Sequence[Problem], n: int, setting: DecodingSetting,
                   block_key: str, seed_i: int, max_new_tokens: int, verifier: Any,
                   verifier_apply_to: Sequence[str], prompt_indices: Sequence[int] | None = None,
                   keep: int | None = None, context: int | None = None) -> tuple[list[dict[str, Any]], int, int]:
    """One engine call over ``call`` (N = ``n`` samples each), graded (and verified) → the JSONL records in
    response order (problem-major, then sample), the number of responses and their generated tokens.

    ``context``: the model's context (tokens): a response that runs past it (prompt + response > context; an engine
    that does not stop there itself, the HF backend) is cut at the context (``finish_reason`` ``"length"``, text
    decoded again with the engine's tokenizer) — what a context-capped engine (vLLM's ``max_model_len``) returns.

    ``prompt_indices``: the position of each prompt of ``call`` in the block's whole call (a rank's share under data
    parallelism), which selects its seed (:meth:`stapo.rollout.SamplingParams.seeds`): a problem gets the same samples
    whichever rank generates it. ``keep``: only the first ``keep`` prompts are real (the rest pad a rank's call to the
    others' length and are dropped before grading).

    Raises:
        RuntimeError: the engine returned a wrong number of responses.
    """
    from stapo.rollout import SamplingParams

    sampling = SamplingParams(temperature=float(setting.temperature), top_p=float(setting.top_p),
                              max_new_tokens=int(max_new_tokens), seed=seed_i,
                              prompt_indices=None if prompt_indices is None else list(prompt_indices))
    responses = engine.generate([p.prompt_ids for p in call], n, sampling)
    if len(responses) != len(call) * n:
        raise RuntimeError(f"engine returned {len(responses)} responses for {len(call)}×{n}")
    if keep is not None:
        responses = [r for r in responses if r.group < keep]
        if not responses:  # a rank whose call was all padding
            return [], 0, 0
    if context is not None:
        responses = [_cut_at_context(engine, r, context) for r in responses]
    golds = [call[r.group].record.answer for r in responses]
    graded = grader.grade([r.text for r in responses], golds).results
    verdicts: dict[int, Any] = {}
    if verifier is not None:
        ask = [i for i, g in enumerate(graded) if g.status.value in verifier_apply_to]
        if ask:
            got = verifier.verify([call[responses[i].group].record.problem for i in ask],
                                  [golds[i] for i in ask], [responses[i].text for i in ask])
            verdicts = dict(zip(ask, got))
    records = []
    for i, (resp, grade) in enumerate(zip(responses, graded)):
        p = call[resp.group]
        v = verdicts.get(i)
        records.append({
            "problem_id": p.id, "sample": int(resp.index), "benchmark": p.benchmark, "setting": setting.name,
            "problem_index": p.index, "content": p.content, "block": block_key, "seed": seed_i,
            "temperature": float(setting.temperature), "top_p": float(setting.top_p), "gold": golds[i],
            "response": resp.text, "prompt_tokens": len(resp.prompt_ids),
            "response_tokens": len(resp.response_ids), "finish_reason": resp.finish_reason,
            "extracted": grade.extracted, "status": grade.status.value, "grader_error": grade.error,
            "grade_seconds": round(float(grade.seconds), 4),
            "verifier_verdict": v.verdict if v is not None else None,
            "verifier_accepted": bool(v.accepted) if v is not None else False,
            "verifier_raw": v.raw if v is not None else None,
            "correct": bool(grade.correct or (v is not None and v.accepted)),
        })
    return records, len(responses), sum(len(r.response_ids) for r in responses)


def _cut_at_context(engine: Any, resp: Any, context: int) -> Any:
    """``resp`` cut so that prompt + response ≤ ``context`` tokens (unchanged when it fits, or when the engine has
    no ``tokenizer`` to decode the cut response with)."""
    room = max(0, int(context) - len(resp.prompt_ids))
    tokenizer = getattr(engine, "tokenizer", None)
    if len(resp.response_ids) <= room or tokenizer is None:
        return resp
    import dataclasses

    ids = list(resp.response_ids[:room])
    logprobs = None if resp.engine_logprobs is None else list(resp.engine_logprobs[:room])
    return dataclasses.replace(resp, response_ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True),
                               engine_logprobs=logprobs, finish_reason="length")


def _by_benchmark(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``{benchmark: its records}`` in the records' order (one store append per file and block)."""
    per_bench: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        per_bench.setdefault(rec["benchmark"], []).append(rec)
    return per_bench


def _call_of(blk: Block, setting: DecodingSetting, stores: Mapping[tuple[str, str], GenerationStore]) -> list[int]:
    """Positions in ``blk.problems`` of the block's engine call: all of them when some sample of the block was
    stored before (a crash mid-block: regenerated whole, same seed, only the missing samples written), else the
    problems whose N samples are not all stored."""
    own = any(r.get("block") == blk.key for p in blk.problems
              for r in stores[(p.benchmark, setting.name)].samples_of(p.id))
    return [i for i, p in enumerate(blk.problems)
            if own or not stores[(p.benchmark, setting.name)].complete(p.id, blk.n)]


def evaluate_problems(
    engine: Any,
    grader: Any,
    problems: Mapping[str, Sequence[Problem]],
    *,
    samples: Mapping[str, int],
    settings: Sequence[DecodingSetting],
    max_new_tokens: int,
    out_dir: str | os.PathLike,
    seed: int = 0,
    samples_per_call: int = 256,
    verifier: Any = None,
    verifier_apply_to: Sequence[str] = ("incorrect", "no_answer"),
    progress: bool = False,
    on_block: Callable[[dict[str, Any]], None] | None = None,
    ctx: Any = None,
    lockstep: bool = False,
    context: int | None = None,
) -> dict[str, Any]:
    """Generate, grade and store every missing sample of ``problems`` under every setting; return metrics.

    Args:
        engine: a rollout engine (``generate(prompt_ids, N, SamplingParams) -> [Response]``).
        grader: a :class:`stapo.tasks.grader.MathGrader` (``grade(responses, golds)``).
        problems: ``{benchmark: problems with prompt_ids}``.
        samples: N per benchmark.
        settings: decoding settings.
        max_new_tokens: generation limit per response (tokens).
        out_dir: run directory (JSONL files under ``generations/``).
        seed: base seed (see :func:`call_seed`).
        samples_per_call: block size target (see :func:`plan_blocks`).
        verifier: optional :class:`~stapo.evaluation.verifier.LLMVerifier` for rule-rejected samples.
        verifier_apply_to: rule verdicts sent to the verifier.
        progress: show a tqdm bar over the missing samples (rank 0).
        on_block: called after each block is stored with ``{"setting", "block", "written", "generated"}`` (rank 0).
        ctx: a :class:`stapo.model.distributed.DistContext` with W > 1 ranks (collective: every rank calls this with the
            same arguments, each with its own engine and grader): each block's engine call is split over the ranks
            (:func:`shard_positions`), each rank generates and grades its share, rank 0 gathers the records and
            writes the block (the one writer of ``out_dir``) and every rank returns rank 0's result. A problem is
            sampled with the seed of its position in the block's call (``SamplingParams.prompt_indices``), so the
            records are those of one process (``grade_seconds`` aside). An error on any rank is raised on every rank
            (the failing rank's own exception there, :class:`~stapo.evaluation.errors.EvalError` naming it elsewhere)
            after the block's gather. ``None`` or W = 1: one process.
        lockstep: with ``ctx``: every rank makes the same engine calls with the same number of prompts (a rank
            whose share of a block is smaller pads it with copies of its first problem, or of the call's, whose
            responses are dropped) — for an engine whose decode steps are collectives (the HF backend on an
            FSDP2-sharded policy: ``generate(synced_gpus=True)`` then lets the ranks' lengths differ).
        context: the model's context in tokens: responses running past it are cut there (:func:`_block_records`);
            None: as the engine returns them.

    Returns:
        ``{"metrics": {setting: {"benchmarks": {name: summary}, "average": {...}}}, "run": {...}}`` —
        see :func:`summarize_run`; ``run`` counts this call's blocks, samples (all ranks) and generated tokens
        (all ranks) and its seconds (rank 0's wall clock).

    Raises:
        EvalError: a problem lacks some of its samples after the run; under ``ctx``, the ranks disagree on the
            blocks (different problems loaded) or another rank failed.
        RuntimeError: the engine returned a wrong number of responses.
    """
    if ctx is not None and getattr(ctx, "enabled", False):
        return _evaluate_sharded(engine, grader, problems, samples=samples, settings=settings,
                                 max_new_tokens=max_new_tokens, out_dir=out_dir, seed=seed,
                                 samples_per_call=samples_per_call, verifier=verifier,
                                 verifier_apply_to=verifier_apply_to, progress=progress, on_block=on_block, ctx=ctx,
                                 lockstep=lockstep, context=context)
    out = Path(out_dir)
    blocks = plan_blocks(problems, samples, samples_per_call)
    stores = _open_stores(out, problems, settings)
    todo = [(s, blk) for s in settings for blk in blocks
            if not all(stores[(p.benchmark, s.name)].complete(p.id, blk.n) for p in blk.problems)]
    total = sum(blk.n * len(blk.problems) for _, blk in todo)
    stats = {"blocks": 0, "generated": 0, "written": 0, "tokens": 0, "seconds": 0.0}
    t_start = time.perf_counter()
    bar = None
    if progress and total:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="eval samples", dynamic_ncols=True)
    try:
        for setting, blk in todo:
            call = [blk.problems[i] for i in _call_of(blk, setting, stores)]
            seed_i = call_seed(seed, setting.name, blk.n, [p.id for p in call])
            records, generated, tokens = _block_records(engine, grader, call, blk.n, setting, blk.key, seed_i,
                                                        max_new_tokens, verifier, verifier_apply_to, context=context)
            written = sum(stores[(b, setting.name)].append(recs) for b, recs in _by_benchmark(records).items())
            stats["blocks"] += 1
            stats["generated"] += generated
            stats["written"] += written
            stats["tokens"] += tokens
            if bar is not None:
                bar.update(written)
            if on_block is not None:
                on_block({"setting": setting.name, "block": blk.key, "written": written, "generated": generated})
    finally:
        if bar is not None:
            bar.close()
    stats["seconds"] = time.perf_counter() - t_start
    stats["tokens_per_s"] = stats["tokens"] / stats["seconds"] if stats["tokens"] and stats["seconds"] > 0 else None
    return {"metrics": summarize_run(problems, stores, samples, settings), "run": stats}


def _error_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def _raise_any(errors: Sequence[str | None], mine: BaseException | None, what: str) -> None:
    """After a gather of every rank's error line (None = fine): raise on every rank when one failed — this rank's
    own exception where it has one, else an EvalError naming the first failed rank."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if mine is not None:
        raise mine
    rank, line = failed[0]
    raise EvalError(f"{what}: rank {rank} failed ({line})")


def _evaluate_sharded(engine: Any, grader: Any, problems: Mapping[str, Sequence[Problem]], *,
                      samples: Mapping[str, int], settings: Sequence[DecodingSetting], max_new_tokens: int,
                      out_dir: str | os.PathLike, seed: int, samples_per_call: int, verifier: Any,
                      verifier_apply_to: Sequence[str], progress: bool,
                      on_block: Callable[[dict[str, Any]], None] | None, ctx: Any, lockstep: bool,
                      context: int | None = None) -> dict[str, Any]:
    """:func:`evaluate_problems` over W > 1 ranks (collective; the rule in its ``ctx`` argument).

    Per block: rank 0 (the only rank that reads or writes the stores) has chosen the call (:func:`_call_of`, sent
    to every rank once, before the first block); rank r generates and grades positions :func:`shard_positions` of
    it; the records are gathered (``all_gather_object``), rank 0 sorts them into the one-process order (position in
    the call, then sample) and appends them to the stores in one write per file, then tells the ranks whether
    that worked (a second small gather). A crash therefore leaves the stores as one process would: whole blocks,
    or a torn last line that the next run cuts off.
    """
    from stapo.model.distributed import gather_objects

    main = ctx.is_main
    out = Path(out_dir)
    blocks = plan_blocks(problems, samples, samples_per_call)
    stores: dict[tuple[str, str], GenerationStore] = {}
    plan: list[tuple[int, int, str, list[int]]] | None = None  # (setting index, block index, block key, call)
    error: BaseException | None = None
    if main:
        try:
            stores = _open_stores(out, problems, settings)
            plan = [(si, bi, blk.key, _call_of(blk, s, stores)) for si, s in enumerate(settings)
                    for bi, blk in enumerate(blocks)
                    if not all(stores[(p.benchmark, s.name)].complete(p.id, blk.n) for p in blk.problems)]
        except Exception as e:  # noqa: BLE001 - a damaged store: raised on every rank below, not a hang
            error = e
    keys = [blk.key for blk in blocks]  # the problem ids of every block: the same on every rank, or no block is
    head = gather_objects((plan, None if error is None else _error_line(error), keys), ctx)
    _raise_any([h[1] for h in head], error, "validation")
    other = [r for r, h in enumerate(head) if h[2] != head[0][2]]
    if other:  # on every rank: the same test on the same gathered lists
        raise EvalError(f"validation: rank {other[0]} planned other blocks than rank 0 (the ranks loaded different "
                        f"problems: the same data.root, tokenizer and data.max_prompt_length on every node?)")
    plan = head[0][0]
    stats = {"blocks": 0, "generated": 0, "written": 0, "tokens": 0, "seconds": 0.0}
    t_start = time.perf_counter()
    bar = None
    if main and progress and plan:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(blocks[bi].n * len(blocks[bi].problems) for _, bi, _, _ in plan),
                   desc="eval samples", dynamic_ncols=True)
    try:
        for si, bi, _, positions in plan:
            setting, blk = settings[si], blocks[bi]
            call = [blk.problems[i] for i in positions]
            seed_i = call_seed(seed, setting.name, blk.n, [p.id for p in call])
            mine = shard_positions(len(call), ctx.world, ctx.rank)
            keep = len(mine)
            if lockstep:  # every rank the same number of prompts: pad with a copy (its responses are dropped)
                width = -(-len(call) // ctx.world)
                mine = mine + [mine[0] if mine else 0] * (width - len(mine))
            records: list[dict[str, Any]] = []
            generated = tokens = 0
            try:
                if mine:
                    records, generated, tokens = _block_records(
                        engine, grader, [call[i] for i in mine], blk.n, setting, blk.key, seed_i, max_new_tokens,
                        verifier, verifier_apply_to, prompt_indices=mine, keep=keep, context=context)
            except Exception as e:  # noqa: BLE001 - told to every rank after the gather below
                error = e
            parts = gather_objects((records, generated, tokens, None if error is None else _error_line(error)), ctx)
            _raise_any([p[3] for p in parts], error, "validation")
            written = 0
            if main:
                order = {(p.benchmark, p.id): i for i, p in enumerate(call)}
                merged = sorted((r for p in parts for r in p[0]),
                                key=lambda r: (order[(r["benchmark"], r["problem_id"])], r["sample"]))
                try:
                    written = sum(stores[(b, setting.name)].append(recs) for b, recs in _by_benchmark(merged).items())
                except Exception as e:  # noqa: BLE001 - a full disk: told to every rank, then raised
                    error = e
            _raise_any(gather_objects(None if error is None else _error_line(error), ctx), error, "validation")
            stats["blocks"] += 1
            stats["generated"] += sum(p[1] for p in parts)
            stats["written"] += written
            stats["tokens"] += sum(p[2] for p in parts)
            if bar is not None:
                bar.update(written)
            if main and on_block is not None:
                on_block({"setting": setting.name, "block": blk.key, "written": written,
                          "generated": sum(p[1] for p in parts)})
    finally:
        if bar is not None:
            bar.close()
    stats["seconds"] = time.perf_counter() - t_start
    stats["tokens_per_s"] = stats["tokens"] / stats["seconds"] if stats["tokens"] and stats["seconds"] > 0 else None
    result = None
    if main:
        try:
            result = {"metrics": summarize_run(problems, stores, samples, settings), "run": stats}
        except Exception as e:  # noqa: BLE001 - e.g. an incomplete problem: raised on every rank
            error = e
    last = gather_objects((result, None if error is None else _error_line(error)), ctx)
    _raise_any([x[1] for x in last], error, "validation")
    return last[0][0]


def summarize_run(problems: Mapping[str, Sequence[Problem]], stores: Mapping[tuple[str, str], GenerationStore],
                  samples: Mapping[str, int], settings: Sequence[DecodingSetting]) -> dict[str, Any]:
    """Metrics per setting and benchmark (:func:`~stapo.evaluation.metrics.summarize_benchmark`) and their
    average over benchmarks, from the stored samples of ``problems`` (other stored problems are ignored).

    Returns:
        ``{setting: {"benchmarks": {name: summary}, "average": {"avg@N", "pass@1", "pass@N", "maj@N"
        (unweighted means over benchmarks), "benchmarks" (count), "samples", "grader" (summed counts),
        "verifier_accepted", "mean_response_tokens", "truncation_rate" (sample-weighted)}}}``.

    Raises:
        EvalError: a problem lacks some of its N samples.
    """
    out: dict[str, Any] = {}
    for s in settings:
        per: dict[str, Any] = {}
        for name, plist in problems.items():
            n = int(samples[name])
            store = stores[(name, s.name)]
            rows = []
            for p in plist:
                recs = store.samples_of(p.id)[:n]
                if len(recs) != n or [r["sample"] for r in recs] != list(range(n)):
                    raise EvalError(f"{store.path}: {p.id} has {len(recs)} of its {n} samples; rerun to complete it")
                rows.append(recs)
            per[name] = summarize_benchmark(rows, n)
        total = sum(v["samples"] for v in per.values())
        grader = {k: sum(v["grader"][k] for v in per.values()) for k in GRADER_STATUSES}

        def weighted(key: str) -> float:
            vals = [(v[key], v["samples"]) for v in per.values() if v["samples"]]
            return sum(x * w for x, w in vals) / total if total else math.nan

        out[s.name] = {"benchmarks": per, "average": {
            "avg@N": average_over_benchmarks(per, "avg@N"), "pass@1": average_over_benchmarks(per, "pass@1"),
            "pass@N": average_over_benchmarks(per, "pass@N"), "maj@N": average_over_benchmarks(per, "maj@N"),
            "benchmarks": len(per), "samples": total, "grader": grader,
            "verifier_accepted": sum(v["verifier_accepted"] for v in per.values()),
            "mean_response_tokens": weighted("mean_response_tokens"), "truncation_rate": weighted("truncation_rate"),
        }}
    return out


# --- the whole run --------------------------------------------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._@-]+", "_", text).strip("_") or "model"


def default_run_dir(cfg: EvalConfig, source: ModelSource) -> Path:
    """``output.dir`` when set, else ``<output.root>/<label>`` (label: ``model.label`` or the source's)."""
    if cfg.output.dir:
        return Path(cfg.output.dir)
    return Path(cfg.output.root) / _slug(cfg.model.label or source.label)


def _manifest(cfg: EvalConfig, source: ModelSource, prompt: PromptSpec, model_digest: str | None = None,
              data: Mapping[str, str] | None = None, machine: str | None = None) -> dict[str, Any]:
    """What the generations of an output folder are made from (``eval_manifest.json``): the model (path and its
    content digest), dtype, backend, the protocol (prompt, new-token limit, seed, block size, N per benchmark,
    decoding settings, grader, verifier), the benchmark files' digests and the machine kinds that generated."""
    return {
        "model": {"kind": source.kind, "path": source.path, "step": source.step},
        "model_digest": model_digest,
        "dtype": cfg.model.dtype,
        "backend": cfg.engine.backend,
        "prompt": {"style": prompt.style, "system_prompt": prompt.system_prompt},
        "max_new_tokens": cfg.generation.max_new_tokens,
        "seed": cfg.generation.seed,
        "samples_per_call": cfg.generation.samples_per_call,
        "samples": {b: cfg.data.samples[b] for b in cfg.data.benchmarks},
        "settings": {s.name: [float(s.temperature), float(s.top_p)] for s in cfg.generation.settings},
        "grader": {"require_value": bool(cfg.grader.require_value)},
        "verifier": ({"model": cfg.verifier.model, "apply_to": list(cfg.verifier.apply_to)}
                     if cfg.verifier.enabled else None),
        "data": dict(data or {}),
        "machines": [machine] if machine else [],
    }


def _short_digest(value: Any) -> str:
    return f"{value[:12]}…" if isinstance(value, str) and len(value) == 64 else repr(value)


def _check_manifest(run_dir: Path, new: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """Compare with the run directory's manifest; return the merged manifest to write.

    The model is compared by content where both manifests hold its digest (a folder moved or copied elsewhere is
    the same model; weights replaced under the same path are not), else by kind, path and step (a manifest from
    before digests, or an ``id:`` model). A benchmark file whose digest changed is not refused: its problems are
    matched by content (:class:`~stapo.evaluation.store.GenerationStore`); a line is added to ``notes``. The machine
    kinds are merged (another kind is allowed). Keys an old manifest lacks (written before they were recorded) are
    taken as recorded now.

    Raises:
        EvalError: a generation-relevant value differs (the message names it, old and new, and how to choose a
            new output; the finished results stay as they are).
    """
    path = run_dir / MANIFEST
    if not path.exists():
        return new
    try:
        old = json.loads(path.read_text())
    except ValueError as e:
        raise EvalError(f"{path} is not valid JSON ({e}); move the run directory away") from None
    if isinstance(old, dict) and old.get("kind") == SWEEP_KIND:
        raise EvalError(f"{run_dir} is the folder of a checkpoint sweep (of {old.get('run_dir')}); its checkpoints' "
                        f"evaluations are in its step_XXXXXX subfolders: choose another output directory (--output)")
    notes = notes if notes is not None else []
    new_output = ("its finished results are kept as they are: evaluate into a new output directory (--output DIR, "
                  "or --label NAME for <output.root>/NAME)")

    def differ(what: str, a: Any, b: Any) -> EvalError:
        return EvalError(f"{run_dir} holds generations made with {what} = {a!r}, this run asks for {b!r}; "
                         f"choose another output directory (--output) or delete {run_dir}")

    old_digest, new_digest = old.get("model_digest"), new.get("model_digest")
    by_content = (isinstance(old_digest, str) and isinstance(new_digest, str)
                  and not old_digest.startswith("id:") and not new_digest.startswith("id:"))
    if by_content and old_digest != new_digest:
        raise EvalError(f"{run_dir} holds generations of another model: the content of {new['model']['path']} "
                        f"changed since they were made (model digest {_short_digest(old_digest)} → "
                        f"{_short_digest(new_digest)}: weights or config files replaced); {new_output}")
    if not by_content and old.get("model") != new["model"]:
        raise differ("model", old.get("model"), new["model"])
    for key in ("dtype", "backend", "prompt", "max_new_tokens", "seed", "samples_per_call"):
        if old.get(key) != new[key]:
            raise differ(key, old.get(key), new[key])
    for key in ("grader", "verifier"):
        if key in old and old[key] != new[key]:
            raise differ(key, old[key], new[key])
    for kind in ("samples", "settings"):
        for name, value in new[kind].items():
            if name in old.get(kind, {}) and old[kind][name] != value:
                raise differ(f"{kind}[{name}]", old[kind][name], value)
    old_data = old.get("data") if isinstance(old.get("data"), dict) else {}
    for name, digest in new["data"].items():
        if name in old_data and old_data[name] != digest:
            notes.append(f"the file of {name} changed since {run_dir} was made (SHA-256 {_short_digest(old_data[name])}"
                         f" → {_short_digest(digest)}): its problems whose text or gold changed are generated and "
                         f"graded again, the others reused")
    old_machines = [m for m in old.get("machines", []) if isinstance(m, str)]
    extra = [m for m in new["machines"] if m not in old_machines]
    merged = dict(new)
    merged["samples"] = {**old.get("samples", {}), **new["samples"]}
    merged["settings"] = {**old.get("settings", {}), **new["settings"]}
    merged["data"] = {**old_data, **new["data"]}
    merged["machines"] = old_machines + extra
    if "context_tokens" in old:
        merged["context_tokens"] = old["context_tokens"]
    return merged


def completeness(evaluated: Sequence[str], requested: Sequence[str], limit: int | None,
                 dropped: Mapping[str, int]) -> tuple[bool, bool]:
    """(complete, paper_protocol) of an evaluation, as results.json records them.

    complete: every benchmark asked for (``data.benchmarks``) was evaluated, in full (no ``data.limit``, no prompt
    dropped for its length) — whatever else is registered. paper_protocol: complete, over exactly the six benchmarks
    of the paper's table (:data:`stapo.tasks.data.PAPER_BENCHMARKS`, not the registry), so that its "Avg" is the
    paper's.

    Example: ``completeness(["aime24"], ["aime24"], None, {"aime24": 0})`` → ``(True, False)``.
    """
    complete = set(evaluated) == set(requested) and limit is None and not any(dropped.values())
    return complete, complete and set(evaluated) == set(PAPER_BENCHMARKS)


def _close_quietly(obj: Any) -> None:
    """``obj.close()``; an exception from it (or a missing ``close``) is logged as a warning, not raised."""
    try:
        obj.close()
    except Exception as e:  # noqa: BLE001 - clean-up after the results are on disk (or after the real error)
        log.warning("closing %s failed: %s: %s", type(obj).__name__, type(e).__name__, e)


def _preflight(check: Callable[..., None], *args: Any) -> None:
    """Run a :mod:`stapo.run.preflight` check; its ConfigError becomes this module's one-line EvalError."""
    try:
        check(*args)
    except ConfigError as e:
        raise EvalError(str(e)) from None


@contextlib.contextmanager
def _holding_lock(run_dir: Path, key: str, take: bool = True) -> Iterator[None]:
    """Hold ``<run_dir>/run.lock`` (:mod:`stapo.run.runlock`; the folder is created, and removed again when the run
    stops before writing anything) for the block. ``take=False`` (a dry run): only check, creating nothing, that
    the folder can be written and that no live process holds it.

    Raises:
        EvalError: another live process holds the run directory (one line naming it and the holder), or the
            folder cannot be written (naming ``key``, the config key it comes from).
    """
    if not take:
        from stapo.run.preflight import check_writable

        _preflight(check_writable, run_dir, key)
        try:
            RunLock(run_dir).check_free()
        except RunLockError as e:
            raise EvalError(str(e)) from None
        yield
        return
    try:
        lock = RunLock(run_dir).acquire()
    except RunLockError as e:
        raise EvalError(str(e)) from None
    except OSError as e:
        reason = os_reason(e)
        raise EvalError(f"invalid value for {key!r}: cannot write the run directory {run_dir} (its lock file "
                        f"{LOCK_NAME}): {reason}; choose a writable folder") from None
    try:
        yield
    finally:
        lock.release()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _load_tokenizer(source: ModelSource, cfg: EvalConfig):
    from stapo.model.models import load_tokenizer

    try:
        return load_tokenizer("embedded:smollm2" if source.kind == "tiny" else source.path,
                              cache_dir=cfg.model.cache_dir)
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot load the tokenizer of {source.spec!r}: {str(e).splitlines()[0]}") from None


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars (its ``Loading weights`` bar of ``from_pretrained``) off for the block
    unless ``enabled`` (``logging.progress_bar``), restored afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled and was:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was:
            hf_logging.enable_progress_bar()


def _bars(cfg: EvalConfig) -> bool:
    """Whether to draw progress bars: ``logging.progress_bar`` by train.py's rule
    (:func:`stapo.run.console.use_progress_bars`: true / false, or ``auto``: stdout and stderr are terminals)."""
    return use_progress_bars(cfg.logging.progress_bar)


def _load_model(source: ModelSource, cfg: EvalConfig, tokenizer: Any):
    from stapo.model.models import build_tiny_model, load_policy

    try:
        with _hf_progress_bars(_bars(cfg)):
            if source.kind == "tiny":
                model, _ = build_tiny_model(seed=0, dtype=cfg.model.dtype, tokenizer=tokenizer)
                return model
            model, _ = load_policy(source.path, dtype=cfg.model.dtype,
                                   attn_implementation=cfg.model.attn_implementation, cache_dir=cfg.model.cache_dir,
                                   tokenizer=tokenizer)
            return model
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot load model {source.spec!r}: {str(e).splitlines()[0]}") from None


def _build_engine(model: Any, tokenizer: Any, cfg: EvalConfig, longest_prompt: int) -> tuple[Any, dict[str, Any]]:
    """The rollout engine of ``engine.backend`` (:data:`stapo.rollout.BACKENDS`, the trainer's table and
    argument builder) → ``(engine, info for the manifest)``."""
    import torch

    from stapo.rollout import EngineOptions, build_rollout_engine, engine_kwargs, get_backend

    ec = cfg.engine
    info: dict[str, Any] = {"backend": ec.backend}
    if get_backend(ec.backend).model_in_place:  # HF: generates with this module, on engine.device
        device = "cuda" if ec.device == "auto" and torch.cuda.is_available() else ("cpu" if ec.device == "auto"
                                                                                   else ec.device)
        model.to(device)
        info["device"] = device
        return build_rollout_engine(ec.backend, model, tokenizer, **engine_kwargs(
            ec.backend, EngineOptions(max_batch_size=ec.hf_max_batch_size))), info
    need = longest_prompt + cfg.generation.max_new_tokens
    cap = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    max_model_len = ec.max_model_len or (min(need, int(cap)) if cap else need)
    if max_model_len <= longest_prompt:
        raise EvalError(f"max_model_len {max_model_len} leaves no room after the longest prompt ({longest_prompt} "
                        f"tokens); raise engine.max_model_len or skip long prompts with data.max_prompt_tokens")
    if max_model_len < need:
        log.warning("max_model_len %d < longest prompt %d + max_new_tokens %d: responses of long prompts are "
                    "capped at max_model_len - prompt length", max_model_len, longest_prompt,
                    cfg.generation.max_new_tokens)
    kwargs = engine_kwargs(ec.backend, EngineOptions(
        max_model_len=max_model_len, kv_cache_gib=ec.kv_cache_gib, gpu_memory_utilization=ec.gpu_memory_utilization,
        enforce_eager=ec.enforce_eager, tensor_parallel_size=ec.tensor_parallel_size, seed=cfg.generation.seed,
        max_num_seqs=ec.max_num_seqs))
    info["max_model_len"] = max_model_len
    try:
        return build_rollout_engine(ec.backend, model, tokenizer, **kwargs), info
    except ImportError as e:
        raise EvalError(f"{e} (or use engine.backend=hf)") from None


def _content_digests(cfg: EvalConfig, source: ModelSource,
                     problems: Mapping[str, Sequence[Problem]]) -> tuple[str, dict[str, str]]:
    """The model's content digest and each benchmark file's (:mod:`stapo.evaluation.identity`).

    Raises:
        EvalError: a file of the model folder or a benchmark file cannot be read (naming the key).
    """
    try:
        model = model_part(source)
    except OSError as e:
        raise EvalError(f"model.path: cannot read {source.path} to fingerprint it: {os_reason(e)}") from None
    data = {}
    for name, plist in problems.items():
        if name in cfg.data.custom_benchmarks:  # a file, a list of files or a hub dataset (stapo.tasks.data.FileSetConfig)
            from stapo.tasks.data import file_set_digest

            spec = cfg.data.custom_benchmarks[name]
            try:
                data[name] = file_set_digest(spec, name=name, key=f"data.custom_benchmarks.{name}")
            except OSError as e:
                raise EvalError(f"benchmark {name}: cannot read {spec.path}: {os_reason(e)}") from None
            continue
        path = benchmark_file(cfg.data.root, name, cfg.data.custom_benchmarks)
        try:
            data[name] = data_part(path, name, plist)
        except OSError as e:
            raise EvalError(f"benchmark {name}: cannot read {path}: {os_reason(e)}") from None
    return model, data


def _model_context(model: Any, cfg: EvalConfig) -> int | None:
    """The context the samples are generated in (tokens): ``engine.max_model_len`` when set for an engine that
    builds its own (vLLM), else the model's ``max_position_embeddings``; None when unknown."""
    from stapo.rollout import get_backend

    cap = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not get_backend(cfg.engine.backend).model_in_place and cfg.engine.max_model_len:
        return int(cfg.engine.max_model_len)
    return int(cap) if isinstance(cap, int) and cap > 0 else None


def _check_context(problems: Mapping[str, Sequence[Problem]], context: int | None, max_new_tokens: int) -> None:
    """Prompts that do not fit the model's ``context``: refused when a prompt leaves no room for one new token;
    one line on stderr when prompt + ``max_new_tokens`` runs past it (those responses are cut at the context).

    Raises:
        EvalError: a prompt of ``context`` tokens or more (one line: count, the first problem, the keys).
    """
    if context is None:
        return
    full = [p for plist in problems.values() for p in plist if len(p.prompt_ids) >= context]
    if full:
        raise EvalError(f"{len(full)} problem(s) have a prompt of at least the model's context of {context} tokens "
                        f"(first: {full[0].id}, {len(full[0].prompt_ids)} tokens): nothing can be generated for "
                        f"them; skip them with data.max_prompt_tokens={context - 1} (counted in results.json) or "
                        f"raise engine.max_model_len (vLLM) / use a model with a longer context")
    over = {b: sum(len(p.prompt_ids) + max_new_tokens > context for p in plist) for b, plist in problems.items()}
    if any(over.values()):
        counts = ", ".join(f"{b}: {n}" for b, n in over.items() if n)
        print(f"evaluate.py: note: {sum(over.values())} problem(s) ({counts}) have prompt + "
              f"generation.max_new_tokens={max_new_tokens} > the model's context of {context} tokens: their "
              f"responses are cut at the context (finish_reason 'length'; results.json data.<benchmark>.over_context);"
              f" lower generation.max_new_tokens or skip long prompts with data.max_prompt_tokens",
              file=sys.stderr, flush=True)


def _add_machine(run_dir: Path, manifest: dict[str, Any], machine: str, context: int | None) -> dict[str, Any]:
    """The manifest with this machine kind among the ones that generated (one line when it is a new kind) and the
    model's context, written back."""
    machines = list(manifest.get("machines") or [])
    if machine not in machines:
        if machines:
            print(f"evaluate.py: note: {run_dir} holds samples generated on {', '.join(machines)}; this run adds "
                  f"samples made on {machine} (the same model, data and protocol)", file=sys.stderr, flush=True)
        machines.append(machine)
    manifest = {**manifest, "machines": machines, "context_tokens": context}
    (run_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def run_evaluation(
    cfg: EvalConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    grader: Any = None,
    on_block: Callable[[dict[str, Any]], None] | None = None,
    write_reports: bool = True,
    dry_run: bool = False,
    wandb: bool = True,
) -> dict[str, Any]:
    """Evaluate ``cfg.model`` on ``cfg.data.benchmarks`` under every decoding setting (resumable).

    Checks that are cheap run first (config, model path, data root, benchmark files, run-directory manifest);
    the model and engine are loaded only when some sample is missing, so rerunning a finished run just rebuilds
    the reports.

    Args:
        cfg: :class:`~stapo.evaluation.config.EvalConfig` (validated again here).
        model, tokenizer: an already loaded policy to use instead of loading ``cfg.model.path`` (tests).
        grader: a :class:`~stapo.tasks.grader.MathGrader` to share (not closed here); default: one is created
            and closed.
        on_block: progress callback (see :func:`evaluate_problems`).
        write_reports: write results.json / .md / .csv / .png and the W&B summary into the run directory.
        dry_run: ``evaluate.py --dry-run`` (:func:`stapo.tools.estimate.eval_dry_run`): run every check that needs no
            model (the lock only checked, not taken), write nothing, and return the plan instead of results:
            ``{"dry_run": True, "label", "run_dir", "source"`` (:class:`ModelSource`), ``"prompt"``
            (:class:`PromptSpec`), ``"problems"`` (``{benchmark: [Problem]}`` with prompt ids), ``"totals"``
            (problems loaded), ``"dropped"`` (long prompts), ``"pending"`` (``{setting: {benchmark: problems
            whose samples are not all stored}}``)``}``.
        wandb: with ``write_reports``, also log the W&B summary (:func:`stapo.evaluation.report.log_wandb`: a
            train.py checkpoint at its training step in the training run's group); a sweep logs its checkpoints
            together instead (:mod:`stapo.evaluation.sweep`).

    Returns:
        The results dict written to ``results.json``: ``label``, ``run_dir``, ``model``, ``prompt``, ``protocol``,
        ``data`` (problems per benchmark), ``metrics`` (see :func:`summarize_run`), ``run``, ``complete``
        (all six benchmarks in full), ``created``, ``git_commit``, ``training`` (the training run of a train.py
        checkpoint: :meth:`~stapo.evaluation.model_source.ModelSource.train_run`; else null).

    Raises:
        EvalError: any user-facing problem (bad model path, unknown benchmark, missing data root, a run
            directory made with different generation settings or in use by another process, a model or tokenizer
            that cannot be loaded).
    """
    validate_eval_config(cfg)
    _preflight(check_device, cfg.engine.device, "engine.device")  # before anything loads (stapo/run/preflight.py)
    source = resolve_model_source(cfg.model.path)
    held_out = [b for b in cfg.data.benchmarks if b in GENERATED_BENCHMARKS]
    if held_out and source.synthetic_split() == "all":  # not an error: the user may mean it, but it is not held out
        print(f"evaluate.py: warning: {source.run_dir} was trained with data.synthetic.split=all, which includes the "
              f"held-out problems {', '.join(held_out)} are drawn from: its accuracy there is not held-out accuracy "
              f"(train with data.synthetic.split=train)", file=sys.stderr, flush=True)
    problems = load_problems(cfg.data.root, cfg.data.benchmarks, cfg.data.limit, cfg.data.custom_benchmarks,
                             max_unparsable_gold=cfg.data.max_unparsable_gold_fraction)
    totals = {b: len(p) for b, p in problems.items()}
    prompt = resolve_prompt(cfg.prompt, source)
    run_dir = default_run_dir(cfg, source)
    model_digest, data_digests = _content_digests(cfg, source, problems)
    if (run_dir / "checkpoints").is_dir() or ((run_dir / "metrics.jsonl").is_file() and not (run_dir / MANIFEST).is_file()):
        raise EvalError(f"output folder {run_dir} is a train.py run folder (checkpoints/, metrics.jsonl): evaluation "
                        f"results go to a folder of their own; drop --output (default {cfg.output.root}/<label>) "
                        f"or choose another")
    # one writer per output directory: the manifest check holds under concurrency (a dry run only checks the lock)
    with _holding_lock(run_dir, "output.dir" if cfg.output.dir else "output.root", take=not dry_run):
        notes: list[str] = []
        manifest = _check_manifest(run_dir, _manifest(cfg, source, prompt, model_digest, data_digests), notes)
        label = cfg.model.label or source.label

        tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(source, cfg)
        _preflight(check_tokenizer, tokenizer, "model.path", source.spec)
        _preflight(check_chat_template, tokenizer, prompt.style, "prompt.style", source.spec)
        dropped = encode_problems(problems, tokenizer, prompt, cfg.data.max_prompt_tokens)
        if dry_run:  # every check above passed; nothing is written
            stores = _open_stores(run_dir, problems, cfg.generation.settings, read_only=True)
            pending = {s.name: {b: sum(not stores[(b, s.name)].complete(p.id, int(cfg.data.samples[b]))
                                       for p in plist) for b, plist in problems.items()}
                       for s in cfg.generation.settings}
            return {"dry_run": True, "label": label, "run_dir": str(run_dir), "source": source, "prompt": prompt,
                    "problems": problems, "totals": totals, "dropped": dropped, "pending": pending, "notes": notes}
        for line in notes:
            print(f"evaluate.py: note: {line}", file=sys.stderr, flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))

        settings = list(cfg.generation.settings)
        blocks = plan_blocks(problems, cfg.data.samples, cfg.generation.samples_per_call)
        stores = _open_stores(run_dir, problems, settings)  # superseded samples are set aside here
        pending = any(not stores[(p.benchmark, s.name)].complete(p.id, blk.n)
                      for s in settings for blk in blocks for p in blk.problems)
        del stores  # evaluate_problems reopens them
        engine_info: dict[str, Any] = {"backend": cfg.engine.backend}
        engine = owned_grader = verifier = None
        context = manifest.get("context_tokens")
        try:
            if pending:
                if model is None:
                    model = _load_model(source, cfg, tokenizer)
                context = _model_context(model, cfg)
                _check_context(problems, context, cfg.generation.max_new_tokens)
                from stapo.common.fingerprint import machine_kind

                manifest = _add_machine(run_dir, manifest, machine_kind(), context)
                longest = max((len(p.prompt_ids) for plist in problems.values() for p in plist), default=1)
                engine, engine_info = _build_engine(model, tokenizer, cfg, longest)
                if grader is None:
                    from stapo.tasks.grader import MathGrader

                    grader = owned_grader = MathGrader(num_workers=cfg.grader.num_workers, timeout_s=cfg.grader.timeout_s,
                                                       require_value=cfg.grader.require_value)
                if cfg.verifier.enabled:
                    from stapo.evaluation.verifier import build_verifier

                    try:
                        with _hf_progress_bars(_bars(cfg)):
                            verifier = build_verifier(cfg.verifier, engine_info.get("device", "cpu"))
                    except (OSError, ValueError) as e:
                        raise EvalError(f"cannot load verifier {cfg.verifier.model!r}: "
                                        f"{str(e).splitlines()[0]}") from None
            result = evaluate_problems(
                engine, grader, problems, samples=cfg.data.samples, settings=settings,
                max_new_tokens=cfg.generation.max_new_tokens, out_dir=run_dir, seed=cfg.generation.seed,
                samples_per_call=cfg.generation.samples_per_call, verifier=verifier,
                verifier_apply_to=tuple(cfg.verifier.apply_to), progress=_bars(cfg), on_block=on_block,
                context=context)
        finally:  # a failing close() is a warning: it must not replace the error that got us here
            for closable in (owned_grader, engine):
                if closable is not None:
                    _close_quietly(closable)

        import stapo

        complete, paper_protocol = completeness(list(problems), list(cfg.data.benchmarks), cfg.data.limit, dropped)
        results = {
            "label": label,
            "run_dir": str(run_dir),
            "model": {"spec": source.spec, "kind": source.kind, "path": source.path, "step": source.step,
                      "run_dir": source.run_dir, "dtype": cfg.model.dtype},
            "prompt": asdict(prompt),
            "protocol": {"benchmarks": list(problems), "samples": {b: cfg.data.samples[b] for b in problems},
                         "settings": [asdict(s) for s in settings], "max_new_tokens": cfg.generation.max_new_tokens,
                         "limit": cfg.data.limit, "seed": cfg.generation.seed,
                         "samples_per_call": cfg.generation.samples_per_call, "engine": engine_info,
                         "grader": asdict(cfg.grader),
                         "verifier": cfg.verifier.model if cfg.verifier.enabled else None},
            "data": {b: {"problems_loaded": totals[b], "problems_evaluated": len(problems[b]),
                         "dropped_long_prompt": dropped[b],
                         "unparsable_golds": [p.id for p in problems[b] if not p.gold_parses],
                         "over_context": (None if context is None else sum(
                             len(p.prompt_ids) + cfg.generation.max_new_tokens > context for p in problems[b]))}
                     for b in problems},
            "context_tokens": context,
            "fingerprint": eval_fingerprint(manifest, (manifest.get("machines") or [None])[-1]),
            "machines": manifest.get("machines", []),
            "metrics": result["metrics"],
            "run": result["run"],
            "complete": complete,
            "paper_protocol": paper_protocol,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "stapo_version": stapo.__version__,
            "git_commit": _git_commit(),
            "config": eval_config_to_dict(cfg),
            "training": source.train_run(),
        }
        write_fingerprint(run_dir, results["fingerprint"])
        if write_reports:
            from stapo.evaluation.report import write_reports as _write

            _write(results, run_dir, plot=cfg.output.plot)
            if wandb:
                log_results_to_wandb(results, run_dir, cfg)
        return results


def log_results_to_wandb(results: dict[str, Any] | Sequence[dict[str, Any]], run_dir: str | os.PathLike,
                         cfg: EvalConfig, name: str | None = None) -> None:
    """:func:`stapo.evaluation.report.log_wandb` with the evaluation config's ``logging.*`` (mode, fallback,
    backends, and the identity keys that override the training run's: project, entity, group, tags, job_type,
    notes), then :func:`stapo.evaluation.report.write_train_summary`: the final numbers into the training run's
    summary (a train.py checkpoint only; the latest step of a sweep). ``logging.backends`` without ``wandb``
    (``[tensorboard]``, ``[none]``) starts no W&B run, neither the evaluation's nor the training run's summary
    update (``eval_summary.json`` is written all the same), as train.py."""
    lc = cfg.logging
    mode = lc.wandb_mode if "wandb" in lc.backends else "disabled"
    log_wandb(results, run_dir, mode=mode, project=lc.project, entity=lc.entity, fallback=lc.wandb_fallback,
              group=lc.group, tags=lc.tags, job_type=lc.job_type, notes=lc.notes, name=name,
              tensorboard="tensorboard" in lc.backends)
    write_train_summary(results, mode=mode, fallback=lc.wandb_fallback)
