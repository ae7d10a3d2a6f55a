"""Tests for stapo/tasks/synthetic.py: the seeded arithmetic task."""
from __future__ import annotations

import ast
import operator
import random
import re

import pytest

from stapo.tasks.data import Record
from stapo.tasks.synthetic import LEVELS, evaluate_expression, generate_arithmetic, make_problem

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _oracle(expression: str) -> int:
    """Independent check: evaluate the printed expression with Python's own parser (no eval)."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise AssertionError(f"unexpected node {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval"))


def _expression(problem: str) -> str:
    match = re.fullmatch(r"What is (.+)\?", problem)
    assert match, problem
    return match.group(1)


def test_evaluate_expression_by_hand():
    assert evaluate_expression([2, 3, 4], ["+", "*"]) == 14  # 2 + 12
    assert evaluate_expression([10, 2, 3], ["-", "*"]) == 4  # 10 - 6
    assert evaluate_expression([5, 7, 2], ["*", "-"]) == 33  # 35 - 2
    assert evaluate_expression([8], []) == 8
    with pytest.raises(ValueError):
        evaluate_expression([1, 2], [])
    with pytest.raises(ValueError):
        evaluate_expression([1, 2], ["/"])


def test_answers_match_an_independent_oracle_at_every_level():
    for level in LEVELS:
        for record in generate_arithmetic(n=100, seed=level, levels=[level]):
            assert record.answer == str(_oracle(_expression(record.problem))), record


def test_easy_levels_are_easy():
    # Level 1: two 1-digit numbers added; levels 1-3: two operands, answer >= 0.
    for record in generate_arithmetic(n=200, seed=1, levels=[1]):
        a, b = re.fullmatch(r"What is (\d) \+ (\d)\?", record.problem).groups()
        assert record.answer == str(int(a) + int(b))
    for record in generate_arithmetic(n=300, seed=2, levels=[1, 2, 3]):
        assert len(re.findall(r"\d+", record.problem)) == 2
        assert int(record.answer) >= 0


def test_level_shape_grows():
    rng = random.Random(0)
    problem6, _ = make_problem(rng, 6)
    assert len(re.findall(r"\d+", problem6)) == 4  # 4 operands
    assert all(100 <= int(x) <= 9999 for x in re.findall(r"\d+", problem6))  # 3-4 digits


def test_deterministic_and_round_robin():
    a = generate_arithmetic(n=8, seed=7, levels=(1, 2))
    b = generate_arithmetic(n=8, seed=7, levels=(1, 2))
    c = generate_arithmetic(n=8, seed=8, levels=(1, 2))
    assert a == b and a != c
    assert [r.id for r in a[:3]] == ["synthetic_arithmetic/L1/0", "synthetic_arithmetic/L2/1", "synthetic_arithmetic/L1/2"]
    assert all(isinstance(r, Record) and r.source == "synthetic_arithmetic" for r in a)
    assert len({r.id for r in generate_arithmetic(n=500)}) == 500


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown arithmetic levels"):
        generate_arithmetic(n=1, levels=[9])
    with pytest.raises(ValueError, match="must not be empty"):
        generate_arithmetic(n=1, levels=[])
    with pytest.raises(ValueError, match="non-negative"):
        generate_arithmetic(n=-1)
    assert generate_arithmetic(n=0) == []


def test_record_has_one_home_and_no_import_cycle():
    """Record lives in stapo.tasks.records; stapo.tasks.data re-exports the same class; synthetic does not import
    data."""
    import subprocess
    import sys

    from stapo.tasks import data, records, synthetic

    assert data.Record is records.Record is synthetic.Record
    code = "import sys, stapo.tasks.synthetic; print('stapo.tasks.data' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


# --- the held-out split (issue 17) --------------------------------------------------------------------------
def test_heldout_split_is_a_fixed_tenth_by_text():
    from stapo.tasks.synthetic import HELDOUT_MODULUS, is_heldout

    # by the definition: sha256(text)[:8 bytes] as a big-endian int, mod 10 == 0
    import hashlib

    text = "What is 7 + 8?"
    expected = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % HELDOUT_MODULUS == 0
    assert is_heldout(text) is expected
    # every level-1 problem enumerated: a tenth is held out, give or take (81 problems → 8 here)
    level1 = [f"What is {a} + {b}?" for a in range(1, 10) for b in range(1, 10)]
    assert 3 <= sum(map(is_heldout, level1)) <= 15


def test_train_and_test_splits_are_disjoint_and_all_is_unchanged():
    from stapo.tasks.synthetic import is_heldout

    train = generate_arithmetic(600, seed=3, levels=(1, 2), split="train")
    test = generate_arithmetic(200, seed=4, levels=(2,), split="test")
    assert not any(is_heldout(r.problem) for r in train)
    assert all(is_heldout(r.problem) for r in test)
    assert not {r.problem for r in train} & {r.problem for r in test}
    assert len({r.problem for r in test}) == 200  # the test split never repeats a problem
    assert all(r.id.startswith("synthetic_arithmetic/test/L2/") for r in test)
    # split="all" is the stream of earlier versions: the default draws are untouched
    assert generate_arithmetic(50, seed=3, levels=(1, 2)) == generate_arithmetic(50, seed=3, levels=(1, 2), split="all")
    # and "all" does contain held-out problems (so training on it would see some test problems)
    assert any(is_heldout(r.problem) for r in generate_arithmetic(600, seed=3, levels=(1, 2)))


def test_test_split_larger_than_a_level_fails_with_a_message():
    with pytest.raises(ValueError, match="distinct held-out problems"):
        generate_arithmetic(50, seed=0, levels=(1,), split="test")  # level 1 has ~8 held-out problems
    with pytest.raises(ValueError, match="unknown split"):
        generate_arithmetic(5, split="dev")


def test_generated_benchmarks():
    from stapo.tasks.synthetic import GENERATED_BENCHMARKS, generated_benchmark, is_heldout

    test, hard = generated_benchmark("arith_test"), generated_benchmark("arith_hard")
    assert len(test) == GENERATED_BENCHMARKS["arith_test"].num_problems
    assert test[0].id == "arith_test/0" and test[0].source == "arith_test"
    assert all(is_heldout(r.problem) for r in test + hard)
    assert not {r.problem for r in test} & {r.problem for r in hard}  # seeds and levels differ
    for rec in test[:50] + hard[:50]:
        assert int(rec.answer) == _oracle(_expression(rec.problem))
    assert generated_benchmark("arith_test") == test  # deterministic
    with pytest.raises(KeyError, match="known: arith_test"):
        generated_benchmark("arith_tset")


def test_could_be_level_by_hand():
    from stapo.tasks.synthetic import could_be_level

    assert could_be_level("What is 88 - 71?", 2) and could_be_level("What is 88 - 71?", 3)
    assert not could_be_level("What is 71 - 88?", 2)  # level 2 never prints a negative difference
    assert could_be_level("What is 3 + 4?", 1) and could_be_level("What is 3 + 4?", 2)
    assert not could_be_level("What is 12 * 45?", 2) and could_be_level("What is 12 * 45?", 3)
    assert not could_be_level("What is 1 + 2 - 3?", 2) and could_be_level("What is 1 + 2 - 3?", 4)
    # every problem a level draws could be drawn by it
    rng = random.Random(0)
    for level in LEVELS:
        assert all(could_be_level(make_problem(rng, level)[0], level) for _ in range(100))


def test_arith_hard_has_no_training_level_problem():
    from stapo.tasks.synthetic import could_be_level, generated_benchmark

    hard = generated_benchmark("arith_hard")
    assert not any(could_be_level(r.problem, lv) for r in hard for lv in (1, 2))
