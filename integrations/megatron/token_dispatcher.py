"""``TurboFlexTokenDispatcher``: Megatron's flex token-dispatcher slot over ``primus_turbo.pytorch.deep_ep``.

It keeps Megatron's six-step dispatcher contract and, like Megatron's flex dispatcher, talks over one
group spanning the expert-tensor-parallel and expert-parallel ranks: each token goes to every TP rank of
the expert's EP rank, and the combine sums the TP ranks' partial expert outputs back into the token.
Token counts stay on the GPU; with ``turbo_num_worst_tokens`` the receive buffers have a fixed size and
nothing waits for the host. On one rank there is nothing to move: the tokens are only permuted.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from primus_turbo.pytorch.modules import DeepEPTokenDispatcher
from primus_turbo.pytorch.ops.moe import moe_permute, moe_unpermute

__all__ = ["TurboFlexTokenDispatcher"]


def _graph_captures_dispatch(config: Any) -> bool:
    """Whether megatron-core's CUDA graphs (``config.cuda_graph_impl`` / ``cuda_graph_modules``) take
    the token dispatch into a graph: a whole-iteration graph, a whole-layer one, or the 'moe' scope."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "full_iteration":
        return True
    if impl not in ("local", "transformer_engine"):
        return False
    # megatron-core < 0.19 names the field cuda_graph_scope
    scope = getattr(config, "cuda_graph_modules", None) or getattr(config, "cuda_graph_scope", None) or []
    modules = [getattr(m, "name", m) for m in ([scope] if isinstance(scope, str) else scope)]
    return not modules or bool({"moe", "full", "full_iteration"} & set(modules))


class TurboFlexTokenDispatcher(MoETokenDispatcher):
    """``MoEFlexTokenDispatcher(num_local_experts, local_expert_indices, config, pg_collection)``.

    ``num_worst_tokens`` (class attribute, set by ``apply_primus_turbo_to_megatron``) fixes the receive
    size for sync-free dispatch.
    """

    num_worst_tokens = 0

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError("the Turbo dispatcher does not pad expert input to capacity")
        self.num_local_experts, self.local_expert_indices = num_local_experts, local_expert_indices
        world = self.tp_size * self.ep_size
        if world > 1 and not self.num_worst_tokens and _graph_captures_dispatch(config):
            raise ValueError(
                f"cuda_graph_impl={config.cuda_graph_impl!r} (whole iteration, whole layer or the 'moe' "
                f"module) captures the token dispatch, which over "
                f"{world} ranks sizes its receive buffers on the host; set --turbo-num-worst-tokens "
                "(turbo_num_worst_tokens) for a sync-free dispatch, or capture only 'attn' / 'moe_router' / "
                "'moe_preprocess'"
            )
        # state that crosses the end of a 'moe_preprocess' graph: returned by the graph and set again on
        # each replay (megatron-core's contract for dispatchers)
        self.cudagraph_attrs = ["_routing_map"]
        self._dispatcher = None
        if world > 1:
            self._dispatcher = DeepEPTokenDispatcher(
                num_experts=world * num_local_experts,
                router_topk=self.tp_size * config.moe_router_topk,
                ep_group=self.tp_ep_group,
                num_worst_tokens=self.num_worst_tokens,
            )
        self.hidden_shape: torch.Size | None = None
        self._row_id_map: torch.Tensor | None = None

    def set_shared_experts(self, shared_experts: Any) -> None:
        raise ValueError("the Turbo dispatcher cannot overlap shared experts (moe_shared_expert_overlap)")

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, EP * TP * local]: the same experts repeated for each TP rank of their EP rank."""
        tokens = t.shape[0]
        t = t.reshape(tokens, self.ep_size, 1, self.num_local_experts)
        return t.expand(-1, -1, self.tp_size, -1).reshape(tokens, -1)

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        self._routing_map = self._expand(routing_map)
        return hidden_states.reshape(-1, hidden_states.shape[-1]), self._expand(probs)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, *args: Any, **kwargs: Any):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Dispatch and permute in one step: -> (expert input, tokens per local expert, row probs)."""
        routing_map, self._routing_map = self._routing_map, None
        if self._dispatcher is not None:
            return self._dispatcher.token_dispatch(hidden_states, probs, routing_map)
        # one rank: nothing to move; top-k routes per token bound the rows, so nothing waits for the host
        rows = hidden_states.shape[0] * self.config.moe_router_topk
        permuted, self._row_id_map, tokens_per_expert, permuted_probs, _ = moe_permute(
            hidden_states,
            routing_map,
            probs,
            num_local_experts=self.num_local_experts,
            num_permuted_tokens=rows,
        )
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._dispatcher is not None:
            return self._dispatcher.token_combine(hidden_states)
        row_id_map, self._row_id_map = self._row_id_map, None
        return moe_unpermute(hidden_states, row_id_map)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)
