"""Reports from results.json dicts: the paper's table (Markdown), a long CSV, a bar chart (PNG) and W&B.

Paper layout (docs/method.md#headline-numbers): one row per checkpoint/method, one column per benchmark (AIME24,
AIME25, AMC23,
MATH500, Minerva, OlympiadBench) plus their average, each cell ``first-setting (second-setting)`` —
T=1.0 first, T=0.7 in parentheses with the default settings — in percent with two decimals. The same
functions serve ``evaluate.py`` (one row) and ``scripts/compare.py`` (several results.json merged). A checkpoint
sweep (:mod:`stapo.evaluation.sweep`) gets accuracy against the training step instead (``sweep.csv`` / ``.md`` /
``.png``); W&B rows are logged at the training step (:data:`STEP_METRIC`).
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from stapo.evaluation.errors import EvalError
from stapo.evaluation.metrics import GRADER_STATUSES, validation_metrics
from stapo.run.runlock import RunLock, RunLockError
from stapo.run.tracking import Tracker, TrackerError
from stapo.tasks.data import BENCHMARK_REGISTRY, BENCHMARKS

__all__ = [
    "DISPLAY_NAMES",
    "load_results",
    "table_columns",
    "table_settings",
    "paper_table",
    "markdown_table",
    "detail_markdown",
    "csv_rows",
    "write_csv",
    "plot_bars",
    "write_reports",
    "write_comparison",
    "STEP_METRIC",
    "result_step",
    "wandb_identity",
    "log_wandb",
    "WANDB_LOGGED",
    "SWEEP_METRICS",
    "sweep_rows",
    "sweep_markdown",
    "plot_sweep",
    "write_sweep_reports",
]

DISPLAY_NAMES = {b.name: b.display for b in BENCHMARK_REGISTRY}  # column titles, from the registry
AVERAGE = "average"
_MISSING = "–"


def _title(bench: str) -> str:
    """Column title: the registry's display name, ``"Avg"`` for the average, a custom benchmark's own name."""
    return "Avg" if bench == AVERAGE else DISPLAY_NAMES.get(bench, bench)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _pct(x: Any) -> str:
    return f"{100 * x:.2f}" if _finite(x) else _MISSING


def _clean(x: Any) -> Any:
    """Non-finite floats → ``None`` (results.json stays strict JSON), recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def load_results(path: str | os.PathLike, label: str | None = None) -> dict[str, Any]:
    """Read a results.json (a file, or a run directory holding one); ``label`` replaces its row name.

    Raises:
        EvalError: missing file, invalid JSON, or no ``metrics`` / ``label`` (the message names the file).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise EvalError(f"results file not found: {p}")
    try:
        res = json.loads(p.read_text())
    except ValueError as e:
        raise EvalError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(res, dict) or "metrics" not in res or "label" not in res:
        raise EvalError(f"{p}: not an evaluate.py results.json (no 'metrics' / 'label')")
    if label:
        res["label"] = label
    return res


def table_settings(results: Sequence[dict[str, Any]]) -> list[str]:
    """Decoding-setting names in table order: the first result's order, then new names as they appear."""
    names: list[str] = []
    for res in results:
        for s in res.get("protocol", {}).get("settings", []) or [{"name": k} for k in res["metrics"]]:
            if s["name"] not in names:
                names.append(s["name"])
    return names


def table_columns(results: Sequence[dict[str, Any]]) -> list[str]:
    """Benchmarks present in any result, in the canonical order (:data:`stapo.tasks.data.BENCHMARKS`), then custom
    benchmarks (``data.custom_benchmarks``) in the order first seen."""
    present = [b for res in results for m in res["metrics"].values() for b in m["benchmarks"]]
    extra = [b for b in dict.fromkeys(present) if b not in BENCHMARKS]
    return [b for b in BENCHMARKS if b in present] + extra


def _value(res: dict[str, Any], setting: str, bench: str, metric: str) -> Any:
    m = res["metrics"].get(setting)
    if m is None:
        return None
    node = m["average"] if bench == AVERAGE else m["benchmarks"].get(bench)
    return None if node is None else node.get(metric)


def paper_table(results: Sequence[dict[str, Any]], metric: str = "avg@N") -> tuple[list[str], list[list[str]]]:
    """Header and rows of the paper-layout table.

    Args:
        results: results dicts (one row each, named by ``label``).
        metric: ``"avg@N"`` (the paper's), ``"pass@N"``, ``"maj@N"`` or ``"pass@1"``.

    Returns:
        ``(header, rows)``: header ``["model", <benchmark display names>..., "Avg"]``; a cell is
        ``"x (y)"`` with x the first setting and y the second (more settings: ``"x (y, z)"``), in percent,
        ``–`` where a value is missing. The Avg column is the unweighted mean over that row's benchmarks.
    """
    settings = table_settings(results)
    cols = table_columns(results)
    header = ["model"] + [DISPLAY_NAMES.get(b, b) for b in cols] + ["Avg"]
    rows = []
    for res in results:
        row = [str(res["label"])]
        for bench in cols + [AVERAGE]:
            vals = [_pct(_value(res, s, bench, metric)) for s in settings]
            row.append(vals[0] if len(vals) == 1 else f"{vals[0]} ({', '.join(vals[1:])})")
        rows.append(row)
    return header, rows


def _setting_text(res_list: Sequence[dict[str, Any]]) -> str:
    seen: dict[str, str] = {}
    for res in res_list:
        for s in res.get("protocol", {}).get("settings", []):
            seen.setdefault(s["name"], f"(T={s['temperature']}, top-p={s['top_p']})")
    names = table_settings(res_list)
    parts = [seen.get(n, n) for n in names]
    if len(parts) == 1:
        return parts[0]
    return f"{parts[0]} first, " + "; ".join(parts[1:]) + " in parentheses"


def markdown_table(results: Sequence[dict[str, Any]], metric: str = "avg@N", title: str | None = None) -> str:
    """The paper-layout table as Markdown, with notes on settings, N, limits and incomplete averages."""
    header, rows = paper_table(results, metric)
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] * len(header)) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", f"{metric} in %; {_setting_text(results)}."]
    for res in results:
        proto = res.get("protocol", {})
        ns = ", ".join(f"{DISPLAY_NAMES.get(b, b)} {n}" for b, n in proto.get("samples", {}).items())
        notes = [f"N: {ns}", f"max new tokens {proto.get('max_new_tokens')}"]
        if proto.get("limit") is not None:
            notes.append(f"first {proto['limit']} problems per benchmark (--limit)")
        # results.json before "paper_protocol" existed: "complete" meant the paper's six in full
        if not res.get("paper_protocol", res.get("complete", False)):
            n_b = len(proto.get("benchmarks", []))
            notes.append(f"Avg over {n_b} benchmark{'s' if n_b != 1 else ''}" +
                         (" (not the paper's six)" if proto.get("limit") is None else ""))
        lines.append(f"- {res['label']}: " + "; ".join(notes) + ".")
    return "\n".join(lines) + "\n"


def detail_markdown(res: dict[str, Any]) -> str:
    """Per (setting, benchmark) details of one result: problems, N, avg@N, pass@1, pass@N, maj@N (percent),
    grader verdict counts, verifier acceptances, mean response tokens and truncation rate."""
    head = ["setting", "benchmark", "problems", "N", "avg@N", "pass@1", "pass@N", "maj@N", "maj ties",
            "no answer", "timeouts", "errors", "verifier +", "mean tokens", "truncated"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for setting in table_settings([res]):
        m = res["metrics"].get(setting)
        if m is None:
            continue
        for bench, s in list(m["benchmarks"].items()) + [(AVERAGE, m["average"])]:
            g = s["grader"]
            lines.append("| " + " | ".join([
                setting, _title(bench), str(s.get("problems", "")), str(s.get("N", "")),
                _pct(s["avg@N"]), _pct(s["pass@1"]), _pct(s["pass@N"]), _pct(s["maj@N"]), str(s.get("maj_ties", "")),
                str(g["no_answer"]), str(g["timeout"]), str(g["error"]), str(s["verifier_accepted"]),
                f"{s['mean_response_tokens']:.1f}" if _finite(s["mean_response_tokens"]) else _MISSING,
                _pct(s["truncation_rate"]) + ("%" if _finite(s["truncation_rate"]) else "")]) + " |")
    return "\n".join(lines) + "\n"


def csv_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Long format, one row per (label, setting, benchmark or ``average``): metrics as fractions, grader counts,
    mean response tokens, truncation rate, N, problems, limit, temperature, top-p."""
    rows = []
    for res in results:
        proto = res.get("protocol", {})
        params = {s["name"]: s for s in proto.get("settings", [])}
        for setting, m in res["metrics"].items():
            for bench, s in list(m["benchmarks"].items()) + [(AVERAGE, m["average"])]:
                row = {"label": res["label"], "setting": setting,
                       "temperature": params.get(setting, {}).get("temperature"),
                       "top_p": params.get(setting, {}).get("top_p"), "benchmark": bench,
                       "N": s.get("N"), "problems": s.get("problems"), "limit": proto.get("limit"),
                       "avg@N": s["avg@N"], "pass@1": s["pass@1"], "pass@N": s["pass@N"], "maj@N": s["maj@N"],
                       "samples": s["samples"], "verifier_accepted": s["verifier_accepted"],
                       "mean_response_tokens": s["mean_response_tokens"], "truncation_rate": s["truncation_rate"]}
                row.update({f"grader_{k}": s["grader"][k] for k in GRADER_STATUSES})
                rows.append(row)
    return rows


def write_csv(path: str | os.PathLike, results: Sequence[dict[str, Any]]) -> Path:
    """Write :func:`csv_rows` to ``path``; returns the path."""
    rows = csv_rows(results)
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["label"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def plot_bars(results: Sequence[dict[str, Any]], path: str | os.PathLike, metric: str = "avg@N") -> Path:
    """Grouped bar chart: one panel per decoding setting, benchmarks (and Avg) on the x axis, one bar per
    result (label); the metric in percent. Written with matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = table_settings(results)
    cols = table_columns(results) + [AVERAGE]
    names = [_title(b) for b in cols]
    fig, axes = plt.subplots(len(settings), 1, figsize=(max(6.0, 1.3 * len(cols) + 1.5), 3.2 * len(settings)),
                             squeeze=False)
    width = 0.8 / max(1, len(results))
    for ax, setting in zip(axes[:, 0], settings):
        top = 0.0
        for i, res in enumerate(results):
            vals = [_value(res, setting, b, metric) for b in cols]
            ys = [100 * v if _finite(v) else 0.0 for v in vals]
            xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(cols))]
            bars = ax.bar(xs, ys, width=width, label=str(res["label"]))
            ax.bar_label(bars, labels=[f"{y:.1f}" for y in ys], fontsize="x-small", padding=1)
            top = max([top] + ys)
        ax.set_ylim(0, max(5.0, 1.15 * top))
        params = next((s for r in results for s in r.get("protocol", {}).get("settings", [])
                       if s["name"] == setting), None)
        ax.set_title(f"{setting}" + (f" (T={params['temperature']}, top-p={params['top_p']})" if params else ""))
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels(names)
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(axis="y", alpha=0.3)
        if len(results) > 1 or ax is axes[0, 0]:
            ax.legend(fontsize="small")
    return _save_figure(fig, path)


def write_reports(results: dict[str, Any], run_dir: str | os.PathLike, *, plot: bool = True) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` (paper table + pass@N / maj@N tables + details), ``results.csv``
    and (``plot``) ``results.png`` into ``run_dir``, each through a temporary file and a rename. Returns
    ``{kind: path}``.

    Raises:
        OSError: a file cannot be written (full disk, ...): the message names it; the previous one is kept.
    """
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "csv": out / "results.csv"}
    with _atomic(paths["json"]) as tmp:
        tmp.write_text(json.dumps(_clean(results), indent=2, default=str, allow_nan=False) + "\n")
    md = [f"# Evaluation: {results['label']}", "", markdown_table([results], "avg@N", "avg@N (paper metric)"),
          markdown_table([results], "pass@N", "pass@N"), markdown_table([results], "maj@N", "maj@N"),
          "### Details", "", detail_markdown(results)]
    run = results.get("run", {})
    md.append(f"Model: `{results['model']['spec']}`; prompt: style {results['prompt']['style']}, system prompt "
              f"{'set' if results['prompt']['system_prompt'] else 'none'} (from {results['prompt']['source']}); "
              f"engine {results['protocol']['engine']}; this invocation generated {run.get('generated', 0)} "
              f"samples ({run.get('tokens', 0)} tokens) in {run.get('seconds', 0.0):.0f} s.\n")
    with _atomic(paths["md"]) as tmp:
        tmp.write_text("\n".join(md))
    with _atomic(paths["csv"]) as tmp:
        write_csv(tmp, [results])
    if plot:
        paths["png"] = out / "results.png"
        with _atomic(paths["png"]) as tmp:
            plot_bars([results], tmp)
    return paths


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """A temporary name beside ``path`` (``.<stem>.tmp<suffix>``) to write, renamed over ``path`` when the block
    succeeds, so a reader never finds a torn report (a full disk, a kill); removed when it fails.

    Raises:
        OSError: the write or the rename failed: same errno, the message names ``path``.
    """
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        from stapo.run.preflight import write_error

        raise write_error(e, path) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def write_comparison(results: Sequence[dict[str, Any]], out_dir: str | os.PathLike, *, name: str = "comparison",
                     plot: bool = True) -> dict[str, Path]:
    """Several results in one table: ``<name>.md`` (avg@N, pass@N and maj@N tables), ``<name>.csv`` and
    ``<name>.png`` in ``out_dir``. Returns ``{kind: path}``.

    Raises:
        EvalError: no results, or two results with the same label.
    """
    if not results:
        raise EvalError("nothing to compare: no results given")
    labels = [r["label"] for r in results]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise EvalError(f"several results are labelled {dup}; name them with LABEL=PATH")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{name}.md", "csv": out / f"{name}.csv"}
    paths["md"].write_text("\n".join([markdown_table(results, m, m) for m in ("avg@N", "pass@N", "maj@N")]))
    write_csv(paths["csv"], results)
    if plot:
        paths["png"] = plot_bars(results, out / f"{name}.png")
    return paths


#: The W&B step metric of evaluation runs: verl's name for the training step (the native trainer logs it too), so
#: the evaluation of a checkpoint of training step K is plotted at x = K beside the training curves.
STEP_METRIC = "training/global_step"


def result_step(results: dict[str, Any]) -> int:
    """The training step a result belongs to: its train.py checkpoint's step, else 0 (a base model or an HF folder
    is the policy before the first update)."""
    step = (results.get("model") or {}).get("step")
    return int(step) if isinstance(step, int) else 0


def wandb_identity(results: dict[str, Any], *, project: str = "stapo", entity: str | None = None,
                   group: str | None = None, tags: Sequence[str] | None = None, job_type: str | None = None,
                   notes: str | None = None, name: str | None = None) -> dict[str, Any]:
    """The W&B run identity of an evaluation (``wandb.init`` keywords plus ``config``).

    An argument that is set wins (``logging.*`` of the evaluation config); otherwise, for a train.py checkpoint
    (``results["training"]``, :meth:`stapo.evaluation.model_source.ModelSource.train_run`), the training run's
    group, tags, project and entity — so the evaluation sits in the training run's group — and ``job_type``
    ``"eval"``. The config is the evaluation config plus ``train_run`` (run, step, objective, model, seed, reward)
    and the training run's own keys ``algorithm.objective``, ``algorithm.reward``, ``trainer.seed`` (W&B can
    group or filter training and evaluation runs by the same column), and its ``logging`` section holds the
    resolved identity the run is logged under (``group``, ``tags``, ``job_type``, ``project``, ``entity`` and the
    training run's ``family`` / ``study`` / ``method``), not the unset values of the evaluation config.
    ``project="stapo"`` (the default) gives way to the training run's project.
    """
    train = results.get("training") or {}
    config = dict(results.get("config") or {})
    if train:
        config["train_run"] = dict(train)
        config["algorithm"] = {"objective": train.get("objective"), "reward": train.get("reward")}
        config["trainer"] = {"seed": train.get("seed")}
    ident = {
        "project": train.get("project") if project == "stapo" and train.get("project") else project,
        "entity": entity or train.get("entity"),
        "group": group or train.get("group"),
        "tags": list(tags) if tags else list(train.get("tags") or []),
        "job_type": job_type or "eval",
        "notes": notes,
        "name": name or f"eval-{results['label']}",
    }
    logging = dict(config.get("logging") or {})
    logging.update({k: ident[k] for k in ("project", "entity", "group", "tags", "job_type")})
    for key in ("family", "study", "method"):  # the training run's, unless the evaluation config set its own
        logging[key] = logging.get(key) or train.get(key)
    config["logging"] = logging
    return {**ident, "config": config}


def _eval_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``eval/<setting>/<benchmark>/<metric>`` scalars of one result (finite values only)."""
    flat: dict[str, float] = {}
    for setting, m in results["metrics"].items():
        for bench, s in list(m["benchmarks"].items()) + [(AVERAGE, m["average"])]:
            for key in ("avg@N", "pass@1", "pass@N", "maj@N", "mean_response_tokens", "truncation_rate"):
                if _finite(s[key]):
                    flat[f"eval/{setting}/{bench}/{key}"] = float(s[key])
    return flat


def _flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The scalars an evaluation logs for one result (finite values only): ``eval/<setting>/<benchmark>/<metric>``
    and the in-training validation's names of the same numbers (:func:`stapo.evaluation.metrics.
    validation_metrics`: ``val-core/<bench>/acc/mean@<N>`` ..., ``<bench>@<setting>`` with several settings), so an
    evaluation shares the validation charts (docs/metrics.md#evaluation-metricsjsonl--wb)."""
    flat = _eval_metrics(results)
    try:
        val = validation_metrics(results["metrics"])
    except (KeyError, TypeError, ValueError):  # a result written before these fields: its eval/ keys only
        val = {}
    flat.update({k: v for k, v in val.items() if _finite(v)})
    return flat


#: The file (in an evaluation's or a sweep's folder) that records which points its W&B run holds already:
#: ``{"run_id": the W&B run id (wandb_run_id), "points": {"<training step>": digest of what was logged}}``.
WANDB_LOGGED = "wandb_logged.json"


def _point_digest(res: dict[str, Any]) -> str:
    """SHA-256 (hex) of what :func:`log_wandb` logs for one result: its step, ``eval/`` scalars and table rows (a
    rerun that extends an evaluation — more problems, benchmarks or settings — changes it; a plain rerun does not;
    the ``val-core`` names of the same numbers are left out, so points logged before they existed stay logged)."""
    header, rows = paper_table([res])
    text = json.dumps([result_step(res), _eval_metrics(res), header, rows, csv_rows([res])], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _logged_points(run_dir: Path) -> dict[str, str]:
    """``{"<step>": digest}`` of the points the W&B run of ``run_dir`` holds (:data:`WANDB_LOGGED`); {} when the
    file is missing or unreadable, or records another W&B run than ``wandb_run_id`` names (a new run: log all)."""
    try:
        rec = json.loads((run_dir / WANDB_LOGGED).read_text())
        run_id = (run_dir / "wandb_run_id").read_text().strip()
    except (OSError, ValueError):
        return {}
    if not isinstance(rec, dict) or rec.get("run_id") != run_id or not isinstance(rec.get("points"), dict):
        return {}
    return {str(k): str(v) for k, v in rec["points"].items()}


def log_wandb(results: dict[str, Any] | Sequence[dict[str, Any]], run_dir: str | os.PathLike, *,
              mode: str = "offline", project: str = "stapo", entity: str | None = None, fallback: str = "offline",
              group: str | None = None, tags: Sequence[str] | None = None, job_type: str | None = None,
              notes: str | None = None, name: str | None = None, tensorboard: bool = False) -> None:
    """Log one result, or the results of several checkpoints of one training run (a sweep), as ONE W&B run
    (through :class:`stapo.run.tracking.Tracker`, offline by default: no API key needed).

    Each result is logged at its training step (:func:`result_step`) under the step metric :data:`STEP_METRIC`, so
    checkpoints form a curve on the training-step axis, in any order: scalars ``eval/<setting>/<benchmark>/<metric>``
    and the tables ``eval/summary`` (the paper table) and ``eval/details`` (the long rows). Identity (group, tags,
    job_type ``eval``, the training run's objective, model and seed in the config): :func:`wandb_identity` from
    the first result. ``metrics.jsonl`` and ``tables.jsonl`` in ``run_dir`` always hold every result (one row per
    result, at its step; a rerun replaces the previous rows there), ``mode="disabled"`` included; with
    ``tensorboard`` (``logging.backends: [..., tensorboard]``) so does ``run_dir/tensorboard`` (every result's
    numbers as scalars at its step, rewritten from the lowest step on each call; without the tensorboard package:
    one line on stderr, the JSONL files only).

    Only new points go to W&B: :data:`WANDB_LOGGED` records (atomically, after the W&B run finished) the step and
    a digest (:func:`_point_digest`) of each point logged, so a rerun of a finished evaluation or sweep logs only
    the checkpoints evaluated (or extended) since — and when there are none it does not start W&B at all (an
    offline rerun would otherwise leave another ``offline-run-*`` folder holding every point again, which
    ``wandb sync`` would upload twice). ``fallback`` as ``logging.wandb_fallback``; the evaluation is finished when
    this runs, so a W&B that cannot start never fails it: one line on stderr, the JSONL files are written without
    W&B, and nothing is recorded as logged.
    """
    many = sorted([results] if isinstance(results, dict) else list(results), key=result_step)
    if not many:
        return
    out = Path(run_dir)

    def log_all(tracker: Tracker, todo: Sequence[dict[str, Any]]) -> None:
        tracker.truncate_after(-1)
        for res in todo:
            step = result_step(res)
            tracker.log(step, _flat_metrics(res))
            header, rows = paper_table([res])
            tracker.log_table(step, "eval/summary", header, rows)
            long = csv_rows([res])
            if long:
                tracker.log_table(step, "eval/details", list(long[0].keys()), [list(r.values()) for r in long])

    logged = _logged_points(out) if mode != "disabled" else {}
    new = {str(result_step(res)): (res, d) for res in many
           if logged.get(str(result_step(res))) != (d := _point_digest(res))}  # {"<step>": (result, digest)}
    if mode != "disabled" and new:
        ident = wandb_identity(many[0], project=project, entity=entity, group=group, tags=tags, job_type=job_type,
                               notes=notes, name=name)
        config = ident.pop("config")
        if len(many) > 1 and "train_run" in config:  # a sweep: the steps are the x axis, not one value of the config
            config["train_run"] = {k: v for k, v in config["train_run"].items() if k != "step"}
        try:
            tracker = Tracker(out, config, mode=mode, fallback=fallback, step_metric=STEP_METRIC, **ident)
        except TrackerError as e:
            print(f"evaluate.py: {e}; the results are complete, W&B skipped", file=sys.stderr)
        else:
            try:
                log_all(tracker, [res for res, _ in new.values()])  # the JSONL files are rewritten whole below
                started = tracker.wandb_dir is not None
            finally:
                tracker.finish()
            if started:
                run_id = (out / "wandb_run_id").read_text().strip()
                points = {**_logged_points(out), **{step: d for step, (_, d) in new.items()}}
                with _atomic(out / WANDB_LOGGED) as tmp:  # a reader never finds a torn record
                    tmp.write_text(json.dumps({"run_id": run_id, "points": points}, indent=1, sort_keys=True) + "\n")
    try:  # metrics.jsonl / tables.jsonl (and TensorBoard): every point, by step
        mirror = Tracker(out, {}, mode="disabled", backends=("tensorboard",) if tensorboard else ())
    except TrackerError as e:  # no tensorboard package: the evaluation is finished, never fail it
        print(f"evaluate.py: {e}; the results are complete, TensorBoard skipped", file=sys.stderr)
        mirror = Tracker(out, {}, mode="disabled")
    try:
        log_all(mirror, many)
    finally:
        mirror.finish()


#: The file in a training run's folder that records the final evaluation numbers written into its W&B summary.
TRAIN_SUMMARY = "eval_summary.json"
#: The summary key of the training step the numbers in a training run's summary were evaluated at.
SUMMARY_STEP_KEY = "eval/global_step"


def train_summary_values(results: dict[str, Any] | Sequence[dict[str, Any]]) -> tuple[Path, int,
                                                                                     dict[str, float]] | None:
    """What an evaluation writes into its training run's W&B summary: ``(training run folder, step, values)`` for
    the result of the latest training step among ``results`` that is a train.py checkpoint (``results["training"]
    ["run_dir"]``), or None when none is. ``values``: its ``eval/<setting>/<benchmark>/<metric>`` scalars (finite
    only) and :data:`SUMMARY_STEP_KEY` = the step."""
    many = [results] if isinstance(results, dict) else list(results)
    mine = [r for r in many if (r.get("training") or {}).get("run_dir")]
    if not mine:
        return None
    res = max(mine, key=result_step)
    step = result_step(res)
    return Path(res["training"]["run_dir"]), step, {**_eval_metrics(res), SUMMARY_STEP_KEY: step}


def write_train_summary(results: dict[str, Any] | Sequence[dict[str, Any]], *, mode: str = "offline",
                        fallback: str = "offline") -> dict[str, float] | None:
    """Write an evaluation's final numbers (:func:`train_summary_values`) into its training run: the file
    :data:`TRAIN_SUMMARY` in the run folder (``{"step", "values"}``, atomically) and, unless ``mode`` is
    ``disabled`` or the run has no W&B run (no ``wandb_run_id``), the W&B run's summary — W&B's documented way to
    add to a finished run: ``wandb.init(id=<its id>, resume="allow")`` then ``run.summary.update`` (through
    :class:`stapo.run.tracking.Tracker`, with the run's project, entity, name, group and tags). Offline this writes one
    more ``offline-run-*`` folder of the same id under ``<run>/wandb``; ``wandb sync <run>/wandb/offline-run-*``
    uploads it into the same run, so the runs table can sort training runs by a benchmark.

    Numbers of an earlier step than the ones recorded are not written (the final evaluation is not replaced by one
    of an intermediate checkpoint), nor while the training run's folder is locked by a live process (it is still
    training: one line on stderr each). A W&B that cannot start never fails the evaluation (one line on stderr).

    Returns:
        The values written, or None when nothing was.
    """
    found = train_summary_values(results)
    if found is None:
        return None
    run_dir, step, values = found
    path = run_dir / TRAIN_SUMMARY
    try:
        before = json.loads(path.read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        before = None
    if isinstance(before, int) and before > step:
        print(f"evaluate.py: {path} holds the evaluation of step {before}; the numbers of step {step} are not "
              f"written into the training run's summary", file=sys.stderr)
        return None
    lock = RunLock(run_dir, program="evaluate.py (training run summary)")
    try:
        lock.acquire()
    except (RunLockError, OSError) as e:
        print(f"evaluate.py: the training run's summary is not updated ({e}); rerun the evaluation once it "
              f"finished", file=sys.stderr)
        return None
    try:
        with _atomic(path) as tmp:
            tmp.write_text(json.dumps({"step": step, "values": values}, indent=1, sort_keys=True) + "\n")
        if mode == "disabled" or not (run_dir / "wandb_run_id").is_file():
            return values
        try:
            train_cfg = json.loads((run_dir / "config.json").read_text())
            lc = train_cfg.get("logging") or {}
        except (OSError, ValueError, AttributeError):
            lc = {}
        try:
            tracker = Tracker(run_dir, {}, mode=mode, fallback=fallback, project=lc.get("project") or "stapo",
                              entity=lc.get("entity"), name=run_dir.name, group=lc.get("group"),
                              tags=lc.get("tags") or None, job_type=lc.get("job_type") or "train")
        except TrackerError as e:
            print(f"evaluate.py: {e}; the training run's W&B summary is not updated", file=sys.stderr)
            return values
        try:
            tracker.update_summary(values)
        finally:
            tracker.finish()
        return values
    finally:
        lock.release()


# --- a sweep of checkpoints: accuracy against the training step -----------------------------------------------
SWEEP_METRICS = ("avg@N", "pass@N", "maj@N", "mean_response_tokens", "truncation_rate")


def sweep_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Long rows of a sweep, one per (step, setting, benchmark or ``average``), in step order: ``step``,
    ``checkpoint`` (the label), ``setting``, ``benchmark``, ``N``, ``problems`` and :data:`SWEEP_METRICS`
    (fractions; ``None`` where not finite)."""
    rows = []
    for res in sorted(results, key=result_step):
        for setting, m in res["metrics"].items():
            for bench, s in list(m["benchmarks"].items()) + [(AVERAGE, m["average"])]:
                row = {"step": result_step(res), "checkpoint": res["label"], "setting": setting, "benchmark": bench,
                       "N": s.get("N"), "problems": s.get("problems")}
                row.update({k: (float(s[k]) if _finite(s.get(k)) else None) for k in SWEEP_METRICS})
                rows.append(row)
    return rows


def sweep_markdown(results: Sequence[dict[str, Any]], metric: str = "avg@N") -> str:
    """One table, one row per checkpoint (by step), one column per (benchmark, setting) and their average, the
    metric in percent: accuracy against the training step."""
    settings = table_settings(results)
    cols = table_columns(results) + [AVERAGE]
    header = ["step"] + [f"{_title(b)} {s}" if len(settings) > 1 else _title(b) for b in cols for s in settings]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for res in sorted(results, key=result_step):
        cells = [str(result_step(res))] + [_pct(_value(res, s, b, metric)) for b in cols for s in settings]
        lines.append("| " + " | ".join(cells) + " |")
    params = {s["name"]: s for r in results for s in r.get("protocol", {}).get("settings", [])}
    text = "; ".join(f"{n} = T {params[n]['temperature']}, top-p {params[n]['top_p']}" if n in params else n
                     for n in settings)
    return "\n".join(lines) + f"\n\n{metric} in % against the training step; {text}.\n"


def plot_sweep(results: Sequence[dict[str, Any]], path: str | os.PathLike, metric: str = "avg@N") -> Path:
    """Line chart of ``metric`` (percent) against the training step: one panel per decoding setting, one line per
    benchmark and the average (thicker). matplotlib, Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = table_settings(results)
    cols = table_columns(results) + [AVERAGE]
    ordered = sorted(results, key=result_step)
    steps = [result_step(r) for r in ordered]
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 3.8), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for bench in cols:
            ys = [_value(r, setting, bench, metric) for r in ordered]
            ax.plot(steps, [100 * y if _finite(y) else float("nan") for y in ys], marker="o",
                    linewidth=2.5 if bench == AVERAGE else 1.2, label=_title(bench))
        ax.set_title(setting)
        ax.set_xlabel("training step")
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save_figure(fig, path)


def write_sweep_reports(results: Sequence[dict[str, Any]], out_dir: str | os.PathLike, *, title: str,
                        plot: bool = True) -> dict[str, Path]:
    """``sweep.csv`` (:func:`sweep_rows`), ``sweep.md`` (avg@N / pass@N / maj@N against the step) and, with
    ``plot``, ``sweep.png`` (:func:`plot_sweep`) in ``out_dir``, each written atomically. Returns ``{kind: path}``.

    Raises:
        OSError: a file cannot be written (the message names it; the previous one is kept).
    """
    out = Path(out_dir)
    paths = {"csv": out / "sweep.csv", "md": out / "sweep.md"}
    rows = sweep_rows(results)
    with _atomic(paths["csv"]) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["step"])
        writer.writeheader()
        writer.writerows(rows)
    md = [f"# Checkpoint sweep: {title}", ""]
    for metric in ("avg@N", "pass@N", "maj@N"):
        md += [f"### {metric}", "", sweep_markdown(results, metric)]
    with _atomic(paths["md"]) as tmp:
        tmp.write_text("\n".join(md))
    if plot and results:
        paths["png"] = out / "sweep.png"
        with _atomic(paths["png"]) as tmp:
            plot_sweep(results, tmp)
    return paths


def _save_figure(fig, path: str | os.PathLike) -> Path:
    """Lay out ``fig``, write it to ``path`` as a 120-dpi PNG, close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
