"""The held-out split shared by the generated tasks (:mod:`stapo.tasks.synthetic`, :mod:`stapo.tasks.word_problems`).

A problem is *held out* when the SHA-256 of its text falls in a fixed tenth of the hash range, whatever the seed,
count or levels that drew it; the generators' ``split="train"`` never returns a held-out problem and
``split="test"`` only held-out ones, so a policy trained on the train split is evaluated on problems it has never
seen. Its own dependency-free module so that both generators import it without importing each other.
"""
from __future__ import annotations

import hashlib

__all__ = ["HELDOUT_MODULUS", "is_heldout"]

#: One problem in ``HELDOUT_MODULUS`` (by the hash of its text) belongs to the held-out split.
HELDOUT_MODULUS = 10


def is_heldout(problem: str) -> bool:
    """Whether a problem text is in the held-out split: ``int(sha256(text)[:8 bytes]) % HELDOUT_MODULUS == 0``.

    Example: of the 81 level-1 arithmetic problems (``"What is a + b?"``, 1 <= a, b <= 9) about 8 are held out; the
    split depends on the text only, so it is the same for every seed, count and level mix.
    """
    digest = hashlib.sha256(problem.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0
