"""Torn JSONL files: a last line cut by a kill mid-write or a full disk is repaired on resume (counted, said in one
line); a damaged complete line is never dropped silently (one line naming the file and line). The training run's
metrics.jsonl / tables.jsonl (stapo.run.tracking) and the evaluation's generation store follow the same rule."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.evaluation.store import GenerationStore  # noqa: E402
from stapo.run.tracking import CorruptJsonlError, Tracker, read_jsonl_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def tear_last_line(path: Path) -> int:
    """Cut the last line in the middle (no newline left); returns the bytes left of it."""
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    keep = (len(data) - start) // 2
    path.write_bytes(data[:start + keep])
    return keep


# --- the tracker's files --------------------------------------------------------------------------------
def test_truncate_after_cuts_a_torn_last_line_and_says_so(tmp_path, capsys):
    tracker = Tracker(tmp_path, {}, mode="disabled")
    for step in (1, 2, 3):
        tracker.log(step, {"x": float(step)})
        tracker.log_table(step, "t", ["a"], [[step]])
    torn = tear_last_line(tracker.metrics_path)
    tracker.truncate_after(2)
    assert steps(tracker.metrics_path) == [1, 2] and steps(tracker.tables_path) == [1, 2]
    assert tracker.torn_bytes == torn
    assert capsys.readouterr().err == (f"{tracker.metrics_path}: cut {torn} bytes of a torn last line "
                                       f"(an interrupted write)\n")
    tracker.log(3, {"x": 3.0})  # appends after a whole line
    assert steps(tracker.metrics_path) == [1, 2, 3]


def test_a_complete_row_missing_only_its_newline_is_kept(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')
    assert read_jsonl_rows(path) == ([{"step": 1}, {"step": 2}], 0)
    tracker = Tracker(tmp_path, {}, mode="disabled")
    tracker.truncate_after(5)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n' and tracker.torn_bytes == 0
    assert capsys.readouterr().err == ""
    path.write_text("\x00" * 40)  # a whole file of zeros (size written, data not: a crash of the file system)
    assert read_jsonl_rows(path) == ([], 40)


@pytest.mark.parametrize("bad", ["not json", '{"no_step": 1}', "[1, 2]", '{"step": "3"}'])
def test_a_damaged_complete_line_is_refused_naming_file_and_line(tmp_path, bad):
    path = tmp_path / "metrics.jsonl"
    before = f'{{"step": 1}}\n{bad}\n{{"step": 2}}\n'
    path.write_text(before)
    tracker = Tracker(tmp_path, {}, mode="disabled")
    with pytest.raises(CorruptJsonlError) as err:
        tracker.truncate_after(1)
    message = str(err.value)
    assert message.startswith(f"{path}: line 2 is not a valid row (") and "\n" not in message
    assert message.endswith("is not a torn last line, so it is not dropped: delete that line (or move the file "
                            "away) and rerun")
    assert path.read_text() == before  # left as it was
    path.write_text(f'{{"step": 1}}\n{bad}\n')  # the LAST line, but complete: damaged, not torn
    with pytest.raises(CorruptJsonlError, match="line 2"):
        tracker.truncate_after(1)


def test_step_below_zero_empties_the_files_unread(tmp_path):
    """The evaluation's W&B summary (stapo.evaluation.report.log_wandb) replaces its rows: truncate_after(-1)."""
    (tmp_path / "metrics.jsonl").write_text('garbage\n{"step": 0}\n{"st')
    Tracker(tmp_path, {}, mode="disabled").truncate_after(-1)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


# --- a training run: tear its last line, --resume ---------------------------------------------------------
def train(tmp_path: Path, capsys, *extra: str) -> tuple[int, str]:
    sys.path.insert(0, str(REPO))
    import train as train_py

    rc = train_py.main(["--config", str(REPO / "configs/tiny_test.yaml"), f"trainer.output_dir={tmp_path}",
                        "trainer.run_name=r", "trainer.save_every=2", *extra])
    return rc, capsys.readouterr().err


def test_resume_after_a_torn_last_line_gives_one_row_per_step(tmp_path, capsys):
    run = tmp_path / "r"
    rc, err = train(tmp_path, capsys, "trainer.total_steps=3")
    assert rc == 0, err
    # two tables a step (trainer.log_examples_every=1): s2t/examples and completions
    assert steps(run / "metrics.jsonl") == [1, 2, 3] and steps(run / "tables.jsonl") == [1, 1, 2, 2, 3, 3]
    # A kill while step 3's rows were written: step 3's checkpoint never happened and its rows are torn.
    shutil.rmtree(run / "checkpoints" / "step_000003")
    tear_last_line(run / "metrics.jsonl")
    tear_last_line(run / "tables.jsonl")
    rc, err = train(tmp_path, capsys, "trainer.total_steps=4", "--resume")
    assert rc == 0, err
    assert steps(run / "metrics.jsonl") == [1, 2, 3, 4] and steps(run / "tables.jsonl") == [1, 1, 2, 2, 3, 3, 4, 4]
    cut = [line for line in err.splitlines() if "torn last line" in line]
    assert len(cut) == 2 and cut[0].startswith(f"{run / 'metrics.jsonl'}: cut ") \
        and cut[1].startswith(f"{run / 'tables.jsonl'}: cut ")

    # a damaged line in the middle: refused in one line naming the file and the line, nothing changed
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][:20] + "\n"
    (run / "metrics.jsonl").write_text("".join(lines))
    changes = (run / "config_changes.jsonl").read_text()  # the 3 → 4 change of the resume above
    rc, err = train(tmp_path, capsys, "trainer.total_steps=5", "--resume")
    assert rc == 2 and "Traceback" not in err
    # one error line, found before the resume is planned (no config change is announced or recorded)
    (error,) = err.splitlines()
    assert error.startswith(f"train.py: {run / 'metrics.jsonl'}: line 2 is not a valid row (")
    assert (run / "config_changes.jsonl").read_text() == changes
    assert (run / "metrics.jsonl").read_text() == "".join(lines)
    assert not (run / "run.lock").exists()  # the lock is released on the error too


# --- the evaluation's store: the same rule ------------------------------------------------------------------
def test_the_generation_store_cuts_a_torn_tail_the_same_way(tmp_path, capsys):
    path = tmp_path / "g.jsonl"
    GenerationStore(path).append([{"problem_id": "p", "sample": j} for j in range(3)])
    torn = tear_last_line(path)
    store = GenerationStore(path)
    assert len(store) == 2 and store.torn_bytes == torn
    assert capsys.readouterr().err == f"{path}: cut {torn} bytes of a torn last line (an interrupted write)\n"
