"""The mechanism study's verdicts (issue 32), by rules fixed before its trunk ran (docs/study.md, "Mechanism study
(issue 32): rules fixed before the trunk"; every threshold is a named constant below and quoted there).

    python -m stapo.study.mechanism_claims --trunk RUN_DIR [--calibration CSV_OR_JSON]
        [--fork-pairs JUSTRL_DIR:STAPO_DIR ...] [--stapo-from-start RUN_DIR] [--checkpoint-steps N ...] --out DIR
    # → DIR/mechanism_claims.md and DIR/mechanism_claims.json
    python -m stapo.study.mechanism_claims --trunk RUN_DIR --gate-only --out DIR   # → DIR/gate_b.json (Gate B only)

The stages (``../shared/notes/MECHANISM_STUDY_DESIGN.md`` §B3): calibration of the base model per difficulty level
(:func:`gate_a`), a JustRL trunk with the mechanism measurements on
(docs/metrics.md#mechanism-measurements-mechanism-probe), a gate on the trunk's length-independent entropy
(:func:`gate_b`, E1), the mechanism on the trunk (:func:`e2`: the silenced tokens' share of the probe-entropy movement
against their token share, and the paired one-step counterfactual δ), and the cumulative effect (:func:`e3`: paired
forks {JustRL, STAPO} × branch seeds from the checkpoint before the rise), or, when the gate fails, a STAPO run from
step 0 paired with the trunk, described as exploratory (:func:`from_start`).

Everything here is a pure function of lists of per-step metric dicts (:func:`stapo.run.tracking.read_metrics` rows of a
run folder's ``metrics.jsonl``) and of the run folders' provenance (:func:`read_run`); nothing is written but the
two output files. Runs are paired only when they ran on one machine kind and one compute dtype
(:func:`check_pairable`): a pair across kinds, or with a side whose own launches differ, is refused in one line.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from stapo.common.checkpoint_files import complete_checkpoints
from stapo.run.provenance import read_launches
from stapo.run.tracking import read_metrics
from stapo.study.stats import block_bootstrap, detectable_effect, moving_average, t_band

__all__ = ["MechanismClaimsError", "RunInfo", "read_run", "kind_from_machine_line", "check_pairable", "gate_a",
           "series", "rise", "gate_b", "fork_checkpoint", "e2", "e3", "from_start", "recipe_checks", "evaluate",
           "render_md", "main", "GROUPS"]

# ---------------------------------------------------------------- the rules' constants (quoted in docs/study.md)
#: Gate A passes iff some level's accuracy is at least this.
GATE_A_MIN_ACCURACY = 0.15
#: The mix sought: pooled accuracy in this closed range ...
MIX_ACCURACY = (0.25, 0.50)
#: ... pooled boxed rate at least this ...
MIX_MIN_BOXED = 0.85
#: ... and pooled mean response length in this closed range (tokens).
MIX_LENGTH = (80.0, 160.0)
#: Among admissible mixes (and in the fallback), the one whose pooled accuracy is closest to this.
MIX_TARGET_ACCURACY = 0.35
#: Calibration tables with more levels than this are refused (the mixes are enumerated: 2^12 − 1 = 4,095 sets).
MAX_LEVELS = 12

#: The gate's series: the probe-set entropy (every logged step) and the first-K entropy, smoothed.
PROBE_KEY = "probe/entropy"
FIRST_K_KEY = "actor/entropy_first_k"
#: The trailing mean of the first-K entropy, in logged points.
FIRST_K_SMOOTH = 5
#: A rise: every value of RISE_STEPS consecutive logged points from t0 on is ≥ RISE_FACTOR × the running minimum at t0.
RISE_FACTOR = 1.2
RISE_STEPS = 20

#: The token groups of the attribution (stapo/train/probes.py::token_groups), in this order.
GROUPS = ("silenced", "kept_candidates", "pos_high_p", "neg")
DH_KEY = "mechanism/dH_probe/{}"
NUM_KEY = "mechanism/num_tokens/{}"
DELTA_KEY = "mechanism/counterfactual/delta"
DELTA_MASKED_KEY = "mechanism/counterfactual/delta_masked"
#: E2 (a): the silenced group's share of Σ|dH_probe| over its token share must be at least this ...
SHARE_RATIO_MIN = 10.0
#: ... and a ratio at or below this (no over-representation at all) refutes it.
SHARE_RATIO_REFUTE = 1.0
#: E2 (b) needs at least this many counterfactual steps with ≥ 1 silenced token.
MIN_MASKED_STEPS = 10
#: The moving-block bootstrap of δ (and of the exploratory from-start difference).
BOOT_BLOCK = 5
BOOT_SAMPLES = 10_000
BOOT_SEED = 0
CONFIDENCE = 0.95

#: E3: the primary endpoint is the mean over the last E3_WINDOW common branch steps.
E3_WINDOW = 10
E3_SECONDARY = ("actor/entropy", "critic/score/mean")
#: The power of the minimum detectable effect reported beside every t-interval.
POWER = 0.8

#: The committed CPU study's 95 % half-width of STAPO − GRPO final accuracy (results/study_cpu/claims.md, C4,
#: t0.7_p0.9/arith_test: mean −0.02344, interval [−0.1342, 0.08728], n = 3 seeds), the reference for what n = 3
#: seeds can resolve in accuracy.
REFERENCE_ACC_HALF_WIDTH = (0.08728 + 0.1342) / 2
#: The paper's accuracy gains over its baselines (points): what a test of C4 would have to resolve.
PAPER_ACC_GAINS = (1.0, 4.5)


class MechanismClaimsError(ValueError):
    """The analysis cannot run as asked (a missing run, runs that may not be paired, a malformed calibration
    table): one line."""


# ---------------------------------------------------------------- runs and their machines

@dataclass
class RunInfo:
    """A run folder as the analysis reads it.

    Attributes:
        path: the folder; rows: its metrics (:func:`stapo.run.tracking.read_metrics`), one per step, sorted by step.
        objective: ``algorithm.objective`` of its ``config.json`` (None without one).
        total_steps: ``trainer.total_steps`` of its ``config.json`` (None without one).
        launches: one dict per launch, oldest first: ``start_step``, ``machine`` (the launch's
            :func:`stapo.common.perf.machine_line`, ``run_info.json``) and ``kind`` (:func:`kind_from_machine_line`).
        kinds: the machine kinds the run ran on (sorted): the launches' kinds, plus the fingerprint's ``machine``
            and the ``fingerprint.machine`` rows of ``config_changes.jsonl``; a GPU fingerprint (``cuda:``) decides
            alone (the launches' lines name the host CPU, not the device).
        dtypes: the compute dtypes (``fingerprint.json`` ``compute_dtype``, else ``config.json``
            ``model.compute_dtype`` unless ``auto``; plus ``model.compute_dtype`` rows of ``config_changes.jsonl``).
    """

    path: Path
    rows: list[dict[str, Any]]
    objective: str | None = None
    total_steps: int | None = None
    launches: list[dict[str, Any]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        """The last logged step (0 when none)."""
        return int(self.rows[-1]["step"]) if self.rows else 0

    @property
    def finished(self) -> bool:
        """Whether the run logged its ``trainer.total_steps`` (unknown total: True when any step is logged)."""
        return bool(self.rows) and (self.total_steps is None or self.last_step >= self.total_steps)

    @property
    def machine_lines(self) -> list[str]:
        """The distinct machine lines of its launches, in order (``?`` for a run without ``run_info.json``)."""
        lines = list(dict.fromkeys(str(launch.get("machine")) for launch in self.launches))
        return lines or ["?"]


_CORES = re.compile(r", \d+ cores, ")
_LEVELS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def kind_from_machine_line(line: str) -> str:
    """The machine kind (:func:`stapo.common.fingerprint.machine_kind`'s form ``cpu:<CPU model>:<SIMD level>``) of a
    :func:`stapo.common.perf.machine_line`: the model is the text before ``, <N> cores,``, the level the fastest of
    ``amx_bf16``, ``avx512_bf16``, ``avx512f``, ``avx2`` among its ``flags`` (``base`` when none), or the
    ``ATEN_CPU_CAPABILITY`` the line says kernels were capped at. Core and thread counts and torch's version are not
    part of the kind.

    Example: ``"AMD EPYC 7B13, 2 cores, flags avx2 fma, torch 2.13.0+cpu, 2 threads"`` → ``cpu:AMD EPYC 7B13:avx2``.
    """
    line = str(line)
    m = _CORES.search(line)
    name = line[:m.start()] if m else line.split(",")[0]
    flags_m = re.search(r"flags ([^,]*)", line)
    flags = set(flags_m.group(1).split()) if flags_m else set()
    level = next((f for f in _LEVELS if f in flags), "base")
    cap = re.search(r"ATEN_CPU_CAPABILITY=(\S+)", line)
    return f"cpu:{name.strip()}:{cap.group(1) if cap else level}"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_run(path: str | Path) -> RunInfo:
    """Read a run folder: ``metrics.jsonl`` (required), ``config.json``, ``run_info.json``, ``fingerprint.json``,
    ``config_changes.jsonl`` (each optional).

    Raises:
        MechanismClaimsError: no folder, or no ``metrics.jsonl`` in it, or a damaged one (one line naming it).
    """
    folder = Path(path)
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise MechanismClaimsError(f"{folder}: no metrics.jsonl (not a run folder, or the run has not logged a step)")
    try:
        by_step = {int(r["step"]): r for r in read_metrics(metrics)}  # a repeated step: the last row
    except (OSError, ValueError) as e:
        raise MechanismClaimsError(f"{metrics}: cannot read it ({e})") from None
    rows = [by_step[s] for s in sorted(by_step) if s > 0]  # step 0: validation of the initial model only
    config = _read_json(folder / "config.json") or {}
    objective = (config.get("algorithm") or {}).get("objective")
    total = (config.get("trainer") or {}).get("total_steps")
    try:
        launches = [{"start_step": int(launch.get("start_step", 0)), "machine": launch.get("machine"),
                     "kind": kind_from_machine_line(launch.get("machine"))} for launch in read_launches(folder)]
    except ValueError as e:
        raise MechanismClaimsError(str(e)) from None
    fp = _read_json(folder / "fingerprint.json") or {}
    changes = []
    changes_path = folder / "config_changes.jsonl"
    if changes_path.is_file():
        for line in changes_path.read_text().splitlines():
            try:
                changes.append(json.loads(line))
            except ValueError:
                continue
    fp_kinds = [fp.get("machine")] + [v for c in changes if c.get("key") == "fingerprint.machine"
                                      for v in (c.get("old"), c.get("new"))]
    fp_kinds = [k for k in fp_kinds if k]
    if any(str(k).startswith("cuda:") for k in fp_kinds):
        kinds = set(fp_kinds)
    else:
        kinds = set(fp_kinds) | {launch["kind"] for launch in launches}
    dtypes = [fp.get("compute_dtype")] if fp.get("compute_dtype") else []
    if not dtypes:
        cd = (config.get("model") or {}).get("compute_dtype")
        dtypes = [cd] if cd and cd != "auto" else []
    dtypes += [v for c in changes if c.get("key") == "model.compute_dtype" for v in (c.get("old"), c.get("new"))
               if v and v != "auto"]
    return RunInfo(folder, rows, objective, int(total) if isinstance(total, int) else None, launches,
                   sorted(kinds), sorted(set(dtypes)))


def _describe(run: RunInfo) -> str:
    return (f"{run.path} (machine {' | '.join(run.machine_lines)}; kind {', '.join(run.kinds) or '?'}; "
            f"dtype {', '.join(run.dtypes) or '?'})")


def check_pairable(a: RunInfo, b: RunInfo) -> None:
    """Refuse to pair two runs unless both ran on one machine kind and one compute dtype, the same for both.

    A run whose own launches differ in kind or dtype (a resume that moved machines) cannot be one side of a pair.
    A run without any machine record (no ``run_info.json`` and no ``fingerprint.json``) cannot be checked and is
    refused too.

    Raises:
        MechanismClaimsError: one line naming both runs with their machine lines, kinds and dtypes.
    """
    for run in (a, b):
        if not run.kinds:
            raise MechanismClaimsError(f"cannot pair {_describe(a)} with {_describe(b)}: {run.path} records no "
                                       f"machine (no run_info.json / fingerprint.json)")
        if len(run.kinds) > 1 or len(run.dtypes) > 1:
            raise MechanismClaimsError(f"cannot pair {_describe(a)} with {_describe(b)}: {run.path} ran on more "
                                       f"than one machine kind or compute dtype (a resume moved it)")
    if a.kinds != b.kinds or (a.dtypes and b.dtypes and a.dtypes != b.dtypes) or bool(a.dtypes) != bool(b.dtypes):
        raise MechanismClaimsError(f"cannot pair {_describe(a)} with {_describe(b)}: machine kind or compute dtype "
                                   f"differ")


def _check_objective(run: RunInfo, expected: str, role: str) -> None:
    if run.objective is not None and run.objective != expected:
        raise MechanismClaimsError(f"{run.path}: the {role} must be a {expected} run, its config.json says "
                                   f"algorithm.objective={run.objective}")


# ---------------------------------------------------------------- Gate A: calibration

_CAL_FIELDS = ("level", "accuracy", "boxed_rate", "mean_length", "n")


def read_calibration(path: str | Path) -> list[dict[str, float]]:
    """A calibration table: CSV with the header ``level,accuracy,boxed_rate,mean_length,n`` (other columns
    ignored), or JSON: a list of such objects, or an object with one under ``rows`` or ``levels``.

    Raises:
        MechanismClaimsError: unreadable, a field missing or not a number (one line naming the file).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise MechanismClaimsError(f"{p}: cannot read the calibration table ({e})") from None
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
            raw = data.get("rows", data.get("levels")) if isinstance(data, dict) else data
            if not isinstance(raw, list):
                raise ValueError("no list of rows")
        else:
            raw = list(csv.DictReader(text.splitlines()))
        rows = [{k: float(r[k]) for k in _CAL_FIELDS} for r in raw]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MechanismClaimsError(f"{p}: not a calibration table with fields {', '.join(_CAL_FIELDS)} "
                                   f"({type(e).__name__}: {e})") from None
    for r in rows:
        r["level"] = int(r["level"])
    return rows


def gate_a(rows: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Gate A and the chosen difficulty mix (docs/study.md, "Gate A").

    Args:
        rows: one per level: ``level``, ``accuracy`` and ``boxed_rate`` (fractions), ``mean_length`` (tokens),
            ``n`` (responses measured).

    Returns:
        ``passed``; ``eligible`` (levels with accuracy ≥ :data:`GATE_A_MIN_ACCURACY`); ``mix`` (the chosen levels,
        sorted; [] when the gate fails); ``pooled`` (its unweighted means over levels: accuracy, boxed_rate,
        mean_length; the training mix draws levels round-robin, so each level is an equal share); ``rule``
        (``"all criteria"`` or ``"fallback: closest accuracy"``); ``unmet`` (the criteria the mix misses).

    Raises:
        MechanismClaimsError: no rows, a repeated level, or more than :data:`MAX_LEVELS` levels.
    """
    levels = [int(r["level"]) for r in rows]
    if not rows:
        raise MechanismClaimsError("the calibration table has no rows")
    if len(set(levels)) != len(levels):
        raise MechanismClaimsError(f"the calibration table repeats a level: {levels}")
    if len(levels) > MAX_LEVELS:
        raise MechanismClaimsError(f"{len(levels)} calibration levels; at most {MAX_LEVELS} are enumerated")
    by_level = {int(r["level"]): r for r in rows}
    eligible = sorted(lv for lv in levels if by_level[lv]["accuracy"] >= GATE_A_MIN_ACCURACY)
    out: dict[str, Any] = {"passed": bool(eligible), "eligible": eligible, "mix": [], "pooled": None, "rule": None,
                           "unmet": [], "levels": [dict(by_level[lv]) for lv in sorted(levels)]}
    if not eligible:
        return out

    def pooled(mix: tuple[int, ...]) -> dict[str, float]:
        return {k: float(np.mean([by_level[lv][k] for lv in mix])) for k in ("accuracy", "boxed_rate",
                                                                             "mean_length")}

    def unmet(p: Mapping[str, float]) -> list[str]:
        missed = []
        if not MIX_ACCURACY[0] <= p["accuracy"] <= MIX_ACCURACY[1]:
            missed.append(f"pooled accuracy {p['accuracy']:.3f} outside [{MIX_ACCURACY[0]}, {MIX_ACCURACY[1]}]")
        if p["boxed_rate"] < MIX_MIN_BOXED:
            missed.append(f"pooled boxed rate {p['boxed_rate']:.3f} < {MIX_MIN_BOXED}")
        if not MIX_LENGTH[0] <= p["mean_length"] <= MIX_LENGTH[1]:
            missed.append(f"pooled mean length {p['mean_length']:.1f} outside [{MIX_LENGTH[0]:g}, "
                          f"{MIX_LENGTH[1]:g}] tokens")
        return missed

    mixes = [m for k in range(1, len(eligible) + 1) for m in itertools.combinations(eligible, k)]

    def key(m: tuple[int, ...]) -> tuple[float, int, tuple[int, ...]]:
        # closest pooled accuracy to the target (distances equal to 9 decimals are a tie: 0.30 and 0.40 are
        # equally close to 0.35, whatever the binary rounding), then more levels, then the smaller level numbers
        return (round(abs(pooled(m)["accuracy"] - MIX_TARGET_ACCURACY), 9), -len(m), m)

    admissible = [m for m in mixes if not unmet(pooled(m))]
    best = min(admissible or mixes, key=key)
    p = pooled(best)
    out.update(mix=list(best), pooled=p, rule="all criteria" if admissible else "fallback: closest accuracy",
               unmet=unmet(p))
    return out


# ---------------------------------------------------------------- Gate B: baseline instability (E1)

def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """The (steps, values) of ``key`` over the rows that log it, in step order (non-finite kept as NaN / inf).

    Returns:
        ([n] int64 steps, [n] float64 values)."""
    pts = [(int(r["step"]), float(r[key])) for r in rows if key in r and isinstance(r[key], (int, float))]
    pts.sort()
    return (np.array([s for s, _ in pts], dtype=np.int64), np.array([v for _, v in pts], dtype=np.float64))


def rise(steps: np.ndarray, values: np.ndarray, *, factor: float = RISE_FACTOR,
         length: int = RISE_STEPS) -> dict[str, Any]:
    """The first rise of one series above its running minimum (docs/study.md, "Gate B").

    With points i = 0 … n−1 (logged steps, in order) and m_i = min of the finite values v_0 … v_i (the running
    minimum; NaN never counts), the series rises at i0 iff m_{i0} > 0 and v_i ≥ ``factor`` · m_{i0} for every
    i in i0 … i0 + ``length`` − 1 (all these points exist; a NaN value fails). The first such i0 is the rise.

    Args:
        steps: [n] int; values: [n] float.

    Returns:
        ``rises``; ``t0`` (the step of i0); ``min_step`` (the latest step j ≤ t0 with v_j = m_{i0}: "before the
        rise"); ``min_value``; ``max_ratio`` (max over i of v_i / m_i, finite values with m_i > 0) and its
        ``max_ratio_step``; ``longest`` (the most consecutive points from any i0 that stay ≥ factor · m_{i0});
        ``n_points``, ``first_step``, ``last_step``, ``missing_steps`` (steps between first and last not logged).
        t0, min_step, min_value are None without a rise.
    """
    v = np.asarray(values, dtype=np.float64)
    s = np.asarray(steps, dtype=np.int64)
    n = int(v.size)
    finite = np.where(np.isfinite(v), v, np.nan)
    run_min = np.fmin.accumulate(finite) if n else finite  # NaN until the first finite value
    out: dict[str, Any] = {"rises": False, "t0": None, "min_step": None, "min_value": None, "max_ratio": None,
                           "max_ratio_step": None, "longest": 0, "n_points": n,
                           "first_step": int(s[0]) if n else None, "last_step": int(s[-1]) if n else None,
                           "missing_steps": int(s[-1] - s[0] + 1 - n) if n else 0}
    if not n:
        return out
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(run_min > 0, finite / run_min, np.nan)
    if np.isfinite(ratio).any():
        i = int(np.nanargmax(ratio))
        out["max_ratio"], out["max_ratio_step"] = float(ratio[i]), int(s[i])
    for i0 in range(n):
        m = run_min[i0]
        if not (m > 0):
            continue
        above = v[i0:] >= factor * m  # NaN → False
        k = int(np.argmin(above)) if not above.all() else int(above.size)
        out["longest"] = max(out["longest"], k)
        if k >= length and not out["rises"]:
            j = int(np.flatnonzero(finite[:i0 + 1] == m)[-1])
            out.update(rises=True, t0=int(s[i0]), min_step=int(s[j]), min_value=float(m))
    return out


def fork_checkpoint(min_step: int, checkpoint_steps: Iterable[int] | None) -> int | None:
    """The checkpoint to fork from: the latest saved step c with c ≤ ``min_step`` − 1, or 0 (the initial model).

    A checkpoint of step c holds the weights after c updates, which are the weights the metrics of step c + 1
    were measured at (``probe/entropy`` at step t is H_probe(θ_t), before step t's update; the trainer counts step
    t done, then saves it). So c ≤ min_step − 1 is the latest checkpoint at or before the minimum, not after it.

    Returns:
        The step, 0 for the initial model, or None when ``checkpoint_steps`` is None (not known)."""
    if checkpoint_steps is None:
        return None
    return max([c for c in checkpoint_steps if c <= min_step - 1] + [0])


def gate_b(rows: Sequence[Mapping[str, Any]], *, finished: bool = True,
           checkpoint_steps: Iterable[int] | None = None) -> dict[str, Any]:
    """Gate B (E1, baseline instability) on the trunk's rows (docs/study.md, "Gate B").

    S1 = ``probe/entropy`` at its logged steps; S2 = ``actor/entropy_first_k`` smoothed by the trailing mean of
    :data:`FIRST_K_SMOOTH` logged points (:func:`stapo.study.stats.moving_average`). Each goes through :func:`rise`.
    The gate passes iff either rises; the deciding series is the one that rises first (the earlier t0; S1 on a
    tie), and its ``min_step`` gives the fork checkpoint (:func:`fork_checkpoint`).

    Args:
        rows: the trunk's metric rows.
        finished: whether the trunk has run all its steps (an unfinished trunk without a rise is "pending").
        checkpoint_steps: the trunk's saved checkpoint steps (None: unknown).

    Returns:
        ``result``: "pass" | "fail" | "pending" | "not testable"; ``passed`` (result == "pass"); ``reason``;
        ``series`` ({"S1": ..., "S2": ...}, each :func:`rise`'s dict with its ``key``); ``decided_by``, ``t0``,
        ``min_step``, ``fork_checkpoint`` (also as ``fork_step``), ``checkpoint_steps``, ``finished``.
    """
    s1 = series(rows, PROBE_KEY)
    s2_steps, s2_raw = series(rows, FIRST_K_KEY)
    s2 = (s2_steps, moving_average(s2_raw, FIRST_K_SMOOTH) if s2_raw.size else s2_raw)
    per = {"S1": {"key": PROBE_KEY, **rise(*s1)},
           "S2": {"key": f"{FIRST_K_KEY} (trailing mean of {FIRST_K_SMOOTH})", **rise(*s2)}}
    ckpts = sorted(int(c) for c in checkpoint_steps) if checkpoint_steps is not None else None
    out: dict[str, Any] = {"series": per, "decided_by": None, "t0": None, "min_step": None, "fork_checkpoint": None,
                           "checkpoint_steps": ckpts, "finished": finished}
    risen = [(v["t0"], name) for name, v in per.items() if v["rises"]]
    if risen:
        _, name = min(risen)
        d = per[name]
        out.update(result="pass", decided_by=name, t0=d["t0"], min_step=d["min_step"],
                   fork_checkpoint=fork_checkpoint(d["min_step"], ckpts),
                   reason=f"{d['key']} stays ≥ {RISE_FACTOR} × its running minimum (step {d['min_step']}, "
                          f"{d['min_value']:.4g}) for {RISE_STEPS} logged steps from step {d['t0']}")
    elif not per["S1"]["n_points"] and not per["S2"]["n_points"]:
        out.update(result="not testable", reason=f"the trunk logs neither {PROBE_KEY} nor {FIRST_K_KEY}")
    elif finished:
        out.update(result="fail", reason=f"neither series stays ≥ {RISE_FACTOR} × its running minimum for "
                                         f"{RISE_STEPS} logged steps")
    else:
        out.update(result="pending", reason="no rise yet and the trunk is unfinished")
    out["passed"] = out["result"] == "pass"
    out["fork_step"] = out["fork_checkpoint"]
    return out


# ---------------------------------------------------------------- E2: the mechanism on the trunk

def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def e2(rows: Sequence[Mapping[str, Any]], *, block: int = BOOT_BLOCK, n_boot: int = BOOT_SAMPLES,
       seed: int = BOOT_SEED) -> dict[str, Any]:
    """E2 (mechanism) on the trunk's rows (docs/study.md, "E2").

    (a) An attribution step is a row with all four ``mechanism/dH_probe/<group>`` and ``mechanism/num_tokens/
    <group>`` (a row with one of them non-finite is left out and listed). Over those steps,
    abs share_g = Σ_t |dH_g,t| / Σ_t Σ_h |dH_h,t|, token share_g = Σ_t n_g,t / Σ_t Σ_h n_h,t, and the silenced
    group's ratio = abs share / token share; (a) holds iff ratio ≥ :data:`SHARE_RATIO_MIN`.
    (b) δ_t = ``mechanism/counterfactual/delta_masked`` at the steps that log it (≥ 1 silenced token; non-finite
    left out and listed), in step order: its mean and :func:`stapo.study.stats.block_bootstrap` interval
    (block 5, 10,000 replicates, seed 0, 95 %); (b) holds iff the upper bound < 0.
    Verdict: "not testable" (no attribution step, none with a silenced token, a zero denominator, or fewer than
    :data:`MIN_MASKED_STEPS` δ steps); "shown" iff (a) and (b); "refuted" iff ratio ≤ :data:`SHARE_RATIO_REFUTE`
    or the lower bound > 0; "inconclusive" otherwise.

    Returns:
        A JSON-able dict: ``result``, ``reasons``, ``groups`` (per group: sum_dH, sum_abs_dH, abs_share, tokens,
        token_share, ratio), ``ratio``, ``part_a``, ``attribution_steps``, ``n_attribution``,
        ``n_attribution_silenced``, ``excluded``, ``delta`` (n, mean: the unconditional mean of
        ``mechanism/counterfactual/delta``), ``delta_masked`` (n, steps, mean, low, high, block), ``part_b``.
    """
    attr, excluded = [], []
    for r in rows:
        keys = [DH_KEY.format(g) for g in GROUPS] + [NUM_KEY.format(g) for g in GROUPS]
        if not all(k in r for k in keys):
            continue
        if all(_finite(r[k]) for k in keys):
            attr.append(r)
        else:
            excluded.append({"step": int(r["step"]), "what": "attribution: a non-finite value"})
    dh = np.array([[float(r[DH_KEY.format(g)]) for g in GROUPS] for r in attr]).reshape(-1, len(GROUPS))
    nt = np.array([[float(r[NUM_KEY.format(g)]) for g in GROUPS] for r in attr]).reshape(-1, len(GROUPS))
    abs_sum, tok_sum = np.abs(dh).sum(axis=0), nt.sum(axis=0)  # [4]
    abs_total, tok_total = float(abs_sum.sum()), float(tok_sum.sum())
    groups = {}
    for i, g in enumerate(GROUPS):
        a_share = float(abs_sum[i] / abs_total) if abs_total > 0 else math.nan
        t_share = float(tok_sum[i] / tok_total) if tok_total > 0 else math.nan
        groups[g] = {"sum_dH": float(dh[:, i].sum()), "sum_abs_dH": float(abs_sum[i]), "abs_share": a_share,
                     "tokens": float(tok_sum[i]), "token_share": t_share,
                     "ratio": a_share / t_share if t_share and t_share > 0 else math.nan}
    ratio = groups["silenced"]["ratio"]
    masked, deltas = [], []
    for r in rows:
        if DELTA_MASKED_KEY in r:
            if _finite(r[DELTA_MASKED_KEY]):
                masked.append((int(r["step"]), float(r[DELTA_MASKED_KEY])))
            else:
                excluded.append({"step": int(r["step"]), "what": f"{DELTA_MASKED_KEY}: non-finite"})
        if DELTA_KEY in r and _finite(r[DELTA_KEY]):
            deltas.append(float(r[DELTA_KEY]))
    masked.sort()
    ci = block_bootstrap(np.array([d for _, d in masked]), block=block, n_boot=n_boot, seed=seed)
    a_reasons, b_reasons = [], []
    if not attr:
        a_reasons.append("no attribution step logged")
    elif tok_sum[0] == 0:
        a_reasons.append("no attribution step has a silenced token")
    elif abs_total == 0:
        a_reasons.append("every group's first-order change is 0 at every attribution step")
    if len(masked) < MIN_MASKED_STEPS:
        b_reasons.append(f"{len(masked)} counterfactual steps with a silenced token, fewer than {MIN_MASKED_STEPS}")
    reasons = a_reasons + b_reasons
    part_a = bool(not a_reasons and ratio >= SHARE_RATIO_MIN)  # each part as measured; the verdict needs both
    part_b = bool(not b_reasons and ci.high < 0)
    if reasons:
        result = "not testable"
    elif part_a and part_b:
        result = "shown"
    elif ratio <= SHARE_RATIO_REFUTE or ci.low > 0:
        result = "refuted"
    else:
        result = "inconclusive"
    return {"result": result, "reasons": reasons, "groups": groups, "ratio": ratio, "part_a": part_a,
            "part_b": part_b, "attribution_steps": [int(r["step"]) for r in attr], "n_attribution": len(attr),
            "n_attribution_silenced": int((nt[:, 0] > 0).sum()) if attr else 0, "excluded": excluded,
            "delta": {"n": len(deltas), "mean": float(np.mean(deltas)) if deltas else math.nan},
            "delta_masked": {"n": len(masked), "steps": [s for s, _ in masked], "mean": ci.mean, "low": ci.low,
                             "high": ci.high, "block": ci.block}}


# ---------------------------------------------------------------- E3: the cumulative effect

def _window_diff(a_rows: Sequence[Mapping[str, Any]], b_rows: Sequence[Mapping[str, Any]], key: str,
                 steps: Sequence[int] | None = None, window: int = E3_WINDOW) -> dict[str, Any]:
    """mean(b) − mean(a) of ``key`` over the last ``window`` steps both log finite (or over ``steps``)."""
    a = {int(r["step"]): float(r[key]) for r in a_rows if _finite(r.get(key))}
    b = {int(r["step"]): float(r[key]) for r in b_rows if _finite(r.get(key))}
    common = sorted(set(a) & set(b))
    if steps is None:
        steps = [s for s in common if common and s > common[-1] - window]
    else:
        steps = [s for s in steps if s in a and s in b]
    if not steps:
        return {"steps": [], "a": math.nan, "b": math.nan, "diff": math.nan}
    ma, mb = float(np.mean([a[s] for s in steps])), float(np.mean([b[s] for s in steps]))
    return {"steps": list(steps), "a": ma, "b": mb, "diff": mb - ma}


def _t_summary(diffs: Sequence[float]) -> dict[str, Any]:
    d = np.array([x for x in diffs if x == x], dtype=np.float64)
    if not d.size:
        return {"n": 0, "mean": math.nan, "low": math.nan, "high": math.nan, "half": math.nan, "mde": math.nan}
    band = t_band(d, CONFIDENCE)
    det = detectable_effect(d, CONFIDENCE, POWER)
    return {"n": int(d.size), "mean": float(band.mean[0]), "low": float(band.low[0]), "high": float(band.high[0]),
            "half": det.half, "mde": det.mde, "sd": det.s}


def e3(pairs: Sequence[tuple[str, Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]], gate: str,
       *, all_finished: bool = True) -> dict[str, Any]:
    """E3 (cumulative effect) over fork pairs (docs/study.md, "E3").

    Per pair (JustRL rows, STAPO rows): the window is the last :data:`E3_WINDOW` steps at which both log a finite
    ``probe/entropy`` (steps T − 9 … T of their common steps, T the last); d = mean STAPO − mean JustRL over it.
    Over pairs: mean d and the 95 % t-interval with n − 1 degrees of freedom (:func:`stapo.study.stats.t_band`),
    its half-width and the 80 %-power minimum detectable effect (:func:`stapo.study.stats.detectable_effect`).
    "shown" iff upper < 0, "refuted" iff lower > 0, else "inconclusive" (one pair: no interval). The secondary
    endpoints (``actor/entropy``, ``critic/score/mean``) use each pair's same window steps and get no verdict.

    Args:
        pairs: (label, justrl_rows, stapo_rows) per branch seed.
        gate: Gate B's result; E3 is tested only on "pass".
        all_finished: whether every fork run ran all its steps (else the result is marked partial).

    Returns:
        ``result``, ``reason``, ``pairs`` (per pair: label, primary, secondary), ``primary`` and ``secondary``
        (:func:`_t_summary`: n, mean, low, high, half, mde, sd), ``partial``.
    """
    out: dict[str, Any] = {"pairs": [], "primary": None, "secondary": {}, "partial": not all_finished}
    if gate != "pass":
        out.update(result="pending" if gate == "pending" else "not testable",
                   reason=f"Gate B is {gate}: the forks are run only after a rise")
        return out
    if not pairs:  # the rules run the forks after a pass: none yet is an unfinished study, not a verdict
        out.update(result="pending", reason="Gate B passed; no fork pair yet (--fork-pairs)", partial=True)
        return out
    for label, j_rows, s_rows in pairs:
        prim = _window_diff(j_rows, s_rows, PROBE_KEY)
        sec = {k: _window_diff(j_rows, s_rows, k, steps=prim["steps"]) for k in E3_SECONDARY}
        out["pairs"].append({"label": label, "primary": prim, "secondary": sec})
    out["primary"] = _t_summary([p["primary"]["diff"] for p in out["pairs"]])
    out["secondary"] = {k: _t_summary([p["secondary"][k]["diff"] for p in out["pairs"]]) for k in E3_SECONDARY}
    prim = out["primary"]
    if prim["n"] == 0:
        out.update(result="not testable", reason="no pair has a common step with probe/entropy")
    elif prim["high"] < 0:
        out.update(result="shown", reason="the whole interval is below 0")
    elif prim["low"] > 0:
        out.update(result="refuted", reason="the whole interval is above 0")
    else:
        out.update(result="inconclusive", reason="the interval contains 0" if prim["n"] > 1 else
                   "one pair: no interval")
    return out


def from_start(trunk_rows: Sequence[Mapping[str, Any]], stapo_rows: Sequence[Mapping[str, Any]], *,
               block: int = BOOT_BLOCK, n_boot: int = BOOT_SAMPLES, seed: int = BOOT_SEED) -> dict[str, Any]:
    """The STAPO-from-step-0 run paired with the trunk, exploratory (one seed): d_t = probe/entropy STAPO − trunk
    at every common step with both finite, its mean and the moving-block bootstrap interval (block 5).

    Returns:
        ``steps``, ``diffs``, ``mean``, ``low``, ``high``, ``block``, ``n``."""
    a = {int(r["step"]): float(r[PROBE_KEY]) for r in trunk_rows if _finite(r.get(PROBE_KEY))}
    b = {int(r["step"]): float(r[PROBE_KEY]) for r in stapo_rows if _finite(r.get(PROBE_KEY))}
    steps = sorted(set(a) & set(b))
    diffs = [b[s] - a[s] for s in steps]
    ci = block_bootstrap(np.array(diffs), block=block, n_boot=n_boot, seed=seed)
    return {"steps": steps, "diffs": diffs, "n": ci.n, "mean": ci.mean, "low": ci.low, "high": ci.high,
            "block": ci.block}


# ---------------------------------------------------------------- the whole analysis

def _checkpoint_steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in complete_checkpoints(run_dir / "checkpoints")]


def _total(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[float, int, int]:
    """(sum, steps with a value > 0, steps with a finite value) of ``key`` over ``rows``."""
    vals = [float(r[key]) for r in rows if _finite(r.get(key))]
    return float(sum(vals)), sum(v > 0 for v in vals), len(vals)


def recipe_checks(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the recipe did on a run (issue 32, item 3; descriptive, no verdict): does the PPO clip act, how many
    tokens does S2T silence (or would it, on a JustRL run), how far the policy moved from the cold start.

    Returns (None where the run logs no such key): ``steps`` (training rows), ``clip_steps`` (steps with
    ``actor/pg_clipfrac`` > 0), ``clipfrac_max`` / ``clipfrac_mean``, ``ppo_kl_max_abs`` (max |``actor/ppo_kl``|),
    ``response_tokens`` (Σ ``response_length/total_tokens``), ``silenced`` / ``silenced_steps`` (Σ and steps > 0 of
    ``actor/s2t/num_masked`` when the run masks with S2T, else of ``s2t/would_mask/num_masked``, with ``silenced_key``
    naming which), ``silenced_share`` (silenced / response tokens), ``kl_to_ref_last`` / ``kl_to_ref_max``
    (``actor/kl_to_ref``, nats/token), ``probe_first`` / ``probe_last`` (``probe/entropy`` at the first and last
    logged steps).

    Example: two steps with pg_clipfrac [0, 0.001], would_mask [0, 2], 100 response tokens each → clip_steps 1,
    silenced 2, silenced_share 0.01.
    """
    train = [r for r in rows if "critic/score/mean" in r]
    out: dict[str, Any] = {"steps": len(train)}
    clip = [float(r["actor/pg_clipfrac"]) for r in train if _finite(r.get("actor/pg_clipfrac"))]
    out["clip_steps"] = sum(c > 0 for c in clip) if clip else None
    out["clipfrac_max"] = max(clip) if clip else None
    out["clipfrac_mean"] = float(np.mean(clip)) if clip else None
    kl = [abs(float(r["actor/ppo_kl"])) for r in train if _finite(r.get("actor/ppo_kl"))]
    out["ppo_kl_max_abs"] = max(kl) if kl else None
    tokens, _, n_tok = _total(train, "response_length/total_tokens")
    out["response_tokens"] = tokens if n_tok else None
    key = "actor/s2t/num_masked" if any("actor/s2t/num_masked" in r for r in train) else "s2t/would_mask/num_masked"
    silenced, silenced_steps, n_sil = _total(train, key)
    out.update({"silenced_key": key if n_sil else None, "silenced": silenced if n_sil else None,
                "silenced_steps": silenced_steps if n_sil else None,
                "silenced_share": silenced / tokens if n_sil and tokens else None})
    ref = [float(r["actor/kl_to_ref"]) for r in train if _finite(r.get("actor/kl_to_ref"))]
    out["kl_to_ref_last"], out["kl_to_ref_max"] = (ref[-1], max(ref)) if ref else (None, None)
    probe = [(int(r["step"]), float(r[PROBE_KEY])) for r in rows if _finite(r.get(PROBE_KEY))]
    out["probe_first"], out["probe_last"] = (probe[0][1], probe[-1][1]) if probe else (None, None)
    return out


def evaluate(*, trunk: RunInfo | None, calibration: Sequence[Mapping[str, float]] | None = None,
             fork_pairs: Sequence[tuple[RunInfo, RunInfo]] = (), stapo_from_start: RunInfo | None = None,
             checkpoint_steps: Iterable[int] | None = None) -> dict[str, Any]:
    """Every verdict of the mechanism study from what is there (module docstring); JSON-able.

    Raises:
        MechanismClaimsError: a pair that may not be paired (:func:`check_pairable`), or a run of the wrong
            objective (the trunk and the forks' first side: justrl; the forks' second side and the from-start run:
            stapo; checked where config.json says)."""
    out: dict[str, Any] = {"budget": budget_note(), "gate_a": gate_a(calibration) if calibration else None,
                           "trunk": None, "gate_b": None, "e2": None, "e3": None, "from_start": None, "recipe": None}
    if trunk is None:
        return out
    _check_objective(trunk, "justrl", "trunk")
    out["trunk"] = _run_summary(trunk)
    out["recipe"] = {trunk.path.name: recipe_checks(trunk.rows)}
    out["gate_b"] = gate_b(trunk.rows, finished=trunk.finished, checkpoint_steps=checkpoint_steps)
    out["e2"] = e2(trunk.rows)
    pairs = []
    for j, s in fork_pairs:
        _check_objective(j, "justrl", "first run of a fork pair")
        _check_objective(s, "stapo", "second run of a fork pair")
        check_pairable(j, s)
        pairs.append((f"{j.path.name} : {s.path.name}", j.rows, s.rows))
        out["recipe"].update({j.path.name: recipe_checks(j.rows), s.path.name: recipe_checks(s.rows)})
    out["e3"] = e3(pairs, out["gate_b"]["result"], all_finished=all(r.finished for p in fork_pairs for r in p))
    out["e3"]["runs"] = [[_run_summary(j), _run_summary(s)] for j, s in fork_pairs]
    if stapo_from_start is not None:
        _check_objective(stapo_from_start, "stapo", "from-start run")
        check_pairable(trunk, stapo_from_start)
        out["from_start"] = {**from_start(trunk.rows, stapo_from_start.rows),
                             "run": _run_summary(stapo_from_start)}
    return out


def _run_summary(run: RunInfo) -> dict[str, Any]:
    return {"path": str(run.path), "objective": run.objective, "last_step": run.last_step,
            "total_steps": run.total_steps, "finished": run.finished, "kinds": run.kinds, "dtypes": run.dtypes,
            "launches": run.launches}


def budget_note() -> dict[str, Any]:
    """What this budget cannot test: accuracy differences of the paper's size with n = 3 seeds (numbers from
    :data:`REFERENCE_ACC_HALF_WIDTH`, the committed CPU study's C4)."""
    from scipy import stats as sps

    n = 3
    t_c, t_p = float(sps.t.ppf(0.5 + CONFIDENCE / 2, n - 1)), float(sps.t.ppf(POWER, n - 1))
    sd = REFERENCE_ACC_HALF_WIDTH * math.sqrt(n) / t_c
    return {"n": n, "half_width": REFERENCE_ACC_HALF_WIDTH, "sd": sd, "mde": (t_c + t_p) * sd / math.sqrt(n),
            "paper_gains_points": list(PAPER_ACC_GAINS)}


# ---------------------------------------------------------------- output

def _f(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def render_md(res: Mapping[str, Any]) -> str:
    """``mechanism_claims.md`` from :func:`evaluate`'s dict."""
    trunk = res.get("trunk")
    partial = bool(trunk and not trunk["finished"]) or bool(res.get("e3") and res["e3"].get("partial"))
    b = res["budget"]
    lines = [f"# Mechanism study (issue 32): verdicts{' — PARTIAL' if partial else ''}", "",
             "Rules fixed before the trunk: docs/study.md, \"Mechanism study (issue 32): rules fixed before the "
             "trunk\"; code: stapo/study/mechanism_claims.py. Written by `python -m stapo.study.mechanism_claims`.",
             "", "## What this budget cannot test", "",
             f"- **Accuracy differences of the paper's size (C4).** With n = {b['n']} seeds the committed CPU study's "
             f"95 % half-width of STAPO − GRPO final accuracy was {100 * b['half_width']:.1f} points "
             f"(results/study_cpu/claims.md, C4), i.e. a between-seed SD of {100 * b['sd']:.1f} points; the effect "
             f"an 80 %-power paired t-test of 3 seeds would need is about {100 * b['mde']:.1f} points, against the "
             f"paper's {b['paper_gains_points'][0]:g}–{b['paper_gains_points'][1]:g} points. No accuracy claim is "
             f"tested here.",
             "- Entropy verdicts are about a 135M model on CPU for ~120 steps; a failed Gate B means \"not testable "
             "at this scale\", not \"refuted\".", ""]
    lines += ["## Verdicts", "", "| | result |", "|---|---|"]
    ga, gb, e2r, e3r = res.get("gate_a"), res.get("gate_b"), res.get("e2"), res.get("e3")
    lines.append(f"| Gate A (calibration) | {('**pass**' if ga['passed'] else '**fail**') if ga else 'not given'} |")
    lines.append(f"| Gate B / E1 (baseline instability) | **{gb['result']}** |" if gb else "| Gate B | no trunk |")
    lines.append(f"| E2 (mechanism) | **{e2r['result']}** |" if e2r else "| E2 | no trunk |")
    lines.append(f"| E3 (cumulative effect) | **{e3r['result']}**{' (partial)' if e3r['partial'] else ''} |"
                 if e3r else "| E3 | no trunk |")
    lines.append("")
    if trunk:
        lines += [f"Trunk: `{trunk['path']}`, {trunk['objective']}, step {trunk['last_step']} of "
                  f"{_f(trunk['total_steps'])}{'' if trunk['finished'] else ' (unfinished)'}; machine kinds "
                  f"{', '.join(trunk['kinds']) or '?'}; dtype {', '.join(trunk['dtypes']) or '?'}."]
        for launch in trunk["launches"]:
            lines.append(f"- launch from step {launch['start_step']}: {launch['machine']} ({launch['kind']})")
        if len(trunk["kinds"]) > 1:
            lines.append("- The trunk moved machines: allowed for E2 and Gate B (each step is measured within "
                         "itself), listed here.")
        lines.append("")
    if ga:
        lines += ["## Gate A: calibration", "", "| level | accuracy | boxed | mean length | n |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['level']} | {r['accuracy']:.3f} | {r['boxed_rate']:.3f} | {r['mean_length']:.1f} | "
                  f"{int(r['n'])} |" for r in ga["levels"]]
        lines.append("")
        if ga["passed"]:
            p = ga["pooled"]
            lines.append(f"- **pass**: levels with accuracy ≥ {GATE_A_MIN_ACCURACY}: {ga['eligible']}.")
            lines.append(f"- Chosen mix: levels {ga['mix']} ({ga['rule']}); pooled accuracy {p['accuracy']:.3f}, "
                         f"boxed {p['boxed_rate']:.3f}, mean length {p['mean_length']:.1f} tokens.")
            if ga["unmet"]:
                lines.append(f"- Criteria not met by any mix: {'; '.join(ga['unmet'])}.")
        else:
            lines.append(f"- **fail**: no level reaches accuracy {GATE_A_MIN_ACCURACY}; the study stops here.")
        lines.append("")
    if gb:
        lines += ["## Gate B (E1): does the baseline's length-independent entropy rise?", "",
                  f"Result: **{gb['result']}** — {gb['reason']}.", "",
                  "| series | points | steps | rises | t0 | min step (before the rise) | min | max ratio (step) | "
                  "longest run ≥ 1.2 × min |", "|---|---|---|---|---|---|---|---|---|"]
        for name, s in gb["series"].items():
            gaps = f" ({s['missing_steps']} missing)" if s["missing_steps"] else ""
            lines.append(f"| {name}: `{s['key']}` | {s['n_points']} | {_f(s['first_step'])}–{_f(s['last_step'])}"
                         f"{gaps} | "
                         f"{'yes' if s['rises'] else 'no'} | {_f(s['t0'])} | {_f(s['min_step'])} | "
                         f"{_f(s['min_value'])} | {_f(s['max_ratio'])} ({_f(s['max_ratio_step'])}) | "
                         f"{s['longest']} |")
        lines.append("")
        if gb["result"] == "pass":
            ck = gb["fork_checkpoint"]
            lines.append(f"- Decided by {gb['decided_by']}; fork from checkpoint step "
                         f"{_f(ck) if ck is not None else 'unknown (no checkpoint list)'}"
                         f"{' (the initial model)' if ck == 0 else ''}; saved checkpoints: "
                         f"{gb['checkpoint_steps'] if gb['checkpoint_steps'] is not None else 'unknown'}.")
            lines.append("")
    if e2r:
        dm = e2r["delta_masked"]
        lines += ["## E2: the mechanism on the trunk", "", f"Result: **{e2r['result']}**" +
                  (f" — {'; '.join(e2r['reasons'])}." if e2r["reasons"] else "."), "",
                  f"- (a) silenced share of Σ|dH_probe| / its token share = **{_f(e2r['ratio'])}** "
                  f"(holds iff ≥ {SHARE_RATIO_MIN:g}: {'yes' if e2r['part_a'] else 'no'}), over "
                  f"{e2r['n_attribution']} attribution steps ({e2r['n_attribution_silenced']} with a silenced "
                  f"token).",
                  f"- (b) mean δ over the {dm['n']} counterfactual steps with a silenced token = **{_f(dm['mean'])}** "
                  f"nats/token, 95 % moving-block bootstrap interval [{_f(dm['low'])}, {_f(dm['high'])}] "
                  f"(block {dm['block']}; holds iff the upper bound < 0: {'yes' if e2r['part_b'] else 'no'}).",
                  f"- Unconditional mean of `{DELTA_KEY}` over its {e2r['delta']['n']} steps: "
                  f"{_f(e2r['delta']['mean'])}.", "",
                  "| group | Σ dH_probe | Σ \\|dH_probe\\| | share of \\|dH\\| | tokens | token share | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for g, v in e2r["groups"].items():
            lines.append(f"| {g} | {_f(v['sum_dH'])} | {_f(v['sum_abs_dH'])} | {_f(v['abs_share'])} | "
                         f"{v['tokens']:.0f} | {_f(v['token_share'])} | {_f(v['ratio'])} |")
        if e2r["excluded"]:
            lines.append("")
            lines.append("Left out (non-finite): " + ", ".join(f"step {x['step']} ({x['what']})"
                                                               for x in e2r["excluded"]) + ".")
        lines.append("")
    if e3r:
        lines += ["## E3: the cumulative effect (forks)", "", f"Result: **{e3r['result']}** — {e3r['reason']}."
                  + (" Some fork runs are unfinished (partial)." if e3r["partial"] else ""), ""]
        if e3r["pairs"]:
            lines += ["| pair (JustRL : STAPO) | window steps | JustRL probe/entropy | STAPO | STAPO − JustRL |",
                      "|---|---|---|---|---|"]
            for p in e3r["pairs"]:
                q = p["primary"]
                st = q["steps"]
                lines.append(f"| {p['label']} | {f'{st[0]}–{st[-1]} ({len(st)})' if st else 'none'} | "
                             f"{_f(q['a'])} | {_f(q['b'])} | {_f(q['diff'])} |")
            lines.append("")
            for name, s in [("probe/entropy (primary)", e3r["primary"])] + list(e3r["secondary"].items()):
                lines.append(f"- {name}: mean STAPO − JustRL {_f(s['mean'])} over {s['n']} pairs, 95 % t-interval "
                             f"[{_f(s['low'])}, {_f(s['high'])}], half-width {_f(s['half'])}, 80 %-power minimum "
                             f"detectable effect {_f(s['mde'])}" + ("" if name.endswith("(primary)") else
                                                                   " (secondary: no verdict)"))
            lines.append("")
    if res.get("recipe"):
        lines += ["## What the recipe did (descriptive)", "",
                  "| run | steps | steps with pg_clipfrac > 0 | max pg_clipfrac | max \\|ppo_kl\\| | silenced "
                  "(S2T; JustRL: would be) | steps with one | share of response tokens | kl_to_ref last (max) | "
                  "probe/entropy first → last |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, c in res["recipe"].items():
            would = " (would)" if c["silenced_key"] == "s2t/would_mask/num_masked" else ""
            lines.append(f"| {name} | {c['steps']} | {_f(c['clip_steps'])} | {_f(c['clipfrac_max'])} | "
                         f"{_f(c['ppo_kl_max_abs'])} | {_f(c['silenced'])}{would} | {_f(c['silenced_steps'])} | "
                         f"{_f(c['silenced_share'])} | {_f(c['kl_to_ref_last'])} ({_f(c['kl_to_ref_max'])}) | "
                         f"{_f(c['probe_first'])} → {_f(c['probe_last'])} |")
        lines.append("")
    fs = res.get("from_start")
    if not fs and gb and gb["result"] == "fail":
        lines += ["No STAPO-from-step-0 run was given (--stapo-from-start): the exploratory pairing is not reported.",
                  ""]
    if fs:
        lines += ["## Exploratory (one seed): STAPO from step 0 paired with the trunk", "",
                  f"`{fs['run']['path']}`: probe/entropy STAPO − trunk over {fs['n']} common steps: mean "
                  f"{_f(fs['mean'])}, 95 % moving-block bootstrap interval [{_f(fs['low'])}, {_f(fs['high'])}] "
                  f"(block {fs['block']}). One seed, steps autocorrelated: a description, not a verdict.", ""]
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return _jsonable(float(x))
    return x


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (module docstring). Exit 0, or 2 with one line on stderr (:class:`MechanismClaimsError`)."""
    ap = argparse.ArgumentParser(prog="python -m stapo.study.mechanism_claims", description=__doc__.split("\n")[0])
    ap.add_argument("--trunk", help="the JustRL trunk's run folder")
    ap.add_argument("--calibration", help="Gate A's table per level (CSV or JSON: level, accuracy, boxed_rate, "
                                          "mean_length, n)")
    ap.add_argument("--fork-pairs", nargs="*", action="extend", default=[], metavar="JUSTRL_DIR:STAPO_DIR",
                    help="one pair of fork run folders per branch seed; repeated flags add up (a later flag used "
                         "to replace the earlier ones: scripts/mechanism_study.py passes one flag per pair)")
    ap.add_argument("--stapo-from-start", help="the STAPO run from step 0 (exploratory pairing with the trunk)")
    ap.add_argument("--checkpoint-steps", type=int, nargs="*", default=None,
                    help="the trunk's saved checkpoint steps (default: its complete checkpoints/step_N folders)")
    ap.add_argument("--gate-only", action="store_true",
                    help="write only Gate B on the trunk, as DIR/gate_b.json (the stage runner's gate)")
    ap.add_argument("--out", required=True, help="folder for mechanism_claims.md and mechanism_claims.json")
    args = ap.parse_args(argv)
    try:
        if not args.trunk and not args.calibration:
            raise MechanismClaimsError("give --trunk RUN_DIR (and/or --calibration for Gate A alone)")
        calibration = read_calibration(args.calibration) if args.calibration else None
        trunk = read_run(args.trunk) if args.trunk else None
        pairs = []
        for spec in args.fork_pairs:
            if spec.count(":") != 1:
                raise MechanismClaimsError(f"--fork-pairs {spec!r}: expected JUSTRL_DIR:STAPO_DIR")
            j, s = spec.split(":")
            pairs.append((read_run(j), read_run(s)))
        start = read_run(args.stapo_from_start) if args.stapo_from_start else None
        ckpts = args.checkpoint_steps
        if ckpts is None and trunk is not None:
            ckpts = _checkpoint_steps(trunk.path)
        out = Path(args.out)
        if args.gate_only:
            if trunk is None:
                raise MechanismClaimsError("--gate-only needs --trunk")
            _check_objective(trunk, "justrl", "trunk")
            gate = gate_b(trunk.rows, finished=trunk.finished, checkpoint_steps=ckpts)
            files = {"gate_b.json": json.dumps(_jsonable({**gate, "trunk": _run_summary(trunk)}), indent=1)}
            summary = f"gate B: {gate['result']} ({gate['reason']})"
        else:
            res = evaluate(trunk=trunk, calibration=calibration, fork_pairs=pairs, stapo_from_start=start,
                           checkpoint_steps=ckpts)
            files = {"mechanism_claims.md": render_md(res), "mechanism_claims.json": json.dumps(_jsonable(res),
                                                                                                indent=1)}
            summary = ""
        try:
            out.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (out / name).write_text(text + "\n")
        except OSError as e:
            raise MechanismClaimsError(f"cannot write into {out}: {e}") from None
    except MechanismClaimsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {' and '.join(str(out / name) for name in files)}" + (f"; {summary}" if summary else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
