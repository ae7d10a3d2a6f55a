"""Tests for stapo/tasks/prompts.py with small tokenizers built here (no hub access)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from stapo.tasks.prompts import BOXED_SUFFIX, encode_prompt, format_prompt, format_prompts, user_content, uses_chat_template

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Word-level vocabulary: ids are easy to read off by hand.
VOCAB = {"[UNK]": 0, "<s>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "user": 4, "assistant": 5, "What": 6, "is": 7, "2": 8, "+": 9, "3": 10, "?": 11}


def _tokenizer(with_template: bool) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    # A BOS is added when add_special_tokens=True, like Llama-style tokenizers.
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if with_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def test_suffix_text():
    assert BOXED_SUFFIX == "Please reason step by step, and put your final answer within \\boxed{}."
    assert user_content("What is 2 + 3?") == "What is 2 + 3?\n\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_chat_template_used_when_available():
    tok = _tokenizer(with_template=True)
    expected = (
        "<|im_start|>user\nWhat is 2 + 3?\n\n"
        "Please reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert format_prompt("What is 2 + 3?", tok) == expected  # "auto"
    assert format_prompt("What is 2 + 3?", tok, use_chat_template=True) == expected
    assert format_prompt("What is 2 + 3?", tok, use_chat_template="chat") == expected  # config spelling
    with_system = format_prompt("What is 2 + 3?", tok, system_prompt="Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_plain_text_for_base_models_or_when_switched_off():
    plain = "What is 2 + 3?\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert format_prompt("What is 2 + 3?", _tokenizer(with_template=False)) == plain  # auto, no template
    assert format_prompt("What is 2 + 3?", _tokenizer(with_template=True), use_chat_template=False) == plain
    assert format_prompt("What is 2 + 3?", _tokenizer(with_template=True), use_chat_template="plain") == plain
    assert format_prompt("What is 2 + 3?", None) == plain
    assert format_prompts(["What is 2 + 3?"] * 2) == [plain, plain]


def test_switch_errors():
    with pytest.raises(ValueError, match="has no chat_template"):
        format_prompt("q", _tokenizer(with_template=False), use_chat_template=True)
    with pytest.raises(ValueError, match="has no chat_template"):
        uses_chat_template(None, True)
    with pytest.raises(ValueError, match="must be 'auto', True/'chat' or False/'plain'"):
        uses_chat_template(None, "yes")
    with pytest.raises(ValueError, match="system_prompt needs the chat template"):
        format_prompt("q", None, system_prompt="hi")
    with pytest.raises(ValueError, match=r"problems\[1\]: problem is empty"):
        format_prompts(["q", "  "])
    with pytest.raises(TypeError):
        user_content(None)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        encode_prompt("q", None)


def test_encode_prompt_special_tokens():
    # Chat template: special tokens come from the template, no extra BOS (add_special_tokens=False).
    # By hand: <|im_start|>=2 user=4 What=6 is=7 2=8 +=9 3=10 ?=11; then the suffix, none of whose
    # words or punctuation ("Please", "reason", ..., "\\", "boxed", "{}.") is in VOCAB -> all 0;
    # then <|im_end|>=3 <|im_start|>=2 assistant=5.
    tok = _tokenizer(with_template=True)
    ids = encode_prompt("What is 2 + 3?", tok)
    assert ids[:8] == [2, 4, 6, 7, 8, 9, 10, 11]
    assert ids[-3:] == [3, 2, 5]
    assert 1 not in ids  # no BOS
    assert set(ids[8:-3]) == {0}
    # Plain text: the tokenizer's BOS is added.
    plain_ids = encode_prompt("What is 2 + 3?", _tokenizer(with_template=False))
    assert plain_ids[:7] == [1, 6, 7, 8, 9, 10, 11]
    assert set(plain_ids[7:]) == {0}
