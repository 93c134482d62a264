"""The Triton transpose of the last two dimensions: bit-exact against torch for every element size,
ragged tiles, strided rows and a batch dimension; bad input raises."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.triton.utils.transpose import transpose_triton
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
SHAPES = [(1, 1), (3, 200), (130, 257)] + ([(4096, 1536), (1000, 7168)] if ON_GPU else [])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_matches_torch_transpose_bitwise(rows, cols, dtype):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)).to(DEVICE, dtype)
    out = transpose_triton(x)
    assert out.is_contiguous() and out.dtype == dtype
    bits = torch.uint8 if dtype.itemsize == 1 else dtype  # torch.equal has no FP8 kernels
    assert torch.equal(out.view(bits), x.t().contiguous().view(bits))


def test_batched_matches_torch_transpose():
    x = torch.randn(3, 130, 200, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float8_e4m3fn)
    out = transpose_triton(x)
    assert out.shape == (3, 200, 130) and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), x.transpose(1, 2).contiguous().view(torch.uint8))
    strided = torch.randn(2, 40, 300, device=DEVICE)[:, :, :130]
    assert torch.equal(transpose_triton(strided), strided.transpose(1, 2).contiguous())


def test_strided_rows_and_empty():
    x = torch.arange(40 * 300, dtype=torch.float32, device=DEVICE).view(40, 300)[:, :130]
    assert torch.equal(transpose_triton(x), x.t().contiguous())
    assert transpose_triton(torch.empty(0, 5, device=DEVICE)).shape == (5, 0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.zeros(2, 3, 4, 5, device=DEVICE), "2-D or 3-D"),
        (lambda: torch.zeros(4, 6, device=DEVICE)[:, ::2], "unit last stride"),
        (lambda: torch.zeros(4, 4, dtype=torch.float64, device=DEVICE), "1-, 2- or 4-byte"),
    ],
    ids=["4d", "strided-columns", "float64"],
)
def test_bad_input_raises(make, message):
    with pytest.raises(ValueError, match=message):
        transpose_triton(make())
