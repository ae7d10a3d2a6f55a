"""Checks that run before a model loads (train.py, evaluate.py): an unusable output folder, a device that is not
there or a tokenizer without the chat template the config asks for is one line naming the key, found in seconds
rather than after minutes of loading (docs/runs.md, "Errors and exit codes").

Every check raises :class:`stapo.config.ConfigError` (a usage error: train.py / evaluate.py exit 2) whose message
starts with the key and its value, says what is wrong and what to do.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from stapo.config import ConfigError

__all__ = ["check_writable", "check_device", "check_tokenizer", "check_chat_template", "os_reason", "write_error"]


def check_writable(folder: str | os.PathLike, key: str) -> Path:
    """Whether ``folder`` can be written: a small probe file is written, flushed and removed in ``folder`` or, when
    it does not exist yet, in its nearest existing parent (nothing is created: a run that then stops on another
    error leaves no empty folder behind).

    Args:
        folder: the run / output folder a job is about to write.
        key: the config key it comes from (named in the error), e.g. ``"trainer.output_dir"``.

    Returns:
        ``folder`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: a parent is a file, or a file cannot be written there (read-only file system, permissions,
            no space left): ``"invalid value for 'trainer.output_dir': cannot write to runs/x: [Errno 30]
            Read-only file system; choose a writable folder"``.
    """
    path = Path(folder)
    where = path
    while not where.exists() and where != where.parent:  # the nearest existing folder (or file) on the way
        where = where.parent
    if not where.is_dir():
        raise ConfigError(f"invalid value for {key!r}: cannot write to {path}: {where} is a file; choose a "
                          f"writable folder")
    probe = where / f".stapo_write_probe.{socket.gethostname()}.{os.getpid()}"
    try:
        with open(probe, "wb") as f:  # a few bytes: a full disk or a quota refuses them too
            f.write(b"stapo write probe\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ConfigError(f"invalid value for {key!r}: cannot write to {path}: {os_reason(e)}; "
                          f"choose a writable folder") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return path


def os_reason(e: OSError) -> str:
    """``[Errno 30] Read-only file system`` (without the file name, which the caller's message names)."""
    return f"[Errno {e.errno}] {e.strerror}" if e.errno is not None and e.strerror else str(e)


def write_error(e: OSError, path: str | os.PathLike) -> OSError:
    """The same kind of OSError, same errno, with a message that names the file a failed write was for:
    ``[Errno 28] cannot write runs/x/metrics.jsonl: No space left on device`` (a full disk, a quota)."""
    return type(e)(e.errno, f"cannot write {path}: {e.strerror or e}")


def check_device(device: str, key: str) -> None:
    """``device`` (``auto`` / ``cpu`` / ``cuda`` / ``cuda:N``) is usable in this process.

    Raises:
        ConfigError: ``cuda`` asked for and torch sees no GPU (no GPU, no driver, a CPU-only torch build, or
            ``CUDA_VISIBLE_DEVICES`` hiding them), or ``cuda:N`` beyond the visible GPUs; the message says to use
            ``auto`` or ``cpu``.
    """
    if not str(device).startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "torch sees no GPU"
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if torch.version.cuda is not None and hidden is not None:
            why += f" (CUDA_VISIBLE_DEVICES={hidden!r})"
        raise ConfigError(f"invalid value for {key!r} ({device}): {why}; use {key}=auto or {key}=cpu")
    index = str(device).partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise ConfigError(f"invalid value for {key!r} ({device}): {torch.cuda.device_count()} GPU(s) visible; "
                          f"use cuda:0..cuda:{torch.cuda.device_count() - 1}, auto or cpu")


def check_chat_template(tokenizer: Any, prompt_style: Any, key: str, model: str) -> None:
    """The tokenizer has a chat template when ``prompt_style`` asks for it (``chat`` / True).

    Args:
        tokenizer: the loaded tokenizer.
        prompt_style: the config value (``chat``, ``plain``, ``auto``, True / False).
        key: its config key (``data.prompt_style``, ``prompt.style``).
        model: the model the tokenizer belongs to (named in the message).

    Raises:
        ConfigError: ``chat`` asked for and the tokenizer has no ``chat_template`` (a base model): use ``plain``.
    """
    if prompt_style is True or prompt_style == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"invalid value for {key!r} (chat): the tokenizer of {model} has no chat template "
                              f"(a base model?); use {key}=plain")


def check_tokenizer(tokenizer: Any, key: str, model: str) -> None:
    """The tokenizer turns a short problem into tokens (a folder whose tokenizer files are missing can load as a
    tokenizer without a vocabulary, and every prompt would be empty).

    Raises:
        ConfigError: the probe text encodes to no token ids.
    """
    ids = tokenizer("What is 1 + 1?", add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError(f"invalid value for {key!r} ({model}): its tokenizer encodes text to no tokens (are "
                          f"tokenizer.json / tokenizer_config.json missing from the folder?)")
