"""Tests for stapo/tasks/word_problems.py: the seeded multi-step word problems, their splits, benchmarks, reference
solutions, the ``data.train_set: word`` training set and its config."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from stapo.tasks.records import Record
from stapo.tasks.splits import is_heldout
from stapo.tasks.word_problems import (WORD_EXAMPLE, WORD_LEVELS, WORD_SYSTEM_PROMPT, Event, WordProblem,
                                 generate_word_problems, make_word_problem, parse_word_problem, reference_solution)

REPO = Path(__file__).resolve().parents[1]
_EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_fixed_seeds_by_hand():
    """The first problems of a few seeds, their answers worked out by hand."""
    easy = generate_word_problems(3, seed=0, levels=(2, 3, 4))
    assert easy[0] == Record(
        "synthetic_word/L2/0", "Raj has 6 shells. He gets 9 more shells from a friend. Then he finds 4 more shells. "
        "How many shells does Raj have now?", "19", "synthetic_word")  # 6 + 9 + 4
    assert easy[1].problem == ("Lily has 9 buttons. She loses 2 buttons. Then she gets 7 more buttons from a friend. "
                               "Then she finds 4 more buttons. How many buttons does Lily have now?")
    assert easy[1].answer == "18"  # 9 - 2 + 7 + 4
    assert easy[2].answer == "7" and easy[2].id == "synthetic_word/L4/2"  # 9 - 6 + 2 - 3 + 5
    small = generate_word_problems(3, seed=0, levels=(12, 13, 14))
    assert small[1].problem == ("Max has 9 marbles. He gets 3 more marbles from a friend. Then the number of marbles "
                                "he has doubles. Then the number of marbles he has doubles. How many marbles does Max "
                                "have now?")
    assert small[1].answer == "48"  # (9 + 3) * 2 * 2
    assert small[2].answer == "4" and small[2].id == "synthetic_word/L14/2"  # ((12 - 5) * 2 - 6) / 2
    large = generate_word_problems(3, seed=1, levels=(22, 23, 24))
    assert large[1].problem == ("Mia has 9 cartons with 10 eggs in each carton. She finds 27 more eggs. Then she puts "
                                "all of her eggs into 3 equal piles. How many eggs are in each pile?")
    assert large[1].answer == "39"  # (9 * 10 + 27) / 3
    assert large[2].answer == "28"  # 6 * 4 - 19 - 3 + 26
    test = generate_word_problems(1, seed=5, levels=(12,), split="test")
    assert test[0].problem.startswith("Tom has 4 boxes with 5 crayons in each box. He finds 6 more crayons.")
    assert test[0].answer == "26" and test[0].id == "synthetic_word/test/L12/0"  # 4 * 5 + 6
    test = generate_word_problems(1, seed=5, levels=(2,), split="test")
    assert test[0].problem.startswith("Mia has 8 oranges. She gets 2 more oranges from a friend. Then she gets 7 more")
    assert test[0].answer == "17"  # 8 + 2 + 7


def test_generator_is_deterministic():
    levels = (2, 3, 4, 12, 13, 14, 22, 23, 24)
    a = generate_word_problems(60, seed=3, levels=levels)
    assert a == generate_word_problems(60, seed=3, levels=levels)
    assert a != generate_word_problems(60, seed=4, levels=levels)
    assert [r.id.split("/")[1] for r in a[:9]] == [f"L{lv}" for lv in levels]  # round-robin


def test_every_written_step_is_right_and_the_levels_hold():
    """An independent check through the reference solution's text: every ``a op b = c`` it writes is exact, the
    last result is the gold, the number of operations is the level's K, every value stays in [1, max_value]."""
    for level, spec in WORD_LEVELS.items():
        for record in generate_word_problems(150, seed=level, levels=[level]):
            solution = reference_solution(record.problem)
            equations = _EQUATION.findall(solution)
            assert len(equations) == spec.operations, (record, solution)
            for a, op, b, c in equations:
                a, b, c = int(a), int(b), int(c)
                assert {"+": a + b, "-": a - b, "*": a * b, "/": a // b if a % b == 0 else -1}[op] == c, solution
                assert 1 <= c <= spec.max_value and a <= spec.max_value
            assert solution.endswith(f"The final answer is \\boxed{{{record.answer}}}.")
            assert re.search(rf"= {record.answer} \w+\.\n", solution)  # the last step's result is the gold


def test_train_and_test_splits_are_disjoint():
    train = generate_word_problems(600, seed=3, levels=(2, 3, 4), split="train")
    test = generate_word_problems(200, seed=4, levels=(2, 3, 4), split="test")
    assert not any(is_heldout(r.problem) for r in train)
    assert all(is_heldout(r.problem) for r in test)
    assert not {r.problem for r in train} & {r.problem for r in test}
    assert len({r.problem for r in test}) == 200
    assert any(is_heldout(r.problem) for r in generate_word_problems(600, seed=3, levels=(2, 3, 4)))  # "all" has some
    with pytest.raises(ValueError, match="unknown word-problem levels"):
        generate_word_problems(5, levels=(1,))
    with pytest.raises(ValueError, match="unknown split"):
        generate_word_problems(5, split="dev")


def test_reference_solution_and_the_one_shot_prompt():
    assert WORD_EXAMPLE.text == ("Ana has 4 bags with 5 marbles in each bag. She gives away 6 marbles. Then she finds "
                                 "3 more marbles. How many marbles does Ana have now?")
    assert reference_solution(WORD_EXAMPLE.text) == (
        "Step 1: Ana has 4 bags with 5 marbles in each bag, so she has 4 * 5 = 20 marbles.\n"
        "Step 2: She gives away 6 marbles, so she has 20 - 6 = 14 marbles.\n"
        "Step 3: She finds 3 more marbles, so she has 14 + 3 = 17 marbles.\n"
        "The final answer is \\boxed{17}.")
    assert WORD_EXAMPLE.answer == 17 and WORD_EXAMPLE.operations == 3 and not is_heldout(WORD_EXAMPLE.text)
    assert WORD_SYSTEM_PROMPT.endswith("Answer:\n" + WORD_EXAMPLE.solution())
    buy = WordProblem("Sam", "he", "apples", (Event("start_plain", 12), Event("buy", 3, 4), Event("share", 4)))
    assert buy.text == ("Sam has 12 apples. He buys 3 boxes with 4 apples in each box. Then he puts all of his apples "
                        "into 4 equal piles. How many apples are in each pile?")
    assert buy.solution() == (
        "Step 1: Sam starts with 12 apples.\n"
        "Step 2: He buys 3 boxes with 4 apples in each box, which is 3 * 4 = 12 apples, so he has 12 + 12 = 24 "
        "apples.\n"
        "Step 3: He puts all of his apples into 4 equal piles, so each pile has 24 / 4 = 6 apples.\n"
        "The final answer is \\boxed{6}.")
    assert buy.operations == 3 and reference_solution(buy) == buy.solution()
    uneven = WordProblem("Sam", "he", "apples", (Event("start_plain", 12), Event("buy", 3, 4), Event("share", 5)))
    with pytest.raises(ValueError, match="does not divide"):
        uneven.values()  # 24 apples do not split into 5 equal piles: the generator never draws it


def test_parse_round_trip_and_foreign_text():
    rng = random.Random(0)
    for level in WORD_LEVELS:
        for _ in range(200):
            problem = make_word_problem(rng, level)
            assert parse_word_problem(problem.text) == problem
    with pytest.raises(ValueError, match="no event"):
        reference_solution("Sam has 3 apples. He eats 2 apples. How many apples does Sam have now?")
    with pytest.raises(ValueError, match="not a word problem"):
        parse_word_problem("What is 2 + 3?")


def test_word_benchmarks_are_held_out_and_registered():
    from stapo.tasks.synthetic import GENERATED_BENCHMARKS, generated_benchmark

    test, mid, hard = (generated_benchmark(name) for name in ("word_test", "word_mid", "word_hard"))
    assert len(test) == GENERATED_BENCHMARKS["word_test"].num_problems == 300 and len(mid) == len(hard) == 300
    assert test[0].id == "word_test/0" and test[0].source == "word_test"
    assert all(is_heldout(r.problem) for r in test + mid + hard)
    assert generated_benchmark("word_test") == test
    assert {len(_EQUATION.findall(reference_solution(r.problem))) for r in test + mid} == {2, 3, 4}
    assert all(" * " not in reference_solution(r.problem) for r in test)  # the easy levels: sums and differences
    assert all(int(r.answer) == parse_word_problem(r.problem).answer for r in hard[:50])


def test_training_set_and_config(tmp_path):
    from stapo.config import ConfigError, load_config, validate
    from stapo.tasks.data import load_train_set

    loaded = load_train_set("word", n=12, seed=0, levels=(2, 3), split="train")
    assert loaded.records == generate_word_problems(12, seed=0, levels=(2, 3), split="train")
    assert loaded.stats.rows_loaded == 12 and loaded.records[0].source == "synthetic_word"

    cfg = load_config(REPO / "configs" / "cpu_smollm2_word_justrl.yaml")
    assert cfg.data.train_set == "word" and cfg.data.system_prompt == WORD_SYSTEM_PROMPT
    assert list(cfg.data.synthetic.levels) == [2, 3, 4] and cfg.data.synthetic.split == "train"
    assert cfg.rollout.response_length == 256 and cfg.rollout.stop_at_first_boxed is True
    assert cfg.algorithm.objective == "justrl"
    assert load_config(REPO / "configs" / "cpu_smollm2_justrl.yaml").rollout.stop_at_first_boxed is False  # default

    with pytest.raises(ConfigError, match=r"data.synthetic.levels.*\[2, 3, 4, 12, 13, 14, 22, 23, 24\]"):
        load_config(REPO / "configs" / "cpu_smollm2_word_justrl.yaml", ["data.synthetic.levels=[1,2]"])
    with pytest.raises(ConfigError, match="data.synthetic.split=train"):
        validate(load_config(REPO / "configs" / "cpu_smollm2_word_justrl.yaml",
                             ["data.synthetic.split=all", "trainer.val_every=5", "validation.benchmarks=[word_test]"]))
    # the arithmetic benchmarks are not drawn from the word task's problems: no refusal
    load_config(REPO / "configs" / "cpu_smollm2_word_justrl.yaml",
                ["data.synthetic.split=all", "trainer.val_every=5", "validation.benchmarks=[arith_test]"])
