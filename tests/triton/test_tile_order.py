"""The grouped kernels' tile order (``_even_band_coords``): a bijection onto the tile grid that walks
bands of row tiles whose heights differ by at most one."""

import pytest
import torch
import triton
import triton.language as tl

from primus_turbo.triton.gemm.gemm_kernel import _even_band_coords
from primus_turbo.triton.utils.device_info import interpreter_active

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_active(), reason="needs a GPU or TRITON_INTERPRET=1"
)


@triton.jit
def _coords_kernel(out_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    tile = tl.program_id(0)
    pid_m, pid_n = _even_band_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    tl.store(out_ptr + 2 * tile, pid_m)
    tl.store(out_ptr + 2 * tile + 1, pid_n)


def _expected_order(num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """ceil(m / group_m) bands, the first m % bands of them one row taller; each band column by column,
    row by row within a column."""
    bands = -(-num_pid_m // group_m)
    base, extra = divmod(num_pid_m, bands)
    order, first = [], 0
    for band in range(bands):
        height = base + (band < extra)
        order += [(first + r, col) for col in range(num_pid_n) for r in range(height)]
        first += height
    return order


@pytest.mark.parametrize(
    "num_pid_m,num_pid_n,group_m",
    [(1, 3, 8), (7, 2, 8), (8, 3, 8), (9, 2, 8), (27, 3, 8), (31, 1, 8), (5, 4, 1), (17, 2, 16)],
)
def test_even_bands_cover_the_grid_once(num_pid_m, num_pid_n, group_m):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiles = num_pid_m * num_pid_n
    out = torch.full((tiles, 2), -1, dtype=torch.int32, device=device)
    _coords_kernel[(tiles,)](out, num_pid_m, num_pid_n, GROUP_M=group_m)
    coords = [tuple(c) for c in out.cpu().tolist()]
    assert coords == _expected_order(num_pid_m, num_pid_n, group_m)
    assert sorted(coords) == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]
