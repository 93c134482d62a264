"""Expert-parallel dispatch and combine over peer memory: every rank of an intranode group maps every
other rank's buffer (torch symmetric memory), and these kernels write rows straight into the peers'.

Each rank's buffer holds one block of ``cap`` rows per source rank, so no offsets need agreeing before the
rows move (``PeerLayout`` gives the regions):

- ``dispatch_push_triton`` (source rank ``me``): each token row, once per destination rank its experts
  live on, into that rank's block ``me`` at the token's position among those sent there; its top-k
  indices made local to that rank (-1 elsewhere), weights (0 elsewhere) and FP8 scales beside it; and the
  row count per destination into each destination's count slot ``me``.
- ``dispatch_receive_triton`` (after a barrier): the blocks compacted in source-rank order into the
  received rows, with the source rank and position of each (for combine).
- ``combine_push_triton`` (expert side): each received row back into its source rank's combine block.
- ``combine_reduce_triton`` (after a barrier): each token's rows summed in fp32 in rank order.

Rows move as 32-bit words; pointers to the peers' buffers come from a table of their addresses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from primus_turbo.triton.utils.launch import cached_launch

__all__ = [
    "PeerLayout",
    "combine_push_triton",
    "combine_reduce_triton",
    "dispatch_push_triton",
    "dispatch_receive_triton",
    "peer_layout",
]

_BLOCK_WORDS = 1024
_ALIGN = 256


class PeerLayout(NamedTuple):
    """Byte offsets of one rank's buffer regions and the rows each block holds."""

    ranks: int
    cap: int  # rows per source-rank block
    row_bytes: int  # dispatched row: x (bf16 or FP8)
    hidden: int
    topk: int
    scale_cols: int
    counts: int
    rows: int
    idx: int
    weights: int
    scales: int
    combine_rows: int  # bf16 / fp16 rows of ``hidden``
    combine_weights: int
    nbytes: int

    def dispatch_words(self) -> tuple[int, int, int, int, int, int]:
        """The dispatch kernels' int32-word sizes and offsets: row, rows, idx, weights, scales, counts."""
        return tuple(
            n // 4 for n in (self.row_bytes, self.rows, self.idx, self.weights, self.scales, self.counts)
        )


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _regions(ranks: int, cap: int, row_bytes: int, hidden: int, topk: int, scale_cols: int) -> PeerLayout:
    sizes = [
        ranks * 4,
        ranks * cap * row_bytes,
        ranks * cap * topk * 4,
        ranks * cap * topk * 4,
        ranks * cap * scale_cols * 4,
        ranks * cap * hidden * 2,
        ranks * cap * topk * 4,
    ]
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += _aligned(size)
    return PeerLayout(ranks, cap, row_bytes, hidden, topk, scale_cols, *offsets, at)


def peer_layout(
    nbytes: int, ranks: int, row_bytes: int, hidden: int, topk: int, scale_cols: int
) -> PeerLayout:
    """The largest layout of these rows that fits a buffer of ``nbytes`` (the same on every rank)."""
    per_row = row_bytes + topk * 12 + scale_cols * 4 + hidden * 2
    cap = max(0, (nbytes - 8 * _ALIGN) // (ranks * per_row))
    while cap and _regions(ranks, cap, row_bytes, hidden, topk, scale_cols).nbytes > nbytes:
        cap -= 1
    return _regions(ranks, cap, row_bytes, hidden, topk, scale_cols)


@triton.jit
def _peer(table_ptr, rank):
    """Rank ``rank``'s buffer as 32-bit words."""
    return tl.load(table_ptr + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def _copy_words(dst_ptr, src_ptr, words, BLOCK: tl.constexpr):
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < words), mask=offs < words)


@cached_launch
@triton.jit
def _dispatch_push_kernel(
    x_ptr, idx_ptr, w_ptr, s_ptr, slot_ptr, sent_ptr, table_ptr, me, T, local_experts, cap, row_words,
    rows_off, idx_off, w_off, s_off, counts_off, K, S,
    R: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr, BLOCK: tl.constexpr, K_P2: tl.constexpr,
    S_P2: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    if t == T:  # one program writes this rank's row count into every destination's slot
        for d in tl.static_range(R):
            tl.store(_peer(table_ptr, d) + counts_off + me, tl.load(sent_ptr + d))
    else:
        ks = tl.arange(0, K_P2)
        experts = tl.load(idx_ptr + t.to(tl.int64) * K + ks, mask=ks < K, other=-1).to(tl.int32)
        if HAS_W:
            weights = tl.load(w_ptr + t.to(tl.int64) * K + ks, mask=ks < K, other=0.0)
        for d in tl.static_range(R):
            slot = tl.load(slot_ptr + t.to(tl.int64) * R + d)
            if slot >= 0:
                base = _peer(table_ptr, d)
                row = (me * cap + slot).to(tl.int64)
                _copy_words(
                    base + rows_off + row * row_words, x_ptr + t.to(tl.int64) * row_words, row_words, BLOCK
                )
                mine = (experts >= d * local_experts) & (experts < (d + 1) * local_experts)
                local = tl.where(mine, experts - d * local_experts, -1)
                tl.store(base + idx_off + row * K + ks, local, mask=ks < K)
                if HAS_W:
                    kept = tl.where(mine, weights, 0.0).to(tl.int32, bitcast=True)
                    tl.store(base + w_off + row * K + ks, kept, mask=ks < K)
                if HAS_S:
                    cols = tl.arange(0, S_P2)
                    scales = tl.load(s_ptr + t.to(tl.int64) * S + cols, mask=cols < S)
                    tl.store(base + s_off + row * S + cols, scales.to(tl.int32, bitcast=True), mask=cols < S)


@cached_launch
@triton.jit
def _dispatch_receive_kernel(
    buf_ptr, x_ptr, idx_ptr, w_ptr, s_ptr, src_rank_ptr, src_pos_ptr, R, cap, row_words,
    rows_off, idx_off, w_off, s_off, counts_off, K, S,
    R_P2: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr, BLOCK: tl.constexpr,
    K_P2: tl.constexpr, S_P2: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    ranks = tl.arange(0, R_P2)
    counts = tl.load(buf_ptr + counts_off + ranks, mask=ranks < R, other=0)
    ends = tl.cumsum(counts, axis=0)
    source = tl.sum((ends <= r).to(tl.int32), axis=0)
    total = tl.sum(counts, axis=0)
    valid = r < total
    position = r - tl.sum(tl.where(ranks == source, ends - counts, 0), axis=0)
    row = (source * cap + position).to(tl.int64)
    out = r.to(tl.int64)
    for start in range(0, row_words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < row_words
        # vector masks: the interpreter rejects a scalar condition broadcast into one
        words = tl.load(
            buf_ptr + rows_off + row * row_words + offs, mask=ok & (offs * 0 + r < total), other=0
        )
        tl.store(x_ptr + out * row_words + offs, words, mask=ok)
    ks = tl.arange(0, K_P2)
    k_ok = (ks < K) & (ks * 0 + r < total)
    experts = tl.load(buf_ptr + idx_off + row * K + ks, mask=k_ok, other=-1)
    tl.store(idx_ptr + out * K + ks, experts.to(tl.int64), mask=ks < K)
    if HAS_W:
        weights = tl.load(buf_ptr + w_off + row * K + ks, mask=k_ok, other=0)
        tl.store(w_ptr + out * K + ks, weights.to(tl.float32, bitcast=True), mask=ks < K)
    if HAS_S:
        cols = tl.arange(0, S_P2)
        scales = tl.load(buf_ptr + s_off + row * S + cols, mask=(cols < S) & (cols * 0 + r < total), other=0)
        tl.store(s_ptr + out * S + cols, scales.to(tl.float32, bitcast=True), mask=cols < S)
    tl.store(src_rank_ptr + r, tl.where(valid, source, -1))
    tl.store(src_pos_ptr + r, tl.where(valid, position, -1))


@cached_launch
@triton.jit
def _combine_push_kernel(
    y_ptr, w_ptr, src_rank_ptr, src_pos_ptr, table_ptr, me, cap, row_words, rows_off, w_off, K,
    HAS_Y: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    source = tl.load(src_rank_ptr + r)
    if source >= 0:
        base = _peer(table_ptr, source)
        row = (me * cap + tl.load(src_pos_ptr + r)).to(tl.int64)
        if HAS_Y:
            _copy_words(
                base + rows_off + row * row_words, y_ptr + r.to(tl.int64) * row_words, row_words, BLOCK
            )
        if HAS_W:
            ks = tl.arange(0, K_P2)
            weights = tl.load(w_ptr + r.to(tl.int64) * K + ks, mask=ks < K, other=0.0)
            tl.store(base + w_off + row * K + ks, weights.to(tl.int32, bitcast=True), mask=ks < K)


@cached_launch
@triton.jit
def _combine_reduce_kernel(
    buf_ptr, wbuf_ptr, slot_ptr, out_ptr, w_out_ptr, cap, H, rows_off, w_off, K,
    R: tl.constexpr, HAS_Y: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    cols_block = tl.program_id(1)
    cols = cols_block * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ks = tl.arange(0, K_P2)
    w_acc = tl.zeros([K_P2], dtype=tl.float32)
    for d in tl.static_range(R):
        slot = tl.load(slot_ptr + t.to(tl.int64) * R + d)
        if slot >= 0:
            row = (d * cap + slot).to(tl.int64)
            if HAS_Y:
                acc += tl.load(buf_ptr + rows_off + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
            if HAS_W:
                w_acc += tl.load(wbuf_ptr + w_off + row * K + ks, mask=ks < K, other=0.0)
    if HAS_Y:
        tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)
    if HAS_W:
        if cols_block == 0:
            tl.store(w_out_ptr + t.to(tl.int64) * K + ks, w_acc, mask=ks < K)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's rows as 32-bit words."""
    t = t.contiguous()
    return t.view(torch.uint8).view(t.shape[0], -1).view(torch.int32)


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def dispatch_push_triton(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    weights: torch.Tensor | None,
    scales: torch.Tensor | None,
    slot: torch.Tensor,
    sent: torch.Tensor,
    table: torch.Tensor,
    me: int,
    layout: PeerLayout,
    local_experts: int,
) -> None:
    """Rank ``me``'s token rows [T, row_bytes] into the peers' dispatch blocks (see the module docstring);
    ``slot`` [T, R] int32 is each token's row in each destination's block (-1: not sent), ``sent`` [R]
    int32 the rows per destination, ``table`` int64 [R] the peers' buffer addresses."""
    tokens, k = topk_idx.shape
    s = scales.shape[1] if scales is not None else 0
    _dispatch_push_kernel[(tokens + 1,)](
        _words(x), topk_idx.contiguous(), weights.contiguous() if weights is not None else topk_idx,
        scales.contiguous() if scales is not None else topk_idx, slot.contiguous(), sent, table, me, tokens,
        local_experts, layout.cap, *layout.dispatch_words(), k, s, R=layout.ranks,
        HAS_W=weights is not None, HAS_S=scales is not None, BLOCK=_BLOCK_WORDS, K_P2=_p2(k), S_P2=_p2(s),
    )  # fmt: skip


def dispatch_receive_triton(
    buffer: torch.Tensor, layout: PeerLayout, rows: int, with_weights: bool, with_scales: bool
) -> tuple[torch.Tensor, ...]:
    """(rows [rows, row_bytes] uint8, local top-k int64 [rows, K], weights fp32 or None, scales fp32 or
    None, source rank int32, source position int32) from this rank's ``buffer`` (uint8); rows past the
    received ones are zeros with top-k -1 and source -1."""
    device = buffer.device
    words = buffer.view(torch.int32)
    x = torch.empty((rows, layout.row_bytes // 4), dtype=torch.int32, device=device)
    idx = torch.empty((rows, layout.topk), dtype=torch.int64, device=device)
    w = torch.empty((rows, layout.topk), dtype=torch.float32, device=device) if with_weights else None
    s = torch.empty((rows, layout.scale_cols), dtype=torch.float32, device=device) if with_scales else None
    src_rank = torch.empty(rows, dtype=torch.int32, device=device)
    src_pos = torch.empty(rows, dtype=torch.int32, device=device)
    if rows:
        _dispatch_receive_kernel[(rows,)](
            words, x, idx, w if w is not None else idx, s if s is not None else idx, src_rank, src_pos,
            layout.ranks, layout.cap, *layout.dispatch_words(), layout.topk, layout.scale_cols,
            R_P2=_p2(layout.ranks), HAS_W=with_weights, HAS_S=with_scales, BLOCK=_BLOCK_WORDS,
            K_P2=_p2(layout.topk), S_P2=_p2(layout.scale_cols),
        )  # fmt: skip
    return x.view(torch.uint8), idx, w, s, src_rank, src_pos


def combine_push_triton(
    y: torch.Tensor | None,
    weights: torch.Tensor | None,
    src_rank: torch.Tensor,
    src_pos: torch.Tensor,
    table: torch.Tensor,
    me: int,
    layout: PeerLayout,
) -> None:
    """Received rows ``y`` [N, H] (16-bit) and/or their fp32 top-k ``weights`` [N, K] back into their
    source ranks' combine blocks."""
    rows = src_rank.shape[0]
    if rows:
        _combine_push_kernel[(rows,)](
            _words(y) if y is not None else src_rank,
            weights.contiguous() if weights is not None else src_rank, src_rank, src_pos, table, me,
            layout.cap, layout.hidden // 2, layout.combine_rows // 4, layout.combine_weights // 4,
            layout.topk, HAS_Y=y is not None, HAS_W=weights is not None, BLOCK=_BLOCK_WORDS,
            K_P2=_p2(layout.topk),
        )  # fmt: skip


def combine_reduce_triton(
    buffer: torch.Tensor,
    slot: torch.Tensor,
    layout: PeerLayout,
    dtype: torch.dtype | None,
    with_weights: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """([T, H] in ``dtype`` or None without a ``dtype``, fp32 [T, K] or None): each token's rows (and top-k
    weights) from this rank's ``buffer`` (uint8) combine blocks, summed in fp32 in rank order."""
    tokens = slot.shape[0]
    device = buffer.device
    out = torch.empty((tokens, layout.hidden), dtype=dtype, device=device) if dtype is not None else None
    w = torch.empty((tokens, layout.topk), dtype=torch.float32, device=device) if with_weights else None
    if tokens:
        block = min(_BLOCK_WORDS, _p2(layout.hidden)) if out is not None else 16
        grid = (tokens, triton.cdiv(layout.hidden, block) if out is not None else 1)
        rows = buffer.view(dtype if dtype is not None else torch.bfloat16)
        _combine_reduce_kernel[grid](
            rows, buffer.view(torch.float32), slot.contiguous(), out if out is not None else w,
            w if w is not None else out, layout.cap, layout.hidden, layout.combine_rows // 2,
            layout.combine_weights // 4, layout.topk, R=layout.ranks, HAS_Y=out is not None,
            HAS_W=with_weights, BLOCK=block, K_P2=_p2(layout.topk),
        )  # fmt: skip
    return out, w
