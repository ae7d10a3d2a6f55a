"""The claims C1–C5 (stapo/study/claims.py): the rule of a sub-claim and the aggregation to a verdict, by hand, and
the claims on hand-written run folders of the tiny study (stapo and grpo only; the other roles absent)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from stapo.study import load_study_config, run_specs
from stapo.study.claims import Claim, SubClaim, c3_testability, evaluate_claims, main, write_claims

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
    assert nan.note == "all replicates equal: the interval has zero width"  # said beside the result
    assert SubClaim("d", ">", 0.0, [0.1, 0.2], list("ab")).note == ""
    assert SubClaim("d", ">", 0.0, [float("nan")], ["a"]).result == "not tested"  # no replicate has a value


def test_claim_verdict_aggregates_its_subclaims():
    yes = SubClaim("y", ">", 0.0, [1.0, 1.0], ["a", "b"])
    no = SubClaim("n", ">", 0.0, [-1.0, -1.0], ["a", "b"])
    maybe = SubClaim("m", ">", 0.0, [1.0], ["a"])
    assert Claim("C", "", [yes, yes]).verdict == "reproduced"
    assert Claim("C", "", [yes, maybe]).verdict == "inconclusive"
    assert Claim("C", "", [yes, maybe, no]).verdict == "not reproduced"
    assert Claim("C", "", []).verdict == "not tested"
    # an untested sub-claim (a role without finished runs) keeps a claim from "reproduced", not from "not reproduced"
    assert Claim("C", "", [yes, yes], untested=["x: no finished run of justrl"]).verdict == "inconclusive"
    assert Claim("C", "", [yes, no], untested=["x"]).verdict == "not reproduced"
    assert Claim("C", "", [], untested=["x"]).verdict == "not tested"
    empty = SubClaim("e", ">", 0.0, [], [])
    assert Claim("C", "", [yes, empty]).verdict == "inconclusive" and Claim("C", "", [empty]).verdict == "not tested"


def test_subclaim_reports_what_its_replicates_can_resolve():
    # 0.02, 0.04, 0.06: s/√3 = 0.011547; t_{0.975,2} = 4.302653, t_{0.8,2} = 1.060660 (t_{p,2} = (2p−1)/√(2p(1−p)))
    s = SubClaim("d", ">", 0.0, [0.02, 0.04, 0.06], list("abc"))
    assert s.half == pytest.approx(0.0496827, abs=1e-7)  # 4.302653 · 0.011547 = high − mean
    assert s.half == pytest.approx(s.high - s.mean) and s.mde == pytest.approx(0.0619302, abs=1e-7)  # 5.363313 · …
    one = SubClaim("d", ">", 0.0, [5.0], ["a"])
    assert math.isnan(one.half) and math.isnan(one.mde)


def test_c3_is_not_testable_without_a_baseline_whose_entropy_rose():
    # JustRL late rises −0.14, 0.04, −0.11: mean −0.07, s = √(((−0.07)² + 0.11² + (−0.04)²) / 2) = √0.0093 = 0.096437,
    # half = 4.302653 · 0.096437 / √3 = 0.23956 → [−0.3096, 0.1696]: straddles 0 → no established rise
    justrl = SubClaim("justrl: final entropy − the smoothed minimum before the final window (late rise)", ">", 0.0,
                      [-0.14, 0.04, -0.11], list("abc"))
    e20 = SubClaim("entropy20: … (late rise)", ">", 0.0, [-0.11, -0.24, -0.13], list("abc"))
    stapo = SubClaim("STAPO final / initial entropy (no collapse)", ">", 0.5, [0.05, 0.06, 0.17], list("abc"))
    assert stapo.result == "not reproduced" and justrl.result == "inconclusive"
    why = c3_testability([justrl, e20, stapo])
    assert why.startswith("no baseline's entropy rose late") and "justrl -0.07 [-0.3096, 0.1696] (1 of 3 seeds " \
        "above 0)" in why and "entropy20 " in why and "(0 of 3 seeds above 0)" in why
    c3 = Claim("C3", "", [justrl, e20, stapo], not_testable=why)
    assert (c3.verdict, c3.rule_verdict) == ("not testable", "not reproduced")  # the rule's output kept beside it
    # a baseline whose rise is established (0.10, 0.12, 0.14 → [0.0703, 0.1697] > 0): C3 is testable, the rule decides
    rose = SubClaim("justrl: … (late rise)", ">", 0.0, [0.10, 0.12, 0.14], list("abc"))
    assert c3_testability([rose, e20, stapo]) == ""
    assert Claim("C3", "", [rose, e20, stapo]).verdict == "not reproduced"
    # no late-rise sub-claim tested (no baseline run): nothing to say here (the claim's untested list says it)
    assert c3_testability([stapo]) == "" and c3_testability([SubClaim("x (late rise)", ">", 0.0, [], [])]) == ""


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
    claims_list, runs = evaluate_claims(cfg, specs, roles=ROLES)
    claims = {c.id: c for c in claims_list}
    assert runs == {"finished": [s.name for s in specs], "unfinished": [], "excluded": {}, "unevaluated": [],
                    "total": 6}

    c1 = claims["C1"]
    assert [s.values for s in c1.subclaims] == [[0.0, 0.0, 0.0]] and c1.verdict == "reproduced"
    assert c1.info["STAPO pooled masked fraction (Σ masked / Σ response tokens over all steps and seeds)"] == \
        pytest.approx(1 / 120)

    # C2: one replicate per seed, the mean over its 2 runs: each run 2.0 − 1.0 = 1.0 → 1.0 per seed (s = 0)
    c2 = {s.name: s for s in claims["C2"].subclaims}
    d = c2["‖∇‖ low_p_low_h − high_p_high_h"]
    assert d.values == [1.0] * 3 and d.labels == ["seed 0", "seed 1", "seed 2"] and d.result == "reproduced"
    # vs 1.0 and 0.5; low_p_high_h empty
    assert c2["‖∇‖ low_p_low_h − the largest other quadrant's"].values == [1.0] * 3
    # ΔH per seed 0.01, 0.02, 0.03 (both runs of a seed alike): mean 0.02, s = 0.01,
    # half = 4.3027 · 0.01 / √3 = 0.02484 → [−0.0048, 0.0448] contains 0 → inconclusive (3 replicates, not 6 runs)
    dh = c2["ΔH of low_p_low_h tokens"]
    assert dh.mean == pytest.approx(0.02) and dh.low == pytest.approx(0.02 - 0.02484, abs=1e-4)
    assert dh.result == "inconclusive"

    c3 = {s.name: s for s in claims["C3"].subclaims}
    g = c3["GRPO final / initial entropy (collapse)"]
    assert g.values == pytest.approx([0.15, 0.2, 0.25]) and g.result == "reproduced"  # [0.0758, 0.3242] < 0.5
    st = c3["STAPO final / initial entropy (no collapse)"]
    assert st.values == pytest.approx([0.8, 0.85, 0.9]) and st.result == "reproduced"
    assert c3["STAPO − GRPO final entropy"].values == pytest.approx([0.65] * 3)
    # the JustRL / 20-Entropy late rises are untested (no runs of those roles): inconclusive, and said so
    assert claims["C3"].verdict == "inconclusive"
    assert claims["C3"].untested == ["absent's late rise: no finished run of absent"] * 2

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
    assert [c["id"] for c in data["claims"]] == ["C1", "C2", "C3", "C4", "C5"] and data["partial"] is False
    assert write_claims(cfg, run_specs(cfg)) == out / "claims.md"
    # a bad config is one line, exit 2
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


EVAL = ["final_eval.enabled=true", "final_eval.config=../eval/tiny_test.yaml"]


def _tiny(tmp_path, *extra):
    cfg = load_study_config(TINY, [f"output_dir={tmp_path / 'study'}", "seeds=[0,1]", *EVAL,
                                   "overrides=[trainer.total_steps=4,trainer.save_every=1]", *extra])
    return cfg, run_specs(cfg), {s.name: s for s in run_specs(cfg)}


def test_claims_read_finished_runs_only_and_say_partial(tmp_path, capsys):
    cfg, specs, by = _tiny(tmp_path)
    # grpo: seed 0 finished (steps 1–4), seed 1 stopped at step 2 while its entropy was still high
    #   seed 0: 1, 0.5, 0.1, 0.1 → final (steps 3–4) 0.1 → ratio 0.1 ; seed 1: 1, 0.9 (unfinished, left out)
    # stapo: both seeds 1, 1, 0.9, 0.9 → ratio 0.9
    _write(by["grpo_seed0"].run_dir, [_row(1, 1.0), _row(2, 0.5), _row(3, 0.1), _row(4, 0.1)])
    _write(by["grpo_seed1"].run_dir, [_row(1, 1.0), _row(2, 0.9)])
    for seed in (0, 1):
        _write(by[f"stapo_seed{seed}"].run_dir, [_row(1, 1.0), _row(2, 1.0), _row(3, 0.9), _row(4, 0.9)])
    claims, runs = evaluate_claims(cfg, specs, roles=ROLES)
    assert runs["unfinished"] == ["grpo_seed1"] and len(runs["finished"]) == 3
    c3 = {s.name: s for s in {c.id: c for c in claims}["C3"].subclaims}
    g = c3["GRPO final / initial entropy (collapse)"]
    assert g.values == pytest.approx([0.1]) and g.labels == ["seed 0"]  # seed 1's 0.9 (its steps 1–2) never enters
    assert c3["STAPO − GRPO final entropy"].values == pytest.approx([0.8])  # seed 0 only: 0.9 − 0.1
    md = write_claims(cfg, specs, roles=ROLES).read_text()
    assert md.startswith("# The paper's claims on study tiny_test — PARTIAL")
    assert "**PARTIAL: 3 of 4 runs finished**" in md and "Not finished (left out): grpo_seed1." in md
    assert json.loads((cfg.output_dir and (tmp_path / "study" / "claims.json")).read_text())["partial"] is True


def test_claims_refuse_a_wrong_output_dir_a_misspelled_benchmark_and_a_bad_role(tmp_path, capsys):
    cfg, specs, by = _tiny(tmp_path)
    base = ["--config", str(TINY), f"output_dir={tmp_path / 'study'}", "seeds=[0,1]", *EVAL,
            "overrides=[trainer.total_steps=4,trainer.save_every=1]"]
    # no runs at all (a typo'd output_dir): one line, exit 2, nothing written
    assert main(base) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no runs with logged steps under" in err
    assert not (tmp_path / "study" / "claims.md").exists()
    for s in specs:
        _write(s.run_dir, [_row(1, 1.0), _row(2, 1.0), _row(3, 1.0), _row(4, 1.0)], acc=0.5)
    # the final evaluations have arith_test and arith_hard; "arith_tset" is refused with the list
    assert main([*base[:2], "--benchmark", "arith_tset", *base[2:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'arith_tset'" in err and "(they have: arith_hard, arith_test)" in err
    assert main([*base[:2], "--role", "grpo=GRPO", *base[2:]]) == 2  # not a method of the study
    assert "'GRPO' is not a method of the study (methods: stapo, grpo)" in capsys.readouterr().err
    assert main([*base[:2], "--role", "ppo=grpo", *base[2:]]) == 2  # not one of the paper's methods
    assert "PAPER one of stapo, grpo, justrl" in capsys.readouterr().err
    # a role mapped to a method of another objective is refused in one line naming both objectives ...
    assert main([*base[:2], "--role", "justrl=grpo", *base[2:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "role justrl is mapped to method grpo, whose run grpo_seed0 trains objective " \
        "'grpo', not 'justrl'" in err and "--allow-objective justrl" in err
    assert main([*base[:2], "--allow-objective", "ppo", *base[2:]]) == 2
    assert "--allow-objective 'ppo': expected one of the paper's methods" in capsys.readouterr().err
    # ... and used when the user says it is intended: justrl → grpo makes C3's late-rise sub-claim tested on grpo's
    # runs, and claims.md / claims.json record the mapping and the allowance
    assert main([*base[:2], "--role", "justrl=grpo", "--allow-objective", "justrl", *base[2:]]) == 0
    data = json.loads((tmp_path / "study" / "claims.json").read_text())
    c3 = next(c for c in data["claims"] if c["id"] == "C3")
    assert any(s["name"].startswith("grpo: final entropy − the smoothed minimum") for s in c3["subclaims"])
    justrl = next(r for r in data["roles"] if r["role"] == "justrl")
    assert justrl == {"role": "justrl", "method": "grpo", "set_by": "--role", "in_study": True,
                      "objectives": ["grpo"], "expected": "justrl", "allowed": True}
    md = (tmp_path / "study" / "claims.md").read_text()
    assert ("Roles (the paper's method → the study's method whose runs play it; `--role PAPER=METHOD` changes one): "
            "stapo → stapo, grpo → grpo, justrl → grpo (--role) (trains grpo, not justrl: allowed by "
            "--allow-objective justrl), entropy20 → entropy20 (no such method in the study),") in md


def test_claims_stop_on_a_damaged_final_evaluation(tmp_path, capsys):
    cfg, specs, by = _tiny(tmp_path)
    for s in specs:
        _write(s.run_dir, [_row(1, 1.0), _row(2, 1.0), _row(3, 1.0), _row(4, 1.0)], acc=0.5)
    bad = by["stapo_seed1"].run_dir / "final_eval" / "results.json"
    bad.write_text('{"metrics": {trunc')
    assert main(["--config", str(TINY), f"output_dir={tmp_path / 'study'}", "seeds=[0,1]", *EVAL,
                 "overrides=[trainer.total_steps=4,trainer.save_every=1]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}: damaged final evaluation" in err  # never a silently smaller table


def test_claims_on_runs_shorter_than_the_window_test_no_ratio(tmp_path):
    # 2 steps with window 2: the final window is steps 1–2 and contains the initial step: no ratio is tested
    cfg, specs, by = _tiny(tmp_path, "report.window=2", "overrides=[trainer.total_steps=2,trainer.save_every=1]")
    for s in specs:
        _write(s.run_dir, [_row(1, 1.0), _row(2, 1.0)])
    claims, _ = evaluate_claims(cfg, specs, roles=ROLES)
    c3 = {c.id: c for c in claims}["C3"]
    assert c3.subclaims == [] and c3.verdict == "not tested"
    assert c3.untested == ["every sub-claim: runs too short: 2 steps ≤ the window 2"]


def test_c5_matched_rate_pools_each_masks_own_keys(tmp_path):
    # random masking logs actor/s2t_random/*; STAPO actor/s2t/*. Pooled: Σ masked / Σ response tokens per method.
    cfg, specs, by = _tiny(tmp_path)
    roles = {**ROLES, "random": "grpo"}  # grpo's runs stand in for random masking here
    for seed in (0, 1):
        # stapo: masked 1, 0, 0, 1 of 10 tokens per step → 2 / 40 per seed → pooled 4 / 80 = 0.05
        _write(by[f"stapo_seed{seed}"].run_dir, [_row(i, 1.0, masked=m) for i, m in zip(range(1, 5), (1, 0, 0, 1))],
               acc=0.5)
        # "random": 3 masked of 20 tokens at step 1, 0 of 20 after → 3 / 80 per seed → pooled 6 / 160 = 0.0375
        rows = [{"step": i, "actor/entropy": 1.0, "actor/s2t_random/num_masked": 3.0 if i == 1 else 0.0,
                 "actor/s2t_random/num_response_tokens": 20.0} for i in range(1, 5)]
        _write(by[f"grpo_seed{seed}"].run_dir, rows, acc=0.5)
    c5 = {c.id: c for c in evaluate_claims(cfg, specs, roles=roles, allow_objective={"random"})[0]}["C5"]
    assert c5.info["pooled masked fraction (Σ masked / Σ response tokens): stapo"] == pytest.approx(0.05)
    assert c5.info["pooled masked fraction (Σ masked / Σ response tokens): grpo"] == pytest.approx(0.0375)


def test_claims_name_finished_runs_without_a_final_evaluation(tmp_path):
    cfg, specs, by = _tiny(tmp_path)
    # all four runs finished; stapo_seed0's final evaluation is missing (deleted, or never run)
    for s in specs:
        _write(s.run_dir, [_row(1, 1.0), _row(2, 1.0), _row(3, 1.0), _row(4, 1.0)],
               acc=None if s.name == "stapo_seed0" else 0.5)
    claims, runs = evaluate_claims(cfg, specs, roles=ROLES)
    assert runs["unfinished"] == [] and runs["unevaluated"] == ["stapo_seed0"]
    c4 = {c.id: c for c in claims}["C4"]
    assert [s.labels for s in c4.subclaims] == [["seed 1"]]  # STAPO − GRPO on the evaluated seed only
    md = write_claims(cfg, specs, roles=ROLES).read_text()
    assert md.startswith("# The paper's claims on study tiny_test — PARTIAL")
    assert "**PARTIAL: 1 finished run(s) without a final evaluation** of their last checkpoint" in md
    assert "(left out of C4 and C5; rerun the study to evaluate them): stapo_seed0." in md
    assert "All 4 runs" not in md
    data = json.loads((tmp_path / "study" / "claims.json").read_text())
    assert data["partial"] is True and data["runs"]["unevaluated"] == ["stapo_seed0"]
    # evaluated everywhere: not partial, and it says so
    (by["stapo_seed0"].run_dir / "final_eval").mkdir()
    (by["stapo_seed0"].run_dir / "final_eval" / "results.json").write_text(
        (by["stapo_seed1"].run_dir / "final_eval" / "results.json").read_text())
    assert "All 4 runs finished and evaluated." in write_claims(cfg, specs, roles=ROLES).read_text()


# --- verdicts from clean data only: runs excluded with their reason --------------------------------------------

def _clean_study(tmp_path):
    """stapo: both seeds entropy 1, 1, 0.9, 0.9 (ratio 0.9), avg@N 0.5; grpo seed 0: 1, 0.5, 0.1, 0.1 (ratio 0.1),
    avg@N 0.25. grpo seed 1 is left to the test."""
    cfg, specs, by = _tiny(tmp_path)
    for seed in (0, 1):
        _write(by[f"stapo_seed{seed}"].run_dir, [_row(1, 1.0), _row(2, 1.0), _row(3, 0.9), _row(4, 0.9)], acc=0.5)
    _write(by["grpo_seed0"].run_dir, [_row(1, 1.0), _row(2, 0.5), _row(3, 0.1), _row(4, 0.1)], acc=0.25)
    return cfg, specs, by


@pytest.mark.parametrize("bad, text", [("nan", "NaN"), ("inf", "+inf"), (None, "NaN"), (1e308, "+inf"),
                                       (float("nan"), "NaN")], ids=["nan", "inf", "old null", "old 1e308", "NaN token"])
def test_claims_exclude_a_run_with_non_finite_values_in_its_final_window(tmp_path, bad, text):
    # grpo seed 1 diverged at step 3: entropy non-finite at steps 3–4, as metrics.jsonl writes it ("nan", "inf"),
    # as it did before (null, a clamped 1e308) or as json.dumps writes a float NaN. Before, its final entropy
    # silently came from steps 1–2 (0.95 → ratio 0.95), or averaged 1e308 in, and it counted as a replicate.
    cfg, specs, by = _clean_study(tmp_path)
    _write(by["grpo_seed1"].run_dir, [_row(1, 1.0), _row(2, 0.9), _row(3, bad), _row(4, bad)], acc=0.3)
    claims, runs = evaluate_claims(cfg, specs, roles=ROLES)
    why = f"actor/entropy is {text} at step 3 (2 non-finite values at steps 3–4)"
    assert runs["excluded"] == {"grpo_seed1": why}
    assert "grpo_seed1" not in runs["finished"] and runs["unfinished"] == []
    c3 = {s.name: s for s in {c.id: c for c in claims}["C3"].subclaims}
    g = c3["GRPO final / initial entropy (collapse)"]
    assert g.values == pytest.approx([0.1]) and g.labels == ["seed 0"] and g.missing == ["seed 1"]
    c4 = {c.id: c for c in claims}["C4"]  # the final evaluation of an excluded run is left out too: 0.5 − 0.25
    assert [s.values for s in c4.subclaims] == [pytest.approx([0.25])] and c4.short_of_plan == "1 of 2 planned seeds"
    md = write_claims(cfg, specs, roles=ROLES).read_text()
    assert md.startswith("# The paper's claims on study tiny_test — 1 run excluded\n")
    assert "**EXCLUDED: 1 run** whose data are not clean" in md and f"- grpo_seed1: {why}" in md
    assert "| C3: GRPO's entropy collapses, JustRL's and 20-Entropy's rise late, STAPO's stays stable | " \
           "**inconclusive** (from 1 of 2 planned seeds) |" in md
    assert "| GRPO final / initial entropy (collapse) | < 0.5 | 1 of 2 | 0.1 | [n/a, n/a] | n/a | n/a | " \
           "seed 0: 0.1 | inconclusive (missing: seed 1) |" in md
    data = json.loads((tmp_path / "study" / "claims.json").read_text())
    assert data["runs"]["excluded"] == {"grpo_seed1": why}
    c3j = next(c for c in data["claims"] if c["id"] == "C3")
    assert c3j["short_of_plan"] == "1 of 2 planned seeds"
    assert c3j["subclaims"][0]["planned"] == ["seed 0", "seed 1"] and c3j["subclaims"][0]["missing"] == ["seed 1"]


def test_claims_exclude_a_run_with_missing_steps(tmp_path):
    # grpo seed 1's row of step 3 was deleted by hand: before, "finished" (its last row is step 4) and its final
    # window held step 4 alone
    cfg, specs, by = _clean_study(tmp_path)
    _write(by["grpo_seed1"].run_dir, [_row(1, 1.0), _row(2, 0.9), _row(4, 0.1)], acc=0.3)
    _, runs = evaluate_claims(cfg, specs, roles=ROLES)
    assert runs["excluded"] == {"grpo_seed1": "metrics.jsonl has no rows for step 3 of 1–4 (deleted or lost rows)"}


def _recorded(spec, run_dir=None):
    """The run's config.json as train.py writes it: its resolved config (the study's plan for it)."""
    from stapo.config import to_dict

    (run_dir or spec.run_dir).joinpath("config.json").write_text(json.dumps(to_dict(spec.train)))


@pytest.mark.parametrize("checks", ["study", "content only"])
def test_claims_count_a_copied_or_linked_run_once(tmp_path, monkeypatch, checks):
    # stapo_seed1 is a copy of stapo_seed0's folder, grpo_seed1 a symlink to grpo_seed0's: one run each, not two
    # seeds (before, both counted: "all 4 runs finished", two identical replicates). "content only": without the
    # study's identity checks (stapo.study.runner.run_identity_problems) the report's own duplicate check decides.
    import shutil

    import stapo.study.runner as runner

    if checks == "content only":
        monkeypatch.delattr(runner, "run_identity_problems", raising=False)
    cfg, specs, by = _tiny(tmp_path)
    for name in ("stapo_seed0", "grpo_seed0"):
        _write(by[name].run_dir, [_row(1, 1.0), _row(2, 0.5), _row(3, 0.2), _row(4, 0.2)], acc=0.5)
        _recorded(by[name])
    shutil.copytree(by["stapo_seed0"].run_dir, by["stapo_seed1"].run_dir)
    by["grpo_seed1"].run_dir.symlink_to(by["grpo_seed0"].run_dir, target_is_directory=True)
    claims, runs = evaluate_claims(cfg, specs, roles=ROLES)
    assert list(runs["excluded"]) == ["stapo_seed1", "grpo_seed1"] and runs["finished"] == ["stapo_seed0",
                                                                                             "grpo_seed0"]
    assert "the same run as stapo_seed0" in runs["excluded"]["stapo_seed1"]
    assert f"is a symlink to {by['grpo_seed0'].run_dir}" in runs["excluded"]["grpo_seed1"]
    c3 = {s.name: s for s in {c.id: c for c in claims}["C3"].subclaims}
    assert c3["STAPO − GRPO final entropy"].labels == ["seed 0"]


def test_claims_record_the_role_mapping(tmp_path):
    cfg, specs, by = _clean_study(tmp_path)
    md = write_claims(cfg, specs).read_text()  # the default roles: the study's method names
    assert ("Roles (the paper's method → the study's method whose runs play it; `--role PAPER=METHOD` changes one): "
            "stapo → stapo, grpo → grpo, justrl → justrl (no such method in the study), entropy20 → entropy20 (no "
            "such method in the study), random → stapo_random (no such method in the study), high_entropy → "
            "stapo_high_entropy (no such method in the study), fullmask → justrl_fullmask (no such method in the "
            "study).") in md
    roles = json.loads((tmp_path / "study" / "claims.json").read_text())["roles"]
    assert roles[0] == {"role": "stapo", "method": "stapo", "set_by": "default", "in_study": True,
                        "objectives": ["stapo"], "expected": "stapo", "allowed": False}
    # the objective a run recorded counts, not the plan's: grpo_seed0's config.json says it trained stapo
    (by["grpo_seed0"].run_dir / "config.json").write_text(json.dumps({"algorithm": {"objective": "stapo"}}))
    from stapo.study.claims import ClaimsError

    with pytest.raises(ClaimsError, match="role grpo is mapped to method grpo, whose run grpo_seed0 trains "
                                          "objective 'stapo', not 'grpo'"):
        evaluate_claims(cfg, specs)


def test_claims_overrides_may_follow_the_options(tmp_path, capsys):
    cfg, specs, by = _clean_study(tmp_path)
    _write(by["grpo_seed1"].run_dir, [_row(1, 1.0), _row(2, 0.5), _row(3, 0.1), _row(4, 0.1)], acc=0.25)
    # before, the overrides after --benchmark were "unrecognized arguments" (exit 2)
    assert main(["--config", str(TINY), f"output_dir={tmp_path / 'study'}", "seeds=[0,1]", "--benchmark",
                 "arith_test", *EVAL, "overrides=[trainer.total_steps=4,trainer.save_every=1]"]) == 0
    assert (tmp_path / "study" / "claims.md").is_file()
