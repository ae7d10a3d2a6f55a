"""The study report: curves with 95 % t-bands over seeds, a final table with paired bootstrap differences, a cost
line, the final evaluation's sampling error (docs/study.md#reading-the-report).

Written to the study's output folder: ``report.md``, ``curves.png`` (one panel per metric and comparison,
``report.panels``: seeds, mean, min–max band), ``curves.csv`` (per method, metric and step: seeds, mean, t-band,
min, max), ``final.csv`` (per method and metric: the final value over seeds and the paired difference to the
reference method), ``quadrants.csv`` and ``s2t_groups.csv`` (the token taxonomy: median-entropy quadrants, and the
split by S2T's own rule) and ``length_adjusted.csv`` (exploratory: entropy against response length). Reads each run's
``metrics.jsonl`` (and the final evaluation's ``results.json``); every metric key it reads is in :data:`METRICS` /
:data:`COST_KEYS`.

Only clean data enter the numbers: a run with a non-finite value of a metric read, missing steps, or a folder that is
not the planned run or not a run of its own is listed as excluded with its reason and left out of every statistic
(:func:`run_exclusions`; the claims, :mod:`stapo.study.claims`, leave out the same runs).
"""
from __future__ import annotations

import contextlib
import csv
import fnmatch
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import numpy as np

from stapo.common.checkpoint_files import latest_checkpoint
from stapo.common.plotting import draw_seed_curves, physical_range
from stapo.config import ConfigError, TrainConfig, _flatten, to_dict
from stapo.run.preflight import check_writable
from stapo.run.tracking import CorruptJsonlError, decode_value, read_jsonl_rows
from stapo.study.config import RunSpec, StudyConfig
from stapo.study.keys import COST_KEYS, LABELS, METRICS, QUADRANT_STATS, QUADRANTS, quadrant_key
from stapo.study.runner import default_threads, evaluated_step
from stapo.study.stats import moving_average, paired_bootstrap, t_band, window_steps

__all__ = ["METRICS", "LABELS", "COST_KEYS", "CHECKED_KEYS", "INF_CHECKED_KEYS", "Series", "as_number", "collect",
           "read_runs", "run_exclusions", "identity_problems", "check_output_writable", "writing", "eval_se_rows",
           "final_results", "pooled_quadrant_stat", "write_report"]



@dataclass
class Series:
    """One metric of one method over its seeds.

    Attributes:
        name: the series' name (a :data:`METRICS` name, ``<name>[<key>]`` for a pattern match, or
            ``final_eval[<setting>]``); keys: the metrics.jsonl keys it was read from.
        seeds: [S] the seeds, in the study's order (only seeds with a run folder).
        steps: [T + 1] the step axis 0 … T (step 0: the validation before training; training metrics start at 1).
        values: [S, T + 1] float64, NaN where a run did not log the metric.
    """

    name: str
    keys: list[str]
    seeds: list[int]
    steps: np.ndarray
    values: np.ndarray


def _read_rows(run_dir: Path, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """A run's metrics rows, one per step (the last row of a repeated step), in step order.

    A torn last line (an interrupted write) is left out and one line through ``say`` names the file: the run is
    reported up to its last intact step.

    Raises:
        CorruptJsonlError: a damaged line that is not a torn last one (one line naming the file and line), a row
            outside 0..the run's own ``trainer.total_steps`` or a value that is not a number or null (naming the file,
            the row and the key): the report is not built on silently missing or foreign data.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows, torn = _load_metrics(path)
    total = _configured_steps(run_dir)
    by_step: dict[int, dict[str, Any]] = {}
    # a repeated step (a crashed attempt's row before the resume truncated it): the last one
    for i, r in enumerate(rows, start=1):
        if r["step"] < 0 or (total is not None and r["step"] > total):
            bound = f"0..{total}, the run's trainer.total_steps (config.json)" if total is not None else "0.."
            raise CorruptJsonlError(f"{path}: row {i} has step {r['step']}, outside {bound}: not a row this run wrote")
        bad = next((k for k, v in r.items()
                    if not (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))), None)
        if bad is not None:
            raise CorruptJsonlError(f"{path}: row {i} (step {r['step']}): {bad} = {json.dumps(r[bad])[:40]} is not "
                                    f"a number (metrics are numbers or null)")
        by_step[r["step"]] = r
    if torn:
        last = max(by_step, default=0)
        say(f"{path}: a torn last line ({torn} bytes, an interrupted write) is left out; {run_dir.name} is reported "
            f"to step {last}")
    return [by_step[s] for s in sorted(by_step)]


def _load_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a run's ``metrics.jsonl`` and the bytes of its torn last line, in file order (the one place the
    study reads that file): :func:`stapo.run.tracking.read_jsonl_rows`, every value but ``step`` decoded as
    :func:`stapo.run.tracking.read_metrics` does (:func:`stapo.run.tracking.decode_value`: ``"nan"``, ``"inf"``,
    ``"-inf"`` and the older ``null`` / ``±1e308`` → ``math.nan`` / ``±math.inf``)."""
    rows, torn = read_jsonl_rows(path)
    return [{k: (v if k == "step" else decode_value(v)) for k, v in r.items()} for r in rows], torn


#: The metrics.jsonl keys (:mod:`fnmatch` patterns) that the report and the claims read and that must be finite at
#: every step a run logged them: a NaN (``null`` in metrics.jsonl, docs/metrics.md) or ±inf in any of them makes the
#: run's data unclean (:func:`run_exclusions`): the report's metrics, the response-token count and the mask counts
#: of the pooled fractions.
CHECKED_KEYS: tuple[str, ...] = (*dict.fromkeys(k for keys in METRICS.values() for k in keys),
                                 COST_KEYS["response_tokens"], "actor/*/num_masked", "actor/*/num_response_tokens",
                                 "s2t/would_mask/num_masked")
#: Keys read whose NaN has a meaning — a quadrant without tokens at a step (docs/metrics.md) — so that only ±inf
#: makes a run unclean.
INF_CHECKED_KEYS: tuple[str, ...] = ("s2t/quadrant/*",)


def _nonfinite_problem(rows: list[dict[str, Any]]) -> str | None:
    """The first non-finite value of a :data:`CHECKED_KEYS` key (NaN or ±inf) or of an :data:`INF_CHECKED_KEYS` key
    (±inf) in a run's rows, as one phrase with the count of all such values; None when there is none.

    Worked example: ``actor/entropy`` NaN at steps 58–60 → ``"actor/entropy is NaN at step 58 (3 non-finite values
    at steps 58–60)"``."""
    kinds: dict[str, int] = {}  # key → 0 not read, 1 must be finite, 2 must not be infinite
    found: list[tuple[int, str, float]] = []  # (step, key, value)
    for r in rows:
        for k, v in r.items():
            kind = kinds.get(k)
            if kind is None:
                kind = kinds[k] = (0 if k == "step" else 1 if any(fnmatch.fnmatchcase(k, p) for p in CHECKED_KEYS)
                                   else 2 if any(fnmatch.fnmatchcase(k, p) for p in INF_CHECKED_KEYS) else 0)
            if not kind:
                continue
            x = math.nan if v is None else float(v)  # a number (:func:`_read_rows`; null: an older file's NaN)
            if math.isinf(x) or (kind == 1 and math.isnan(x)):
                found.append((r["step"], k, x))
    if not found:
        return None
    step, key, x = found[0]
    text = "NaN" if math.isnan(x) else "+inf" if x > 0 else "-inf"
    steps = sorted({f[0] for f in found})
    more = (f" ({len(found)} non-finite values at steps {steps[0]}–{steps[-1]})" if len(steps) > 1 else
            f" ({len(found)} non-finite values)" if len(found) > 1 else "")
    return f"{key} is {text} at step {step}{more}"


def _spans(steps: list[int]) -> str:
    """Increasing integers as ranges: [3, 4, 5, 9] → ``"3–5, 9"``."""
    runs: list[list[int]] = []  # [first, last] of each range
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}–{b}" if b > a else str(a) for a, b in runs)


def _gap_problem(rows: list[dict[str, Any]]) -> str | None:
    """The training steps missing between step 1 and a run's last logged step (rows deleted by hand or lost), as one
    phrase; None when every step is there. A run writes one row per step, in order, and a resume redoes the rows
    after its checkpoint, so a finished or interrupted run has none missing."""
    steps = {r["step"] for r in rows if r["step"] >= 1}
    if not steps:
        return None
    missing = sorted(set(range(1, max(steps) + 1)) - steps)
    if not missing:
        return None
    return (f"metrics.jsonl has no rows for step{'s' if len(missing) > 1 else ''} {_spans(missing)} of 1–{max(steps)} "
            f"(deleted or lost rows)")


def _names_itself(run_dir: Path) -> bool:
    """Whether the run's ``config.json`` names the folder it is in (``trainer.run_name``): a copy placed elsewhere
    keeps the name of the run it was copied from."""
    trainer = _run_config(run_dir).get("trainer")
    return isinstance(trainer, dict) and trainer.get("run_name") == run_dir.name


def _duplicates(specs: list[RunSpec]) -> dict[str, str]:
    """Runs that are another run's folder or a copy of it, by content: a run folder that is a symlink, or two runs
    with byte-identical ``config.json`` and ``metrics.jsonl`` (every row, each step's wall time included). Of an
    original and its copies the copies are named (their config.json names another folder); when that cannot be
    told, every one of them. Returns ``run name → reason``."""
    import hashlib

    out: dict[str, str] = {}
    groups: dict[str, list[RunSpec]] = {}
    for s in specs:
        d = s.run_dir
        if d.is_symlink():
            out[s.name] = (f"the run folder {d} is a symlink to {os.readlink(d)}: a run counts once, in its own "
                           f"folder (a duplicate, not an independent seed)")
            continue
        try:
            digest = hashlib.sha256((d / "config.json").read_bytes()).hexdigest() + \
                hashlib.sha256((d / "metrics.jsonl").read_bytes()).hexdigest()
        except OSError:
            continue
        groups.setdefault(digest, []).append(s)
    for group in groups.values():
        originals = [s for s in group if _names_itself(s.run_dir)]
        for s in group:
            if len(group) > 1 and not (len(originals) == 1 and s is originals[0]):
                others = ", ".join(o.name for o in group if o is not s)
                out[s.name] = (f"the same run as {others} (identical config.json and metrics.jsonl): a copy counts "
                               f"once, not as an independent seed")
    return out


def identity_problems(specs: list[RunSpec]) -> dict[str, str]:
    """Runs whose folder is not the run the study planned, or not a run of its own: ``run name → reason`` (one
    line). With the study's identity checks (:func:`stapo.study.runner.run_identity_problems`: a recorded config
    that differs from the plan, a config.json edited after its fingerprint, a symlink or a copy of another run)
    those; without them, the duplicates by content (:func:`_duplicates`). Reads only; the model folder and the
    training data are not hashed (the runs are reported as they were trained)."""
    try:
        from stapo.study.runner import run_identity_problems
    except ImportError:
        return _duplicates(specs)
    out: dict[str, str] = {}
    for s in specs:
        lines = run_identity_problems(s, specs, check_inputs=False)
        if lines:
            out[s.name] = "; ".join(line.removeprefix(f"{s.name}: ") for line in lines)
    return out


def run_exclusions(specs: list[RunSpec], rows: dict[str, list]) -> dict[str, str]:
    """The runs whose data the report and the claims must not use, each with its reason (one line): a non-finite
    value of a metric they read at any logged step (:func:`_nonfinite_problem`: a diverged run's NaN entropy, an
    infinite gradient norm), steps missing from its metrics (:func:`_gap_problem`), or a folder that is not the
    planned run or not a run of its own (:func:`identity_problems`). Only runs with logged rows are looked at (the
    others are read by nothing).

    Args:
        specs: the study's runs; rows: ``run name → metrics rows`` (:func:`read_runs`).

    Returns:
        ``run name → reason`` in grid order; the reasons of one run joined by ``"; "``.
    """
    read = [s for s in specs if rows.get(s.name)]
    identity = identity_problems(specs) if read else {}
    out: dict[str, str] = {}
    for s in read:
        why = [p for p in (identity.get(s.name), _nonfinite_problem(rows[s.name]), _gap_problem(rows[s.name])) if p]
        if why:
            out[s.name] = "; ".join(why)
    return out


def read_runs(specs: list[RunSpec], say: Callable[[str], None] | None = None) -> dict[str, list]:
    """``run name → metrics rows`` of every run (:func:`_read_rows`); ``say`` gets the one-line notes (default
    stderr).

    Raises:
        stapo.run.tracking.CorruptJsonlError: as :func:`_read_rows`.
    """
    say = say or (lambda line: print(f"stapo.study: {line}", file=sys.stderr, flush=True))
    return {s.name: _read_rows(s.run_dir, say) for s in specs}


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config (its ``config.json``, written by train.py); empty when the file is missing or
    damaged."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _configured_steps(run_dir: Path) -> int | None:
    """The run's own ``trainer.total_steps`` (:func:`_run_config`), None when the file is missing or does not say."""
    trainer = _run_config(run_dir).get("trainer")
    steps = trainer.get("total_steps") if isinstance(trainer, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _is_validation(key: str) -> bool:
    """Validation keys (``val-core/…``, ``val-aux/…``) have a step-0 point (the initial policy,
    ``trainer.val_before_train``); training metrics start at step 1."""
    return key.startswith("val-")


def as_number(v: Any) -> float:
    """A metrics.jsonl value as a float: ints and floats as they are, anything else (missing, ``None``, a bool, a
    string) as NaN, so a step that did not log a key drops out of NaN-aware means instead of raising."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None else math.nan


def final_results(spec: RunSpec) -> dict[str, Any] | None:
    """The run's final evaluation (``<run>/final_eval/results.json``) as a dict, ``None`` when there is none, or when
    it evaluated another checkpoint than the run's final one (``model.step`` ≠ ``trainer.total_steps``: the study's
    steps were raised since; the runner evaluates the final checkpoint again).

    Raises:
        stapo.run.tracking.CorruptJsonlError: results.json is not JSON (a damaged file: one line naming it), never
            dropped silently (its run would vanish from the final table and the claims).
    """
    path = spec.run_dir / "final_eval" / "results.json"
    if not path.is_file():
        return None
    try:
        res = json.loads(path.read_text())
        if not isinstance(res, dict) or not isinstance(res.get("metrics", {}), dict):
            raise ValueError("not an object with a 'metrics' object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptJsonlError(f"{path}: damaged final evaluation ({str(e).splitlines()[0]}); restore it (e.g. from "
                                f"an export), or delete it and rerun the study to evaluate the final checkpoint "
                                f"again") from None
    return res if evaluated_step(res) == spec.total_steps else None


def _final_eval(spec: RunSpec) -> dict[str, float]:
    """``setting → average avg@N`` of the run's final evaluation (:func:`final_results`), and with several
    benchmarks also ``setting/benchmark → avg@N`` of each. Empty when there is none (or it is of another step).

    Raises:
        stapo.run.tracking.CorruptJsonlError: results.json is damaged (:func:`final_results`).
    """
    res = final_results(spec)
    out: dict[str, float] = {}
    for setting, m in (res or {}).get("metrics", {}).items():
        out[setting] = as_number(m.get("average", {}).get("avg@N"))
        benches = m.get("benchmarks", {})
        if len(benches) > 1:
            out.update({f"{setting}/{b}": as_number(v.get("avg@N")) for b, v in benches.items()})
    return out


def eval_se_rows(specs: list[RunSpec], confidence: float = 0.95) -> list[dict[str, Any]]:
    """The sampling error of the runs' final evaluations, per decoding setting and benchmark.

    A run's ``avg@N_se`` (evaluate.py: the standard error of avg@N over problems, stapo.evaluation.metrics) says how
    far its avg@N may be from the same checkpoint's accuracy on the whole problem distribution. The resolvable
    difference is the half-width of the normal ``confidence`` interval of the difference of two independent runs'
    avg@N at the median SE: ``z · sqrt(2) · SE`` (z = 1.96 at 95 %); a smaller difference between two runs is
    within their problem-sampling noise. Worked example: SE 0.027 → 1.96 · 1.414 · 0.027 = 0.075.

    Args:
        specs: the study's runs; those without a final evaluation of their final step are left out.
        confidence: the interval's level, in (0, 1).

    Returns:
        One row per (setting, benchmark) in first-seen order: ``setting``, ``benchmark``, ``runs`` (how many
        evaluations report an SE), ``problems`` / ``samples`` (N; "a–b" when the runs differ), ``se_min``,
        ``se_median``, ``se_max`` and ``resolvable`` (fractions of 1; NaN without an SE).

    Raises:
        stapo.run.tracking.CorruptJsonlError: a results.json is damaged (:func:`final_results`).
    """
    from statistics import NormalDist

    z = NormalDist().inv_cdf((1 + confidence) / 2)
    found: dict[tuple[str, str], list[tuple[float, Any, Any]]] = {}
    for spec in specs:
        res = final_results(spec)
        for setting, m in (res or {}).get("metrics", {}).items():
            for bench, v in (m.get("benchmarks") or {}).items():
                se = as_number(v.get("avg@N_se"))
                if not math.isnan(se):
                    found.setdefault((setting, bench), []).append((se, v.get("problems"), v.get("N")))

    def span(xs: list[Any]) -> str:
        vals = sorted({x for x in xs if x is not None})
        return "?" if not vals else str(vals[0]) if len(vals) == 1 else f"{vals[0]}–{vals[-1]}"

    rows = []
    for (setting, bench), vals in found.items():
        ses = np.array([v[0] for v in vals])  # [R] one SE per run
        med = float(np.median(ses))
        rows.append({"setting": setting, "benchmark": bench, "runs": len(vals), "problems": span([v[1] for v in vals]),
                     "samples": span([v[2] for v in vals]), "se_min": float(ses.min()), "se_median": med,
                     "se_max": float(ses.max()), "resolvable": z * math.sqrt(2) * med})
    return rows


def collect(cfg: StudyConfig, specs: list[RunSpec], say: Callable[[str], None] | None = None,
            exclude: Collection[str] = (), rows: dict[str, list] | None = None
            ) -> tuple[dict[str, dict[str, Series]], dict[str, list]]:
    """Read every run folder of the study (nothing is written).

    Args:
        say: where the one-line notes go (a torn last line left out); default stderr.
        exclude: names of runs whose rows are read (and returned) but left out of every series, final evaluations
            included (:func:`run_exclusions`).
        rows: the runs' rows when already read (:func:`read_runs`); default: read here.

    Returns:
        ``(series, rows)``: ``series[name][method]`` a :class:`Series` (names in :data:`METRICS` order, pattern
        matches sorted, then ``final_eval[...]``); ``rows[run name]`` the run's metrics rows (one per step).

    Raises:
        stapo.run.tracking.CorruptJsonlError: a run's metrics.jsonl has a damaged line that is not a torn last line.
    """
    rows = read_runs(specs, say) if rows is None else rows
    t_max = max([s.total_steps for s in specs] + [r[-1]["step"] for r in rows.values() if r])
    steps = np.arange(0, t_max + 1)  # [T + 1] column j = step j
    wanted = cfg.report.metrics or list(METRICS)
    series: dict[str, dict[str, Series]] = {}
    kept = [s for s in specs if s.name not in exclude]
    for method in cfg.methods:
        runs = [s for s in kept if s.method == method and rows[s.name]]
        seeds = [s.seed for s in runs]
        logged = set().union(*[set(r) for s in runs for r in rows[s.name]]) if runs else set()
        for name in wanted:
            targets: list[tuple[str, list[str]]] = []  # (series name, keys in priority order)
            for cand in METRICS[name]:
                if "*" in cand:
                    targets += [(f"{name}[{k}]", [k]) for k in sorted(fnmatch.filter(logged, cand))]
                elif cand in logged and not targets:
                    targets = [(name, [c for c in METRICS[name] if "*" not in c])]
            for sname, keys in targets:
                vals = np.full((len(runs), t_max + 1), np.nan)  # [S, T + 1]
                used: list[str] = []
                for i, s in enumerate(runs):
                    for r in rows[s.name]:
                        key = next((k for k in keys if as_number(r.get(k)) == as_number(r.get(k))), None)
                        first = 0 if key is not None and _is_validation(key) else 1  # step 0: validation only
                        if key is not None and first <= r["step"] <= t_max:
                            vals[i, r["step"]] = as_number(r[key])
                            if key not in used:
                                used.append(key)
                series.setdefault(sname, {})[method] = Series(sname, used, seeds, steps, vals)
        if cfg.final_eval.enabled:
            evals = {s.seed: _final_eval(s) for s in kept if s.method == method}
            for setting in sorted({k for e in evals.values() for k in e}):
                done = [seed for seed, e in evals.items() if setting in e]
                vals = np.full((len(done), t_max + 1), np.nan)  # [S, T + 1], the value at the last step
                for i, seed in enumerate(done):
                    vals[i, -1] = evals[seed][setting]
                source = setting if "/" in setting else f"{setting}/average"
                series.setdefault(f"final_eval[{setting}]", {})[method] = Series(
                    f"final_eval[{setting}]", [f"results.json:{source}/avg@N"], done, steps, vals)
    return series, rows


def _label(name: str) -> str:
    base, _, key = name.partition("[")
    return LABELS.get(base, base) + (f" ({key.rstrip(']')})" if key else "")


def _fmt(x: float, digits: int = 4) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def _fmt_signed(x: float) -> str:
    return "—" if x != x else f"{x:+.3f}"


def _final_rows(cfg: StudyConfig, series: dict[str, dict[str, Series]]) -> list[dict[str, Any]]:
    """One row per (series, method): the final value over seeds and the paired difference to the reference."""
    r = cfg.report
    out = []
    # the study's last training step: the final window is the last W training steps before it (a sparse metric
    # such as validation is not averaged back to the start of training)
    last_step = max((int(s.steps[(s.steps >= 1) & ~np.isnan(s.values).all(axis=0)].max(initial=0))
                     for by_method in series.values() for s in by_method.values()), default=0)
    for sname, by_method in series.items():
        all_vals = np.concatenate([s.values for s in by_method.values()], axis=0)  # [Σ S, T]
        steps = next(iter(by_method.values())).steps
        trained = steps >= 1  # the step-0 validation (the initial policy) is on the curve, never a final value
        win = window_steps(steps[trained], all_vals[:, trained], r.window, last_step)
        cols = np.isin(steps, win)  # [T] the window's columns
        ref = by_method.get(cfg.reference)
        for method, s in by_method.items():
            with np.errstate(all="ignore"):  # a seed without a value in the window: NaN (left out by t_band)
                finals = np.array([np.nanmean(v[cols]) if (~np.isnan(v[cols])).any() else np.nan
                                   for v in s.values])  # [S]
            band = t_band(finals, r.confidence) if finals.size else None
            row = {"metric": sname, "method": method, "keys": " ".join(s.keys),
                   "window_steps": f"{int(win[0])}-{int(win[-1])}" if win.size else "",
                   "n_seeds": int(band.n[0]) if band else 0,
                   "final_mean": float(band.mean[0]) if band else math.nan,
                   "final_ci_low": float(band.low[0]) if band else math.nan,
                   "final_ci_high": float(band.high[0]) if band else math.nan,
                   "reference": cfg.reference, "diff_mean": math.nan, "diff_ci_low": math.nan,
                   "diff_ci_high": math.nan, "n_pairs": 0}
            if ref is not None and method != cfg.reference:
                shared = [sd for sd in s.seeds if sd in ref.seeds]
                diffs = np.array([s.values[s.seeds.index(sd)][cols] - ref.values[ref.seeds.index(sd)][cols]
                                  for sd in shared]).reshape(len(shared), int(cols.sum()))  # [S', W]
                ci = paired_bootstrap(diffs, confidence=r.confidence, n_boot=r.bootstrap_samples,
                                      seed=r.bootstrap_seed)
                row.update(diff_mean=ci.mean, diff_ci_low=ci.low, diff_ci_high=ci.high, n_pairs=ci.n_pairs)
            out.append(row)
    return out


def _smoothed(cfg: StudyConfig, s: Series) -> np.ndarray:
    """[S, T + 1] each run's curve after the report's trailing moving average (``report.smooth``)."""
    return np.array([moving_average(v, cfg.report.smooth) for v in s.values]).reshape(s.values.shape)


def _curve_rows(cfg: StudyConfig, series: dict[str, dict[str, Series]]) -> list[dict[str, Any]]:
    """One row per (series, method, step with a value): the mean over seeds, its t-interval and the seeds' min and
    max, of each run's smoothed curve (:func:`_smoothed`)."""
    out = []
    for sname, by_method in series.items():
        for method, s in by_method.items():
            smooth = _smoothed(cfg, s)
            band = t_band(smooth, cfg.report.confidence)
            for j, step in enumerate(s.steps):
                if band.n[j] == 0:
                    continue
                col = smooth[:, j][~np.isnan(smooth[:, j])]
                out.append({"metric": sname, "method": method, "step": int(step), "n_seeds": int(band.n[j]),
                            "mean": float(band.mean[j]), "ci_low": float(band.low[j]),
                            "ci_high": float(band.high[j]), "min": float(col.min()), "max": float(col.max())})
    return out


def pooled_quadrant_stat(run: list[dict[str, Any]], q: str, stat: str) -> tuple[float, float]:
    """One run's value of a quadrant statistic over some steps, pooled over tokens, and the tokens behind it.

    With the per-step counts logged (``s2t/quadrant/<q>/count``, ``s2t/quadrant/num_tokens``) the steps are
    pooled by token: share = Σ_t count_q(t) / Σ_t num_tokens(t); a mean statistic (grad_norm, entropy_change) =
    Σ_t count_q(t)·value_q(t) / Σ_t count_q(t), so a step with 3 tokens in the quadrant weighs 3, not as much as a
    step with 300. Worked example: counts 1 and 3 with grad_norm 2.0 and 1.0 → (2 + 3) / 4 = 1.25 (the unweighted
    mean of the steps would be 1.5). Without counts (older logs): the plain mean of the steps' values.
    NaN values (an empty quadrant at a step) are left out.

    Returns:
        ``(value, tokens)``: NaN when no step has a value; tokens = Σ count_q (NaN without counts).
    """
    key, ckey, nkey = quadrant_key(q, stat), quadrant_key(q, "count"), "s2t/quadrant/num_tokens"
    if all(as_number(r.get(ckey)) == as_number(r.get(ckey)) for r in run) and \
            all(as_number(r.get(nkey)) == as_number(r.get(nkey)) for r in run):
        counts = [as_number(r.get(ckey)) for r in run]
        tokens = float(sum(counts))
        if stat == "share":
            total = sum(as_number(r.get(nkey)) for r in run)
            return (tokens / total if total > 0 else math.nan), tokens
        pairs = [(c, v) for c, v in zip(counts, (as_number(r.get(key)) for r in run)) if c > 0 and v == v]
        weight = sum(c for c, _ in pairs)
        return (sum(c * v for c, v in pairs) / weight if weight > 0 else math.nan), tokens
    vals = [v for v in (as_number(r.get(key)) for r in run) if v == v]
    return (sum(vals) / len(vals) if vals else math.nan), math.nan


def _quadrant_rows(cfg: StudyConfig, specs: list[RunSpec], rows: dict[str, list]) -> list[dict[str, Any]]:
    """The token taxonomy (docs/method.md#token-analysis) per method: each quadrant's token share, mean logit-gradient
    norm and mean first-order entropy change among the Â > 0 tokens, at step 1 (the base model's rollouts), over the
    first ``report.window`` steps and over each run's last ``report.window`` steps. A run's steps are pooled by token
    (:func:`pooled_quadrant_stat`), then averaged over seeds (seeds without a token in the quadrant are left out);
    ``tokens`` is the quadrant's token count summed over seeds and steps (the sample behind the means). Empty when no
    run logs ``s2t/quadrant/*``."""
    out: list[dict[str, Any]] = []
    window = cfg.report.window
    for method in cfg.methods:
        # training rows only: a step-0 row (the validation of trainer.val_before_train) has no token statistics
        runs = [[r for r in rows[s.name] if r.get("step", 0) >= 1] for s in specs if s.method == method]
        runs = [run for run in runs if run]
        if not runs or not any(quadrant_key(q, "share") in r for q in QUADRANTS for run in runs for r in run):
            continue
        last = max(r["step"] for run in runs for r in run)
        for phase, pick in (("step 1 (base model)", lambda run: run[:1]),
                            (f"first {window} steps", lambda run: run[:window]),
                            (f"last {window} steps", lambda run: run[-window:])):
            for q in QUADRANTS:
                row: dict[str, Any] = {"method": method, "phase": phase, "quadrant": q, "n_seeds": len(runs),
                                       "last_step": last}
                tokens = math.nan
                for stat in QUADRANT_STATS:
                    pooled = [pooled_quadrant_stat(pick(run), q, stat) for run in runs]  # [(value, tokens)] per seed
                    vals = [v for v, _ in pooled if v == v]
                    row[stat] = float(np.mean(vals)) if vals else math.nan
                    if stat == "share":
                        counted = [t for _, t in pooled if t == t]
                        tokens = float(sum(counted)) if counted else math.nan
                row["tokens"] = tokens
                out.append(row)
    return out


#: The S2T-rule groups of the Â > 0 tokens (:func:`_s2t_group_rows`), in table order.
S2T_GROUPS: tuple[str, ...] = ("silenced", "kept candidates", "candidates (silenced + kept)", "non-candidates")


def _pooled_groups(run: list[dict[str, Any]]) -> dict[str, tuple[float, float, float, float]] | None:
    """One run's S2T-rule split of its Â > 0 tokens over some steps: ``group → (share, grad_norm, entropy_change,
    tokens)``, or None when a step lacks a key it needs (older logs).

    Counts per step: Â > 0 tokens ``s2t/quadrant/num_tokens``; S2T's candidates (Â > 0, p < τ_p)
    ``s2t/would_mask/num_candidates`` and what it silences ``s2t/would_mask/num_masked`` (the old policy's S2T on
    the whole batch, logged by every objective). Candidates are exactly the two low-p quadrants (same τ_p, same
    Â > 0), so their mean ‖∇‖ and ΔH are the count-weighted means of ``low_p_high_h`` and ``low_p_low_h``, and the
    non-candidates' those of the two high-p quadrants; the silenced and the kept candidates are counted only (their
    ‖∇‖ and ΔH are not logged: NaN). Shares are of the Â > 0 tokens, pooled over the steps by token.

    Worked example: one step, 100 Â > 0 tokens, 6 candidates of which 4 silenced; low_p_high_h 4 tokens with ΔH
    0.01, low_p_low_h 2 with ΔH 0.04 → silenced 0.04, kept 0.02, candidates 0.06 with ΔH (0.04 + 0.08) / 6 = 0.02,
    non-candidates 0.94."""
    keys = ("s2t/quadrant/num_tokens", "s2t/would_mask/num_candidates", "s2t/would_mask/num_masked")
    if not run or any(as_number(r.get(k)) != as_number(r.get(k)) for r in run for k in keys):
        return None
    n = sum(as_number(r["s2t/quadrant/num_tokens"]) for r in run)
    cand = sum(as_number(r["s2t/would_mask/num_candidates"]) for r in run)
    masked = sum(as_number(r["s2t/would_mask/num_masked"]) for r in run)

    def weighted(quadrants: tuple[str, str], stat: str) -> float:
        num = den = 0.0
        for r in run:
            for q in quadrants:
                c, v = as_number(r.get(quadrant_key(q, "count"))), as_number(r.get(quadrant_key(q, stat)))
                if c == c and c > 0 and v == v:
                    num, den = num + c * v, den + c
        return num / den if den > 0 else math.nan

    share = (lambda k: k / n) if n > 0 else (lambda k: math.nan)
    low, high = ("low_p_high_h", "low_p_low_h"), ("high_p_high_h", "high_p_low_h")
    return {"silenced": (share(masked), math.nan, math.nan, masked),
            "kept candidates": (share(cand - masked), math.nan, math.nan, cand - masked),
            "candidates (silenced + kept)": (share(cand), weighted(low, "grad_norm"), weighted(low, "entropy_change"),
                                             cand),
            "non-candidates": (share(n - cand), weighted(high, "grad_norm"), weighted(high, "entropy_change"),
                               n - cand)}


def _s2t_group_rows(cfg: StudyConfig, specs: list[RunSpec], rows: dict[str, list]) -> list[dict[str, Any]]:
    """The token taxonomy by S2T's own rule (docs/study.md#reading-the-report): per method and phase (step 1, the
    first and each run's last ``report.window`` steps, as :func:`_quadrant_rows`), each group of
    :data:`S2T_GROUPS` among the Â > 0 tokens (:func:`_pooled_groups`), its share, mean ‖∇‖ and mean ΔH averaged over
    seeds (seeds without a value left out) and its tokens summed over seeds. Empty when no run logs the counts."""
    out: list[dict[str, Any]] = []
    window = cfg.report.window
    for method in cfg.methods:
        runs = [[r for r in rows[s.name] if r.get("step", 0) >= 1] for s in specs if s.method == method]
        runs = [run for run in runs if run and _pooled_groups(run) is not None]
        if not runs:
            continue
        for phase, pick in (("step 1 (base model)", lambda run: run[:1]),
                            (f"first {window} steps", lambda run: run[:window]),
                            (f"last {window} steps", lambda run: run[-window:])):
            pooled = [_pooled_groups(pick(run)) for run in runs]
            for g in S2T_GROUPS:
                row: dict[str, Any] = {"method": method, "phase": phase, "group": g, "n_seeds": len(runs)}
                for i, stat in enumerate(("share", "grad_norm", "entropy_change", "tokens")):
                    vals = [p[g][i] for p in pooled if p is not None and p[g][i] == p[g][i]]
                    row[stat] = (float(sum(vals)) if stat == "tokens" else float(np.mean(vals))) if vals else math.nan
                out.append(row)
    return out


def _cut_comparison(specs: list[RunSpec], rows: dict[str, list]) -> tuple[int, int, float]:
    """Over every training step of the runs that log S2T's own cut (``actor/s2t/entropy_threshold``, STAPO) next to
    the quadrants' median cut (``s2t/quadrant/entropy_threshold``): ``(steps with both, steps where S2T's cut ≥ the
    median cut, the largest S2T cut in nats)``. Where S2T's cut is the higher one, the low_p_low_h quadrant is a
    subset of the silenced tokens (its lowest-entropy part)."""
    both = above = 0
    top = math.nan
    for s in specs:
        for r in rows.get(s.name, []):
            a, b = as_number(r.get("actor/s2t/entropy_threshold")), as_number(r.get("s2t/quadrant/entropy_threshold"))
            if r.get("step", 0) >= 1 and a == a and b == b:
                both, above = both + 1, above + (a >= b)
                top = a if top != top else max(top, a)
    return both, above, top


def _clip_counts(specs: list[RunSpec], rows: dict[str, list]) -> dict[str, tuple[int, int]]:
    """``key → (training steps logging it, steps where it is > 0)`` over every run, for ``actor/pg_clipfrac``,
    ``actor/pg_clipfrac_lower`` and ``actor/ppo_kl`` (its absolute value): whether the PPO clip ever acted. With one
    optimizer update per rollout the ratio is 1 at every token, so all three are 0."""
    out: dict[str, tuple[int, int]] = {}
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
        vals = [as_number(r.get(key)) for s in specs for r in rows.get(s.name, []) if r.get("step", 0) >= 1]
        vals = [v for v in vals if v == v]
        if vals:
            out[key] = (len(vals), sum(abs(v) > 0 for v in vals))
    return out


def _length_rows(cfg: StudyConfig, specs: list[RunSpec], rows: dict[str, list]
                 ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Exploratory: entropy against response length (docs/study.md#reading-the-report).

    Over every training step of every run given, x = ``response_length/mean`` and y = ``actor/entropy``: the
    Pearson correlation r and the least-squares line y ≈ a + b·x. A run's length-adjusted entropy is its mean
    residual y − (a + b·x), over all its training steps and over the final window (its last ``report.window``
    steps); ``diff_*`` is that minus the reference method's at the same seed (NaN without one).

    Returns:
        ``(fit, rows)``: fit = ``{"r", "a", "b", "points"}`` (NaN with fewer than 3 points or no spread); rows: one
        per run (method, seed, resid_all, resid_final, diff_all, diff_final), in the study's order.
    """
    xy = {s.name: [(as_number(r.get("response_length/mean")), as_number(r.get("actor/entropy")))
                   for r in rows.get(s.name, []) if r.get("step", 0) >= 1] for s in specs}
    xy = {k: [(x, y) for x, y in v if x == x and y == y] for k, v in xy.items()}
    pts = np.array([p for v in xy.values() for p in v], dtype=np.float64).reshape(-1, 2)  # [P, 2]
    nan = {"r": math.nan, "a": math.nan, "b": math.nan, "points": int(pts.shape[0])}
    if pts.shape[0] < 3 or np.ptp(pts[:, 0]) == 0 or np.ptp(pts[:, 1]) == 0:
        return nan, []
    b, a = np.polyfit(pts[:, 0], pts[:, 1], 1)
    fit = {"r": float(np.corrcoef(pts[:, 0], pts[:, 1])[0, 1]), "a": float(a), "b": float(b),
           "points": int(pts.shape[0])}
    resid: dict[tuple[str, int], tuple[float, float]] = {}
    for s in specs:
        v = np.array(xy[s.name], dtype=np.float64).reshape(-1, 2)
        if v.shape[0]:
            e = v[:, 1] - (a + b * v[:, 0])  # [T] residuals in nats
            resid[(s.method, s.seed)] = (float(e.mean()), float(e[-cfg.report.window:].mean()))
    out = []
    for (method, seed), (r_all, r_fin) in resid.items():
        ref = resid.get((cfg.reference, seed)) if method != cfg.reference else None
        out.append({"method": method, "seed": seed, "resid_all": r_all, "resid_final": r_fin,
                    "diff_all": r_all - ref[0] if ref else math.nan, "diff_final": r_fin - ref[1] if ref else math.nan})
    return fit, out


def _tmp(path: Path) -> Path:
    """A temporary name beside ``path`` for an atomic replace, own to this process (a ``--report-only`` may write
    the report while the runner writes it too)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Re-raise an OSError of the block as one naming ``path`` (:func:`stapo.run.preflight.write_error`: same type and
    errno), e.g. ``[Errno 28] cannot write runs/study/x/final.csv: No space left on device``."""
    try:
        yield
    except OSError as e:
        from stapo.run.preflight import write_error

        raise write_error(e, path) from None


def check_output_writable(out: Path, what: str) -> None:
    """Whether ``what`` (``"the report"``, ``"the claims"``) can be written into the study folder ``out``
    (:func:`stapo.run.preflight.check_writable`: a probe file written and removed; nothing is created).

    Raises:
        stapo.config.ConfigError: it cannot (a read-only folder or file system, permissions, no space): one line
            naming the folder, the operating system's reason and what to do.
    """
    try:
        check_writable(out, "output_dir")
    except ConfigError as e:
        raise ConfigError(f"{e} (the study writes {what} into its own folder, beside its runs: for a read-only "
                          f"study, copy its folder somewhere writable and pass output_dir=<the copy>)") from None


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    tmp = _tmp(path)
    with writing(path), tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else
                            f"{v:.10g}" if isinstance(v, float) else v) for k, v in row.items()})
    with writing(path):
        os.replace(tmp, path)


def _plot(path: Path, cfg: StudyConfig, series: dict[str, dict[str, Series]]) -> bool:
    """``curves.png``: one panel per metric and comparison (``report.panels``; default one of every method). In each,
    per method a thin line per seed, the mean over seeds as a thick line and a light band from the seeds' minimum to
    their maximum, of each run's smoothed curve (:func:`_smoothed`): the band stays within the values the metric
    took (no negative entropy, no accuracy above 1), unlike a t-band over 2–3 seeds. A method keeps its colour in
    every panel. Returns False when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = [n for n in series if not n.startswith("final_eval") and series[n]]
    if not names:
        return False
    panels = cfg.report.panels or [list(cfg.methods)]
    per_row = max(1, 4 // len(panels))  # metrics side by side in one row of the figure
    ncol, nrow = per_row * len(panels), math.ceil(len(names) / per_row)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.3 * ncol, 3.3 * nrow), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {m: colors[k % len(colors)] for k, m in enumerate(cfg.methods)}
    used = set()
    for i, name in enumerate(names):
        for j, panel in enumerate(panels):
            ax = axes[i // per_row, (i % per_row) * len(panels) + j]
            used.add(id(ax))
            for method in panel:
                s = series[name].get(method)
                if s is None:
                    continue
                # seeds, mean, min-max band (stapo/common/plotting.py, shared with scripts/plot_runs.py)
                ranges = {physical_range(k) for k in s.keys}  # one range for all the keys read, else none
                draw_seed_curves(ax, s.steps, _smoothed(cfg, s), color[method], f"{method} ({len(s.seeds)})",
                                 clip=ranges.pop() if len(ranges) == 1 else (None, None))
            ax.set_title(f"{_label(name)}" + (f"\n{', '.join(panel)}" if len(panels) > 1 else ""), fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if i < per_row:
                ax.legend(fontsize=7, title="method (seeds)", title_fontsize=7)
            if i // per_row == nrow - 1:
                ax.set_xlabel("training step", fontsize=8)
    for ax in axes.flat:
        if id(ax) not in used:
            ax.axis("off")
    smooth = f", each run smoothed over {cfg.report.smooth} steps" if cfg.report.smooth > 1 else ""
    fig.suptitle(f"study {cfg.name}: thin lines = seeds, thick = mean over seeds, band = the seeds' min–max{smooth}",
                 fontsize=11)
    fig.tight_layout()
    tmp = _tmp(path)
    with writing(path):
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        os.replace(tmp, path)
    return True


def _cost(cfg: StudyConfig, specs: list[RunSpec], rows: dict[str, list],
          launches: dict[str, list[tuple[int, int | None]]]) -> dict[str, Any]:
    """Steps, response tokens and compute of the runs' metrics (and the runner's recorded attempts).

    CPU-hours of training: Σ over steps of ``timing_s/step`` × the threads of the launch that trained the step
    (``launches[run]``, :func:`_launch_threads`: ``run_info.json``'s machine line, "…, N threads"), the default
    thread count (:func:`default_threads`) where a run does not say (``threads_assumed``: those runs).
    ``threads`` is that count when every step had the same, else None (mixed). ``bad_attempts``: lines of
    ``attempts.jsonl`` that are not an attempt record, left out of the wall time."""
    default = default_threads(cfg)
    tokens = sum(as_number(x.get(COST_KEYS["response_tokens"])) for r in rows.values() for x in r
                 if COST_KEYS["response_tokens"] in x)
    step_s, cpu_s, used, assumed = 0.0, 0.0, set(), []
    for s in specs:
        for x in rows.get(s.name, []):
            if COST_KEYS["step_time"] not in x:
                continue
            t = as_number(x[COST_KEYS["step_time"]])
            # the last launch that started before this step trained it
            k = next((n for start, n in reversed(launches[s.name]) if start < x.get("step", 0)), None)
            if k is None and s.name not in assumed:
                assumed.append(s.name)
            k = k or default
            step_s, cpu_s = step_s + t, cpu_s + t * k
            used.add(k)
    wall_s, wall_cpu_s, bad_attempts = 0.0, 0.0, 0
    path = Path(cfg.output_dir) / "attempts.jsonl"
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                a = json.loads(line)
                wall_s += float(a["wall_s"])
                wall_cpu_s += float(a["wall_s"]) * int(a.get("threads", default))
            except (ValueError, KeyError, TypeError):
                bad_attempts += bool(line.strip())
    threads = used.pop() if len(used) == 1 else (default if not used else None)
    return {"runs": sum(bool(r) for r in rows.values()), "steps": sum(r[-1]["step"] for r in rows.values() if r),
            "tokens": tokens, "step_h": step_s / 3600, "threads": threads, "cpu_h": cpu_s / 3600,
            "wall_h": wall_s / 3600, "wall_cpu_h": wall_cpu_s / 3600, "threads_assumed": assumed,
            "default_threads": default, "bad_attempts": bad_attempts}


def _launch_threads(run_dir: Path) -> list[tuple[int, int | None]]:
    """``[(start_step, threads)]`` per launch of the run, from ``run_info.json`` (each launch's machine line ends in
    "…, N threads", stapo.common.perf); threads None where the line lacks it; [] when the file is missing or damaged."""
    try:
        launches = json.loads((run_dir / "run_info.json").read_text())["launches"]
        out = []
        for launch in launches:
            m = re.search(r"(\d+) threads", str(launch.get("machine", "")))
            out.append((int(launch.get("start_step", 0)), int(m.group(1)) if m else None))
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _pairing_notes(cfg: StudyConfig, specs: list[RunSpec]) -> list[str]:
    """Keys that decide the prompts and their rollouts and differ between methods (then pairs do not share
    prompts), read from what each run recorded (its ``config.json``; keys it predates at their schema default) and
    from the study's plan only for a run without one — the notes describe the runs reported, not a plan that was
    changed since."""
    default = _flatten(to_dict(TrainConfig()))

    def recorded(spec: RunSpec) -> dict[str, Any]:
        cfg_json = _run_config(spec.run_dir)
        return {**default, **_flatten(cfg_json)} if cfg_json else _flatten(to_dict(spec.train))

    notes = []
    for seed in dict.fromkeys(s.seed for s in specs):
        flat = {s.method: recorded(s) for s in specs if s.seed == seed}
        keys = sorted({k for f in flat.values() for k in f if k.startswith(("data.", "rollout.n", "trainer.seed",
                                                                             "trainer.total_steps"))
                       and not k.startswith("data.root")})
        differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat.values()}) > 1]
        if differ:
            notes.append(f"seed {seed}: the methods differ in {', '.join(differ)}, so its pairs do not share "
                         f"prompts (the paired differences are then plain differences per step)")
    return notes


def _hardware(run_dir: Path) -> tuple[str, str]:
    """(machine, compute dtype) a run trained on: the last launch's ``run_info.json`` machine line (without the
    package versions) and ``config.json``'s resolved ``model.compute_dtype``; ``"?"`` where a file is missing
    or damaged. Runs of one study may come from different machines (sessions resume the grid wherever they run),
    and ``compute_dtype: auto`` trains in bf16 where the CPU has native bf16 and in fp32 elsewhere."""
    machine, dtype = "?", "?"
    try:
        launches = json.loads((run_dir / "run_info.json").read_text())["launches"]
        machine = str(launches[-1]["machine"]).split(", torch")[0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
    model = _run_config(run_dir).get("model")
    if isinstance(model, dict) and "compute_dtype" in model:
        dtype = str(model["compute_dtype"])
    return machine, dtype


def _checkpoint_step(run_dir: Path) -> int:
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    try:
        return int(ckpt.name.removeprefix("step_")) if ckpt is not None else 0
    except ValueError:
        return 0


def write_report(cfg: StudyConfig, specs: list[RunSpec], say: Callable[[str], None] | None = None) -> Path:
    """Write ``report.md``, ``curves.png``, ``curves.csv`` and ``final.csv`` into the study's output folder
    (each file replaced atomically) from whatever runs exist; returns the path of ``report.md``. Reads the run
    folders only (nothing under ``runs/`` is written), so it may run beside a working runner.

    Runs whose data are not clean (:func:`run_exclusions`) are listed with their reason and left out of the
    curves, the final values and differences, the token taxonomy and the sampling error (their steps still count in
    the cost); the claims leave out the same runs.

    Args:
        say: where one-line notes go (:func:`collect`); default stderr.

    Raises:
        stapo.run.tracking.CorruptJsonlError: a run's metrics.jsonl has a damaged line that is not a torn last line
            (one line naming the file and line; nothing is written).
        stapo.config.ConfigError: the output folder cannot be written (read-only, no space): one line naming it
            (:func:`check_output_writable`; checked before anything is read).
        OSError: a write failed all the same (a full disk): the message names the file (:func:`writing`).
    """
    out = Path(cfg.output_dir)
    check_output_writable(out, "the report")
    rows = read_runs(specs, say)
    excluded = run_exclusions(specs, rows)
    kept = [s for s in specs if s.name not in excluded]
    series, _ = collect(cfg, specs, exclude=excluded, rows=rows)
    curves = _curve_rows(cfg, series)
    finals = _final_rows(cfg, series)
    _write_csv(out / "curves.csv", curves, ["metric", "method", "step", "n_seeds", "mean", "ci_low", "ci_high",
                                            "min", "max"])
    _write_csv(out / "final.csv", finals, ["metric", "method", "keys", "window_steps", "n_seeds", "final_mean",
                                           "final_ci_low", "final_ci_high", "reference", "diff_mean",
                                           "diff_ci_low", "diff_ci_high", "n_pairs"])
    plotted = _plot(out / "curves.png", cfg, series)
    launches = {s.name: _launch_threads(s.run_dir) for s in specs}  # [(start step, threads)] per launch
    cost = _cost(cfg, specs, rows, launches)
    r = cfg.report
    conf = f"{r.confidence:.0%}"
    seeds = "; ".join(f"{m} {', '.join(str(s.seed) for s in specs if s.method == m)}" for m in cfg.methods)
    lines = [f"# Study report: {cfg.name}", "",
             f"- Config: `{cfg.source}`; output: `{out}`; W&B groups `{cfg.name}-<method>` (tag `study:{cfg.name}`)",
             f"- Methods: {', '.join(cfg.methods)}; reference for the differences: **{cfg.reference}**; "
             f"seeds: {seeds}",
             f"- **Cost**: {cost['runs']} runs, {cost['steps']} steps, {cost['tokens']:.0f} response tokens; "
             f"Σ step time {cost['step_h']:.2f} h × "
             + (f"{cost['threads']} threads" if cost["threads"] else "each step's threads (run_info.json)")
             + f" = {cost['cpu_h']:.2f} CPU-hours; "
             f"runner wall time (recorded attempts) {cost['wall_h']:.2f} h = {cost['wall_cpu_h']:.2f} CPU-hours", ""]
    lines += ["## Runs", "", "| run | steps logged | of | mean s/step | threads | compute dtype | machine |",
              "|---|---|---|---|---|---|---|"]
    hardware = {s.name: _hardware(s.run_dir) for s in specs}
    for s in specs:
        logged = sum(x["step"] >= 1 for x in rows[s.name])  # training steps with a row (a gap is not counted)
        times = [as_number(x[COST_KEYS["step_time"]]) for x in rows[s.name] if COST_KEYS["step_time"] in x]
        per_step = f"{sum(times) / len(times):.1f}" if times else "n/a"
        machine, dtype = hardware[s.name]
        threads = (launches[s.name] or [(0, None)])[-1][1] or "?"  # the last launch's
        name = f"{s.name} (excluded)" if s.name in excluded else s.name
        lines.append(f"| {name} | {logged} | {s.total_steps} | {per_step} | {threads} | {dtype} | {machine} |")
    mixed = {h for n, h in hardware.items() if rows[n]}
    if len({d for _, d in mixed}) > 1 or len({m for m, _ in mixed}) > 1:
        lines += ["", "The runs were trained on more than one machine or compute dtype (above): the seeds of a "
                      "method, and the methods compared at one seed, may differ in numerics as well as in the "
                      "method, and the s/step (and CPU-hours) are not comparable across machines."]
    short = [s for s in specs if not rows[s.name] or rows[s.name][-1]["step"] < s.total_steps]
    lost = [s for s in short if _checkpoint_step(s.run_dir) >= s.total_steps]  # trained; rows lost (a torn line)
    missing = [s.name for s in short if s.name not in {x.name for x in lost}]
    if lost:
        lines += ["", "Finished, but their metrics.jsonl lacks the rows of the last steps (a torn last line; the "
                      "training state is complete, the rows cannot be recomputed without retraining): "
                  + ", ".join(f"{s.name} (rows to step {rows[s.name][-1]['step'] if rows[s.name] else 0} of "
                              f"{s.total_steps})" for s in lost) + "."]
    if missing:
        lines += ["", f"Not finished (reported as far as they got): {', '.join(missing)}."]
    unevaluated = [s.name for s in specs if cfg.final_eval.enabled and s not in short and final_results(s) is None]
    if unevaluated:
        lines += ["", "Finished without a final evaluation of their last checkpoint (left out of the final-evaluation "
                      f"rows; rerun the study to evaluate them): {', '.join(unevaluated)}."]
    if excluded:
        lines += ["", f"**Excluded: {len(excluded)} run{'s' if len(excluded) > 1 else ''}** whose data are not clean, "
                      "left out of everything below (curves, final values, differences, token taxonomy, sampling "
                      "error; their steps count in the cost) and out of the claims; the seeds columns say how many "
                      "of a method's planned seeds remain:", ""]
        lines += [f"- {name}: {why}" for name, why in excluded.items()]
    lines += ["", "## Curves", "",
              "The figure: one panel per metric and comparison (`report.panels`), per method a thin line per seed, "
              "the mean over seeds (thick) and the seeds' min–max range (band)"
              + (f", each run smoothed by a trailing moving average over {r.smooth} steps" if r.smooth > 1 else "")
              + f". `curves.csv` has per method and step the mean, the {conf} t-interval over seeds "
              f"(mean ± t_{{{(1 + r.confidence) / 2:.3g}, n−1}} · s/√n; empty with one seed; with 2–3 seeds it is "
              "wide and may pass the metric's range) and the seeds' min and max.", ""]
    if plotted:
        lines += ["![curves](curves.png)", ""]
    lines += ["## Final values", "",
              f"Final value of a run = the mean of the metric over the steps it logged within the last {r.window} "
              "training steps (a sparse metric such as validation: its points there, or its last point if none; "
              "the window column); over seeds: mean "
              f"± the {conf} t-interval half-width (n/a with one seed). Δ = method − {cfg.reference}, paired by "
              f"(seed, step) over those steps: mean over seeds of the per-seed mean difference, with a {conf} "
              f"two-stage percentile bootstrap interval ({r.bootstrap_samples} replicates, RNG seed "
              f"{r.bootstrap_seed}: seeds resampled, then steps within each seed; docs/study.md); with one pair there "
              "is no interval (n/a). With a handful of seeds a bootstrap over seeds spans little more than their "
              "range (with one value per seed, as for the final evaluation, and at most 3 seeds it is the range "
              "of the per-seed differences): read it as descriptive, not as a test (`python -m stapo.study.claims` "
              "tests with the t-interval over seeds). Data: `final.csv`.",
              "", f"| metric | method | seeds | final | ± | Δ vs {cfg.reference} | {conf} CI of Δ | pairs |",
              "|---|---|---|---|---|---|---|---|"]
    for row in finals:
        half = (row["final_ci_high"] - row["final_mean"]) if not math.isnan(row["final_ci_high"]) else math.nan
        if row["method"] == cfg.reference:
            diff, ci = "—", "—"
        elif not row["n_pairs"]:  # the reference does not log it, or shares no seed with this method
            diff, ci = "no pairs", "—"
        elif row["n_pairs"] == 1:  # one seed, one step (e.g. a final evaluation of one seed): no interval
            diff, ci = _fmt(row["diff_mean"]), "n/a"
        else:
            diff, ci = _fmt(row["diff_mean"]), f"[{_fmt(row['diff_ci_low'])}, {_fmt(row['diff_ci_high'])}]"
        planned = sum(s.method == row["method"] for s in specs)
        n = f"{row['n_seeds']} of {planned}" if row["n_seeds"] < planned else row["n_seeds"]
        lines.append(f"| {_label(row['metric'])} | {row['method']} | {n} | {_fmt(row['final_mean'])} "
                     f"| {_fmt(half, 3)} | {diff} | {ci} | {row['n_pairs'] or '—'} |")
    absent = [f"{name} ({', '.join(m for m in cfg.methods if m not in series.get(name, {}))})"
              for name in (r.metrics or METRICS) if "*" not in METRICS[name][0]
              and any(m not in series.get(name, {}) for m in cfg.methods)]
    quadrants = _quadrant_rows(cfg, kept, rows)
    if quadrants and all(q["share"] != q["share"] for q in quadrants):  # every share NaN: no Â > 0 token anywhere
        lines += ["", "## Token taxonomy", "", "No response token had Â > 0 in the steps read (every group's rewards "
                  "were equal or below their mean), so the quadrant table is empty and is not shown."]
        quadrants = []
    if not quadrants:
        with writing(out / "quadrants.csv"):
            (out / "quadrants.csv").unlink(missing_ok=True)  # no stale table from an earlier report
    if quadrants:
        _write_csv(out / "quadrants.csv", quadrants, ["method", "phase", "quadrant", "n_seeds", "last_step",
                                                      *QUADRANT_STATS, "tokens"])
        lines += ["", "## Token taxonomy", "",
                  "Response tokens with Â > 0, split by p < τ_p (low_p) and H below the median H of those tokens "
                  "(low_h). low_p_low_h is a median-entropy split, **not the set S2T silences**: S2T's entropy cut is "
                  "the q-quantile (algorithm.s2t.entropy_quantile) of the candidates' H, Â > 0 and p < τ_p (the next "
                  "table splits by that rule). share: the quadrant's fraction of those tokens; "
                  "‖∇‖: mean logit-gradient norm |Â|·sqrt(1 − 2p + Σπ²)/T; ΔH: mean first-order entropy change per "
                  "unit step (docs/metrics.md, s2t/quadrant/*). At step 1 (the base model's rollouts), over the first "
                  f"and over each run's last {r.window} steps: a run's steps pooled by token, then the mean over "
                  "seeds; tokens: the quadrant's tokens summed over seeds and steps. Data: `quadrants.csv`.", "",
                  "| method | phase | quadrant | share | ‖∇‖ | ΔH | tokens |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {q['method']} | {q['phase']} | {q['quadrant']} | {_fmt(q['share'])} | {_fmt(q['grad_norm'])} "
                  f"| {_fmt(q['entropy_change'])} | {_fmt(q['tokens'], 6)} |" for q in quadrants]
    groups = _s2t_group_rows(cfg, kept, rows) if quadrants else []
    if not groups:
        with writing(out / "s2t_groups.csv"):
            (out / "s2t_groups.csv").unlink(missing_ok=True)
    else:
        _write_csv(out / "s2t_groups.csv", groups, ["method", "phase", "group", "n_seeds", *QUADRANT_STATS, "tokens"])
        both, above, top = _cut_comparison(kept, rows)
        lines += ["", "### Token taxonomy by S2T's rule", "",
                  "The same Â > 0 tokens split as S2T splits them (at the old policy, for every method: what S2T "
                  "silences or would silence): **silenced** (p < τ_p and H below the q-quantile of the candidates' "
                  "H), **kept candidates** (p < τ_p, H at or above that cut), **non-candidates** (p ≥ τ_p). Counts "
                  "from `s2t/would_mask/num_candidates` and `num_masked` at every step. The candidates are exactly "
                  "the two low-p quadrants, so their ‖∇‖ and ΔH are the quadrants' count-weighted means (and the "
                  "non-candidates' those of the high-p quadrants); **the silenced and the kept candidates' own ‖∇‖ "
                  "and ΔH are not in the logged metrics** (n/a): splitting them needs per-token statistics that the "
                  "runs did not keep (their rollouts are not in the grid), i.e. training again with that split "
                  "logged. Pooled by token per run, then the mean over seeds; tokens summed over seeds. Data: "
                  "`s2t_groups.csv`.", ""]
        if both:
            lines += [f"Where S2T's own cut is logged (`actor/s2t/entropy_threshold`), it was at or above the "
                      f"quadrants' median cut at {above} of {both} steps (there low_p_low_h is a subset of the "
                      f"silenced tokens, their lowest-entropy part) and at most {top:.2f} nats, so every silenced "
                      f"token had H < {top:.2f} < −ln τ_p and a positive first-order ΔH, by the formula.", ""]
        lines += ["| method | phase | group | share | ‖∇‖ | ΔH | tokens |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {g['method']} | {g['phase']} | {g['group']} | {_fmt(g['share'])} | {_fmt(g['grad_norm'])} "
                  f"| {_fmt(g['entropy_change'])} | {_fmt(g['tokens'], 6)} |" for g in groups]
    clip = _clip_counts(kept, rows)
    if clip:
        lines += ["", "## Did the clip act?", "",
                  "Training steps at which each quantity was > 0, over every run reported (the PPO ratio's clip, "
                  "docs/metrics.md): " + "; ".join(f"`{k}` {pos} of {n}" for k, (n, pos) in clip.items()) + "."]
        if all(pos == 0 for _, pos in clip.values()):
            lines += ["", "The clip never acted: each rollout feeds one optimizer update "
                          "(`actor.ppo_mini_batch_size` = `data.train_batch_size`), so the update is on-policy, the "
                          "ratio is 1 at every token and no ε or dual clip can bind. Clip-higher and the dual clip of "
                          "JustRL, 20-Entropy and STAPO are inert here: STAPO and JustRL differ only by S2T's mask."]
    fit, length = _length_rows(cfg, kept, rows)
    if length:
        _write_csv(out / "length_adjusted.csv", length, ["method", "seed", "resid_all", "resid_final", "diff_all",
                                                         "diff_final"])
        lines += ["", "## Exploratory: entropy and response length", "",
                  f"Not a pre-registered test. Over all {fit['points']} training steps of the runs reported, the "
                  f"step's mean entropy (`actor/entropy`) and mean response length (`response_length/mean`) "
                  f"correlate at r = {fit['r']:.3f} (Pearson); least squares: entropy ≈ {fit['a']:.3f} + "
                  f"{fit['b']:.4f} · length (nats, tokens). Length-adjusted entropy of a run: its mean residual from "
                  f"that line over all its training steps, and over its last {r.window} steps; Δ = method − "
                  f"{cfg.reference} at the same seed (negative: lower entropy than {cfg.reference} at the same "
                  "length). One line for every method, so a method whose entropy-length relation differs is "
                  "compared on a line that is not its own. Data: `length_adjusted.csv`.", "",
                  f"| method | seed | residual, all steps | residual, last {r.window} | Δ all steps | "
                  f"Δ last {r.window} |", "|---|---|---|---|---|---|"]
        lines += [f"| {x['method']} | {x['seed']} | {x['resid_all']:+.3f} | {x['resid_final']:+.3f} | "
                  f"{_fmt_signed(x['diff_all'])} | {_fmt_signed(x['diff_final'])} |" for x in length]
    else:
        with writing(out / "length_adjusted.csv"):
            (out / "length_adjusted.csv").unlink(missing_ok=True)
    se_rows = eval_se_rows(kept, r.confidence) if cfg.final_eval.enabled else []
    if se_rows:
        lines += ["", "## Final evaluation: sampling error", "",
                  "A run's final avg@N is measured on a finite set of problems: SE = its standard error over problems "
                  "(results.json `avg@N_se`), min / median / max over the runs. Resolvable difference: the half-width "
                  f"of the {conf} normal interval of the difference of two runs' avg@N at the median SE "
                  "(z · √2 · SE); a smaller difference between two single runs is within their problem-sampling "
                  "noise (the intervals over seeds above also carry the seed-to-seed variation).", "",
                  "| setting | benchmark | runs | problems | N | SE min | SE median | SE max | resolvable difference |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {e['setting']} | {e['benchmark']} | {e['runs']} | {e['problems']} | {e['samples']} "
                  f"| {_fmt(e['se_min'], 3)} | {_fmt(e['se_median'], 3)} | {_fmt(e['se_max'], 3)} "
                  f"| {_fmt(e['resolvable'], 3)} |" for e in se_rows]
    notes = _pairing_notes(cfg, kept)
    if cost["threads_assumed"]:
        notes.append(f"threads not recorded (run_info.json missing, damaged or without a thread count): "
                     f"{', '.join(cost['threads_assumed'])}; the cost line counts their steps at "
                     f"{cost['default_threads']} threads")
    if cost["bad_attempts"]:
        notes.append(f"attempts.jsonl: {cost['bad_attempts']} line(s) that are not attempt records are left out of "
                     f"the runner wall time")
    if absent or notes:
        lines += ["", "Notes:", ""]
        lines += [f"- not logged: {a}" for a in absent]
        lines += [f"- {n}" for n in notes]
    tmp = _tmp(out / "report.md")
    with writing(out / "report.md"):
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, out / "report.md")
    return out / "report.md"
