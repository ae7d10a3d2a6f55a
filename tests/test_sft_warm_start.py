"""scripts/sft_warm_start.py: the cold start's examples put the loss on the reference solution only (issue 32)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from stapo.config import load_config
from stapo.model.models import EMBEDDED_ALIASES, load_tokenizer
from stapo.tasks.prompts import encode_prompt
from stapo.tasks.word_problems import reference_solution

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sft_warm_start", REPO / "scripts" / "sft_warm_start.py")
sft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sft)


def test_examples_are_the_rl_prompt_then_the_labelled_reference_solution():
    cfg = load_config(REPO / "configs" / "cpu_smollm2_word_justrl.yaml")
    tok = load_tokenizer(EMBEDDED_ALIASES[0])
    rows = sft.build_examples(tok, cfg, num_problems=5, levels=[2, 12], seed=7)
    assert len(rows) == 5  # 3 of level 2 (the first level gets the remainder), 2 of level 12
    for row in rows:
        ids, labels = row["input_ids"], row["labels"]
        n_prompt = sum(1 for x in labels if x == -100)
        prompt_text = tok.decode(ids[:n_prompt])
        problem = prompt_text.split("<|im_start|>user\n")[-1].split("\n\nPlease reason")[0]
        # the prompt is exactly training's; the labels are the reference solution and the EOS, nothing else
        assert ids[:n_prompt] == encode_prompt(problem, tok, use_chat_template=cfg.data.prompt_style,
                                               system_prompt=cfg.data.system_prompt)
        assert labels[n_prompt:] == ids[n_prompt:]
        assert ids[-1] == tok.eos_token_id
        assert tok.decode(ids[n_prompt:-1]) == reference_solution(problem)


def test_collate_pads_right_with_no_loss_on_padding():
    # two rows of 3 and 1 tokens, prompt token 5 unlabelled: padded to [2, 3] with pad id 0 and label -100
    batch = sft.collate(0)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [9], "labels": [9]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [9, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].dtype == torch.long
