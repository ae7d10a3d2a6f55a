"""Save a W&B workspace that compares the methods of a project: one panel per quantity, one line per method.

    python scripts/wandb_workspace.py --entity ENTITY --project stapo              # save it (needs W&B login)
    python scripts/wandb_workspace.py --project stapo --print-spec                 # print the layout, no network
    python scripts/wandb_workspace.py --project stapo --dry-run                    # build it offline, save nothing

``--entity`` defaults to ``$WANDB_ENTITY``; saving needs one, the offline modes write ``ENTITY`` without it.

The layout (:func:`workspace_spec`, a plain dict, pure) is built from the keys the runs log (docs/metrics.md):

* **Training**: reward ``critic/score/mean``, ``actor/entropy``, the token masks on two linear panels (a log axis
  would drop the steps where S2T silences nothing, most of them): every mask's masked fraction
  ``actor/<mask>/masked_frac`` (STAPO's ``s2t`` and the S2T ablations', ~0.01 %) and 20-Entropy's kept fraction
  ``actor/top_entropy/kept_frac`` (~20 %); ``s2t/would_mask/masked_frac``: what the S2T rule would silence, every
  method; ``response_length/mean``;
* **Accuracy**: per benchmark (and the average), the in-training validation and the evaluations of checkpoints on
  one panel — every ``val-core/<bench>[@<setting>]/acc/mean@<N>`` key (a regular expression over the setting and
  N: the validation's N and the evaluation protocol's differ) — plus a panel of the evaluation's
  ``eval/<setting>/<bench>/avg@N``;
* **Utilisation**: ``perf/tokens_per_s``, ``timing_s/step``, ``perf/max_memory_allocated_gb``, ``perf/mfu/actor``.

Every panel's x axis is ``training/global_step`` (the runs' step metric, so an evaluation of step K sits at K);
the runs are grouped by W&B's *Group* — ``<family>-<method>`` or ``<study>-<method>`` (stapo/run/provenance.py) — so
each method is one line, the mean over its seeds with their min–max band. ``--filter-tag family:cpu_smollm2``
(or ``study:<name>``) restricts the workspace to one comparison.

Saving uses W&B's workspaces API (the ``wandb-workspaces`` package: requirements-dev.txt) and prints the
workspace's URL. Exit codes: 0 saved / printed, 1 the package is missing or W&B refused to save (one line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]

#: The x axis of every panel: the training step (verl's name; every training and evaluation row carries it).
STEP_AXIS = "training/global_step"
#: W&B's run field the runs are grouped by: the run's group, one per method (stapo/run/provenance.py::default_group).
GROUP_BY = "Group"
#: Every registered token mask's masked fraction, ``actor/<mask prefix>/masked_frac`` (stapo/core/metric_names.py):
#: STAPO's ``actor/s2t/masked_frac`` and the S2T ablations' own.
MASKED_FRAC_REGEX = "^actor/[^/]+/masked_frac$"
#: What a mask that keeps a subset logs instead (20-Entropy's ``actor/top_entropy/kept_frac``).
KEPT_FRAC_REGEX = "^actor/[^/]+/kept_frac$"
#: The training panels: (title, keys, metric regex or None).
TRAINING_PANELS: tuple[tuple[str, tuple[str, ...], str | None], ...] = (
    ("reward (critic/score/mean)", ("critic/score/mean",), None),
    ("entropy (actor/entropy)", ("actor/entropy",), None),
    ("masked fraction: silenced by the method's mask (actor/<mask>/masked_frac)", (), MASKED_FRAC_REGEX),
    ("kept fraction: 20-Entropy's top-entropy tokens (actor/<mask>/kept_frac)", (), KEPT_FRAC_REGEX),
    ("masked fraction: the S2T rule on every method (s2t/would_mask/masked_frac)", ("s2t/would_mask/masked_frac",),
     None),
    ("response length (response_length/mean)", ("response_length/mean",), None),
)
#: The utilisation panels: (title, keys).
UTILISATION_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("generated tokens per second (perf/tokens_per_s)", ("perf/tokens_per_s",)),
    ("seconds per step (timing_s/step)", ("timing_s/step",)),
    ("peak memory, GiB (perf/max_memory_allocated_gb)", ("perf/max_memory_allocated_gb",)),
    ("MFU of the update (perf/mfu/actor)", ("perf/mfu/actor",)),
)


def _regex_escape(name: str) -> str:
    """``name`` with the regular-expression metacharacters a benchmark name could hold escaped."""
    return "".join("\\" + c if c in r".^$*+?{}[]\|()" else c for c in name)


def accuracy_regex(benchmark: str) -> str:
    """The validation keys of one benchmark, any decoding setting and any N: ``^val-core/<bench>(@<setting>)?/acc/
    mean@<N>$``. ``accuracy_regex("aime24")`` matches ``val-core/aime24/acc/mean@4`` (in-training validation) and
    ``val-core/aime24@t1.0_p1.0/acc/mean@32`` (an evaluation of the paper protocol), not ``val-core/aime25/...``."""
    return f"^val-core/{_regex_escape(benchmark)}(@[^/]+)?/acc/mean@[0-9]+$"


def eval_regex(benchmark: str) -> str:
    """The evaluation keys of one benchmark's avg@N, any setting: ``^eval/<setting>/<bench>/avg@N$``."""
    return f"^eval/[^/]+/{_regex_escape(benchmark)}/avg@N$"


def _panel(title: str, *, keys: Sequence[str] = (), regex: str | None = None) -> dict[str, Any]:
    # every panel linear: a log axis drops the zero steps (most of a STAPO run's masked fraction)
    return {"title": title, "x": STEP_AXIS, "y": list(keys), "metric_regex": regex, "groupby": GROUP_BY,
            "aggregate": "mean", "range": "minmax", "log_y": False}


def workspace_spec(entity: str, project: str, benchmarks: Sequence[str], *, name: str = "STAPO: methods compared",
                   filter_tag: str | None = None) -> dict[str, Any]:
    """The workspace as a plain dict (pure: no W&B, no network).

    Args:
        entity, project: where the runs are.
        benchmarks: the benchmarks of the accuracy panels (one panel each, then ``average``).
        name: the workspace's name.
        filter_tag: only runs with this tag (e.g. ``family:cpu_smollm2``, ``study:cpu_methods``), or None.

    Returns:
        ``{"entity", "project", "name", "x_axis", "groupby", "filter_tag", "sections": [{"name", "panels":
        [{"title", "x", "y" (keys), "metric_regex" (or None), "groupby", "aggregate", "range", "log_y"}]}]}``:
        sections
        ``Training``, ``Accuracy`` (validation and evaluation per benchmark, then the evaluation's avg@N) and
        ``Utilisation``; every panel's x is :data:`STEP_AXIS`, grouped by :data:`GROUP_BY` (mean line, min–max band).

    Raises:
        ValueError: an empty entity or project, or no benchmark.
    """
    if not entity or not project:
        raise ValueError("workspace_spec: entity and project must be non-empty")
    if not benchmarks:
        raise ValueError("workspace_spec: no benchmark")
    benches = [*dict.fromkeys(benchmarks), "average"]
    accuracy = [_panel(f"{b}: validation and evaluation accuracy (mean@N)", regex=accuracy_regex(b)) for b in benches]
    accuracy += [_panel(f"{b}: evaluation avg@N (eval/*)", regex=eval_regex(b)) for b in benches]
    return {
        "entity": entity, "project": project, "name": name, "x_axis": STEP_AXIS, "groupby": GROUP_BY,
        "filter_tag": filter_tag,
        "sections": [
            {"name": "Training", "panels": [_panel(t, keys=k, regex=r) for t, k, r in TRAINING_PANELS]},
            {"name": "Accuracy", "panels": accuracy},
            {"name": "Utilisation", "panels": [_panel(t, keys=k) for t, k in UTILISATION_PANELS]},
        ],
    }


def to_workspace(spec: dict[str, Any]) -> Any:
    """The :func:`workspace_spec` dict as a ``wandb_workspaces.workspaces.Workspace`` (built offline; ``.save()``
    sends it).

    Raises:
        ImportError: ``wandb-workspaces`` is not installed.
    """
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def plot(p: dict[str, Any]) -> Any:
        return wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"]), metric_regex=p["metric_regex"],
                           groupby=p["groupby"], groupby_aggfunc=p["aggregate"], groupby_rangefunc=p["range"],
                           log_y=p.get("log_y", False))

    filters = [ws.Tags().isin([spec["filter_tag"]])] if spec.get("filter_tag") else ""
    return ws.Workspace(
        entity=spec["entity"], project=spec["project"], name=spec["name"],
        sections=[ws.Section(name=s["name"], panels=[plot(p) for p in s["panels"]], is_open=True)
                  for s in spec["sections"]],
        settings=ws.WorkspaceSettings(x_axis=spec["x_axis"]),
        runset_settings=ws.RunsetSettings(groupby=[ws.Metric(spec["groupby"])], filters=filters))


def default_benchmarks() -> list[str]:
    """The paper's six benchmarks (:data:`stapo.tasks.data.BENCHMARKS`)."""
    sys.path.insert(0, str(REPO))
    from stapo.tasks.data import BENCHMARKS

    return list(BENCHMARKS)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entity", default=os.environ.get("WANDB_ENTITY") or None,
                    help="W&B entity (user or team); default $WANDB_ENTITY; needed to save")
    ap.add_argument("--project", required=True, help="W&B project (logging.project; default of the runs: stapo)")
    ap.add_argument("--name", default="STAPO: methods compared", help="the workspace's name")
    ap.add_argument("--benchmarks", nargs="+", default=None, help="accuracy panels (default: the six benchmarks)")
    ap.add_argument("--filter-tag", default=None, help="only runs with this tag, e.g. family:cpu_smollm2")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--print-spec", action="store_true", help="print the layout as JSON and stop (no network)")
    mode.add_argument("--dry-run", action="store_true", help="build the W&B workspace offline, save nothing")
    args = ap.parse_args(argv)
    if not args.entity and not (args.print_spec or args.dry_run):
        ap.error("--entity (or $WANDB_ENTITY) is needed to save the workspace; --print-spec / --dry-run work without")
    args.entity = args.entity or "ENTITY"  # the offline modes: a placeholder
    spec = workspace_spec(args.entity, args.project, args.benchmarks or default_benchmarks(), name=args.name,
                          filter_tag=args.filter_tag)
    if args.print_spec:
        print(json.dumps(spec, indent=1))
        return 0
    try:
        workspace = to_workspace(spec)
    except ImportError:
        print("wandb_workspace.py: the wandb-workspaces package is not installed: pip install -r "
              "requirements-dev.txt (or --print-spec for the layout)", file=sys.stderr)
        return 1
    panels = sum(len(s["panels"]) for s in spec["sections"])
    if args.dry_run:
        print(f"workspace {spec['name']!r} for {args.entity}/{args.project}: {len(spec['sections'])} sections, "
              f"{panels} panels, x = {spec['x_axis']}, grouped by {spec['groupby']} (dry run: not saved)")
        return 0
    try:
        saved = workspace.save()
    except Exception as e:  # noqa: BLE001 - no login, no network, no such project: one line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"wandb_workspace.py: W&B did not save the workspace ({reason}); log in with `wandb login` and check "
              f"--entity/--project", file=sys.stderr)
        return 1
    print(f"saved: {getattr(saved, 'url', None) or getattr(workspace, 'url', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
