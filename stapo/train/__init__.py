"""The training loop as a package (docs/method.md; the map is in the README's "Layout").

* :mod:`stapo.train.trainer` — :class:`Trainer`: built from a config; :meth:`Trainer.train` (loop, validation,
  checkpoints, resume) and :meth:`Trainer.train_step` (rollout → reward → advantages → plan → old/ref statistics →
  update → sync → metrics).
* :mod:`stapo.train.plan` — :class:`UpdatePlan`: which rows are forwarded when, which graphs are kept, where the
  mask reads its statistics; sizes the progress bar.
* :mod:`stapo.train.update` — :class:`PolicyUpdate`: executes the plan (mask → denominator → forward/backward →
  clip → AdamW step).
* :mod:`stapo.train.batch` — :class:`Rollout` and :class:`StepBatch`, what flows between the stages.
* :mod:`stapo.train.metrics` — the step metrics, the metric accumulator, the silenced-token table.
* :mod:`stapo.train.prompts` — :class:`PromptLoader` and :func:`load_prompts`.
* :mod:`stapo.train.state` — :class:`RunState`: a step's checkpoint and resuming from the latest one.
"""
from stapo.train.batch import Rollout, StepBatch
from stapo.train.plan import UpdatePlan, build_plan
from stapo.train.prompts import PromptLoader, load_prompts
from stapo.train.state import RunState
from stapo.train.trainer import Trainer
from stapo.train.update import PolicyUpdate, UpdateResult

__all__ = ["Trainer", "PromptLoader", "load_prompts", "Rollout", "StepBatch", "UpdatePlan",
           "build_plan", "PolicyUpdate", "UpdateResult", "RunState"]
