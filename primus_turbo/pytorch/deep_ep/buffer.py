"""A DeepEP-compatible ``Buffer`` for expert-parallel dispatch and combine.

The calls and results follow DeepEP v1's ``deep_ep.Buffer`` (what Megatron's flex dispatcher uses):
``get_dispatch_layout`` finds which ranks each token must reach; ``dispatch`` sends every token once to
each such rank, with its top-k expert indices made local (-1 for experts elsewhere, weight 0); ``combine``
sends rows back and sums each token's copies at its source. This backend (``BackendType.TORCH``) moves
the rows with ``torch.distributed.all_to_all_single``, so it runs on NCCL and on gloo (CPU). It has two
paths:

- ``num_worst_tokens == 0``: counts are exchanged and read on the host (as DeepEP v1 does), and
  ``num_recv_tokens_per_expert_list`` is a host list;
- ``num_worst_tokens > 0``: every rank pair exchanges a fixed block of ``T`` rows, received rows are
  compacted on the device into ``num_worst_tokens`` rows (padding rows have top-k indices -1), and nothing
  syncs with the host, so the call can be captured in a CUDA graph. The list is then empty. Every rank
  must pass the same token count ``T`` (as sequence-parallel MoE layers do); received rows past
  ``num_worst_tokens`` are dropped.

``topk_idx`` values are checked where they are on the host (or with ``PRIMUS_TURBO_DEBUG_CHECKS=1``),
with one small all-reduce so that a bad value on one rank raises on all of them.

With the ``TURBO`` backend selected (CUDA, one host), rows are written straight into the peers' buffers
(torch symmetric memory, ``peer.py``): a barrier, the push, a barrier, this rank's own buffer compacted;
combine the same way back. The buffer (``num_nvl_bytes``, or ``Config.get_nvl_buffer_size_hint``'s size
when 0) is allocated at the first dispatch, a collective; every rank's token count must fit it.

With the ``DEEP_EP`` backend selected, ``Buffer(...)`` returns the external package's own
``deep_ep.Buffer`` built from the same arguments (an error names the missing package where it does not
import), and ``buffer_size_hints`` asks that package's configs for the staging sizes.

The per-rank sums of ``combine`` run rank by rank in a fixed order, so results are deterministic.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from primus_turbo.common.constants import ENV_DEBUG_CHECKS
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
from primus_turbo.pytorch.deep_ep.peer import (
    PeerHandle,
    SymmetricPeers,
    combine_push,
    combine_reduce,
    dispatch_push,
    dispatch_receive,
    peer_buffer_bytes,
)
from primus_turbo.pytorch.kernels.moe.permute_impl import take_rows

__all__ = ["Buffer", "Config", "EventOverlap", "Handle", "buffer_size_hints"]


class Config:
    """DeepEP's performance config. The all-to-all backend keeps the values for API compatibility and needs
    no staging buffer (size hints 0); the TURBO backend's hint is its peer buffer (``peer_buffer_bytes``)."""

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer needed: the TURBO backend's peer buffer, none for the all-to-all one."""
        return peer_buffer_bytes(hidden_bytes, num_ranks) if _selected_backend() is BackendType.TURBO else 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA staging buffer needed: none for the all-to-all backend."""
        return 0


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()`` (or leaving a ``with`` block) makes the current
    stream wait for the communication; a no-op when the call already ran on the current stream."""

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait()


@dataclass(frozen=True)
class Handle:
    """What ``combine`` needs to send rows back: the order tokens left in, per-rank counts both ways and,
    on the fixed-size path, where each received row came from."""

    send_order: torch.Tensor  # source token of each sent row, grouped by destination rank
    send_counts: torch.Tensor  # int64 [R] rows sent to each rank
    recv_counts: torch.Tensor  # int64 [R] rows received from each rank
    num_tokens: int
    recv_slots: torch.Tensor | None  # fixed-size path: the [R * T] block slot of each received row


def _event(async_finish: bool, device: torch.device) -> EventOverlap:
    if async_finish and device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)
    return EventOverlap()


def _selected_backend() -> BackendType:
    choice = GlobalBackendManager.get_moe_dispatch_combine_backend(PrecisionType.BF16_FP16_FP32)
    return choice.backend if choice is not None and choice.backend is not None else BackendType.TORCH


def _deep_ep():
    """The external ``deep_ep`` package, or a ValueError that names it."""
    try:
        import deep_ep
    except ImportError as exc:
        raise ValueError(
            "MoE dispatch/combine backend DEEP_EP needs the deep_ep package (DeepEP), which does not "
            f"import here: {exc}"
        ) from exc
    return deep_ep


def buffer_size_hints(group_size: int, hidden_bytes: int) -> tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` a buffer for ``hidden_bytes`` per token needs under the
    selected backend: the larger of its dispatch and combine configs' hints (0 for the all-to-all one)."""
    impl = _deep_ep().Buffer if _selected_backend() is BackendType.DEEP_EP else Buffer
    configs = (impl.get_dispatch_config(group_size), impl.get_combine_config(group_size))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, group_size) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, group_size) for c in configs)
    return nvl, rdma


class Buffer:
    """Expert-parallel communication over ``group`` with DeepEP v1's calls (see the module docstring).

    ``num_nvl_bytes`` sizes the TURBO backend's peer buffer; ``num_rdma_bytes`` / ``low_latency_mode`` are
    accepted for compatibility; the all-to-all backend allocates nothing. The backend comes from
    ``PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND`` or ``GlobalBackendManager``: TORCH or TURBO (built here),
    or DEEP_EP, for which the constructor returns a ``deep_ep.Buffer``.
    """

    num_sms: int = 20

    def __new__(cls, group: dist.ProcessGroup, *args: object, **kwargs: object):
        if _selected_backend() is BackendType.DEEP_EP:
            return _deep_ep().Buffer(group, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
    ) -> None:
        if low_latency_mode:
            raise ValueError("low-latency mode is not implemented; use the normal dispatch/combine")
        backend = _selected_backend()
        if backend not in (BackendType.TORCH, BackendType.TURBO):
            raise ValueError(
                f"MoE dispatch/combine backend {backend.name} is not available in this build; TORCH "
                "(all-to-all over torch.distributed), TURBO (peer memory) and DEEP_EP (the deep_ep "
                "package) are"
            )
        self.backend = backend
        self._peers: SymmetricPeers | None = None
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs the communication kernels may use (kept for DeepEP compatibility)."""
        if new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"num_sms must be a positive even number, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    def destroy(self) -> None:
        """Release the buffer (nothing is held by the all-to-all backend)."""

    def _check_topk(self, topk_idx: torch.Tensor, num_experts: int) -> None:
        if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"topk_idx must be int32/int64 [tokens, topk], got {topk_idx.dtype} {tuple(topk_idx.shape)}"
            )
        if num_experts % self.group_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of the group size ({self.group_size})"
            )
        # the values: where they are on the host, or when asked. Every rank learns whether any rank's are
        # bad, so all raise together instead of some waiting in the next collective.
        if topk_idx.device.type != "cpu" and os.environ.get(ENV_DEBUG_CHECKS, "0") != "1":
            return
        bad = bool(((topk_idx < -1) | (topk_idx >= num_experts)).any())
        flag = torch.tensor([int(bad)], dtype=torch.int32, device=topk_idx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()):
            mine = f"{topk_idx.min()}..{topk_idx.max()}" if topk_idx.numel() else "none"
            raise ValueError(
                f"topk_idx values must lie in [-1, {num_experts}) on every rank; this rank's: {mine}"
            )

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:
        """(num_tokens_per_rank int32 [R], None, num_tokens_per_expert int32 [E], is_token_in_rank bool
        [T, R], event) for ``topk_idx`` [T, topk] (-1: dropped)."""
        self._check_topk(topk_idx, num_experts)
        local = num_experts // self.group_size
        valid = topk_idx >= 0
        dest_rank = torch.where(valid, topk_idx // local, self.group_size).long()
        in_rank = torch.zeros(
            topk_idx.shape[0], self.group_size + 1, dtype=torch.bool, device=topk_idx.device
        )
        in_rank = in_rank.scatter_(1, dest_rank, True)[:, : self.group_size]
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
        per_expert.scatter_add_(
            0, torch.where(valid, topk_idx, num_experts).long().flatten(), valid.int().flatten()
        )
        per_rank = in_rank.sum(0, dtype=torch.int32)
        return per_rank, None, per_expert[:num_experts], in_rank, _event(async_finish, topk_idx.device)

    # ------------------------------------------------------------------ dispatch / combine

    def _exchange(self, rows: torch.Tensor, send: list[int] | None, recv: list[int] | None) -> torch.Tensor:
        """all_to_all_single of ``rows`` [N, ...] as raw bytes (any dtype, NCCL or gloo); equal blocks when
        the split lists are None."""
        flat = rows.contiguous().view(rows.shape[0], math.prod(rows.shape[1:]))
        as_bytes = flat.view(torch.uint8)
        total = sum(recv) if recv is not None else rows.shape[0]
        out = as_bytes.new_empty((total, as_bytes.shape[1]))
        dist.all_to_all_single(out, as_bytes, recv, send, group=self.group)
        return out.view(rows.dtype).view(total, *rows.shape[1:])

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: Handle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send each token [T, H] (or ``(x_fp8, scales)``) once to every rank ``is_token_in_rank`` names.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)``: received rows grouped by source rank (in source token order), their top-k indices made
        local to this rank (-1 elsewhere; weight 0 there) and, on the host-sync path, the received count
        per local expert rounded up to ``expert_alignment``. With ``handle`` (a previous dispatch's) the
        same layout is reused and only rows move (the backward of ``combine``).
        """
        x, scales = x if isinstance(x, tuple) else (x, None)
        if self.backend is BackendType.TURBO:
            return self._dispatch_peer(
                x, scales, handle, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                expert_alignment, num_worst_tokens, async_finish,
            )  # fmt: skip
        if handle is not None:
            recv_x = self._send(x, handle)
            recv_scales = self._send(scales, handle) if scales is not None else None
            out = (recv_x, recv_scales) if scales is not None else recv_x
            return out, None, None, [], handle, _event(async_finish, x.device)
        if topk_idx is None or is_token_in_rank is None:
            raise ValueError(
                "dispatch needs topk_idx and is_token_in_rank (from get_dispatch_layout) or a handle"
            )
        if is_token_in_rank.shape != (x.shape[0], self.group_size):
            shape = tuple(is_token_in_rank.shape)
            raise ValueError(f"is_token_in_rank must be [{x.shape[0]}, {self.group_size}], got {shape}")
        if topk_weights is not None and topk_weights.dtype != torch.float32:
            raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
        handle = self._layout(is_token_in_rank, num_worst_tokens)
        recv_x = self._send(x, handle)
        recv_scales = self._send(scales, handle) if scales is not None else None
        recv_idx = self._send(topk_idx.long(), handle, fill=-1)
        experts = num_tokens_per_expert.numel() if num_tokens_per_expert is not None else None
        local = experts // self.group_size if experts is not None else None
        if local is None:
            raise ValueError("dispatch needs num_tokens_per_expert (from get_dispatch_layout)")
        mine = (recv_idx >= 0) & (recv_idx // local == self.rank)
        recv_topk_idx = torch.where(mine, recv_idx - self.rank * local, -1)
        recv_topk_weights = None
        if topk_weights is not None:
            recv_topk_weights = torch.where(mine, self._send(topk_weights, handle), 0.0)
        counts: list[int] = []
        if num_worst_tokens <= 0:
            per_expert = torch.bincount(recv_topk_idx[mine], minlength=local)
            align = max(1, expert_alignment)
            counts = ((per_expert + align - 1) // align * align).tolist()
        out = (recv_x, recv_scales) if scales is not None else recv_x
        return out, recv_topk_idx, recv_topk_weights, counts, handle, _event(async_finish, x.device)

    def combine(
        self,
        x: torch.Tensor,
        handle: Handle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Send received rows back and sum each token's copies at its source (fp32, rank by rank):
        ``(combined_x [T, H], combined_topk_weights, event)``. ``bias`` (one tensor or two) is added."""
        if isinstance(handle, PeerHandle):
            combined, weights = self._combine_peer(x, handle, topk_weights)
        else:
            combined = self._return(x, handle)
            weights = self._return(topk_weights, handle) if topk_weights is not None else None
        if bias is not None:
            for b in bias if isinstance(bias, tuple) else (bias,):
                combined = combined + b
        return combined, weights, _event(async_finish, x.device)

    def _dispatch_peer(
        self, x, scales, handle, in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
        num_worst_tokens, async_finish,
    ):  # fmt: skip
        """The TURBO path: rows written into the peers' symmetric buffers (``peer.py``)."""
        if x.device.type != "cuda":
            raise ValueError("the TURBO dispatch backend needs CUDA tensors on an intranode group")
        if handle is None:
            if topk_idx is None or in_rank is None or num_tokens_per_expert is None:
                raise ValueError(
                    "dispatch needs topk_idx, is_token_in_rank and num_tokens_per_expert (from "
                    "get_dispatch_layout) or a handle"
                )
            if topk_weights is not None and topk_weights.dtype != torch.float32:
                raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
            experts = num_tokens_per_expert.numel()
        else:
            topk_idx = torch.full((x.shape[0], handle.layout.topk), -1, dtype=torch.int64, device=x.device)
            experts = handle.local_experts * self.group_size
        if self._peers is None:  # a collective: every rank dispatches
            nbytes = self.num_nvl_bytes or peer_buffer_bytes(x.shape[1] * 2, self.group_size)
            self._peers = SymmetricPeers(self.group, nbytes, x.device)
        peers = self._peers
        peers.barrier()
        slot, sent, layout = dispatch_push(
            peers, x, topk_idx, topk_weights if handle is None else None, scales, in_rank, experts, handle
        )
        peers.barrier()
        rows = handle.src_rank.numel() if handle is not None else (num_worst_tokens or -1)
        recv_x, recv_idx, recv_w, recv_s, src_rank, src_pos = dispatch_receive(
            peers, layout, rows, x.dtype, x.shape[1], topk_weights is not None and handle is None,
            scales is not None,
        )  # fmt: skip
        out = (recv_x, recv_s) if scales is not None else recv_x
        if handle is not None:
            return out, None, None, [], handle, _event(async_finish, x.device)
        local = experts // self.group_size
        handle = PeerHandle(slot, sent, src_rank, src_pos, layout, local)
        counts: list[int] = []
        if num_worst_tokens <= 0:
            per_expert = torch.bincount(recv_idx[recv_idx >= 0], minlength=local)
            align = max(1, expert_alignment)
            counts = ((per_expert + align - 1) // align * align).tolist()
        return out, recv_idx, recv_w, counts, handle, _event(async_finish, x.device)

    def _combine_peer(
        self, x: torch.Tensor, handle: PeerHandle, topk_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The TURBO path of ``combine``: ``(combined, combined weights)``. fp32 rows as wide as the top-k
        (the gradient of dispatched weights) travel in the weights' slots."""
        peers = self._peers
        as_weights = x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == handle.layout.topk
        peers.barrier()
        if as_weights:
            combine_push(peers, None, x, handle)
        else:
            combine_push(peers, x, topk_weights, handle)
        peers.barrier()
        if as_weights:
            return combine_reduce(peers, handle, None, True)[1], None
        return combine_reduce(peers, handle, x.dtype, topk_weights is not None)

    def _layout(self, in_rank: torch.Tensor, num_worst_tokens: int) -> Handle:
        """Where each token goes: the send order, counts both ways and (fixed-size path) the compaction."""
        tokens, ranks = in_rank.shape
        position = in_rank.to(torch.int64).cumsum(0) - 1  # [T, R]: the token's row within its block
        token_ids = torch.arange(tokens, device=in_rank.device)[:, None].expand(tokens, ranks)
        if num_worst_tokens > 0:
            slot = torch.where(
                in_rank, torch.arange(ranks, device=in_rank.device) * tokens + position, ranks * tokens
            )
            send_order = torch.full((ranks * tokens + 1,), -1, dtype=torch.int64, device=in_rank.device)
            send_order = send_order.scatter_(0, slot.flatten(), token_ids.flatten())[:-1]
            sent = self._exchange((send_order >= 0).to(torch.uint8)[:, None], None, None)[:, 0].bool()
            row = sent.to(torch.int64).cumsum(0) - 1
            keep = sent & (row < num_worst_tokens)
            recv_slots = torch.full((num_worst_tokens + 1,), -1, dtype=torch.int64, device=in_rank.device)
            ids = torch.arange(ranks * tokens, device=in_rank.device)
            recv_slots = recv_slots.scatter_(0, torch.where(keep, row, num_worst_tokens), ids)[:-1]
            blocks = torch.full((ranks,), tokens, dtype=torch.int64)
            return Handle(send_order, blocks, blocks, tokens, recv_slots)
        send_counts = in_rank.sum(0)
        send_order = in_rank.t().nonzero()[:, 1]
        recv_counts = self._exchange(send_counts[:, None], [1] * ranks, [1] * ranks)[:, 0]
        return Handle(send_order, send_counts.cpu(), recv_counts.cpu(), tokens, None)

    def _send(self, rows: torch.Tensor, handle: Handle, fill: float = 0) -> torch.Tensor:
        """Rows of a [T, ...] tensor to the ranks the handle names, as received here."""
        sent = take_rows(rows, handle.send_order, fill)
        if handle.recv_slots is None:
            return self._exchange(sent, handle.send_counts.tolist(), handle.recv_counts.tolist())
        return take_rows(self._exchange(sent, None, None), handle.recv_slots, fill)

    def _return(self, rows: torch.Tensor, handle: Handle) -> torch.Tensor:
        """Received-layout rows back to their sources, summed per token in fp32 in rank order."""
        if handle.recv_slots is None:
            back = self._exchange(rows, handle.recv_counts.tolist(), handle.send_counts.tolist())
        else:
            slots = handle.send_order.numel()
            block = torch.zeros((slots + 1, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
            block[torch.where(handle.recv_slots >= 0, handle.recv_slots, slots)] = rows  # padding: spare row
            back = self._exchange(block[:slots], None, None)
        out = torch.zeros((handle.num_tokens, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
        sources = handle.send_order
        valid = (sources >= 0).view(-1, *([1] * (rows.dim() - 1)))
        bounds = [0, *handle.send_counts.cumsum(0).tolist()]  # counts live on the host
        for begin, end in zip(bounds[:-1], bounds[1:], strict=True):  # each rank block holds a token once
            out.index_add_(0, sources[begin:end].clamp(min=0), back[begin:end].float() * valid[begin:end])
        return out.to(rows.dtype)
