"""stapo.common.perf: the FLOP / byte counts of the utilisation report, worked by hand on a tiny shape."""
import math
import os

import pytest
import torch

from stapo.common import perf

# d = 4, MLP 8, 2 layers, 2 query heads and 1 key-value head of 2, 10 output rows.
# One layer's matmul weights: q 4·4 + k, v 2·(4·2) + o 4·4 + MLP 3·(4·8) = 16 + 16 + 16 + 96 = 144.
TINY = perf.ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab_rows=10)


def test_layer_params_and_weight_bytes():
    assert TINY.layer_linear_params == 144
    assert TINY.lm_head_params == 40
    assert TINY.weight_bytes(4) == (2 * 144 + 40) * 4  # 1,312 bytes
    assert TINY.kv_bytes_per_key(2) == 2 * 2 * 1 * 2 * 2  # K and V × layers × kv heads × head dim × 2 bytes


def test_forward_work_plain_and_shared_prompt():
    # Plain: 2 rows × (P=3 + R=2) = 10 positions; keys 2 · (1+2+3+4+5) = 30; logits for R + 1 = 3 per row.
    # 2·L·144·10 + 4·L·(heads·hd)·30 + 2·40·6 = 5,760 + 960 + 480
    assert perf.forward_work(TINY, rows=2, prompt_width=3, response_width=2).flops == 7200
    # Shared prompt (1 distinct): prompt pass 3 positions (keys 1+2+3 = 6) + 2 rows × 1 response position at
    # position 3 (4 keys each) → 5 positions, 14 keys, logits 2 per row: 2,880 + 4·2·4·14 + 320 = 2,880 + 448 + 320
    assert perf.forward_work(TINY, rows=2, prompt_width=3, response_width=2, prompts=1).flops == 3648


def test_prefill_and_decode_work():
    # Prefill of a 3-token prompt: 3 positions, 6 keys, one logits row: 1,728 + 192 + 80
    assert perf.prefill_work(TINY, [3]).flops == 2000
    # Decode of a 3-token response after a 3-token prompt: 2 forwards (tokens 1 and 2), at positions 3 and 4
    # → 4 + 5 = 9 keys, each with logits: 2·2·144·2 + 4·2·4·9 + 80·2 = 1,152 + 288 + 160
    w = perf.decode_work(TINY, [3], [3], itemsize=4)
    assert w.flops == 1600
    # bytes: 2 decode steps × 1,312 weight bytes + 9 keys × 32 bytes of K/V (fp32)
    assert w.bytes == 2 * 1312 + 9 * 32
    # Two sequences decode together: the weights are read once per step (max length − 1 = 2 steps)
    w2 = perf.decode_work(TINY, [3, 3], [3, 1], itemsize=4)
    assert w2.bytes == 2 * 1312 + 9 * 32 and w2.flops == 1600  # the 1-token response needs no decode forward
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        perf.decode_work(TINY, [3, 3], [3], itemsize=4)


def test_linear_shapes_cover_forward_and_backward():
    fwd = TINY.linear_shapes(5)
    assert (5, 4, 10) in fwd and len(fwd) == 8  # the LM head [5, 4] @ [4, 10]
    both = TINY.linear_shapes(5, backward=True)
    assert len(both) == 24 and (5, 10, 4) in both and (10, 5, 4) in both  # grad-input and grad-weight products
    # the backward products have twice the forward's FLOPs
    flops = [2 * m * k * n for m, k, n in both]
    assert sum(flops[8:]) == 2 * sum(flops[:8])


def test_gemm_rate_and_fraction():
    rate = perf.gemm_rate([(8, 8, 8)], reps=1)
    assert rate > 0 and math.isfinite(rate)
    with pytest.raises(ValueError, match="non-positive"):
        perf.gemm_rate([(0, 8, 8)])
    assert perf.fraction(2.0, 1.0) == 0.5 and math.isnan(perf.fraction(0.0, 1.0))


def test_from_hf_config_defaults_head_dim():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    s = perf.ModelShape.from_hf_config(cfg)
    assert (s.head_dim, s.kv_heads, s.vocab_rows) == (16, 2, 100)


def test_machine_line_names_flags():
    line = perf.machine_line()
    assert "cores" in line and torch.__version__ in line
    assert ("ATEN_CPU_CAPABILITY" in line) == ("ATEN_CPU_CAPABILITY" in os.environ)
    assert perf.native_bf16() == bool(perf.cpu_flags() & {"avx512_bf16", "amx_bf16"})


# --- logged utilisation: perf/mfu/actor, perf/max_memory_allocated_gb (issue 33) ---------------------------------
def test_update_flops_by_hand():
    from stapo.common.perf import ModelShape, update_flops

    # d = 4, 1 layer, 1 head of 4, MLP 8, V = 10: layer params 4·4 (q) + 2·4·4 (k, v) + 4·4 (o) + 3·4·8 = 160
    shape = ModelShape(hidden=4, intermediate=8, layers=1, heads=1, kv_heads=1, head_dim=4, vocab_rows=10)
    # a row of 2 prompt + 1 response tokens: 3 positions, 1 + 2 + 3 = 6 causal keys, logits for 1 + 1 positions:
    # 2·160·3 + 4·1·4·6 + 2·(4·10)·2 = 960 + 96 + 160 = 1,216 per forward; update = 3 forwards = 3,648
    assert update_flops(shape, [2], [1]) == 3648.0
    # two rows add: the second of 1 + 1 tokens: 2·160·2 + 4·4·3 + 2·40·2 = 640 + 48 + 160 = 848 → 3·(1216 + 848)
    assert update_flops(shape, [2, 1], [1, 1]) == 3 * (1216 + 848)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        update_flops(shape, [2, 1], [1])


def test_peak_flops_table_override_and_unknown():
    from stapo.common.perf import mfu, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12  # the PCIe card before the generic H100 entry
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float16") == 312e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32") is None  # the table's peaks are bf16/fp16 ones
    assert peak_flops(None, "bfloat16") is None and peak_flops("Some GPU", "bfloat16") is None
    assert peak_flops(None, "float32", 2e12) == 2e12  # trainer.peak_flops wins, on any device
    # 3,648 FLOPs in 2 s on a 1,000 FLOP/s device: 3648 / 2000 = 1.824
    assert mfu(3648.0, 2.0, 1000.0) == pytest.approx(1.824)
    assert mfu(1.0, 1.0, None) is None and mfu(1.0, 0.0, 1.0) is None


def test_max_memory_gb_on_cpu_is_the_process_peak_rss():
    import resource

    from stapo.common.perf import max_memory_gb

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    got = max_memory_gb("cpu")
    assert got >= kib / 2**20 and got < 2 * kib / 2**20 + 1  # the peak only grows between the two reads
