"""Seeded multi-step word problems: a reasoning task whose length is set by the problem (issue 32, item 2).

A problem follows one person's count of one kind of item through K operations on small integers, e.g. (K = 3)::

    Ana has 4 bags with 5 marbles in each bag. She gives away 6 marbles. Then she finds 3 more marbles.
    How many marbles does Ana have now?

with the gold ``"17"``. Its reference solution (:func:`reference_solution`; the one-shot example of
:data:`WORD_SYSTEM_PROMPT` is one) writes one numbered step per event with its calculation and ends with the box::

    Step 1: Ana has 4 bags with 5 marbles in each bag, so she has 4 * 5 = 20 marbles.
    Step 2: She gives away 6 marbles, so she has 20 - 6 = 14 marbles.
    Step 3: She finds 3 more marbles, so she has 14 + 3 = 17 marbles.
    The final answer is \\boxed{17}.

so a correct answer needs written steps whose length grows with K (about 30 SmolLM2 tokens a step; the measured
token counts of the reference solutions are in docs/method.md#word-problem-task).

The events and the operations they take (:data:`OPERATIONS`): a start with containers (``b * e``, 1) or a plain count
(0); give away / lose ``x`` (``-``, 1); find / get ``x`` more (``+``, 1); buy ``m`` containers of ``e`` (``*`` then
``+``, 2); the count doubles or triples (``*``, 1); give half away (``/ 2``, 1); and, only as the last event, split
everything into ``k`` equal piles (``/ k``, 1; the question then asks for one pile). Every intermediate value is an
integer in ``[1, max_value]`` (differences stay positive, divisions are exact). Level = K + 10 × scale:

====== ========== ======= ============================ ============ ============= =========== ======= =========
level  operations scale   events                       containers   per container plain start amounts max value
====== ========== ======= ============================ ============ ============= =========== ======= =========
2-4    2-4        easy    plain start, give, add       –            –             3-9         2-9     20
12-14  2-4        small   all                          2-5          2-6           5-20        2-9     60
22-24  2-4        large   all                          3-9          4-12          10-60       3-30    300
====== ========== ======= ============================ ============ ============= =========== ======= =========

(small: buy 2-3 containers, double, split into 2-5 piles; large: buy 2-5, double or triple, split into 2-9).

Splits and benchmarks as for the arithmetic task (:mod:`stapo.tasks.synthetic`): :func:`stapo.tasks.splits.is_heldout`
on the problem text; ``generate_word_problems(split="train")`` never returns a held-out problem, ``split="test"`` only
held-out ones, each once. The generated benchmarks ``word_test`` (levels 2-4), ``word_mid`` (12-14) and ``word_hard``
(22-24) are registered in :data:`stapo.tasks.synthetic.GENERATED_BENCHMARKS`; the training set is ``data.train_set:
word`` (``data.synthetic`` gives its count, levels, seed and split; :func:`stapo.tasks.data.load_train_set`).

Not from the paper: a CPU-scale task for the mechanism study (../shared/notes/MECHANISM_STUDY_DESIGN.md, B3).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal, Sequence

from stapo.tasks.records import Record
from stapo.tasks.splits import is_heldout

__all__ = [
    "SOURCE",
    "WordLevel",
    "WORD_LEVELS",
    "DEFAULT_WORD_LEVELS",
    "OPERATIONS",
    "Event",
    "WordProblem",
    "WORD_EXAMPLE",
    "WORD_SYSTEM_PROMPT",
    "make_word_problem",
    "generate_word_problems",
    "parse_word_problem",
    "reference_solution",
]

SOURCE = "synthetic_word"


@dataclass(frozen=True)
class WordLevel:
    """One difficulty level: how many operations and how large the numbers (ranges inclusive).

    Attributes:
        level: the level's number, ``operations + 10 × scale`` (easy 0, small 1, large 2).
        operations: K, the arithmetic operations of the reference solution (2-4).
        scale: ``"easy"``, ``"small"`` or ``"large"`` (the ranges below).
        group_count / group_size: containers at the start, items per container (start and purchases).
        start: a plain starting count.
        amount: items given away, lost, found or received.
        buy_count: containers bought.
        factors: what the count may be multiplied by (2 = doubles, 3 = triples).
        share: the number of equal piles of the final split.
        max_value: every intermediate value is at most this.
        events: the event kinds the level draws after its start (the start itself: with containers only where
            ``"buy"`` is among them, else a plain count).
    """

    level: int
    operations: int
    scale: Literal["easy", "small", "large"]
    group_count: tuple[int, int]
    group_size: tuple[int, int]
    start: tuple[int, int]
    amount: tuple[int, int]
    buy_count: tuple[int, int]
    factors: tuple[int, ...]
    share: tuple[int, int]
    max_value: int
    events: tuple[str, ...] = ("give", "add", "buy", "times", "half", "share")


_EASY = dict(scale="easy", group_count=(2, 5), group_size=(2, 6), start=(3, 9), amount=(2, 9), buy_count=(2, 3),
             factors=(2,), share=(2, 5), max_value=20, events=("give", "add"))
_SMALL = dict(scale="small", group_count=(2, 5), group_size=(2, 6), start=(5, 20), amount=(2, 9), buy_count=(2, 3),
              factors=(2,), share=(2, 5), max_value=60)
_LARGE = dict(scale="large", group_count=(3, 9), group_size=(4, 12), start=(10, 60), amount=(3, 30),
              buy_count=(2, 5), factors=(2, 3), share=(2, 9), max_value=300)
WORD_LEVELS: dict[int, WordLevel] = {
    **{k: WordLevel(k, k, **_EASY) for k in (2, 3, 4)},
    **{10 + k: WordLevel(10 + k, k, **_SMALL) for k in (2, 3, 4)},
    **{20 + k: WordLevel(20 + k, k, **_LARGE) for k in (2, 3, 4)},
}
DEFAULT_WORD_LEVELS: tuple[int, ...] = (2, 3, 4)
#: Arithmetic operations each event kind takes.
OPERATIONS: dict[str, int] = {"start_groups": 1, "start_plain": 0, "give": 1, "add": 1, "buy": 2, "times": 1,
                              "half": 1, "share": 1}
_WEIGHTS: dict[str, int] = {"give": 3, "add": 3, "buy": 2, "times": 1, "half": 1, "share": 1}

_NAMES: tuple[tuple[str, str], ...] = (
    ("Sam", "he"), ("Ana", "she"), ("Ben", "he"), ("Mia", "she"), ("Leo", "he"), ("Zoe", "she"), ("Tom", "he"),
    ("Eva", "she"), ("Max", "he"), ("Lily", "she"), ("Omar", "he"), ("Nina", "she"), ("Raj", "he"), ("Kim", "she"),
    ("Dan", "he"), ("Rosa", "she"),
)
#: item → (container, containers)
_ITEMS: dict[str, tuple[str, str]] = {
    "apples": ("box", "boxes"), "pens": ("pack", "packs"), "marbles": ("bag", "bags"),
    "stickers": ("sheet", "sheets"), "cookies": ("tray", "trays"), "eggs": ("carton", "cartons"),
    "pencils": ("box", "boxes"), "beads": ("jar", "jars"), "candies": ("bag", "bags"), "crayons": ("box", "boxes"),
    "cards": ("pack", "packs"), "oranges": ("basket", "baskets"), "shells": ("bucket", "buckets"),
    "buttons": ("jar", "jars"),
}
_PRONOUNS = {"he": {"He": "He", "he": "he", "his": "his"}, "she": {"He": "She", "he": "she", "his": "her"}}

# Each event is "<subject> <phrase>." in the problem and "<subject> <phrase>, <calculation>." in the solution, so the
# solution repeats the problem's words. {number} / {size} are the event's numbers.
_PHRASES: dict[str, tuple[str, ...]] = {
    "start_groups": ("{name} has {number} {containers} with {size} {items} in each {container}",),
    "start_plain": ("{name} has {number} {items}",),
    "give": ("{He} gives away {number} {items}", "{He} gives {number} {items} to a friend",
             "{He} loses {number} {items}"),
    "add": ("{He} finds {number} more {items}", "{He} gets {number} more {items} from a friend"),
    "buy": ("{He} buys {number} {containers} with {size} {items} in each {container}",),
    "times": ("The number of {items} {he} has doubles", "The number of {items} {he} has triples"),
    "half": ("{He} gives half of {his} {items} to {his} brother", "{He} gives half of {his} {items} to {his} sister"),
    "share": ("{He} puts all of {his} {items} into {number} equal piles",),
}
_CALCULATIONS: dict[str, str] = {
    "start_groups": "so {he} has {number} * {size} = {value} {items}",
    "give": "so {he} has {prev} - {number} = {value} {items}",
    "add": "so {he} has {prev} + {number} = {value} {items}",
    "buy": "which is {number} * {size} = {bought} {items}, so {he} has {prev} + {bought} = {value} {items}",
    "times": "so {he} has {prev} * {number} = {value} {items}",
    "half": "so {he} has {prev} / 2 = {value} {items}",
    "share": "so each pile has {prev} / {number} = {value} {items}",
}
_QUESTION = "How many {items} does {name} have now?"
_SHARE_QUESTION = "How many {items} are in each pile?"
_FINAL = "The final answer is \\boxed{{{value}}}."


@dataclass(frozen=True)
class Event:
    """One sentence of a problem.

    Attributes:
        kind: a key of :data:`OPERATIONS`.
        number: containers (``start_groups``, ``buy``), the starting count (``start_plain``), the amount (``give``,
            ``add``), the factor (``times``: 2 or 3), the piles (``share``), 2 (``half``).
        size: items per container (``start_groups``, ``buy``), else 0.
        variant: which wording of the kind (an index into its phrases; ``times``: 0 = doubles, 1 = triples).
    """

    kind: str
    number: int
    size: int = 0
    variant: int = 0


def _apply(prev: int, event: Event) -> int:
    """The count after ``event`` (``prev`` before it)."""
    k, n = event.kind, event.number
    if k == "start_groups":
        return n * event.size
    if k == "start_plain":
        return n
    if k == "give":
        return prev - n
    if k == "add":
        return prev + n
    if k == "buy":
        return prev + n * event.size
    if k == "times":
        return prev * n
    if k in ("half", "share"):
        if prev % n:
            raise ValueError(f"{prev} does not divide by {n}")
        return prev // n
    raise ValueError(f"unknown event kind {k!r}; known: {', '.join(OPERATIONS)}")


@dataclass(frozen=True)
class WordProblem:
    """A word problem as its parts: who, which item, and the events (the first is a start).

    Attributes:
        name: the person (a first name).
        pronoun: ``"he"`` or ``"she"``.
        items: the item, plural (a key of the item table, which gives its container).
        events: the start event then one or more others; a ``share`` only last.
    """

    name: str
    pronoun: Literal["he", "she"]
    items: str
    events: tuple[Event, ...]

    def _words(self) -> dict[str, str]:
        container, containers = _ITEMS[self.items]
        return {"name": self.name, "items": self.items, "container": container, "containers": containers,
                **_PRONOUNS[self.pronoun]}

    def values(self) -> list[int]:
        """The count after each event (``len(events)`` ints; the last is the answer)."""
        out, prev = [], 0
        for event in self.events:
            prev = _apply(prev, event)
            out.append(prev)
        return out

    @property
    def answer(self) -> int:
        """The exact answer (a positive integer)."""
        return self.values()[-1]

    @property
    def operations(self) -> int:
        """K: the arithmetic operations of the reference solution (:data:`OPERATIONS` summed over the events)."""
        return sum(OPERATIONS[e.kind] for e in self.events)

    def _phrase(self, event: Event) -> str:
        return _PHRASES[event.kind][event.variant].format(number=event.number, size=event.size, **self._words())

    @property
    def text(self) -> str:
        """The problem statement: one sentence per event (``"Then "`` before the third and later ones), then the
        question."""
        sentences = []
        for i, event in enumerate(self.events):
            phrase = self._phrase(event)
            sentences.append(("Then " + phrase[0].lower() + phrase[1:] if i >= 2 else phrase) + ".")
        last = self.events[-1].kind == "share"
        sentences.append((_SHARE_QUESTION if last else _QUESTION).format(**self._words()))
        return " ".join(sentences)

    def solution(self) -> str:
        """The reference worked solution: ``"Step i: <event>, <calculation>."`` per event (a plain start:
        ``"<name> starts with <n> <items>."``), one per line, then ``"The final answer is \\boxed{<answer>}."``."""
        lines, prev = [], 0
        for i, (event, value) in enumerate(zip(self.events, self.values()), start=1):
            if event.kind == "start_plain":
                body = f"{self.name} starts with {value} {self.items}."
            else:
                calc = _CALCULATIONS[event.kind].format(number=event.number, size=event.size, prev=prev, value=value,
                                                        bought=event.number * event.size, **self._words())
                body = f"{self._phrase(event)}, {calc}."
            lines.append(f"Step {i}: {body}")
            prev = value
        lines.append(_FINAL.format(value=prev))
        return "\n".join(lines)


#: The one-shot example of :data:`WORD_SYSTEM_PROMPT` (level 13; a training problem, not held out).
WORD_EXAMPLE = WordProblem("Ana", "she", "marbles", (Event("start_groups", 4, 5), Event("give", 6), Event("add", 3)))
#: The system prompt of the word task (configs/cpu_smollm2_word_justrl.yaml ``data.system_prompt``): the instruction
#: and :data:`WORD_EXAMPLE` with its reference solution.
WORD_SYSTEM_PROMPT = ("Solve the word problem step by step. Write each step on its own line with its calculation, "
                      "then end with the final answer in a box, like this example.\n"
                      f"Question: {WORD_EXAMPLE.text}\nAnswer:\n{WORD_EXAMPLE.solution()}")


def _draw_event(rng: random.Random, spec: WordLevel, kind: str, prev: int) -> Event | None:
    """One event of ``kind`` that keeps the count in ``[1, spec.max_value]`` after ``prev``, or None when none can."""
    lo, hi = spec.amount
    if kind == "give":
        top = min(hi, prev - 1)
        return Event("give", rng.randint(lo, top), variant=rng.randrange(len(_PHRASES["give"]))) if top >= lo else None
    if kind == "add":
        top = min(hi, spec.max_value - prev)
        return Event("add", rng.randint(lo, top), variant=rng.randrange(len(_PHRASES["add"]))) if top >= lo else None
    if kind == "buy":
        pairs = [(m, e) for m in range(spec.buy_count[0], spec.buy_count[1] + 1)
                 for e in range(spec.group_size[0], spec.group_size[1] + 1) if prev + m * e <= spec.max_value]
        if not pairs:
            return None
        m, e = rng.choice(pairs)
        return Event("buy", m, e)
    if kind == "times":
        factors = [f for f in spec.factors if prev * f <= spec.max_value]
        if not factors:
            return None
        f = rng.choice(factors)
        return Event("times", f, variant=f - 2)
    if kind == "half":
        return Event("half", 2, variant=rng.randrange(len(_PHRASES["half"]))) if prev % 2 == 0 and prev >= 4 else None
    if kind == "share":
        piles = [k for k in range(spec.share[0], spec.share[1] + 1) if prev % k == 0 and prev // k >= 2]
        return Event("share", rng.choice(piles)) if piles else None
    raise ValueError(f"unknown event kind {kind!r}")


def make_word_problem(rng: random.Random, level: int) -> WordProblem:
    """Draw one problem of ``level`` (a key of :data:`WORD_LEVELS`) from ``rng``: a start with containers (half the
    time) or a plain count, then events (weighted give 3 : add 3 : buy 2 : times 1 : half 1 : split 1, the split
    only last) until the operations add up to the level's K.

    Raises:
        ValueError: unknown level.
    """
    if level not in WORD_LEVELS:
        raise ValueError(f"unknown word-problem level {level!r}; known: {sorted(WORD_LEVELS)}")
    spec = WORD_LEVELS[level]
    while True:  # a dead end (no event fits) draws again; rare
        name, pronoun = rng.choice(_NAMES)
        items = rng.choice(sorted(_ITEMS))
        if "buy" in spec.events and rng.random() < 0.5:
            events = [Event("start_groups", rng.randint(*spec.group_count), rng.randint(*spec.group_size))]
        else:
            events = [Event("start_plain", rng.randint(*spec.start))]
        prev, left = _apply(0, events[0]), spec.operations - OPERATIONS[events[0].kind]
        while left > 0:
            kinds = [k for k in spec.events if OPERATIONS[k] <= left and (k != "share" or left == 1)]
            options = [(k, e) for k in kinds if (e := _draw_event(rng, spec, k, prev)) is not None]
            if not options:
                break
            kind, event = rng.choices(options, weights=[_WEIGHTS[k] for k, _ in options])[0]
            events.append(event)
            prev, left = _apply(prev, event), left - OPERATIONS[kind]
        if left == 0:
            return WordProblem(name, pronoun, items, tuple(events))


Split = Literal["all", "train", "test"]


def generate_word_problems(
    n: int = 2048,
    seed: int = 0,
    levels: Sequence[int] = DEFAULT_WORD_LEVELS,
    split: Split = "all",
) -> list[Record]:
    """Generate ``n`` word problems, levels round-robin (record i has level ``levels[i % len(levels)]``),
    deterministic for a given ``(n, seed, levels, split)`` (as :func:`stapo.tasks.synthetic.generate_arithmetic`).

    Args:
        n: number of problems (>= 0).
        seed: RNG seed.
        levels: keys of :data:`WORD_LEVELS`.
        split: ``"all"`` (every draw), ``"train"`` (held-out draws are redrawn,
            :func:`stapo.tasks.splits.is_heldout`) or ``"test"`` (only held-out problems, each at most once).

    Returns:
        ``list[Record]`` with ``id = "synthetic_word/L<level>/<i>"`` (``.../test/L<level>/<i>`` for the test
        split), ``answer = str(int)``, ``source = "synthetic_word"``.

    Raises:
        ValueError: ``n < 0``, empty ``levels``, an unknown level or split.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    levels = tuple(levels)
    if not levels:
        raise ValueError("levels must not be empty")
    unknown = [lv for lv in levels if lv not in WORD_LEVELS]
    if unknown:
        raise ValueError(f"unknown word-problem levels {unknown}; known: {sorted(WORD_LEVELS)}")
    if split not in ("all", "train", "test"):
        raise ValueError(f"unknown split {split!r}; known: all, train, test")
    rng = random.Random(seed)
    records: list[Record] = []
    seen: set[str] = set()
    for i in range(n):
        level = levels[i % len(levels)]
        for _ in range(100_000):  # a held-out draw is 1 in 10, and the problem space is large
            problem = make_word_problem(rng, level)
            text = problem.text
            if split == "all" or (split == "train" and not is_heldout(text)):
                break
            if split == "test" and is_heldout(text) and text not in seen:
                seen.add(text)
                break
        else:  # pragma: no cover - the space of every level has far more than 10^5 problems
            raise ValueError(f"cannot draw {n} problems of split {split} at level {level}")
        rid = f"{SOURCE}/test/L{level}/{i}" if split == "test" else f"{SOURCE}/L{level}/{i}"
        records.append(Record(id=rid, problem=text, answer=str(problem.answer), source=SOURCE))
    return records


# --- reading a problem back (for reference solutions of any record) ---------------------------------------------
_FIELDS = {"name": r"[A-Z][a-z]+", "number": r"\d+", "size": r"\d+", "items": r"[a-z]+", "container": r"[a-z]+",
           "containers": r"[a-z]+", "He": r"He|She", "he": r"he|she", "his": r"his|her"}


def _pattern(phrase: str) -> re.Pattern:
    """A phrase template as a regex: each field a named group, its repeats backreferences."""
    out, seen, pos = [], set(), 0
    for m in re.finditer(r"\{(\w+)\}", phrase):
        out.append(re.escape(phrase[pos:m.start()]))
        key = m.group(1)
        out.append(f"(?P={key})" if key in seen else f"(?P<{key}>{_FIELDS[key]})")
        seen.add(key)
        pos = m.end()
    out.append(re.escape(phrase[pos:]))
    return re.compile("".join(out))


_PATTERNS = [(kind, v, _pattern(p)) for kind, phrases in _PHRASES.items() for v, p in enumerate(phrases)]


def parse_word_problem(text: str) -> WordProblem:
    """Read a problem written by :attr:`WordProblem.text` back into its parts (``parse(p.text) == p``).

    Raises:
        ValueError: ``text`` is not a problem of this generator (naming the sentence that does not fit).
    """
    sentences = re.findall(r"[^.?]+[.?]", text.strip())
    if len(sentences) < 3:
        raise ValueError(f"not a word problem (needs a start, an event and a question): {text[:80]!r}")
    events, words = [], {}
    for i, sentence in enumerate(s.strip() for s in sentences[:-1]):
        body = sentence[:-1]
        if i >= 2:
            if not body.startswith("Then "):
                raise ValueError(f"sentence {i + 1} does not start with 'Then ': {sentence!r}")
            body = body[5].upper() + body[6:]
        for kind, variant, pattern in _PATTERNS:
            m = pattern.fullmatch(body)
            if m and (i == 0) == kind.startswith("start") and (kind != "share" or i == len(sentences) - 2):
                break
        else:
            raise ValueError(f"sentence {i + 1} is no event of the word task: {sentence!r}")
        got = m.groupdict()
        for key, value in got.items():
            if key in ("number", "size"):
                continue
            if key in ("He", "he", "his"):
                key, value = "pronoun", {"He": "he", "he": "he", "his": "he"}.get(value, "she")
            if words.setdefault(key, value) != value:
                raise ValueError(f"sentence {i + 1} changes the {key} ({words[key]!r} → {value!r}): {sentence!r}")
        number = int(got.get("number") or (2 if kind == "half" else variant + 2 if kind == "times" else 0))
        events.append(Event(kind, number, int(got.get("size") or 0), variant))
    items = words.get("items", "")
    if items not in _ITEMS:
        raise ValueError(f"unknown item {items!r} in {text[:80]!r}")
    problem = WordProblem(words["name"], words.get("pronoun", _pronoun_of(words["name"])), items, tuple(events))
    if problem.text != text.strip():
        raise ValueError(f"not written by the word-problem generator (its re-rendering differs): {text[:80]!r}")
    return problem


def _pronoun_of(name: str) -> str:
    return dict(_NAMES).get(name, "he")


def reference_solution(problem: str | WordProblem) -> str:
    """The reference worked solution of a problem (a :class:`WordProblem` or its text, e.g. a record's
    ``problem``): :meth:`WordProblem.solution`.

    Raises:
        ValueError: the text is not a problem of this generator (:func:`parse_word_problem`).
    """
    return (problem if isinstance(problem, WordProblem) else parse_word_problem(problem)).solution()
