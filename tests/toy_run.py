"""Run the trainer on the tiny model with a toy reward (used by tests/test_trainer.py in a subprocess).

    python tests/toy_run.py OUTPUT_DIR [--uneven-reward] [key=value ...]
    torchrun --nproc_per_node=2 tests/toy_run.py OUTPUT_DIR ...      # data-parallel (tests/test_distributed.py)
    ... --record-weight-dtypes=FILE   # rank 0 writes the dtypes q_proj's weight had in the update's forwards

The toy reward gives +1 to responses whose decoded text has an even number of characters and −1 otherwise,
so groups of the random tiny model get varied rewards and non-zero advantages (the strict-box reward would
be −1 everywhere). ``--uneven-reward``: the same, except that global prompt 1 of every step gets −1 for all
its responses (Â = 0: no S2T candidates), see :func:`uneven_reward_for`.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.config import load_config  # noqa: E402
from stapo.train import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def toy_reward(responses, golds):
    return SimpleNamespace(rewards=[1.0 if len(t) % 2 == 0 else -1.0 for t in responses], stats=None)


def uneven_reward_for(cfg):
    """:func:`toy_reward`, but −1 for every response of the step's global prompt 1.

    With data.train_batch_size=4, actor.ppo_mini_batch_size=2 and 2 ranks, global prompt 1 is rank 1's half of
    the first mini-batch, so that mini-batch's S2T candidates all sit on rank 0. The global index of a response's
    prompt is recovered from this rank's share (:func:`stapo.model.distributed.shard_prompt_indices`).
    """
    from stapo.model.distributed import shard_prompt_indices
    from stapo.core.minibatch import dist_world

    G = cfg.rollout.n

    def reward(responses, golds):
        world, rank = dist_world()
        share = shard_prompt_indices(cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, world, rank)
        base = toy_reward(responses, golds).rewards
        return SimpleNamespace(rewards=[-1.0 if share[i // G] == 1 else r for i, r in enumerate(base)], stats=None)

    return reward


def make_trainer(output_dir: str, overrides: list[str], uneven_reward: bool = False) -> Trainer:
    cfg = load_config(REPO / "configs" / "tiny_test.yaml",
                      [f"trainer.output_dir={output_dir}", "trainer.run_name=toy", *overrides])
    return Trainer(cfg, reward_fn=uneven_reward_for(cfg) if uneven_reward else toy_reward)


def record_weight_dtypes(trainer: Trainer) -> list[str]:
    """Record the dtype of the first decoder layer's q_proj weight as the module sees it in every forward with
    grad (the update). FSDP2 with a MixedPrecisionPolicy unshards it in bf16; autocast alone leaves it fp32."""
    seen: list[str] = []
    proj = trainer.model.model.layers[0].self_attn.q_proj

    def hook(module, args):
        import torch

        if torch.is_grad_enabled():
            seen.append(str(module.weight.dtype).removeprefix("torch."))

    proj.register_forward_pre_hook(hook)
    return seen


if __name__ == "__main__":
    import json

    from stapo.model.distributed import barrier, teardown

    args = sys.argv[2:]
    uneven = "--uneven-reward" in args
    record = next((a.split("=", 1)[1] for a in args if a.startswith("--record-weight-dtypes=")), None)
    overrides = [a for a in args if a != "--uneven-reward" and not a.startswith("--record-weight-dtypes=")]
    trainer = make_trainer(sys.argv[1], overrides, uneven_reward=uneven)
    seen = record_weight_dtypes(trainer) if record else None
    try:
        trainer.train()
        if record and trainer.dist.is_main:
            Path(record).write_text(json.dumps(sorted(set(seen))))
        barrier(trainer.dist)  # as train.py: every rank done before any tears the process group down
    finally:
        trainer.close()
        teardown()
