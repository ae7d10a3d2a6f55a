"""The JustRL/STAPO prompt: the problem, a blank line, then the boxed-answer instruction.

``"<problem>\\n\\nPlease reason step by step, and put your final answer within \\boxed{}."``

This is the string JustRL appends to every training prompt (thunlp/JustRL
``train/verl/utils/dataset/rl_dataset.py``, ``use_boxed_suffix_prompt``: ``content + "\\n\\n" +
suffix``) and that STAPO reuses (docs/method.md#training-recipe).  It is sent as the single user message through the
tokenizer's chat template when the model has one (instruct models; verl does the same with
``apply_chat_template(..., add_generation_prompt=True)``), or used as plain text (base models).
The switch is a config value: ``"auto"`` (template if the tokenizer has one), ``True`` or ``"chat"``
(require it) or ``False`` or ``"plain"`` (plain text).
"""
from __future__ import annotations

from typing import Any, Literal, Sequence, Union

__all__ = [
    "BOXED_SUFFIX",
    "PROMPT_SEPARATOR",
    "ChatTemplateSetting",
    "user_content",
    "uses_chat_template",
    "format_prompt",
    "format_prompts",
    "encode_prompt",
]

BOXED_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT_SEPARATOR = "\n\n"

ChatTemplateSetting = Union[bool, Literal["auto", "chat", "plain"]]


def user_content(problem: str) -> str:
    """``problem + "\\n\\n" + BOXED_SUFFIX`` (the user message / plain-text prompt).

    Raises:
        TypeError: ``problem`` is not a ``str``.
        ValueError: ``problem`` is empty or whitespace.
    """
    if not isinstance(problem, str):
        raise TypeError(f"problem must be str, got {type(problem).__name__}")
    if not problem.strip():
        raise ValueError("problem is empty")
    return problem + PROMPT_SEPARATOR + BOXED_SUFFIX


def _has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def uses_chat_template(tokenizer: Any, use_chat_template: ChatTemplateSetting = "auto") -> bool:
    """Resolve the config switch for a tokenizer.

    Args:
        tokenizer: a transformers tokenizer, or ``None`` (plain text only).
        use_chat_template: ``"auto"``, ``True`` / ``"chat"`` or ``False`` / ``"plain"``.

    Returns:
        Whether the chat template will be applied.

    Raises:
        ValueError: ``use_chat_template`` is not one of those values, or asks for the template while
            the tokenizer is ``None`` or has no ``chat_template``.
    """
    if use_chat_template == "auto":
        return _has_chat_template(tokenizer)
    if use_chat_template is True or use_chat_template == "chat":
        if not _has_chat_template(tokenizer):
            name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
            raise ValueError(
                f"use_chat_template=True but tokenizer {name!r} has no chat_template "
                "(use 'auto' or False for base models)"
            )
        return True
    if use_chat_template is False or use_chat_template == "plain":
        return False
    raise ValueError(f"use_chat_template must be 'auto', True/'chat' or False/'plain', got {use_chat_template!r}")


def _messages(problem: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": user_content(problem)})
    return messages


def format_prompt(
    problem: str,
    tokenizer: Any = None,
    *,
    use_chat_template: ChatTemplateSetting = "auto",
    system_prompt: str | None = None,
) -> str:
    """The prompt text for one problem.

    Args:
        problem: the problem statement (no instruction).
        tokenizer: transformers tokenizer (needed for the chat template); ``None`` = plain text.
        use_chat_template: ``"auto"`` / ``True`` / ``"chat"`` / ``False`` / ``"plain"``
            (see :func:`uses_chat_template`).
        system_prompt: optional system message (chat template only; JustRL/STAPO use none).

    Returns:
        With the template: ``tokenizer.apply_chat_template([user], tokenize=False,
        add_generation_prompt=True)`` (ends with the assistant header); without:
        :func:`user_content` (a ``system_prompt`` is then rejected).

    Raises:
        TypeError / ValueError: bad problem or switch (see :func:`user_content`,
            :func:`uses_chat_template`); ``system_prompt`` given for a plain-text prompt.

    Source: docs/method.md#training-recipe; JustRL ``rl_dataset.py``.
    """
    if uses_chat_template(tokenizer, use_chat_template):
        text = tokenizer.apply_chat_template(
            _messages(problem, system_prompt), tokenize=False, add_generation_prompt=True
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
        return text
    if system_prompt:
        raise ValueError("system_prompt needs the chat template (use_chat_template is off or unavailable)")
    return user_content(problem)


def format_prompts(
    problems: Sequence[str],
    tokenizer: Any = None,
    *,
    use_chat_template: ChatTemplateSetting = "auto",
    system_prompt: str | None = None,
) -> list[str]:
    """:func:`format_prompt` for each problem (errors name the index)."""
    out = []
    for i, problem in enumerate(problems):
        try:
            out.append(format_prompt(problem, tokenizer, use_chat_template=use_chat_template, system_prompt=system_prompt))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"problems[{i}]: {exc}") from None
    return out


def encode_prompt(
    problem: str,
    tokenizer: Any,
    *,
    use_chat_template: ChatTemplateSetting = "auto",
    system_prompt: str | None = None,
) -> list[int]:
    """Token ids of :func:`format_prompt`.

    The chat-template text already contains the model's special tokens, so it is encoded with
    ``add_special_tokens=False`` (as verl does); a plain-text prompt is encoded with
    ``add_special_tokens=True`` (a BOS for tokenizers that add one).

    Returns:
        ``list[int]``.

    Raises:
        ValueError: ``tokenizer`` is ``None``; otherwise as :func:`format_prompt`.
    """
    if tokenizer is None:
        raise ValueError("encode_prompt needs a tokenizer")
    templated = uses_chat_template(tokenizer, use_chat_template)
    text = format_prompt(problem, tokenizer, use_chat_template=templated, system_prompt=system_prompt)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
