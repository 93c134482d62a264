"""Expert-parallel dispatch and combine with autograd: ``moe_dispatch`` / ``moe_combine``.

Dispatch's backward is a combine of the gradients and combine's backward a dispatch, both over the
handle the forward dispatch returned, on one ``deep_ep.Buffer`` per process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primus_turbo.pytorch.deep_ep import Buffer, Handle
from primus_turbo.pytorch.deep_ep.buffer import buffer_size_hints

__all__ = ["moe_combine", "moe_dispatch"]

# per group: the buffer and the bytes per token it was sized for
_BUFFERS: dict[dist.ProcessGroup, tuple[Buffer, int]] = {}


def _buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Buffer:
    """The group's buffer, rebuilt (with the selected backend's staging sizes) only when rows of more
    than the ``hidden_bytes`` it was sized for arrive."""
    buffer, sized_for = _BUFFERS.get(group, (None, -1))
    if buffer is None or hidden_bytes > sized_for:
        nvl, rdma = buffer_size_hints(dist.get_world_size(group), hidden_bytes)
        buffer = Buffer(group, nvl, rdma)
        _BUFFERS[group] = buffer, hidden_bytes
    return buffer


class _DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, num_experts, group, num_worst_tokens):
        buffer = _buffer(group, x.shape[1] * x.element_size())
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            num_worst_tokens=num_worst_tokens,
        )
        local = num_experts // buffer.group_size
        routed = recv_idx >= 0
        tokens_per_expert = torch.zeros(local + 1, dtype=torch.int64, device=x.device)
        tokens_per_expert.scatter_add_(
            0, torch.where(routed, recv_idx, local).flatten(), routed.long().flatten()
        )
        ctx.group, ctx.handle = group, handle
        ctx.save_for_backward(recv_idx)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_weights, tokens_per_expert[:local], handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_idx, grad_recv_weights, _grad_counts, _grad_handle):
        (recv_idx,) = ctx.saved_tensors
        buffer = _buffer(ctx.group, 0)  # the buffer the forward's handle belongs to
        grad_x = buffer.combine(grad_recv_x, ctx.handle)[0] if grad_recv_x is not None else None
        grad_weights = None
        if grad_recv_weights is not None:  # only the slots of this rank's experts carried a weight
            grad_weights = buffer.combine(torch.where(recv_idx >= 0, grad_recv_weights, 0.0), ctx.handle)[0]
        return grad_x, None, grad_weights, None, None, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, group):
        ctx.group, ctx.handle = group, handle
        combined, _, _ = _buffer(group, x.shape[1] * x.element_size()).combine(x, handle)
        return combined

    @staticmethod
    def backward(ctx, grad):
        recv, *_ = _buffer(ctx.group, 0).dispatch(grad.contiguous(), handle=ctx.handle)
        return recv, None, None


def moe_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    num_worst_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Handle]:
    """Send tokens [T, H] to the ranks that host their top-k experts (``num_experts`` split evenly over
    ``group``): ``(recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle)``. Received top-k
    indices are local to this rank (-1 for experts elsewhere, weight 0 there); ``tokens_per_expert``
    (int64, on the device) counts the received routes per local expert. ``num_worst_tokens > 0`` fixes
    the received row count and avoids every host sync (every rank must then pass the same T).
    Differentiable in ``x`` and ``topk_weights`` (fp32)."""
    group = group if group is not None else dist.group.WORLD
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must be float32 shaped like topk_idx {tuple(topk_idx.shape)}")
    return _DispatchFunction.apply(x, topk_idx, topk_weights, num_experts, group, num_worst_tokens)


def moe_combine(x: torch.Tensor, handle: Handle, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send dispatched rows back and sum each token's copies at its source: [T, H]. Differentiable in x."""
    group = group if group is not None else dist.group.WORLD
    return _CombineFunction.apply(x, handle, group)
