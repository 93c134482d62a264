"""Grouped GEMM: forward, dgrad and variable-K wgrad of every backend against a per-group fp64
reference, with balanced, skewed and empty groups, both weight layouts, fused accumulation, the op
contract, determinism and bad input."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.grouped_gemm import grouped_gemm_impl as impl
from primus_turbo.pytorch.ops import grouped_gemm
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
BACKENDS = [BackendType.TORCH, BackendType.TRITON]
GATE = {torch.bfloat16: 45.0, torch.float16: 45.0, torch.float32: 90.0}


@pytest.fixture(autouse=True)
def _reset_backends():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


def _group_lens(kind: str, groups: int, tokens_per_group: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        lens = torch.full((groups,), tokens_per_group)
    elif kind == "skewed":
        weights = 0.2 + 0.8 * torch.rand(groups, generator=gen)
        lens = (weights / weights.sum() * groups * tokens_per_group).long()
    elif kind == "empty":
        lens = torch.randint(0, 2 * tokens_per_group, (groups,), generator=gen)
        lens[::2] = 0
    else:  # one group holds every token
        lens = torch.zeros(groups, dtype=torch.long)
        lens[-1] = groups * tokens_per_group
    return lens.to(torch.int64).to(DEVICE)


def _operands(lens, k, n, trans_b, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens, groups = int(lens.sum()), lens.shape[0]
    a = torch.randn(tokens, k, generator=gen).to(DEVICE, dtype).requires_grad_()
    b = (torch.randn((groups, n, k) if trans_b else (groups, k, n), generator=gen) * k**-0.5).to(
        DEVICE, dtype
    )
    grad = torch.randn(tokens, n, generator=gen).to(DEVICE, dtype)
    return a, b.requires_grad_(), grad


def _reference(a, b, lens, trans_b, grad):
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    bounds = [0, *torch.cumsum(lens.cpu(), 0).tolist()]
    outs = []
    for g in range(lens.shape[0]):
        w = b64[g].t() if trans_b else b64[g]
        outs.append(a64[bounds[g] : bounds[g + 1]] @ w)
    out = torch.cat(outs)
    out.backward(grad.double())
    return out.detach(), a64.grad, b64.grad


SHAPES = [(4, 16, 48, 40), (3, 5, 32, 24)] + (
    [(16, 512, 2048, 1408), (8, 1024, 7168, 2048)] if ON_GPU else []
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("trans_b", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one-group"])
@pytest.mark.parametrize("groups,per_group,k,n", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_forward_dgrad_wgrad(backend, groups, per_group, k, n, kind, trans_b, dtype):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    lens = _group_lens(kind, groups, per_group)
    a, b, grad = _operands(lens, k, n, trans_b, dtype)
    out = grouped_gemm(a, b, lens, trans_b=trans_b)
    out.backward(grad)
    ref_out, ref_a, ref_b = _reference(a, b, lens, trans_b, grad)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert impl.GroupedGemmDispatcher.last_selected() is backend
    for expected, actual in ((ref_out, out), (ref_a, a.grad), (ref_b, b.grad)):
        if expected.abs().sum() == 0:
            assert torch.all(actual == 0)
        else:
            assert compute_snr(expected, actual) >= GATE[dtype]


def test_single_group_and_zero_tokens():
    lens = torch.tensor([0, 0], dtype=torch.int64, device=DEVICE)
    a = torch.empty(0, 32, device=DEVICE, requires_grad=True)
    b = torch.randn(2, 32, 16, device=DEVICE, requires_grad=True)
    out = grouped_gemm(a, b, lens)
    out.sum().backward()
    assert out.shape == (0, 16) and torch.all(b.grad == 0)
    one = torch.tensor([7], dtype=torch.int64, device=DEVICE)
    a1 = torch.randn(7, 32, device=DEVICE)
    torch.testing.assert_close(grouped_gemm(a1, b[:1], one), a1 @ b[0])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_megatron_fused_wgrad_accumulation(backend):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    lens = _group_lens("skewed", 4, 16)
    a, b, grad = _operands(lens, 48, 40, True, torch.float32)
    b.main_grad = torch.ones(b.shape, device=DEVICE)
    grouped_gemm(a, b, lens, trans_b=True, fuse_bgrad_accum_pattern="megatron").backward(grad)
    _, _, ref_b = _reference(a, b, lens, True, grad)
    assert b.grad_added_to_main_grad
    assert compute_snr(ref_b + 1, b.main_grad) >= 90


def test_autotune_caches_by_shape_class():
    GlobalBackendManager.set_auto_tune(True)
    lens = _group_lens("skewed", 4, 16)
    a, b, _ = _operands(lens, 48, 40, False, torch.float32)
    grouped_gemm(a.detach(), b.detach(), lens)
    other = _group_lens("empty", 4, 16, seed=3)
    a2 = torch.randn(int(other.sum()), 48, device=DEVICE)
    grouped_gemm(a2, b.detach(), other)
    keys = {impl.GroupedGemmDispatcher.make_key(a=t, b=b, group_offs=None, trans_b=False) for t in (a, a2)}
    assert len(keys) <= 2


def test_autotune_times_torch_grouped_mm(monkeypatch):
    """``torch._grouped_mm`` (the TORCH backend) is a candidate: the autotuner must not pick a slower
    Triton kernel for lack of a competitor."""
    from primus_turbo.pytorch.core import backend as backend_module

    timed = []

    def fake_timings(fns, *args, **kwargs):
        timed.append(set(fns))
        return {b: (1.0 if b is BackendType.TORCH else 2.0) for b in fns}

    monkeypatch.setattr(backend_module, "_time_candidates", fake_timings)
    GlobalBackendManager.set_auto_tune(True)
    lens = _group_lens("balanced", 4, 16)
    a, b, _ = _operands(lens, 48, 40, False, torch.float32)
    grouped_gemm(a.detach(), b.detach(), lens)
    assert impl.GroupedGemmDispatcher.last_selected() is BackendType.TORCH
    assert all(BackendType.TORCH in candidates for candidates in timed)


@pytest.mark.deterministic
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_deterministic(backend):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    lens = _group_lens("skewed", 4, 16)
    a, b, grad = _operands(lens, 48, 40, False, torch.bfloat16)
    results = []
    for _ in range(5):
        a.grad = b.grad = None
        out = grouped_gemm(a, b, lens)
        out.backward(grad)
        results.append((out, a.grad, b.grad))
    for result in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], result, strict=True))


def test_opcheck_and_compile():
    lens = _group_lens("empty", 4, 8)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    a, b, grad = _operands(lens, 32, 24, False, torch.float32)
    torch.library.opcheck(impl.grouped_gemm_impl, (a.detach(), b.detach(), offs, False))
    torch.library.opcheck(impl.grouped_gemm_variable_k_impl, (a.detach(), grad, offs))
    out = torch.zeros(4, 32, 24, device=DEVICE)
    torch.library.opcheck(impl.grouped_gemm_variable_k_accum_impl, (a.detach(), grad, offs, out))

    def step(a, b):
        return grouped_gemm(a, b, lens).square().sum()

    leaves = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    step(*eager).backward()
    for x, y in zip(leaves, eager, strict=True):
        torch.testing.assert_close(x.grad, y.grad)


def test_unbuilt_backends_say_why():
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.CK)
    lens = _group_lens("balanced", 2, 4)
    a, b, _ = _operands(lens, 16, 8, False, torch.float32)
    with pytest.raises(ValueError, match="CK grouped GEMM kernels are not built"):
        grouped_gemm(a.detach(), b.detach(), lens)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda a, b, lens: grouped_gemm(a, b, lens.int()), TypeError, "group_lens.dtype"),
        (lambda a, b, lens: grouped_gemm(a, b, lens[:-1]), ValueError, "groups but b has"),
        (lambda a, b, lens: grouped_gemm(a, b.transpose(1, 2), lens), ValueError, "b has K="),
        (lambda a, b, lens: grouped_gemm(a, b.double(), lens), TypeError, "same dtype"),
        (lambda a, b, lens: grouped_gemm(a[None], b, lens), ValueError, "2-D"),
        (lambda a, b, lens: grouped_gemm(a, b, lens * 2), ValueError, "sum to"),
        (lambda a, b, lens: grouped_gemm(a, b, lens - 10), ValueError, "non-negative"),
        (
            lambda a, b, lens: grouped_gemm(a, b, lens, fuse_bgrad_accum_pattern="megatron"),
            ValueError,
            "main_grad",
        ),
    ],
)
def test_bad_input_raises_clear_error(call, error, match, monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    lens = _group_lens("balanced", 3, 4)
    a, b, _ = _operands(lens, 16, 8, False, torch.float32)
    with pytest.raises(error, match=match):
        call(a.detach(), b.detach(), lens)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_cuda_graph_capture_and_replay(backend):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    lens = _group_lens("skewed", 4, 64)
    a, b, grad = _operands(lens, 128, 96, True, torch.bfloat16)
    static_a = a.detach().clone().requires_grad_()
    grouped_gemm(static_a, b, lens, trans_b=True).backward(
        grad
    )  # warm up: autotune and compile outside capture
    static_a.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = grouped_gemm(static_a, b, lens, trans_b=True)
        static_out.backward(grad)
    fresh = torch.randn_like(a)
    with torch.no_grad():
        static_a.copy_(fresh)
    graph.replay()
    expected = grouped_gemm(fresh, b.detach(), lens, trans_b=True)
    torch.testing.assert_close(static_out, expected)


@pytest.mark.parametrize("k,n", [(33, 16), (30, 30)])
def test_unaligned_rows_use_the_fallback(k, n):
    lens = torch.tensor([3, 5], dtype=torch.int64, device=DEVICE)
    a = torch.randn(8, k, device=DEVICE)
    b = torch.randn(2, k, n, device=DEVICE)
    expected = torch.cat([a[:3] @ b[0], a[3:] @ b[1]])
    torch.testing.assert_close(grouped_gemm(a, b, lens), expected)


def test_group_ends_converted_once_per_offsets_version():
    """The int32 ends torch._grouped_mm reads are made once per offsets tensor, again after an in-place
    change, and always for inference tensors (which keep no version)."""
    offs = torch.tensor([0, 2, 5], device=DEVICE)
    first = impl._ends(offs)
    assert first.dtype == torch.int32 and first.tolist() == [2, 5]
    assert impl._ends(offs) is first
    offs[2] = 6
    assert impl._ends(offs).tolist() == [2, 6]
    with torch.inference_mode():
        frozen = torch.tensor([0, 1, 3], device=DEVICE)
        assert impl._ends(frozen).tolist() == [1, 3]
        a = torch.randn(3, 16, device=DEVICE)
        b = torch.randn(2, 16, 16, device=DEVICE)
        out = grouped_gemm(a, b, torch.tensor([1, 2], device=DEVICE))
    tol = 1e-4 if DEVICE == "cpu" else 1e-2  # the Triton fp32 kernel multiplies in tf32
    torch.testing.assert_close(out, torch.cat([a[:1] @ b[0], a[1:] @ b[1]]), rtol=tol, atol=tol)
