"""Dense GEMM: every backend against the fp64 reference, forward and backward, plus the op contract."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.gemm import gemm_impl as gemm_kernels
from primus_turbo.pytorch.ops import gemm
from tests.pytorch.ref.gemm_ref import gemm_ref, gemm_ref_with_grads
from tests.pytorch.test_utils import DEVICES, get_tolerances

ON_GPU = torch.cuda.is_available()
DEVICE = DEVICES[0]
BACKENDS = (
    [BackendType.HIPBLASLT, BackendType.TRITON, BackendType.TORCH]
    if ON_GPU
    else [
        BackendType.TRITON,
        BackendType.TORCH,
    ]
)
SHAPES = [(1, 1, 1), (1, 16, 17), (16, 1, 16), (33, 40, 64), (64, 48, 130), (127, 65, 33)]
if ON_GPU:
    SHAPES += [(512, 1024, 2048), (2048, 4096, 1024), (1, 4096, 4096), (4096, 129, 255), (255, 256, 4096)]
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def _reset_backends():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


def _operands(m, n, k, trans_a, trans_b, dtype, device=DEVICE, requires_grad=True):
    a_shape = (k, m) if trans_a else (m, k)
    b_shape = (n, k) if trans_b else (k, n)
    a = (torch.randn(a_shape, device=device) / k**0.5).to(dtype).requires_grad_(requires_grad)
    b = torch.randn(b_shape, device=device).to(dtype).requires_grad_(requires_grad)
    return a, b


def _pin(backend):
    GlobalBackendManager.set_gemm_backend(backend)


def _check_close(actual, expected, dtype):
    """allclose at the dtype's gate on values normalised by the reference's max-abs.

    Accumulation-order and output-rounding errors of a K-long dot product scale with the output's range,
    so elements that cancel to near zero are judged against that range, not their own size.
    """
    scale = expected.abs().max().clamp_min(1e-30) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().cpu().double() / scale, expected / scale, **get_tolerances(dtype)
    )


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS, ids=["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_forward_backward(m, n, k, trans_a, trans_b, dtype, backend):
    torch.manual_seed(42)
    _pin(backend)
    a, b = _operands(m, n, k, trans_a, trans_b, dtype)
    grad_out = torch.randn(m, n, device=DEVICE).to(dtype)
    out = gemm(a, b, trans_a, trans_b)
    out.backward(grad_out)
    ref_out, ref_da, ref_db = gemm_ref_with_grads(a, b, grad_out, trans_a, trans_b)
    assert out.dtype == dtype and out.shape == (m, n)
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    _check_close(out, ref_out, dtype)
    _check_close(a.grad, ref_da, dtype)
    _check_close(b.grad, ref_db, dtype)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize(
    "in_dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32)]
)
def test_gemm_wider_out_dtype(in_dtype, out_dtype, backend):
    torch.manual_seed(0)
    _pin(backend)
    a, b = _operands(40, 24, 72, False, True, in_dtype, requires_grad=False)
    out = gemm(a, b, trans_b=True, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    _check_close(out, gemm_ref(a, b, trans_b=True), out_dtype)


def test_gemm_default_backend_and_narrower_out_dtype():
    torch.manual_seed(0)
    a, b = _operands(32, 16, 48, False, False, torch.float32, requires_grad=False)
    out = gemm(a, b, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    _check_close(out, gemm_ref(a, b), torch.bfloat16)
    # the vendor BLAS cannot narrow fp32 to bf16: the first registered backend that can runs instead
    expected = BackendType.TRITON if ON_GPU else BackendType.TORCH
    assert gemm_kernels.last_selected_backend() is expected


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_gemm_strided_and_column_major_inputs(backend):
    torch.manual_seed(1)
    _pin(backend)
    base = torch.randn(64, 96, device=DEVICE, dtype=torch.bfloat16)
    a = base[:, 8:72]  # row stride 96, not contiguous
    b_col_major = torch.randn(40, 64, device=DEVICE, dtype=torch.bfloat16).t()  # (64, 40), column-major
    every_other = torch.randn(64, 80, device=DEVICE, dtype=torch.bfloat16)[:, ::2]  # neither layout
    for b in (b_col_major, every_other):
        _check_close(gemm(a, b), gemm_ref(a, b), torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("m,n,k", [(0, 16, 32), (16, 0, 32), (16, 24, 0), (0, 0, 0)])
def test_gemm_empty_inputs(m, n, k, backend):
    _pin(backend)
    a, b = _operands(m, n, k, False, True, torch.bfloat16)
    out = gemm(a, b, trans_b=True)
    assert out.shape == (m, n)
    assert torch.count_nonzero(out) == 0
    out.backward(torch.ones_like(out))
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert torch.count_nonzero(a.grad) == 0 and torch.count_nonzero(b.grad) == 0


def _weight_with_main_grad(n, k, dtype, main_grad_dtype=torch.float32):
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype).requires_grad_()
    weight.main_grad = torch.randn(n, k, device=DEVICE, dtype=main_grad_dtype)
    weight.grad_added_to_main_grad = False
    return weight


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("zero_out_wgrad", [False, True])
def test_gemm_megatron_fused_wgrad_accumulation(backend, trans_b, zero_out_wgrad):
    torch.manual_seed(3)
    _pin(backend)
    m, n, k = 48, 40, 64
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = _weight_with_main_grad(n, k, torch.bfloat16)
    if not trans_b:
        weight = _weight_with_main_grad(k, n, torch.bfloat16)
    weight.zero_out_wgrad = zero_out_wgrad
    start = weight.main_grad.clone()
    grad_out = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    out = gemm(x, weight, trans_b=trans_b, fuse_bgrad_accum_pattern="megatron")
    out.backward(grad_out)
    _, ref_dx, ref_dw = gemm_ref_with_grads(x, weight, grad_out, False, trans_b)
    assert weight.grad_added_to_main_grad is True
    torch.testing.assert_close(
        weight.main_grad.cpu().double(), start.cpu().double() + ref_dw, rtol=1e-4, atol=1e-4
    )
    assert weight.grad.shape == weight.shape and weight.grad.dtype == weight.dtype
    if zero_out_wgrad:
        assert torch.count_nonzero(weight.grad) == 0
    _check_close(x.grad, ref_dx, torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS, ids=["NN", "NT", "TN", "TT"])
def test_gemm_accum_op_adds_once(backend, trans_a, trans_b):
    torch.manual_seed(4)
    _pin(backend)
    a, b = _operands(36, 20, 52, trans_a, trans_b, torch.bfloat16, requires_grad=False)
    acc = torch.randn(36, 20, device=DEVICE)
    expected = acc.double().cpu() + gemm_ref(a, b, trans_a, trans_b)
    torch.ops.primus_turbo.gemm_accum(a, b, acc, trans_a, trans_b)
    torch.testing.assert_close(acc.cpu().double(), expected, rtol=1e-4, atol=1e-4)


def test_gemm_autotune_times_backends_and_keeps_accumulators(monkeypatch):
    """Autotune picks a backend per shape, caches it, and its timing runs never touch the caller's buffer."""
    monkeypatch.setattr(gemm_kernels.TorchGemmBackend, "autotune", True)
    GlobalBackendManager.set_auto_tune(True)
    torch.manual_seed(5)
    a, b = _operands(40, 24, 72, False, True, torch.bfloat16, requires_grad=False)
    acc = torch.randn(40, 24, device=DEVICE)
    expected = acc.double().cpu() + gemm_ref(a, b, False, True)
    torch.ops.primus_turbo.gemm_accum(a, b, acc, False, True)
    torch.testing.assert_close(acc.cpu().double(), expected, rtol=1e-4, atol=1e-4)
    out = gemm(a, b, trans_b=True)
    _check_close(out, gemm_ref(a, b, trans_b=True), torch.bfloat16)
    assert len(gemm_kernels.GemmDispatcher._cache) == 2
    assert gemm_kernels.last_selected_backend() in BACKENDS


def test_gemm_env_backend_selection(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp8:HIPBLASLT,other:triton")
    a, b = _operands(8, 8, 8, False, False, torch.float32, requires_grad=False)
    gemm(a, b)
    assert gemm_kernels.last_selected_backend() is BackendType.TRITON
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH)
    gemm(a, b)
    assert gemm_kernels.last_selected_backend() is BackendType.TORCH


@pytest.mark.skipif(ON_GPU, reason="checks the CPU error path")
def test_gemm_pinned_unavailable_backend_raises_with_reason():
    _pin(BackendType.HIPBLASLT)
    a, b = _operands(8, 8, 8, False, False, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="pinned backend HIPBLASLT cannot handle this call: needs a CUDA"):
        gemm(a, b)


@pytest.mark.skipif(not ON_GPU, reason="the vendor BLAS path only exists on a GPU")
def test_gemm_pinned_backend_that_cannot_handle_raises():
    _pin(BackendType.HIPBLASLT)
    a, b = _operands(8, 8, 8, False, False, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="HIPBLASLT cannot handle this call: output"):
        gemm(a, b, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS, ids=["NN", "NT", "TN", "TT"])
def test_gemm_opcheck(trans_a, trans_b, dtype):
    torch.manual_seed(6)
    a, b = _operands(24, 40, 32, trans_a, trans_b, dtype, requires_grad=False)
    torch.library.opcheck(torch.ops.primus_turbo.gemm.default, (a, b, trans_a, trans_b, dtype))
    acc = torch.zeros(24, 40, device=DEVICE)
    torch.library.opcheck(torch.ops.primus_turbo.gemm_accum.default, (a, b, acc, trans_a, trans_b))


COMPILE_BACKENDS = ["aot_eager", "inductor"] if ON_GPU else ["aot_eager"]


@pytest.mark.parametrize("compile_backend", COMPILE_BACKENDS)
def test_gemm_compiles_fullgraph_forward_backward(compile_backend):
    torch._dynamo.reset()
    torch.manual_seed(7)

    def step(x, w):
        return gemm(torch.relu(x), w, trans_b=True).float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend=compile_backend)
    x, w = _operands(32, 16, 48, False, True, torch.bfloat16)
    loss = compiled(x, w)
    loss.backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss_ref = step(x_ref, w_ref)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, x_ref.grad, **get_tolerances(torch.bfloat16))
    torch.testing.assert_close(w.grad, w_ref.grad, **get_tolerances(torch.bfloat16))


DET_SHAPES = [(4096, 4096, 4096), (1000, 3000, 2000)] if ON_GPU else [(64, 48, 80)]


@pytest.mark.deterministic
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("m,n,k", DET_SHAPES)
def test_gemm_deterministic(m, n, k, backend):
    torch.manual_seed(8)
    _pin(backend)
    a, b = _operands(m, n, k, False, True, torch.bfloat16)
    grad_out = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    results = []
    for _ in range(10):
        a.grad = b.grad = None
        out = gemm(a, b, trans_b=True)
        out.backward(grad_out)
        results.append((out.detach().clone(), a.grad.clone(), b.grad.clone()))
    for other in results[1:]:
        for first, again in zip(results[0], other, strict=True):
            torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (
            lambda: (torch.ones(4, 4, dtype=torch.int32), torch.ones(4, 4, dtype=torch.int32)),
            TypeError,
            "a.dtype",
        ),
        (lambda: (torch.ones(4, 4), torch.ones(4, 4, dtype=torch.bfloat16)), TypeError, "same dtype"),
        (lambda: (torch.ones(4, 5), torch.ones(4, 4)), ValueError, "inner dimensions differ"),
        (lambda: (torch.ones(2, 4, 4), torch.ones(4, 4)), ValueError, "a must be 2-D"),
        (lambda: (torch.ones(4, 4), torch.ones(4)), ValueError, "b must be 2-D"),
        (lambda: ([[1.0]], torch.ones(1, 1)), TypeError, "a must be a torch.Tensor"),
    ],
    ids=["int-dtype", "mixed-dtype", "mismatched-k", "3d-input", "1d-input", "not-a-tensor"],
)
def test_gemm_bad_input_raises(make_args, error, match):
    a, b = make_args()
    with pytest.raises(error, match=match):
        gemm(a, b)


def test_gemm_bad_options_raise():
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm(a, b, out_dtype=torch.int8)
    with pytest.raises(TypeError, match="trans_b must be a bool"):
        gemm(a, b, trans_b=1)
    with pytest.raises(ValueError, match="fuse_bgrad_accum_pattern"):
        gemm(a, b, fuse_bgrad_accum_pattern="deepspeed")
    with pytest.raises(ValueError, match="needs b.main_grad"):
        gemm(a, b, fuse_bgrad_accum_pattern="megatron")
    b.main_grad = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="main_grad must be a contiguous tensor"):
        gemm(a, b, fuse_bgrad_accum_pattern="megatron")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to mix devices")
def test_gemm_mixed_devices_raise():
    with pytest.raises(ValueError, match="one device"):
        gemm(torch.ones(4, 4, device="cuda"), torch.ones(4, 4))


MAX_DIM = 1536 if ON_GPU else 80


@settings(max_examples=40 if ON_GPU else 12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(1, MAX_DIM),
    n=st.integers(1, MAX_DIM),
    k=st.integers(1, MAX_DIM),
    trans_a=st.booleans(),
    trans_b=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_gemm_fuzz_every_available_backend(m, n, k, trans_a, trans_b, dtype):
    a, b = _operands(m, n, k, trans_a, trans_b, dtype, requires_grad=False)
    expected = gemm_ref(a, b, trans_a, trans_b)
    for backend in BACKENDS:
        GlobalBackendManager.set_gemm_backend(backend)
        _check_close(gemm(a, b, trans_a, trans_b), expected, dtype)
    GlobalBackendManager.reset()


def test_megatron_fused_accumulation_compiles_fullgraph():
    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    w.main_grad = torch.zeros(8, 16, device=DEVICE)

    def step(x, w):
        return gemm(x, w, trans_b=True, fuse_bgrad_accum_pattern="megatron").sum()

    torch.compile(step, fullgraph=True, backend="aot_eager")(x, w).backward()
    assert w.grad_added_to_main_grad
    torch.testing.assert_close(w.main_grad, torch.ones(4, 8, device=DEVICE).t() @ x.detach())
