"""``DeepEPTokenDispatcher``: expert-parallel token movement for an MoE layer, shaped like Megatron's
flex dispatcher: dispatch -> permute (``token_dispatch``), the experts, unpermute -> combine
(``token_combine``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from primus_turbo.pytorch.ops.moe import moe_combine, moe_dispatch, moe_permute, moe_unpermute

__all__ = ["DeepEPTokenDispatcher"]


class DeepEPTokenDispatcher:
    """Moves tokens to the ranks of ``ep_group`` that own their experts and back.

    ``num_experts`` split evenly over the group; ``router_topk`` routes per token. ``pad_multiple`` pads each
    local expert's rows for the grouped GEMM; ``permute_max_token_num > 0`` and ``num_worst_tokens > 0`` fix
    the permuted and received row counts, so neither step syncs with the host. ``token_dispatch`` returns
    the experts' input, their token counts and each row's routing probability, which the experts apply
    (as Megatron's flex dispatcher expects); ``token_combine`` sums the expert outputs back per token.
    """

    def __init__(
        self,
        num_experts: int,
        router_topk: int,
        ep_group: dist.ProcessGroup | None = None,
        pad_multiple: int = 0,
        permute_max_token_num: int = -1,
        num_worst_tokens: int = 0,
    ) -> None:
        self.group = ep_group if ep_group is not None else dist.group.WORLD
        size = dist.get_world_size(self.group)
        if num_experts % size:
            raise ValueError(
                f"num_experts ({num_experts}) must split evenly over the {size} ranks of ep_group"
            )
        if not 0 < router_topk <= num_experts:
            raise ValueError(f"router_topk must be in [1, {num_experts}], got {router_topk}")
        self.num_experts, self.router_topk = num_experts, router_topk
        self.num_local_experts = num_experts // size
        self.pad_multiple, self.permute_max_token_num = pad_multiple, permute_max_token_num
        self.num_worst_tokens = num_worst_tokens
        self._state: tuple | None = None

    def _topk(
        self, probs: torch.Tensor, routing_map: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 top-k expert indices, fp32 weights) from [T, E] probabilities and their routing map."""
        masked = probs.float() if routing_map is None else probs.float().masked_fill(~routing_map, -1.0)
        weights, indices = masked.topk(self.router_topk, dim=-1)
        if routing_map is not None:
            dropped = weights < 0
            indices, weights = indices.masked_fill(dropped, -1), weights.masked_fill(dropped, 0.0)
        return indices, weights

    def token_dispatch(
        self,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` [..., H] and routing (``probs`` [T, E] with an optional bool ``routing_map``, or
        ``probs`` [T, topk] with ``indices``) -> (expert input [N, H] grouped by local expert,
        tokens_per_expert int64 [local experts], permuted_probs fp32 [N])."""
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        if indices is None:
            indices, weights = self._topk(probs, routing_map)
        else:
            weights = probs.float()
        recv, recv_idx, recv_weights, _, handle = moe_dispatch(
            tokens, indices, weights, self.num_experts, self.group, self.num_worst_tokens
        )
        permuted, row_id_map, tokens_per_expert, permuted_probs, _ = moe_permute(
            recv,
            recv_idx,
            recv_weights,
            num_local_experts=self.num_local_experts,
            pad_multiple=self.pad_multiple,
            num_permuted_tokens=self.permute_max_token_num,
        )
        self._state = (shape, handle, row_id_map)
        return permuted, tokens_per_expert, permuted_probs

    def token_combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Expert outputs [N, H] (probabilities already applied) -> the output, in ``hidden``'s shape."""
        if self._state is None:
            raise RuntimeError("token_combine needs a token_dispatch first")
        shape, handle, row_id_map = self._state
        self._state = None
        merged = moe_unpermute(expert_output, row_id_map)
        return moe_combine(merged, handle, self.group).reshape(shape)
