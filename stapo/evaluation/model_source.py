"""What ``--model`` names: resolved and checked without importing torch, so bad paths fail in milliseconds.

Accepted forms (:func:`resolve_model_source`):

* ``embedded:smollm2`` (and the other :data:`stapo.model.models.EMBEDDED_ALIASES`) — the embedded SmolLM2-135M-Instruct;
* ``tiny`` — a randomly initialised tiny Qwen3 model (tests only, like ``model.path: tiny`` in train configs);
* a local HF folder (``config.json`` plus ``*.safetensors`` / ``pytorch_model*.bin`` weights);
* a train.py checkpoint ``runs/<name>/checkpoints/step_XXXXXX`` (an HF folder with ``trainer_state.pt``; the
  sharded training state in its ``dcp/`` subfolder is ignored) —
  its run's ``config.json`` gives the training prompt (``data.prompt_style``, ``data.system_prompt``);
* a train.py run folder ``runs/<name>`` or its ``checkpoints`` folder — the latest complete checkpoint;
* a hub id ``org/name`` (needs network or a filled HF cache), when no local path of that name exists.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stapo.common.checkpoint_files import (
    _STEP_DIR,
    complete_checkpoints,
    has_hf_weights,
    step_folders,
    verify_checkpoint,
)
from stapo.evaluation.errors import EvalError

__all__ = ["EMBEDDED_NAMES", "ModelSource", "resolve_model_source"]

#: Same names as :data:`stapo.model.models.EMBEDDED_ALIASES` (kept here to avoid importing torch; a test checks).
EMBEDDED_NAMES = ("embedded:smollm2", "embedded", "smollm2", "embedded:smollm2-135m-instruct")

@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``.

    Attributes:
        spec: the string as given.
        kind: ``"embedded"``, ``"tiny"``, ``"hf_folder"``, ``"checkpoint"`` or ``"hub"``.
        path: what to load (:func:`stapo.model.models.load_policy` argument; an absolute folder for local kinds).
        label: default row name in tables (``smollm2-135m-instruct``, ``<run>@step_000020``, folder name, ...).
        step: the training step of a train.py checkpoint, else ``None``.
        run_dir: the train.py run folder of a checkpoint (holding ``config.json``), else ``None``.
    """

    spec: str
    kind: Literal["embedded", "tiny", "hf_folder", "checkpoint", "hub"]
    path: str
    label: str
    step: int | None = None
    run_dir: str | None = None

    def train_prompt(self) -> dict[str, Any] | None:
        """``{"style", "system_prompt"}`` from the checkpoint's run ``config.json`` (``data.prompt_style``,
        ``data.system_prompt``), or ``None`` when this is not a checkpoint or the file is missing/unreadable."""
        if self.run_dir is None:
            return None
        path = Path(self.run_dir) / "config.json"
        try:
            data = json.loads(path.read_text()).get("data", {})
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(data, dict) or "prompt_style" not in data:
            return None
        return {"style": data.get("prompt_style"), "system_prompt": data.get("system_prompt")}

    def synthetic_split(self) -> str | None:
        """The ``data.synthetic.split`` a train.py checkpoint was trained on (``"all"`` for runs that predate the key),
        or ``None`` when this is not a checkpoint of a run on the synthetic task (or its config.json is unreadable).
        ``"all"`` includes the held-out problems of the generated benchmarks (``arith_test``, ``arith_hard``)."""
        if self.kind != "checkpoint" or self.run_dir is None:
            return None
        try:
            data = json.loads((Path(self.run_dir) / "config.json").read_text()).get("data", {})
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(data, dict) or data.get("train_set") != "synthetic":
            return None
        synthetic = data.get("synthetic") if isinstance(data.get("synthetic"), dict) else {}
        return str(synthetic.get("split", "all"))

    def train_run(self) -> dict[str, Any] | None:
        """What the training run of a train.py checkpoint was, from its run's ``config.json``: the identity an
        evaluation logs under (docs/evaluation.md#evaluation-on-the-training-step-axis).

        Returns:
            ``None`` when this is not a train.py checkpoint; else ``{"run", "run_dir", "step", "objective",
            "model", "seed", "reward", "project", "entity", "group", "tags", "family", "study", "method"}``:
            ``run`` the run folder's name,
            ``step`` the checkpoint's training step, the others from ``algorithm.objective``, ``model.path``,
            ``trainer.seed``, ``algorithm.reward`` and ``logging.*`` (``None`` / ``[]`` where the file is missing,
            unreadable or predates the key). ``group`` falls back to the run's name and ``tags`` to
            ``[objective, model, reward]`` (the values known) when the run recorded none.
        """
        if self.kind != "checkpoint" or self.run_dir is None:
            return None
        try:
            cfg = json.loads((Path(self.run_dir) / "config.json").read_text())
            cfg = cfg if isinstance(cfg, dict) else {}
        except (OSError, ValueError):
            cfg = {}

        def get(section: str, key: str) -> Any:
            node = cfg.get(section)
            return node.get(key) if isinstance(node, dict) else None

        run = Path(self.run_dir).name
        objective, model, reward = get("algorithm", "objective"), get("model", "path"), get("algorithm", "reward")
        model_tag = str(model).rstrip("/").split("/")[-1] if model else None
        tags = get("logging", "tags")
        tags = [str(t) for t in tags] if isinstance(tags, list) and tags else [
            str(t) for t in (objective, model_tag, reward) if t]
        return {"run": run, "run_dir": self.run_dir, "step": self.step, "objective": objective, "model": model,
                "seed": get("trainer", "seed"), "reward": reward, "project": get("logging", "project"),
                "entity": get("logging", "entity"), "group": get("logging", "group") or run, "tags": tags,
                "family": get("logging", "family"), "study": get("logging", "study"),
                "method": get("logging", "method")}


def _folder_source(spec: str, folder: Path) -> ModelSource:
    folder = folder.resolve()
    if folder.name.endswith(".tmp") and _STEP_DIR.match(folder.name[:-4]):
        raise EvalError(f"{folder} is an incomplete checkpoint (a crashed save); use a step_XXXXXX folder")
    if (folder / "config.json").is_file() and has_hf_weights(folder):
        m = _STEP_DIR.match(folder.name)
        if (folder / "trainer_state.pt").is_file() or m:
            damaged = verify_checkpoint(folder)  # sizes and checksums of its COMPLETE.json (None: intact)
            if damaged is not None:
                raise EvalError(f"checkpoint {folder} is damaged: {damaged}; use an earlier checkpoint (the run "
                                f"folder picks the newest intact one)")
            step = int(m.group(1)) if m else None
            run_dir = folder.parent.parent if folder.parent.name == "checkpoints" else None
            run_name = run_dir.name if run_dir is not None else folder.parent.name
            return ModelSource(spec, "checkpoint", str(folder), f"{run_name}@{folder.name}", step,
                               str(run_dir) if run_dir is not None else None)
        return ModelSource(spec, "hf_folder", str(folder), folder.name)
    for root in (folder / "checkpoints", folder):  # a train.py run folder (its config.json is not a model's)
        # in a checkpoints/ folder every step_N folder is a checkpoint, damaged or not (each one named below);
        # elsewhere (a folder holding checkpoints directly, or something else) only the complete ones count
        ckpts = step_folders(root) if root.name == "checkpoints" else complete_checkpoints(root)
        for ckpt in reversed(ckpts):  # the newest intact one (the rule a resume uses: stapo/common/checkpoint_files.py);
            damaged = verify_checkpoint(ckpt)  # each damaged newer one is named, one line each
            if damaged is None:
                return _folder_source(spec, ckpt)
            print(f"evaluating {root}: {ckpt.name} is damaged ({damaged}); trying the one before", file=sys.stderr)
        if ckpts:
            raise EvalError(f"run folder {folder} has no intact checkpoint (each one is damaged; see above)")
    if (folder / "checkpoints").is_dir():
        raise EvalError(f"run folder {folder} has no complete checkpoint under checkpoints/")
    if (folder / "config.json").is_file():
        raise EvalError(f"model folder {folder} has config.json but no weights (*.safetensors / *.bin); "
                        f"an incomplete checkpoint?")
    raise EvalError(f"model path {folder} is neither an HF model folder (config.json + weights), a train.py "
                    f"checkpoint (runs/<name>/checkpoints/step_XXXXXX) nor a train.py run folder")


def resolve_model_source(spec: str) -> ModelSource:
    """Resolve ``--model`` / ``model.path`` (forms in the module docstring).

    Args:
        spec: the model string.

    Returns:
        :class:`ModelSource`.

    Raises:
        EvalError: an empty string; a local path that does not exist, is a file, is an HF folder without
            weights, an incomplete (``.tmp``) checkpoint, or a folder holding no model or checkpoint — the
            message names the path.
    """
    spec = str(spec).strip()
    if not spec:
        raise EvalError("model path is empty; use a folder, a checkpoint, or 'embedded:smollm2'")
    if spec.lower() in EMBEDDED_NAMES:
        return ModelSource(spec, "embedded", EMBEDDED_NAMES[0], "smollm2-135m-instruct")
    if spec == "tiny":
        return ModelSource(spec, "tiny", "tiny", "tiny")
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise EvalError(f"model path {path} is a file; expected an HF model folder or a train.py checkpoint folder")
        return _folder_source(spec, path)
    parts = spec.split("/")
    looks_local = (spec.startswith(("/", "./", "../", "~", ".")) or len(parts) != 2
                   or Path(parts[0]).expanduser().is_dir())
    if looks_local:
        raise EvalError(f"model path {spec!r} does not exist (a local folder, a train.py checkpoint "
                        f"runs/<name>/checkpoints/step_XXXXXX, a hub id 'org/name', or 'embedded:smollm2')")
    return ModelSource(spec, "hub", spec, parts[1])
