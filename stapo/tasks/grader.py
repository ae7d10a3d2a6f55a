"""Evaluation grader: math-verify equivalence in a pool of worker processes with a hard timeout.

Why a process pool (docs/method.md#grading, docs/method.md#pitfalls): math-verify's own timeouts use ``signal.alarm``,
which only
works on the main thread and cannot interrupt long C-level computations (sympy evaluating
``9^{9^{9^{9^{9}}}}`` never returns).  Here math-verify runs with its signal timeouts disabled inside
dedicated worker processes; the parent enforces a hard wall-clock limit per answer by killing a
worker that overruns (SIGKILL) and starting a replacement.  The parent side uses no signals, so
:meth:`MathGrader.grade` may be called from any thread.

Why not ``pebble.ProcessPool`` (checked with pebble 5.2.3): a worker that dies while no task is running (an idle
worker killed from outside, a replacement killed while starting, a warm-up that raises) breaks the whole pebble
pool for good (``BrokenProcessPool: All workers expired``) instead of being replaced, and pebble has no notion of
a worker being ready, so :meth:`MathGrader.wait_ready`, ``startup_timeout_s`` and the start-up ``GraderError``
carrying the worker's exception could not be kept; worker pids are not exposed (private dict, order not stable).

Verdicts: every answer gets a :class:`GradeResult` whose ``status`` is one of ``correct``,
``incorrect``, ``no_answer`` (nothing could be extracted from the response), ``timeout`` or
``error`` (an exception inside math-verify, an unparseable gold answer — one math-verify cannot parse into a
mathematical object (:func:`gold_parses`), unless the response repeats it as text —, or a worker that died).
Only ``correct`` counts as correct; timeouts and errors are *also* counted in the returned
:class:`GraderStats`, so they are never silently folded into "wrong".

Extraction (docs/method.md#grading): the response's last ``\\boxed{...}`` (nested braces handled, the whole
response is searched; surrounding whitespace/``$`` and a trailing period removed from its content),
parsed with math-verify's LaTeX extraction; when the response has no box at
all, math-verify's own extraction (LaTeX, then plain expressions) is run on the full response.
The gold answer is parsed as LaTeX (wrapped as ``\\boxed{gold}`` so that the whole string is one
expression).  Equivalence: ``math_verify.verify(gold, prediction)`` for every pair of parsed
candidates; correct when any pair verifies.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import multiprocessing as mp
import os
import re
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as _mp_wait
from typing import Sequence

from stapo.tasks.boxed import last_boxed_content, last_boxed_only_string, remove_boxed, strip_answer_decorations

__all__ = [
    "GradeStatus",
    "GradeResult",
    "GraderStats",
    "GradeBatch",
    "GraderError",
    "MathGrader",
    "grade_answer",
    "parse_gold",
    "gold_parses",
    "check_text_batch",
]

_ERROR_TEXT_MAX = 300
_MAX_START_FAILURES = 3  # consecutive worker deaths during start-up before the grader gives up


class GradeStatus(str, enum.Enum):
    """Outcome of grading one response against one gold answer."""

    CORRECT = "correct"
    INCORRECT = "incorrect"
    NO_ANSWER = "no_answer"  # nothing extractable in the response (no box, no parseable expression)
    TIMEOUT = "timeout"  # no verdict within the hard per-answer limit; the worker was killed
    ERROR = "error"  # exception in math-verify, unparseable gold, or a worker that died


@dataclass(frozen=True)
class GradeResult:
    """Verdict for one (response, gold) pair.

    Attributes:
        correct: ``True`` only when ``status is GradeStatus.CORRECT``.
        status: the :class:`GradeStatus`.
        extracted: the answer text that was graded (content of the last box, or math-verify's
            extracted string), ``None`` when nothing was extracted.
        error: short description for ``timeout`` / ``error`` verdicts, else ``None``.
        seconds: wall-clock seconds spent on this answer (in the worker; for timeouts, until the kill).
        unevaluated: math-verify found the answer equivalent but it is an unevaluated expression
            (``9 + 5`` for 14) and the grader requires a value (``MathGrader(require_value=True)``): the status is
            ``incorrect``.
    """

    correct: bool
    status: GradeStatus
    extracted: str | None = None
    error: str | None = None
    seconds: float = 0.0
    unevaluated: bool = False


@dataclass
class GraderStats:
    """Counts over a batch of grading calls (all fields are plain ints/floats, ready for logging).

    Attributes:
        n: answers graded.
        correct / incorrect / no_answer / timeouts / errors: answers per :class:`GradeStatus`
            (they sum to ``n``).
        worker_restarts: workers killed (timeout) or found dead and replaced.
        unevaluated: of the ``incorrect``, answers math-verify found equivalent that were unevaluated expressions
            (:func:`is_unevaluated_expression`; only with ``MathGrader(require_value=True)``).
        seconds: wall-clock seconds spent in :meth:`MathGrader.grade`.
        error_types: ``{exception class name (or "WorkerDied", "GoldUnparseable"): count}``.
    """

    n: int = 0
    correct: int = 0
    incorrect: int = 0
    no_answer: int = 0
    timeouts: int = 0
    errors: int = 0
    worker_restarts: int = 0
    unevaluated: int = 0
    seconds: float = 0.0
    error_types: dict[str, int] = field(default_factory=dict)

    def add(self, result: GradeResult) -> None:
        """Count one :class:`GradeResult`."""
        self.n += 1
        status = GradeStatus(result.status)
        if status is GradeStatus.CORRECT:
            self.correct += 1
        elif status is GradeStatus.INCORRECT:
            self.incorrect += 1
            self.unevaluated += bool(result.unevaluated)
        elif status is GradeStatus.NO_ANSWER:
            self.no_answer += 1
        elif status is GradeStatus.TIMEOUT:
            self.timeouts += 1
        else:
            self.errors += 1
            key = (result.error or "Unknown").split(":", 1)[0]
            self.error_types[key] = self.error_types.get(key, 0) + 1

    def merge(self, other: "GraderStats") -> None:
        """Add ``other``'s counts into ``self`` (used for the grader's running totals)."""
        for name in ("n", "correct", "incorrect", "no_answer", "timeouts", "errors", "worker_restarts", "unevaluated"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.seconds += other.seconds
        for key, count in other.error_types.items():
            self.error_types[key] = self.error_types.get(key, 0) + count

    @property
    def accuracy(self) -> float:
        """``correct / n`` (0.0 when ``n == 0``)."""
        return self.correct / self.n if self.n else 0.0

    def as_dict(self, prefix: str = "grader/") -> dict[str, float]:
        """Flat ``{prefix + name: value}`` dict for a metrics logger (``error_types`` flattened)."""
        out: dict[str, float] = {}
        for key, value in asdict(self).items():
            if key == "error_types":
                for etype, count in value.items():
                    out[f"{prefix}error_type/{etype}"] = count
            else:
                out[prefix + key] = value
        out[prefix + "accuracy"] = self.accuracy
        return out


@dataclass(frozen=True)
class GradeBatch:
    """Results of :meth:`MathGrader.grade`: one :class:`GradeResult` per input, in input order,
    and the :class:`GraderStats` of this call."""

    results: list[GradeResult]
    stats: GraderStats

    @property
    def correct(self) -> list[bool]:
        """``[r.correct for r in results]``."""
        return [r.correct for r in self.results]


class GraderError(RuntimeError):
    """The grader pool itself failed (a worker could not start, or the grader is closed)."""


# --------------------------------------------------------------------------------------------
# In-process grading (runs inside the worker processes)
# --------------------------------------------------------------------------------------------


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_TEXT_MAX else text[:_ERROR_TEXT_MAX] + "..."


def _first_str(items: Sequence[object]) -> str | None:
    for item in items:
        if isinstance(item, str):
            return item
    return None


#: A binary arithmetic operator between two operands: ``9 + 5``, ``(3)(4)`` is not matched, ``-5`` is not.
_UNEVALUATED_RE = re.compile(r"[\d)\]}]\s*(?:[-+*/×÷·]|\\times|\\cdot|\\div)\s*[\d(\[{\\]")


def is_unevaluated_expression(answer: str | None) -> bool:
    """Whether an extracted answer still holds a binary ``+ - * / × ÷ \\times \\cdot \\div`` between two operands.

    The answer-form rule of ``MathGrader(require_value=True)`` (the ``math_verify_value`` reward): math-verify
    evaluates ``9 + 5`` to 14, so on the synthetic arithmetic task an echo of the question ("So 9 + 5.") would be
    graded correct. Only the part after the last ``=`` is checked (math-verify grades an equation's right side).
    Examples: ``"9 + 5."`` → True, ``"9+5"`` → True, ``"3\\times 4"`` → True; ``"14"``, ``"-3"``,
    ``"9 + 5 = 14"``, ``"\\frac{1}{2}"``, ``"2^{10}"``, ``None`` → False. Not an equivalence check: math-verify
    decides equivalence.
    """
    return bool(answer) and _UNEVALUATED_RE.search(answer.rsplit("=", 1)[-1]) is not None


def check_text_batch(responses: Sequence[str], golds: Sequence[str], prefix: str = "") -> tuple[list[str], list[str]]:
    """``responses`` and ``golds`` as lists, checked: equal lengths, every item a ``str``.

    Raises:
        ValueError: the lengths differ (``"<prefix>3 responses but 2 gold answers"``).
        TypeError: an item is not a ``str`` (``"<prefix>responses[1] is int, expected str"``; likewise ``golds[i]``).
    """
    responses = list(responses)
    golds = list(golds)
    if len(responses) != len(golds):
        raise ValueError(f"{prefix}{len(responses)} responses but {len(golds)} gold answers")
    for i, (resp, gold) in enumerate(zip(responses, golds)):
        if not isinstance(resp, str):
            raise TypeError(f"{prefix}responses[{i}] is {type(resp).__name__}, expected str")
        if not isinstance(gold, str):
            raise TypeError(f"{prefix}golds[{i}] is {type(gold).__name__}, expected str")
    return responses, golds


def parse_gold(gold: str, timeout_s: int | None = None) -> list:
    """math-verify's parse of a gold answer, as the grader parses it: ``gold`` wrapped as ``\\boxed{gold}`` (the whole
    string one expression), LaTeX extraction only.

    Args:
        gold: the normalised gold answer (:func:`stapo.tasks.data.normalize_gold`).
        timeout_s: math-verify's own parsing timeout (``signal.alarm``: main thread only); None = none (the grader's
            workers, which are killed from outside instead).

    Returns:
        math-verify's list: the parsed expressions (sympy objects) followed by the extracted strings; a gold it cannot
        parse gives only its text (math-verify's fallback) or an empty list.

    Raises:
        Exception: whatever math-verify raises (``raise_on_error=True``).
    """
    from math_verify import LatexExtractionConfig, parse

    return parse("\\boxed{" + gold + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout_s,
                 raise_on_error=True)


def gold_parses(gold: str, timeout_s: int | None = None) -> bool:
    """Whether math-verify parses ``gold`` (:func:`parse_gold`) into a mathematical object, not just its text.

    A gold it cannot parse (``"\\frac{"``, ``"\\sqrt"``, ``"\\begin{cases}...\\end{cases}"``, ``"-1./3"``) can only
    match a response that repeats it as text: :func:`grade_answer` grades every other response of it ``error``
    (``GoldUnparseable``), not ``incorrect``. Examples: ``"34"``, ``"\\frac{1}{2}"``, ``"(1,2)"``, ``"x=3"``,
    ``"\\text{Monday}"`` and ``"N/A"`` (math-verify reads it as the expression n/a) → True; ``"\\frac{"``,
    ``"np.arcsin(10/13)"``, ``""`` → False. A math-verify exception or timeout counts as False.
    """
    try:
        parsed = parse_gold(gold, timeout_s)
    except Exception:  # noqa: BLE001 - any math-verify failure: the gold cannot be parsed
        return False
    return any(not isinstance(x, str) for x in parsed)


def grade_answer(response: str, gold: str) -> GradeResult:
    """Grade one response against one gold answer with math-verify, in the calling process.

    This is the function the pool workers run.  It has **no timeout** (math-verify's signal
    timeouts are disabled, see the module docstring): call it directly only on trusted inputs;
    use :class:`MathGrader` for model outputs.  Exceptions raised inside math-verify are caught
    and returned as ``status=error`` verdicts (they are not raised).

    Args:
        response: the model's response text (the prompt must not be included).
        gold: the normalised gold answer as LaTeX without ``$`` delimiters
            (see :func:`stapo.tasks.data.normalize_gold`).

    Returns:
        :class:`GradeResult` (``seconds`` measured here).

    Raises:
        TypeError: ``response`` or ``gold`` is not a ``str``.

    Source: docs/method.md#grading (rule-based math equivalence with math-verify).
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    if not isinstance(gold, str):
        raise TypeError(f"gold must be str, got {type(gold).__name__}")
    from math_verify import LatexExtractionConfig, parse, verify

    t0 = time.perf_counter()

    def done(status: GradeStatus, extracted: str | None, error: str | None = None) -> GradeResult:
        return GradeResult(
            correct=status is GradeStatus.CORRECT,
            status=status,
            extracted=extracted,
            error=error,
            seconds=time.perf_counter() - t0,
        )

    latex_only = [LatexExtractionConfig()]
    try:
        gold_parsed = parse_gold(gold)
    except Exception as exc:  # noqa: BLE001 - any math-verify failure is a counted error
        return done(GradeStatus.ERROR, None, "GoldUnparseable: " + _short(exc))
    if not gold_parsed:
        return done(GradeStatus.ERROR, None, f"GoldUnparseable: gold answer {gold[:80]!r} gave no parse")
    # only math-verify's text fallback: a response can match it as text, but no other verdict is a wrong answer
    gold_is_text = all(isinstance(g, str) for g in gold_parsed)

    boxed = last_boxed_only_string(response)
    try:
        if boxed is not None:
            extracted: str | None = remove_boxed(boxed)
            # Light clean-up first: math-verify cannot parse e.g. "34." or "$34$" inside a box.
            cleaned = "\\boxed{" + strip_answer_decorations(extracted) + "}"
            pred_parsed = parse(cleaned, extraction_config=latex_only, parsing_timeout=None, raise_on_error=True)
        else:
            pred_parsed = parse(response, parsing_timeout=None, raise_on_error=True)
            extracted = _first_str(pred_parsed)
    except Exception as exc:  # noqa: BLE001
        return done(GradeStatus.ERROR, last_boxed_content(response), _short(exc))
    if not pred_parsed:
        return done(GradeStatus.NO_ANSWER, extracted)

    first_error: str | None = None
    for g in gold_parsed:
        for p in pred_parsed:
            try:
                if verify(g, p, timeout_seconds=None, raise_on_error=True):
                    return done(GradeStatus.CORRECT, extracted)
            except Exception as exc:  # noqa: BLE001
                if first_error is None:
                    first_error = _short(exc)
    if first_error is not None:
        return done(GradeStatus.ERROR, extracted, first_error)
    if gold_is_text:
        return done(GradeStatus.ERROR, extracted, f"GoldUnparseable: gold answer {gold[:80]!r} has no math-verify "
                                                  f"parse (matched as text only)")
    return done(GradeStatus.INCORRECT, extracted)


def _worker_main(conn) -> None:  # pragma: no cover - runs in a child process
    """Worker loop: warm up (imports sympy/math-verify), say ready, then grade tasks until told to stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent
    # math-verify warns once that its timeouts are disabled; that is deliberate here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        grade_answer("\\boxed{1}", "1")
    except BaseException as exc:  # noqa: BLE001
        try:
            conn.send(("failed", _short(exc)))
        finally:
            return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # parent went away
        if msg is None:
            return
        task_id, response, gold = msg
        try:
            result = grade_answer(response, gold)
        except Exception as exc:  # noqa: BLE001
            result = GradeResult(False, GradeStatus.ERROR, None, _short(exc))
        try:
            conn.send((task_id, result))
        except (BrokenPipeError, OSError):
            return


# --------------------------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------------------------


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx, index: int) -> None:
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn,), name=f"stapo-grader-{index}", daemon=True
        )
        self.process.start()
        child_conn.close()  # so that the parent sees EOF when the child dies
        self.conn = parent_conn
        self.ready = False
        self.started_at = time.monotonic()
        self.task: tuple[int, float] | None = None  # (input index, dispatch time)

    def kill(self) -> None:
        try:
            self.process.kill()
        except (OSError, ValueError):
            pass
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self, timeout: float) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()


def _shutdown(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.stop(timeout=2.0)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class MathGrader:
    """A reusable pool of math-verify worker processes with a hard per-answer timeout.

    Create once, call :meth:`grade` many times, then :meth:`close` (or use it as a context
    manager).  Workers start eagerly in ``__init__`` (about 1 s each: importing sympy).  A
    worker that exceeds ``timeout_s`` on one answer is killed with SIGKILL and replaced by a
    fresh worker, which starts in the background while the other workers keep grading; that
    answer's verdict is ``timeout``.  A worker that dies (crash, OOM kill) gives an ``error``
    verdict for its answer and is replaced as well; an idle worker found dead gets no task (the
    task goes to another worker); a replacement that dies while starting is respawned (up to 3
    times in a row).  Calls from several threads are serialised by a lock; any thread may call.

    Args:
        num_workers: worker processes (>= 1).
        timeout_s: hard wall-clock limit per answer, seconds (> 0), measured from dispatch to
            the worker until its verdict arrives.
        start_method: multiprocessing start method; ``"spawn"`` (default) is safe in processes
            that already run threads (torch); ``"forkserver"`` also works.  Note: with spawn,
            scripts that create a grader need an ``if __name__ == "__main__":`` guard.
        startup_timeout_s: seconds a new worker may take to import math-verify and report ready.
        require_value: an answer math-verify finds equivalent but that is an unevaluated expression
            (:func:`is_unevaluated_expression`: ``9 + 5`` for 14) is graded ``incorrect`` and counted in
            ``GraderStats.unevaluated`` (the ``math_verify_value`` reward; the synthetic task's held-out benchmarks).

    Raises:
        ValueError: bad arguments.
        GraderError: a worker failed to start.

    Source: docs/method.md#grading, docs/method.md#pitfalls (worker-thread math-verify with signal timeouts raises).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
        require_value: bool = False,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(startup_timeout_s, (int, float)) and startup_timeout_s > 0):
            raise ValueError(f"startup_timeout_s must be positive, got {startup_timeout_s!r}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.require_value = bool(require_value)
        self._ctx = mp.get_context(start_method)
        self._lock = threading.Lock()
        self._closed = False
        self._spawned = 0
        self._start_failures = 0
        self.total_stats = GraderStats()
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        try:
            for _ in range(num_workers):
                self._workers.append(self._new_worker())
            self._wait_all_ready()
        except BaseException:
            self._finalizer()
            self._closed = True
            raise

    # -- public API ----------------------------------------------------------------------

    def grade(self, responses: Sequence[str], golds: Sequence[str]) -> GradeBatch:
        """Grade ``responses[i]`` against ``golds[i]`` for every i.

        Args:
            responses: model responses (``str``; the response only, not the prompt).
            golds: normalised gold answers (``str``), same length.

        Returns:
            :class:`GradeBatch` with results in input order and this call's stats
            (also added to :attr:`total_stats`).

        Raises:
            TypeError: a response or gold is not a ``str`` (the message names the index).
            ValueError: the two sequences differ in length.
            GraderError: the grader is closed, or a replacement worker could not start.
        """
        responses, golds = check_text_batch(responses, golds, "grade: ")
        with self._lock:
            if self._closed:
                raise GraderError("MathGrader is closed")
            t0 = time.perf_counter()
            stats = GraderStats()
            try:
                results = self._run(responses, golds, stats)
            except BaseException:
                # Do not leave stale tasks in flight: their late answers would confuse the next call.
                for i, worker in enumerate(self._workers):
                    if worker.task is not None:
                        self._replace(i, stats)
                raise
            stats.seconds = time.perf_counter() - t0
            self.total_stats.merge(stats)
            return GradeBatch(results=results, stats=stats)

    def wait_ready(self) -> None:
        """Block until every worker (including replacements still starting) is ready.

        Raises:
            GraderError: the grader is closed, or a worker cannot start.
        """
        with self._lock:
            if self._closed:
                raise GraderError("MathGrader is closed")
            stats = GraderStats()
            self._wait_all_ready(stats)
            self.total_stats.merge(stats)

    def grade_one(self, response: str, gold: str) -> GradeResult:
        """Grade a single pair; see :meth:`grade`."""
        return self.grade([response], [gold]).results[0]

    def close(self) -> None:
        """Stop all workers (politely, then SIGKILL after 2 s).  Idempotent."""
        with self._lock:
            self._closed = True
            self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def worker_pids(self) -> list[int | None]:
        """Process ids of the current workers (for tests and diagnostics)."""
        return [w.process.pid for w in self._workers]

    def __enter__(self) -> "MathGrader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _new_worker(self) -> _Worker:
        worker = _Worker(self._ctx, self._spawned)
        self._spawned += 1
        return worker

    def _replace(self, index: int, stats: GraderStats | None) -> None:
        self._workers[index].kill()
        self._workers[index] = self._new_worker()
        if stats is not None:
            stats.worker_restarts += 1

    def _handle_startup_message(self, worker: _Worker, stats: GraderStats | None) -> None:
        """Read a starting worker's first message.  A worker that died while starting (killed from
        outside, OOM) is replaced, up to ``_MAX_START_FAILURES`` times in a row; a worker that
        reports an exception during warm-up (e.g. math-verify not importable) is fatal."""
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=5)
            self._start_failures += 1
            if self._start_failures > _MAX_START_FAILURES:
                raise GraderError(
                    f"grader worker {worker.process.name} exited during start-up (exit code "
                    f"{worker.process.exitcode}); {self._start_failures} start-up failures in a row"
                ) from None
            self._replace(self._workers.index(worker), stats)
            return
        if isinstance(msg, tuple) and msg and msg[0] == "ready":
            worker.ready = True
            self._start_failures = 0
            return
        raise GraderError(f"grader worker {worker.process.name} failed to start: {msg!r}")

    def _check_startup_deadline(self, worker: _Worker, now: float) -> None:
        if not worker.ready and now - worker.started_at > self.startup_timeout_s:
            raise GraderError(
                f"grader worker {worker.process.name} did not become ready within "
                f"{self.startup_timeout_s:.0f} s"
            )

    def _wait_all_ready(self, stats: GraderStats | None = None) -> None:
        while True:
            starting = [w for w in self._workers if not w.ready]
            if not starting:
                return
            now = time.monotonic()
            for w in starting:
                self._check_startup_deadline(w, now)
            wait_s = max(0.0, min(w.started_at + self.startup_timeout_s for w in starting) - now)
            readable = _mp_wait([w.conn for w in starting], timeout=wait_s)
            for w in starting:
                if w.conn in readable:
                    self._handle_startup_message(w, stats)

    def _run(self, responses: list[str], golds: list[str], stats: GraderStats) -> list[GradeResult]:
        n = len(responses)
        results: list[GradeResult | None] = [None] * n
        pending = deque(range(n))
        timeout = self.timeout_s

        def finish(k: int, result: GradeResult) -> None:
            if self.require_value and result.correct and is_unevaluated_expression(result.extracted):
                result = dataclasses.replace(result, correct=False, status=GradeStatus.INCORRECT, unevaluated=True)
            results[k] = result
            stats.add(result)

        while pending or any(w.task is not None for w in self._workers):
            # 1. dispatch to idle, ready workers
            for i, w in enumerate(self._workers):
                if pending and w.ready and w.task is None:
                    k = pending.popleft()
                    try:
                        w.conn.send((k, responses[k], golds[k]))
                    except (BrokenPipeError, OSError, ValueError):
                        pending.appendleft(k)  # the worker is dead: retry the task elsewhere
                        self._replace(i, stats)
                        continue
                    w.task = (k, time.monotonic())
            # 2. wait for a verdict, a start-up message, or the nearest deadline
            watched = [w for w in self._workers if w.task is not None or not w.ready]
            if not watched:
                continue
            now = time.monotonic()
            deadlines = [
                (w.task[1] + timeout) if w.task is not None else (w.started_at + self.startup_timeout_s)
                for w in watched
            ]
            readable = _mp_wait([w.conn for w in watched], timeout=max(0.0, min(deadlines) - now))
            # 3. collect messages
            for w in watched:
                if w.conn not in readable:
                    continue
                i = self._workers.index(w)
                if not w.ready:
                    self._handle_startup_message(w, stats)
                    continue
                k = w.task[0]
                try:
                    task_id, result = w.conn.recv()
                except (EOFError, OSError):
                    w.process.join(timeout=5)
                    finish(
                        k,
                        GradeResult(
                            False,
                            GradeStatus.ERROR,
                            last_boxed_content(responses[k]),
                            f"WorkerDied: grader worker exited (code {w.process.exitcode}) while grading item {k}",
                            time.monotonic() - w.task[1],
                        ),
                    )
                    w.task = None
                    self._replace(i, stats)
                    continue
                if task_id == k:
                    finish(k, result)
                    w.task = None
            # 4. enforce deadlines: kill and replace overrunning workers
            now = time.monotonic()
            for i, w in enumerate(list(self._workers)):
                if w.task is not None and now - w.task[1] >= timeout:
                    k, started = w.task
                    finish(
                        k,
                        GradeResult(
                            False,
                            GradeStatus.TIMEOUT,
                            last_boxed_content(responses[k]),
                            f"Timeout: no verdict within {timeout:g} s; worker killed and replaced",
                            now - started,
                        ),
                    )
                    w.task = None
                    self._replace(i, stats)
                else:
                    self._check_startup_deadline(w, now)
        return results  # type: ignore[return-value]
