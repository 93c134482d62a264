"""Flash attention: forward and backward of every backend against an fp64 reference over MHA/GQA/MQA,
unequal head dims, odd and unequal sequence lengths, causal masks, windows, sinks and the bshd / sbhd /
bhsd layouts; output layouts; the op contract (opcheck, fullgraph compile); determinism; bad input."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primus_turbo.pytorch.core import backend as backend_module
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
from primus_turbo.pytorch.kernels.attention import flash_attn_impl as impl
from primus_turbo.pytorch.ops import flash_attn_func, flash_attn_varlen_func
from tests.pytorch.ref.attention_ref import attention_grads_ref, attention_ref
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
BACKENDS = [BackendType.TORCH, BackendType.TRITON]
SNR_DB = 40.0
# (heads q, heads kv, head dim qk, head dim v)
HEADS = [(2, 2, 32, 32), (4, 2, 48, 32), (4, 1, 16, 40)] + (
    [(8, 2, 192, 128), (32, 8, 128, 128), (64, 8, 64, 64), (28, 4, 128, 128), (4, 2, 256, 256)]
    if ON_GPU
    else []
)
# (seq q, seq k)
SEQS = [(17, 17), (1, 9), (33, 20), (20, 33)] + ([(1024, 1024), (777, 1500)] if ON_GPU else [])
LAYOUTS = ["bshd", "sbhd", "bhsd"]


@pytest.fixture(autouse=True)
def _reset_backends():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


def _tensor(b, s, h, d, layout, dtype, gen):
    """A logical [b, s, h, d] tensor stored in ``layout``."""
    dims = {"b": b, "s": s, "h": h, "d": d}
    stored = torch.randn([dims[c] for c in layout], generator=gen).to(DEVICE, dtype)
    return stored.permute([layout.index(c) for c in "bshd"]).requires_grad_()


def _inputs(b, s_q, s_k, heads, layout="bshd", dtype=torch.bfloat16, sink=False, seed=0):
    h_q, h_kv, d_qk, d_v = heads
    gen = torch.Generator().manual_seed(seed)
    q = _tensor(b, s_q, h_q, d_qk, layout, dtype, gen)
    k = _tensor(b, s_k, h_kv, d_qk, layout, dtype, gen)
    v = _tensor(b, s_k, h_kv, d_v, layout, dtype, gen)
    sinks = (torch.randn(h_q, generator=gen) + 1.0).to(DEVICE).requires_grad_() if sink else None
    return q, k, v, sinks


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


def _check(
    backend, b, seqs, heads, layout="bshd", causal=False, window=(-1, -1), sink=False, dtype=torch.bfloat16
):
    GlobalBackendManager.set_attn_backend(backend, PrecisionType.BF16_FP16_FP32)
    q, k, v, s = _inputs(b, *seqs, heads, layout, dtype, sink)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, sink=s)
    assert out.shape == (b, seqs[0], heads[0], heads[3])
    assert [out.stride(i) > 0 for i in range(4)] and _order(out) == _order(q)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    out.backward(grad)
    rq, rk, rv, rs = _leaves(q, k, v, s)
    scale = heads[2] ** -0.5
    ref = attention_ref(rq, rk, rv, scale, causal, window, rs)
    ref.backward(grad.double())
    _assert_matches(ref, out)
    for mine, theirs in ((q, rq), (k, rk), (v, rv)):
        assert mine.grad.shape == mine.shape and _order(mine.grad) == _order(mine)
        _assert_matches(theirs.grad, mine.grad)
    if sink:
        _assert_matches(rs.grad, s.grad)


def _assert_matches(reference, actual):
    """SNR gate; a reference that is exactly zero (a one-key window makes dq vanish) needs ~zeros."""
    if not reference.abs().max():
        assert actual.float().abs().max() <= 1e-6
        return
    assert compute_snr(reference, actual) >= SNR_DB


def _order(t):
    """The memory order of the dimensions, outermost first; a size-1 dimension has no place in memory (its
    stride is arbitrary), so it is left out."""
    return sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: (-t.stride(d), d))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqs", SEQS, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_forward_backward_matches_reference(backend, heads, seqs, causal):
    _check(backend, 2, seqs, heads, causal=causal)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_layouts_are_read_in_place_and_kept(backend, layout):
    _check(backend, 2, (19, 19), (4, 2, 32, 32), layout, causal=True)


@pytest.mark.parametrize(
    "window,causal", [((3, 2), False), ((4, -1), True), ((0, 0), False), ((-1, 5), False)], ids=str
)
@pytest.mark.parametrize("seqs", [(25, 25), (12, 30), (30, 12)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_sliding_windows(backend, seqs, window, causal):
    _check(backend, 1, seqs, (2, 1, 32, 32), window=window, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_sink_and_its_gradient(backend, causal):
    _check(backend, 2, (21, 21), (4, 2, 32, 32), causal=causal, sink=True)
    _check(backend, 1, (30, 12), (2, 2, 32, 32), causal=True, sink=True)


def test_fp32_runs_on_torch_and_triton_declines_it():
    _check(BackendType.TORCH, 1, (9, 9), (2, 1, 16, 16), dtype=torch.float32)
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    q, k, v, _ = _inputs(1, 9, 9, (2, 1, 16, 16), dtype=torch.float32)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_lse_and_rows_without_keys(backend):
    GlobalBackendManager.set_attn_backend(backend)
    q, k, v, _ = _inputs(1, 6, 3, (2, 2, 16, 16))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (1, 2, 6) and lse.dtype == torch.float32
    # bottom-right causal: the first Sq - Sk = 3 queries see no key
    assert torch.equal(out[:, :3].float(), torch.zeros_like(out[:, :3].float()))
    assert torch.isinf(lse[..., :3]).all() and (lse[..., :3] < 0).all()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 16**-0.5
    mask = torch.ones(6, 3, dtype=torch.bool, device=DEVICE).tril(-3)
    expected = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)[..., 3:]
    torch.testing.assert_close(lse[..., 3:].double(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_empty_inputs(backend):
    GlobalBackendManager.set_attn_backend(backend)
    for b, s_q, s_k in ((0, 4, 4), (2, 0, 4), (2, 4, 0)):
        q, k, v, _ = _inputs(b, s_q, s_k, (2, 1, 16, 16))
        out = flash_attn_func(q, k, v)
        out.sum().backward()
        assert out.shape == (b, s_q, 2, 16) and not out.float().abs().sum()
        assert k.grad.shape == k.shape and not k.grad.float().abs().sum()


@pytest.mark.parametrize(
    "options",
    [{}, {"sink": True}, {"deterministic": True}, {"return_lse": True}, {"window_size": (4, 0)}],
    ids=["plain", "sink", "deterministic", "lse", "window"],
)
def test_default_backend(options):
    """GPUs: SDPA (TORCH) for what it runs end to end, the Triton kernels for the rest; CPUs: TORCH."""
    q, k, v, s = _inputs(1, 9, 9, (2, 1, 16, 16), sink=options.pop("sink", False))
    flash_attn_func(q, k, v, causal=True, sink=s, **options)
    plain = s is None and not options
    expected = BackendType.TORCH if not ON_GPU or plain else BackendType.TRITON
    assert impl.AttentionDispatcher.last_selected() is expected


def test_sdpa_route_puts_cudnn_first_for_the_call_only(monkeypatch):
    before = torch._C._get_sdp_priority_order()
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch._C._get_sdp_priority_order()[0])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v, _ = _inputs(1, 9, 9, (2, 1, 16, 16))
    flash_attn_func(q, k, v, causal=True)
    assert seen == [int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)]
    assert torch._C._get_sdp_priority_order() == before


def test_opcheck():
    q, k, v, s = _inputs(1, 9, 7, (4, 2, 16, 16), sink=True)
    q, k, v = (t.detach() for t in (q, k, v))
    backend = "TRITON" if ON_GPU else "TORCH"
    args = (q, k, v, s.detach(), 0.25, -1, 0, backend)
    torch.library.opcheck(impl.flash_attn_fwd_impl, args)
    torch.library.opcheck(impl.flash_attn_fwd_impl, (q, k, v, None, 0.25, -1, -1, "TORCH"))
    out, lse = impl.flash_attn_fwd_impl(*args)
    torch.library.opcheck(impl.flash_attn_bwd_impl, (torch.randn_like(out), q, k, v, out, lse, *args[3:]))


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "sdpa"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiles_fullgraph_with_eager_strides(layout, sink):
    torch._dynamo.reset()
    q, k, v, s = _inputs(2, 11, 11, (4, 2, 16, 16), layout, sink=sink)

    def step(q, k, v, s):
        return flash_attn_func(q, k, v, causal=True, sink=s)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, s)
    eager = step(*_leaves(q, k, v, s))
    assert out.stride() == eager.stride()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    out.float().sum().backward()
    assert q.grad is not None and (s is None or s.grad is not None)


@settings(
    max_examples=40 if ON_GPU else 8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    b=st.integers(1, 2),
    seqs=st.tuples(st.integers(1, 40), st.integers(1, 40)),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    head_dims=st.tuples(st.sampled_from([16, 24, 40, 48, 64, 96]), st.sampled_from([16, 32, 40])),
    causal=st.booleans(),
    window=st.tuples(st.integers(-1, 12), st.integers(-1, 12)),
    sink=st.booleans(),
    layout=st.sampled_from(LAYOUTS),
)
def test_triton_matches_reference_on_fuzzed_inputs(
    b, seqs, kv_heads, group, head_dims, causal, window, sink, layout
):
    """Random shapes, GQA groups, head dims off powers of two (split tiles), windows, sinks and layouts: the
    output against the exact fp64 reference, the gradients against the fp64 flash-attention backward on the
    kernel's own output (``attention_grads_ref``; the exact gradient differs from it by the output's
    rounding wherever dP - delta cancels, in every flash-attention kernel)."""
    GlobalBackendManager.set_attn_backend(BackendType.TRITON, PrecisionType.BF16_FP16_FP32)
    heads = (kv_heads * group, kv_heads, *head_dims)
    q, k, v, s = _inputs(b, *seqs, heads, layout, sink=sink)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, sink=s)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, out.dtype)
    out.backward(grad)
    q_, k_, v_, s_ = (t.detach() if t is not None else None for t in (q, k, v, s))
    scale = head_dims[0] ** -0.5
    _assert_matches(attention_ref(q_, k_, v_, scale, causal, window, s_), out)
    expected = attention_grads_ref(q_, k_, v_, scale, causal, window, s_, grad, out.detach())
    for theirs, mine in zip(expected, (q.grad, k.grad, v.grad, s.grad if sink else None), strict=True):
        if theirs is not None:
            _assert_matches(theirs, mine)


@pytest.mark.parametrize("sink", [False, True], ids=["plain", "sink"])
def test_grads_reference_is_autograd_on_the_exact_output(sink):
    q, k, v, s = (
        t.detach().double() if t is not None else None for t in _inputs(2, 9, 13, (4, 2, 16, 8), sink=sink)
    )
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (q, k, v, s)]
    out = attention_ref(*leaves[:3], 0.25, True, (5, -1), leaves[3])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad)
    expected = attention_grads_ref(q, k, v, 0.25, True, (5, -1), s, grad, out.detach())
    for mine, leaf in zip(expected, leaves, strict=True):
        if leaf is not None:
            torch.testing.assert_close(mine, leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_small_grids_split_query_head_groups(monkeypatch, causal):
    """A dK/dV grid smaller than the GPU splits each group's query heads into shares summed afterwards;
    the gradients still match the reference."""
    from primus_turbo.triton.attention import flash_attn_kernel as kernel

    splits = []
    choose = kernel._group_splits
    monkeypatch.setattr(kernel, "_group_splits", lambda *a: splits.append(choose(*a)) or splits[-1])
    monkeypatch.setattr(kernel, "interpreter_active", lambda: False)  # the interpreter pairs causal blocks
    _check(BackendType.TRITON, 1, (20, 20), (6, 1, 32, 32), causal=causal)
    assert splits and splits[-1] > 1


def test_group_splits():
    from primus_turbo.triton.attention.flash_attn_kernel import _group_splits

    assert _group_splits(7, 128, 132) == 3  # Qwen2.5-7B at 2048 tokens: shares of 3, 3 and 1 heads
    assert _group_splits(4, 256, 132) == 1  # the grid already fills the GPU
    assert _group_splits(1, 8, 132) == 1  # MHA: nothing to split
    assert _group_splits(6, 1, 132) == 6


@pytest.mark.deterministic
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_deterministic_bitwise(backend):
    GlobalBackendManager.set_attn_backend(backend)
    results = []
    for _ in range(3 if not ON_GPU else 10):
        q, k, v, s = _inputs(2, 40 if ON_GPU else 17, 40 if ON_GPU else 17, (4, 1, 32, 32), sink=True)
        out = flash_attn_func(q, k, v, causal=True, sink=s, deterministic=True)
        out.float().sum().backward()
        results.append([t.detach().clone() for t in (out, q.grad, k.grad, v.grad, s.grad)])
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other, strict=True))


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "4-D"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "one dtype"),
        (lambda q, k, v: (q.int(), k, v), TypeError, "q.dtype"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "multiple of key/value heads"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, "head dims differ"),
        (lambda q, k, v: (q, k, v[:, :3]), ValueError, "share"),
        (lambda q, k, v: (q[:1], k, v), ValueError, "batch"),
        (lambda q, k, v: (q.transpose(2, 3), k, v), ValueError, "unit stride"),
    ],
)
def test_bad_input_raises_clear_error(mutate, error, match):
    q, k, v, _ = _inputs(2, 5, 5, (4, 2, 16, 16))
    with pytest.raises(error, match=match):
        flash_attn_func(*mutate(q.detach(), k.detach(), v.detach()))


def test_bad_options_raise_clear_error():
    q, k, v, _ = _inputs(1, 5, 5, (2, 2, 16, 16))
    with pytest.raises(ValueError, match="dropout"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match="sink must be fp32"):
        flash_attn_func(q, k, v, sink=torch.zeros(3, device=DEVICE))
    for bad_scale in (0.0, -0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softmax_scale must be positive and finite"):
            flash_attn_func(q, k, v, softmax_scale=bad_scale)
    with pytest.raises(ValueError, match="head dims up to 256"):
        big = torch.zeros(1, 5, 2, 288, device=DEVICE, dtype=torch.bfloat16)
        flash_attn_func(big, big, big)


def _packed(lengths_q, lengths_k, heads, sink=False, seed=0):
    h_q, h_kv, d_qk, d_v = heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()

    q, k, v = (
        rand(sum(lengths_q), h_q, d_qk),
        rand(sum(lengths_k), h_kv, d_qk),
        rand(sum(lengths_k), h_kv, d_v),
    )
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        for n in (lengths_q, lengths_k)
    )
    sinks = (torch.randn(h_q, generator=gen) + 1.0).to(DEVICE).requires_grad_() if sink else None
    return q, k, v, cu_q, cu_k, sinks


@pytest.mark.parametrize(
    "lengths", [([5, 1, 17, 0, 9], [5, 1, 17, 0, 9]), ([3, 20, 1], [7, 20, 4])], ids=["self", "cross"]
)
@pytest.mark.parametrize(
    "options", [{}, {"causal": True}, {"causal": True, "sink": True}, {"window": (4, 1)}], ids=str
)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_varlen_matches_each_sequence_alone(backend, options, lengths):
    GlobalBackendManager.set_attn_backend(backend)
    heads = (4, 2, 32, 16)
    causal, window = options.get("causal", False), options.get("window", (-1, -1))
    q, k, v, cu_q, cu_k, s = _packed(*lengths, heads, sink=options.get("sink", False))
    out = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lengths[0]), max(lengths[1]), causal=causal, window_size=window, sink=s
    )
    assert out.shape == (q.shape[0], 4, 16)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE, out.dtype)
    out.backward(grad)
    rq, rk, rv, rs = _leaves(q, k, v, s)
    pieces = []
    for i in range(len(lengths[0])):
        rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        pieces.append(
            attention_ref(rq[None, rows_q], rk[None, rows_k], rv[None, rows_k], 32**-0.5, causal, window, rs)[
                0
            ]
        )
    ref = torch.cat(pieces)
    ref.backward(grad.double())
    _assert_matches(ref, out)
    for mine, theirs in ((q, rq), (k, rk), (v, rv)) + (((s, rs),) if s is not None else ()):
        _assert_matches(theirs.grad, mine.grad)


def test_varlen_opcheck_and_compile():
    q, k, v, cu_q, cu_k, s = _packed([3, 6], [3, 6], (2, 1, 16, 16), sink=True)
    q, k, v, s = (t.detach() for t in (q, k, v, s))
    backend = "TRITON" if ON_GPU else "TORCH"
    args = (q, k, v, cu_q, cu_k, 6, 6, s, 0.25, -1, 0, backend)
    torch.library.opcheck(impl.flash_attn_varlen_fwd_impl, args)
    out, lse = impl.flash_attn_varlen_fwd_impl(*args)
    assert lse.shape == (2, 9)
    bwd_args = (torch.randn_like(out), q, k, v, out, lse, *args[3:])
    torch.library.opcheck(impl.flash_attn_varlen_bwd_impl, bwd_args)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, causal=True),
        fullgraph=True,
        backend="aot_eager",
    )
    leaves = _leaves(q, k, v)
    compiled(*leaves).float().sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_varlen_bad_offsets_raise_clear_error(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    q, k, v, cu_q, cu_k, _ = _packed([3, 6], [3, 6], (2, 1, 16, 16))
    with pytest.raises(TypeError, match="int32"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 6, 6)
    with pytest.raises(ValueError, match="B \\+ 1"):
        flash_attn_varlen_func(q, k, v, cu_q[:2], cu_k, 6, 6)
    with pytest.raises(ValueError, match="rise from 0 to 9"):
        flash_attn_varlen_func(q, k, v, cu_q * 2, cu_k, 6, 6)
    with pytest.raises(ValueError, match="over the max"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6)
    with pytest.raises(ValueError, match="3-D"):
        flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 6, 6)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_window_bounds_beyond_the_sequences_mean_unbounded(backend):
    GlobalBackendManager.set_attn_backend(backend)
    q, k, v, _ = _inputs(1, 20, 13, (2, 1, 16, 16))
    huge = flash_attn_func(q, k, v, window_size=(2**31 - 1, 2**31 - 1))
    torch.testing.assert_close(huge, flash_attn_func(q, k, v), rtol=0, atol=0)
    one_sided = flash_attn_func(q, k, v, window_size=(0, 2**31 - 1))
    reference = attention_ref(q, k, v, 16**-0.5, window=(0, -1))
    assert compute_snr(reference, one_sided) >= SNR_DB


def _fake_package(name, lse_keyword, calls):
    """A stand-in for the flash_attn / aiter package: the fp64 reference, recording each call's options."""

    def attend(q, k, v, *packing, dropout_p, softmax_scale, causal, window_size, deterministic, **lse_flag):
        calls.append({"packing": packing, "scale": softmax_scale, "causal": causal, "window": window_size})
        calls[-1].update({"deterministic": deterministic, "dropout": dropout_p, **lse_flag})
        batch = (q, k, v) if not packing else (q[None], k[None], v[None])  # one packed sequence
        out = attention_ref(*batch, softmax_scale, False, window_size, None).to(q.dtype)
        out, lse = (out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])) if not packing else (out[0], None)
        return (out, lse, None) if lse_flag[lse_keyword] else out

    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.flash_attn_func = module.flash_attn_varlen_func = attend
    return module


@pytest.fixture
def _fresh_availability():
    backend_module._cached_unavailable_reason.cache_clear()
    yield
    backend_module._cached_unavailable_reason.cache_clear()


@pytest.mark.usefixtures("_fresh_availability")
@pytest.mark.parametrize(
    "backend, module, lse_keyword",
    [(BackendType.FLASH_ATTN, "flash_attn", "return_attn_probs"), (BackendType.AITER, "aiter", "return_lse")],
)
def test_package_backends_run_through_the_package(monkeypatch, backend, module, lse_keyword):
    """An installed package gets the call end to end with this library's window convention; gradients come
    from its autograd; sinks are declined with the reason."""
    calls = []
    monkeypatch.setitem(sys.modules, module, _fake_package(module, lse_keyword, calls))
    GlobalBackendManager.set_attn_backend(backend)
    q, k, v, _ = _inputs(2, 9, 9, (4, 2, 16, 16))
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(3, -1), deterministic=True, return_lse=True)
    assert calls[-1] == {
        "packing": (), "scale": 0.25, "causal": False, "window": (3, 0), "deterministic": True,
        "dropout": 0.0, lse_keyword: True,
    }  # fmt: skip
    assert lse.shape == (2, 4, 9) and impl.AttentionDispatcher.last_selected() is backend
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None
    _, _, _, sink = _inputs(2, 9, 9, (4, 2, 16, 16), sink=True)
    with pytest.raises(ValueError, match="has no attention sinks"):
        flash_attn_func(q, k, v, sink=sink)


@pytest.mark.usefixtures("_fresh_availability")
def test_flash_attn_package_varlen_and_head_dims(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_package("flash_attn", "return_attn_probs", calls))
    GlobalBackendManager.set_attn_backend(BackendType.FLASH_ATTN)
    q, k, v, _ = _inputs(1, 9, 9, (2, 2, 16, 16))
    cu = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 9, 9, causal=True)
    assert calls[-1]["packing"] == (cu, cu, 9, 9) and calls[-1]["window"] == (-1, 0)
    q, k, v, _ = _inputs(1, 9, 9, (2, 2, 16, 32))
    with pytest.raises(ValueError, match="needs equal q/k and v head dims"):
        flash_attn_func(q, k, v)


@pytest.mark.usefixtures("_fresh_availability")
@pytest.mark.parametrize(
    "backend, module", [(BackendType.FLASH_ATTN, "flash_attn"), (BackendType.AITER, "aiter")]
)
def test_package_backends_unavailable_without_the_package(monkeypatch, backend, module):
    monkeypatch.setitem(sys.modules, module, None)  # import (and find_spec) of it fails
    GlobalBackendManager.set_attn_backend(backend)
    q, k, v, _ = _inputs(1, 9, 9, (2, 2, 16, 16))
    with pytest.raises(ValueError, match=f"the {module} package is not installed"):
        flash_attn_func(q, k, v)
