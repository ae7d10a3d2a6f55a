"""Supervised warm start ("cold start") of the policy on the word-problem task's reference solutions (issue 32).

    python scripts/sft_warm_start.py [--config configs/cpu_smollm2_word_justrl.yaml] [--out data/models/word_sft]
                                     [--num-problems 256] [--levels 2 3 4 12 13 14] [--epochs 1] [--lr 1e-5]
                                     [--batch-size 8] [--seed 1234]

Why: the embedded SmolLM2-135M-Instruct scores 0-4 % on the word problems at T = 1 whatever the prompt
(results/word_task_probe.md, results/mechanism_study/calibration.md), so almost no GRPO group carries a reward
difference and the study's calibration gate (some level at >= 15 %) fails on the raw model. As DeepSeek-R1's "cold
start" does, a short supervised pass on a few hundred worked solutions teaches the format (numbered steps, one
calculation each, the box); RL then starts from that model. It is not in the STAPO paper (whose Qwen3 base models
already reason) and is applied to every method of the study alike (they all start from its output).

Data: ``--num-problems`` training-split problems (:func:`stapo.tasks.word_problems.generate_word_problems`,
``split="train"``: never a held-out ``word_*`` benchmark problem) drawn evenly over ``--levels`` with ``--seed``
(not the RL training set's seed, ``data.synthetic.seed``), each paired with its reference solution
(:func:`stapo.tasks.word_problems.reference_solution`) and the EOS token. The prompt is exactly the RL prompt of
``--config`` (chat template, its ``data.system_prompt``; :func:`stapo.tasks.prompts.encode_prompt`); the loss is the
token-mean cross-entropy over the solution tokens only (prompt and padding labelled -100).

Training: transformers' ``Trainer`` (AdamW, linear decay to 0, no warm-up, fp32, weight decay 0, gradient clip 1.0,
``--batch-size`` sequences per step, ``--epochs`` passes), then the model and tokenizer are saved as an HF folder at
``--out`` that ``model.path`` can name. ``--out`` must not exist (never overwritten); ``sft_info.json`` in it records
the arguments, the loss per step and the wall time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from stapo.config import load_config  # noqa: E402
from stapo.model.models import load_policy  # noqa: E402
from stapo.tasks.prompts import encode_prompt  # noqa: E402
from stapo.tasks.word_problems import WORD_LEVELS, generate_word_problems, reference_solution  # noqa: E402


def build_examples(tok, cfg, num_problems: int, levels: list[int], seed: int) -> list[dict[str, list[int]]]:
    """``num_problems`` (prompt, solution) examples as ``{"input_ids", "labels"}`` token lists.

    ``labels`` is -100 on the prompt tokens (no loss) and the token id on the solution and its EOS.
    Problems are split evenly over ``levels`` (the first ``num_problems % len(levels)`` levels get one more).
    """
    out = []
    for i, level in enumerate(levels):
        n = num_problems // len(levels) + (i < num_problems % len(levels))
        for r in generate_word_problems(n, seed=seed + level, levels=[level], split="train"):
            prompt = encode_prompt(r.problem, tok, use_chat_template=cfg.data.prompt_style,
                                   system_prompt=cfg.data.system_prompt)
            target = list(tok(reference_solution(r.problem), add_special_tokens=False)["input_ids"])
            target.append(tok.eos_token_id)
            out.append({"input_ids": prompt + target, "labels": [-100] * len(prompt) + target})
    return out


def collate(pad_id: int):
    """A collator padding ``input_ids`` (right, ``pad_id``) and ``labels`` (-100) to the longest row: [B, T] int64."""
    def fn(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        T = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long)      # [B, T]
        labels = torch.full((len(rows), T), -100, dtype=torch.long)     # [B, T]
        attn = torch.zeros((len(rows), T), dtype=torch.long)            # [B, T]
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            attn[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": attn}
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/cpu_smollm2_word_justrl.yaml", help="its model.path and prompt")
    ap.add_argument("--out", default="data/models/word_sft")
    ap.add_argument("--num-problems", type=int, default=256)
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 3, 4, 12, 13, 14])
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    out = Path(args.out)
    bad = [lv for lv in args.levels if lv not in WORD_LEVELS]
    if bad or args.num_problems < 1 or args.lr <= 0 or args.epochs <= 0 or args.batch_size < 1:
        sys.exit(f"sft_warm_start.py: --levels must be of {sorted(WORD_LEVELS)} (got {bad}); --num-problems, "
                 "--lr, --epochs, --batch-size must be positive")
    if out.exists():
        sys.exit(f"sft_warm_start.py: {out} exists; choose another --out (a finished model is never overwritten)")

    from transformers import Trainer, TrainingArguments, TrainerCallback

    cfg = load_config(REPO / args.config)
    torch.manual_seed(args.seed)
    model, tok = load_policy(cfg.model.path)
    examples = build_examples(tok, cfg, args.num_problems, args.levels, args.seed)
    losses: list[dict[str, float]] = []

    class _Record(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "loss" in logs:
                losses.append({"step": state.global_step, "loss": float(logs["loss"])})
                print(f"step {state.global_step}: loss {logs['loss']:.4f}", flush=True)

    tmp = out.with_name(out.name + ".partial")
    targs = TrainingArguments(
        output_dir=str(tmp), per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
        learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], seed=args.seed, use_cpu=True,
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    model.train()
    t0 = time.time()
    Trainer(model=model, args=targs, train_dataset=examples, data_collator=collate(tok.pad_token_id),
            callbacks=[_Record()]).train()
    model.eval()
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "sft_info.json").write_text(json.dumps({
        "command": "python scripts/sft_warm_start.py " + " ".join(sys.argv[1:]), "args": vars(args),
        "base_model": cfg.model.path, "examples": len(examples), "seconds": round(time.time() - t0, 1),
        "losses": losses}, indent=1) + "\n")
    tmp.rename(out)
    print(f"wrote {out} ({len(examples)} examples, {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
