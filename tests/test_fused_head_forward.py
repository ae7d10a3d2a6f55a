"""The fused LM head inside the model's forward (stapo.model.lm_head.forward_token_stats), in one process and inside the
FSDP2 root module's forward on 2 gloo ranks; the token-statistics tile sizes per device.

References: the logits path (the model's own LM head + token_stats) in one process without FSDP2, and
``lm_head_token_stats`` on the decoder's hidden states; never the code under test against itself.  Tolerances: fp32
everywhere, the two paths differ only by the summation order over ~4k vocabulary columns (statistics ≤ 2e-6 absolute,
gradients ≤ 1e-5 of each tensor's scale + 1e-4 relative, as in tests/test_policy.py).
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.multiprocessing as mp

from stapo.model.lm_head import (
    TokenStatsRequest,
    forward_token_stats,
    install_token_stats_forward,
    lm_head_tiles,
    lm_head_token_stats,
)
from stapo.train.policy import collate_responses, policy_token_stats
from stapo.rollout import Response
from stapo.core.token_stats import ChunkSizes, chunk_sizes

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

VOCAB, PAD_ROWS = 4096, 5  # real token ids, padded embedding rows (never in the softmax)


def _tiny(tied: bool, seed: int = 0):
    """A 2-layer Qwen3 (d = 16) with VOCAB + PAD_ROWS embedding rows, no tokenizer needed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB + PAD_ROWS, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=tied, use_sliding_window=False, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    model.config.stapo_vocab_size = VOCAB
    return model.train()  # (no dropout in Qwen3; train() turns gradient checkpointing on when enabled)


def _responses(seed: int = 5):
    """2 groups × 2 responses: prompts of 3 and 6 tokens, responses of 1 … 40 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for grp, (plen, rlens) in enumerate([(3, (40, 7)), (6, (1, 33))]):
        prompt = torch.randint(1, VOCAB, (plen,), generator=g).tolist()
        for n in rlens:
            out.append(Response(group=grp, prompt_ids=prompt, response_ids=torch.randint(1, VOCAB, (n,), generator=g)
                                .tolist(), text="", engine_logprobs=None, finish_reason="eos"))
    return out


def _loss(st):
    return st.logprobs.sum() + 0.5 * st.entropy.sum()


def _assert_stats_close(got, ref, what):
    for f in ("logprobs", "entropy", "collision"):
        torch.testing.assert_close(getattr(got, f), getattr(ref, f), atol=2e-6, rtol=0, msg=f"{what}: {f}")


def _assert_grads_close(got: dict, ref: dict, what):
    assert got.keys() == ref.keys(), what
    for n, gr in ref.items():
        torch.testing.assert_close(got[n], gr, atol=1e-5 * float(gr.abs().max()) + 1e-7, rtol=1e-4, msg=f"{what}: {n}")


# --------------------------------------------------------------------------------------------------
# One process.
# --------------------------------------------------------------------------------------------------


def test_forward_token_stats_is_the_head_on_the_decoder_states_and_leaves_the_plain_forward_alone():
    """forward_token_stats(keep=...) = lm_head_token_stats(decoder states[keep], W) bit for bit (slice, int and flat
    index selections, rows + prefix); a hidden-only request returns those states; calls without the request run the
    model's own forward (same logits, and HF sees its original signature, ``logits_to_keep`` included)."""
    model = _tiny(tied=True).eval()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))  # [B=2, L=9]
    with torch.no_grad():
        before = model(input_ids=ids).logits  # [2, 9, V_rows]
    install_token_stats_forward(model)
    install_token_stats_forward(model)  # idempotent
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    assert "forward" in model.__dict__ and "forward" not in _tiny(tied=True).__dict__  # this instance only
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
        h = model.model(input_ids=ids).last_hidden_state  # [2, 9, d]
    W = model.get_output_embeddings().weight
    t = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1))  # [2, 4]
    flat = torch.tensor([0, 4, 9, 17])  # flat positions into the 2·9
    cases = [(dict(keep=slice(-5, -1)), h[:, -5:-1], t),
             (dict(keep=4), h[:, -4:], t),
             (dict(keep=flat), h.reshape(-1, h.shape[-1])[flat], t[0]),
             (dict(keep=2, rows=torch.tensor([1, 0]), prefix=h[:, :2]),
              torch.cat([h[:, :2], h[[1, 0], -2:]], dim=1), t)]
    for kw, states, targets in cases:
        req = TokenStatsRequest(targets, 0.7, vocab_size=VOCAB, backend="eager")
        with torch.no_grad():
            got = forward_token_stats(model, req, input_ids=ids, **kw)
            ref = lm_head_token_stats(states, W, targets, 0.7, vocab_size=VOCAB, backend="eager")
            hid = forward_token_stats(model, req.hidden_only(), input_ids=ids, **kw)
        assert got.hidden is None and hid.logprobs is None and torch.equal(hid.hidden, states)
        for f in ("logprobs", "entropy", "collision"):
            assert torch.equal(getattr(got, f), getattr(ref, f)), (kw, f)
    with pytest.raises(ValueError, match="keep must be"):
        forward_token_stats(model, req, input_ids=ids, keep=torch.ones(2, 2, dtype=torch.long))


@pytest.mark.parametrize("tied", [False, True])
def test_fused_in_forward_matches_the_logits_path_with_gradient_checkpointing(tied):
    """actor.lm_head=fused (the head inside the forward) with gradient checkpointing on: the logits path's values and
    gradients, tied and untied embeddings; the padded embedding rows get exactly zero gradient."""
    batch = collate_responses(_responses(), pad_token_id=0)
    out = {}
    for head in ("logits", "fused"):
        model = _tiny(tied)
        model.gradient_checkpointing_enable()
        st = policy_token_stats(model, batch, 0.7, lm_head=head, entropy_grad=True, backend="eager")
        _loss(st).backward()
        out[head] = (st, {n: p.grad for n, p in model.named_parameters()})
    _assert_stats_close(out["fused"][0], out["logits"][0], "stats")
    _assert_grads_close(out["fused"][1], out["logits"][1], "grads")
    assert torch.all(out["fused"][1]["model.embed_tokens.weight" if tied else "lm_head.weight"][VOCAB:] == 0)


def test_tile_sizes_per_device():
    """CPU keeps today's sizes (256 compiled rows, 13-row bf16 upcast, 4 eager rows at V = 151,936; 8,192 × 2,048
    head tiles); CUDA gets 4,096 compiled rows reading bf16 directly, 441 eager rows, 16,384 × 8,192 head tiles.
    (A torch.device("cuda") needs no GPU: only its type is read.)"""
    V = 151_936
    assert chunk_sizes(torch.device("cpu"), V, "compiled") == ChunkSizes(rows=256, upcast_rows=13)
    assert chunk_sizes("cpu", V, "compiled", torch.float32) == ChunkSizes(rows=256, upcast_rows=None)
    assert chunk_sizes("cpu", V, "eager") == ChunkSizes(rows=4, upcast_rows=None)  # 2.5 MiB // (4 B · V)
    assert chunk_sizes(torch.device("cuda"), V, "compiled") == ChunkSizes(rows=4096, upcast_rows=None)
    assert chunk_sizes("cuda:1", V, "eager") == ChunkSizes(rows=441, upcast_rows=None)  # 256 MiB // (4 B · V)
    assert lm_head_tiles(torch.device("cpu")) == (8192, 2048)
    assert lm_head_tiles(torch.device("cuda", 0)) == (16384, 8192)


@pytest.mark.slow
def test_gpu_route_run_on_cpu_reads_bf16_directly_and_matches_the_eager_kernel(monkeypatch):
    """The CUDA chunking (4,096-row compiled calls on bf16 logits without the upcast buffer; 16,384 × 8,192 head
    tiles) run on the CPU by pretending the device is a GPU: the same statistics and gradients as the eager kernel
    (bf16 logits, fp32 statistics: ≤ 5e-6; bf16 gradient: ≤ 1 bf16 ulp of its scale).  Slow: compiles the kernels'
    bf16 variant (~10 s)."""
    import stapo.model.lm_head as lm
    import stapo.core.token_stats as ts

    upcasts = []
    real_upcast = ts._fwd_sums_upcast
    monkeypatch.setattr(ts, "_fwd_sums_upcast", lambda *a: upcasts.append(1) or real_upcast(*a))
    monkeypatch.setattr(ts, "_gpu_sizes", lambda device: True)
    monkeypatch.setattr(lm, "_gpu_sizes", lambda device: True)
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(300, 5003, generator=g)).bfloat16().requires_grad_()  # [N, V] bf16
    t = torch.randint(0, 5003, (300,), generator=g)
    grads = {}
    for backend in ("eager", "compiled"):
        st = ts.token_stats(x, t, 0.7, backend=backend)
        (st.logprobs.sum() + st.entropy.sum()).backward()
        grads[backend] = (st, x.grad.float())
        x.grad = None
    assert upcasts == [] and ts.chunk_sizes(x.device, 5003, "compiled").rows == 4096
    for f in ("logprobs", "entropy", "collision"):
        torch.testing.assert_close(getattr(grads["compiled"][0], f), getattr(grads["eager"][0], f), atol=5e-6, rtol=0)
    torch.testing.assert_close(grads["compiled"][1], grads["eager"][1], rtol=0,
                               atol=float(grads["eager"][1].abs().max()) * 2**-8)
    h = torch.randn(300, 16, generator=g).bfloat16()  # [N, d]
    W = torch.randn(5003, 16, generator=g).bfloat16()  # [V, d]
    a = lm_head_token_stats(h, W, t, 0.7, backend="compiled")
    b = lm_head_token_stats(h, W, t, 0.7, backend="eager")
    for f in ("logprobs", "entropy", "collision"):
        torch.testing.assert_close(getattr(a, f), getattr(b, f), atol=5e-6, rtol=0)
    assert upcasts == []


# --------------------------------------------------------------------------------------------------
# FSDP2 on 2 gloo ranks.
# --------------------------------------------------------------------------------------------------


def _max_numel_mode():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class MaxNumel(TorchDispatchMode):
        """The largest numel of any tensor an aten op produces (as tests/test_lm_head.py's probe)."""

        def __init__(self):
            super().__init__()
            self.max = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor):
                    self.max = max(self.max, x.numel())
            return out

    return MaxNumel()


# (tied embeddings, gradient checkpointing, forward layout): the padded batch untied, tied with checkpointing, and the
# packed [1, T] layout (stapo.train.policy.layout_inputs; the head on flat positions) tied
VARIANTS = ((False, False, "padded"), (True, True, "padded"), (True, False, "packed"))


def _fsdp2_worker(rank: int, store: str, out_dir: str) -> None:
    import stapo.model.distributed as dist
    import stapo.model.lm_head as lm

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = dist.DistContext(world=2, rank=rank, strategy="fsdp2")
    lm._VOCAB_TILE = 1024  # CPU default vocabulary tile → 4 tiles over V = 4,096 (the default 8,192 would be one)
    responses = _responses()
    full = collate_responses(responses, pad_token_id=0)  # [4, ·]
    local = collate_responses(responses[2 * rank:2 * rank + 2], pad_token_id=0)  # this rank's 2 rows
    res = {}
    try:
        for tied, ckpt, layout in VARIANTS:
            # one-process reference: the logits path on all 4 rows, loss halved (FSDP2 averages over 2 ranks)
            ref_model = _tiny(tied)
            ref = policy_token_stats(ref_model, full, 0.7, lm_head="logits", entropy_grad=True, backend="eager")
            (0.5 * _loss(ref)).backward()
            ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
            model = _tiny(tied)
            if ckpt:
                model.gradient_checkpointing_enable()
            dist.wrap_policy(model, ctx)  # fully_shard per decoder layer, then the root
            with _max_numel_mode() as probe:
                st = policy_token_stats(model, local, 0.7, lm_head="fused", entropy_grad=True, backend="eager",
                                        layout=layout)
                _loss(st).backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective, same order
            sharded = all(type(p).__name__ == "DTensor" for p in model.parameters())
            rows = slice(2 * rank, 2 * rank + 2)
            ref_local = type(ref)(**{f: getattr(ref, f)[rows, :local.response_ids.shape[1]].detach()
                                     for f in ("logprobs", "entropy", "collision")})
            res[(tied, ckpt, layout)] = dict(st=type(st)(st.logprobs.detach(), st.entropy.detach(), st.collision.detach()),
                                     ref=ref_local, grads=grads, ref_grads=ref_grads, sharded=sharded,
                                     max_numel=probe.max, n_tokens=local.response_ids.numel())
        # probe sanity: the logits path under FSDP2 does hold [rows, R + 1, V_rows] logits
        model = _tiny(False)
        dist.wrap_policy(model, ctx)
        with _max_numel_mode() as probe:
            _loss(policy_token_stats(model, local, 0.7, lm_head="logits", entropy_grad=True,
                                     backend="eager")).backward()
        res["logits_max_numel"] = probe.max
        torch.save(res, os.path.join(out_dir, f"fsdp{rank}.pt"))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_fused_head_inside_the_fsdp2_root_forward_on_two_gloo_ranks(tmp_path):
    """FSDP2 (fully_shard per layer + root) on 2 gloo ranks, actor.lm_head=fused, untied embeddings, tied ones with
    gradient checkpointing, and the packed layout: each rank's statistics and the averaged full gradients
    (``full_tensor()``) equal a one-process logits-path reference; no tensor of N·V elements (N = the rank's rows ×
    response columns) is ever produced in the forward or backward (the logits path's is)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_fsdp2_worker, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0
    for rank in (0, 1):
        res = torch.load(tmp_path / f"fsdp{rank}.pt", weights_only=False)
        for tied, ckpt, layout in VARIANTS:
            r = res[(tied, ckpt, layout)]
            what = f"rank {rank}, tied={tied}, checkpointing={ckpt}, layout={layout}"
            assert r["sharded"], what
            _assert_stats_close(r["st"], r["ref"], what)
            _assert_grads_close(r["grads"], r["ref_grads"], what)
            assert r["max_numel"] < r["n_tokens"] * VOCAB, what
        assert res["logits_max_numel"] >= res[VARIANTS[0]]["n_tokens"] * VOCAB
