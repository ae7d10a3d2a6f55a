"""The claims C1–C5 (stapo/study/claims.py): the rule of a sub-claim and the aggregation to a verdict, by hand, and
the claims on hand-written run folders of the tiny study (stapo and grpo only; the other roles absent)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from stapo.study import load_study_config, run_specs
from stapo.study.claims import Claim, SubClaim, evaluate_claims, main, write_claims

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "study" / "tiny_test.yaml"
ROLES = {"stapo": "stapo", "grpo": "grpo", "justrl": "absent", "entropy20": "absent", "random": "absent",
         "high_entropy": "absent", "fullmask": "absent"}


def test_subclaim_rule_by_hand():
    # 0.02, 0.04, 0.06: mean 0.04, s = 0.02, half = t_{0.975,2} · 0.02 / √3 = 4.3027 · 0.011547 = 0.049684
    s = SubClaim("d", ">", 0.0, [0.02, 0.04, 0.06], ["a", "b", "c"])
    assert s.mean == pytest.approx(0.04) and s.low == pytest.approx(0.04 - 0.049684, abs=1e-5)
    assert s.result == "inconclusive"  # the interval [−0.0097, 0.0897] contains 0
    assert SubClaim("d", ">", 0.0, [0.10, 0.12, 0.14], list("abc")).result == "reproduced"  # [0.0703, 0.1697]
    assert SubClaim("d", ">", 0.0, [-0.10, -0.12, -0.14], list("abc")).result == "not reproduced"
    assert SubClaim("r", "<", 0.5, [0.15, 0.2, 0.25], list("abc")).result == "reproduced"  # [0.0758, 0.3242]
    one = SubClaim("d", ">", 0.0, [5.0], ["a"])
    assert one.result == "inconclusive" and math.isnan(one.low)  # one seed: no interval, no verdict
    nan = SubClaim("d", ">", 0.0, [float("nan"), 0.3, 0.3], list("abc"))  # NaN left out; s = 0 → [0.3, 0.3]
    assert nan.labels == ["b", "c"] and nan.result == "reproduced"


def test_claim_verdict_aggregates_its_subclaims():
    yes = SubClaim("y", ">", 0.0, [1.0, 1.0], ["a", "b"])
    no = SubClaim("n", ">", 0.0, [-1.0, -1.0], ["a", "b"])
    maybe = SubClaim("m", ">", 0.0, [1.0], ["a"])
    assert Claim("C", "", [yes, yes]).verdict == "reproduced"
    assert Claim("C", "", [yes, maybe]).verdict == "inconclusive"
    assert Claim("C", "", [yes, maybe, no]).verdict == "not reproduced"
    assert Claim("C", "", []).verdict == "not tested"


def _write(run_dir: Path, rows: list[dict], acc: float | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if acc is not None:
        (run_dir / "final_eval").mkdir()
        benches = {"arith_test": {"avg@N": acc}, "arith_hard": {"avg@N": 0.0}}
        (run_dir / "final_eval" / "results.json").write_text(json.dumps(
            {"model": {"step": 4}, "metrics": {"t1.0_p1.0": {"average": {"avg@N": acc / 2}, "benchmarks": benches}}}))


def _row(step: int, entropy: float, masked: float = 0.0, **extra) -> dict:
    return {"step": step, "actor/entropy": entropy, "critic/score/mean": 0.0, "response_length/total_tokens": 10.0,
            "actor/s2t/masked_frac": masked / 10, "actor/s2t/num_masked": masked,
            "actor/s2t/num_response_tokens": 10.0, **extra}


def test_claims_on_hand_written_runs(tmp_path):
    cfg = load_study_config(TINY, [f"output_dir={tmp_path / 'study'}", "seeds=[0,1,2]",
                                   "overrides=[trainer.total_steps=4,trainer.save_every=1]",
                                   "final_eval.enabled=true", "final_eval.config=../eval/tiny_test.yaml"])
    specs = run_specs(cfg)
    by = {s.name: s for s in specs}
    # entropy per step (window 2: final = mean of steps 3–4; initial = step 1):
    #   stapo seed s: 1, 0.9, 0.8+0.05s, 0.8+0.05s → final 0.8, 0.85, 0.9 → ratios 0.8, 0.85, 0.9
    #   grpo  seed s: 1, 0.5, 0.1+0.05s, 0.2+0.05s → final 0.15, 0.2, 0.25 → ratios 0.15, 0.2, 0.25
    # stapo masks one token at step 2 of seed 0 only: per-seed medians 0, 0, 0; pooled 1 / (3 seeds · 4 · 10) = 1/120
    # low_p_low_h vs high_p_high_h ‖∇‖ at step 1 only (pooled over the first 2 steps with counts 1 and 0): 2.0 vs 1.0
    # final arith_test avg@N: stapo 0.4, 0.5, 0.6 ; grpo 0.1, 0.3, 0.5 → STAPO − GRPO 0.3, 0.2, 0.1
    q = "s2t/quadrant/"
    for seed in range(3):
        e = 0.05 * seed
        quad = {q + "num_tokens": 10.0, q + "low_p_low_h/count": 1.0, q + "low_p_low_h/grad_norm": 2.0,
                q + "low_p_low_h/entropy_change": 0.01 * (seed + 1), q + "high_p_high_h/count": 5.0,
                q + "high_p_high_h/grad_norm": 1.0, q + "high_p_low_h/count": 4.0, q + "high_p_low_h/grad_norm": 0.5,
                q + "low_p_high_h/count": 0.0}
        empty = {q + "num_tokens": 10.0, q + "low_p_low_h/count": 0.0, q + "high_p_high_h/count": 0.0,
                 q + "high_p_low_h/count": 0.0, q + "low_p_high_h/count": 0.0}
        _write(by[f"stapo_seed{seed}"].run_dir,
               [_row(1, 1.0, **quad), _row(2, 0.9, masked=1.0 if seed == 0 else 0.0, **empty),
                _row(3, 0.8 + e), _row(4, 0.8 + e)], acc=0.4 + 0.1 * seed)
        _write(by[f"grpo_seed{seed}"].run_dir,
               [_row(1, 1.0, **quad), _row(2, 0.5, **empty), _row(3, 0.1 + e), _row(4, 0.2 + e)],
               acc=0.1 + 0.2 * seed)
    claims = {c.id: c for c in evaluate_claims(cfg, specs, roles=ROLES)}

    c1 = claims["C1"]
    assert [s.values for s in c1.subclaims] == [[0.0, 0.0, 0.0]] and c1.verdict == "reproduced"
    assert c1.info["STAPO pooled masked fraction (Σ masked / Σ tokens)"] == pytest.approx(1 / 120)

    c2 = {s.name: s for s in claims["C2"].subclaims}  # 6 runs, each 2.0 − 1.0 = 1.0 (s = 0: the interval [1, 1])
    d = c2["‖∇‖ low_p_low_h − high_p_high_h"]
    assert d.values == [1.0] * 6 and d.result == "reproduced"
    assert c2["‖∇‖ low_p_low_h − the largest other quadrant's"].values == [1.0] * 6  # vs 1.0 and 0.5; low_p_high_h empty
    dh = c2["ΔH of low_p_low_h tokens"]  # 0.01, 0.02, 0.03 per seed, twice: mean 0.02 > 0, interval above 0
    assert dh.mean == pytest.approx(0.02) and dh.result == "reproduced"

    c3 = {s.name: s for s in claims["C3"].subclaims}
    g = c3["GRPO final / initial entropy (collapse)"]
    assert g.values == pytest.approx([0.15, 0.2, 0.25]) and g.result == "reproduced"  # [0.0758, 0.3242] < 0.5
    st = c3["STAPO final / initial entropy (no collapse)"]
    assert st.values == pytest.approx([0.8, 0.85, 0.9]) and st.result == "reproduced"
    assert c3["STAPO − GRPO final entropy"].values == pytest.approx([0.65] * 3)
    assert claims["C3"].verdict == "reproduced"  # the JustRL / 20-Entropy sub-claims are absent (roles)

    c4 = {s.name: s for s in claims["C4"].subclaims}
    assert list(c4) == ["t1.0_p1.0/arith_test: STAPO − grpo avg@N"]
    s = c4["t1.0_p1.0/arith_test: STAPO − grpo avg@N"]  # 0.3, 0.2, 0.1: mean 0.2, half 4.3027 · 0.1/√3 = 0.2484
    assert s.values == pytest.approx([0.3, 0.2, 0.1]) and s.low == pytest.approx(0.2 - 0.24842, abs=1e-4)
    assert s.result == "inconclusive" and claims["C4"].verdict == "inconclusive"
    assert claims["C5"].verdict == "not tested"


def test_claims_cli_writes_md_and_json(tmp_path, capsys):
    out = tmp_path / "study"
    cfg = load_study_config(TINY, [f"output_dir={out}"])
    for s in run_specs(cfg):
        _write(s.run_dir, [_row(1, 1.0), _row(2, 0.5)])
    assert main(["--config", str(TINY), f"output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "| C1: S2T silences" in text and (out / "claims.md").is_file()
    data = json.loads((out / "claims.json").read_text())
    assert [c["id"] for c in data] == ["C1", "C2", "C3", "C4", "C5"]
    assert write_claims(cfg, run_specs(cfg)) == out / "claims.md"
    # a bad config is one line, exit 2
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
