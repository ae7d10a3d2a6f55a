"""The policy and its tensors: loading models (models), the fused LM head, the precision policy, torchrun data
parallelism (distributed) and crash-safe checkpoints."""
