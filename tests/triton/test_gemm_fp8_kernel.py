"""The Triton FP8 GEMM kernel through both load paths (TMA descriptors and masked pointers), every
scale mode, ragged M/N/K and accumulation, against dequantize-and-multiply."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.triton.gemm import gemm_fp8_kernel as kernel
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
BLOCK = 128 if ON_GPU else 32
E4M3 = torch.float8_e4m3fn
# (a mode, b mode): the pairs gemm_fp8 produces
MODES = [
    (kernel.SCALE_TENSOR, kernel.SCALE_TENSOR),
    (kernel.SCALE_ROW, kernel.SCALE_ROW),
    (kernel.SCALE_BLOCKS, kernel.SCALE_BLOCKS),
    (kernel.SCALE_BLOCKS, kernel.SCALE_BLOCK_2D),
    (kernel.SCALE_BLOCK_2D, kernel.SCALE_BLOCKS),
]
MODE_IDS = ["tensor", "row", "blocks", "blocks-2d", "2d-blocks"]


def _scale(rows: int, k: int, mode: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows + k + mode)
    shapes = {
        kernel.SCALE_TENSOR: (),
        kernel.SCALE_ROW: (rows, 1),
        kernel.SCALE_BLOCKS: (rows, k // BLOCK),
        kernel.SCALE_BLOCK_2D: (-(-rows // BLOCK), k // BLOCK),
    }
    return (torch.rand(shapes[mode], generator=gen) + 0.5).to(DEVICE)


def _expand(scale: torch.Tensor, rows: int, k: int, mode: int) -> torch.Tensor:
    if mode == kernel.SCALE_BLOCKS:
        return scale.repeat_interleave(BLOCK, dim=1)
    if mode == kernel.SCALE_BLOCK_2D:
        return scale.repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)
    return scale


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("m,n", [(64, 96), (72, 40)])
def test_kernel_matches_dequantized_product(m, n, modes, use_tma):
    if use_tma and not kernel.supports_tma(torch.device(DEVICE)):
        pytest.skip("no TMA on this device")
    k = 4 * BLOCK
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(DEVICE, E4M3)
    b = torch.randn(n, k, generator=gen).to(DEVICE, E4M3)
    sa, sb = _scale(m, k, modes[0]), _scale(n, k, modes[1])
    reference = (a.float() * _expand(sa, m, k, modes[0])) @ (b.float() * _expand(sb, n, k, modes[1])).t()
    block = BLOCK if max(modes) >= kernel.SCALE_BLOCKS else 0
    out = kernel.gemm_fp8_triton(
        a, sa, modes[0], b, sb, modes[1], torch.empty(m, n, device=DEVICE), block, use_tma=use_tma
    )
    assert compute_snr(reference, out) >= 60
    start = torch.randn(m, n, device=DEVICE)
    acc = kernel.gemm_fp8_triton(
        a, sa, modes[0], b, sb, modes[1], start.clone(), block, True, use_tma=use_tma
    )
    assert compute_snr(reference + start, acc) >= 60


def test_pointer_path_takes_unaligned_k():
    m, n, k = 40, 24, 50
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(m, k, generator=gen).to(DEVICE, E4M3)
    b = torch.randn(n, k, generator=gen).to(DEVICE, E4M3)
    one = torch.ones((), device=DEVICE)
    out = kernel.gemm_fp8_triton(
        a, one, kernel.SCALE_TENSOR, b, one, kernel.SCALE_TENSOR, torch.empty(m, n, device=DEVICE)
    )
    assert compute_snr(a.float() @ b.float().t(), out) >= 60


@pytest.mark.parametrize("modes", MODES[2:], ids=MODE_IDS[2:])
def test_every_config_scales_blocks_right(modes):
    """Each config's tile shape decides whether a 2-D block scale is one value per tile or a vector, and
    how many programs share an SM: every config against the reference, with ragged edges."""
    m, n, k = 200, 328, 4 * BLOCK
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(m, k, generator=gen).to(DEVICE, E4M3)
    b = torch.randn(n, k, generator=gen).to(DEVICE, E4M3)
    sa, sb = _scale(m, k, modes[0]), _scale(n, k, modes[1])
    reference = (a.float() * _expand(sa, m, k, modes[0])) @ (b.float() * _expand(sb, n, k, modes[1])).t()
    for config in kernel.kernel_configs():
        out = kernel.gemm_fp8_triton(
            a, sa, modes[0], b, sb, modes[1], torch.empty(m, n, device=DEVICE), BLOCK, config=config
        )
        assert compute_snr(reference, out) >= 60, config
