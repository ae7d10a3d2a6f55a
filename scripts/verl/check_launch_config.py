#!/usr/bin/env python
"""Dry-run check of a verl launch line: compose the hydra overrides, load the plugin as the workers do, validate.

Called by ``DRY_RUN=1 bash scripts/verl/run_stapo_qwen3_1.7b.sh`` with the script's overrides. It needs verl,
hydra-core and stapo, but no GPU, data or model download: on a cluster, run it in verl's environment; on a CPU
machine, in ``.venv-verl`` (``bash scripts/verl/setup_check_env.sh``). It

1. composes verl's ``ppo_trainer`` config (the yaml files installed with verl) with the overrides, exactly as
   ``python -m verl.trainer.main_ppo`` does (``@hydra.main(config_name="ppo_trainer")``);
2. imports ``actor_rollout_ref.model.external_lib`` with verl's own ``import_external_libs`` (what
   ``HFModelConfig.__post_init__`` does in every worker) and checks that the plugin's hook is in place on
   ``verl.workers.engine_workers.TrainingWorker.train_batch`` and its losses are in verl's registry;
3. instantiates ``actor_rollout_ref.actor`` through ``verl.utils.config.omega_conf_to_dataclass`` — the hydra
   ``_target_`` path the workers take (``StapoPolicyLossConfig``);
4. runs verl's own driver-side ``validate_config``;
5. prints the objective verl's actor will optimise in :mod:`stapo.core.objectives` terms
   (:func:`stapo.integrations.verl.objective_of_verl_actor`) and the registered objective it equals
   (``stapo``, ``entropy20``, ``justrl``, ``grpo``, the S2T ablations ``stapo_high_entropy``, ``stapo_random``,
   ``justrl_fullmask``), the reference model, the attention implementation and the
   reward; fails on settings the plugin rejects at run time (aggregation, KL with a plugin loss, rollout IS weights).

Exit codes: 0 ok; 1 a check failed (``check failed: ...`` on stderr).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HOOK_TARGET = "verl.workers.engine_workers.TrainingWorker.train_batch"


def _fail(msg: str) -> int:
    print(f"check failed: {msg}", file=sys.stderr)
    return 1


def main(overrides: list[str]) -> int:
    """Run the checks for ``overrides`` (hydra override strings); see the module docstring."""
    try:
        import hydra  # noqa: F401
    except ImportError:
        return _fail("hydra is not installed in this environment: create the check's environment with "
                     "`bash scripts/verl/setup_check_env.sh`, then `source .venv-verl/bin/activate` and rerun")
    try:
        import verl
        from hydra import compose, initialize_config_dir
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import omega_conf_to_dataclass, validate_config
        from verl.utils.import_utils import import_external_libs

        config_dir = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=overrides)
        external_libs = cfg.actor_rollout_ref.model.get("external_lib")
        import_external_libs(external_libs)  # the worker's import (workers/config/model.py)
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        use_ref = need_reference_policy(cfg)
        validate_config(config=cfg, use_reference_policy=use_ref, use_critic=need_critic(cfg))
        loss_mode = actor.policy_loss.loss_mode
        fn = get_policy_loss_fn(loss_mode)
    except Exception as e:  # noqa: BLE001 - report any failure as a failed check
        return _fail(f"{type(e).__name__}: {e}")
    print(f"verl {verl.__version__}: config composes and validates "
          f"({cfg.trainer.nnodes} node(s) × {cfg.trainer.n_gpus_per_node} GPUs)")

    import stapo.integrations.verl as plugin
    from verl.workers.engine_workers import TrainingWorker

    libs = [] if external_libs is None else [external_libs] if isinstance(external_libs, str) else list(external_libs)
    loaded = "stapo.integrations.verl" in libs
    hooked = bool(getattr(TrainingWorker.train_batch, "_stapo_hook", False)) and plugin.WORKER_HOOK_ERROR is None
    if loss_mode in plugin.PLUGIN_LOSSES:
        if not loaded:
            return _fail(f"policy loss {loss_mode!r} needs actor_rollout_ref.model.external_lib="
                         f"stapo.integrations.verl (got {external_libs!r}): the workers would not register it nor "
                         "install the hook")
        if not hooked:
            return _fail(f"the stapo worker hook is not installed on {HOOK_TARGET}: {plugin.WORKER_HOOK_ERROR}")
    if loaded:
        state = "installed" if hooked else f"NOT installed ({plugin.WORKER_HOOK_ERROR})"
        use = "active" if loss_mode in plugin.PLUGIN_LOSSES else f"inactive for loss_mode {loss_mode!r}"
        print(f"plugin: external_lib stapo.integrations.verl imported; worker hook {state} on {HOOK_TARGET} ({use}); "
              f"registered losses {sorted(plugin.PLUGIN_LOSSES)}")
    print(f"policy loss {loss_mode!r} -> {fn.__module__}.{fn.__name__}")

    problems = []
    try:
        objective = plugin.objective_of_verl_actor(actor)
    except ValueError as e:
        objective = None
        problems.append(str(e))
    if objective is not None:
        name = plugin.registered_objective_name(objective)
        print(f"objective: {objective}")
        print("equals stapo.core.objectives " + (repr(name) if name else "(no registered objective: custom settings)"))
    if use_ref:
        print(f"reference model: on (KL loss β = {actor.kl_loss_coef}, {actor.kl_loss_type})")
    else:
        print("reference model: off")
    if cfg.algorithm.get("rollout_correction", {}).get("rollout_is") and loss_mode in plugin.PLUGIN_LOSSES:
        problems.append("algorithm.rollout_correction.rollout_is is set: rollout IS weights are not supported")
    if problems:
        return _fail("; ".join(problems))

    attn = cfg.actor_rollout_ref.model.get("override_config", {}).get("attn_implementation", "flash_attention_2")
    have_fa = importlib.util.find_spec("flash_attn") is not None
    note = "" if attn != "flash_attention_2" or have_fa else (
        " -- WARNING: flash_attn is not importable in this environment; install it on every node or set "
        "ATTN_IMPL=sdpa (docs/scaling.md, Cluster)")
    print(f"attention (FSDP actor/ref): {attn}{note}")
    engine = cfg.actor_rollout_ref.actor.fsdp_config  # what verl's FSDP engine reads (oc.select of actor's keys)
    chunked = bool(engine.get("entropy_from_logits_with_chunking", False))
    print("entropy from logits (FSDP actor): " + (f"chunked, {engine.get('entropy_from_logits_chunk_size')} tokens "
          "per chunk" if chunked else "one [tokens, V] softmax per micro-batch (no chunking)"))
    print(f"reward: {cfg.reward.custom_reward_function.path}:{cfg.reward.custom_reward_function.name} "
          f"{dict(cfg.reward.custom_reward_function.get('reward_kwargs', {}))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
