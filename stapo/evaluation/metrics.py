"""Evaluation metrics over N graded samples per problem: avg@N, unbiased pass@k, maj@N
(docs/method.md#evaluation-protocol).

All metrics are fractions in [0, 1] (tables multiply by 100). For a benchmark of P problems where problem i
has c_i correct samples out of N:

* ``avg@N``  = (1/P) Σ_i c_i / N — the paper's number (the mean pass@1 over the N samples).
* ``pass@k`` = (1/P) Σ_i [1 − C(N − c_i, k) / C(N, k)] — the unbiased estimator of Chen et al. (2021,
  "Evaluating Large Language Models Trained on Code", eq. 1); computed here for k = 1 (equal to avg@N) and
  k = N (the fraction of problems with at least one correct sample).
* ``maj@N``  = (1/P) Σ_i [the majority answer of problem i is correct] (self-consistency voting).

Majority vote (:func:`majority_vote`): each sample with an extracted answer votes for its
:func:`answer_key` (the extracted answer with decorations, whitespace and LaTeX spacing removed); samples
without an answer do not vote. **Ties** are broken deterministically: among the keys with the most votes,
the one whose first vote comes from the lowest sample index wins (samples are numbered 0..N−1 in generation
order). The winning key counts as correct when *any* sample voting for it was graded correct (the same
string graded against the same gold answer gets the same verdict unless the grader timed out on one copy).
A problem where no sample has an answer counts as incorrect. Voting groups answers by string, not by
mathematical equivalence: ``1/2`` and ``0.5`` are different votes.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from stapo.core.metric_names import val_key, val_source
from stapo.tasks.boxed import strip_answer_decorations

__all__ = [
    "GRADER_STATUSES",
    "MajorityVote",
    "pass_at_k",
    "mean_pass_at_k",
    "avg_at_n",
    "answer_key",
    "majority_vote",
    "summarize_benchmark",
    "average_over_benchmarks",
    "SAMPLE_KEYS",
    "per_problem_accuracy",
    "paired_difference",
    "validation_metrics",
]

#: Verdicts of :class:`stapo.tasks.grader.MathGrader` (``GradeStatus`` values), in table order.
GRADER_STATUSES = ("correct", "incorrect", "no_answer", "timeout", "error")

_LATEX_SPACING = re.compile(r"\\[,;:! ]|\\q?quad|\\left|\\right")
_WHITESPACE = re.compile(r"\s+")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``1 − C(n − c, k) / C(n, k)``.

    Args:
        n: samples drawn for the problem (>= 1).
        c: of those, samples graded correct (0 <= c <= n).
        k: the k of pass@k (1 <= k <= n).

    Returns:
        Probability in [0, 1] that at least one of k samples drawn without replacement from the n is correct
        (exact integer binomials, then one correctly rounded division).

    Raises:
        ValueError: n, c or k out of range (the message names which).

    Source: Chen et al. 2021 (Codex paper), eq. 1.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or int(value) != value:
            raise ValueError(f"pass_at_k: {name} must be an integer, got {value!r}")
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        raise ValueError(f"pass_at_k: n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """Mean of :func:`pass_at_k` over problems.

    Args:
        counts: one ``(n, c)`` pair per problem.
        k: the k of pass@k (<= every n).

    Returns:
        Fraction in [0, 1]; ``nan`` for an empty ``counts``.
    """
    if not counts:
        return math.nan
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def avg_at_n(correct: Sequence[Sequence[bool]]) -> float:
    """avg@N: the mean over problems of the fraction of that problem's samples graded correct.

    Args:
        correct: ``correct[i][j]`` — whether sample j of problem i is correct (problems may have different N).

    Returns:
        Fraction in [0, 1]; ``nan`` when there are no problems.

    Raises:
        ValueError: a problem has no samples.

    Source: docs/method.md#evaluation-protocol ("avg@N = mean over problems of the fraction of N samples graded
    correct").
    """
    if not correct:
        return math.nan
    total = 0.0
    for i, row in enumerate(correct):
        if len(row) == 0:
            raise ValueError(f"avg_at_n: problem {i} has no samples")
        total += sum(bool(x) for x in row) / len(row)
    return total / len(correct)


def answer_key(answer: str | None) -> str | None:
    """The voting key of an extracted answer: decorations stripped (surrounding ``$``, a trailing period, see
    :func:`stapo.tasks.boxed.strip_answer_decorations`), LaTeX spacing commands (``\\,`` ``\\;`` ``\\!`` ``\\quad``) and
    ``\\left`` / ``\\right`` removed, all whitespace removed, ``\\dfrac`` / ``\\tfrac`` written ``\\frac``.

    Returns:
        The key, or ``None`` for ``None`` or an answer that is empty after normalisation.

    Examples: ``" 34. "`` -> ``"34"``; ``"\\dfrac{1}{2}"`` -> ``"\\frac{1}{2}"``; ``"(1, 2)"`` -> ``"(1,2)"``.
    """
    if answer is None:
        return None
    key = strip_answer_decorations(str(answer))
    key = _LATEX_SPACING.sub("", key)
    key = _WHITESPACE.sub("", key).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return key or None


@dataclass(frozen=True)
class MajorityVote:
    """Outcome of :func:`majority_vote` for one problem.

    Attributes:
        answer: the winning voting key (``None`` when no sample had an answer).
        votes: samples that voted for it.
        correct: whether any sample voting for it was graded correct.
        tied: whether another key had as many votes (the tie-break rule then decided).
    """

    answer: str | None
    votes: int
    correct: bool
    tied: bool


def majority_vote(answers: Sequence[str | None], correct: Sequence[bool]) -> MajorityVote:
    """Majority vote over one problem's samples (rule and tie-break in the module docstring).

    Args:
        answers: extracted answer per sample (``None`` = no answer), in sample order 0..N−1.
        correct: grader verdict per sample (same length).

    Returns:
        :class:`MajorityVote`.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(answers) != len(correct):
        raise ValueError(f"majority_vote: {len(answers)} answers but {len(correct)} verdicts")
    votes: dict[str, int] = {}
    first: dict[str, int] = {}
    right: dict[str, bool] = {}
    for j, (ans, ok) in enumerate(zip(answers, correct)):
        key = answer_key(ans)
        if key is None:
            continue
        votes[key] = votes.get(key, 0) + 1
        first.setdefault(key, j)
        right[key] = right.get(key, False) or bool(ok)
    if not votes:
        return MajorityVote(answer=None, votes=0, correct=False, tied=False)
    top = max(votes.values())
    leaders = [key for key in votes if votes[key] == top]
    winner = min(leaders, key=lambda key: first[key])
    return MajorityVote(answer=winner, votes=top, correct=right[winner], tied=len(leaders) > 1)


def summarize_benchmark(problems: Sequence[Sequence[Mapping[str, Any]]], n: int) -> dict[str, Any]:
    """All metrics of one (benchmark, decoding setting) from its graded samples.

    Args:
        problems: one list per problem of exactly ``n`` sample records, in sample order, each a mapping with
            ``correct`` (bool, final verdict), ``extracted`` (str | None), ``status`` (rule-based grader verdict,
            one of :data:`GRADER_STATUSES`), ``response_tokens`` (int), ``finish_reason`` (``"eos"`` /
            ``"length"``) and optionally ``verifier_accepted`` (bool).
        n: samples per problem N.

    Returns:
        Plain dict: ``N``, ``problems`` (P), ``samples`` (P·N), ``avg@N``, ``pass@1``, ``pass@N``, ``maj@N``
        (fractions; ``nan`` when P = 0), ``avg@N_se`` (the standard error of avg@N over problems: the sample
        standard deviation of the per-problem accuracies c_i / N divided by √P; ``nan`` when P < 2), ``maj_ties``
        (problems whose vote was tied), ``grader`` (count per status, summing to P·N), ``verifier_accepted`` (samples
        the LLM verifier turned correct), ``no_answer_rate``, ``mean_response_tokens`` (tokens, EOS included) and
        ``truncation_rate`` (fraction of samples that hit the generation limit).

    Raises:
        ValueError: a problem does not have exactly ``n`` samples, or an unknown grader status.
    """
    counts: list[tuple[int, int]] = []
    grader = {status: 0 for status in GRADER_STATUSES}
    maj_correct = ties = accepted = tokens = truncated = 0
    for i, samples in enumerate(problems):
        if len(samples) != n:
            raise ValueError(f"summarize_benchmark: problem {i} has {len(samples)} samples, expected N={n}")
        flags = [bool(s["correct"]) for s in samples]
        counts.append((n, sum(flags)))
        vote = majority_vote([s.get("extracted") for s in samples], flags)
        maj_correct += vote.correct
        ties += vote.tied
        for s in samples:
            status = s["status"]
            if status not in grader:
                raise ValueError(f"summarize_benchmark: unknown grader status {status!r}")
            grader[status] += 1
            accepted += bool(s.get("verifier_accepted", False))
            tokens += int(s["response_tokens"])
            truncated += s["finish_reason"] == "length"
    p = len(counts)
    total = p * n
    # standard error of avg@N over problems: sd of the per-problem accuracies c_i / N (ddof 1) / sqrt(P)
    accs = [c / n for _, c in counts]
    se = (math.sqrt(sum((a - sum(accs) / p) ** 2 for a in accs) / (p - 1)) / math.sqrt(p)) if p > 1 else math.nan
    return {
        "N": n,
        "problems": p,
        "samples": total,
        "avg@N": avg_at_n([[j < c for j in range(n)] for _, c in counts]) if p else math.nan,
        "avg@N_se": se,
        "pass@1": mean_pass_at_k(counts, 1),
        "pass@N": mean_pass_at_k(counts, n),
        "maj@N": maj_correct / p if p else math.nan,
        "maj_ties": ties,
        "grader": grader,
        "verifier_accepted": accepted,
        "no_answer_rate": grader["no_answer"] / total if total else math.nan,
        "mean_response_tokens": tokens / total if total else math.nan,
        "truncation_rate": truncated / total if total else math.nan,
    }


def average_over_benchmarks(per_benchmark: Mapping[str, Mapping[str, Any]], key: str = "avg@N") -> float:
    """Unweighted mean of ``key`` over benchmarks (the paper's "average over the six benchmarks").

    Args:
        per_benchmark: ``{benchmark: summary}`` as returned by :func:`summarize_benchmark`.
        key: the metric to average.

    Returns:
        The mean (``nan`` when empty or when any value is ``nan``).
    """
    values = [float(s[key]) for s in per_benchmark.values()]
    return sum(values) / len(values) if values else math.nan


#: The keys of a graded sample record that :func:`per_problem_accuracy` reads.
SAMPLE_KEYS = ("benchmark", "setting", "problem_id", "correct")


def per_problem_accuracy(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per-problem accuracy c_i / N_i of graded samples, grouped by (benchmark, decoding setting).

    Args:
        records: graded sample records as evaluate.py stores them (``generations/<benchmark>__<setting>.jsonl``),
            each a mapping with ``benchmark``, ``setting``, ``problem_id`` and ``correct`` (bool).

    Returns:
        ``{(benchmark, setting): {problem_id: fraction of its samples graded correct}}``.

    Raises:
        ValueError: a record lacks one of the four keys (the message names the record's index).

    Example: records of problem ``p/0`` with correct = [True, False, True, True] and ``p/1`` with [False] * 4 →
    ``{("p", "t1.0_p1.0"): {"p/0": 0.75, "p/1": 0.0}}``.
    """
    hits: dict[tuple[str, str], dict[str, list[int]]] = {}
    for i, rec in enumerate(records):
        missing = [k for k in SAMPLE_KEYS if k not in rec]
        if missing:
            raise ValueError(f"per_problem_accuracy: record {i} lacks {', '.join(missing)}")
        cell = hits.setdefault((str(rec["benchmark"]), str(rec["setting"])), {})
        c = cell.setdefault(str(rec["problem_id"]), [0, 0])  # [correct, samples]
        c[0] += bool(rec["correct"])
        c[1] += 1
    return {key: {pid: c / n for pid, (c, n) in cell.items()} for key, cell in hits.items()}


def paired_difference(acc_a: Mapping[str, float], acc_b: Mapping[str, float], z: float = 1.96) -> dict[str, float]:
    """The difference of two runs' avg@N on the problems both answered, with its paired standard error.

    Two runs evaluated on the same problems share the problems' difficulty, so the difference of their avg@N has a
    smaller sampling error than √(SE_a² + SE_b²): with d_i = a_i − b_i the per-problem accuracy difference over
    the P shared problems, diff = mean(d) = avg@N_a − avg@N_b (on those problems) and
    SE_paired = sd(d) / √P (sample sd, ddof 1). A difference smaller than ``resolvable`` = z · SE_paired is within
    the problem-sampling noise of the pair at the normal level of ``z`` (1.96: 95 %); the sampling noise of the N
    samples per problem is part of each a_i and b_i, so it is included.

    Args:
        acc_a, acc_b: ``{problem_id: accuracy in [0, 1]}`` of the two runs (:func:`per_problem_accuracy`).
        z: the normal quantile of the resolvable difference.

    Returns:
        ``problems`` (P, shared), ``diff``, ``se_paired``, ``se_unpaired`` (√(SE_a² + SE_b²) on the shared
        problems, each SE = sd / √P), ``resolvable`` (z · se_paired); fractions.

    The two runs must be two evaluations made with the same protocol (:mod:`stapo.evaluation.identity`:
    ``protocol_differences``, ``same_inputs``; ``scripts/paired_eval_diff.py`` checks both before calling this).

    Raises:
        ValueError: fewer than 2 shared problems; or the same mapping given twice (a difference of 0 by
            construction, not a tie).

    Example: a = {x: 1, y: 0.5, z: 0}, b = {x: 0.5, y: 0.5, z: 0} → d = [0.5, 0, 0], diff = 1/6,
    sd(d) = √(((1/3)² + 2·(1/6)²) / 2) = √(1/12) ≈ 0.2887, SE_paired = 0.2887 / √3 ≈ 0.1667.
    """
    if acc_a is acc_b:
        raise ValueError("paired_difference: the same run given twice (its difference with itself is 0 by "
                         "construction, not a tie)")
    shared = sorted(set(acc_a) & set(acc_b))
    p = len(shared)
    if p < 2:
        raise ValueError(f"paired_difference: the two runs share {p} problem(s); at least 2 are needed")
    sd = statistics.stdev  # sample sd (ddof 1)
    a = [float(acc_a[k]) for k in shared]  # [P]
    b = [float(acc_b[k]) for k in shared]  # [P]
    d = [x - y for x, y in zip(a, b)]  # [P] per-problem differences
    se_paired = sd(d) / math.sqrt(p)
    return {
        "problems": float(p),
        "diff": sum(d) / p,
        "se_paired": se_paired,
        "se_unpaired": math.sqrt(sd(a) ** 2 / p + sd(b) ** 2 / p),
        "resolvable": z * se_paired,
    }


def validation_metrics(metrics: Mapping[str, Any], dropped: Mapping[str, int] | None = None, *,
                       prefix: str = "val") -> dict[str, float]:
    """The validation keys (verl's layout, shared with the verl plugin's runs: stapo/core/metric_names.py,
    docs/metrics.md) of an evaluation's ``metrics`` — in-training validation and ``evaluate.py`` log the same names
    through this function.

    Args:
        metrics: ``{setting: {"benchmarks": {bench: stats}, "average": stats}}`` as
            :func:`stapo.evaluation.runner.evaluate_problems` returns it (each stats dict with ``N``, ``avg@N``,
            ``pass@N``, ``maj@N``; the average with ``samples``, ``mean_response_tokens``, ``truncation_rate`` and
            the ``grader`` counts ``no_answer`` / ``timeout`` / ``error``).
        dropped: ``{benchmark: problems skipped for a too long prompt}``
            (``<prefix>-aux/<bench>/dropped_long_prompt``).
        prefix: the section prefix (``val`` → ``val-core`` / ``val-aux``).

    Returns:
        ``{key: value}``: ``<prefix>-core/<bench>/acc/{mean,pass,maj}@<N>`` (fractions),
        ``<prefix>-core/average/acc/mean@<N max>``, ``<prefix>-aux/response_length/{mean (tokens), clip_ratio}``,
        ``<prefix>-aux/grader/{no_answer_rate (fraction), timeouts, errors (counts)}``; with several settings the
        benchmark segment is ``<bench>@<setting>`` (``average@<setting>``, ``grader@<setting>`` ...).
    """
    out: dict[str, float] = {}
    p = prefix
    several = len(metrics) > 1
    for setting, m in metrics.items():
        tag = setting if several else None
        for bench, s in m["benchmarks"].items():
            n, src = int(s["N"]), val_source(bench, tag)
            out[val_key(src, f"mean@{n}", prefix=p)] = float(s["avg@N"])
            out[val_key(src, f"pass@{n}", prefix=p)] = float(s["pass@N"])
            out[val_key(src, f"maj@{n}", prefix=p)] = float(s["maj@N"])
        avg = m["average"]
        n_max = max((int(s["N"]) for s in m["benchmarks"].values()), default=0)
        out[val_key(val_source("average", tag), f"mean@{n_max}", prefix=p)] = float(avg["avg@N"])
        samples = avg["samples"]
        aux = [("response_length", "mean", float(avg["mean_response_tokens"])),
               ("response_length", "clip_ratio", float(avg["truncation_rate"])),
               ("grader", "no_answer_rate", avg["grader"]["no_answer"] / samples if samples else math.nan),
               ("grader", "timeouts", float(avg["grader"]["timeout"])),
               ("grader", "errors", float(avg["grader"]["error"]))]
        for group, metric, value in aux:
            out[val_key(val_source(group, tag), metric, core=False, var=None, prefix=p)] = value
    for bench, n in (dropped or {}).items():
        out[val_key(bench, "dropped_long_prompt", core=False, var=None, prefix=p)] = float(n)
    return out
