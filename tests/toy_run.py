"""Run the trainer on the tiny model with a toy reward (used by tests/test_trainer.py in a subprocess).

    python tests/toy_run.py OUTPUT_DIR [key=value ...]

The toy reward gives +1 to responses whose decoded text has an even number of characters and −1 otherwise,
so groups of the random tiny model get varied rewards and non-zero advantages (the strict-box reward would
be −1 everywhere).
"""
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.config import load_config  # noqa: E402
from stapo.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def toy_reward(responses, golds):
    return SimpleNamespace(rewards=[1.0 if len(t) % 2 == 0 else -1.0 for t in responses], stats=None)


def make_trainer(output_dir: str, overrides: list[str]) -> Trainer:
    cfg = load_config(REPO / "configs" / "tiny_test.yaml",
                      [f"trainer.output_dir={output_dir}", "trainer.run_name=toy", *overrides])
    return Trainer(cfg, reward_fn=toy_reward)


if __name__ == "__main__":
    make_trainer(sys.argv[1], sys.argv[2:]).train()
