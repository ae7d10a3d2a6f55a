"""stapo — a reproduction of STAPO (arXiv 2602.15620): GRPO-style RL for LLM math reasoning
stabilised by the S2T (Silencing Spurious Tokens) mask, with the GRPO, 20-Entropy and JustRL baselines.

Package layout (one file per concern):
  token_stats  — log-prob, entropy and collision probability of target tokens from logits (chunked)
  advantages   — GRPO group-normalised advantages
  masks        — token masks: S2T (STAPO) and top-entropy (20-Entropy)
  objectives   — clipped surrogate, KL, loss aggregation and the registry of named objectives
  analysis     — the paper's token-level analysis (§9): gradient norms, entropy change, quadrants
"""

__version__ = "0.1.0"
