"""Integrations of the STAPO objectives into existing RL training engines.

- :mod:`stapo.integrations.verl` — registers ``stapo`` and ``entropy20`` as verl policy losses (verl's own
  ``register_policy_loss`` registry) and hooks verl's actor worker so that the S2T / top-entropy masks are
  computed over the whole optimizer mini-batch (all micro-batches, all data-parallel ranks).
- :mod:`stapo.integrations.verl_reward` — our training reward in verl's ``compute_score`` signature.

Nothing here is imported by ``import stapo``: verl is an optional dependency.
"""
