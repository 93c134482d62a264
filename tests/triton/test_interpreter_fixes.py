"""The test-only Triton-interpreter corrections in conftest still apply to the installed Triton."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs[:, None] * N + offs[None, :])
    b = tl.load(b_ptr + offs[:, None] * N + offs[None, :])
    tl.store(c_ptr + offs[:, None] * N + offs[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr, TO_E5M2: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = x.to(tl.float8e5) if TO_E5M2 else x.to(tl.float8e4nv)
    tl.store(y_ptr + offs, y.to(tl.uint8, bitcast=True))


def test_interpreter_is_patched():
    from triton.runtime import interpreter

    assert getattr(interpreter.InterpreterBuilder, "_primus_turbo_patched", False)


def test_bf16_dot_multiplies_values_not_bits():
    torch.manual_seed(0)
    a = torch.randn(16, 16).bfloat16()
    b = torch.randn(16, 16).bfloat16()
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("to_e5m2", [False, True])
def test_fp8_cast_rounds_to_nearest_even(src_dtype, to_e5m2):
    x = torch.tensor([31.98, -31.98, 0.3, 1.0625, 448.0, -2.5e-3, 0.0, 7.3] * 2).to(src_dtype)
    y = torch.empty(16, dtype=torch.uint8)
    _cast_kernel[(1,)](x, y, N=16, TO_E5M2=to_e5m2)
    target = torch.float8_e5m2 if to_e5m2 else torch.float8_e4m3fn
    assert torch.equal(y, x.to(target).view(torch.uint8))
