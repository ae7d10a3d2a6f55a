"""Seeded synthetic integer-arithmetic task: the embedded default training set for CPU runs.

Problems look like ``"What is 37 + 45?"`` with exact integer answers (``"82"``), in the same
:class:`~stapo.tasks.records.Record` type as the real data, so the same prompts, strict-box reward and grader
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

Held-out split: a problem is *held out* when the SHA-256 of its text falls in a fixed tenth of the hash range
(:func:`is_heldout`), whatever the seed, count or levels that drew it. ``generate_arithmetic(split="train")`` never
returns a held-out problem, ``split="test"`` returns only held-out ones (each at most once), so a policy trained on
``split="train"`` is evaluated on problems it has never seen. The generated benchmarks :data:`GENERATED_BENCHMARKS`
(``arith_test``: level 2, the training task's harder half; ``arith_hard``: levels 3-4, multiplication and three
operands, never trained on) are built from the held-out split and are evaluated like the file benchmarks
(``evaluate.py --benchmarks arith_test``, ``validation.benchmarks: [arith_test]``). The word-problem task
(:mod:`stapo.tasks.word_problems`) registers its held-out benchmarks here too (``word_test``, ``word_mid``,
``word_hard``).

Not from the paper: a CPU-scale stand-in for DAPO-Math-17k (docs/method.md#cpu-recipe asks to scale the recipe
down with configs, not to change the algorithm).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, Sequence

from stapo.tasks.records import Record
from stapo.tasks.splits import HELDOUT_MODULUS, is_heldout  # re-exported: the split of every generated task
from stapo.tasks.word_problems import generate_word_problems

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
    "HELDOUT_MODULUS",
    "is_heldout",
    "GeneratedBenchmark",
    "GENERATED_BENCHMARKS",
    "generated_benchmark",
    "could_be_level",
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
Split = Literal["all", "train", "test"]
SPLITS: tuple[str, ...] = ("all", "train", "test")


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
    split: Split = "all",
) -> list[Record]:
    """Generate ``n`` arithmetic problems, levels assigned round-robin (record i has level
    ``levels[i % len(levels)]``), deterministic for a given ``(n, seed, levels, split)``.

    Args:
        n: number of problems (>= 0).
        seed: RNG seed.
        levels: levels to use (keys of :data:`LEVELS`).
        split: ``"all"`` (every draw; the stream of earlier versions), ``"train"`` (draws that are held out are
            redrawn, :func:`is_heldout`) or ``"test"`` (only held-out problems, each at most once).

    Returns:
        ``list[Record]`` with ``id = "synthetic_arithmetic/L<level>/<i>"`` (``.../test/L<level>/<i>`` for the
        test split), ``answer = str(int)``, ``source = "synthetic_arithmetic"``.

    Raises:
        ValueError: ``n < 0``, empty ``levels``, an unknown level or split, or a test split larger than a level's
            held-out problems (level 1 has about 8).
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    levels = tuple(levels)
    if not levels:
        raise ValueError("levels must not be empty")
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        raise ValueError(f"unknown arithmetic levels {unknown}; known: {sorted(LEVELS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    rng = random.Random(seed)
    records = []
    seen: set[str] = set()
    for i in range(n):
        level = levels[i % len(levels)]
        for _ in range(100_000):  # a held-out draw is 1 in 10; a new test problem of level >= 2 is found fast
            problem, answer = make_problem(rng, level)
            if split == "all" or (split == "train" and not is_heldout(problem)):
                break
            if split == "test" and is_heldout(problem) and problem not in seen:
                seen.add(problem)
                break
        else:
            raise ValueError(f"cannot draw {n} distinct held-out problems of levels {list(levels)} "
                             f"(level {level} ran out after {i}); use fewer problems or higher levels")
        rid = f"{SOURCE}/test/L{level}/{i}" if split == "test" else f"{SOURCE}/L{level}/{i}"
        records.append(Record(id=rid, problem=problem, answer=str(answer), source=SOURCE))
    return records


@dataclass(frozen=True)
class GeneratedBenchmark:
    """A benchmark drawn from the held-out split (``generate_arithmetic(num_problems, seed, levels, "test")``, or
    :func:`stapo.tasks.word_problems.generate_word_problems` for ``task="word"``).

    Attributes:
        name: the benchmark's name in evaluation and validation configs.
        levels / num_problems / seed: what :func:`generate_arithmetic` draws.
        samples: the default N per problem (avg@N).
        description: one line for reports and docs.
        exclude_levels: problems another level could also produce are skipped (:func:`could_be_level`: a level-3
            ``88 - 71`` is also a level-2 problem, so it is not "harder"; arithmetic only).
        task: ``"arithmetic"`` (:data:`LEVELS`) or ``"word"`` (:data:`stapo.tasks.word_problems.WORD_LEVELS`).
    """

    name: str
    levels: tuple[int, ...]
    num_problems: int
    seed: int
    samples: int
    description: str
    exclude_levels: tuple[int, ...] = ()
    task: Literal["arithmetic", "word"] = "arithmetic"


def could_be_level(problem: str, level: int) -> bool:
    """Whether ``make_problem(rng, level)`` could print ``problem`` (operand count, digit counts, operators and,
    for the non-negative levels, the order of a difference). Example: ``"What is 88 - 71?"`` → True for levels 2
    and 3, ``"What is 12 * 4?"`` → False for every level (level 3 has two-digit operands only).
    """
    spec = LEVELS[level]
    parts = problem.removeprefix("What is ").removesuffix("?").split(" ")
    numbers, ops = parts[0::2], parts[1::2]
    if len(numbers) != spec.operands or any(op not in spec.ops for op in ops):
        return False
    if not all(spec.min_digits <= len(x) <= spec.max_digits for x in numbers):
        return False
    return spec.allow_negative or not (ops[0] == "-" and int(numbers[0]) < int(numbers[1]))


#: The held-out benchmarks of the synthetic task (issue 17's CPU study): name → spec.
GENERATED_BENCHMARKS: dict[str, GeneratedBenchmark] = {
    b.name: b
    for b in (
        GeneratedBenchmark("arith_test", (2,), 1000, 1, 4,
                           "held-out level-2 problems (1-2 digit sums and differences): the training task"),
        GeneratedBenchmark("arith_hard", (3, 4), 500, 2, 4,
                           "held-out levels 3-4 (2-digit products, three operands, negative results): never trained",
                           exclude_levels=(1, 2)),
        GeneratedBenchmark("word_test", (2, 3, 4), 300, 1, 4,
                           "held-out word problems, 2-4 sums and differences up to 20: the word task", task="word"),
        GeneratedBenchmark("word_mid", (12, 13, 14), 300, 2, 4,
                           "held-out word problems, 2-4 operations with products, halves and splits up to 60",
                           task="word"),
        GeneratedBenchmark("word_hard", (22, 23, 24), 300, 3, 4,
                           "held-out word problems, 2-4 operations up to 300", task="word"),
    )
}


def generated_benchmark(name: str) -> list[Record]:
    """The problems of a :data:`GENERATED_BENCHMARKS` benchmark, with ``source`` = its name.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    if name not in GENERATED_BENCHMARKS:
        raise KeyError(f"unknown generated benchmark {name!r}; known: {', '.join(GENERATED_BENCHMARKS)}")
    spec = GENERATED_BENCHMARKS[name]
    if spec.task == "word":
        records = generate_word_problems(spec.num_problems, spec.seed, spec.levels, split="test")
    else:
        draws = 3 * spec.num_problems if spec.exclude_levels else spec.num_problems  # room for the excluded ones
        records = generate_arithmetic(draws, spec.seed, spec.levels, split="test")
        records = [r for r in records if not any(could_be_level(r.problem, lv) for lv in spec.exclude_levels)]
        if len(records) < spec.num_problems:  # pragma: no cover - a spec error, caught by the tests
            raise ValueError(f"{name}: only {len(records)} problems after excluding levels {spec.exclude_levels}")
    records = records[:spec.num_problems]
    return [Record(id=f"{name}/{i}", problem=r.problem, answer=r.answer, source=name) for i, r in enumerate(records)]
