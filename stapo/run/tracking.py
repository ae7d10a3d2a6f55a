"""Metrics tracking: a JSONL file of every step's metrics (always) plus the chosen backends (``logging.backends``):
Weights & Biases (``wandb``, the default), TensorBoard (``tensorboard``: every scalar at its step, in
``<run_dir>/tensorboard``; ``tensorboard --logdir runs`` shows every run of a folder with no W&B server) or ``none``.

W&B runs in ``offline`` mode by default and never needs an API key; ``online`` syncs, ``disabled`` turns it
off (the JSONL file alone is then complete). ``online`` fails fast when W&B cannot start: no credentials (checked
before ``wandb.init``, so it never prompts or waits) or a server that does not answer within a short init timeout
(:data:`INIT_TIMEOUT_S`); ``fallback`` then decides between continuing offline (one line on stderr saying so) and
a one-line :class:`TrackerError`. Tables (e.g. silenced-token examples) go to W&B as
``wandb.Table`` and to ``tables.jsonl`` in the run directory; a table logged every few steps under one name
(``log_table(..., incremental=True)``: ``completions``, ``s2t/examples``) is ONE W&B incremental table
(``wandb.Table(log_mode="INCREMENTAL")``, a ``step`` column first) that grows by each step's rows, not one panel
per step. W&B's system metrics and console capture follow ``logging.system_metrics`` / ``logging.console_capture``
(on for training runs); :meth:`Tracker.update_summary` writes values into the run's W&B summary (evaluate.py puts
its final numbers into the training run's summary this way).

Crash safety of the JSONL files (the same rule as the evaluation's :class:`~stapo.evaluation.store.GenerationStore`):
a row is written with one ``write`` of the line and its newline, so a process killed mid-write (or a full disk)
leaves at most a last line without its newline. :meth:`Tracker.truncate_after` — run at the start of every
training run, fresh or resumed — cuts such a torn tail off, counts it (:attr:`Tracker.torn_bytes`) and says so in
one line on stderr. A *complete* line that is not a JSON row with an integer ``step`` is never dropped silently:
:class:`CorruptJsonlError` names the file and the line.

Non-finite values (docs/metrics.md#non-finite-values): JSON has no NaN or infinity, so a non-finite float is written
as one of the JSON strings :data:`NONFINITE` (``"nan"``, ``"inf"``, ``"-inf"``): a reader that does not decode them
gets a string, which no mean averages in silently. :func:`read_metrics` is the one reader of ``metrics.jsonl``: it
returns those values as floats (``math.nan``, ``math.inf``, ``-math.inf``), and reads files written before this
form the way they were meant (``null`` was NaN, ``±1e308`` was ±inf).
"""
from __future__ import annotations

import contextlib
import json
import math
import netrc
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Literal, Sequence
from urllib.parse import urlsplit

__all__ = ["Tracker", "TrackerError", "INIT_TIMEOUT_S", "CorruptJsonlError", "read_jsonl_rows", "read_metrics",
           "decode_value", "NONFINITE", "TENSORBOARD_DIR"]

#: The folder of a run's TensorBoard event files (``logging.backends: [..., tensorboard]``).
TENSORBOARD_DIR = "tensorboard"

#: How a non-finite float is written to ``metrics.jsonl`` / ``tables.jsonl``: the JSON string of each value.
NONFINITE: dict[str, float] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

# files written before the NONFINITE form: +inf/-inf were clamped to ±1e308 (a value no metric reaches otherwise)
_OLD_INF = 1e308


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


def decode_value(v: Any) -> Any:
    """One ``metrics.jsonl`` value as written (:data:`NONFINITE`) → the value: ``"nan"``/``"inf"``/``"-inf"`` →
    ``math.nan``/``math.inf``/``-math.inf``; the forms of files written before it: ``None`` (``null``) → ``math.nan``,
    ``±1e308`` → ``±math.inf``; anything else unchanged."""
    if v is None:
        return math.nan
    if isinstance(v, str):
        return NONFINITE.get(v, v)
    if isinstance(v, float) and abs(v) == _OLD_INF:
        return math.copysign(math.inf, v)
    return v


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (a training run's, an evaluation's or a sweep's), with non-finite values
    as floats — the one reader of that file (module docstring).

    Every value but ``step`` goes through :func:`decode_value`: ``"nan"``, ``"inf"``, ``"-inf"`` (this form) and
    ``null``, ``±1e308`` (files written before it) become ``math.nan``, ``math.inf``, ``-math.inf``. A torn last line
    (an interrupted write) is left out, as :func:`read_jsonl_rows` does; nothing on disk changes.

    Returns:
        The rows in file order, each a dict with an integer ``step`` and its metric values (floats, ints, or
        strings that are not a non-finite form).

    Raises:
        FileNotFoundError / OSError: the file cannot be read.
        CorruptJsonlError: a complete line is not a JSON object with an integer ``step`` (file and line named).
    """
    rows, _ = read_jsonl_rows(path)
    return [{k: (v if k == "step" else decode_value(v)) for k, v in row.items()} for row in rows]


# Seconds W&B may take to start an online run (wandb's own default is 90; its retries add ~10 s on top).
# The environment variable WANDB_INIT_TIMEOUT, when set, is left to wandb instead.
INIT_TIMEOUT_S = 15.0


class TrackerError(RuntimeError):
    """W&B cannot start in the requested mode (one line saying what to do; train.py: exit 2)."""


def _wandb_credentials(wandb: Any) -> bool:
    """Whether W&B finds credentials without asking: ``WANDB_API_KEY`` / ``WANDB_IDENTITY_TOKEN_FILE``, a netrc
    entry (``NETRC`` or ``~/.netrc``, written by ``wandb login``) for the server (``WANDB_BASE_URL``, else the
    ``base_url`` of W&B's settings file, else wandb's default), or an API key in W&B's settings. An unreadable
    netrc or settings file counts as credentials (wandb then reports it)."""
    import configparser

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        settings = wandb.Settings()
        if getattr(settings, "api_key", None):
            return True
        base_url = os.environ.get("WANDB_BASE_URL")
        if not base_url:
            config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
            parser = configparser.ConfigParser()
            parser.read(config_dir / "settings")
            base_url = parser.get("default", "base_url", fallback=None) or str(settings.base_url)
        host = urlsplit(base_url).netloc
    except Exception:
        return True  # let wandb.init decide
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    if not path.exists():
        return False
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):
        return True


def _jsonable(v: Any) -> Any:
    """A value as written to the JSONL files: a non-finite float as its :data:`NONFINITE` string, a tensor or numpy
    scalar as its Python value, anything else unchanged."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if hasattr(v, "item") and callable(v.item):
        return _jsonable(v.item())
    return v


def _wandb_env() -> str:
    """``" (the environment sets WANDB_MODE='x', ...)"`` for the ``WANDB_*`` variables that are set (wandb reads
    them and fails on a bad one with its own validation message), else ``""``."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("WANDB_") and v and k != "WANDB_API_KEY"
           and k != "WANDB_SILENT"}
    return f" (the environment sets {', '.join(f'{k}={v!r}' for k, v in env.items())})" if env else ""


def _one_row_per_key(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with one row per ``step`` (metrics) or per ``(step, name)`` (tables), the last one of each, in the
    order of those last ones."""
    last = {(row["step"], row.get("name")): i for i, row in enumerate(rows)}
    return [row for i, row in enumerate(rows) if last[(row["step"], row.get("name"))] == i]


def _append_line(path: Path, line: str) -> None:
    """Append ``line`` + newline to ``path``.

    Raises:
        OSError: the write failed (full disk, quota, read-only): same errno, the message names the file. A
            partly written line is a torn last line that the next resume cuts (:meth:`Tracker.truncate_after`).
    """
    try:
        with path.open("a") as f:
            f.write(line + "\n")
    except OSError as e:
        from stapo.run.preflight import write_error

        raise write_error(e, path) from None


class Tracker:
    """Write metrics to ``<run_dir>/metrics.jsonl`` and to the backends (W&B, TensorBoard).

    Args:
        run_dir: the run directory (created if needed).
        config: plain dict logged as the run's config.
        mode: W&B mode: ``offline`` (default; files under ``<run_dir>/wandb``), ``online`` or ``disabled``.
        fallback: what ``online`` does when W&B cannot start (no credentials, no answer within
            :data:`INIT_TIMEOUT_S`): ``offline`` (default) continues offline and prints one line to stderr saying
            so and how to sync later; ``error`` raises :class:`TrackerError`. :attr:`mode` is the mode in use.
        project, entity, name: W&B run identity.
        group, tags, job_type, notes: W&B's grouping fields (``wandb.init`` arguments of the same names): runs of
            one study or config family share a ``group``; ``job_type`` is ``"train"`` or ``"eval"``.
        step_metric: when set (e.g. ``"training/global_step"``, verl's name), every W&B row carries the ``step``
            given to :meth:`log` / :meth:`log_table` under this key, every other metric is plotted against it
            (``define_metric("*", step_metric=...)``), and W&B's own ``_step`` just counts rows. This lets an
            evaluation run log a checkpoint of training step K at x = K, in any order, next to the training
            curves. ``None``: rows are logged at W&B step ``step`` (steps must then increase).
        wandb_step: with ``step_metric``, also log each row at W&B's own step ``step`` (steps must then increase).
            Training runs set it: a resumed offline run writes a new offline folder whose rows must continue the
            old ones' W&B steps, or ``wandb sync`` would drop them as out of order. Evaluation runs leave it off
            (a sweep may log a checkpoint below one already logged).
        backends: ``logging.backends``: ``"wandb"`` (with ``mode``), ``"tensorboard"`` (every scalar of
            :meth:`log` at its step as a TensorBoard scalar in ``<run_dir>/tensorboard``; tables are not written
            there; a resume purges the events at or after its first logged step, as a crashed run's rows are cut
            from the JSONL file) and/or ``"none"``. Without ``"wandb"`` W&B is off (:attr:`mode` ``disabled``).
        system_metrics: W&B samples the machine's CPU / GPU utilisation and memory in the background (its
            ``system/*`` charts); off: ``x_disable_stats``.
        console_capture: W&B keeps the process's stdout / stderr as the run's logs (``console="auto"``); off:
            ``console="off"``.
        The W&B run id is stored in ``<run_dir>/wandb_run_id``, so a resumed run (or an evaluation that writes
        into its summary) appends to the same W&B run.

    Raises:
        TrackerError: (a RuntimeError) W&B cannot start in the requested mode and cannot fall back (the message,
            one line, says how to switch it offline or off); or ``"tensorboard"`` is asked for and the
            ``tensorboard`` package is not installed.
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
        fallback: Literal["offline", "error"] = "offline",
        group: str | None = None,
        tags: Sequence[str] | None = None,
        job_type: str | None = None,
        notes: str | None = None,
        step_metric: str | None = None,
        wandb_step: bool = False,
        backends: Sequence[str] = ("wandb",),
        system_metrics: bool = False,
        console_capture: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.step_metric = step_metric
        self.wandb_step = wandb_step
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.tables_path = self.run_dir / "tables.jsonl"
        self._wandb = None
        self._tables: dict[str, Any] = {}  # incremental W&B tables by name
        self._tb = None  # the TensorBoard SummaryWriter, opened at the first row (its purge step)
        self.tensorboard_dir = self.run_dir / TENSORBOARD_DIR if "tensorboard" in backends else None
        if self.tensorboard_dir is not None:
            try:
                import torch.utils.tensorboard  # noqa: F401  (needs the tensorboard package)
            except ImportError:
                raise TrackerError("logging.backends has tensorboard but the tensorboard package is not installed: "
                                   "pip install tensorboard (requirements-dev.txt), or drop it from "
                                   "logging.backends") from None
        self.mode = mode if "wandb" in backends else "disabled"
        if self.mode == "disabled":
            return
        mode = self.mode
        import wandb

        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        os.environ.setdefault("WANDB_SILENT", "true")
        if mode == "online" and not _wandb_credentials(wandb):  # wandb would prompt (a terminal) or fail later
            self.mode = self._fall_back("no W&B API key (set WANDB_API_KEY or run `wandb login`)", fallback)
        timeout = {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": INIT_TIMEOUT_S}

        def init(m: str) -> Any:
            run = wandb.init(project=project, entity=entity, name=name, id=run_id, resume="allow",
                             dir=str(self.run_dir), mode=m, config=config, group=group,
                             tags=list(tags) if tags else None, job_type=job_type, notes=notes,
                             settings=wandb.Settings(console="auto" if console_capture else "off",
                                                     x_disable_stats=not system_metrics, **timeout))
            if step_metric:
                run.define_metric(step_metric)
                run.define_metric("*", step_metric=step_metric)
            return run

        try:
            self._wandb = init(self.mode)
        except Exception as e:  # e.g. the server does not answer
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if self.mode != "online":
                raise TrackerError(f"W&B failed to start in mode {self.mode!r}{_wandb_env()}: {reason}. "
                                   f"Use logging.wandb_mode=disabled.") from None
            self.mode = self._fall_back(f"W&B did not start online{_wandb_env()} ({reason})", fallback)
            with contextlib.suppress(Exception):  # the failed run holds its id in wandb's service for a while
                wandb.teardown()
            for attempt in range(6):  # the same id (a resume appends to the same W&B run), at last a new one
                if attempt == 5:
                    run_id = uuid.uuid4().hex[:8]
                    id_file.write_text(run_id)
                try:
                    self._wandb = init(self.mode)
                    break
                except Exception as e2:
                    if attempt == 5:
                        raise TrackerError(f"W&B failed to start offline either: {e2}. "
                                           f"Use logging.wandb_mode=disabled.") from None
                    time.sleep(1.0)

    def _fall_back(self, reason: str, fallback: str) -> str:
        """``offline`` after printing one line (``fallback="offline"``), else raise :class:`TrackerError`."""
        if fallback != "offline":
            raise TrackerError(f"{reason}; use logging.wandb_mode=offline (sync later with `wandb sync`) or "
                               f"disabled, or logging.wandb_fallback=offline to continue offline")
        print(f"W&B: {reason}; logging offline instead (logging.wandb_fallback=offline); upload later with "
              f"`wandb sync {self.run_dir / 'wandb'}/offline-run-*`", file=sys.stderr, flush=True)
        return "offline"

    @property
    def wandb_dir(self) -> Path | None:
        """The W&B run's local directory (offline runs keep their files here), or None."""
        return Path(self._wandb.dir).parent if self._wandb is not None else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step's metrics (a flat dict of scalars) to the JSONL file, W&B and TensorBoard (its numeric
        values, as scalars at ``step``)."""
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        _append_line(self.metrics_path, json.dumps(row))
        if self._wandb is not None:
            self._wandb_log(step, dict(metrics))
        if self.tensorboard_dir is not None:
            self._tensorboard_log(step, row)

    def _tensorboard_log(self, step: int, row: dict[str, Any]) -> None:
        """The row's numbers as TensorBoard scalars at ``step`` (non-finite ones as NaN / ±inf; strings and
        booleans left out). The writer opens at the first row with ``purge_step`` = its step, so a resumed run
        drops the events a crashed launch wrote at or after it."""
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=step)
        for key, value in row.items():
            value = decode_value(value)
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, float(value), global_step=step)
        self._tb.flush()

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
                  incremental: bool = False) -> None:
        """Log a table (e.g. ``s2t/examples``) to W&B and ``tables.jsonl`` (one row per call: step, name, columns,
        rows).

        ``incremental``: in W&B the name is ONE incremental table (``wandb.Table(log_mode="INCREMENTAL")``) that
        grows by these rows at each call — with a first column ``step`` when ``columns`` has none — instead of a
        new table (one panel per step when the name holds the step; only the latest when it does not). A resumed
        launch starts a new incremental table under the same name (W&B shows each launch's part).
        """
        _append_line(self.tables_path, json.dumps({"step": step, "name": name, "columns": list(columns),
                                                   "rows": [[_jsonable(c) for c in r] for r in rows]}))
        if self._wandb is None:
            return
        import wandb

        if not incremental:
            self._wandb_log(step, {name: wandb.Table(columns=list(columns), data=[list(r) for r in rows])})
            return
        with_step = "step" not in columns
        table = self._tables.get(name)
        if table is None:
            table = self._tables[name] = wandb.Table(columns=(["step"] if with_step else []) + list(columns),
                                                     log_mode="INCREMENTAL")
        for r in rows:
            table.add_data(*([step] if with_step else []), *r)
        self._wandb_log(step, {name: table})

    def update_summary(self, values: dict[str, Any]) -> None:
        """Write ``values`` into the W&B run's summary (the runs table's columns; a key already there is
        replaced). No-op without W&B."""
        if self._wandb is not None:
            self._wandb.summary.update(dict(values))

    def _wandb_log(self, step: int, row: dict[str, Any]) -> None:
        """One W&B row at ``step``: under ``step_metric`` (and as W&B's step with ``wandb_step``; else W&B's
        ``_step`` counts rows), or as W&B's step."""
        if self.step_metric:
            self._wandb.log({**row, self.step_metric: step}, step=step if self.wandb_step else None)
        else:
            self._wandb.log(row, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop JSONL rows with step > ``step`` (rows of a crashed run that a resume will redo) from
        ``metrics.jsonl`` and ``tables.jsonl``, and a torn last line (an interrupted write; its bytes are added to
        :attr:`torn_bytes` and one line on stderr names the file), and repeated rows of one step (one line on
        stderr; the last row of the step is kept). Each file is rewritten atomically (a temporary
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
            kept = _one_row_per_key([row for row in rows if row["step"] <= step])
            if len(kept) < sum(row["step"] <= step for row in rows):
                print(f"{path}: dropped {sum(row['step'] <= step for row in rows) - len(kept)} repeated row(s) (a "
                      f"step logged twice; the last one is kept)", file=sys.stderr, flush=True)
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("w") as f:
                f.write("".join(json.dumps(row) + "\n" for row in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

    def finish(self) -> None:
        """Close the backends: finish the W&B run (an offline one is complete on disk then) and close the
        TensorBoard writer."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
