"""Seeded synthetic integer-arithmetic task: the embedded default training set for CPU runs.

Problems look like ``"What is 37 + 45?"`` with exact integer answers (``"82"``), in the same
:class:`~stapo.records.Record` type as the real data, so the same prompts, strict-box reward and grader
apply.  Difficulty grows with the digit count of the operands and the number of operands:

====== ============= ======== =========== ==================
level  digits         operands operators   negative results
====== ============= ======== =========== ==================
1      1              2        ``+``       no
2      1-2            2        ``+ -``     no
3      2              2        ``+ - *``   no
4      1-2            3        ``+ -``     yes
5      2-3            3        ``+ - *``   yes
6      3-4            4        ``+ - *``   yes
====== ============= ======== =========== ==================

Levels 1-2 are deliberately trivial (single-digit sums, two-digit sums/differences) so that a
small model such as SmolLM2-135M-Instruct gets some right; the default mix (levels 1-4) also gives
it problems it gets wrong, so GRPO groups have non-zero reward variance.  ``*`` binds tighter than
``+``/``-`` (the answer is the value of the printed expression under the usual precedence).

Not from the paper: a CPU-scale stand-in for DAPO-Math-17k (docs/method.md#cpu-recipe asks to scale the recipe
down with configs, not to change the algorithm).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from stapo.records import Record

__all__ = [
    "SOURCE",
    "ArithmeticLevel",
    "LEVELS",
    "DEFAULT_LEVELS",
    "DEFAULT_NUM_PROBLEMS",
    "DEFAULT_SEED",
    "evaluate_expression",
    "make_problem",
    "generate_arithmetic",
]

SOURCE = "synthetic_arithmetic"


@dataclass(frozen=True)
class ArithmeticLevel:
    """One difficulty level.

    Attributes:
        level: level number (1 = easiest).
        min_digits / max_digits: each operand has a digit count drawn uniformly from this range
            (1 digit = 1..9; d >= 2 digits = 10^(d-1)..10^d - 1).
        operands: number of operands (>= 2).
        ops: operators to draw from (subset of ``"+"``, ``"-"``, ``"*"``).
        allow_negative: if ``False`` the level only has 2 operands and a subtraction puts the
            larger operand first, so the answer is >= 0.
    """

    level: int
    min_digits: int
    max_digits: int
    operands: int
    ops: tuple[str, ...]
    allow_negative: bool


LEVELS: dict[int, ArithmeticLevel] = {
    1: ArithmeticLevel(1, 1, 1, 2, ("+",), False),
    2: ArithmeticLevel(2, 1, 2, 2, ("+", "-"), False),
    3: ArithmeticLevel(3, 2, 2, 2, ("+", "-", "*"), False),
    4: ArithmeticLevel(4, 1, 2, 3, ("+", "-"), True),
    5: ArithmeticLevel(5, 2, 3, 3, ("+", "-", "*"), True),
    6: ArithmeticLevel(6, 3, 4, 4, ("+", "-", "*"), True),
}
DEFAULT_LEVELS: tuple[int, ...] = (1, 2, 3, 4)
DEFAULT_NUM_PROBLEMS = 2048
DEFAULT_SEED = 0


def evaluate_expression(numbers: Sequence[int], ops: Sequence[str]) -> int:
    """Exact value of ``numbers[0] ops[0] numbers[1] ops[1] ...`` with ``*`` before ``+``/``-``.

    Args:
        numbers: k >= 1 integers.
        ops: k - 1 operators from ``"+"``, ``"-"``, ``"*"``.

    Returns:
        The integer value.

    Raises:
        ValueError: wrong lengths or an unknown operator.
    """
    if len(numbers) < 1 or len(ops) != len(numbers) - 1:
        raise ValueError(f"need k numbers and k-1 operators, got {len(numbers)} and {len(ops)}")
    terms = [int(numbers[0])]
    signs = [1]
    for op, value in zip(ops, numbers[1:]):
        if op == "*":
            terms[-1] *= int(value)
        elif op in ("+", "-"):
            terms.append(int(value))
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operator {op!r}")
    return sum(sign * term for sign, term in zip(signs, terms))


def _operand(rng: random.Random, spec: ArithmeticLevel) -> int:
    digits = rng.randint(spec.min_digits, spec.max_digits)
    low = 1 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_problem(rng: random.Random, level: int) -> tuple[str, int]:
    """Draw one problem of ``level`` from ``rng``.

    Returns:
        ``(problem text, exact integer answer)``, e.g. ``("What is 37 + 45?", 82)``.

    Raises:
        ValueError: unknown level.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; known: {sorted(LEVELS)}")
    spec = LEVELS[level]
    numbers = [_operand(rng, spec) for _ in range(spec.operands)]
    ops = [rng.choice(spec.ops) for _ in range(spec.operands - 1)]
    if not spec.allow_negative and spec.operands == 2 and ops[0] == "-" and numbers[0] < numbers[1]:
        numbers.reverse()
    expression = " ".join(
        [str(numbers[0])] + [f"{op} {value}" for op, value in zip(ops, numbers[1:])]
    )
    return f"What is {expression}?", evaluate_expression(numbers, ops)


def generate_arithmetic(
    n: int = DEFAULT_NUM_PROBLEMS,
    seed: int = DEFAULT_SEED,
    levels: Sequence[int] = DEFAULT_LEVELS,
) -> list[Record]:
    """Generate ``n`` arithmetic problems, levels assigned round-robin (record i has level
    ``levels[i % len(levels)]``), deterministic for a given ``(n, seed, levels)``.

    Args:
        n: number of problems (>= 0).
        seed: RNG seed.
        levels: levels to use (keys of :data:`LEVELS`).

    Returns:
        ``list[Record]`` with ``id = "synthetic_arithmetic/L<level>/<i>"``, ``answer = str(int)``,
        ``source = "synthetic_arithmetic"``.

    Raises:
        ValueError: ``n < 0``, empty ``levels`` or an unknown level.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    levels = tuple(levels)
    if not levels:
        raise ValueError("levels must not be empty")
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        raise ValueError(f"unknown arithmetic levels {unknown}; known: {sorted(LEVELS)}")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        level = levels[i % len(levels)]
        problem, answer = make_problem(rng, level)
        records.append(Record(id=f"{SOURCE}/L{level}/{i}", problem=problem, answer=str(answer), source=SOURCE))
    return records
