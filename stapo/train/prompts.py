"""Training prompts: loading and tokenising the training set, and their seeded, resumable order."""
from __future__ import annotations

from typing import Any

import numpy as np

from stapo.tasks.data import DataError, file_set_name, load_file_set, load_train_set
from stapo.tasks.prompts import encode_prompt

__all__ = ["PromptLoader", "load_prompts"]

Prompt = tuple[list[int], str, str]  # (prompt token ids, gold answer, record id)


def load_prompts(cfg: Any, tokenizer: Any) -> tuple[list[Prompt], dict[str, float]]:
    """The training set of ``cfg.data`` → (prompts, counts).

    ``data.train_set``: ``synthetic`` or ``word`` (generated arithmetic or word problems, ``data.synthetic``), ``file``
    (the user's JSONL / parquet, ``data.train_file`` with its field mapping; source name = the file's stem) or a
    registered training set read from ``data.root``. Prompts are encoded with ``data.prompt_style`` /
    ``data.system_prompt``; those longer than ``data.max_prompt_length`` tokens are dropped and counted.

    Returns:
        (list of (prompt ids, gold, record id), ``{"data/num_prompts", "data/num_dropped_too_long",
        "data/num_skipped_rows", "data/num_unparsable_gold"}`` as floats). ``data/num_unparsable_gold``: golds of a
        training file that math-verify cannot parse (:func:`stapo.tasks.golds.check_golds`: one line on stderr; their
        prompts are kept, the ``math_verify`` rewards grade them as grader errors); 0 for a generated set.

    Raises:
        stapo.tasks.data.DataError: unreadable or empty file, missing column (naming the file and the key); more than
            ``data.max_unparsable_gold_fraction`` of the file's golds unparsable (file, count, first rows); or no prompt
            left (every row skipped or longer than ``data.max_prompt_length``): one line naming the source, the rows
            read / skipped / too long and the key to change.
    """
    dc = cfg.data
    if dc.train_set in ("synthetic", "word"):  # generated: the arithmetic or the word-problem task
        records = load_train_set(dc.train_set, n=dc.synthetic.num_problems, seed=dc.synthetic.seed,
                                 levels=tuple(dc.synthetic.levels), split=dc.synthetic.split)
    elif dc.train_set == "file":
        name = file_set_name(dc.train_file)
        records = load_file_set(name, dc.train_file, key="data.train_file")
    else:
        records = load_train_set(dc.train_set, dc.root)
    unparsable = 0
    if records.stats.path:  # a file (not a generated set): golds the grader cannot parse, one line (rank 0), refused
        # above data.max_unparsable_gold_fraction
        from stapo.tasks.golds import check_golds

        unparsable = check_golds([r.answer for r in records], where=records.stats.path or dc.train_set,
                                 key="data.max_unparsable_gold_fraction",
                                 max_fraction=dc.max_unparsable_gold_fraction, rows=records.rows,
                                 report=_rank0_report, consequence=_unparsable_consequence(cfg)).count
    out, dropped = [], 0
    for rec in records:
        ids = encode_prompt(rec.problem, tokenizer, use_chat_template=dc.prompt_style, system_prompt=dc.system_prompt)
        if len(ids) > dc.max_prompt_length:
            dropped += 1
            continue
        out.append((ids, rec.answer, rec.id))
    if not out:
        raise _no_prompts_error(dc, records.stats, dropped)
    stats = {"data/num_prompts": float(len(out)), "data/num_dropped_too_long": float(dropped),
             "data/num_skipped_rows": float(records.stats.skipped), "data/num_unparsable_gold": float(unparsable)}
    return out, stats


def _unparsable_consequence(cfg: Any) -> str:
    """What the gold report says becomes of a training prompt whose gold math-verify cannot parse, per reward."""
    if cfg.algorithm.reward == "strict_box":
        return ("their prompts are kept: algorithm.reward=strict_box compares the boxed answer with the gold as text, "
                "so only a response repeating it scores +1")
    return ("their prompts are kept: the math-verify reward scores -1 unless a response repeats the gold as text, "
            "counted in reward/grader/errors (GoldUnparseable), not as wrong answers")


def _rank0_report(line: str) -> None:
    """One line on stderr from rank 0 only (every rank loads the prompts under torchrun)."""
    import os
    import sys

    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _no_prompts_error(dc: Any, stats: Any, too_long: int) -> Exception:
    """The one-line :class:`stapo.tasks.data.DataError` for a training set that left no prompt: the source (the file of
    ``data.train_file.path`` or the set's name), rows read / skipped (with the reasons) / too long, and the key to
    change (``data.max_prompt_length`` for too-long prompts, the field mapping for skipped rows)."""
    if dc.train_set == "file":
        source = f"data.train_file.path={stats.path}"
        mapping = [f"data.train_file.{k}" for k in ("problem_key", "answer_key")]
        if dc.train_file.id_key is not None:
            mapping.append("data.train_file.id_key")
        fix_skipped = f"check {' / '.join(mapping)}"
    else:
        source = f"data.train_set={dc.train_set}" + (f" ({stats.path})" if stats.path else "")
        fix_skipped = "check the file (scripts/prepare_data.py builds it)"
    skipped = f"{stats.skipped} skipped"
    if stats.skipped:
        skipped += " (" + "; ".join(f"{reason}: {n}" for reason, n in list(stats.skipped_by_reason.items())[:3])
        skipped += "; ...)" if len(stats.skipped_by_reason) > 3 else ")"
    fixes = ([fix_skipped] if stats.skipped or not stats.rows_read else []) + (
        ["raise data.max_prompt_length"] if too_long else [])
    return DataError(f"no training prompts from {source}: {stats.rows_read} rows read, {skipped}, {too_long} longer "
                     f"than data.max_prompt_length={dc.max_prompt_length} tokens"
                     + (f"; {', and '.join(fixes)}" if fixes else ""))


class PromptLoader:
    """Seeded, resumable iteration over training prompts: a fresh permutation each epoch.

    Args:
        prompts: list of (prompt token ids, gold answer, record id).
        batch_size: prompts per step.
        seed: the epoch-e permutation is ``np.random.default_rng([seed, e]).permutation``.
        shuffle: False keeps file order.

    Raises:
        ValueError: no prompts.
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int, shuffle: bool = True):
        if not prompts:
            raise ValueError("no training prompts (all dropped or empty data set)")  # load_prompts names the cause
        self.prompts = prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def next_batch(self) -> list[Prompt]:
        out = []
        while len(out) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[int(self._order[self.position])])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position"}``, and ``"order"`` (the epoch's prompt indices) while the epoch's order is not
        the seed's permutation (the first epoch of a fork, :meth:`branch`)."""
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position}
        if not np.array_equal(self._order, self._permutation(self.epoch)):
            state["order"] = [int(i) for i in self._order]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        order = state.get("order")
        if order is not None and len(order) != len(self.prompts):
            raise ValueError(f"the loader state's order has {len(order)} prompts, the training set {len(self.prompts)}")
        self._order = np.asarray(order, dtype=np.int64) if order is not None else self._permutation(self.epoch)

    def branch(self, state: dict[str, Any], source_seed: int) -> None:
        """Continue another run's loader (``state``: its :meth:`state_dict`; ``source_seed``: its seed) under this
        loader's seed — a fork (``trainer.init_from``).

        The epoch and position are the source's. The prompts the source drew in this epoch keep their places; the
        rest of the epoch (the source's order from the position on) is permuted by
        ``np.random.default_rng([seed, epoch, position])``, and later epochs are this seed's permutations. So no
        prompt comes twice within the epoch, and the prompts of every later step are a function of (this seed, the
        step) for a given source checkpoint: two forks with one seed draw the same prompts. With the source's seed
        (or ``shuffle`` off) the order is the source's own: the fork continues the source exactly.

        Example: 6 prompts, source order [4, 0, 5, 1, 3, 2] at position 2 → [4, 0] + a permutation of [5, 1, 3, 2].
        """
        source = PromptLoader(self.prompts, self.batch_size, source_seed, self.shuffle)
        source.load_state_dict(state)
        self.epoch, self.position, self._order = source.epoch, source.position, source._order
        if source_seed != self.seed and self.shuffle:
            rest = np.random.default_rng([self.seed, self.epoch, self.position]).permutation(
                self._order[self.position:])
            self._order = np.concatenate([self._order[:self.position], rest])
