"""Tests for stapo/tasks/grader.py: verdicts on the golden file, the hard timeout, threads, worker death."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from stapo.tasks.grader import GradeStatus, GraderError, GraderStats, MathGrader, grade_answer

GOLDEN = Path(__file__).parent / "golden" / "reward_cases.json"
CASES = json.loads(GOLDEN.read_text(encoding="utf-8"))
TIMEOUT_S = 3.0
POWER_TOWER = "The answer is \\boxed{9^{9^{9^{9^{9}}}}}"


@pytest.fixture(scope="module")
def grader():
    g = MathGrader(num_workers=2, timeout_s=TIMEOUT_S)
    yield g
    g.close()


def test_golden_verdicts(grader):
    t0 = time.monotonic()
    batch = grader.grade([c["response"] for c in CASES], [c["gold"] for c in CASES])
    elapsed = time.monotonic() - t0
    for case, result in zip(CASES, batch.results):
        assert result.correct is case["grader_correct"], (case["name"], result, case["why"])
    # The power tower is killed at the timeout: a counted timeout, not a silent "wrong".
    tower = batch.results[[c["name"] for c in CASES].index("power_tower")]
    assert tower.status is GradeStatus.TIMEOUT
    assert TIMEOUT_S <= tower.seconds < TIMEOUT_S + 2.0
    # Counts (from the golden file's expected verdicts): 1 timeout, every status accounted for.
    stats = batch.stats
    assert stats.n == len(CASES)
    assert stats.correct == sum(c["grader_correct"] for c in CASES)
    assert stats.timeouts == 1 and stats.errors == 0 and stats.worker_restarts == 1
    assert stats.correct + stats.incorrect + stats.no_answer + stats.timeouts + stats.errors == stats.n
    # Bounded: the other answers take well under a second each; with 2 workers the whole file
    # must finish within the timeout plus a generous margin.
    assert elapsed < TIMEOUT_S + 15


def test_statuses_for_simple_cases(grader):
    batch = grader.grade(["\\boxed{4}", "\\boxed{5}", "", "\\boxed{}"], ["4", "4", "4", "4"])
    assert [r.status for r in batch.results] == [
        GradeStatus.CORRECT,
        GradeStatus.INCORRECT,
        GradeStatus.NO_ANSWER,
        GradeStatus.NO_ANSWER,
    ]
    assert [r.extracted for r in batch.results] == ["4", "5", None, ""]
    assert batch.correct == [True, False, False, False]
    assert grader.grade([], []).results == []


def test_called_from_worker_thread_respects_timeout(grader):
    out: dict = {}

    def work():
        try:
            t0 = time.monotonic()
            out["batch"] = grader.grade([POWER_TOWER, "so \\boxed{0.5}"], ["5", "\\frac{1}{2}"])
            out["elapsed"] = time.monotonic() - t0
        except BaseException as exc:  # pragma: no cover - surfaced by the assert below
            out["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert "error" not in out, out.get("error")
    results = out["batch"].results
    assert results[0].status is GradeStatus.TIMEOUT
    assert results[1].status is GradeStatus.CORRECT
    assert out["elapsed"] < TIMEOUT_S + 5


def test_math_verify_default_timeout_fails_off_main_thread():
    # The reason for the pool (docs/method.md#pitfalls): math-verify's signal-based timeout raises in a thread.
    from math_verify import parse

    caught: list = []

    def work():
        try:
            parse("\\boxed{1}")
        except ValueError as exc:
            caught.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=30)
    assert len(caught) == 1 and "thread" in str(caught[0])


def test_pool_is_reused_after_a_timeout(grader):
    pids_before = grader.worker_pids()
    batch = grader.grade([POWER_TOWER], ["5"])
    assert batch.results[0].status is GradeStatus.TIMEOUT
    assert batch.stats.worker_restarts == 1
    pids_after = grader.worker_pids()
    # exactly one worker was replaced
    assert sum(a != b for a, b in zip(pids_before, pids_after)) == 1
    # and the pool still grades (the replacement starts in the background)
    again = grader.grade(["\\boxed{2}"] * 4, ["2"] * 4)
    assert again.correct == [True] * 4


def test_worker_death_is_counted_as_error(grader):
    # Kill the worker that is busy with the power tower; the verdict must be an error, counted.
    killer_done = threading.Event()

    def kill_busy_worker():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            busy = [w for w in grader._workers if w.task is not None]  # test-only peek
            if busy:
                time.sleep(0.3)  # let it get stuck in the power tower
                os.kill(busy[0].process.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        killer_done.set()

    threading.Thread(target=kill_busy_worker).start()
    batch = grader.grade([POWER_TOWER], ["5"])
    killer_done.wait(5)
    result = batch.results[0]
    assert result.status is GradeStatus.ERROR
    assert result.error.startswith("WorkerDied")
    assert batch.stats.errors == 1 and batch.stats.error_types == {"WorkerDied": 1}
    assert grader.grade(["\\boxed{3}"], ["3"]).correct == [True]


def test_idle_worker_killed_externally_is_replaced(grader):
    grader.wait_ready()  # both workers idle and ready
    os.kill(grader.worker_pids()[0], signal.SIGKILL)
    time.sleep(0.2)
    batch = grader.grade(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"], ["1", "2", "3"])
    assert batch.correct == [True, True, True]
    assert batch.stats.errors == 0  # the task was re-sent to a live worker, not lost


def test_worker_killed_while_starting_is_respawned(grader):
    grader.wait_ready()
    assert grader.grade([POWER_TOWER], ["5"]).results[0].status is GradeStatus.TIMEOUT
    starting = [w for w in grader._workers if not w.ready]  # the replacement, still importing sympy
    assert len(starting) == 1
    os.kill(starting[0].process.pid, signal.SIGKILL)
    batch = grader.grade(["\\boxed{1}"] * 4, ["1"] * 4)
    assert batch.correct == [True] * 4
    grader.wait_ready()
    assert all(w.process.is_alive() for w in grader._workers)


def test_input_validation(grader):
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        grader.grade(["a", "b"], ["1"])
    with pytest.raises(TypeError, match=r"responses\[1\]"):
        grader.grade(["a", 5], ["1", "2"])
    with pytest.raises(TypeError, match=r"golds\[0\]"):
        grader.grade(["a"], [None])
    with pytest.raises(ValueError, match="num_workers"):
        MathGrader(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        MathGrader(timeout_s=0)


def test_close_stops_workers():
    g = MathGrader(num_workers=1, timeout_s=2.0)
    assert g.grade_one("\\boxed{7}", "7").correct
    processes = [w.process for w in g._workers]
    with g:
        pass  # __exit__ closes
    assert g.closed
    assert all(not p.is_alive() for p in processes)
    with pytest.raises(GraderError, match="closed"):
        g.grade(["\\boxed{7}"], ["7"])
    g.close()  # idempotent


def test_grade_answer_counts_math_verify_exceptions(monkeypatch):
    # An exception inside math-verify's verify() becomes an "error" verdict with the exception name.
    import math_verify

    def boom(*args, **kwargs):
        raise RuntimeError("sympy blew up")

    monkeypatch.setattr(math_verify, "verify", boom)
    result = grade_answer("\\boxed{4}", "4")
    assert result.status is GradeStatus.ERROR and not result.correct
    assert result.error == "RuntimeError: sympy blew up"
    stats = GraderStats()
    stats.add(result)
    assert (stats.n, stats.errors, stats.error_types) == (1, 1, {"RuntimeError": 1})


def test_unparseable_gold_is_an_error_not_a_wrong_answer():
    result = grade_answer("\\boxed{4}", "")
    assert result.status is GradeStatus.ERROR
    assert result.error.startswith("GoldUnparseable")
    with pytest.raises(TypeError):
        grade_answer(None, "4")


def test_stats_merge_and_dict():
    a = GraderStats(n=3, correct=2, incorrect=1, seconds=1.0)
    b = GraderStats(n=2, correct=0, timeouts=1, errors=1, worker_restarts=1, seconds=0.5, error_types={"X": 1})
    a.merge(b)
    assert (a.n, a.correct, a.incorrect, a.timeouts, a.errors, a.worker_restarts) == (5, 2, 1, 1, 1, 1)
    assert a.seconds == 1.5 and a.error_types == {"X": 1}
    d = a.as_dict()
    assert d["grader/accuracy"] == 2 / 5 and d["grader/error_type/X"] == 1


def test_unevaluated_expression_rule_by_hand():
    from stapo.tasks.grader import is_unevaluated_expression as unevaluated

    # an operator between two operands: not a value
    for answer in ("9 + 5.", "9+5", "3\\times 4", "12 - 7", "(2)+(3)", "8 / 2"):
        assert unevaluated(answer), answer
    # values (a leading minus, a fraction, a power, thousands separators) and an equation's right side
    for answer in ("14", "-3", "\\frac{1}{2}", "2^{10}", "1,000", "9 + 5 = 14", "", None):
        assert not unevaluated(answer), answer


def test_require_value_grades_an_echo_incorrect():
    # math-verify evaluates "9 + 5" to 14: the plain grader pays the echo, require_value does not
    responses = ["So 9 + 5.", "9 + 5 = 14", "\\boxed{9+5}", "The answer is 14.", "15"]
    golds = ["14"] * 5
    with MathGrader(num_workers=1, timeout_s=TIMEOUT_S) as plain:
        assert plain.grade(responses, golds).correct == [True, True, True, True, False]
    with MathGrader(num_workers=1, timeout_s=TIMEOUT_S, require_value=True) as strict:
        batch = strict.grade(responses, golds)
    assert batch.correct == [False, True, False, True, False]
    assert [r.unevaluated for r in batch.results] == [True, False, True, False, False]
    assert batch.results[0].status is GradeStatus.INCORRECT and batch.results[0].extracted == "9 + 5."
    # counts: 2 correct, 3 incorrect of which 2 unevaluated; the statuses still sum to n
    s = batch.stats
    assert (s.n, s.correct, s.incorrect, s.unevaluated) == (5, 2, 3, 2)
    assert s.as_dict()["grader/unevaluated"] == 2
