"""The paper's claims C1–C5 tested on a study's runs, each with a rule fixed in advance (docs/study.md#claims).

    python -m stapo.study.claims --config configs/study/cpu_reproduction.yaml   # → <output_dir>/claims.md, .json

A claim is split into sub-claims; each is one number per replicate (a seed; for C2 the mean over that seed's
runs) compared with a threshold on the side the paper claims, with the 95 % Student-t interval over the replicates
(:func:`stapo.study.stats.t_band`): **reproduced** when the whole interval is on the claimed side, **not
reproduced** when the whole interval is on the other side, **inconclusive** otherwise (including a single seed,
which has no interval). A claim is reproduced when every sub-claim is, not reproduced when any sub-claim is not,
and inconclusive otherwise. Worked example: final accuracy STAPO − GRPO over seeds 0.02, 0.04, 0.06 → mean 0.04,
s = 0.02, half = 4.3027 · 0.02 / √3 = 0.0497 → [−0.0097, 0.0897] contains 0 → inconclusive.

The sub-claims (paper: METHOD §4, §8, §9; roles map the paper's methods to the study's method names, :data:`ROLES`):

- C1 rarity: the median over steps of STAPO's masked fraction (``actor/s2t/masked_frac``) < 0.01 % (the paper:
  "mostly < 0.01 %"), per seed. Also reported: the pooled fraction Σ masked / Σ response tokens, and what S2T
  would silence for every method (``s2t/would_mask/*``).
- C2 taxonomy: among Â > 0 tokens over the first W steps of every run (a run's steps pooled by token), the
  low-p/low-H quadrant's mean logit-gradient norm exceeds the high-p/high-H quadrant's and each other quadrant's,
  and its mean first-order entropy change is > 0; one replicate per seed, the mean over that seed's runs that
  have tokens in the quadrant (the runs of a seed share their prompts and the base model's step-1 rollouts).
- C3 entropy: GRPO's final entropy (mean of the last W steps) / its step-1 entropy < 0.5 (collapse); JustRL's and
  20-Entropy's final entropy exceeds the lowest point of their smoothed curve before the final window (a late
  rise); STAPO's final/initial ratio > 0.5 (no collapse) and STAPO's final entropy > GRPO's (paired by seed).
  C3 needs a baseline whose entropy rises (S2T is claimed to prevent that rise): when no late-rise sub-claim is
  reproduced, C3 is **not testable** and the sub-claims' rule is shown beside it (:func:`c3_testability`).
- C4 accuracy: STAPO − each baseline > 0 in the final evaluation's avg@N on the held-out benchmark, at each
  decoding setting (paired by seed).
- C5 masking: STAPO − random masking > 0 and random − high-entropy masking > 0 (final avg@N, each setting, paired
  by seed); JustRL-FullMask's final/initial entropy < 0.5 (collapse). Also reported: the masked fractions of
  STAPO and random masking (matched rate).

Beside every sub-claim: the interval's half-width and the effect 80 % power would need
(:func:`stapo.study.stats.detectable_effect`). C2's notes say which of its sub-claims follow from the formulas.

Only clean runs are read (:func:`stapo.study.report.run_exclusions`: the report's exclusions, each named with its
reason in claims.md / claims.json); a verdict drawn from fewer seeds than the plan says so beside it. The role
mapping is written into both files, and a role mapped to a method whose runs train another objective than the
paper's method is refused unless ``--allow-objective`` says it is intended (:func:`role_table`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Collection

import numpy as np

from stapo.config import ConfigError
from stapo.run.cli import ArgumentParser
from stapo.run.tracking import CorruptJsonlError
from stapo.study.config import RunSpec, StudyConfig, load_study_config, run_specs
from stapo.study.keys import QUADRANTS
from stapo.study.report import (
    Series,
    _run_config,
    as_number,
    check_output_writable,
    collect,
    final_results,
    pooled_quadrant_stat,
    read_runs,
    run_exclusions,
    writing,
)
from stapo.study.stats import detectable_effect, moving_average, t_band, window_steps

__all__ = ["ROLES", "ROLE_OBJECTIVES", "SubClaim", "Claim", "ClaimsError", "role_table", "evaluate_claims",
           "write_claims", "main"]

#: The paper's methods → the study's method names (configs/study/cpu_reproduction.yaml).
ROLES: dict[str, str] = {"stapo": "stapo", "grpo": "grpo", "justrl": "justrl", "entropy20": "entropy20",
                         "random": "stapo_random", "high_entropy": "stapo_high_entropy",
                         "fullmask": "justrl_fullmask"}
#: The objective (``algorithm.objective``) of each of the paper's methods: a role mapped to a method whose runs train
#: another one is refused unless allowed (:func:`role_table`).
ROLE_OBJECTIVES: dict[str, str] = {"stapo": "stapo", "grpo": "grpo", "justrl": "justrl", "entropy20": "entropy20",
                                   "random": "stapo_random", "high_entropy": "stapo_high_entropy",
                                   "fullmask": "justrl_fullmask"}
BASELINES = ("grpo", "justrl", "entropy20")
COLLAPSE = 0.5  # final / initial entropy below this is a collapse
RARE = 1e-4  # 0.01 %: the paper's "mostly < 0.01 %"


@dataclass
class SubClaim:
    """One tested quantity: ``values`` (one per replicate) against ``threshold`` on the claimed ``side``.

    Attributes:
        name: what is measured, in words; side: ">" or "<" (the paper's direction); threshold: the bound.
        values: the replicates' values (NaN left out); labels: their seeds.
        planned: the labels of the replicates the study's plan gives this sub-claim (its methods' seeds), None when
            not known; ``missing`` the planned ones without a value (a run unfinished, excluded or without the
            quantity), said beside the result: a verdict from fewer seeds than planned says so.
        mean, low, high: the mean and 95 % t-interval over the replicates (NaN with fewer than 2 for the bounds).
        half, mde: what the replicates can resolve (:func:`stapo.study.stats.detectable_effect`): the interval's
            half-width, and the effect (distance from the threshold) a two-sided test at α = 0.05 would detect
            with 80 % power, from the replicates' own spread; NaN with fewer than 2.
        result: "reproduced" | "not reproduced" | "inconclusive" | "not tested" (no replicate has a value).
        note: a caveat shown beside the result (e.g. all replicates equal: a zero-width interval).
    """

    name: str
    side: str
    threshold: float
    values: list[float]
    labels: list[str]
    planned: list[str] | None = None
    missing: list[str] = field(default_factory=list)
    mean: float = math.nan
    low: float = math.nan
    high: float = math.nan
    half: float = math.nan
    mde: float = math.nan
    result: str = "inconclusive"
    note: str = ""

    def __post_init__(self) -> None:
        keep = [(v, lab) for v, lab in zip(self.values, self.labels) if v == v]
        self.values, self.labels = [v for v, _ in keep], [lab for _, lab in keep]
        self.missing = [lab for lab in self.planned or [] if lab not in self.labels]
        if not self.values:
            self.result = "not tested"
            return
        band = t_band(np.array(self.values))
        self.mean, self.low, self.high = float(band.mean[0]), float(band.low[0]), float(band.high[0])
        power = detectable_effect(np.array(self.values))
        self.half, self.mde = power.half, power.mde
        above, below = self.low > self.threshold, self.high < self.threshold  # False when NaN (one replicate)
        claimed, opposite = (above, below) if self.side == ">" else (below, above)
        self.result = "reproduced" if claimed else "not reproduced" if opposite else "inconclusive"
        if len(self.values) > 1 and max(self.values) == min(self.values):
            self.note = "all replicates equal: the interval has zero width"


class ClaimsError(ValueError):
    """The claims cannot be evaluated as asked (no runs, an unknown benchmark or role). One-line message."""


@dataclass
class Claim:
    """A claim's verdict from its sub-claims, and the numbers shown beside them (``info``).

    ``untested``: the sub-claims that could not be tested, each with its reason (a role without finished runs, runs
    too short for the windows); a claim with an untested sub-claim is at best inconclusive.
    ``not_testable``: why the runs cannot test the claim at all although its sub-claims have values (a
    precondition the claim needs did not occur, e.g. C3 without a baseline whose entropy rose): the verdict is
    then "not testable" and :attr:`rule_verdict` is what the sub-claims' rule alone gives, shown beside it.
    ``notes``: caveats printed under the claim (e.g. a sub-claim that follows from the formulas)."""

    id: str
    statement: str
    subclaims: list[SubClaim]
    info: dict[str, Any] = field(default_factory=dict)
    untested: list[str] = field(default_factory=list)
    not_testable: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def short_of_plan(self) -> str:
        """``"n of m planned seeds"`` for each distinct shortfall of the tested sub-claims (fewer replicates than the
        study plans, :attr:`SubClaim.missing`), joined by ", "; ``""`` when every one has its planned seeds."""
        gaps = [f"{len(s.values)} of {len(s.values) + len(s.missing)}" for s in self.subclaims
                if s.missing and s.result != "not tested"]
        return ", ".join(dict.fromkeys(gaps)) + " planned seeds" if gaps else ""

    @property
    def verdict(self) -> str:
        """"not testable" when :attr:`not_testable` gives a reason, else :attr:`rule_verdict`."""
        return "not testable" if self.not_testable else self.rule_verdict

    @property
    def rule_verdict(self) -> str:
        """The sub-claims' rule: not tested (none tested), not reproduced (any), reproduced (all tested and
        reproduced, none untested), inconclusive otherwise."""
        results = [s.result for s in self.subclaims]
        missing = bool(self.untested) or "not tested" in results
        tested = [r for r in results if r != "not tested"]
        if not tested:
            return "not tested"
        if "not reproduced" in tested:
            return "not reproduced"
        return "reproduced" if all(r == "reproduced" for r in tested) and not missing else "inconclusive"


def _by_seed(series: dict[str, dict[str, Series]], name: str, method: str) -> dict[int, np.ndarray]:
    """``seed → [T + 1]`` values of one metric of one method (empty when absent)."""
    s = series.get(name, {}).get(method)
    return {} if s is None else {seed: s.values[i] for i, seed in enumerate(s.seeds)}


def _trained(row: np.ndarray) -> np.ndarray:
    """The training steps (≥ 1) at which a [T + 1] curve has a value, increasing."""
    return np.flatnonzero(~np.isnan(row[1:])) + 1


def _final(row: np.ndarray, window: int) -> float:
    """Mean of a curve over the report's final window (:func:`stapo.study.stats.window_steps`). [T + 1] → float."""
    steps = _trained(row)
    win = window_steps(steps, row[None, steps], window)
    return float(np.mean(row[win])) if win.size else math.nan


def _initial(row: np.ndarray) -> float:
    """The curve's value at its first training step (step 1: the base model's rollouts)."""
    steps = _trained(row)
    return float(row[steps[0]]) if steps.size else math.nan


def _late_rise(row: np.ndarray, window: int, smooth: int) -> float:
    """Final value minus the lowest point of the smoothed curve before the final window (> 0: a late rise)."""
    steps = _trained(row)
    if steps.size <= window:
        return math.nan
    sm = moving_average(row[steps], smooth)  # [T'] over the logged steps
    return _final(row, window) - float(np.nanmin(sm[:-window]))


def _paired(a: dict[int, float], b: dict[int, float]) -> tuple[list[float], list[str]]:
    seeds = [s for s in a if s in b]
    return [a[s] - b[s] for s in seeds], [f"seed {s}" for s in seeds]


def _settings(series: dict[str, dict[str, Series]], benchmark: str) -> list[str]:
    """The final evaluation's series of ``benchmark`` (one per decoding setting), e.g. ``t1.0_p1.0/arith_test``.

    Raises:
        ClaimsError: the final evaluations are per benchmark and none is ``benchmark`` (the message lists them).
    """
    names = [n[len("final_eval["):-1] for n in series if n.startswith("final_eval[")]
    per_bench = [n for n in names if "/" in n]
    if per_bench:
        out = sorted(n for n in per_bench if n.endswith(f"/{benchmark}"))
        if not out:
            have = sorted({n.split("/", 1)[1] for n in per_bench})
            raise ClaimsError(f"--benchmark {benchmark!r}: the final evaluations have no such benchmark "
                              f"(they have: {', '.join(have)})")
        return out
    return sorted(names)  # a single-benchmark evaluation: the setting's average is the benchmark


def _final_eval(series, setting: str, method: str) -> dict[int, float]:
    return {seed: float(row[-1]) for seed, row in _by_seed(series, f"final_eval[{setting}]", method).items()}


def _pooled_fraction(rows: dict[str, list], specs: list[RunSpec], method: str, num: str, den: str) -> float:
    """Σ num / Σ den over every training step of every run of ``method`` (NaN when nothing is logged). ``num`` and
    ``den`` may be patterns with one ``*`` (e.g. ``actor/*/num_masked``): then each step's key pair of one mask is
    used (the first logged prefix)."""
    n = d = 0.0
    for s in specs:
        if s.method != method:
            continue
        for r in rows.get(s.name, []):
            if r.get("step", 0) < 1:
                continue
            pairs = [(num, den)]
            if "*" in num:
                head, tail = num.split("*")
                pairs = [(k, den.replace("*", k[len(head):len(k) - len(tail)])) for k in r
                         if k.startswith(head) and k.endswith(tail) and len(k) > len(head) + len(tail)][:1]
            for kn, kd in pairs:
                a, b = as_number(r.get(kn)), as_number(r.get(kd))
                if a == a and b == b:
                    n, d = n + a, d + b
    return n / d if d > 0 else math.nan


def _finished(specs: list[RunSpec], rows: dict[str, list]) -> list[RunSpec]:
    """The runs whose metrics reach their last step (``trainer.total_steps``): the claims read these only, so that a
    run still training never enters a final window or a final evaluation."""
    return [s for s in specs if rows.get(s.name) and rows[s.name][-1].get("step", 0) >= s.total_steps]


def _objective(spec: RunSpec) -> str:
    """The objective a run trains: its recorded ``config.json``'s ``algorithm.objective``, the plan's when the run
    has not recorded one (no folder yet)."""
    algo = _run_config(spec.run_dir).get("algorithm")
    recorded = algo.get("objective") if isinstance(algo, dict) else None
    return recorded if isinstance(recorded, str) else str(spec.train.algorithm.objective)


def role_table(cfg: StudyConfig, specs: list[RunSpec], roles: dict[str, str],
               allow_objective: Collection[str] = ()) -> list[dict[str, Any]]:
    """The role mapping as written into claims.md / claims.json, checked against what the runs train.

    Args:
        roles: the paper's methods → the study's method names (:data:`ROLES` with the ``--role`` changes).
        allow_objective: roles whose method may train another objective than :data:`ROLE_OBJECTIVES` says (the
            user says it is intended, e.g. a variant of GRPO standing in for GRPO).

    Returns:
        One dict per role, in :data:`ROLES` order: ``role``, ``method``, ``set_by`` (``"default"`` or
        ``"--role"``), ``in_study`` (the method is one of the study's), ``objectives`` (what its runs train:
        recorded config.json, else the plan), ``expected`` (the role's objective) and ``allowed`` (another
        objective, allowed by ``allow_objective``).

    Raises:
        ClaimsError: a role's runs train another objective than the role's and the role is not in
            ``allow_objective``: one line naming the role, the method, a run and both objectives.
    """
    table, refused = [], []
    for role, method in roles.items():
        found: dict[str, str] = {}  # objective → the first run that trains it
        for s in specs:
            if s.method == method:
                found.setdefault(_objective(s), s.name)
        expected = ROLE_OBJECTIVES[role]
        other = {obj: name for obj, name in found.items() if obj != expected}
        if other and role not in allow_objective:
            obj, name = next(iter(other.items()))
            refused.append(f"role {role} is mapped to method {method}, whose run {name} trains objective {obj!r}, "
                           f"not {expected!r}: map {role} to a method of objective {expected} with --role "
                           f"{role}=METHOD, or pass --allow-objective {role} if the stand-in is intended")
        table.append({"role": role, "method": method, "set_by": "default" if ROLES.get(role) == method else "--role",
                      "in_study": method in cfg.methods, "objectives": list(found), "expected": expected,
                      "allowed": bool(other)})
    if refused:
        raise ClaimsError("; ".join(refused))
    return table


def evaluate_claims(cfg: StudyConfig, specs: list[RunSpec], *, benchmark: str = "arith_test",
                    roles: dict[str, str] | None = None,
                    allow_objective: Collection[str] = ()) -> tuple[list[Claim], dict[str, Any]]:
    """C1–C5 on the study's finished runs (nothing is written). ``benchmark``: the held-out benchmark of C4/C5;
    ``roles``: the paper's methods → the study's method names (default :data:`ROLES`); ``allow_objective``: roles
    whose method may train another objective than the role's (:func:`role_table`).

    Only runs whose metrics reach ``trainer.total_steps`` are read (a run still training is listed, not used), and
    of those only the ones whose data are clean (:func:`stapo.study.report.run_exclusions`: no NaN / ±inf in a metric
    read, no missing steps, the planned run in its own folder; the report leaves out the same runs). A sub-claim
    whose methods have no finished run is listed as untested in its claim; one with fewer replicates than the plan
    gives names the missing seeds (:attr:`SubClaim.missing`).

    Returns:
        ``(claims, runs)``: runs = ``{"finished": [the finished runs read], "unfinished": [names], "excluded":
        {name: reason}, "unevaluated": [runs read without a final evaluation of their last checkpoint, left out of
        C4/C5], "total": n}``.

    Raises:
        ClaimsError: no run of the study has logged a step, ``benchmark`` is not among the final evaluations', or a
            role's runs train another objective than the role's (not in ``allow_objective``).
        stapo.run.tracking.CorruptJsonlError: a damaged metrics line or results.json (one line naming the file).
    """
    roles = dict(ROLES if roles is None else roles)
    role_table(cfg, specs, roles, allow_objective)  # refuses a role whose runs train another objective
    all_rows = read_runs(specs)  # a torn last line is noted once, here
    if not any(all_rows.values()):
        raise ClaimsError(f"no runs with logged steps under {Path(cfg.output_dir) / 'runs'} (is output_dir right? "
                          f"the study has {len(specs)} runs: {', '.join(s.name for s in specs[:3])}, …)")
    excluded = run_exclusions(specs, all_rows)
    finished = _finished(specs, all_rows)
    done = [s for s in finished if s.name not in excluded]
    runs = {"finished": [s.name for s in done],
            "unfinished": [s.name for s in specs if s not in finished],
            "excluded": excluded,
            "unevaluated": [s.name for s in done if cfg.final_eval.enabled and final_results(s) is None],
            "total": len(specs)}
    series, rows = collect(cfg, done, say=lambda _msg: None, rows={s.name: all_rows[s.name] for s in done}) \
        if done else ({}, {})

    def plan(*methods: str) -> list[str]:
        """The seeds the study plans for every one of ``methods`` (a sub-claim's planned replicates)."""
        seeds = [s.seed for s in specs if s.method == methods[0]]
        for m in methods[1:]:
            seeds = [sd for sd in seeds if any(s.method == m and s.seed == sd for s in specs)]
        return [f"seed {sd}" for sd in dict.fromkeys(seeds)]
    w, smooth = cfg.report.window, cfg.report.smooth
    has = {role: any(s.method == m and rows.get(s.name) for s in done) for role, m in roles.items()}
    lacks = lambda *rs: "no finished run of " + ", ".join(roles[r] for r in rs if not has[r])  # noqa: E731
    claims: list[Claim] = []
    # windows: the final window (last W steps) must not reach step 1, the initial value of the ratios
    short = bool(done) and min(s.total_steps for s in done) <= w
    too_short = f"runs too short: {min((s.total_steps for s in done), default=0)} steps ≤ the window {w}"

    # C1: rarity
    subs, info, untested = [], {}, []
    if has["stapo"]:
        mf = _by_seed(series, "masked_frac", roles["stapo"])
        subs.append(SubClaim("median over steps of STAPO's masked fraction", "<", RARE,
                             [float(np.nanmedian(v[1:])) if (~np.isnan(v[1:])).any() else math.nan
                              for v in mf.values()], [f"seed {s}" for s in mf], plan(roles["stapo"])))
        info["STAPO pooled masked fraction (Σ masked / Σ response tokens over all steps and seeds)"] = \
            _pooled_fraction(rows, done, roles["stapo"], "actor/s2t/num_masked", "actor/s2t/num_response_tokens")
        for role, m in roles.items():
            if has[role]:
                info[f"S2T would-mask pooled fraction: {m}"] = _pooled_fraction(
                    rows, done, m, "s2t/would_mask/num_masked", "response_length/total_tokens")
    else:
        untested.append(f"STAPO's masked fraction: {lacks('stapo')}")
    claims.append(Claim("C1", "S2T silences a tiny fraction of response tokens (mostly < 0.01 %)", subs, info,
                        untested))

    # C2: token taxonomy over the first W steps; one replicate per seed = the mean over that seed's runs (runs of
    # one seed share their prompts and step-1 rollouts, so they are not independent)
    per_run: dict[str, dict[str, float]] = {}
    for s in done:
        run = [r for r in rows.get(s.name, []) if r.get("step", 0) >= 1][:w]
        if run:
            per_run[s.name] = {f"{q}/{stat}": pooled_quadrant_stat(run, q, stat)[0]
                               for q in QUADRANTS for stat in ("grad_norm", "entropy_change")}
    seeds = list(dict.fromkeys(s.seed for s in done if s.name in per_run))
    subs, info = [], {}

    def seed_means(fn) -> list[float]:
        out = []
        for seed in seeds:
            vals = [fn(per_run[s.name]) for s in done if s.seed == seed and s.name in per_run]
            vals = [v for v in vals if v == v]
            out.append(float(np.mean(vals)) if vals else math.nan)
        return out

    def largest_other(run: dict[str, float]) -> float:
        others = [run[f"{q}/grad_norm"] for q in QUADRANTS
                  if q != "low_p_low_h" and run[f"{q}/grad_norm"] == run[f"{q}/grad_norm"]]
        return max(others) if others else math.nan

    if per_run:
        labels = [f"seed {sd}" for sd in seeds]
        planned = [f"seed {sd}" for sd in dict.fromkeys(s.seed for s in specs)]
        subs.append(SubClaim("‖∇‖ low_p_low_h − high_p_high_h", ">", 0.0,
                             seed_means(lambda r: r["low_p_low_h/grad_norm"] - r["high_p_high_h/grad_norm"]), labels,
                             planned))
        subs.append(SubClaim("‖∇‖ low_p_low_h − the largest other quadrant's", ">", 0.0,
                             seed_means(lambda r: r["low_p_low_h/grad_norm"] - largest_other(r)), labels, planned))
        subs.append(SubClaim("ΔH of low_p_low_h tokens", ">", 0.0,
                             seed_means(lambda r: r["low_p_low_h/entropy_change"]), labels, planned))
        with np.errstate(all="ignore"):
            ratio = np.array([r["low_p_low_h/grad_norm"] / r["high_p_high_h/grad_norm"] for r in per_run.values()])
        ratio = ratio[~np.isnan(ratio)]
        info["‖∇‖ ratio low_p_low_h / high_p_high_h (mean of the per-run ratios)"] = \
            float(ratio.mean()) if ratio.size else math.nan
        with_tokens = sum(r["low_p_low_h/grad_norm"] == r["low_p_low_h/grad_norm"] for r in per_run.values())
        info["runs with low_p_low_h tokens in the first steps"] = f"{with_tokens} of {len(per_run)}"
        for q in QUADRANTS:
            vals = [r[f"{q}/grad_norm"] for r in per_run.values() if r[f"{q}/grad_norm"] == r[f"{q}/grad_norm"]]
            info[f"‖∇‖ {q} (mean over runs)"] = float(np.mean(vals)) if vals else math.nan
        info["per run: ‖∇‖ low_p_low_h − high_p_high_h"] = ", ".join(
            f"{n} {_fmt(r['low_p_low_h/grad_norm'] - r['high_p_high_h/grad_norm'])}" for n, r in per_run.items())
    claims.append(Claim("C2", f"among Â > 0 tokens (first {w} steps), the low-p/low-H quadrant has the largest "
                              "logit-gradient norm and raises entropy", subs, info,
                        [] if per_run else ["the quadrant statistics: no finished run logged them"],
                        notes=_c2_notes(done, rows, w) if per_run else []))

    # C3: entropy dynamics
    ent = {role: _by_seed(series, "entropy", m) for role, m in roles.items()}
    ratio = {role: {s: _final(v, w) / _initial(v) for s, v in e.items()} for role, e in ent.items()}
    final = {role: {s: _final(v, w) for s, v in e.items()} for role, e in ent.items()}
    subs, info, untested = [], {}, []
    if short:
        untested.append(f"every sub-claim: {too_short}")
    else:
        if has["grpo"]:
            subs.append(SubClaim("GRPO final / initial entropy (collapse)", "<", COLLAPSE,
                                 list(ratio["grpo"].values()), [f"seed {s}" for s in ratio["grpo"]],
                                 plan(roles["grpo"])))
        else:
            untested.append(f"GRPO's collapse: {lacks('grpo')}")
        for role in ("justrl", "entropy20"):
            if has[role]:
                e = ent[role]
                subs.append(SubClaim(f"{roles[role]}: final entropy − the smoothed minimum before the final window "
                                     "(late rise)", ">", 0.0, [_late_rise(v, w, smooth) for v in e.values()],
                                     [f"seed {s}" for s in e], plan(roles[role])))
            else:
                untested.append(f"{roles[role]}'s late rise: {lacks(role)}")
        if has["stapo"]:
            subs.append(SubClaim("STAPO final / initial entropy (no collapse)", ">", COLLAPSE,
                                 list(ratio["stapo"].values()), [f"seed {s}" for s in ratio["stapo"]],
                                 plan(roles["stapo"])))
        else:
            untested.append(f"STAPO's stability: {lacks('stapo')}")
        if has["stapo"] and has["grpo"]:
            subs.append(SubClaim("STAPO − GRPO final entropy", ">", 0.0, *_paired(final["stapo"], final["grpo"]),
                                 plan(roles["stapo"], roles["grpo"])))
        else:
            untested.append(f"STAPO − GRPO final entropy: {lacks('stapo', 'grpo')}")
    for role, m in roles.items():
        if has[role] and role in ("stapo", *BASELINES, "fullmask") and not short:
            vals = [v for v in ratio[role].values() if v == v]
            info[f"final / initial entropy: {m}"] = float(np.mean(vals)) if vals else math.nan
    claims.append(Claim("C3", "GRPO's entropy collapses, JustRL's and 20-Entropy's rise late, STAPO's stays stable",
                        subs, info, untested, not_testable=c3_testability(subs)))

    # C4: accuracy on the held-out benchmark at each decoding setting
    settings = _settings(series, benchmark)
    subs, info, untested = [], {}, []
    if not settings:
        untested.append(f"every sub-claim: no finished run has a final evaluation of {benchmark}")
    elif not has["stapo"]:
        untested.append(f"every sub-claim: {lacks('stapo')}")
    else:
        for setting in settings:
            mine = _final_eval(series, setting, roles["stapo"])
            for role in BASELINES:
                if has[role]:
                    subs.append(SubClaim(f"{setting}: STAPO − {roles[role]} avg@N", ">", 0.0,
                                         *_paired(mine, _final_eval(series, setting, roles[role])),
                                         plan(roles["stapo"], roles[role])))
            for role in ("stapo", *BASELINES):
                vals = list(_final_eval(series, setting, roles[role]).values()) if has[role] else []
                if vals:
                    info[f"{setting}: {roles[role]} avg@N (mean over seeds)"] = float(np.mean(vals))
        untested += [f"STAPO − {roles[r]}: {lacks(r)}" for r in BASELINES if not has[r]]
    claims.append(Claim("C4", f"STAPO ≥ the best baseline on held-out problems ({benchmark}) at both decoding "
                              "settings (tested: STAPO − each baseline > 0)", subs, info, untested))

    # C5: masking strategy
    subs, info, untested = [], {}, []
    for setting in settings:
        acc = {role: _final_eval(series, setting, roles[role]) for role in ("stapo", "random", "high_entropy")
               if has[role]}
        if "stapo" in acc and "random" in acc:
            subs.append(SubClaim(f"{setting}: STAPO − random masking avg@N", ">", 0.0,
                                 *_paired(acc["stapo"], acc["random"]), plan(roles["stapo"], roles["random"])))
        if "random" in acc and "high_entropy" in acc:
            subs.append(SubClaim(f"{setting}: random − high-entropy masking avg@N", ">", 0.0,
                                 *_paired(acc["random"], acc["high_entropy"]),
                                 plan(roles["random"], roles["high_entropy"])))
        for role, a in acc.items():
            info[f"{setting}: {roles[role]} avg@N (mean over seeds)"] = float(np.mean(list(a.values())))
    if not settings:
        untested.append(f"the accuracy orderings: no finished run has a final evaluation of {benchmark}")
    else:
        if not (has["stapo"] and has["random"]):
            untested.append(f"STAPO − random masking: {lacks('stapo', 'random')}")
        if not (has["random"] and has["high_entropy"]):
            untested.append(f"random − high-entropy masking: {lacks('random', 'high_entropy')}")
    if has["fullmask"] and not short:
        subs.append(SubClaim("JustRL-FullMask final / initial entropy (collapse)", "<", COLLAPSE,
                             list(ratio["fullmask"].values()), [f"seed {s}" for s in ratio["fullmask"]],
                             plan(roles["fullmask"])))
    else:
        untested.append(f"JustRL-FullMask's collapse: {too_short if short else lacks('fullmask')}")
    for role in ("stapo", "random", "high_entropy"):
        if has[role]:
            info[f"pooled masked fraction (Σ masked / Σ response tokens): {roles[role]}"] = _pooled_fraction(
                rows, done, roles[role], "actor/*/num_masked", "actor/*/num_response_tokens")
    claims.append(Claim("C5", "low-entropy masking (STAPO) > random masking at a matched rate > high-entropy masking; "
                              "JustRL-FullMask collapses entropy", subs, info, untested))
    return claims, runs


def c3_testability(subclaims: list[SubClaim]) -> str:
    """Why C3 cannot be tested on these runs (``""`` when it can): the precondition of C3.

    S2T is claimed to keep entropy stable where the baselines' entropy rises late (JustRL, 20-Entropy); that can be
    tested only where a baseline's entropy did rise. The rise is established by the same rule as a sub-claim: a
    late-rise sub-claim (its name contains "late rise") whose 95 % t-interval lies wholly above 0 (result
    "reproduced"). When late-rise sub-claims were tested and none is reproduced, C3 is "not testable" and this
    returns the reason with each baseline's mean late rise, its interval and how many seeds rose at all; when none
    was tested (no baseline run), ``""`` (the claim's untested list says so).

    Worked example: JustRL late rises −0.14, +0.04, −0.11 (mean −0.07, s = √(0.0186 / 2) = 0.0964, half-width
    4.3027 · 0.0964 / √3 = 0.240 → [−0.31, 0.17], not wholly above 0) and 20-Entropy −0.11, −0.24, −0.13 → no
    baseline rose → not testable.
    """
    rises = [s for s in subclaims if "late rise" in s.name and s.result != "not tested"]
    if not rises or any(s.result == "reproduced" for s in rises):
        return ""
    parts = [f"{s.name.split(':')[0]} {_fmt(s.mean)} [{_fmt(s.low)}, {_fmt(s.high)}] "
             f"({sum(v > 0 for v in s.values)} of {len(s.values)} seeds above 0)" for s in rises]
    return ("no baseline's entropy rose late (final entropy − the smoothed minimum before the final window, mean "
            "[95 % t-interval]: " + "; ".join(parts) + "); C3 is about whether S2T prevents such a rise, so these "
            "runs cannot test it")


def _c2_notes(done: list[RunSpec], rows: dict[str, list], window: int) -> list[str]:
    """Why two of C2's sub-claims follow from the formulas (docs/method.md#token-analysis), with the runs' numbers.

    ΔH of a token = −p (ln p + H) Â (stapo.core.analysis.entropy_change_estimate) is > 0 for Â > 0 exactly when
    H < −ln p; a low-p token has −ln p > −ln τ_p (6.21 nats at τ_p = 0.002), and a low_p_low_h token's H is below
    its step's median cut (``s2t/quadrant/entropy_threshold``): when that cut stays below −ln τ_p, every such token
    raises entropy by construction. The logit-gradient norm per unit Â, ‖e_y − π‖, lies in [1 − p, √2 (1 − p)]
    (Σ_{v≠y} π_v² ≤ (1 − p)²): ≥ 1 − τ_p for a low-p token, near √2 when its H is low (the mass sits on one other
    token), near 1 − p for a high-p, high-H token."""
    taus = {float(s.train.algorithm.s2t.prob_threshold) for s in done}
    qs = {float(s.train.algorithm.s2t.entropy_quantile) for s in done}
    cuts = [as_number(r.get("s2t/quadrant/entropy_threshold")) for s in done
            for r in [r for r in rows.get(s.name, []) if r.get("step", 0) >= 1][:window]]
    cuts = [c for c in cuts if c == c]
    if len(taus) != 1 or not cuts:
        return []
    tau = taus.pop()
    bound = -math.log(tau)
    first = (f"ΔH of low_p_low_h > 0 follows from the formula: ΔH = −p (ln p + H) Â is > 0 for Â > 0 whenever "
             f"H < −ln p, and every low-p token has −ln p > −ln τ_p = {bound:.2f} nats; the median-H cut of the "
             f"quadrants was at most {max(cuts):.2f} nats over these steps, so every low_p_low_h token has ΔH > 0")
    if max(cuts) >= bound:
        first = (f"ΔH of low_p_low_h: ΔH = −p (ln p + H) Â is > 0 for Â > 0 whenever H < −ln p (> {bound:.2f} nats "
                 f"for a low-p token); the median-H cut reached {max(cuts):.2f} nats here, so it is not guaranteed")
    second = ("‖∇‖ low_p_low_h > high_p_high_h is close to the formula too: per unit Â the norm is ‖e_y − π‖ ∈ "
              f"[1 − p, √2 (1 − p)], at least {1 - tau:.3f} for a low-p token and near √2 when its entropy is low "
              "(the mass on one other token), near 1 − p < 1 for a confident high-p token; the comparison with the "
              "low-p/high-H quadrant, which the formula does not order, is the informative one")
    q = f"{qs.pop():g}" if len(qs) == 1 else "algorithm.s2t.entropy_quantile"
    third = ("low_p_low_h is a median-entropy split, not the set S2T silences: S2T's cut is the "
             f"{q} quantile (algorithm.s2t.entropy_quantile) of the candidates' (Â > 0, p < τ_p) entropy; report.md "
             "splits the tokens by S2T's own rule")
    return [first, second, third]


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def write_claims(cfg: StudyConfig, specs: list[RunSpec], *, benchmark: str = "arith_test",
                 roles: dict[str, str] | None = None, allow_objective: Collection[str] = ()) -> Path:
    """Write ``claims.md`` and ``claims.json`` to the study's output folder; returns the .md path. While some runs
    are unfinished both say PARTIAL and name them; both name the excluded runs with their reasons, the role mapping,
    and beside each verdict drawn from fewer seeds than planned, how many.

    Raises:
        stapo.config.ConfigError: the output folder cannot be written (checked first; one line naming it).
        OSError: a write failed all the same (the message names the file).
        ClaimsError, stapo.run.tracking.CorruptJsonlError: as :func:`evaluate_claims`.
    """
    out = Path(cfg.output_dir)
    check_output_writable(out, "the claims")
    roles = dict(ROLES if roles is None else roles)
    claims, runs = evaluate_claims(cfg, specs, benchmark=benchmark, roles=roles, allow_objective=allow_objective)
    table = role_table(cfg, specs, roles, allow_objective)
    partial = bool(runs["unfinished"] or runs["unevaluated"])
    excluded = runs["excluded"]
    lines = [f"# The paper's claims on study {cfg.name}" + (" — PARTIAL" if partial else "")
             + (f" — {len(excluded)} run{'s' if len(excluded) > 1 else ''} excluded" if excluded else ""), ""]
    if runs["unfinished"]:
        lines += [f"**PARTIAL: {runs['total'] - len(runs['unfinished'])} of {runs['total']} runs finished**; the "
                  f"claims read the finished ones only. Not finished (left out): {', '.join(runs['unfinished'])}.",
                  ""]
    if runs["unevaluated"]:
        lines += [f"**PARTIAL: {len(runs['unevaluated'])} finished run(s) without a final evaluation** of their last "
                  f"checkpoint (left out of C4 and C5; rerun the study to evaluate them): "
                  f"{', '.join(runs['unevaluated'])}.", ""]
    if not partial:
        lines += [f"All {runs['total']} runs finished" + (f"; {len(excluded)} excluded (below)." if excluded else
                                                         " and evaluated." if cfg.final_eval.enabled else "."), ""]
    if excluded:
        lines += [f"**EXCLUDED: {len(excluded)} run{'s' if len(excluded) > 1 else ''}** whose data are not clean, "
                  "left out of every claim (and out of the study report); each verdict drawn from fewer seeds than "
                  "planned says so beside it:", ""]
        lines += [f"- {name}: {why}" for name, why in excluded.items()] + [""]

    def role_text(r: dict[str, Any]) -> str:
        text = f"{r['role']} → {r['method']}" + (" (--role)" if r["set_by"] == "--role" else "")
        if not r["in_study"]:
            text += " (no such method in the study)"
        elif r["allowed"]:
            text += (f" (trains {', '.join(r['objectives'])}, not {r['expected']}: allowed by --allow-objective "
                     f"{r['role']})")
        return text

    lines += ["Roles (the paper's method → the study's method whose runs play it; `--role PAPER=METHOD` changes "
              "one): " + ", ".join(role_text(r) for r in table) + ".", ""]
    lines += ["Each sub-claim: one value per replicate (a seed; for C2 the mean over that seed's runs), the mean and "
              "its 95 % Student-t interval over the replicates; **reproduced** when the whole interval is on the "
              "paper's side of the threshold, **not reproduced** when it is wholly on the other side, "
              "**inconclusive** otherwise (one replicate has no interval). A claim is reproduced when all its "
              "sub-claims are tested and reproduced, not reproduced when any is not reproduced, inconclusive "
              "otherwise; **not testable** when the runs lack what the claim presupposes (C3: a baseline whose "
              "entropy rose), with the rule's output beside it. Rules: `stapo/study/claims.py`; "
              "docs/study.md#claims.", "",
              "| claim | verdict |", "|---|---|"]
    short = {c.id: f" (from {c.short_of_plan})" if c.short_of_plan else "" for c in claims}
    rule = {c.id: f" (the rule alone: {c.rule_verdict})" if c.not_testable else "" for c in claims}
    lines += [f"| {c.id}: {c.statement} | **{c.verdict}**{rule[c.id]}{short[c.id]} |" for c in claims]
    lines += ["", "Power, beside each sub-claim: **half-width**, the 95 % interval's half-width (a mean must be this "
              "far from the threshold for the interval to exclude it), and **80 % power**, the distance from the "
              "threshold that a two-sided t-test at α = 0.05 would detect with 80 % power, (t_{0.975, n−1} + "
              "t_{0.8, n−1}) · s/√n from the replicates' own spread s (`stapo/study/stats.py::detectable_effect`; "
              "docs/study.md#claims). An effect smaller than these is one the study could not have resolved."]
    for c in claims:
        lines += ["", f"## {c.id}: {c.statement} — {c.verdict}{rule[c.id]}{short[c.id]}", ""]
        if c.not_testable:
            lines += [f"**Not testable**: {c.not_testable}. The sub-claims' rule, applied all the same, gives "
                      f"**{c.rule_verdict}**.", ""]
        if c.subclaims:
            lines += ["| sub-claim | claimed | n | mean | 95 % CI | half-width | 80 % power | values | result |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for s in c.subclaims:
                vals = ", ".join(f"{lab}: {_fmt(v)}" for v, lab in zip(s.values, s.labels))
                notes = [s.note] if s.note else []
                if s.missing:
                    notes.append(f"missing: {', '.join(s.missing)}")
                note = f" ({'; '.join(notes)})" if notes else ""
                n = f"{len(s.values)} of {len(s.values) + len(s.missing)}" if s.missing else f"{len(s.values)}"
                lines.append(f"| {s.name} | {s.side} {_fmt(s.threshold)} | {n} | {_fmt(s.mean)} | "
                             f"[{_fmt(s.low)}, {_fmt(s.high)}] | {_fmt(s.half)} | {_fmt(s.mde)} | {vals} | "
                             f"{s.result}{note} |")
        if c.untested:
            lines += [""] + [f"- Not tested: {u}." for u in c.untested]
        if c.info:
            lines += [""] + [f"- {k}: {_fmt(v) if isinstance(v, float) else v}" for k, v in c.info.items()]
        if c.notes:
            lines += [""] + [f"- Note: {n}." for n in c.notes]
    with writing(out / "claims.md"):
        (out / "claims.md").write_text("\n".join(lines) + "\n")
    payload = {"study": cfg.name, "partial": partial, "runs": runs, "benchmark": benchmark, "roles": table,
               "claims": [{"id": c.id, "statement": c.statement, "verdict": c.verdict,
                           "rule_verdict": c.rule_verdict, "not_testable": c.not_testable, "notes": c.notes,
                           "short_of_plan": c.short_of_plan, "info": c.info, "untested": c.untested,
                           "subclaims": [asdict(s) for s in c.subclaims]} for c in claims]}
    with writing(out / "claims.json"):
        (out / "claims.json").write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n")
    return out / "claims.md"


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="stapo.study.claims", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="study YAML (configs/study/)")
    p.add_argument("--benchmark", default="arith_test", help="the held-out benchmark of C4 and C5")
    p.add_argument("--role", action="append", default=[], metavar="PAPER=METHOD",
                   help=f"map one of the paper's methods ({', '.join(ROLES)}) to a method of the study (repeatable; "
                        "default: the names of configs/study/cpu_reproduction.yaml); written into claims.md/json")
    p.add_argument("--allow-objective", action="append", default=[], metavar="PAPER",
                   help="let the method of role PAPER train another objective than the paper's method (refused "
                        "otherwise, e.g. --role grpo=my_method whose runs train stapo); repeatable, recorded")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the study config (anywhere on the "
                   "command line)")
    args = p.parse_intermixed_args(argv)  # overrides before, between or after the options
    try:
        cfg = load_study_config(args.config, args.overrides)
        roles = dict(ROLES)
        for item in args.role:
            paper, _, method = item.partition("=")
            if paper not in ROLES or not method:
                raise ClaimsError(f"--role {item!r}: expected PAPER=METHOD with PAPER one of {', '.join(ROLES)}")
            if method not in cfg.methods:
                raise ClaimsError(f"--role {item!r}: {method!r} is not a method of the study "
                                  f"(methods: {', '.join(cfg.methods)})")
            roles[paper] = method
        unknown = [r for r in args.allow_objective if r not in ROLES]
        if unknown:
            raise ClaimsError(f"--allow-objective {unknown[0]!r}: expected one of the paper's methods "
                              f"({', '.join(ROLES)})")
        path = write_claims(cfg, run_specs(cfg), benchmark=args.benchmark, roles=roles,
                            allow_objective=args.allow_objective)
    except (ConfigError, CorruptJsonlError, ClaimsError) as e:
        print(f"stapo.study.claims: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a failed read or write of a run or claims file (the message names it)
        print(f"stapo.study.claims: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}", file=sys.stderr)
        return 1
    print(path.read_text().split("\n## ")[0].rstrip())
    print(f"claims: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
