"""One writer per run folder: an advisory lock held for the whole of a ``train.py`` or ``evaluate.py`` run.

``train.py`` locks its run directory (``trainer.output_dir/<run_name>``; under ``torchrun`` rank 0 alone) and
``evaluate.py`` its output directory (``output.dir``) by creating ``<folder>/run.lock`` and taking an exclusive
``fcntl.flock`` on it. The lock file holds the holder's identity as one JSON object —
``{"pid", "host", "started" (UTC, ISO 8601), "program"}`` — so that a second process can name it:

    train.py: runs/toy is in use by train.py (pid 4242 on host gpu1, started 2026-12-01T15:00:00+00:00;
    lock file runs/toy/run.lock): wait for it to finish or stop it, or choose another run folder

The kernel drops an ``flock`` when its process dies, however it dies (SIGKILL, OOM), so a lock file left
behind by a dead process never blocks: the next run takes it over and says so on stderr (naming the previous
holder). A clean exit deletes the lock file. Where the file system refuses ``flock`` (some FUSE / Lustre
mounts), the holder's identity decides instead: a live pid on this host holds the folder, a dead one is
taken over, and a holder on another host is refused (delete the lock file once that process is gone) — best
effort: two processes starting in the same instant could both pass.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

__all__ = ["LOCK_NAME", "RunLock", "RunLockError", "Holder"]

LOCK_NAME = "run.lock"

_HELD: dict[str, int] = {}  # lock file → its descriptor, held by this process (a second RunLock on it is refused)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLockError(RuntimeError):
    """The folder is in use by another live process. The message is one line: the folder, the holder (pid, host,
    start time, program), the lock file and what to do."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: ``pid`` and ``host`` of the process, ``started`` (UTC, ISO 8601) and
    ``program`` (``train.py`` / ``evaluate.py`` / the script's name)."""

    pid: int
    host: str
    started: str
    program: str = "?"

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder written in a lock file, or None (empty or unreadable: a writer that has not written yet)."""
        try:
            d = json.loads(text)
            return cls(pid=int(d["pid"]), host=str(d["host"]), started=str(d.get("started", "?")),
                       program=str(d.get("program", "?")))
        except (ValueError, KeyError, TypeError):
            return None


def _forget_in_child() -> None:
    """A forked child (a grader pool worker, ...) closes its copies of the held lock files: the lock stays with
    the parent alone, and dies with it even when the child lives on."""
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie counts; another user's process counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RunLock:
    """The lock of one run folder (a context manager: ``with RunLock(folder, "train.py"): ...``).

    Args:
        folder: the run folder; created (with its parents) by :meth:`acquire` when missing, and removed again by
            :meth:`release` when the lock file was all it ever held.
        program: the name written into the lock file and used as the prefix of the takeover line.
        announce: where the one-line takeover notice goes (default: stderr).

    Attributes:
        path: ``<folder>/run.lock``.
        took_over: the previous holder whose stale lock :meth:`acquire` took over, or None.
    """

    def __init__(self, folder: str | os.PathLike, program: str | None = None,
                 announce: Callable[[str], None] = _stderr) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.program = program or (Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python")
        self.announce = announce
        self.took_over: Holder | None = None
        self._fd: int | None = None
        self._created_folder = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock (non-blocking) and write this process into the lock file. Returns ``self``.

        Raises:
            RunLockError: another live process holds the folder (one line naming the folder and the holder).
            OSError: the folder or the lock file cannot be created (e.g. a read-only file system).
        """
        if self._fd is not None:
            return self
        key = str(self.path.absolute())
        if key in _HELD:
            raise self._in_use(self._read_holder(retry=False), "this same process")
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            self._created_folder = True
        for _ in range(100):  # retried only when the lock file was replaced while we were taking it
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                have_flock = self._flock(fd)
            except BaseException:
                os.close(fd)
                raise
            if have_flock and not self._same_file(fd):  # its holder deleted it on release: take the new one
                os.close(fd)
                continue
            break
        else:  # pragma: no cover - a folder whose lock file keeps being replaced
            raise RunLockError(f"{self.folder}: could not take its lock file {self.path} (it keeps being replaced)")
        try:
            previous = Holder.parse(os.pread(fd, 65536, 0).decode("utf-8", "replace"))
            reason = self._stale_reason(previous, have_flock)
            me = Holder(pid=os.getpid(), host=socket.gethostname(),
                        started=datetime.now(timezone.utc).isoformat(timespec="seconds"), program=self.program)
            data = (json.dumps(asdict(me)) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _HELD[key] = fd
        if previous is not None:
            self.took_over = previous
            self.announce(f"{self.program}: took over the stale lock of {self.folder} ({previous.program}, "
                          f"{previous.describe()}): {reason}")
        return self

    def check_free(self) -> None:
        """Look, without taking it, whether another live process holds the folder: a cheap check before minutes
        of loading a model (:meth:`acquire` still decides). Creates and writes nothing.

        Raises:
            RunLockError: the lock file is locked by another process (one line naming the folder and the holder).
        """
        if str(self.path.absolute()) in _HELD:  # this process holds it: acquire() reports that case
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # no lock file (or unreadable): nobody holds it, or acquire() will say why
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            raise self._in_use(self._read_holder()) from None
        except OSError:  # a file system without flock: acquire() decides by the holder's identity
            pass
        finally:
            os.close(fd)

    def release(self) -> None:
        """Delete the lock file and drop the lock (nothing when not held). Removes the folder again when
        :meth:`acquire` created it and the lock file was all it held."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if _HELD.get(str(self.path.absolute())) != fd:  # a forked child: its copy is closed already
            return
        del _HELD[str(self.path.absolute())]
        try:
            if self._same_file(fd):
                self.path.unlink()  # while still locked: a process waiting on this file sees it replaced
        except OSError:
            pass
        finally:
            os.close(fd)  # drops the flock
        if self._created_folder:
            try:
                self.folder.rmdir()  # only when empty
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------------------------------------
    def _flock(self, fd: int) -> bool:
        """Take the flock → True; False when the file system has no flock (the holder's identity decides).

        Raises:
            RunLockError: another process holds it.
        """
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            raise self._in_use(self._read_holder()) from None
        except OSError as e:
            if e.errno in _NO_FLOCK:
                return False
            raise

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        fs = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (fs.st_dev, fs.st_ino)

    def _stale_reason(self, previous: Holder | None, have_flock: bool) -> str:
        """Why ``previous`` (the lock file's holder) no longer holds the folder.

        Raises:
            RunLockError: without flock: ``previous`` is alive on this host, or runs on another host.
        """
        if previous is None:
            return ""
        here = previous.host == socket.gethostname()
        alive = here and previous.pid != os.getpid() and _pid_alive(previous.pid)
        if not have_flock:
            if alive:
                raise self._in_use(previous)
            if not here:
                raise self._in_use(previous, what_to_do=f"this file system has no flock, so a holder on another "
                                                         f"host cannot be checked: once that process is gone, "
                                                         f"delete {self.path}")
        if here and not alive:
            return "that process is gone"
        if here:
            return f"pid {previous.pid} is alive but does not hold the lock (a reused pid)"
        return "no process holds the lock any more"

    def _read_holder(self, retry: bool = True) -> Holder | None:
        """The current holder named in the lock file; waits up to 2 s for a holder that is still writing it."""
        for attempt in range(20 if retry else 1):
            try:
                holder = Holder.parse(self.path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                holder = None
            if holder is not None:
                return holder
            if retry:
                time.sleep(0.1)
        return None

    def _in_use(self, holder: Holder | None, what: str | None = None, what_to_do: str | None = None) -> RunLockError:
        who = what or (f"{holder.program} ({holder.describe()}; lock file {self.path})" if holder is not None
                       else f"another process (lock file {self.path})")
        if what is None and holder is not None and holder.host == socket.gethostname() and not _pid_alive(holder.pid):
            who += f" — pid {holder.pid} is gone, but a process it started still holds the lock"
        what_to_do = what_to_do or "wait for it to finish or stop it, or choose another folder"
        return RunLockError(f"{self.folder} is in use by {who}: {what_to_do}")
