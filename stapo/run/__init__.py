"""The run shell: everything about a run's folder and process that is not the algorithm — the RunFolder the trainer
is handed (folder), the lock, the parser and interrupts (cli), pre-flight checks, provenance and W&B identity, the
trackers, the console, the memory plan and the throughput cache. Nothing here imports training or evaluation."""
