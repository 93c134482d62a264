"""Transformer-Engine-shaped linear layers on Turbo GEMM: ``TurboLinear``, ``TurboColumnParallelLinear``,
``TurboRowParallelLinear`` and ``TurboLayerNormColumnParallelLinear``.

They take the constructor keywords Megatron passes to ``TELinear`` and friends (unknown ones, added by
later Megatron versions, are accepted and ignored), keep TE's parameter names (``weight``, ``bias``,
``layer_norm_weight``, ``layer_norm_bias``, an ``_extra_state`` entry) so checkpoints interchange, and
return ``(out, bias)`` as TE does. Tensor parallelism follows TE: column layers split the output
features and, with sequence parallelism, all-gather the sequence first; row layers split the input
features and all-reduce, or reduce-scatter the sequence. Weight gradients go into ``main_grad`` when
Megatron's ``gradient_accumulation_fusion`` is on; FP8 follows ``config.fp8``/``fp8_recipe``, and the
quantized weight is reused across micro-batches (``is_first_microbatch``) until the weight changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide, get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none
from torch import nn

from primus_turbo.integrations.megatron.config import fp8_quant_config
from primus_turbo.integrations.megatron.fp8_choice import Fp8Choice
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
from primus_turbo.pytorch.ops import (
    fused_all_gather_matmul,
    fused_matmul_reduce_scatter,
    gemm,
    gemm_fp8,
    rmsnorm,
    rmsnorm_fp8,
)
from primus_turbo.pytorch.ops.fp8_primary import fp8_primary_view
from primus_turbo.pytorch.ops.gemm_fp8 import quantize_fp8_weight
from primus_turbo.pytorch.ops.quantization import FUSED_FP8_GRANULARITIES, QuantizedTensor

__all__ = [
    "FP8WeightCache",
    "TurboColumnParallelLinear",
    "TurboLayerNormColumnParallelLinear",
    "TurboLinear",
    "TurboRowParallelLinear",
    "init_partitioned_weight",
    "param_device",
]

_PARALLEL_MODES = ("column", "row", "duplicated")


def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FP8WeightCache:
    """A module's FP8 weight copies, made once per weight update and reused across micro-batches
    (``is_first_microbatch``, as TE's modules do).

    Off (``get`` returns None: quantize in the call) when ``is_first_microbatch`` is None or Megatron's
    ``disable_parameter_transpose_cache`` is set (as for TE's modules), inside a torch.compile graph
    (checked first: no guard on the flag), and while a CUDA graph is being captured: a replayed graph
    must quantize the weights the optimizer has changed since, and a cache hit at capture time would
    leave the quantization out of the graph for good.

    With ``config.fp8_param`` (Megatron's ``--fp8-param-gather``) the copies are the weights' FP8 primary
    copies instead (``ops.fp8_primary``): kept with the weights, written by ``FusedAdamW``'s step (with any
    other optimizer quantized again on each step's first micro-batch, and after any change seen), and
    read by a CUDA graph when that optimizer owns them.
    """

    def __init__(self) -> None:
        self.key: tuple[tuple[int, int], ...] | None = None
        self.value: Any = None

    def get(
        self,
        module: nn.Module,
        weights: Sequence[torch.Tensor],
        make: Callable[[], Any],
        experts: bool = False,
    ) -> Any:
        """The cached copies of ``weights`` (``make()`` again when the weights changed, by an in-place
        update or a new storage, or on the first micro-batch); the FP8 primary copies with ``fp8_param``
        (``experts``: ``weights`` are a layer's experts')."""
        if getattr(module.config, "fp8_param", False):
            # a new step (first micro-batch): the weights may have changed unseen (see fp8_primary_view)
            requantize = module.is_first_microbatch is not False
            return fp8_primary_view(weights, module.quant_config, experts, requantize)
        if torch.compiler.is_compiling() or module.is_first_microbatch is None or _capturing_cuda_graph():
            return None
        if getattr(module.config, "disable_parameter_transpose_cache", False):
            return None
        key = tuple((w._version, w.data_ptr()) for w in weights)
        if module.is_first_microbatch or self.key != key:
            self.key, self.value = key, make()
        return self.value

    @staticmethod
    def microbatch_done(module: nn.Module) -> None:
        """After a forward: later micro-batches are no longer the first (None, the cache off, stays None).
        Not inside a torch.compile graph, where a written flag would recompile the graph next step."""
        if not torch.compiler.is_compiling():
            module.is_first_microbatch = False if module.is_first_microbatch is not None else None


def param_device(config: Any) -> torch.device | int | None:
    """Where Megatron creates parameters: the host with ``use_cpu_initialization``, else the current GPU."""
    return None if config.use_cpu_initialization else torch.cuda.current_device()


def init_partitioned_weight(
    weight: torch.Tensor,
    config: Any,
    init_method: Callable[[torch.Tensor], Any],
    full_shape: tuple[int, int],
    dim: int,
    rank: int,
    tp_size: int,
    is_expert: bool,
    stride: int = 1,
) -> None:
    """Initialise this rank's shard (split along ``dim`` of the [out, in] ``full_shape``) as Megatron's
    parallel linears do: from the full master weight on the host with ``use_cpu_initialization``, else on
    the device under the model-parallel RNG tracker; both tag the tensor-parallel attributes."""
    output_size, input_size = full_shape
    if config.use_cpu_initialization:
        _initialize_affine_weight_cpu(
            weight,
            output_size,
            input_size,
            weight.shape[dim],
            dim,
            init_method,
            stride=stride,
            params_dtype=config.params_dtype,
            rank=rank,
            world_size=tp_size,
        )
    else:
        _initialize_affine_weight_gpu(weight, init_method, dim, stride, is_expert=is_expert)


class _ExtraState:
    """TE modules save an ``_extra_state`` entry (their FP8 metadata); ours is empty and ignored on load,
    so state dicts have the same keys either way."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore: Turbo scales FP8 from the current tensors."""


class TurboLinear(_ExtraState, nn.Module):
    """``TELinear``'s contract: ``parallel_mode`` "column", "row" or "duplicated" (no tensor parallelism).

    Layers built while ``async_tp`` is set (by ``--use-turbo-async-tp``) run a sequence-parallel bf16/fp16
    all-gather + GEMM (column) or GEMM + reduce-scatter (row) as one fused op. Layers built while
    ``fp8_auto_filter`` is set (``--turbo-fp8-auto-filter``) run their GEMMs in bf16 wherever the FP8 cost
    model finds FP8 slower at the call's shape.
    """

    async_tp: bool = False
    fp8_auto_filter: str | None = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config: Any,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        is_expert: bool = False,
        tp_group: torch.distributed.ProcessGroup | None = None,
        stride: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        parallel_mode = parallel_mode or "duplicated"
        if parallel_mode not in _PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {_PARALLEL_MODES} or None, got {parallel_mode!r}")
        if skip_weight_param_allocation:
            raise ValueError("Turbo linear layers do not support skip_weight_param_allocation")
        self.config, self.parallel_mode, self.is_expert = config, parallel_mode, is_expert
        self.skip_bias_add, self.tp_comm_buffer_name = skip_bias_add, tp_comm_buffer_name
        self.is_first_microbatch = True
        self.quant_config = fp8_quant_config(config)
        self._weight_cache = FP8WeightCache()
        self._fp8_choice, self.fp8_auto_filter = Fp8Choice(), type(self).fp8_auto_filter
        expert_parallel = config.expert_model_parallel_size > 1
        if parallel_mode == "duplicated":
            self._tp_group, tp_size, rank = None, 1, 0
        else:
            self._tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
            tp_size, rank = get_pg_size(self._tp_group), get_pg_rank(self._tp_group)
        # experts' tensor-parallel traffic is the token dispatcher's job
        self.explicit_expert_comm = is_expert and (tp_size > 1 or expert_parallel)
        self.communicates = parallel_mode != "duplicated" and tp_size > 1 and not self.explicit_expert_comm
        self.sequence_parallel = bool(config.sequence_parallel) and self.communicates
        # FP8 layers keep the separate collective for now
        self.fused_tp = self.async_tp and self.sequence_parallel and self.quant_config is None
        self.in_features = divide(input_size, tp_size) if parallel_mode == "row" else input_size
        self.out_features = divide(output_size, tp_size) if parallel_mode == "column" else output_size
        self._make_weight(input_size, output_size, init_method, tp_size, rank, stride)
        if bias:
            self.bias = nn.Parameter(self._empty(self.out_features))
            with torch.no_grad():
                self.bias.zero_()
            if parallel_mode == "column":
                set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            elif self.sequence_parallel:
                self.bias.sequence_parallel = True  # its gradient is summed over the TP ranks
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            param.allreduce = not (is_expert and expert_parallel)
            if parallel_mode == "duplicated" and not is_expert:
                param.sequence_parallel = bool(config.sequence_parallel)

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, device=param_device(self.config), dtype=self.config.params_dtype)

    def _make_weight(self, input_size, output_size, init_method, tp_size, rank, stride) -> None:
        self.weight = nn.Parameter(self._empty(self.out_features, self.in_features))
        if not self.config.perform_initialization:
            return
        if self.parallel_mode == "duplicated":
            with torch.no_grad():
                init_method(self.weight)
            return
        dim = 1 if self.parallel_mode == "row" else 0
        init_partitioned_weight(
            self.weight,
            self.config,
            init_method,
            (output_size, input_size),
            dim,
            rank,
            tp_size,
            self.is_expert,
            stride,
        )

    def _fp8_weight(self) -> QuantizedTensor | torch.Tensor:
        """The weight's FP8 copies, made once per weight update while ``is_first_microbatch`` is not None."""
        cached = self._weight_cache.get(
            self, (self.weight,), lambda: quantize_fp8_weight(self.weight, self.quant_config)
        )
        return self.weight if cached is None else cached

    def _accum(self) -> str | None:
        """Megatron's fused wgrad accumulation into ``weight.main_grad``, where the config asks for it."""
        return "megatron" if self.config.gradient_accumulation_fusion and self.weight.requires_grad else None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)

    def _fp8_config(self, tokens: int, input_fp8: bool = False) -> Float8QuantConfig | None:
        """The FP8 config this call's GEMMs run under: the layer's, or None (bf16) where the FP8 auto-filter
        (``fp8_auto_filter``, set by ``apply_primus_turbo_to_megatron``) finds FP8 slower at this shape."""
        if self.quant_config is None or self.fp8_auto_filter is None:
            return self.quant_config
        use_fp8, _ = self._fp8_choice.decide(self, self.fp8_auto_filter, tokens, input_fp8=input_fp8)
        return self.quant_config if use_fp8 else None

    def _gemm(self, a: torch.Tensor | QuantizedTensor) -> torch.Tensor:
        """``a`` [tokens, in] (bf16, or already FP8 from a fused producer) times the weight."""
        accum = self._accum()
        config = self._fp8_config(a.shape[0], isinstance(a, QuantizedTensor))
        if config is None:
            out = gemm(a, self.weight, trans_b=True, fuse_bgrad_accum_pattern=accum)
        else:
            out = gemm_fp8(a, self._fp8_weight(), trans_b=True, config=config, fuse_bgrad_accum_pattern=accum)
        FP8WeightCache.microbatch_done(self)
        return out

    def _gather_input(self, x: torch.Tensor) -> torch.Tensor:
        if not self.communicates or self.parallel_mode != "column":
            return x
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=self._tp_group
            )
        return copy_to_tensor_model_parallel_region(x, group=self._tp_group)

    def _reduce_output(self, out: torch.Tensor) -> torch.Tensor:
        if not self.communicates or self.parallel_mode != "row":
            return out
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, group=self._tp_group)
        return reduce_from_tensor_model_parallel_region(out, group=self._tp_group)

    def _add_bias(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.bias is None:
            return out, None
        if self.skip_bias_add:
            return out, self.bias
        return out + self.bias, None

    def _gather_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Column-parallel: the gathered sequence times the weight shard."""
        if self.parallel_mode == "column" and self.fused_tp:
            _, (out,) = fused_all_gather_matmul(
                x, [self.weight], 0, self._tp_group, return_a=False, trans_b=True,
                fuse_bgrad_accum_pattern=self._accum(),
            )  # fmt: skip
            return out
        return self._matmul(self._gather_input(x))

    def _matmul_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Row-parallel: the partial products summed over the group, this rank's sequence shard kept."""
        if self.parallel_mode == "row" and self.fused_tp:
            return fused_matmul_reduce_scatter(
                x, self.weight, 0, self._tp_group, trans_b=True, fuse_bgrad_accum_pattern=self._accum()
            )
        return self._reduce_output(self._matmul(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` [..., in] (the local sequence shard with sequence parallelism) -> ``(out, bias or None)``."""
        if self.parallel_mode == "row":
            return self._add_bias(self._matmul_reduce(x))
        return self._add_bias(self._gather_matmul(x))

    def finish_init(self, quantization_config: Any) -> None:
        """Megatron's per-layer quantization override: Turbo reads FP8 from the model config only."""
        if quantization_config is not None:
            raise ValueError("per-layer quantization configs are not supported by Turbo linear layers")

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (no delayed wgrad)."""

    def _tp_axis_map(self) -> dict[str, int]:
        return {}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Distributed-checkpoint shards under TE's names: split along the tensor-parallel axis."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            self._tp_axis_map(),
            sharded_offsets,
            tp_group=self._tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )

    def extra_repr(self) -> str:
        fp8 = f", fp8={self.quant_config.granularity.name.lower()}" if self.quant_config else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, parallel_mode={self.parallel_mode}, "
            f"sequence_parallel={self.sequence_parallel}{fp8}"
        )


class TurboColumnParallelLinear(TurboLinear):
    """``TEColumnParallelLinear``'s contract: the output features split over the tensor-parallel ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], Any],
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None,
        stride: int = 1,
        **kwargs: Any,
    ) -> None:
        if gather_output:
            raise ValueError(
                "Turbo column-parallel linear layers do not gather their output (gather_output=True)"
            )
        super().__init__(
            input_size,
            output_size,
            parallel_mode="column",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            tp_comm_buffer_name=tp_comm_buffer_name,
            is_expert=is_expert,
            tp_group=tp_group,
            stride=stride,
        )

    def _tp_axis_map(self) -> dict[str, int]:
        return {"weight": 0, "bias": 0}


class TurboRowParallelLinear(TurboLinear):
    """``TERowParallelLinear``'s contract: the input features split over the tensor-parallel ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        if not input_is_parallel:
            raise ValueError("Turbo row-parallel linear layers need input_is_parallel=True")
        super().__init__(
            input_size,
            output_size,
            parallel_mode="row",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            tp_comm_buffer_name=tp_comm_buffer_name,
            is_expert=is_expert,
            tp_group=tp_group,
        )

    def _tp_axis_map(self) -> dict[str, int]:
        return {"weight": 1}


class TurboLayerNormColumnParallelLinear(TurboColumnParallelLinear):
    """``TELayerNormColumnParallelLinear``'s contract: RMSNorm (Turbo kernel) or LayerNorm over the local
    sequence shard, then the column-parallel GEMM; the norm's parameters are ``layer_norm_weight`` and,
    for LayerNorm, ``layer_norm_bias``."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization must be RMSNorm or LayerNorm, got {config.normalization!r}")
        self.normalization, self.eps = config.normalization, float(config.layernorm_epsilon)
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        fill = 0.0 if self.zero_centered else 1.0
        self.layer_norm_weight = nn.Parameter(self._empty(input_size).fill_(fill))
        self.layer_norm_bias = None
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(self._empty(input_size).zero_())
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = bool(config.sequence_parallel)  # summed over the TP ranks
                param.allreduce = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "RMSNorm":
            return rmsnorm(x, self.layer_norm_weight, self.eps, self.zero_centered)
        weight = self.layer_norm_weight + 1 if self.zero_centered else self.layer_norm_weight
        return F.layer_norm(x, (x.shape[-1],), weight, self.layer_norm_bias, self.eps)

    def _fuses_norm_into_fp8(self) -> bool:
        """FP8 RMSNorm whose input needs no gather: the norm writes the GEMM's FP8 operand itself."""
        config = self.quant_config
        return (
            config is not None
            and self.normalization == "RMSNorm"
            and not self.communicates
            and config.granularity in FUSED_FP8_GRANULARITIES
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = x.numel() // max(x.shape[-1], 1)
        if self._fuses_norm_into_fp8() and self._fp8_config(tokens, input_fp8=True) is not None:
            # no bf16 normalized activation is written and read back for quantization
            quantized = rmsnorm_fp8(
                x.reshape(-1, x.shape[-1]),
                self.layer_norm_weight,
                self.quant_config,
                self.eps,
                self.zero_centered,
                columnwise=self.weight.requires_grad,
            )
            return self._add_bias(self._gemm(quantized).view(*x.shape[:-1], self.out_features))
        return self._add_bias(self._gather_matmul(self._norm(x)))

    def extra_repr(self) -> str:
        return f"{self.normalization}, " + super().extra_repr()
