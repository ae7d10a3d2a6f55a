"""The training console (stapo/run/console.py): progress bars on a terminal, one plain line per step in a log file,
the run folder and W&B location at start, and the end-of-run "evaluate" suggestion (stapo/train/summary.py)."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from stapo.run.console import start_lines, step_line, use_progress_bars
from stapo.train import summary
from stapo.train.summary import Commands, commands_here, eval_config_for, evaluate_suggestion, missing_benchmarks

REPO = Path(__file__).resolve().parents[1]


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        if self.closed:  # as a real file object: ValueError on a closed file
            raise ValueError("I/O operation on closed file")
        return self.tty


def test_progress_bars_follow_the_setting_or_the_terminal():
    assert use_progress_bars(True, (_Stream(False),)) is True  # forced on, even in a log file
    assert use_progress_bars(False, (_Stream(True),)) is False
    assert use_progress_bars("auto", (_Stream(True), _Stream(True))) is True
    assert use_progress_bars("auto", (_Stream(True), _Stream(False))) is False  # `2> log`: bars would go there
    assert use_progress_bars("auto", (_Stream(False), _Stream(True))) is False  # nohup / Slurm: stdout is a file
    assert use_progress_bars("auto", (object(),)) is False  # no isatty at all
    closed = _Stream(True)
    closed.close()
    assert use_progress_bars("auto", (closed,)) is False
    with pytest.raises(ValueError, match="true, false or auto"):
        use_progress_bars("yes", (_Stream(True),))


def test_step_line_by_hand():
    metrics = {"critic/score/mean": 0.125, "actor/entropy": 1.23456, "response_length/mean": 45.25,
               "actor/pg_clipfrac": 0.0, "actor/s2t/masked_frac": 0.0045, "timing_s/step": 41.26,
               "actor/num_kept_tokens": 900.0}
    assert step_line(3, 20, metrics) == ("step 3/20 | reward +0.125 | entropy 1.235 | len 45.2 | clipfrac 0.0000 | "
                                         "masked 0.0045 | 41.3 s/step")
    # GRPO masks nothing: no masked fraction; a missing key is left out; an ablation's mask is named by its key
    grpo = {k: v for k, v in metrics.items() if k != "actor/s2t/masked_frac"}
    del grpo["actor/pg_clipfrac"]
    assert step_line(1, 2, grpo) == "step 1/2 | reward +0.125 | entropy 1.235 | len 45.2 | 41.3 s/step"
    assert "masked 0.1000" in step_line(1, 2, {"actor/s2t_random/masked_frac": 0.1})
    assert "\r" not in step_line(3, 20, metrics) and "\x1b" not in step_line(3, 20, metrics)


def test_start_lines():
    assert start_lines("runs/r", mode="disabled") == [
        "run folder: runs/r", "W&B: disabled (logging.wandb_mode; metrics.jsonl holds every metric)"]
    assert start_lines("runs/r", mode="offline", project="stapo", group="cpu_smollm2-stapo",
                       wandb_dir="runs/r/wandb/offline-run-1-ab")[1] == (
        "W&B: offline, project stapo, group cpu_smollm2-stapo; upload later with: wandb sync "
        "runs/r/wandb/offline-run-1-ab")
    assert start_lines("runs/r", mode="online", project="p", group="g", wandb_dir="x",
                       url="https://wandb.ai/e/p/runs/ab")[1] == "W&B: online, project p, group g, https://wandb.ai/e/p/runs/ab"


def _eval_dir(tmp_path: Path) -> Path:
    """configs/eval with two configs: `fam` on math500 under data root `d` (which holds it), `gone` on aime24
    under a root that does not exist."""
    d = tmp_path / "configs" / "eval"
    d.mkdir(parents=True)
    (d / "fam.yaml").write_text("model: {path: tiny}\ndata: {root: d, benchmarks: [math500]}\n")
    (d / "gone.yaml").write_text("model: {path: tiny}\ndata: {root: nowhere, benchmarks: [aime24]}\n")
    (d / "paper.yaml").write_text("model: {path: tiny}\ndata: {root: d, benchmarks: [math500]}\n")
    bench = tmp_path / "d" / "benchmarks" / "math500"
    bench.mkdir(parents=True)
    (bench / "test.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    return d


def test_the_evaluate_suggestion_follows_the_family_and_the_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _eval_dir(tmp_path)
    assert missing_benchmarks(["math500", "arith_test", "aime24"], "d") == ["aime24"]  # arith_test is generated
    assert missing_benchmarks(["math500"], "nowhere") == ["math500"]
    assert missing_benchmarks(["no_such_bench"], "d") == ["no_such_bench"]
    assert eval_config_for("paper_qwen3_8b", "configs/paper/qwen3_8b_stapo.yaml") == Path("configs/eval/paper.yaml")
    assert eval_config_for("paper_qwen3_8b", "configs/qwen3_8b_stapo.yaml") is None
    # 1. the family's config, its data there: evaluate every checkpoint
    assert evaluate_suggestion("runs/r", family="fam") == (
        "python evaluate.py --config configs/eval/fam.yaml --model runs/r --all-checkpoints")
    # a study's W&B group (study-method) names no config; the family does (train.py passes the family)
    assert evaluate_suggestion("runs/r", family="fam", config_path="configs/fam_stapo.yaml").startswith(
        "python evaluate.py --config configs/eval/fam.yaml --model runs/r --all-checkpoints")
    # 2. the family's config lacks data: the training config's validation benchmarks, when theirs is there
    text = evaluate_suggestion("runs/r", family="gone", validation_benchmarks=["math500"], data_root="d")
    assert text.startswith("python evaluate.py --config configs/eval/gone.yaml --model runs/r --all-checkpoints "
                           "--benchmarks math500 --data-root d  (this config's validation benchmarks")
    # no config for the family: the validation benchmarks at evaluate.py's defaults, said so
    text = evaluate_suggestion("runs/r", family="custom", validation_benchmarks=["arith_test"], data_root="d")
    assert text.startswith("python evaluate.py --model runs/r --all-checkpoints --benchmarks arith_test --data-root d")
    assert "no configs/eval/custom.yaml" in text
    # 3. no data anywhere: the command with what is missing and how to get it, never a bare command that fails
    text = evaluate_suggestion("runs/r", family="gone", validation_benchmarks=["aime25"], data_root="nowhere")
    # (prepare_data.py writes data/ by default: --out names the config's root, where evaluate.py will look)
    assert text == ("python evaluate.py --config configs/eval/gone.yaml --model runs/r --all-checkpoints  (needs "
                    "data for aime24 under nowhere: python scripts/prepare_data.py --out nowhere, or pass --data-root "
                    "with a folder that has it, or --benchmarks with data you have)")


def test_outside_a_checkout_the_suggestions_name_the_console_scripts_and_the_shipped_configs(tmp_path, monkeypatch):
    """From a folder that is not a checkout (no evaluate.py, no scripts/): stapo-eval / stapo-summarize /
    stapo-compare, and the family's eval config found among the package's configs, written configs/eval/X.yaml
    (stapo-eval resolves that name there: stapo.tools.entry_points.resolve_config)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(summary, "_console_scripts_installed", lambda: True)  # as in a venv where stapo is installed
    here = commands_here()
    assert (here.evaluate, here.summarize, here.compare) == ("stapo-eval", "stapo-summarize", "stapo-compare")
    assert here.eval_dir == REPO / "configs" / "eval"  # this checkout is the installed package's configs
    assert evaluate_suggestion("runs/r", family="cpu_smollm2", commands=here).startswith(
        "stapo-eval --config configs/eval/cpu_smollm2.yaml --model runs/r --all-checkpoints")
    # the checkout itself: its files and relative paths (the README's commands)
    assert commands_here(REPO) == Commands(eval_dir=REPO / "configs" / "eval")
    monkeypatch.chdir(REPO)
    assert commands_here() == Commands()


def test_a_checkout_run_from_another_folder_without_console_scripts_names_its_own_files(tmp_path, monkeypatch):
    """`python /repo/train.py` from another folder in an environment without stapo's console scripts (an older
    editable install, or none): the suggestions are the checkout's files by absolute path, which run from there
    (evaluate.py resolves configs/eval/X.yaml in the checkout), not stapo-* commands that do not exist."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(summary, "_console_scripts_installed", lambda: False)
    here = commands_here()
    assert here == Commands(evaluate=f"python {REPO}/evaluate.py", summarize=f"python {REPO}/scripts/summarize_run.py",
                            compare=f"python {REPO}/scripts/compare.py",
                            prepare_data=f"python {REPO}/scripts/prepare_data.py", eval_dir=REPO / "configs" / "eval")
    assert evaluate_suggestion("runs/r", family="cpu_smollm2", commands=here).startswith(
        f"python {REPO}/evaluate.py --config configs/eval/cpu_smollm2.yaml --model runs/r --all-checkpoints")
    # the lookup itself: a script beside this Python (a venv's bin/) counts, as one on $PATH does
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    assert not summary._console_scripts_installed()
    (tmp_path / "bin").mkdir()
    for name in summary.CONSOLE_SCRIPTS:
        (tmp_path / "bin" / name).write_text("")
    assert summary._console_scripts_installed()


def test_train_py_in_a_log_file_prints_plain_step_lines(tmp_path, capsys, monkeypatch):
    """train.py with stdout / stderr captured (not terminals) and trainer.progress_bar=auto: the run folder and the
    W&B line first, one plain line per step, no bar (no carriage return), and the end-of-run suggestion with
    --all-checkpoints from the family (tiny_test → configs/eval/tiny_test.yaml, whose data is ../shared/data)."""
    import train

    monkeypatch.chdir(REPO)
    assert not sys.stdout.isatty()
    rc = train.main(["--config", "configs/tiny_test.yaml", f"trainer.output_dir={tmp_path}", "trainer.run_name=r",
                     "trainer.progress_bar=auto", "logging.group=some-study-stapo"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"run folder: {tmp_path / 'r'}"
    assert lines[1] == "W&B: disabled (logging.wandb_mode; metrics.jsonl holds every metric)"
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in steps] == ["step 1/2", "step 2/2"]
    assert all(" | reward " in s and " | entropy " in s and s.endswith(" s/step") for s in steps)
    assert "\r" not in out + err and "train:" not in err  # no tqdm bar ("train: 50%|...")
    suggestion = next(line for line in lines if line.startswith("  evaluate "))
    data_there = (REPO.parent / "shared" / "data" / "benchmarks" / "aime24").is_dir()
    if data_there:  # the family's config, not configs/eval/some-study-stapo.yaml (the group)
        assert suggestion.endswith(f"python evaluate.py --config configs/eval/tiny_test.yaml --model "
                                   f"{tmp_path / 'r'} --all-checkpoints")
    else:
        assert "--all-checkpoints" in suggestion and "(" in suggestion
