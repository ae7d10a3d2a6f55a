"""Tests for stapo/synthetic.py: the seeded arithmetic task."""
from __future__ import annotations

import ast
import operator
import random
import re

import pytest

from stapo.data import Record
from stapo.synthetic import LEVELS, evaluate_expression, generate_arithmetic, make_problem

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
    """Record lives in stapo.records; stapo.data re-exports the same class; synthetic does not import data."""
    import subprocess
    import sys

    from stapo import data, records, synthetic

    assert data.Record is records.Record is synthetic.Record
    code = "import sys, stapo.synthetic; print('stapo.data' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
