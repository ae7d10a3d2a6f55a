"""Tests for stapo.core.token_stats (docs/method.md#token-statistics, #token-analysis, #pitfalls).

Every expected value comes from an independent float64 softmax reference written here (or from a
hand computation), never from calling token_stats twice.  The compiled backend is exercised when
torch.compile works on this machine and skipped (with the reason) otherwise; its tests use few dtypes
so that the first-call compilation keeps the file fast.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import stapo.core.token_stats as ts_mod
from stapo.core.token_stats import TokenStats, token_stats

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------
# Independent float64 reference.
# --------------------------------------------------------------------------------------------------


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """Plain float64 softmax on the SAME values (bf16/fp16 upcast exactly): (logp, H, C, log π)."""
    z = logits.double() / temperature  # [..., V] fp64
    logpi = torch.log_softmax(z, dim=-1)  # [..., V]
    pi = logpi.exp()  # [..., V]
    finite_logpi = logpi.masked_fill(~torch.isfinite(logpi), 0.0)  # 0·log 0 := 0, grad-safe
    entropy = -(pi * finite_logpi).sum(-1)  # [...] nats
    collision = (pi * pi).sum(-1)  # [...]
    logp = logpi.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [...]
    return logp, entropy, collision


def make_logits(shape, dtype=torch.float32, seed=0, neg_inf_cols=(), scale=4.0):
    """Random logits with varied entropies: some rows are sharply peaked, some nearly flat."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * scale  # [..., V]
    flat = x.view(-1, shape[-1])
    n = flat.shape[0]
    flat[::3] *= 0.05  # near-uniform rows (high entropy)
    idx = torch.randint(0, shape[-1], (n,), generator=g)
    flat[1::3].scatter_(1, idx[1::3, None], 40.0)  # one dominant logit (entropy ≈ 0)
    for c in neg_inf_cols:
        x[..., c] = NEG_INF
    return x.to(dtype)


def make_targets(shape, vocab, seed=1, avoid=()):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, shape, generator=g)
    for c in avoid:
        t[t == c] = (c + 1) % vocab
    return t


@pytest.fixture(scope="module")
def compiled_ok():
    """Skip compiled-backend tests (with the reason) when torch.compile cannot build a CPU kernel."""
    try:
        fn = torch.compile(lambda a: (a * 2.0).exp().sum(-1), dynamic=True, fullgraph=True)
        fn(torch.ones(3, 5))
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"torch.compile unavailable here: {type(exc).__name__}: {exc}")
    return True


def assert_close(actual, expected, atol, what):
    actual = actual.double()
    expected = expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    same_inf = torch.isinf(expected) & (actual == expected)
    err = (actual - expected).abs().masked_fill(same_inf, 0.0)
    assert torch.isfinite(err).all(), f"{what}: non-finite mismatch"
    assert err.max().item() <= atol, f"{what}: max |Δ| = {err.max().item():.3g} > {atol}"


# --------------------------------------------------------------------------------------------------
# Hand-worked cases.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_hand_worked_values(backend, request):
    if backend == "compiled":
        request.getfixturevalue("compiled_ok")
    ln3 = math.log(3.0)
    # Row 0: logits [0, 2 ln 3, -inf] at T = 2 → z = [0, ln 3, -inf] → π = [1/4, 3/4, 0].
    #   log π(1) = ln(3/4) = -0.2876820725
    #   H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.3465735903 + 0.2157615544 = 0.5623351446 nats
    #   C = 1/16 + 9/16 = 0.625
    # Row 1: logits [0, 0, 0] at T = 2 → uniform: log π(0) = -ln 3 = -1.0986122887, H = ln 3, C = 1/3.
    # Row 2: logits [1, 1, -inf] → π = [1/2, 1/2, 0]: target 2 has log π = -inf, H = ln 2, C = 1/2.
    logits = torch.tensor([[0.0, 2 * ln3, NEG_INF], [0.0, 0.0, 0.0], [1.0, 1.0, NEG_INF]])  # [3, 3]
    targets = torch.tensor([1, 0, 2])
    st = token_stats(logits, targets, temperature=2.0, backend=backend, chunk_size=3)
    assert isinstance(st, TokenStats)
    expected_logp = torch.tensor([-0.2876820725, -1.0986122887, NEG_INF])
    # Row 2 is at T = 2 too, but uniform over two ids whatever T is: H = ln 2 = 0.6931471806.
    expected_h = torch.tensor([0.5623351446, 1.0986122887, 0.6931471806])
    expected_c = torch.tensor([0.625, 1.0 / 3.0, 0.5])
    assert_close(st.logprobs, expected_logp, 1e-6, "logprobs")
    assert st.logprobs[2].item() == NEG_INF
    assert_close(st.entropy, expected_h, 1e-6, "entropy")
    assert_close(st.collision, expected_c, 1e-6, "collision")
    for t in (st.logprobs, st.entropy, st.collision):
        assert t.dtype == torch.float32


def test_hand_worked_gradient():
    # V = 2, logits [0, ln 3], target 1, T = 1: π = [1/4, 3/4].
    #   d log π(1)/dz = onehot − π = [-1/4, 1/4]
    #   dH/dz_j = −π_j (log π_j + H): H = 0.5623351446
    #     j=0: −1/4 (ln 1/4 + H) = −0.25 (−1.3862943611 + 0.5623351446) = 0.2059898041
    #     j=1: −3/4 (ln 3/4 + H) = −0.75 (−0.2876820725 + 0.5623351446) = −0.2059898041
    x = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)  # [1, 2]
    st = token_stats(x, torch.tensor([1]), entropy_grad=True, backend="eager")
    (g_lp,) = torch.autograd.grad(st.logprobs.sum(), x, retain_graph=True)
    (g_h,) = torch.autograd.grad(st.entropy.sum(), x)
    assert_close(g_lp, torch.tensor([[-0.25, 0.25]]), 1e-6, "d logp")
    assert_close(g_h, torch.tensor([[0.2059898041, -0.2059898041]]), 1e-6, "d H")


# --------------------------------------------------------------------------------------------------
# Forward values against the float64 reference.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("neg_inf", [False, True])
def test_forward_matches_float64_eager(dtype, temperature, neg_inf):
    vocab = 3001
    cols = (0, 17, 1500, vocab - 1) if neg_inf else ()
    logits = make_logits((3, 13, vocab), dtype, neg_inf_cols=cols)  # [B, T, V]
    targets = make_targets((3, 13), vocab, avoid=cols)  # [B, T]
    st = token_stats(logits, targets, temperature, backend="eager")
    ref_lp, ref_h, ref_c = reference(logits, targets, temperature)
    assert st.logprobs.shape == st.entropy.shape == st.collision.shape == targets.shape
    assert_close(st.logprobs, ref_lp, 1e-5, "logprobs")
    assert_close(st.entropy, ref_h, 1e-5, "entropy")
    assert_close(st.collision, ref_c, 1e-5, "collision")
    assert torch.isfinite(st.entropy).all() and torch.isfinite(st.collision).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_float64_compiled(dtype, compiled_ok):
    vocab = 4099
    cols = (3, 2048)
    logits = make_logits((41, vocab), dtype, neg_inf_cols=cols, seed=3)  # [N, V]
    targets = make_targets((41,), vocab, avoid=cols)
    for temperature in (1.0, 0.7):
        st = token_stats(logits, targets, temperature, backend="compiled", chunk_size=16)
        ref_lp, ref_h, ref_c = reference(logits, targets, temperature)
        assert_close(st.logprobs, ref_lp, 1e-5, f"logprobs T={temperature}")
        assert_close(st.entropy, ref_h, 1e-5, f"entropy T={temperature}")
        assert_close(st.collision, ref_c, 1e-5, f"collision T={temperature}")


def test_backends_agree(compiled_ok):
    logits = make_logits((2, 9, 2500), torch.float32, neg_inf_cols=(7,), seed=5)
    targets = make_targets((2, 9), 2500, avoid=(7,))
    a = token_stats(logits, targets, 0.7, backend="eager", chunk_size=4)
    b = token_stats(logits, targets, 0.7, backend="compiled", chunk_size=4)
    for name in ("logprobs", "entropy", "collision"):
        assert_close(getattr(b, name), getattr(a, name), 2e-6, name)


# --------------------------------------------------------------------------------------------------
# Gradients against autograd through the float64 reference.
# --------------------------------------------------------------------------------------------------


def reference_grads(logits, targets, temperature, w_lp, w_h):
    x = logits.detach().double().requires_grad_(True)
    lp, h, _ = reference(x, targets, temperature)
    loss = (w_lp * lp).sum() + (w_h * h).sum() if w_h is not None else (w_lp * lp).sum()
    (g,) = torch.autograd.grad(loss, x)
    return g


def run_grads(logits, targets, temperature, w_lp, w_h, **kw):
    x = logits.detach().clone().requires_grad_(True)
    st = token_stats(x, targets, temperature, entropy_grad=w_h is not None, **kw)
    loss = (w_lp * st.logprobs).sum()
    if w_h is not None:
        loss = loss + (w_h * st.entropy).sum()
    loss.backward()
    assert x.grad.dtype == logits.dtype and x.grad.shape == logits.shape
    return x.grad


@pytest.mark.parametrize(
    "backend,dtype",
    [("eager", torch.float32), ("eager", torch.bfloat16), ("compiled", torch.float32)],
)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradients_match_float64_autograd(backend, dtype, with_entropy, request):
    if backend == "compiled":
        request.getfixturevalue("compiled_ok")
    vocab = 1531
    cols = (0, 900)
    logits = make_logits((2, 7, vocab), dtype, neg_inf_cols=cols, seed=7)  # [B, T, V]
    targets = make_targets((2, 7), vocab, avoid=cols)
    g = torch.Generator().manual_seed(11)
    w_lp = torch.randn(2, 7, generator=g, dtype=torch.float64)
    w_h = torch.randn(2, 7, generator=g, dtype=torch.float64) if with_entropy else None
    got = run_grads(logits, targets, 0.7, w_lp.float(), None if w_h is None else w_h.float(),
                    backend=backend, chunk_size=5)
    want = reference_grads(logits, targets, 0.7, w_lp, w_h)
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        assert_close(got, want, 1e-5, "grad")
    else:  # the gradient is returned in bf16: 8 mantissa bits
        tol = 1e-2 * want.abs().max().item() + 1e-6
        assert_close(got, want, tol, "grad (bf16)")


def test_entropy_only_gradient():
    vocab = 257
    logits = make_logits((11, vocab), torch.float32, seed=9)
    targets = make_targets((11,), vocab)
    x = logits.clone().requires_grad_(True)
    st = token_stats(x, targets, 1.3, entropy_grad=True, backend="eager", chunk_size=4)
    st.entropy.sum().backward()  # logprobs unused: backward gets no logprob gradient
    want = reference_grads(logits, targets, 1.3, torch.zeros(11, dtype=torch.float64),
                           torch.ones(11, dtype=torch.float64))
    assert_close(x.grad, want, 1e-5, "grad of entropy only")


def test_entropy_detached_by_default():
    x = make_logits((2, 3, 50), seed=2).requires_grad_(True)
    targets = make_targets((2, 3), 50)
    st = token_stats(x, targets, backend="eager")
    assert st.logprobs.requires_grad
    assert not st.entropy.requires_grad
    assert not st.collision.requires_grad
    st2 = token_stats(x, targets, backend="eager", entropy_grad=True)
    assert st2.entropy.requires_grad
    assert not st2.collision.requires_grad


# --------------------------------------------------------------------------------------------------
# Chunking, shapes and layouts.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_wide_logits_tiny_probabilities(backend, request):
    """Spreads beyond the kernels' 2^-63 floor (≈ 43.7 nats): tiny-probability entries are dropped,
    which must not be visible at 1e-5 (log-prob of a tiny-probability target stays exact)."""
    if backend == "compiled":
        request.getfixturevalue("compiled_ok")
    vocab = 500
    logits = make_logits((4, vocab), seed=15, scale=2.0)
    logits[:, 0] = 80.0  # dominant: everything else is ~e^-80 relative (beyond the floor)
    logits[1, 1] = 40.0  # p ≈ e^-40 (inside the floor)
    logits[2, 2] = 30.0
    targets = torch.tensor([5, 1, 2, 0])  # row 0's target has p ≈ e^-80
    st = token_stats(logits, targets, backend=backend, chunk_size=4)
    ref_lp, ref_h, ref_c = reference(logits, targets)
    assert_close(st.logprobs, ref_lp, 1e-5, "logprobs")
    assert_close(st.entropy, ref_h, 1e-5, "entropy")
    assert_close(st.collision, ref_c, 1e-5, "collision")
    w = torch.ones(4, dtype=torch.float64)
    got = run_grads(logits, targets, 1.0, w.float(), w.float(), backend=backend, chunk_size=4)
    assert_close(got, reference_grads(logits, targets, 1.0, w, w), 1e-5, "grad")


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 36, 37, 100])
def test_chunk_boundaries_eager(chunk_size):
    vocab = 301
    logits = make_logits((37, vocab), seed=4, neg_inf_cols=(5,))  # [N=37, V], 37 is prime
    targets = make_targets((37,), vocab, avoid=(5,))
    st = token_stats(logits, targets, 0.7, backend="eager", chunk_size=chunk_size)
    ref_lp, ref_h, ref_c = reference(logits, targets, 0.7)
    assert_close(st.logprobs, ref_lp, 1e-5, "logprobs")
    assert_close(st.entropy, ref_h, 1e-5, "entropy")
    assert_close(st.collision, ref_c, 1e-5, "collision")
    w = torch.linspace(-1, 1, 37, dtype=torch.float64)
    got = run_grads(logits, targets, 0.7, w.float(), w.flip(0).float(), backend="eager",
                    chunk_size=chunk_size)
    assert_close(got, reference_grads(logits, targets, 0.7, w, w.flip(0)), 1e-5, "grad")


@pytest.mark.parametrize("chunk_size", [1, 2, 6, 100])
def test_chunk_boundaries_compiled(chunk_size, compiled_ok):
    vocab = 301
    logits = make_logits((37, vocab), seed=4)  # 37 = 6·6 + 1: a trailing lone row
    targets = make_targets((37,), vocab)
    st = token_stats(logits, targets, backend="compiled", chunk_size=chunk_size)
    ref_lp, ref_h, ref_c = reference(logits, targets)
    assert_close(st.logprobs, ref_lp, 1e-5, "logprobs")
    assert_close(st.entropy, ref_h, 1e-5, "entropy")
    assert_close(st.collision, ref_c, 1e-5, "collision")
    w = torch.linspace(-1, 1, 37, dtype=torch.float64)
    got = run_grads(logits, targets, 1.0, w.float(), None, backend="compiled", chunk_size=chunk_size)
    assert_close(got, reference_grads(logits, targets, 1.0, w, None), 1e-5, "grad")


def test_flat_input_equals_reference_and_3d_layout():
    vocab = 211
    logits3 = make_logits((3, 5, vocab), seed=6)  # [B, T, V]
    targets3 = make_targets((3, 5), vocab)
    st_flat = token_stats(logits3.reshape(15, vocab), targets3.reshape(15), backend="eager")
    assert st_flat.logprobs.shape == (15,)
    ref_lp, ref_h, ref_c = reference(logits3, targets3)
    assert_close(st_flat.logprobs, ref_lp.reshape(15), 1e-5, "flat logprobs")
    assert_close(st_flat.entropy, ref_h.reshape(15), 1e-5, "flat entropy")
    assert_close(st_flat.collision, ref_c.reshape(15), 1e-5, "flat collision")


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_non_contiguous_view_logits(backend, request):
    """logits[:, :-1] (the usual shift) cannot be flattened without a copy: handled per batch row."""
    if backend == "compiled":
        request.getfixturevalue("compiled_ok")
    vocab = 199
    base = make_logits((2, 6, vocab), seed=8).requires_grad_(True)  # [B, T+1, V]
    view = base[:, :-1]  # [B, T, V], non-contiguous
    targets = make_targets((2, 5), vocab)
    st = token_stats(view, targets, 0.7, entropy_grad=True, backend=backend, chunk_size=3)
    ref_lp, ref_h, _ = reference(view.detach(), targets, 0.7)
    assert_close(st.logprobs, ref_lp, 1e-5, "logprobs")
    assert_close(st.entropy, ref_h, 1e-5, "entropy")
    (st.logprobs.sum() + st.entropy.sum()).backward()
    want = reference_grads(view.detach(), targets, 0.7, torch.ones(2, 5, dtype=torch.float64),
                           torch.ones(2, 5, dtype=torch.float64))
    assert_close(base.grad[:, :-1], want, 1e-5, "grad on the view")
    assert (base.grad[:, -1] == 0).all()


def test_empty_input():
    st = token_stats(torch.zeros(0, 7), torch.zeros(0, dtype=torch.long), backend="eager")
    assert st.logprobs.shape == st.entropy.shape == st.collision.shape == (0,)


# --------------------------------------------------------------------------------------------------
# Non-finite logits (docs/method.md#pitfalls).
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_neg_inf_logits_and_target(backend, request):
    if backend == "compiled":
        request.getfixturevalue("compiled_ok")
    vocab = 64
    logits = make_logits((4, vocab), seed=12, neg_inf_cols=(10, 20, 63))  # padded vocab columns
    targets = torch.tensor([10, 1, 2, 3])  # row 0's target has a -inf logit
    x = logits.clone().requires_grad_(True)
    st = token_stats(x, targets, entropy_grad=True, backend=backend, chunk_size=2)
    assert st.logprobs[0].item() == NEG_INF
    assert torch.isfinite(st.logprobs[1:]).all()
    assert torch.isfinite(st.entropy).all() and torch.isfinite(st.collision).all()
    (st.logprobs[1:].sum() + st.entropy.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[:, [10, 20, 63]] == 0).all()  # π = 0 there: no gradient


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_all_neg_inf_row_is_nan_and_isolated(backend, request):
    """Documented: a row whose logits are all -inf gives NaN; other rows are unaffected."""
    if backend == "compiled":
        request.getfixturevalue("compiled_ok")
    logits = torch.tensor([[NEG_INF, NEG_INF, NEG_INF], [0.0, 0.0, NEG_INF]])
    st = token_stats(logits, torch.tensor([0, 1]), backend=backend)
    assert torch.isnan(st.entropy[0]) and torch.isnan(st.collision[0])
    assert not torch.isfinite(st.logprobs[0])
    assert abs(st.entropy[1].item() - math.log(2.0)) < 1e-6
    assert abs(st.logprobs[1].item() + math.log(2.0)) < 1e-6


# --------------------------------------------------------------------------------------------------
# Input validation and backend fallback.
# --------------------------------------------------------------------------------------------------

_X = torch.zeros(2, 3, 5)
_T = torch.zeros(2, 3, dtype=torch.long)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((torch.zeros(5), torch.zeros((), dtype=torch.long)), {}, ValueError, r"\[B, T, V\] or \[N, V\]"),
        ((torch.zeros(1, 2, 3, 5), torch.zeros(1, 2, 3, dtype=torch.long)), {}, ValueError, "shape"),
        ((_X, torch.zeros(2, 4, dtype=torch.long)), {}, ValueError, "targets must have shape"),
        ((_X, torch.zeros(6, dtype=torch.long)), {}, ValueError, "targets must have shape"),
        ((torch.zeros(2, 3, 0), _T), {}, ValueError, "vocabulary"),
        ((_X.long(), _T), {}, TypeError, "logits must be float32"),
        ((_X.double(), _T), {}, TypeError, "logits must be float32"),
        ((_X, _T.float()), {}, TypeError, "targets must be an integer"),
        ((_X, _T.bool()), {}, TypeError, "targets must be an integer"),
        (([[0.0]], torch.zeros(1, dtype=torch.long)), {}, TypeError, "logits must be a torch.Tensor"),
        ((_X, [0]), {}, TypeError, "targets must be a torch.Tensor"),
        ((_X, _T + 5), {}, ValueError, r"token ids in \[0, V=5\)"),
        ((_X, _T - 100), {}, ValueError, r"token ids in \[0, V=5\)"),
        ((_X, _T, 0.0), {}, ValueError, "temperature"),
        ((_X, _T, -0.7), {}, ValueError, "temperature"),
        ((_X, _T, float("nan")), {}, ValueError, "temperature"),
        ((_X, _T, float("inf")), {}, ValueError, "temperature"),
        ((_X, _T, "1.0"), {}, TypeError, "temperature"),
        ((_X, _T), {"chunk_size": 0}, ValueError, "chunk_size"),
        ((_X, _T), {"chunk_size": 2.5}, ValueError, "chunk_size"),
        ((_X, _T), {"backend": "triton"}, ValueError, "backend"),
    ],
)
def test_bad_input_raises(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        token_stats(*args, **kwargs)


def test_int32_targets_accepted():
    logits = make_logits((4, 9), seed=13)
    targets = make_targets((4,), 9)
    st = token_stats(logits, targets.int(), backend="eager")
    assert_close(st.logprobs, reference(logits, targets)[0], 1e-5, "logprobs")


def test_auto_falls_back_to_eager_once_and_compiled_raises(monkeypatch):
    def broken(name):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(ts_mod, "_get_compiled", broken)
    monkeypatch.setattr(ts_mod, "_compile_error", None)
    logits = make_logits((6, 33), seed=14)
    targets = make_targets((6,), 33)
    with pytest.raises(RuntimeError, match="backend=\"eager\""):
        token_stats(logits, targets, backend="compiled")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = token_stats(logits, targets, backend="auto")
        token_stats(logits, targets, backend="auto")
    msgs = [w for w in caught if "falling back to the eager kernel" in str(w.message)]
    assert len(msgs) == 1
    assert_close(st.logprobs, reference(logits, targets)[0], 1e-5, "fallback logprobs")
