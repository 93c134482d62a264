"""MoE token permutation: the destination map computed on the device, and custom ops for the row movement
(``primus_turbo::moe_gather_rows`` / ``moe_merge_rows`` / ``moe_route_dots``): the Triton kernels of
``primus_turbo/triton/moe/permute_kernel.py`` where Triton runs, the same in PyTorch elsewhere.

Layout: expert-major. Expert ``e``'s rows start at the sum of the previous experts' (padded) counts and
hold its tokens in token order, then zero rows up to a multiple of ``pad_multiple``. ``row_id_map``
[T, E] int32 names each (token, expert) route's row, or -1 (not routed, or beyond a fixed row count).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.triton.moe import gather_rows_triton, merge_rows_triton, route_dots_triton
from primus_turbo.triton.utils.device_info import triton_runs_on

__all__ = [
    "destination_rows",
    "moe_gather_rows_impl",
    "moe_merge_rows_impl",
    "moe_route_dots_impl",
    "source_rows",
    "take_rows",
]


def destination_rows(
    routing_map: torch.Tensor, pad_multiple: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row_id_map int32 [T, E], tokens_per_expert int64 [E], rows) for a bool ``routing_map`` [T, E].

    ``num_rows > 0`` fixes the row count (routes past it get -1 and are not counted) and keeps
    everything on the device; otherwise the count of padded rows is read on the host.
    """
    counts = routing_map.sum(dim=0)
    padded = counts if pad_multiple <= 1 else (counts + pad_multiple - 1) // pad_multiple * pad_multiple
    first_row = padded.cumsum(0) - padded
    rank = routing_map.to(torch.int64).cumsum(0) - 1
    dest = torch.where(routing_map, first_row[None, :] + rank, -1)
    rows = num_rows if num_rows > 0 else int(padded.sum())
    if num_rows > 0:  # routes past the fixed row count are dropped and no longer counted
        dest = torch.where(dest < rows, dest, -1)
        counts = (dest >= 0).sum(dim=0)
    return dest.to(torch.int32), counts, rows


def source_rows(row_id_map: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source token, source expert) int32 [rows] of each permuted row, -1 for padding, by a scatter on
    the device (routes without a row land in a spare slot that is dropped)."""
    tokens, experts = row_id_map.shape
    slot = torch.where(row_id_map >= 0, row_id_map.to(torch.int64), rows).flatten()
    token_ids = torch.arange(tokens, device=row_id_map.device, dtype=torch.int32)[:, None].expand(
        tokens, experts
    )
    expert_ids = torch.arange(experts, device=row_id_map.device, dtype=torch.int32)[None, :].expand(
        tokens, experts
    )
    src_token = torch.full((rows + 1,), -1, dtype=torch.int32, device=row_id_map.device)
    src_expert = torch.full((rows + 1,), -1, dtype=torch.int32, device=row_id_map.device)
    src_token.scatter_(0, slot, token_ids.flatten())
    src_expert.scatter_(0, slot, expert_ids.flatten())
    return src_token[:rows], src_expert[:rows]


def take_rows(x: torch.Tensor, index: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """``x[index]`` with rows of ``fill`` where ``index < 0``, through a spare row, so an empty ``x`` and
    FP8 dtypes work."""
    padded = torch.cat([x, torch.full((1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])
    return padded[torch.where(index >= 0, index.long(), x.shape[0])]


@custom_op("primus_turbo::moe_gather_rows", mutates_args=())
def moe_gather_rows_impl(x: torch.Tensor, src: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor:
    """[len(src), H]: ``x[src[r]]`` (times ``row_scale[r]``), zeros where ``src[r] < 0``."""
    if triton_runs_on(x.device):
        scale = row_scale.contiguous() if row_scale is not None else None
        return gather_rows_triton(x.contiguous(), src.contiguous(), scale)
    rows = take_rows(x, src)
    return (rows.float() * row_scale[:, None]).to(x.dtype) if row_scale is not None else rows


@moe_gather_rows_impl.register_fake
def _moe_gather_rows_fake(x, src, row_scale):
    return x.new_empty((src.shape[0], x.shape[1]))


@custom_op("primus_turbo::moe_merge_rows", mutates_args=())
def moe_merge_rows_impl(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """[T, H] in y's dtype: per token, the (``weights``-weighted, fp32-accumulated) sum of its routed rows."""
    if triton_runs_on(y.device):
        weights = weights.contiguous() if weights is not None else None
        return merge_rows_triton(y.contiguous(), row_id_map.contiguous(), weights)
    routed = row_id_map >= 0
    rows = take_rows(y, row_id_map).float()  # [T, E, H]
    scale = routed.float() if weights is None else torch.where(routed, weights.float(), 0.0)
    return (rows * scale[..., None]).sum(dim=1).to(y.dtype)


@moe_merge_rows_impl.register_fake
def _moe_merge_rows_fake(y, row_id_map, weights):
    return y.new_empty((row_id_map.shape[0], y.shape[1]))


@custom_op("primus_turbo::moe_route_dots", mutates_args=())
def moe_route_dots_impl(g: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E]: ``<g[t], y[row_id_map[t, e]]>`` for routed pairs, 0 elsewhere (merge-weight gradient)."""
    if triton_runs_on(g.device):
        return route_dots_triton(g.contiguous(), y.contiguous(), row_id_map.contiguous())
    rows = take_rows(y, row_id_map).float()
    return torch.where(row_id_map >= 0, (rows * g.float()[:, None, :]).sum(-1), 0.0)


@moe_route_dots_impl.register_fake
def _moe_route_dots_fake(g, y, row_id_map):
    return g.new_empty(row_id_map.shape, dtype=torch.float32)
