"""The Triton 2-D transpose: bit-exact against ``x.t().contiguous()`` for every element size, ragged
tiles and strided rows; bad input raises."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.triton.utils.transpose import transpose_2d_triton
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
SHAPES = [(1, 1), (3, 200), (130, 257)] + ([(4096, 1536), (1000, 7168)] if ON_GPU else [])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_matches_torch_transpose_bitwise(rows, cols, dtype):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)).to(DEVICE, dtype)
    out = transpose_2d_triton(x)
    assert out.is_contiguous() and out.dtype == dtype
    bits = torch.uint8 if dtype.itemsize == 1 else dtype  # torch.equal has no FP8 kernels
    assert torch.equal(out.view(bits), x.t().contiguous().view(bits))


def test_strided_rows_and_empty():
    x = torch.arange(40 * 300, dtype=torch.float32, device=DEVICE).view(40, 300)[:, :130]
    assert torch.equal(transpose_2d_triton(x), x.t().contiguous())
    assert transpose_2d_triton(torch.empty(0, 5, device=DEVICE)).shape == (5, 0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.zeros(2, 3, 4, device=DEVICE), "2-D"),
        (lambda: torch.zeros(4, 6, device=DEVICE)[:, ::2], "unit column stride"),
        (lambda: torch.zeros(4, 4, dtype=torch.float64, device=DEVICE), "1-, 2- or 4-byte"),
    ],
    ids=["3d", "strided-columns", "float64"],
)
def test_bad_input_raises(make, message):
    with pytest.raises(ValueError, match=message):
        transpose_2d_triton(make())
