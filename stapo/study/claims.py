"""The paper's claims C1–C5 tested on a study's runs, each with a rule fixed in advance (docs/study.md#claims).

    python -m stapo.study.claims --config configs/study/cpu_reproduction.yaml   # → <output_dir>/claims.md, .json

A claim is split into sub-claims; each is one number per replicate (a seed, or a run for C2) compared with a
threshold on the side the paper claims, with the 95 % Student-t interval over the replicates
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
  and its mean first-order entropy change is > 0; one replicate per run that has tokens in the quadrant.
- C3 entropy: GRPO's final entropy (mean of the last W steps) / its step-1 entropy < 0.5 (collapse); JustRL's and
  20-Entropy's final entropy exceeds the lowest point of their smoothed curve before the final window (a late
  rise); STAPO's final/initial ratio > 0.5 (no collapse) and STAPO's final entropy > GRPO's (paired by seed).
- C4 accuracy: STAPO − each baseline > 0 in the final evaluation's avg@N on the held-out benchmark, at each
  decoding setting (paired by seed).
- C5 masking: STAPO − random masking > 0 and random − high-entropy masking > 0 (final avg@N, each setting, paired
  by seed); JustRL-FullMask's final/initial entropy < 0.5 (collapse). Also reported: the masked fractions of
  STAPO and random masking (matched rate).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stapo.study.config import RunSpec, StudyConfig
from stapo.study.keys import QUADRANTS
from stapo.study.report import Series, as_number, collect, pooled_quadrant_stat
from stapo.study.stats import moving_average, t_band, window_steps

__all__ = ["ROLES", "SubClaim", "Claim", "evaluate_claims", "write_claims", "main"]

#: The paper's methods → the study's method names (configs/study/cpu_reproduction.yaml).
ROLES: dict[str, str] = {"stapo": "stapo", "grpo": "grpo", "justrl": "justrl", "entropy20": "entropy20",
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
        values: the replicates' values (NaN left out); labels: their seeds or runs.
        mean, low, high: the mean and 95 % t-interval over the replicates (NaN with fewer than 2 for the bounds).
        result: "reproduced" | "not reproduced" | "inconclusive".
    """

    name: str
    side: str
    threshold: float
    values: list[float]
    labels: list[str]
    mean: float = math.nan
    low: float = math.nan
    high: float = math.nan
    result: str = "inconclusive"

    def __post_init__(self) -> None:
        keep = [(v, lab) for v, lab in zip(self.values, self.labels) if v == v]
        self.values, self.labels = [v for v, _ in keep], [lab for _, lab in keep]
        if self.values:
            band = t_band(np.array(self.values))
            self.mean, self.low, self.high = float(band.mean[0]), float(band.low[0]), float(band.high[0])
        above, below = self.low > self.threshold, self.high < self.threshold  # False when NaN (one replicate)
        claimed, opposite = (above, below) if self.side == ">" else (below, above)
        self.result = "reproduced" if claimed else "not reproduced" if opposite else "inconclusive"


@dataclass
class Claim:
    """A claim's verdict from its sub-claims, and the numbers shown beside them (``info``)."""

    id: str
    statement: str
    subclaims: list[SubClaim]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        results = [s.result for s in self.subclaims]
        if not results:
            return "not tested"
        if all(r == "reproduced" for r in results):
            return "reproduced"
        return "not reproduced" if "not reproduced" in results else "inconclusive"


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
    """The final evaluation's series of ``benchmark`` (one per decoding setting), e.g. ``t1.0_p1.0/arith_test``."""
    out = sorted(n[len("final_eval["):-1] for n in series if n.startswith("final_eval[") and n.endswith(f"/{benchmark}]"))
    if not out:  # a single-benchmark evaluation: the setting's average is the benchmark
        out = sorted(n[len("final_eval["):-1] for n in series if n.startswith("final_eval[") and "/" not in n)
    return out


def _final_eval(series, setting: str, method: str) -> dict[int, float]:
    return {seed: float(row[-1]) for seed, row in _by_seed(series, f"final_eval[{setting}]", method).items()}


def _pooled_fraction(rows: dict[str, list], specs: list[RunSpec], method: str, num: str, den: str) -> float:
    """Σ num / Σ den over every training step of every run of ``method`` (NaN when nothing is logged)."""
    n = d = 0.0
    for s in specs:
        if s.method != method:
            continue
        for r in rows.get(s.name, []):
            a, b = as_number(r.get(num)), as_number(r.get(den))
            if r.get("step", 0) >= 1 and a == a and b == b:
                n, d = n + a, d + b
    return n / d if d > 0 else math.nan


def evaluate_claims(cfg: StudyConfig, specs: list[RunSpec], *, benchmark: str = "arith_test",
                    roles: dict[str, str] | None = None) -> list[Claim]:
    """C1–C5 on the study's runs as they are (nothing is written). ``benchmark``: the held-out benchmark of C4/C5.
    A claim whose methods are absent from the study has no sub-claims ("not tested")."""
    roles = dict(ROLES if roles is None else roles)
    series, rows = collect(cfg, specs)
    w, smooth = cfg.report.window, cfg.report.smooth
    has = {role: any(s.method == m and rows.get(s.name) for s in specs) for role, m in roles.items()}
    claims: list[Claim] = []

    # C1: rarity
    subs, info = [], {}
    if has["stapo"]:
        mf = _by_seed(series, "masked_frac", roles["stapo"])
        subs.append(SubClaim("median over steps of STAPO's masked fraction", "<", RARE,
                             [float(np.nanmedian(v[1:])) if (~np.isnan(v[1:])).any() else math.nan
                              for v in mf.values()], [f"seed {s}" for s in mf]))
        info["STAPO pooled masked fraction (Σ masked / Σ tokens)"] = _pooled_fraction(
            rows, specs, roles["stapo"], "actor/s2t/num_masked", "actor/s2t/num_response_tokens")
        for role, m in roles.items():
            if has[role]:
                info[f"S2T would-mask pooled fraction: {m}"] = _pooled_fraction(
                    rows, specs, m, "s2t/would_mask/num_masked", "response_length/total_tokens")
    claims.append(Claim("C1", "S2T silences a tiny fraction of response tokens (mostly < 0.01 %)", subs, info))

    # C2: token taxonomy over the first W steps of every run
    per_run: dict[str, dict[str, tuple[float, float]]] = {}
    for s in specs:
        run = [r for r in rows.get(s.name, []) if r.get("step", 0) >= 1][:w]
        if run:
            per_run[s.name] = {f"{q}/{stat}": pooled_quadrant_stat(run, q, stat)[0]
                               for q in QUADRANTS for stat in ("grad_norm", "entropy_change")}
    subs, info = [], {}
    if per_run:
        names = list(per_run)
        g = {q: [per_run[n][f"{q}/grad_norm"] for n in names] for q in QUADRANTS}
        ll = np.array(g["low_p_low_h"])
        subs.append(SubClaim("‖∇‖ low_p_low_h − high_p_high_h", ">", 0.0,
                             list(ll - np.array(g["high_p_high_h"])), names))
        others = np.array([g[q] for q in QUADRANTS if q != "low_p_low_h"])  # [3, runs]
        best_other = np.where(np.isnan(others).all(axis=0), np.nan,
                              np.where(np.isnan(others), -np.inf, others).max(axis=0))  # [runs]
        subs.append(SubClaim("‖∇‖ low_p_low_h − the largest other quadrant's", ">", 0.0, list(ll - best_other), names))
        subs.append(SubClaim("ΔH of low_p_low_h tokens", ">", 0.0,
                             [per_run[n]["low_p_low_h/entropy_change"] for n in names], names))
        with np.errstate(all="ignore"):
            ratio = ll / np.array(g["high_p_high_h"])  # [runs]
        ratio = ratio[~np.isnan(ratio)]
        info["‖∇‖ ratio low_p_low_h / high_p_high_h (mean over runs)"] = float(ratio.mean()) if ratio.size else math.nan
        info["runs with low_p_low_h tokens in the first steps"] = int((~np.isnan(ll)).sum())
        for q in QUADRANTS:
            vals = [v for v in g[q] if v == v]
            info[f"‖∇‖ {q} (mean over runs)"] = float(np.mean(vals)) if vals else math.nan
    claims.append(Claim("C2", f"among Â > 0 tokens (first {w} steps), the low-p/low-H quadrant has the largest "
                              "logit-gradient norm and raises entropy", subs, info))

    # C3: entropy dynamics
    ent = {role: _by_seed(series, "entropy", m) for role, m in roles.items()}
    ratio = {role: {s: _final(v, w) / _initial(v) for s, v in e.items()} for role, e in ent.items()}
    final = {role: {s: _final(v, w) for s, v in e.items()} for role, e in ent.items()}
    subs, info = [], {}
    if has["grpo"]:
        subs.append(SubClaim("GRPO final / initial entropy (collapse)", "<", COLLAPSE,
                             list(ratio["grpo"].values()), [f"seed {s}" for s in ratio["grpo"]]))
    for role in ("justrl", "entropy20"):
        if has[role]:
            e = ent[role]
            subs.append(SubClaim(f"{roles[role]}: final entropy − the smoothed minimum before the final window "
                                 "(late rise)", ">", 0.0, [_late_rise(v, w, smooth) for v in e.values()],
                                 [f"seed {s}" for s in e]))
    if has["stapo"]:
        subs.append(SubClaim("STAPO final / initial entropy (no collapse)", ">", COLLAPSE,
                             list(ratio["stapo"].values()), [f"seed {s}" for s in ratio["stapo"]]))
        if has["grpo"]:
            subs.append(SubClaim("STAPO − GRPO final entropy", ">", 0.0, *_paired(final["stapo"], final["grpo"])))
    for role, m in roles.items():
        if has[role] and role in ("stapo", *BASELINES, "fullmask"):
            vals = [v for v in ratio[role].values() if v == v]
            info[f"final / initial entropy: {m}"] = float(np.mean(vals)) if vals else math.nan
    claims.append(Claim("C3", "GRPO's entropy collapses, JustRL's and 20-Entropy's rise late, STAPO's stays stable",
                        subs, info))

    # C4: accuracy on the held-out benchmark at each decoding setting
    settings = _settings(series, benchmark)
    subs, info = [], {}
    if has["stapo"]:
        for setting in settings:
            mine = _final_eval(series, setting, roles["stapo"])
            for role in BASELINES:
                if has[role]:
                    subs.append(SubClaim(f"{setting}: STAPO − {roles[role]} avg@N", ">", 0.0,
                                         *_paired(mine, _final_eval(series, setting, roles[role]))))
            for role in ("stapo", *BASELINES):
                vals = list(_final_eval(series, setting, roles[role]).values()) if has[role] else []
                if vals:
                    info[f"{setting}: {roles[role]} avg@N (mean over seeds)"] = float(np.mean(vals))
    claims.append(Claim("C4", f"STAPO ≥ the best baseline on held-out problems ({benchmark}) at both decoding "
                              "settings", subs, info))

    # C5: masking strategy
    subs, info = [], {}
    for setting in settings:
        acc = {role: _final_eval(series, setting, roles[role]) for role in ("stapo", "random", "high_entropy")
               if has[role]}
        if "stapo" in acc and "random" in acc:
            subs.append(SubClaim(f"{setting}: STAPO − random masking avg@N", ">", 0.0,
                                 *_paired(acc["stapo"], acc["random"])))
        if "random" in acc and "high_entropy" in acc:
            subs.append(SubClaim(f"{setting}: random − high-entropy masking avg@N", ">", 0.0,
                                 *_paired(acc["random"], acc["high_entropy"])))
        for role, a in acc.items():
            info[f"{setting}: {roles[role]} avg@N (mean over seeds)"] = float(np.mean(list(a.values())))
    if has["fullmask"]:
        subs.append(SubClaim("JustRL-FullMask final / initial entropy (collapse)", "<", COLLAPSE,
                             list(ratio["fullmask"].values()), [f"seed {s}" for s in ratio["fullmask"]]))
    for role in ("stapo", "random", "high_entropy"):
        if has[role]:
            f = [float(np.mean(v[_trained(v)])) for v in _by_seed(series, "masked_frac", roles[role]).values()
                 if _trained(v).size]
            info[f"masked fraction over all steps: {roles[role]}"] = float(np.nanmean(f)) if f else math.nan
    claims.append(Claim("C5", "low-entropy masking (STAPO) > random masking at a matched rate > high-entropy masking; "
                              "JustRL-FullMask collapses entropy", subs, info))
    return claims


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def write_claims(cfg: StudyConfig, specs: list[RunSpec], *, benchmark: str = "arith_test") -> Path:
    """Write ``claims.md`` and ``claims.json`` to the study's output folder; returns the .md path."""
    claims = evaluate_claims(cfg, specs, benchmark=benchmark)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# The paper's claims on study {cfg.name}", "",
             "Each sub-claim: one value per replicate (seed, or run for C2), the mean and its 95 % Student-t interval "
             "over the replicates; **reproduced** when the whole interval is on the paper's side of the threshold, "
             "**not reproduced** when it is wholly on the other side, **inconclusive** otherwise (one replicate has "
             "no interval). A claim is reproduced when all its sub-claims are, not reproduced when any is not. "
             "Rules: `stapo/study/claims.py`; docs/study.md#claims.", "",
             "| claim | verdict |", "|---|---|"]
    lines += [f"| {c.id}: {c.statement} | **{c.verdict}** |" for c in claims]
    for c in claims:
        lines += ["", f"## {c.id}: {c.statement} — {c.verdict}", ""]
        if c.subclaims:
            lines += ["| sub-claim | claimed | n | mean | 95 % CI | values | result |", "|---|---|---|---|---|---|---|"]
            for s in c.subclaims:
                vals = ", ".join(f"{_fmt(v)}" for v in s.values)
                lines.append(f"| {s.name} | {s.side} {_fmt(s.threshold)} | {len(s.values)} | {_fmt(s.mean)} | "
                             f"[{_fmt(s.low)}, {_fmt(s.high)}] | {vals} | {s.result} |")
        else:
            lines.append("Not tested: the study has none of the methods it needs.")
        if c.info:
            lines += [""] + [f"- {k}: {_fmt(v) if isinstance(v, float) else v}" for k, v in c.info.items()]
    (out / "claims.md").write_text("\n".join(lines) + "\n")
    payload = [{"id": c.id, "statement": c.statement, "verdict": c.verdict, "info": c.info,
                "subclaims": [asdict(s) for s in c.subclaims]} for c in claims]
    (out / "claims.json").write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n")
    return out / "claims.md"


def main(argv: list[str] | None = None) -> int:
    from stapo.cli import ArgumentParser
    from stapo.config import ConfigError
    from stapo.study.config import load_study_config, run_specs
    from stapo.tracking import CorruptJsonlError

    p = ArgumentParser(prog="stapo.study.claims", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="study YAML (configs/study/)")
    p.add_argument("--benchmark", default="arith_test", help="the held-out benchmark of C4 and C5")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the study config")
    args = p.parse_args(argv)
    try:
        cfg = load_study_config(args.config, args.overrides)
        path = write_claims(cfg, run_specs(cfg), benchmark=args.benchmark)
    except (ConfigError, CorruptJsonlError) as e:
        print(f"stapo.study.claims: {e}", file=sys.stderr)
        return 2
    print(path.read_text().split("\n## ")[0].rstrip())
    print(f"claims: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
