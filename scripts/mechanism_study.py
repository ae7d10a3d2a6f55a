"""The staged mechanism study of issue 32, one stage per command (rules: docs/study.md#mechanism-study-issue-32-rules-fixed-before-the-trunk).

    python scripts/mechanism_study.py sft          # the cold-start model data/models/word_sft_n64 (~12 min)
    python scripts/mechanism_study.py calibrate    # results/mechanism_study/calibration.{md,json}: gate A
    python scripts/mechanism_study.py probe-set    # results/mechanism_study/probe_set.jsonl (fixed for every run)
    python scripts/mechanism_study.py trunk        # the JustRL trunk, runs/mechanism/trunk (resumable)
    python scripts/mechanism_study.py gate         # gate B on the trunk: results/mechanism_study/gate_b.json
    python scripts/mechanism_study.py arms         # gate B passed: the forks; failed: STAPO from step 0 (resumable)
    python scripts/mechanism_study.py snapshot     # the runs' small files into results/mechanism_study/runs/ (to commit)
    python scripts/mechanism_study.py verdicts     # results/mechanism_study/mechanism_claims.{md,json}, mechanism.png
    python scripts/mechanism_study.py status       # what is done, what runs, what is next

Every training stage calls ``train.py --resume``-able commands (``trainer.resume=auto``): rerunning a stage continues
it from its latest checkpoint; a finished run is left as it is. Long stages are meant to run in the background::

    nohup python scripts/mechanism_study.py trunk > runs/mechanism/trunk.log 2>&1 &

The study's settings are fixed here and in configs/mechanism/*.yaml (pre-registered: docs/study.md); the stages
print the commands they run. Exit codes: 0 done, 1 a stage failed (its command's output says why), 2 a stage whose
inputs are missing (one line naming the stage to run first).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
OUT = REPO / "results" / "mechanism_study"
RUNS = REPO / "runs" / "mechanism"
SFT_MODEL = REPO / "data" / "models" / "word_sft_n64"
JUSTRL, STAPO = "configs/mechanism/justrl.yaml", "configs/mechanism/stapo.yaml"
PROBE_SET = OUT / "probe_set.jsonl"
#: gate B passed: {JustRL, STAPO} x these branch seeds, FORK_STEPS steps each from the checkpoint before the rise
#: (trainer.init_from; a pair shares its prompts and rollout seeds: docs/runs.md, "Forks")
FORK_SEEDS = (1, 2, 3)
FORK_STEPS = 30
#: the levels the cold start was trained on (a quick read of levels 3 / 13 / 23 after it: 52 / 25 / 5.5 %, so the large
#: scale is left out) and 64 problems x 4 samples each (the design's 128 x 4 halved for time: a level's accuracy then
#: has a standard error of at most 3 points, 256 responses)
CAL_LEVELS = [2, 3, 4, 12, 13, 14]
CAL_PROBLEMS, CAL_SAMPLES = 64, 4
#: the cold start (scripts/sft_warm_start.py): 64 training-split problems over the easy and small levels, one pass
#: (8 optimizer steps). The first trunk's 192-problem cold start left a policy too confident for S2T to silence
#: anything (results/mechanism_study/superseded/sft192/); this lighter one keeps ~0.5-0.6 nats per token
SFT_ARGS = ["--num-problems", "64", "--levels", "2", "3", "4", "12", "13", "14", "--epochs", "1", "--lr", "2e-5",
            "--batch-size", "8", "--seed", "1234"]


def run(cmd: list[str]) -> None:
    """Run ``cmd`` in the repository root (printed first); exit 1 when it fails."""
    print("+ " + shlex.join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=REPO)
    if rc != 0:
        sys.exit(f"mechanism_study.py: the command above failed (exit {rc})")


def need(path: Path, stage: str) -> None:
    if not path.exists():
        print(f"mechanism_study.py: {path.relative_to(REPO)} is missing: run `python scripts/mechanism_study.py "
              f"{stage}` first", file=sys.stderr)
        sys.exit(2)


def levels_overrides() -> list[str]:
    """The calibrated mix as config overrides (training levels and the validation benchmark)."""
    need(OUT / "gate_a.json", "calibrate")
    gate = json.loads((OUT / "gate_a.json").read_text())
    if not gate["passed"]:
        print("mechanism_study.py: gate A failed (results/mechanism_study/gate_a.json): the study stops at "
              "calibration", file=sys.stderr)
        sys.exit(2)
    levels = gate["mix"]
    return [f"data.synthetic.levels=[{','.join(map(str, levels))}]",
            f"validation.benchmarks=[{','.join(benchmarks(levels))}]"]


def benchmarks(levels: list[int]) -> list[str]:
    """The held-out word benchmarks covering ``levels`` (word_test: 2-4, word_mid: 12-14, word_hard: 22-24)."""
    return [name for name, scale in (("word_test", 0), ("word_mid", 1), ("word_hard", 2))
            if any(lv // 10 == scale for lv in levels)]


def train(config: str, name: str, extra: list[str]) -> None:
    run([PY, "train.py", "--config", config, f"trainer.output_dir={RUNS.relative_to(REPO)}",
         f"trainer.run_name={name}", "trainer.resume=auto", *levels_overrides(), *extra])


def stage_sft(_a) -> None:
    if SFT_MODEL.exists():
        print(f"{SFT_MODEL.relative_to(REPO)} exists: nothing to do")
        return
    run([PY, "scripts/sft_warm_start.py", "--out", str(SFT_MODEL.relative_to(REPO)), *SFT_ARGS])


def stage_calibrate(a) -> None:
    need(SFT_MODEL, "sft")
    if (OUT / "calibration.json").exists():  # measured once (delete it to measure again)
        print(f"{(OUT / 'calibration.json').relative_to(REPO)} exists: applying gate A to it")
    else:
        run([PY, "scripts/probe_word_task.py", "--config", JUSTRL, "--problems", str(a.problems), "--group-size",
             str(CAL_SAMPLES), "--levels", *map(str, a.levels), "--seed", "0", "--out", str(OUT / "calibration.md"),
             "--json", str(OUT / "calibration.json")])
    from stapo.study.mechanism_claims import gate_a

    rows = json.loads((OUT / "calibration.json").read_text())["rows"]
    result = gate_a(rows)
    (OUT / "gate_a.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps(result, indent=1, default=str))


def stage_probe_set(_a) -> None:
    overrides = levels_overrides()
    mix = json.loads((OUT / "gate_a.json").read_text())["mix"]
    if PROBE_SET.exists():
        print(f"{PROBE_SET.relative_to(REPO)} exists: the probe set is fixed once; nothing to do")
        return
    run([PY, "scripts/build_probe_set.py", "--config", JUSTRL, "--word-levels", *map(str, mix), "--num-prompts", "32",
         "--seed", "0", "--out", str(PROBE_SET.relative_to(REPO)), *overrides])


def stage_trunk(_a) -> None:
    need(PROBE_SET, "probe-set")
    train(JUSTRL, "trunk", [])


def stage_gate(_a) -> None:
    need(RUNS / "trunk" / "metrics.jsonl", "trunk")
    run([PY, "-m", "stapo.study.mechanism_claims", "--trunk", str((RUNS / "trunk").relative_to(REPO)),
         "--gate-only", "--out", str(OUT.relative_to(REPO))])


def stage_arms(_a) -> None:
    need(OUT / "gate_b.json", "gate")
    gate = json.loads((OUT / "gate_b.json").read_text())
    if gate["passed"]:  # paired forks from the checkpoint before the rise: same prompts and rollout seeds per pair
        k = int(gate["fork_step"])
        ckpt = (RUNS / "trunk" / "checkpoints" / f"step_{k:06d}").relative_to(REPO)
        start = [f"trainer.init_from={ckpt}"] if k > 0 else []  # step 0: the cold-start model itself
        for seed in FORK_SEEDS:  # E3's endpoint is probe/entropy: the forks skip attribution and counterfactual
            for config, name in ((JUSTRL, "justrl"), (STAPO, "stapo")):
                train(config, f"fork{seed}_{name}", [*start, f"trainer.seed={seed}",
                                                     f"trainer.total_steps={k + FORK_STEPS}",
                                                     "mechanism.attribution_every=0",
                                                     "mechanism.counterfactual_every=0"])
    elif gate["result"] == "fail":  # C3 not testable: STAPO from step 0 with the trunk's seed, paired with it
        train(STAPO, "stapo_from_start", [])
    else:  # pending (the trunk is unfinished) or not testable (the trunk logs neither series)
        print(f"mechanism_study.py: gate B is {gate['result']!r} ({gate.get('reason')}): finish the trunk and rerun "
              "the gate stage", file=sys.stderr)
        sys.exit(2)


def stage_snapshot(_a) -> None:
    """Copy every run's small files (metrics, configs, run info, fingerprint, validation results; not checkpoints,
    W&B files or rollouts: stapo.study.runner.EXPORT_EXCLUDE) to results/mechanism_study/runs/<run>/, to commit."""
    import fnmatch
    import shutil

    from stapo.study.runner import EXPORT_EXCLUDE

    need(RUNS, "trunk")
    n = 0
    for path in sorted(RUNS.rglob("*")):
        rel = path.relative_to(RUNS)
        if (len(rel.parts) < 2 or not path.is_file()
                or any(fnmatch.fnmatch(part, pat) for part in rel.parts for pat in EXPORT_EXCLUDE)):
            continue
        out = OUT / "runs" / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, out)
        n += 1
    print(f"copied {n} files to {(OUT / 'runs').relative_to(REPO)}")


def stage_verdicts(_a) -> None:
    # the live run folders when this machine has them, else the committed snapshot (a fresh clone)
    runs = (RUNS if (RUNS / "trunk" / "metrics.jsonl").exists() else OUT / "runs").relative_to(REPO)
    need(REPO / runs / "trunk" / "metrics.jsonl", "trunk")
    out = OUT.relative_to(REPO)  # relative paths: the written files name them (the commands run in the repo root)
    cmd = [PY, "-m", "stapo.study.mechanism_claims", "--trunk", str(runs / "trunk"),
           "--calibration", str(out / "calibration.json"), "--out", str(out)]
    forks = sorted(p.relative_to(REPO) for p in (REPO / runs).glob("fork*_justrl"))
    for j in forks:
        cmd += ["--fork-pairs", f"{j}:{j.with_name(j.name.replace('_justrl', '_stapo'))}"]
    if REPO / runs != RUNS and (OUT / "gate_b.json").exists():
        # the snapshot keeps no checkpoints: the trunk's saved steps as the gate stage found them (else the fork
        # checkpoint would read 0, the initial model, instead of the one the forks started from)
        steps = json.loads((OUT / "gate_b.json").read_text()).get("checkpoint_steps")
        if steps:
            cmd += ["--checkpoint-steps", *map(str, steps)]
    if (REPO / runs / "stapo_from_start").exists():
        cmd += ["--stapo-from-start", str(runs / "stapo_from_start")]
    run(cmd)
    run([PY, "scripts/plot_mechanism.py", str(runs / "trunk"), "--out", str(out / "mechanism.png")])


def stage_status(_a) -> None:
    for label, path in (("cold-start model", SFT_MODEL), ("calibration / gate A", OUT / "gate_a.json"),
                        ("probe set", PROBE_SET), ("trunk metrics", RUNS / "trunk" / "metrics.jsonl"),
                        ("gate B", OUT / "gate_b.json"), ("verdicts", OUT / "mechanism_claims.md")):
        state = "missing"
        if path.exists():
            state = "present"
            if path.name == "metrics.jsonl":
                state = f"{sum(1 for _ in path.open())} rows"
        print(f"{label:22s} {state:10s} {path.relative_to(REPO)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=("sft", "calibrate", "probe-set", "trunk", "gate", "arms", "snapshot", "verdicts",
                                      "status"))
    ap.add_argument("--levels", type=int, nargs="+", default=CAL_LEVELS, help="calibrate: the levels measured")
    ap.add_argument("--problems", type=int, default=CAL_PROBLEMS, help="calibrate: held-out problems per level")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    globals()["stage_" + a.stage.replace("-", "_")](a)


if __name__ == "__main__":
    main()
