"""``\\boxed{...}`` extraction shared by the rewards, the grader and the data loaders.

Kept in its own dependency-free module so that grader worker processes, the strict-box reward and
the Minerva gold-answer extraction all use one implementation (and importing it never pulls in
math-verify or sympy).

Source: the brace-matching scan of verl's ``verl/utils/reward_score/math_dapo.py``
(``last_boxed_only_string`` / ``remove_boxed``), which JustRL uses unchanged for its
"DAPO strict box" training reward (thunlp/JustRL ``train/verl/utils/reward_score/math_dapo.py``).
"""
from __future__ import annotations

BOX_OPEN = "\\boxed{"


def last_boxed_only_string(text: str) -> str | None:
    """Return the last ``\\boxed{...}`` of ``text`` (command and braces included), or ``None``.

    The scan starts at the last occurrence of ``\\boxed{`` and matches braces, so nested
    braces (``\\boxed{\\frac{1}{\\sqrt{2}}}``) are returned whole.  As in verl, only the *last*
    ``\\boxed{`` is considered: if it is never closed (a truncated response), the result is
    ``None`` even when an earlier, closed box exists.  ``\\boxed 5`` (no braces) and ``\\fbox``
    are not recognised.

    Args:
        text: any string (a model response, a reference solution).

    Returns:
        ``str`` such as ``"\\boxed{34}"``, or ``None`` when there is no closed last box.

    Raises:
        TypeError: ``text`` is not a ``str``.

    Source: verl ``math_dapo.last_boxed_only_string`` (JustRL copy is identical).
    """
    if not isinstance(text, str):
        raise TypeError(f"last_boxed_only_string expects str, got {type(text).__name__}")
    start = text.rfind(BOX_OPEN)
    end = _box_end(text, start) if start >= 0 else None
    return None if end is None else text[start:end]


def _box_end(text: str, start: int) -> int | None:
    """Index just past the brace that closes the ``\\boxed{`` at ``start`` (braces matched), or None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def first_boxed_end(text: str) -> int | None:
    """Index just past the closing brace of the *first* ``\\boxed{...}`` of ``text`` (braces matched), or ``None``.

    The scan starts at the first occurrence of ``\\boxed{``; ``None`` when there is none or it is never closed (a
    later box would sit inside it). ``text[:first_boxed_end(text)]`` is the text up to and including that box;
    ``rollout.stop_at_first_boxed`` ends a response there (:func:`stapo.rollout.boxed_cut.cut_at_first_boxed`).
    Example: ``"so 3. \\boxed{\\frac{1}{2}} and \\boxed{7}"`` → 25 (the end of ``\\boxed{\\frac{1}{2}}``).

    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"first_boxed_end expects str, got {type(text).__name__}")
    start = text.find(BOX_OPEN)
    return _box_end(text, start) if start >= 0 else None


def remove_boxed(boxed: str) -> str:
    """Strip the ``\\boxed{`` prefix and the closing ``}`` from a string returned by
    :func:`last_boxed_only_string`.

    Args:
        boxed: ``"\\boxed{<content>}"``.

    Returns:
        ``"<content>"`` (not stripped of whitespace).

    Raises:
        ValueError: ``boxed`` does not start with ``\\boxed{`` or does not end with ``}``
            (verl asserts instead; an explicit error is friendlier).

    Source: verl ``math_dapo.remove_boxed``.
    """
    if not (boxed.startswith(BOX_OPEN) and boxed.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} string: {boxed[:80]!r}")
    return boxed[len(BOX_OPEN) : -1]


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` of ``text`` (see :func:`last_boxed_only_string`),
    or ``None`` when there is none."""
    boxed = last_boxed_only_string(text)
    return None if boxed is None else remove_boxed(boxed)


def strip_answer_decorations(answer: str) -> str:
    """Light clean-up of an extracted answer: repeatedly strip surrounding whitespace, one leading
    ``$``, one trailing unescaped ``$`` and one trailing ``.`` until nothing changes.

    Inner spaces are kept (``"1, 2"`` stays ``"1, 2"``); an escaped trailing ``\\$`` is kept.
    Examples: ``" 34 "`` -> ``"34"``; ``"$34$."`` -> ``"34"``; ``"3.5"`` -> ``"3.5"``.

    Args:
        answer: the raw string.

    Returns:
        The cleaned string (possibly empty).

    Raises:
        TypeError: ``answer`` is not a ``str``.

    Source: docs/method.md#training-reward ("exact string after light normalisation"; verl applies none).
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer must be str, got {type(answer).__name__}")
    s = answer.strip()
    while True:
        before = s
        if s.startswith("$"):
            s = s[1:].strip()
        if s.endswith("$") and not s.endswith("\\$"):
            s = s[:-1].strip()
        if s.endswith("."):
            s = s[:-1].strip()
        if s == before:
            return s
