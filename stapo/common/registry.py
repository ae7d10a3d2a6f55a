"""The two operations of every name → entry registry in stapo (token masks, objectives, loss formulas, rollout
backends): add under a new name, look a name up. The registries themselves stay plain dicts
(:data:`stapo.core.masks.MASKS`, :data:`stapo.core.objectives.OBJECTIVES`, :data:`stapo.core.objectives.POLICY_LOSSES`,
:data:`stapo.rollout.BACKENDS`); these functions only give them one wording of their errors.
"""
from __future__ import annotations

from typing import TypeVar

__all__ = ["ExtensionError", "add_entry", "check_new", "lookup"]

T = TypeVar("T")


class ExtensionError(ValueError):
    """A registered extension (a token mask, a loss formula) broke its contract at run time: a keep-mask of the
    wrong shape or dtype, tokens silenced outside the mask's ``maskable_rows`` rule, a loss formula without its
    flags. The message is one line naming the extension and the fix (train.py prints it, exit code 2)."""


def add_entry(table: dict[str, T], kind: str, name: str, entry: T) -> T:
    """``table[name] = entry``; returns ``entry``.

    Args:
        table: the registry.
        kind: what an entry is, for the message (``"objective"``, ``"token mask"``...).

    Raises:
        ValueError: ``name`` is already in ``table`` (``"<kind> '<name>' is already registered"``).
    """
    check_new(table, kind, name)
    table[name] = entry
    return entry


def check_new(table: dict[str, object], kind: str, name: str) -> None:
    """Raises ``ValueError`` (``"<kind> '<name>' is already registered"``) when ``name`` is in ``table``."""
    if name in table:
        raise ValueError(f"{kind} {name!r} is already registered")


def lookup(table: dict[str, T], kind: str, name: str) -> T:
    """``table[name]``.

    Raises:
        KeyError: an unknown name (``"unknown <kind> '<name>'; valid names: [<sorted names>]"``).
    """
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; valid names: {sorted(table)}") from None
