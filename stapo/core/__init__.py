"""The paper's algorithm: pure tensor functions, no model, no files (read these first).

token_stats (log p, entropy, collision from logits) → advantages (GRPO) → masks (S2T, 20-Entropy, the ablations;
``register_token_mask``) → objectives (the clipped surrogate, loss aggregation, ``register_objective``) → minibatch (a
mask over a mini-batch split across ranks); params (the paper's values), analysis, metric_names, tensor_utils.
docs/method.md is the specification; docs/extending.md adds a mask or a loss in one decorated function.
"""
