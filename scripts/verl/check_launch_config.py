#!/usr/bin/env python
"""Dry-run check of a verl launch line: compose the hydra overrides, instantiate the actor config, validate.

Called by ``DRY_RUN=1 bash scripts/verl/run_stapo_qwen3_1.7b.sh`` with the script's overrides; runs in the verl
environment (needs verl, hydra-core, stapo; no GPU, no data, no model download). It

1. composes verl's ``ppo_trainer`` config (the yaml files installed with verl) with the overrides, exactly as
   ``python -m verl.trainer.main_ppo`` does (``@hydra.main(config_name="ppo_trainer")``);
2. instantiates ``actor_rollout_ref.actor`` through ``verl.utils.config.omega_conf_to_dataclass`` — the hydra
   ``_target_`` path the workers take — which imports the plugin for ``StapoPolicyLossConfig``;
3. runs verl's own driver-side ``validate_config``;
4. prints the objective the registered loss will use (:func:`stapo.integrations.verl.objective_from_verl_config`)
   and fails on settings the plugin rejects at run time (``loss_agg_mode`` ≠ token-mean, rollout IS weights).

Exit codes: 0 ok; 1 a check failed (the error is printed).
"""
from __future__ import annotations

import sys
from pathlib import Path


def main(overrides: list[str]) -> int:
    """Run the checks for ``overrides`` (hydra override strings); see the module docstring."""
    try:
        import verl
        from hydra import compose, initialize_config_dir
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import omega_conf_to_dataclass, validate_config

        config_dir = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=overrides)
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        for lib in [cfg.actor_rollout_ref.model.get("external_lib")] if cfg.actor_rollout_ref.model.get(
                "external_lib") else []:
            __import__(lib)
        loss_mode = actor.policy_loss.loss_mode
        fn = get_policy_loss_fn(loss_mode)
    except Exception as e:  # noqa: BLE001 - report any failure as a failed check
        print(f"check failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"verl {verl.__version__}: config composes and validates "
          f"({cfg.trainer.nnodes} node(s) × {cfg.trainer.n_gpus_per_node} GPUs)")
    print(f"policy loss {loss_mode!r} -> {fn.__module__}.{fn.__name__}")
    from stapo.integrations.verl import PLUGIN_LOSSES, objective_from_verl_config

    if loss_mode in PLUGIN_LOSSES:
        objective = objective_from_verl_config(loss_mode, actor)
        print(f"objective: {objective}")
        problems = []
        if actor.loss_agg_mode != objective.loss_agg_mode:
            problems.append(f"actor.loss_agg_mode={actor.loss_agg_mode!r}, the loss needs {objective.loss_agg_mode!r}")
        if cfg.algorithm.get("rollout_correction", {}).get("rollout_is"):
            problems.append("algorithm.rollout_correction.rollout_is is set: rollout IS weights are not supported")
        if problems:
            print("check failed: " + "; ".join(problems), file=sys.stderr)
            return 1
    print(f"reward: {cfg.reward.custom_reward_function.path}:{cfg.reward.custom_reward_function.name} "
          f"{dict(cfg.reward.custom_reward_function.get('reward_kwargs', {}))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
