"""MoE token permutation: the expert-major layout computed on the device, and custom ops for it and for the
row movement (``primus_turbo::moe_expert_layout`` / ``moe_expert_bounds`` / ``moe_scatter_rows`` /
``moe_merge_rows`` / ``moe_route_dots``): the Triton kernels of ``primus_turbo/triton/moe/permute_kernel.py``
where Triton runs, the same in PyTorch elsewhere.

Layout: expert-major. Expert ``e``'s rows start at the sum of the previous experts' (padded) counts and
hold its tokens in token order, then zero rows up to a multiple of ``pad_multiple``. ``row_id_map``
[T, E] int32 names each (token, expert) route's row, or -1 (not routed, or beyond a fixed row count).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.triton.moe import (
    expert_bounds_triton,
    expert_layout_triton,
    merge_rows_triton,
    route_dots_triton,
    scatter_rows_triton,
)
from primus_turbo.triton.utils.device_info import triton_runs_on

__all__ = [
    "merge_rows_torch",
    "moe_expert_bounds_impl",
    "moe_expert_layout_impl",
    "moe_merge_rows_impl",
    "moe_route_dots_impl",
    "moe_scatter_rows_impl",
    "padded_counts",
    "permute_torch",
    "permute_uses_triton",
    "take_rows",
]


def permute_uses_triton(x: torch.Tensor) -> bool:
    """Whether the permutation ops run the Triton kernels on ``x`` (else the PyTorch expressions here)."""
    return triton_runs_on(x.device)


def padded_counts(counts: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """Each expert's row count in the layout: ``counts`` rounded up to a multiple of ``pad_multiple``."""
    return counts if pad_multiple <= 1 else (counts + pad_multiple - 1) // pad_multiple * pad_multiple


def _kept_counts(counts: torch.Tensor, first_row: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Routes per expert that fit below a fixed row count ``num_rows``, from each expert's first row."""
    return torch.minimum((num_rows - first_row).clamp_(min=0), counts)


def _expert_layout_torch(
    routing_map: torch.Tensor, pad_multiple: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    counts = routing_map.sum(dim=0)
    padded = padded_counts(counts, pad_multiple)
    ends = padded.cumsum(0)
    first_row = ends - padded
    rank = routing_map.cumsum(0, dtype=torch.int32)  # routes of each expert up to this token, inclusive
    dest = torch.where(routing_map, rank + (first_row - 1).to(torch.int32), -1)
    if num_rows > 0:  # routes past the fixed row count are dropped and no longer counted
        dest.masked_fill_(dest >= num_rows, -1)
        counts = _kept_counts(counts, first_row, num_rows)
    return dest, counts, torch.cat([first_row, ends[-1:]]).to(torch.int32)


@custom_op("primus_turbo::moe_expert_layout", mutates_args=())
def moe_expert_layout_impl(
    routing_map: torch.Tensor, pad_multiple: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_id_map int32 [T, E], kept tokens per expert int64 [E], int32 [E + 1] each expert's first row
    and the padded row total) of a bool ``routing_map`` [T, E]. ``num_rows > 0`` drops the routes past
    that row (they get -1 and are not counted)."""
    if triton_runs_on(routing_map.device):
        return expert_layout_triton(routing_map, pad_multiple, num_rows)
    return _expert_layout_torch(routing_map, pad_multiple, num_rows)


@moe_expert_layout_impl.register_fake
def _moe_expert_layout_fake(routing_map, pad_multiple, num_rows):
    tokens, experts = routing_map.shape
    return (
        routing_map.new_empty((tokens, experts), dtype=torch.int32),
        routing_map.new_empty((experts,), dtype=torch.int64),
        routing_map.new_empty((experts + 1,), dtype=torch.int32),
    )


@custom_op("primus_turbo::moe_expert_bounds", mutates_args=())
def moe_expert_bounds_impl(row_id_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row int32 [E], route count int32 [E]) per expert of a ``row_id_map``; the first row is
    meaningless where the count is 0."""
    if triton_runs_on(row_id_map.device):
        return expert_bounds_triton(row_id_map)
    routed = row_id_map >= 0
    first = torch.where(routed, row_id_map, torch.iinfo(torch.int32).max).amin(dim=0)
    return first.to(torch.int32), routed.sum(dim=0).to(torch.int32)


@moe_expert_bounds_impl.register_fake
def _moe_expert_bounds_fake(row_id_map):
    experts = row_id_map.shape[1]
    return row_id_map.new_empty((experts,)), row_id_map.new_empty((experts,))


class _Routes(NamedTuple):
    """Every routed (token, expert) pair of a ``row_id_map`` [T, E] as int64 index lists."""

    token: torch.Tensor
    row: torch.Tensor
    flat: torch.Tensor  # token * E + expert: the pair's entry of a flattened [T, E] tensor
    in_order: bool  # rows are 0, 1, ..., n - 1 (no padding, nothing dropped)

    def rows_of(self, y: torch.Tensor) -> torch.Tensor:
        """``y``'s routed rows in route order (``y`` itself where that is every row in order)."""
        return y if self.in_order and y.shape[0] == self.row.numel() else y.index_select(0, self.row)


_last_routes: list = [None, None, None]  # (row_id_map, its version, its routes)


def _remember_routes(row_id_map: torch.Tensor, routes: _Routes) -> None:
    if not row_id_map.is_inference():
        _last_routes[:] = row_id_map, row_id_map._version, routes


def _routes(row_id_map: torch.Tensor) -> _Routes:
    """The routes of ``row_id_map``, expert-major and in token order within an expert (so each token's
    routes come in expert order and fp32 sums over them run in one order): the CPU paths' index lists (the
    device launchers never sync on a route count). The last map's lists are kept: unpermute's forward and
    its backward's two ops take the map that permute made."""
    cached, version, routes = _last_routes
    if cached is row_id_map and version == row_id_map._version and not row_id_map.is_inference():
        return routes
    expert, token = (row_id_map >= 0).t().nonzero(as_tuple=True)
    flat = token * row_id_map.shape[1] + expert
    row = row_id_map.reshape(-1).index_select(0, flat).long()
    routes = _Routes(token, row, flat, row.numel() == 0 or int(row[-1]) == row.numel() - 1)
    _remember_routes(row_id_map, routes)
    return routes


def _at_pairs(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """fp32 entries of ``x`` [T, E] at the flattened pair indices ``flat``, differentiably."""
    return x.reshape(-1).index_select(0, flat).float()


def _place(values: torch.Tensor, routes: _Routes, num_rows: int) -> torch.Tensor:
    """[num_rows, ...]: ``values`` (one per route) on the routes' rows, zeros elsewhere; differentiable in
    ``values`` (FP8 values move as bytes)."""
    if routes.in_order and routes.row.numel() == num_rows:
        return values
    out = values.new_zeros((num_rows, *values.shape[1:]))
    if values.is_floating_point() and values.element_size() == 1:  # FP8, whose CPU index_copy is missing
        return out.view(torch.uint8).index_copy_(0, routes.row, values.view(torch.uint8)).view(values.dtype)
    return out.index_copy(0, routes.row, values)


def permute_torch(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs_map: torch.Tensor | None,
    scales: torch.Tensor | None,
    pad_multiple: int,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``moe_permute``'s five results from a bool ``routing_map`` [T, E] as one PyTorch expression that
    autograd differentiates: the CPU path in eager mode, where it costs less host time than the custom
    ops and a Python Function. Syncs on the route count (the CPU has nothing to overlap)."""
    experts = routing_map.shape[1]
    expert, token = routing_map.t().nonzero(as_tuple=True)
    counts = routing_map.sum(dim=0)
    padded = padded_counts(counts, pad_multiple)
    first = padded.cumsum(0) - padded
    row = torch.arange(token.numel(), device=tokens.device)
    in_order, total = pad_multiple <= 1, token.numel()
    if not in_order:  # shift each expert's routes by the padding of the experts before it
        row = row + (first - (counts.cumsum(0) - counts)).index_select(0, expert)
        total = int(first[-1] + padded[-1])
    rows = num_rows if num_rows > 0 else total
    if rows < total:  # routes past the fixed row count are dropped and no longer counted
        keep = row < rows
        token, expert, row = token[keep], expert[keep], row[keep]
        counts = _kept_counts(counts, first, rows)
    routes = _Routes(token, row, token * experts + expert, in_order)
    row_id_map = torch.full((routing_map.shape[0], experts), -1, dtype=torch.int32, device=tokens.device)
    row_id_map.view(-1).index_copy_(0, routes.flat, row.to(torch.int32))
    _remember_routes(row_id_map, routes)
    permuted = _place(tokens.index_select(0, token), routes, rows)
    probs = _place(_at_pairs(probs_map, routes.flat), routes, rows) if probs_map is not None else None
    permuted_scales = _place(scales.index_select(0, token), routes, rows) if scales is not None else None
    return permuted, row_id_map, counts, probs, permuted_scales


def merge_rows_torch(y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``moe_merge_rows`` in PyTorch, differentiable in ``y`` and ``weights``: the CPU path (eager
    ``moe_unpermute`` calls it under autograd)."""
    routes = _routes(row_id_map)
    rows = routes.rows_of(y).float()
    if weights is not None:
        rows = rows * _at_pairs(weights, routes.flat)[:, None]
    out = torch.zeros((row_id_map.shape[0], y.shape[1]), dtype=torch.float32, device=y.device)
    return out.index_add_(0, routes.token, rows).to(y.dtype)


def take_rows(x: torch.Tensor, index: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """``x[index]`` with rows of ``fill`` where ``index < 0``, through a spare row, so an empty ``x`` and
    FP8 dtypes work."""
    padded = torch.cat([x, torch.full((1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])
    return padded[torch.where(index >= 0, index.long(), x.shape[0])]


@custom_op("primus_turbo::moe_scatter_rows", mutates_args=())
def moe_scatter_rows_impl(
    x: torch.Tensor,
    row_id_map: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    weights: torch.Tensor | None,
    num_rows: int,
    scale_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_rows, H], fp32 [num_rows] route weight per row, or [0] without ``weights``): each token row of
    ``x`` [T, H] copied to the rows its ``row_id_map`` names, times its ``weights`` [T, E] entry where
    ``scale_rows``; zeros on the rows outside every expert's ``[start, start + count)``."""
    if triton_runs_on(x.device):
        return scatter_rows_triton(
            x.contiguous(), row_id_map.contiguous(), start.contiguous(), count.contiguous(),
            weights.contiguous() if weights is not None else None, num_rows, scale_rows,
        )  # fmt: skip
    routes = _routes(row_id_map)
    rows = x.index_select(0, routes.token)
    if weights is None:
        return _place(rows, routes, num_rows), torch.empty(0, dtype=torch.float32, device=x.device)
    route_weights = _at_pairs(weights, routes.flat)
    if scale_rows:
        rows = (rows.float() * route_weights[:, None]).to(x.dtype)
    return _place(rows, routes, num_rows), _place(route_weights, routes, num_rows)


@moe_scatter_rows_impl.register_fake
def _moe_scatter_rows_fake(x, row_id_map, start, count, weights, num_rows, scale_rows):
    row_weights = x.new_empty((num_rows if weights is not None else 0,), dtype=torch.float32)
    return x.new_empty((num_rows, x.shape[1])), row_weights


@custom_op("primus_turbo::moe_merge_rows", mutates_args=())
def moe_merge_rows_impl(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """[T, H] in y's dtype: per token, the (``weights``-weighted, fp32-accumulated) sum of its routed rows."""
    if triton_runs_on(y.device):
        weights = weights.contiguous() if weights is not None else None
        return merge_rows_triton(y.contiguous(), row_id_map.contiguous(), weights)
    return merge_rows_torch(y, row_id_map, weights)


@moe_merge_rows_impl.register_fake
def _moe_merge_rows_fake(y, row_id_map, weights):
    return y.new_empty((row_id_map.shape[0], y.shape[1]))


@custom_op("primus_turbo::moe_route_dots", mutates_args=())
def moe_route_dots_impl(g: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E]: ``<g[t], y[row_id_map[t, e]]>`` for routed pairs, 0 elsewhere (merge-weight gradient)."""
    if triton_runs_on(g.device):
        return route_dots_triton(g.contiguous(), y.contiguous(), row_id_map.contiguous())
    routes = _routes(row_id_map)
    dots = (routes.rows_of(y).float() * g.index_select(0, routes.token).float()).sum(-1)
    out = torch.zeros(row_id_map.shape, dtype=torch.float32, device=g.device)
    out.view(-1).index_copy_(0, routes.flat, dots)
    return out


@moe_route_dots_impl.register_fake
def _moe_route_dots_fake(g, y, row_id_map):
    return g.new_empty(row_id_map.shape, dtype=torch.float32)
