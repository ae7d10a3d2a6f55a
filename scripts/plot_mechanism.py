"""The mechanism study's figure (issue 32, item 6): who moves the probe-set entropy along a run?

    python scripts/plot_mechanism.py RUN_DIR --out results/<study>/mechanism.png [--title TEXT]

Four panels over the run's steps, from its ``metrics.jsonl`` (docs/metrics.md#mechanism-measurements-mechanism-probe):

1. ``probe/entropy`` and ``actor/entropy_first_k`` (trailing mean of 5), Gate B's series;
2. at each attribution step, each token group's share of the step's response tokens (lines, log scale) against its
   share of the step's first-order probe-entropy movement Σ|dH_probe| (bars, same colour): the paper's claim
   predicts the silenced group's bar far above its line (docs/study.md, "E2": ≥ 10× over the run);
3. the signed first-order change of the probe entropy per group (``mechanism/dH_probe/<group>``, nats/token) and the
   step's whole first-order change (``mechanism/dH_probe/step``, black);
4. the paired one-step counterfactual δ = ΔH_STAPO − ΔH_JustRL (``mechanism/counterfactual/delta``; filled where
   ≥ 1 token was silenced, hollow where δ is 0 by construction), the mean of the filled ones with its 95 %
   moving-block bootstrap interval (block 5, 10,000 replicates, seed 0: :func:`stapo.study.mechanism_claims.e2`).

Works on a partial run (a panel without data says so). One PNG.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from stapo.study.mechanism_claims import (DELTA_KEY, DELTA_MASKED_KEY, DH_KEY, FIRST_K_KEY,  # noqa: E402
                                          FIRST_K_SMOOTH, GROUPS, MIN_MASKED_STEPS, NUM_KEY, PROBE_KEY,
                                          SHARE_RATIO_MIN,
                                          MechanismClaimsError, e2, read_run, series)
from stapo.study.stats import moving_average  # noqa: E402

COLORS = {"silenced": "#d62728", "kept_candidates": "#ff7f0e", "pos_high_p": "#1f77b4", "neg": "#2ca02c"}
LABELS = {"silenced": "S2T-silenced", "kept_candidates": "kept candidates (Â>0, p<τ_p)",
          "pos_high_p": "Â>0, p≥τ_p", "neg": "Â<0"}
FLOOR = 1e-5  # log-scale floor of the share panel (a share of 0 sits on it)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")


def plot(run_dir: str | Path, out: str | Path, title: str | None = None) -> Path:
    """Draw the figure of ``run_dir`` into ``out`` (PNG; parent folders created) → its path.

    Raises:
        MechanismClaimsError: no ``metrics.jsonl`` in ``run_dir``.
    """
    run = read_run(run_dir)
    rows = run.rows
    attr = [r for r in rows if all(DH_KEY.format(g) in r and NUM_KEY.format(g) in r for g in GROUPS)]
    steps = np.array([r["step"] for r in attr], dtype=float)  # [A]
    dh = np.array([[float(r[DH_KEY.format(g)]) for g in GROUPS] for r in attr]).reshape(-1, 4)  # [A, 4]
    nt = np.array([[float(r[NUM_KEY.format(g)]) for g in GROUPS] for r in attr]).reshape(-1, 4)  # [A, 4]
    with np.errstate(invalid="ignore", divide="ignore"):
        abs_share = np.abs(dh) / np.abs(dh).sum(axis=1, keepdims=True)  # [A, 4]
        tok_share = nt / nt.sum(axis=1, keepdims=True)  # [A, 4]
    spacing = float(np.min(np.diff(steps))) if steps.size > 1 else 1.0
    width = 0.8 * spacing / len(GROUPS)
    offsets = (np.arange(len(GROUPS)) - (len(GROUPS) - 1) / 2) * width

    fig, axes = plt.subplots(4, 1, figsize=(11, 13.5), sharex=True,
                             gridspec_kw={"height_ratios": [0.6, 1.3, 1.0, 1.0]})
    ax = axes[0]
    ps, pv = series(rows, PROBE_KEY)
    ks, kv = series(rows, FIRST_K_KEY)
    if ps.size:
        ax.plot(ps, pv, color="k", lw=1.2, label=PROBE_KEY)
    if ks.size:
        ax.plot(ks, moving_average(kv, FIRST_K_SMOOTH), color="0.55", lw=1.2,
                label=f"{FIRST_K_KEY} (trailing mean of {FIRST_K_SMOOTH})")
    if ps.size or ks.size:
        ax.legend(loc="best", fontsize=8)
    else:
        _empty(ax, f"neither {PROBE_KEY} nor {FIRST_K_KEY} logged yet")
    ax.set_ylabel("entropy\n(nats/token)")
    ax.set_title("The length-independent entropies of Gate B", fontsize=10)

    verdict = e2(rows) if rows else None
    ax = axes[1]
    if steps.size:
        for i, g in enumerate(GROUPS):
            ax.bar(steps + offsets[i], np.clip(np.nan_to_num(abs_share[:, i]), FLOOR, None) - FLOOR, width,
                   bottom=FLOOR, color=COLORS[g], alpha=0.55)
            line = np.where(tok_share[:, i] > 0, tok_share[:, i], np.nan)  # no token: a gap, not a point
            ax.plot(steps, line, "-o", color=COLORS[g], ms=4, lw=1.5, label=LABELS[g])
        ax.set_yscale("log")
        ax.set_ylim(FLOOR, 1.5)
        ax.legend(loc="lower left", fontsize=8, ncol=2, title="lines: share of tokens; bars: share of Σ|ΔH_probe|",
                  title_fontsize=8, framealpha=0.9)
        sil = verdict["groups"]["silenced"]
        text = (f"over the run, silenced: {sil['abs_share']:.3g} of Σ|ΔH_probe| vs {sil['token_share']:.3g} of tokens"
                f" → ratio {sil['ratio']:.3g}" if sil["ratio"] is not None and np.isfinite(sil["ratio"])
                else "no silenced token on an attribution step: ratio n/a")
        ax.text(0.99, 0.03, f"{text} (E2 (a) needs ≥ {SHARE_RATIO_MIN:g})",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=8,
                bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": "0.7"})
    else:
        _empty(ax, "no attribution step logged yet (mechanism/dH_probe/*)")
    ax.set_ylabel("share of the step (log)")
    ax.set_title("Who moves the probe-set entropy? token share (lines) vs share of first-order |ΔH_probe| (bars)",
                 fontsize=10)

    ax = axes[2]
    if steps.size:
        for i, g in enumerate(GROUPS):
            ax.bar(steps + offsets[i], dh[:, i], width, color=COLORS[g], label=LABELS[g])
        total = [(r["step"], r["mechanism/dH_probe/step"]) for r in attr if "mechanism/dH_probe/step" in r]
        if total:
            ax.plot(*zip(*total), "k_", ms=14, mew=2, label="whole step (first order)")
        ax.axhline(0, color="0.3", lw=0.8)
        ax.legend(loc="best", fontsize=8, ncol=3)
    else:
        _empty(ax, "no attribution step logged yet")
    ax.set_ylabel("first-order ΔH_probe\n(nats/token)")
    ax.set_title("Signed first-order change of the probe entropy per token group", fontsize=10)

    ax = axes[3]
    cf = [(int(r["step"]), float(r[DELTA_KEY]), DELTA_MASKED_KEY in r) for r in rows if DELTA_KEY in r]
    if cf:
        masked = [(s, d) for s, d, m in cf if m]
        plain = [(s, d) for s, d, m in cf if not m]
        if plain:
            ax.plot(*zip(*plain), "o", mfc="none", mec="0.5", label="δ, nothing silenced (0 by construction)")
        if masked:
            ax.plot(*zip(*masked), "o", color=COLORS["silenced"], label="δ, ≥ 1 token silenced")
            res = verdict["delta_masked"]
            lo_s, hi_s = masked[0][0], masked[-1][0]
            ax.hlines(res["mean"], lo_s, hi_s, color="k", lw=1.5,
                      label=f"mean δ (≥ 1 silenced): {res['mean']:.3g}, 95 % block-bootstrap "
                            f"[{res['low']:.3g}, {res['high']:.3g}], n = {res['n']}"
                            + (f" (< {MIN_MASKED_STEPS}: E2 not testable)" if res["n"] < MIN_MASKED_STEPS else ""))
            ax.fill_between([lo_s, hi_s], res["low"], res["high"], color="k", alpha=0.12)
        ax.axhline(0, color="0.3", lw=0.8)
        ax.legend(loc="best", fontsize=8, framealpha=0.8)
    else:
        _empty(ax, "no counterfactual step logged yet (mechanism/counterfactual/*)")
    ax.set_ylabel("δ = ΔH_STAPO − ΔH_JustRL\n(nats/token)")
    ax.set_xlabel("training step")
    ax.set_title("Paired one-step counterfactual from one state and batch: STAPO's update vs JustRL's", fontsize=10)
    state = "" if run.finished else f", partial: step {run.last_step} of {run.total_steps}"
    fig.suptitle(title or f"{run.path.name} ({run.objective or '?'}{state})", fontsize=12)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run folder with metrics.jsonl (the trunk)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    try:
        path = plot(args.run_dir, args.out, args.title)
    except (MechanismClaimsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
