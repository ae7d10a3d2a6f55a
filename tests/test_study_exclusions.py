"""The study report and its command line on data that must not be trusted or folders that cannot be written
(stapo/study/report.py, stapo/study/__main__.py): runs with non-finite metrics or missing steps are listed as
excluded with their reason, not silently dropped or half-read; a read-only study folder, an export into the study's
own folder and overrides after an option are one line (or accepted), not a traceback."""
from __future__ import annotations

import csv
import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from stapo.study import load_study_config, run_specs, write_report
from stapo.study.__main__ import main as study_main
from stapo.study.report import _gap_problem, _nonfinite_problem, _spans

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "study" / "tiny_test.yaml"


def _study(tmp_path: Path, *extra: str):
    cfg = load_study_config(TINY, [f"output_dir={tmp_path / 'study'}", *extra])
    return cfg, run_specs(cfg), {s.name: s for s in run_specs(cfg)}


def _row(step: int, reward: float, entropy: float | None = 1.0, **extra) -> dict:
    return {"step": step, "critic/score/mean": reward, "actor/entropy": entropy, "response_length/total_tokens": 10.0,
            "timing_s/step": 1.0, **extra}


def _write(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _final(out: Path) -> dict[tuple[str, str], dict[str, str]]:
    return {(r["metric"], r["method"]): r for r in csv.DictReader((out / "final.csv").open())}


def test_non_finite_and_gap_checks_by_hand():
    q = "s2t/quadrant/low_p_low_h/grad_norm"
    assert _nonfinite_problem([_row(1, 0.0), _row(2, 0.0)]) is None
    # NaN of a quadrant statistic is an empty quadrant (docs/metrics.md), not a fault; its ±inf is
    assert _nonfinite_problem([_row(1, 0.0, **{q: None}), _row(2, 0.0, **{q: math.nan})]) is None
    assert _nonfinite_problem([_row(1, 0.0), _row(2, 0.0, **{q: -math.inf})]) == f"{q} is -inf at step 2"
    # the first one is named, and how many there are
    assert _nonfinite_problem([_row(1, 0.0), _row(2, math.inf, entropy=None), _row(3, 0.0, entropy=None)]) == \
        "critic/score/mean is +inf at step 2 (3 non-finite values at steps 2–3)"
    # a metric the study does not read is not checked
    assert _nonfinite_problem([_row(1, 0.0, **{"actor/pg_clipfrac_lower": None})]) is None
    assert _gap_problem([_row(0, 0.0), _row(1, 0.0), _row(2, 0.0)]) is None  # step 0 (validation) is optional
    assert _gap_problem([_row(s, 0.0) for s in (1, 2, 5, 6, 8)]) == \
        "metrics.jsonl has no rows for steps 3–4, 7 of 1–8 (deleted or lost rows)"
    assert _spans([3]) == "3" and _spans([1, 2, 3, 9, 11, 12]) == "1–3, 9, 11–12"


def test_report_lists_a_diverged_run_as_excluded_and_leaves_it_out(tmp_path):
    # stapo_seed1's entropy is NaN at step 2 (its final window, W = 2 of 2 steps); before, the report kept its
    # reward (2 seeds) but silently dropped it from the entropy row (1 seed), and named it nowhere
    cfg, specs, by = _study(tmp_path)
    for name, rewards in (("grpo_seed0", (0.0, 0.0)), ("grpo_seed1", (1.0, 1.0)), ("stapo_seed0", (1.0, 2.0))):
        _write(by[name].run_dir, [_row(1, rewards[0]), _row(2, rewards[1])])
    _write(by["stapo_seed1"].run_dir, [_row(1, 1.0), _row(2, 3.0, entropy=math.nan)])
    md = write_report(cfg, specs).read_text()
    out = tmp_path / "study"
    final = _final(out)
    # stapo: seed 0 alone → reward (1 + 2) / 2 = 1.5; Δ vs grpo paired at seed 0: 1 − 0, 2 − 0 → 1.5 over 2 pairs
    assert final[("reward", "stapo")]["n_seeds"] == "1" and float(final[("reward", "stapo")]["final_mean"]) == 1.5
    assert float(final[("reward", "stapo")]["diff_mean"]) == 1.5 and final[("reward", "stapo")]["n_pairs"] == "2"
    assert final[("entropy", "stapo")]["n_seeds"] == "1" and final[("reward", "grpo")]["n_seeds"] == "2"
    assert "**Excluded: 1 run** whose data are not clean" in md
    assert "- stapo_seed1: actor/entropy is NaN at step 2" in md
    assert "| stapo_seed1 (excluded) | 2 | 2 |" in md
    assert "| reward (mean, ±1) | stapo | 1 of 2 | 1.5 |" in md  # the seeds column: fewer than planned
    curves = [r for r in csv.DictReader((out / "curves.csv").open()) if r["metric"] == "reward"
              and r["method"] == "stapo" and r["step"] == "2"]
    assert curves[0]["n_seeds"] == "1" and float(curves[0]["mean"]) == 2.0  # seed 1's 3.0 is not averaged in


def test_report_counts_logged_steps_and_excludes_a_run_with_a_gap(tmp_path):
    # rows 3–4 of stapo_seed0 deleted by hand: before, the Runs table said "6 | 6" (its last step) and its curve
    # and window skipped them without a word
    cfg, specs, by = _study(tmp_path, "overrides=[trainer.total_steps=6,trainer.save_every=1]")
    for s in specs:
        _write(s.run_dir, [_row(i, float(i)) for i in range(1, 7) if s.name != "stapo_seed0" or i not in (3, 4)])
    md = write_report(cfg, specs).read_text()
    assert "| stapo_seed0 (excluded) | 4 | 6 |" in md and "| stapo_seed1 | 6 | 6 |" in md
    assert "- stapo_seed0: metrics.jsonl has no rows for steps 3–4 of 1–6 (deleted or lost rows)" in md


def test_cli_accepts_overrides_after_an_option(tmp_path, capsys):
    cfg, specs, by = _study(tmp_path)
    for s in specs:
        _write(s.run_dir, [_row(1, 0.0), _row(2, 1.0)])
    # before: "unrecognized arguments: report.window=1" (the overrides after --report-only)
    assert study_main(["--config", str(TINY), f"output_dir={tmp_path / 'study'}", "--report-only",
                       "report.window=1"]) == 0
    assert "report: " in capsys.readouterr().out
    assert study_main(["--config", str(TINY), "--dry-run", f"output_dir={tmp_path / 'study'}", "seeds=[0]"]) == 0


def test_cli_export_into_the_studys_own_folder_is_one_line(tmp_path, capsys):
    cfg, specs, by = _study(tmp_path)
    for s in specs:
        _write(s.run_dir, [_row(1, 0.0), _row(2, 1.0)])
    study = tmp_path / "study"
    before = sorted(p.relative_to(study) for p in study.rglob("*"))
    for dest in (study, study / "runs" / "copy"):  # before: shutil.SameFileError (a traceback)
        assert study_main(["--config", str(TINY), f"output_dir={study}", "--export", str(dest)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--export {dest}: that is the study's own folder" in err
    assert sorted(p.relative_to(study) for p in study.rglob("*")) == before  # nothing written
    assert study_main(["--config", str(TINY), f"output_dir={study}", "--export", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "runs" / "stapo_seed0" / "metrics.jsonl").is_file()


_NO_WRITES = """
import resource, sys
import matplotlib.pyplot, stapo.rollout, stapo.study.report  # imported first: importing torch writes caches
from stapo.study.__main__ import main as study
from stapo.study.claims import main as claims
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # as a read-only folder or a full disk: no byte can be written
args = ["--config", sys.argv[1], "output_dir=" + sys.argv[2]]
for name, fn, extra in (("report", study, ["--report-only"]), ("claims", claims, []), ("run", study, [])):
    print(name, fn(args + extra), file=sys.stderr, flush=True)
"""


def test_a_folder_that_cannot_be_written_is_one_line_for_the_report_the_claims_and_the_runner(tmp_path):
    # a real process that may not write a byte (root ignores a read-only chmod; a file-size limit of 0 refuses
    # every write as EFBIG, as a read-only file system refuses it as EROFS). Before: a traceback from the report's
    # csv write, the claims' write_text and the runner's lock file.
    cfg, specs, by = _study(tmp_path)
    for s in specs:
        _write(s.run_dir, [_row(1, 0.0), _row(2, 1.0)])
    out = subprocess.run([sys.executable, "-c", _NO_WRITES, str(TINY), str(tmp_path / "study")], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 6 and lines[1::2] == ["report 2", "claims 2", "run 2"], out.stderr
    for prog, line in zip(("stapo.study", "stapo.study.claims", "stapo.study"), lines[::2]):
        assert line.startswith(f"{prog}: invalid value for 'output_dir': cannot write to {tmp_path / 'study'}: "
                               "[Errno 27] File too large"), line
    assert "(the study writes the report into its own folder" in lines[0]
    assert "(the study writes the claims into its own folder" in lines[2]
    assert not list((tmp_path / "study").glob("*.md")) and not (tmp_path / "study" / "run.lock").exists()
