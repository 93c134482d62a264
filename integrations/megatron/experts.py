"""MoE experts on Turbo grouped GEMM: ``TurboGroupedLinear`` (the TE grouped-linear slots) and
``TurboGroupedMLP`` (the ``TEGroupedMLP`` slot), with token counts kept on the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide, get_pg_rank, get_pg_size
from torch import nn

from primus_turbo.integrations.megatron.config import fp8_quant_config
from primus_turbo.integrations.megatron.fp8_choice import Fp8Choice
from primus_turbo.integrations.megatron.linear import (
    FP8WeightCache,
    _ExtraState,
    init_partitioned_weight,
    param_device,
)
from primus_turbo.pytorch.core.custom_op import apply_function
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.pytorch.modules.grouped_linear import grouped_linear
from primus_turbo.pytorch.ops import (
    QuantizedExperts,
    QuantizedTensor,
    quantize_fp8_experts,
    swiglu_fp8,
    swiglu_with_probs,
)

__all__ = [
    "TurboColumnParallelGroupedLinear",
    "TurboGroupedLinear",
    "TurboGroupedMLP",
    "TurboGroupedMLPWithFusedAct",
    "TurboRowParallelGroupedLinear",
]


def _expert_tp_group(pg_collection: Any) -> torch.distributed.ProcessGroup | None:
    group = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    return group


def _expert_groups(pg_collection: Any) -> tuple[Any, Any]:
    """(expert-parallel group, expert-data-parallel group), from ``pg_collection`` or Megatron's state."""
    ep = getattr(pg_collection, "ep", None) or parallel_state.get_expert_model_parallel_group()
    edp = getattr(pg_collection, "expt_dp", None) or parallel_state.get_expert_data_parallel_group()
    return ep, edp


def _consecutive(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether equal-shape contiguous ``tensors`` fill one storage back to back, in order."""
    first = tensors[0]
    storage, step = first.untyped_storage().data_ptr(), first.numel() * first.element_size()
    start = first.data_ptr()
    return all(
        t.is_contiguous()
        and t.shape == first.shape
        and t.untyped_storage().data_ptr() == storage
        and t.data_ptr() == start + i * step
        for i, t in enumerate(tensors)
    )


def _stack_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[G, ...] view of ``tensors`` that lie back to back in one storage (``_consecutive``), first first."""
    first = tensors[0]
    return first.as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()))


class _ConsecutiveStack(torch.autograd.Function):
    """``torch.stack`` of tensors that already lie back to back in one storage: a view, no copy; the
    gradient of each is its slice of the stacked gradient."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> torch.Tensor:
        return _stack_view(tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grad.unbind(0)


class _StackIntoMainGrad(torch.autograd.Function):
    """The experts' weights stacked (a view where ``consecutive``, else a copy) under Megatron's fused wgrad
    accumulation: the backward adds the stacked gradient into the experts' ``main_grad``s, which DDP's
    buffer holds back to back (``reverse``: from the last expert to the first, as DDP lays parameters
    out), in one kernel instead of one per expert, and hands autograd dummy gradients with
    ``grad_added_to_main_grad`` set, as Megatron's fused kernels do."""

    @staticmethod
    def forward(
        ctx: Any, main_grad: torch.Tensor, reverse: bool, consecutive: bool, *tensors: torch.Tensor
    ) -> torch.Tensor:
        ctx.main_grad, ctx.reverse, ctx.params = main_grad, reverse, tensors
        return _stack_view(tensors) if consecutive else torch.stack(tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.main_grad.add_(grad.flip(0) if ctx.reverse else grad)
        zero = False
        for param in ctx.params:
            param.grad_added_to_main_grad = True
            zero = zero or getattr(param, "zero_out_wgrad", False)
        dummy = (torch.zeros if zero else torch.empty)(grad.shape, dtype=grad.dtype, device=grad.device)
        return None, None, None, *dummy.unbind(0)


def _main_grad_order(grads: list[torch.Tensor | None], params: Sequence[nn.Parameter]) -> bool | None:
    """Whether the experts' ``main_grad``s lie back to back in one buffer from the last expert to the first
    (True) or from the first (False); None when they do not lie back to back (or one is missing)."""
    if any(g is None or g.shape != p.shape for g, p in zip(grads, params, strict=True)):
        return None
    for order, reverse in ((grads, False), (grads[::-1], True)):
        if _consecutive(order):
            return reverse
    return None


class TurboGroupedLinear(_ExtraState, nn.Module):
    """``TEGroupedLinear``'s contract: ``num_gemms`` experts' weights ``weight0..weight{n-1}`` [out, in]
    (TE's names), ``forward(x, m_splits)`` over tokens sorted by expert, ``m_splits`` a device tensor (no
    host sync) or a list. The experts' tensor-parallel split (column: output features, row: input
    features) is sized here; the token dispatcher moves the data. Under FP8 the quantized weights are
    reused across micro-batches (``is_first_microbatch``) until they change. Layers built while
    ``fp8_wgrad`` is False (``--no-turbo-fp8-expert-wgrad``) compute their weight gradients in the
    parameters' dtype."""

    fp8_wgrad: bool = True
    fp8_auto_filter: str | None = None

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config: Any,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = True,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if bias and skip_bias_add:
            raise ValueError("Turbo grouped linear layers add their bias (skip_bias_add=False)")
        self.config, self.num_gemms, self.parallel_mode = config, num_gemms, parallel_mode
        self.is_expert, self.tp_comm_buffer_name = is_expert, tp_comm_buffer_name
        self.quant_config = fp8_quant_config(config)
        self.fp8_wgrad, self.fp8_auto_filter = type(self).fp8_wgrad, type(self).fp8_auto_filter
        self._fp8_choice = Fp8Choice()
        self.is_first_microbatch = True
        self._weight_cache = FP8WeightCache()
        group = _expert_tp_group(pg_collection) if parallel_mode in ("column", "row") else None
        self._tp_group, self._pg_collection = group, pg_collection
        tp_size, rank = get_pg_size(group), get_pg_rank(group)
        self.in_features = divide(input_size, tp_size) if parallel_mode == "row" else input_size
        self.out_features = divide(output_size, tp_size) if parallel_mode == "column" else output_size
        device = param_device(config)
        dim = 1 if parallel_mode == "row" else 0
        expert_parallel = config.expert_model_parallel_size > 1
        # the experts' weights are consecutive slices of one allocation: forward reads them as one
        # [G, out, in] tensor without copying (see ``_stacked``)
        weights = torch.empty(
            num_gemms, self.out_features, self.in_features, device=device, dtype=config.params_dtype
        )
        biases = torch.zeros(num_gemms, self.out_features, device=device, dtype=config.params_dtype)
        for i in range(num_gemms):
            weight = nn.Parameter(weights[i])
            if config.perform_initialization:
                init_partitioned_weight(
                    weight, config, init_method, (output_size, input_size), dim, rank, tp_size, True
                )
            self.register_parameter(f"weight{i}", weight)
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(biases[i]))
        self.use_bias = bias
        names = ("weight", "bias") if bias else ("weight",)
        self._expert_names = {name: [f"{name}{i}" for i in range(num_gemms)] for name in names}
        self._layouts: dict[str, tuple[list[int], bool]] = {}  # data pointers -> lie back to back
        self._main_grad_layout: tuple[list[int], bool | None] | None = None
        for param in self.parameters():
            param.allreduce = not expert_parallel

    def _experts(self, name: str) -> list[nn.Parameter]:
        """The per-expert parameters ``{name}0..{name}{G-1}`` (read from ``_parameters``: ``Module``'s
        attribute lookup costs about a microsecond per expert and call)."""
        params = self._parameters
        return [params[key] for key in self._expert_names[name]]

    def _stacked(self, name: str) -> torch.Tensor:
        """[G, ...] from the per-expert parameters, gradients flowing back to each (into their ``main_grad``s
        in one step under Megatron's fused wgrad accumulation, ``_StackIntoMainGrad``). While they still
        lie one after another in memory (as built, and after ``.to()``) this is a view of them; after
        something else re-homed them (a distributed optimizer's parameter buffer) or under torch.compile,
        a copy. The full layout check runs once per set of data pointers (re-homing changes them)."""
        params = self._experts(name)
        if torch.compiler.is_compiling():
            return torch.stack(params)
        pointers = [p.data_ptr() for p in params]
        known = self._layouts.get(name)
        if known is None or known[0] != pointers:
            known = self._layouts[name] = (pointers, _consecutive(params))
        consecutive = known[1]
        main_grad = self._main_grad(params) if name == "weight" else None
        if main_grad is not None and torch.is_grad_enabled() and params[0].requires_grad:
            return apply_function(_StackIntoMainGrad, *main_grad, consecutive, *params)
        return apply_function(_ConsecutiveStack, *params) if consecutive else torch.stack(params)

    def _main_grad(self, params: list[nn.Parameter]) -> tuple[torch.Tensor, bool] | None:
        """(the experts' ``main_grad``s as one [G, ...] tensor in memory order, whether that order runs from
        the last expert to the first) where Megatron's ``gradient_accumulation_fusion`` is on and DDP's
        buffer holds them back to back; the layout check runs again only when the buffer moved."""
        if not self.config.gradient_accumulation_fusion or getattr(params[0], "main_grad", None) is None:
            return None
        grads = [getattr(p, "main_grad", None) for p in params]
        pointers = [g.data_ptr() if g is not None else 0 for g in grads]
        if self._main_grad_layout is None or self._main_grad_layout[0] != pointers:
            self._main_grad_layout = (pointers, _main_grad_order(grads, params))
        reverse = self._main_grad_layout[1]
        if reverse is None:
            return None
        return _stack_view(grads[::-1] if reverse else grads), reverse

    def _apply(self, fn: Callable, recurse: bool = True) -> TurboGroupedLinear:
        """``Module._apply`` (``.to()``, ``.cuda()``, ``.bfloat16()``), which converts each parameter on its
        own, then the experts laid back to back in one allocation again."""
        module = super()._apply(fn, recurse)
        for name in ("weight", "bias") if self.use_bias else ("weight",):
            params = self._experts(name)
            if not _consecutive(params):
                with torch.no_grad():
                    joined = torch.stack(params)
                for param, part in zip(params, joined, strict=True):
                    param.data = part
        return module

    def forward(
        self, x: torch.Tensor | QuantizedTensor, m_splits: torch.Tensor | Sequence[int]
    ) -> tuple[torch.Tensor, None]:
        """``x`` [T, in] with expert ``g``'s rows contiguous and in order -> ``(out [T, out], None)``;
        under tensorwise FP8 ``x`` may arrive quantized (``fp8_input``)."""
        device = x.data.device if isinstance(x, QuantizedTensor) else x.device
        group_lens = torch.as_tensor(m_splits, dtype=torch.int64).to(device, non_blocking=True)
        bias = self._stacked("bias") if self.use_bias else None
        weight = self._stacked("weight")
        config, fp8_wgrad = self._fp8_plan(x.shape[0], isinstance(x, QuantizedTensor))
        if isinstance(x, QuantizedTensor) and config is None:
            raise ValueError("an FP8 input needs the layer's FP8 plan (see fp8_input)")
        fp8_weight = self._fp8_weight(weight) if config is not None else None
        out = grouped_linear(x, weight, bias, group_lens, config, fp8_weight, fp8_wgrad)
        FP8WeightCache.microbatch_done(self)
        return out, None

    def _fp8_plan(self, tokens: int, input_fp8: bool = False) -> tuple[Float8QuantConfig | None, bool]:
        """(FP8 config or None for bf16, FP8 weight gradient): the layer's settings, or under the FP8
        auto-filter the cost model's choice at ``tokens`` rows (the wgrad's precision too, unless
        ``--no-turbo-fp8-expert-wgrad`` fixed it to bf16), the input arriving in FP8 or not."""
        if self.quant_config is None or self.fp8_auto_filter is None:
            return self.quant_config, self.fp8_wgrad
        use_fp8, fp8_wgrad = self._fp8_choice.decide(
            self,
            self.fp8_auto_filter,
            tokens,
            groups=self.num_gemms,
            fp8_wgrad=None if self.fp8_wgrad else False,
            input_fp8=input_fp8,
        )
        return (self.quant_config, fp8_wgrad) if use_fp8 else (None, self.fp8_wgrad)

    def fp8_input(self, tokens: int) -> Float8QuantConfig | None:
        """The config under which a producer may hand this layer its input already in FP8 (``swiglu_fp8``),
        or None: tensorwise FP8 with an FP8 weight gradient (which reads the producer's transposed copy);
        the other scalings quantize the input along each expert's tokens for the weight gradient. Under
        the FP8 auto-filter the choice is the cost model's with the input's quantization left out."""
        if self.quant_config is None or self.quant_config.granularity is not ScalingGranularity.TENSORWISE:
            return None
        config, fp8_wgrad = self._fp8_plan(tokens, input_fp8=True)
        if config is None or config.granularity is not ScalingGranularity.TENSORWISE or not fp8_wgrad:
            return None
        return config

    def _fp8_weight(self, weight: torch.Tensor) -> QuantizedExperts | None:
        """The experts' FP8 copies, made once per weight update across micro-batches (``is_first_microbatch``)
        or None (quantized in the call)."""
        return self._weight_cache.get(
            self,
            self._experts("weight"),
            lambda: quantize_fp8_experts(weight.detach(), self.quant_config, trans_b=True),
            experts=True,
        )

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Distributed-checkpoint shards under TE's grouped names (``weight{i}``, ``_extra_state{i}``), each
        expert placed at its global index on a leading expert axis, as TE's grouped linears do: the
        checkpoints interchange with TE runs and with Megatron's ``SequentialMLP``."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        ep_group, edp_group = _expert_groups(self._pg_collection)
        first = get_pg_rank(ep_group) * self.num_gemms
        total = get_pg_size(ep_group) * self.num_gemms
        axis = {"column": 0, "row": 1}.get(self.parallel_mode)
        state = self.state_dict(prefix="", keep_vars=True)
        shards = {}
        for i in range(self.num_gemms):
            local = {f"{i}.weight": state[f"weight{i}"], f"{i}._extra_state": state.get("_extra_state")}
            if self.use_bias:
                local[f"{i}.bias"] = state[f"bias{i}"]
            axes = {} if axis is None else {f"{i}.weight": axis, **({f"{i}.bias": 0} if axis == 0 else {})}
            offsets = (
                sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), first + i, total))
            )
            sub = make_sharded_tensors_for_checkpoint(
                local, "", axes, offsets, tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"]
            )
            replace_prefix_for_sharding(sub, f"{i}.", f"{first + i}.{prefix}" if singleton else prefix)
            shards[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            shards[f"{prefix}_extra_state{i if i else ''}"] = sub[f"{i}._extra_state"]
            if self.use_bias:
                shards[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        replica = get_pg_rank(edp_group)  # experts repeat over the expert-data-parallel ranks only
        for shard in shards.values():
            shard.replica_id = (*shard.replica_id[:2], replica)
        return shards

    def extra_repr(self) -> str:
        fp8 = f", fp8={self.quant_config.granularity.name.lower()}" if self.quant_config else ""
        fp8 += ", fp8_wgrad=False" if self.quant_config and not self.fp8_wgrad else ""
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, parallel_mode={self.parallel_mode}{fp8}"
        )


class TurboColumnParallelGroupedLinear(TurboGroupedLinear):
    """``TEColumnParallelGroupedLinear``: the experts' output features split over expert-TP ranks."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs: Any) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


class TurboRowParallelGroupedLinear(TurboGroupedLinear):
    """``TERowParallelGroupedLinear``: the experts' input features split over expert-TP ranks."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs: Any) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)


class TurboGroupedMLP(MegatronModule):
    """The experts of an MoE layer: grouped fc1, the gated activation times each row's routing
    probability (one fused Turbo kernel for SwiGLU when ``fused_act_with_probs``), grouped fc2.

    ``forward(hidden [T, H] sorted by local expert, tokens_per_expert [E_local], probs [T])`` returns
    ``(out [T, H], None)`` as Megatron's experts do; the token counts may stay on the GPU.
    """

    fused_act_with_probs = False

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: Any = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config)
        fused_act_with_probs = self.fused_act_with_probs
        if config.moe_apply_probs_on_input:
            raise ValueError("moe_apply_probs_on_input is not supported by Turbo grouped experts")
        swiglu = config.gated_linear_unit and config.activation_func is F.silu
        if fused_act_with_probs and not swiglu:
            raise ValueError("the fused activation with probs needs SwiGLU experts (gated_linear_unit, silu)")
        self.num_local_experts = num_local_experts
        self.ep_group, _ = _expert_groups(pg_collection)
        self.tp_group = _expert_tp_group(pg_collection)
        ffn = config.moe_ffn_hidden_size
        fc1 = getattr(submodules, "linear_fc1", None) or TurboColumnParallelGroupedLinear
        fc2 = getattr(submodules, "linear_fc2", None) or TurboRowParallelGroupedLinear
        common = dict(config=config, is_expert=True, pg_collection=pg_collection, bias=config.add_bias_linear)
        self.linear_fc1 = fc1(
            num_local_experts,
            config.hidden_size,
            ffn * 2 if config.gated_linear_unit else ffn,
            init_method=config.init_method,
            skip_bias_add=False,
            tp_comm_buffer_name="fc1",
            **common,
        )
        self.linear_fc2 = fc2(
            num_local_experts,
            ffn,
            config.hidden_size,
            init_method=config.output_layer_init_method,
            skip_bias_add=False,
            tp_comm_buffer_name="fc2",
            **common,
        )

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor | QuantizedTensor:
        """The gated activation times the probabilities: fused, and written straight in FP8 where fc2 reads
        its input that way (``fp8_input``)."""
        if self.fused_act_with_probs:
            config = self.linear_fc2.fp8_input(h.shape[0]) if hasattr(self.linear_fc2, "fp8_input") else None
            return swiglu_fp8(h, config, probs) if config is not None else swiglu_with_probs(h, probs)
        act = self.config.activation_func
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        return (h * probs.unsqueeze(-1)).to(h.dtype)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        group_lens = torch.as_tensor(tokens_per_expert, dtype=torch.int64).to(
            permuted_local_hidden_states.device, non_blocking=True
        )
        h, _ = self.linear_fc1(permuted_local_hidden_states, group_lens)
        out, _ = self.linear_fc2(self._activation(h, permuted_probs), group_lens)
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's ``TEGroupedMLP`` checkpoint layout (the gated fc1 split for tensor parallelism, keys
        shared with ``SequentialMLP``), over this module's grouped linears."""
        return TEGroupedMLP.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (no delayed wgrad)."""


class TurboGroupedMLPWithFusedAct(TurboGroupedMLP):
    """``TurboGroupedMLP`` whose SwiGLU and routing-probability product run as one Turbo kernel."""

    fused_act_with_probs = True
