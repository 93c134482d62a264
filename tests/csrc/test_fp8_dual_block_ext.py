"""Tests of the C++/CUDA op primus_turbo_cpp_extension::fp8_dual_block_emit (needs a GPU and _C): both 1 x 128
FP8 copies bit for bit equal to the Triton producers'."""

import pytest
import torch

from tests.csrc import extension_marks

pytestmark = extension_marks(cuda_only=True)

# tails in both dimensions; (4112, 2440) gives blocks a second tile after a tail tile
SHAPES = [(128, 128), (1008, 200), (4096, 1536), (272, 7168), (4112, 2440)]
# (input dtype, FP8 dtype) pairs for the producers; the copy tests every combination
KINDS = [(torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2)]


def _op():
    return torch.ops.primus_turbo_cpp_extension.fp8_dual_block_emit


def _buffers(rows: int, cols: int, fp8: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, scale, q_t, scale_t laid out as quantize_fp8_with_trans returns them (block-major scales)."""
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity
    from primus_turbo.pytorch.kernels.quantization.quantization_impl import fp8_producer_empty

    blockwise = ScalingGranularity.BLOCKWISE.value
    return fp8_producer_empty(torch.Size((rows, cols)), fp8, blockwise, 128, True, torch.device("cuda"))


def _assert_same_bits(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, expected, strict=True):
        view = torch.int32 if a.dtype == torch.float32 else torch.uint8
        assert torch.equal(a.view(view), b.view(view))


def _input(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, width, generator=gen, device="cuda").to(dtype)
    x[3, 5] = float("nan")
    x[-1, -2] = float("inf")
    x[17] = 0.0
    return x


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_copy_matches_triton(rows, cols, dtype, fp8):
    from primus_turbo.triton.quantization import quantize_fp8_dual_blocks_triton

    x = _input(rows, cols, dtype, 0)
    expected, got = _buffers(rows, cols, fp8), _buffers(rows, cols, fp8)
    quantize_fp8_dual_blocks_triton(x, *expected, 128, None)
    _op()(x, None, None, None, None, 0, 0, False, *got)
    _assert_same_bits(got, expected)


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype,fp8", KINDS)
def test_gated_matches_triton(rows, cols, act, moe, dtype, fp8):
    from primus_turbo.triton.activation import gated_act_fp8_triton
    from primus_turbo.triton.quantization import EMIT_BLOCK

    x = _input(rows, 2 * cols, dtype, 1)
    probs = (
        torch.rand(rows, device="cuda").to(dtype if dtype == torch.float16 else torch.float32)
        if moe
        else None
    )
    mask = (torch.arange(rows, device="cuda") % 3 != 0) if moe else None
    expected, got = _buffers(rows, cols, fp8), _buffers(rows, cols, fp8)
    gated_act_fp8_triton(x, probs, mask, act, EMIT_BLOCK, *expected, 128)
    _op()(x, None, None, probs, mask, 1, act, False, *got)
    _assert_same_bits(got, expected)


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("gamma_fp32", [True, False])
@pytest.mark.parametrize("dtype,fp8", KINDS)
def test_rmsnorm_matches_triton(rows, cols, zero_centered, gamma_fp32, dtype, fp8):
    from primus_turbo.triton.normalization import rmsnorm_fp8_triton
    from primus_turbo.triton.quantization import EMIT_BLOCK

    x = _input(rows, cols, dtype, 2)
    gamma = torch.randn(cols, device="cuda").to(torch.float32 if gamma_fp32 else dtype)
    expected, got = _buffers(rows, cols, fp8), _buffers(rows, cols, fp8)
    rstd = rmsnorm_fp8_triton(x, gamma, 1e-6, zero_centered, EMIT_BLOCK, *expected, 128)
    _op()(x, gamma, rstd, None, None, 2, 0, zero_centered, *got)
    _assert_same_bits(got, expected)


@pytest.mark.parametrize("op_name", ["quantize_fp8_with_trans", "rmsnorm_fp8", "swiglu_fp8"])
def test_ops_take_the_cuda_tiles(op_name, monkeypatch):
    """quantize_fp8_with_trans, rmsnorm_fp8 and swiglu_fp8 (1 x 128, both copies, aligned rows) run this
    op, and their outputs equal the Triton path's bit for bit."""
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
    from primus_turbo.pytorch.kernels.activation import gated_act_impl
    from primus_turbo.pytorch.kernels.normalization import rmsnorm_impl
    from primus_turbo.pytorch.kernels.quantization import dual_block_cuda, quantization_impl
    from primus_turbo.pytorch.ops import quantize_fp8_with_trans, rmsnorm_fp8, swiglu_fp8

    x = _input(1024, 768, torch.bfloat16, 4)
    gamma = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(1024, device="cuda")
    row_mask = torch.rand(1024, device="cuda") > 0.2
    config = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=128)

    def run():
        if op_name == "quantize_fp8_with_trans":
            return quantize_fp8_with_trans(
                x, torch.float8_e4m3fn, ScalingGranularity.BLOCKWISE, block_size=128
            )
        if op_name == "rmsnorm_fp8":
            out = rmsnorm_fp8(x, gamma, config)
        else:
            out = swiglu_fp8(x, config, probs, row_mask)
        return out.data, out.scale_inv, out.data_t, out.scale_inv_t

    calls = []
    module = {
        "quantize_fp8_with_trans": quantization_impl,
        "rmsnorm_fp8": rmsnorm_impl,
        "swiglu_fp8": gated_act_impl,
    }[op_name]

    def spy(*args, **kwargs):
        calls.append(args[1])
        return dual_block_cuda.dual_block_cuda(*args, **kwargs)

    monkeypatch.setattr(module, "dual_block_cuda", spy)
    got = run()
    assert calls, "the C++ tiles did not run"
    monkeypatch.setattr(module, "dual_block_cuda_usable", lambda *args: False)
    _assert_same_bits(got, run())


def test_opcheck():
    x = _input(256, 384, torch.bfloat16, 3)
    outputs = _buffers(256, 384, torch.float8_e4m3fn)
    # test_schema compares mutated arguments with arithmetic that float8 tensors do not support
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(_op(), (x, None, None, None, None, 0, 0, False, *outputs), test_utils=checks)


def test_compile_fullgraph():
    """torch.compile captures the mutating op without graph breaks and writes the same bits as eager."""
    x = _input(256, 384, torch.bfloat16, 5)

    def emit(x, q, scale, q_t, scale_t):
        _op()(x, None, None, None, None, 0, 0, False, q, scale, q_t, scale_t)
        return q, scale, q_t, scale_t

    eager = emit(x, *_buffers(256, 384, torch.float8_e4m3fn))
    compiled = torch.compile(emit, fullgraph=True)(x, *_buffers(256, 384, torch.float8_e4m3fn))
    _assert_same_bits(compiled, eager)


def test_unaligned_rows_raise():
    x = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="16-byte aligned rows"):
        _op()(x, None, None, None, None, 0, 0, False, *_buffers(100, 256, torch.float8_e4m3fn))


def test_bad_output_dtype_raises():
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    q, scale, q_t, scale_t = _buffers(128, 256, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="q must be float8_e4m3fn or float8_e5m2"):
        _op()(x, None, None, None, None, 0, 0, False, q.view(torch.uint8), scale, q_t, scale_t)
