"""Metrics tracking: a JSONL file of every step's metrics (always) plus Weights & Biases.

W&B runs in ``offline`` mode by default and never needs an API key; ``online`` syncs, ``disabled`` turns it
off (the JSONL file alone is then complete). Tables (e.g. silenced-token examples) go to W&B as
``wandb.Table`` and to ``tables.jsonl`` in the run directory.
"""
from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Literal, Sequence

__all__ = ["Tracker"]


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
        """Drop JSONL rows with step > ``step`` (rows of a crashed run that a resume will redo)."""
        for path in (self.metrics_path, self.tables_path):
            if not path.exists():
                continue
            keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in keep))

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
