"""The TURBO dispatch/combine backend: rows written straight into the peers' buffers of an intranode group
(torch symmetric memory, no multicast) by the kernels of ``primus_turbo/triton/moe/ep_kernel.py``.

A call is: barrier (every rank is done reading its buffer), push into the peers, barrier (every row has
landed), read this rank's own buffer. The steps are separate functions so that tests can run several
ranks' steps in one process over ``Peers`` that share one address table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from primus_turbo.triton.moe.ep_kernel import (
    PeerLayout,
    combine_push_triton,
    combine_reduce_triton,
    dispatch_push_triton,
    dispatch_receive_triton,
    peer_layout,
)

__all__ = [
    "ENV_EP_MAX_TOKENS",
    "PeerHandle",
    "Peers",
    "SymmetricPeers",
    "combine_push",
    "combine_reduce",
    "dispatch_push",
    "dispatch_receive",
    "peer_buffer_bytes",
]

ENV_EP_MAX_TOKENS = "PRIMUS_TURBO_EP_MAX_TOKENS"


class Peers:
    """One rank's view of the group's buffers: its own (``buffer``, uint8), every rank's address
    (``table``, int64 on the device) and a barrier over the group."""

    def __init__(self, rank: int, world: int, buffer: torch.Tensor, table: torch.Tensor) -> None:
        self.rank, self.world, self.buffer, self.table = rank, world, buffer, table

    def barrier(self) -> None:
        """No other rank to wait for (a single-process group of buffers)."""


class SymmetricPeers(Peers):
    """``nbytes`` of torch symmetric memory on every rank of ``group`` (a collective call)."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(buffer, group)
        table = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        super().__init__(self.handle.rank, self.handle.world_size, buffer, table)

    def barrier(self) -> None:
        """Stream-ordered barrier over the group (no host synchronization)."""
        self.handle.barrier(channel=0)


def peer_buffer_bytes(hidden_bytes: int, ranks: int) -> int:
    """Buffer bytes for ``PRIMUS_TURBO_EP_MAX_TOKENS`` (default 8192) tokens per rank of ``hidden_bytes``
    (bf16 rows, top-k up to 32, FP8 scales included)."""
    tokens = int(os.environ.get(ENV_EP_MAX_TOKENS, "8192"))
    return ranks * tokens * (2 * hidden_bytes + 32 * 12 + hidden_bytes // 64) + 64 * 1024


@dataclass(frozen=True)
class PeerHandle:
    """What combine (and a dispatch with a handle) needs: each token's row in each destination's block,
    the rows sent per destination, and the source rank and position of every received row."""

    slot: torch.Tensor  # int32 [T, R], -1: not sent
    sent: torch.Tensor  # int32 [R]
    src_rank: torch.Tensor  # int32 [N], -1: padding
    src_pos: torch.Tensor  # int32 [N]
    layout: PeerLayout
    local_experts: int


def _layout(nbytes: int, ranks: int, x: torch.Tensor, topk: int, scale_cols: int) -> PeerLayout:
    hidden = x.shape[1]
    row_bytes = hidden * x.element_size()
    if row_bytes % 4 or hidden % 2:
        raise ValueError(f"the TURBO backend moves rows of whole 32-bit words; hidden {hidden} does not fit")
    layout = peer_layout(nbytes, ranks, row_bytes, hidden, topk, scale_cols)
    if x.shape[0] > layout.cap:
        raise ValueError(
            f"{x.shape[0]} tokens exceed the {layout.cap} a {nbytes}-byte buffer holds per rank at this "
            f"shape; size the Buffer with Config.get_nvl_buffer_size_hint or raise {ENV_EP_MAX_TOKENS}"
        )
    return layout


def dispatch_push(
    peers: Peers,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    scales: torch.Tensor | None,
    in_rank: torch.Tensor,
    num_experts: int,
    handle: PeerHandle | None = None,
) -> tuple[torch.Tensor, torch.Tensor, PeerLayout]:
    """Write this rank's rows into the peers' buffers: ``(slot, sent, layout)``; a ``handle`` reuses a
    previous dispatch's placement."""
    if handle is not None:
        slot, sent, layout = handle.slot, handle.sent, handle.layout
    else:
        ranks = in_rank.to(torch.int32)
        slot = torch.where(in_rank, ranks.cumsum(0, dtype=torch.int32) - 1, -1).to(torch.int32)
        sent = ranks.sum(0, dtype=torch.int32)
        scale_cols = scales.shape[1] if scales is not None else 0
        layout = _layout(peers.buffer.numel(), peers.world, x, topk_idx.shape[1], scale_cols)
    dispatch_push_triton(
        x, topk_idx, topk_weights, scales, slot, sent, peers.table, peers.rank, layout,
        num_experts // peers.world,
    )  # fmt: skip
    return slot, sent, layout


def dispatch_receive(
    peers: Peers,
    layout: PeerLayout,
    rows: int,
    dtype: torch.dtype,
    hidden: int,
    with_weights: bool,
    with_scales: bool,
) -> tuple[torch.Tensor, ...]:
    """(rows [rows, hidden] of ``dtype``, local top-k, weights, scales, source rank, source position) from
    this rank's buffer; ``rows < 0`` reads the received count on the host."""
    if rows < 0:
        counts = peers.buffer[layout.counts : layout.counts + 4 * peers.world].view(torch.int32)
        rows = int(counts.sum())
    x, idx, w, s, src_rank, src_pos = dispatch_receive_triton(
        peers.buffer, layout, rows, with_weights, with_scales
    )
    return x.view(dtype).view(rows, hidden), idx, w, s, src_rank, src_pos


def combine_push(
    peers: Peers, y: torch.Tensor | None, topk_weights: torch.Tensor | None, handle: PeerHandle
) -> None:
    """Received rows (16-bit [N, H]) and/or fp32 top-k weights [N, K] back into their sources' buffers."""
    if y is not None and (y.element_size() != 2 or y.dim() != 2 or y.shape[1] != handle.layout.hidden):
        raise ValueError(
            f"TURBO combine takes 16-bit rows of hidden {handle.layout.hidden}, "
            f"got {y.dtype} {tuple(y.shape)}"
        )
    combine_push_triton(
        y, topk_weights, handle.src_rank, handle.src_pos, peers.table, peers.rank, handle.layout
    )


def combine_reduce(
    peers: Peers, handle: PeerHandle, dtype: torch.dtype | None, with_weights: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each token's returned rows (of ``dtype``; none without one) and weights summed in fp32 in rank
    order: ``([T, H] or None, [T, K] or None)``."""
    return combine_reduce_triton(peers.buffer, handle.slot, handle.layout, dtype, with_weights)
