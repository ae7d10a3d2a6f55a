"""Metrics tracking: a JSONL file of every step's metrics (always) plus Weights & Biases.

W&B runs in ``offline`` mode by default and never needs an API key; ``online`` syncs, ``disabled`` turns it
off (the JSONL file alone is then complete). Tables (e.g. silenced-token examples) go to W&B as
``wandb.Table`` and to ``tables.jsonl`` in the run directory.

Crash safety of the JSONL files (the same rule as the evaluation's :class:`~stapo.evaluation.store.GenerationStore`):
a row is written with one ``write`` of the line and its newline, so a process killed mid-write (or a full disk)
leaves at most a last line without its newline. :meth:`Tracker.truncate_after` — run at the start of every
training run, fresh or resumed — cuts such a torn tail off, counts it (:attr:`Tracker.torn_bytes`) and says so in
one line on stderr. A *complete* line that is not a JSON row with an integer ``step`` is never dropped silently:
:class:`CorruptJsonlError` names the file and the line.
"""
from __future__ import annotations

import json
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Literal, Sequence

__all__ = ["Tracker", "CorruptJsonlError", "read_jsonl_rows"]


class CorruptJsonlError(ValueError):
    """A complete (newline-terminated) line of a run's JSONL file is not a valid row. The message is one line:
    the file, the line number and what to do."""


def read_jsonl_rows(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """The rows of a metrics / tables JSONL file and the bytes of its torn tail (nothing is changed on disk).

    A last line without its newline is an interrupted write: when it does not parse as a row it is left out
    and its length in bytes returned (a complete row that only lacks the newline is kept).

    Returns:
        ``(rows, torn_bytes)``: each row a dict with an integer ``step``, in file order.

    Raises:
        CorruptJsonlError: a complete line (or an unterminated last one that parses) is not a JSON object with an
            integer ``step``, naming the file and the line.
    """
    path = Path(path)
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1  # where the unterminated last line starts (len(data): there is none)
    body, tail = data[:cut], data[cut:]
    rows: list[dict[str, Any]] = []
    lines = body.decode("utf-8", "replace").splitlines()
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            rows.append(_row(path, lineno, line))
    torn = 0
    if tail:
        try:
            rows.append(_row(path, len(lines) + 1, tail.decode("utf-8")))
        except (CorruptJsonlError, UnicodeDecodeError):
            torn = len(tail)
    return rows, torn


def _row(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError("not a JSON object with an integer 'step'")
    except ValueError as e:
        raise CorruptJsonlError(f"{path}: line {lineno} is not a valid row ({e}) and is not a torn last line, so it "
                                f"is not dropped: delete that line (or move the file away) and rerun") from None
    return row


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    if hasattr(v, "item") and callable(v.item):
        return _jsonable(v.item())
    return v


class Tracker:
    """Write metrics to ``<run_dir>/metrics.jsonl`` and to W&B.

    Args:
        run_dir: the run directory (created if needed).
        config: plain dict logged as the run's config.
        mode: W&B mode: ``offline`` (default; files under ``<run_dir>/wandb``), ``online`` or ``disabled``.
        project, entity, name: W&B run identity.
        resume_id: the W&B run id to continue (stored in ``<run_dir>/wandb_run_id``), so a resumed run
            appends to the same W&B run.

    Raises:
        RuntimeError: W&B cannot start in the requested mode (the message says how to disable it).
    """

    torn_bytes: int = 0  # bytes of torn last lines cut off by truncate_after

    def __init__(
        self,
        run_dir: str | Path,
        config: dict[str, Any],
        *,
        mode: Literal["offline", "online", "disabled"] = "offline",
        project: str = "stapo",
        entity: str | None = None,
        name: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.tables_path = self.run_dir / "tables.jsonl"
        self._wandb = None
        if mode != "disabled":
            import wandb

            id_file = self.run_dir / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
            id_file.write_text(run_id)
            os.environ.setdefault("WANDB_SILENT", "true")
            try:
                self._wandb = wandb.init(
                    project=project, entity=entity, name=name, id=run_id, resume="allow",
                    dir=str(self.run_dir), mode=mode, config=config,
                    settings=wandb.Settings(console="off", x_disable_stats=True),
                )
            except Exception as e:  # e.g. online without credentials
                raise RuntimeError(f"W&B failed to start in mode {mode!r}: {e}. "
                                   f"Use logging.wandb_mode=offline or disabled.") from e

    @property
    def wandb_dir(self) -> Path | None:
        """The W&B run's local directory (offline runs keep their files here), or None."""
        return Path(self._wandb.dir).parent if self._wandb is not None else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step's metrics (a flat dict of scalars) to the JSONL file and to W&B."""
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Log a table (e.g. ``s2t/examples``) to W&B and ``tables.jsonl``."""
        with self.tables_path.open("a") as f:
            f.write(json.dumps({"step": step, "name": name, "columns": list(columns),
                                "rows": [[_jsonable(c) for c in r] for r in rows]}) + "\n")
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop JSONL rows with step > ``step`` (rows of a crashed run that a resume will redo) from
        ``metrics.jsonl`` and ``tables.jsonl``, and a torn last line (an interrupted write; its bytes are added to
        :attr:`torn_bytes` and one line on stderr names the file). Each file is rewritten atomically (a temporary
        file, fsync'ed, then renamed over it). ``step < 0`` empties both files (nothing is kept, nothing parsed).

        Raises:
            CorruptJsonlError: a complete line is not a valid row (the message names the file and the line);
                the file is left as it was.
        """
        for path in (self.metrics_path, self.tables_path):
            if not path.exists():
                continue
            rows, torn = read_jsonl_rows(path) if step >= 0 else ([], 0)
            if torn:
                self.torn_bytes += torn
                print(f"{path}: cut {torn} bytes of a torn last line (an interrupted write)", file=sys.stderr,
                      flush=True)
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("w") as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows if row["step"] <= step))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
