#!/bin/bash
# The six benchmarks (paper N, --limit 1, both settings) on the seed-2 final checkpoints of the four methods, then the
# table. Run from the repository root with the study's runs under runs/study/ (the seed-2 runs were trained in side
# folders of the study, _b and _c, with the same commands apart from trainer.output_dir; see ../README.md).
# Its timestamps, as run on 2026-12-03 (2-core AMD EPYC, AVX2, fp32): run.log. That run's loop printed "rc=$?" after
# a $(date) on the same line, so its rc=0 is date's, not evaluate.py's (fixed below); each run's results.json is
# complete (216 samples).
for spec in stapo_seed2:cpu_reproduction grpo_seed2:cpu_reproduction_c justrl_seed2:cpu_reproduction_b \
            entropy20_seed2:cpu_reproduction_b; do
  run=${spec%%:*}; folder=${spec##*:}
  echo "$(date -u +%H:%M:%S) start $run"
  OMP_NUM_THREADS=2 .venv/bin/python evaluate.py --config configs/eval/cpu_smollm2.yaml \
      --model runs/study/$folder/runs/$run --label $run --limit 1 --output runs/eval/bench_limit1/$run
  rc=$?
  echo "$(date -u +%H:%M:%S) done $run rc=$rc"
done
D=results/study_cpu/benchmarks_limit1
for run in stapo_seed2 grpo_seed2 justrl_seed2 entropy20_seed2; do  # the small files and the graded samples (gzip)
  mkdir -p $D/$run/generations
  cp runs/eval/bench_limit1/$run/results.{json,md,csv} $D/$run/
  for g in runs/eval/bench_limit1/$run/generations/*.jsonl; do gzip -9 -c "$g" > $D/$run/generations/$(basename "$g").gz; done
done
.venv/bin/python scripts/compare.py BASE=results/eval/smollm2_base_limit1 STAPO=$D/stapo_seed2 GRPO=$D/grpo_seed2 \
    JustRL=$D/justrl_seed2 20-Entropy=$D/entropy20_seed2 --out $D --name comparison
