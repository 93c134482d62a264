"""The Hopper Gluon kernel for 1 x 128 / 128 x 128 block-scaled FP8 GEMMs against dequantize-and-multiply:
ragged M and N, K of one to nine blocks (every prologue length of the unrolled K loop), E5M2 activations
(the HYBRID backward), fp32 output, block-major and row-major activation scales. Runs on sm_90 only."""

from __future__ import annotations

import pytest
import torch

from tests.pytorch.test_utils import compute_snr

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.version.hip is not None
    or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon kernel targets Hopper (sm_90)",
)


def _operands(m: int, n: int, k: int, a_dtype: torch.dtype, block_major: bool):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=gen).to(a_dtype)
    b = torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    sa = torch.rand(k // 128, m, device="cuda", generator=gen).t() + 0.5
    sa = sa if block_major else sa.contiguous()
    sb = torch.rand(-(-n // 128), k // 128, device="cuda", generator=gen) + 0.5
    a_full = a.float() * sa.repeat_interleave(128, dim=1)
    b_full = b.float() * sb.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)
    return a, sa, b, sb, a_full @ b_full.t()


@pytest.mark.parametrize(
    "m,n,k",
    [
        (128, 128, 128),
        (300, 7168, 2048),
        (256, 576, 384),
        (200, 328, 1152),
        (64, 256, 640),
        (4096, 1536, 7168),
    ],
    ids=str,
)
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_matches_dequantized_product(m, n, k, a_dtype):
    from primus_turbo.triton.gemm.gemm_fp8_block_sm90 import gemm_fp8_block_sm90, sm90_block_kernel_usable

    a, sa, b, sb, reference = _operands(m, n, k, a_dtype, block_major=True)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    assert sm90_block_kernel_usable(a, sa, b, sb, out)
    assert gemm_fp8_block_sm90(a, sa, b, sb, out)
    assert compute_snr(reference, out) >= 40


@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "row-major"])
def test_fp32_output_and_scale_layouts(block_major):
    from primus_turbo.triton.gemm.gemm_fp8_block_sm90 import BlockSm90Config, gemm_fp8_block_sm90

    a, sa, b, sb, reference = _operands(384, 640, 1024, torch.float8_e4m3fn, block_major)
    for config in (BlockSm90Config(), BlockSm90Config(num_stages=3, k_unroll=2, group_m=4)):
        out = torch.empty(384, 640, device="cuda", dtype=torch.float32)
        assert gemm_fp8_block_sm90(a, sa, b, sb, out, config)
        assert compute_snr(reference, out) >= 60, config


def test_declines_what_it_cannot_take():
    from primus_turbo.triton.gemm.gemm_fp8_block_sm90 import sm90_block_kernel_usable

    a, sa, b, sb, _ = _operands(128, 128, 256, torch.float8_e4m3fn, block_major=True)
    assert not sm90_block_kernel_usable(a, sa, b, sb, torch.empty(128, 100, 2, device="cuda")[:, :, 0])
    out = torch.empty(128, 128, device="cuda")
    assert not sm90_block_kernel_usable(a[:, :192], sa[:, :1], b[:, :192], sb[:, :1], out)
