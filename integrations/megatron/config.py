"""``PrimusTurboConfig``: which Megatron slots Turbo fills, checked against the Megatron config.

One switch, ``enable_primus_turbo``, turns every feature on wherever the model can use it. A feature
flag left at ``None`` follows the switch; ``False`` turns that feature off; ``True`` insists on it, so a
model that cannot use it (no experts, context parallelism, ...) is an error rather than a silent no-op.
A feature flag set without the switch is an error too. FP8 follows Megatron's own ``fp8`` and
``fp8_recipe`` fields.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from primus_turbo.common.constants import (
    ENV_ATTN_BACKEND,
    ENV_GEMM_BACKEND,
    ENV_GROUPED_GEMM_BACKEND,
    ENV_MOE_DISPATCH_COMBINE_BACKEND,
)
from primus_turbo.pytorch.core.backend import parse_backend_spec
from primus_turbo.pytorch.core.low_precision import (
    DEFAULT_BLOCK_SIZE,
    MXFP8_BLOCK_SIZE,
    Float8QuantConfig,
    Format,
    ScaleDtype,
    ScalingGranularity,
)
from primus_turbo.pytorch.ops.fp8_primary import Fp8PrimaryWeight

__all__ = [
    "BACKEND_FIELDS",
    "FEATURES",
    "FP8_AUTO_FILTER_MODES",
    "PrimusTurboConfig",
    "ResolvedTurbo",
    "fp8_quant_config",
    "resolve",
]

FEATURES = (
    "use_turbo_attention",
    "use_turbo_gemm",
    "use_turbo_grouped_gemm",
    "use_turbo_deepep",
    "use_turbo_rms_norm",
    "use_turbo_fused_act_with_probs",
    "use_turbo_fused_router",
    "use_turbo_async_tp",
)
# backend field -> (GlobalBackendManager op, its environment variable, whether "autotune" is allowed)
BACKEND_FIELDS = {
    "turbo_gemm_backend": ("gemm", ENV_GEMM_BACKEND, True),
    "turbo_grouped_gemm_backend": ("grouped_gemm", ENV_GROUPED_GEMM_BACKEND, True),
    "turbo_attention_backend": ("attn", ENV_ATTN_BACKEND, True),
    "turbo_dispatch_backend": ("moe_dispatch_combine", ENV_MOE_DISPATCH_COMBINE_BACKEND, False),
}
_FP8_RECIPES = {
    "tensorwise": {"granularity": ScalingGranularity.TENSORWISE},
    "blockwise": {"granularity": ScalingGranularity.BLOCKWISE, "block_size": DEFAULT_BLOCK_SIZE},
    "mxfp8": {
        "granularity": ScalingGranularity.MX_BLOCKWISE,
        "block_size": MXFP8_BLOCK_SIZE,
        "scale_dtype": ScaleDtype.E8M0,
    },
}


# None: off; "auto": eager or graph from the model config's CUDA-graph setting
FP8_AUTO_FILTER_MODES = (None, "auto", "eager", "graph")


@dataclass(frozen=True)
class PrimusTurboConfig:
    """The Turbo switch, per-feature flags (None: on where the model can use it) and backend choices.

    Backend fields take the same strings as the ``PRIMUS_TURBO_*_BACKEND`` variables (``TRITON``,
    ``autotune``, ``fp8:TRITON,other:HIPBLASLT``). ``turbo_num_worst_tokens > 0`` sizes the expert-parallel
    receive buffers for the worst case, so dispatch never waits for the host. Under ``fp8``,
    ``turbo_fp8_expert_wgrad=False`` computes the experts' weight gradients in the parameters' dtype
    (forward and dgrad stay FP8): faster where each expert sees few tokens.
    ``turbo_backward_on_caller_thread`` (default on) runs each backward on the thread that calls it
    (``torch.autograd.set_multithreading_enabled(False)``) instead of autograd's per-GPU worker thread: a
    Megatron rank drives one GPU, so the hand-off between the two threads buys nothing and costs host time
    on every backward node. ``turbo_fp8_auto_filter`` (under ``fp8``; ``auto``, ``eager`` or ``graph``)
    keeps each linear and grouped linear in bf16 where the FP8 cost model
    (``primus_turbo.pytorch.core.fp8_filter``) finds FP8 slower at the layer's shape, and lets it pick the
    experts' weight-gradient precision; ``eager`` counts each layer's host time, ``graph`` only its device
    time, ``auto`` follows the model config's ``cuda_graph_impl``. Each layer logs its choice once.
    """

    enable_primus_turbo: bool = False
    use_turbo_attention: bool | None = None
    use_turbo_gemm: bool | None = None
    use_turbo_grouped_gemm: bool | None = None
    use_turbo_deepep: bool | None = None
    use_turbo_rms_norm: bool | None = None
    use_turbo_fused_act_with_probs: bool | None = None
    use_turbo_fused_router: bool | None = None
    use_turbo_async_tp: bool | None = None
    turbo_gemm_backend: str | None = None
    turbo_grouped_gemm_backend: str | None = None
    turbo_attention_backend: str | None = None
    turbo_dispatch_backend: str | None = None
    use_turbo_autotune: bool = False
    turbo_num_worst_tokens: int = 0
    turbo_fp8_expert_wgrad: bool = True
    turbo_backward_on_caller_thread: bool = True
    turbo_fp8_auto_filter: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enable_primus_turbo, bool):
            raise TypeError(f"enable_primus_turbo must be a bool, got {self.enable_primus_turbo!r}")
        for name in FEATURES:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be True, False or None, got {value!r}")
            if value and not self.enable_primus_turbo:
                raise ValueError(f"{name}=True needs enable_primus_turbo=True (--enable-primus-turbo)")
        self.backend_choices()  # bad backend strings raise here
        if not isinstance(self.use_turbo_autotune, bool):
            raise TypeError(f"use_turbo_autotune must be a bool, got {self.use_turbo_autotune!r}")
        if not isinstance(self.turbo_num_worst_tokens, int) or self.turbo_num_worst_tokens < 0:
            raise ValueError(
                f"turbo_num_worst_tokens must be an int >= 0, got {self.turbo_num_worst_tokens!r}"
            )
        if not isinstance(self.turbo_fp8_expert_wgrad, bool):
            raise TypeError(f"turbo_fp8_expert_wgrad must be a bool, got {self.turbo_fp8_expert_wgrad!r}")
        if self.turbo_fp8_auto_filter not in FP8_AUTO_FILTER_MODES:
            raise ValueError(
                f"turbo_fp8_auto_filter must be one of {FP8_AUTO_FILTER_MODES}, "
                f"got {self.turbo_fp8_auto_filter!r}"
            )
        if not isinstance(self.turbo_backward_on_caller_thread, bool):
            raise TypeError(
                "turbo_backward_on_caller_thread must be a bool, "
                f"got {self.turbo_backward_on_caller_thread!r}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PrimusTurboConfig:
        """From a mapping (a YAML section, say); unknown keys raise instead of being ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown Primus-Turbo option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace | Any) -> PrimusTurboConfig:
        """From Megatron-LM's parsed arguments (with ``add_primus_turbo_args`` in the parser)."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})

    def backend_env(self) -> dict[str, str]:
        """The ``PRIMUS_TURBO_*`` variables the backend fields stand for."""
        return {
            env: getattr(self, name) for name, (_, env, _) in BACKEND_FIELDS.items() if getattr(self, name)
        }

    def backend_choices(self) -> dict[str, dict]:
        """{op: parsed choices per precision} for each backend field that is set."""
        return {
            op: parse_backend_spec(getattr(self, name), name, autotune)
            for name, (op, _, autotune) in BACKEND_FIELDS.items()
            if getattr(self, name)
        }


@dataclass(frozen=True)
class ResolvedTurbo:
    """What Turbo fills in one model: each feature decided, and the FP8 config (None: bf16/fp16)."""

    attention: bool = False
    gemm: bool = False
    grouped_gemm: bool = False
    deepep: bool = False
    rms_norm: bool = False
    fused_act_with_probs: bool = False
    fused_router: bool = False
    async_tp: bool = False
    fp8: Float8QuantConfig | None = None
    num_worst_tokens: int = 0
    fp8_expert_wgrad: bool = True
    backward_on_caller_thread: bool = False
    fp8_auto_filter: str | None = None  # "eager" | "graph": the FP8 cost model decides per layer

    def describe(self) -> str:
        on = [name for name in (f.removeprefix("use_turbo_") for f in FEATURES) if getattr(self, name)]
        fp8 = f", fp8 {self.fp8.granularity.name.lower()}/{self.fp8.format.name}" if self.fp8 else ""
        fp8 += ", experts' wgrad in high precision" if self.fp8 and not self.fp8_expert_wgrad else ""
        fp8 += f", fp8 auto-filter ({self.fp8_auto_filter})" if self.fp8_auto_filter else ""
        thread = ", backward on the calling thread" if self.backward_on_caller_thread else ""
        return f"Primus-Turbo fills: {', '.join(on) or 'nothing'}{fp8}{thread}"


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return getattr(value, "value", value)  # Megatron enums (Fp8Recipe) compare as their names


def fp8_quant_config(config: Any) -> Float8QuantConfig | None:
    """Turbo's FP8 config for Megatron's ``fp8`` (e4m3 | hybrid) and ``fp8_recipe``, or None without FP8.

    ``delayed`` scaling and ``custom`` recipes have no Turbo equivalent and raise.
    """
    fmt = _get(config, "fp8")
    if not fmt:
        return None
    formats = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}
    if fmt not in formats:
        raise ValueError(f"fp8={fmt!r} is not supported by Primus-Turbo; use 'e4m3' or 'hybrid'")
    recipe = _get(config, "fp8_recipe", "delayed")
    if recipe not in _FP8_RECIPES:
        raise ValueError(
            f"fp8_recipe={recipe!r} is not supported by Primus-Turbo (it scales from the current amax); "
            f"choose --fp8-recipe {' | '.join(_FP8_RECIPES)}"
        )
    return Float8QuantConfig(format=formats[fmt], **_FP8_RECIPES[recipe])


def _feature(turbo: PrimusTurboConfig, name: str, usable: bool, why_not: str) -> bool:
    """The feature's value: its flag, or the switch where the model can use it."""
    flag = getattr(turbo, name)
    if flag and not usable:
        raise ValueError(f"{name}=True cannot apply: {why_not}")
    return usable if flag is None else flag


def resolve(turbo: PrimusTurboConfig, config: Any) -> ResolvedTurbo:
    """Decide each feature for a model with Megatron config ``config`` (a ``TransformerConfig`` or
    Megatron-LM's argument namespace), raising on contradictions."""
    if not turbo.enable_primus_turbo:
        return ResolvedTurbo()
    moe = bool(_get(config, "num_moe_experts"))
    cp = int(_get(config, "context_parallel_size", 1) or 1)
    gemm = _feature(turbo, "use_turbo_gemm", True, "")
    attention = _feature(
        turbo,
        "use_turbo_attention",
        cp == 1
        and not _get(config, "multi_latent_attention", False)
        and not _get(config, "attention_dropout", 0.0),
        "Turbo attention runs without context parallelism, multi-latent attention and attention dropout",
    )
    grouped = _feature(
        turbo,
        "use_turbo_grouped_gemm",
        moe and bool(_get(config, "moe_grouped_gemm", False)),
        "the model needs experts and --moe-grouped-gemm",
    )
    deepep = _feature(turbo, "use_turbo_deepep", moe, "the model has no experts (--num-experts)")
    rms_norm = _feature(
        turbo,
        "use_turbo_rms_norm",
        _get(config, "normalization", "LayerNorm") == "RMSNorm",
        "normalization is not RMSNorm",
    )
    swiglu = (
        bool(_get(config, "gated_linear_unit", False))
        and getattr(_get(config, "activation_func"), "__name__", "") == "silu"
    )
    fused_act = _feature(
        turbo,
        "use_turbo_fused_act_with_probs",
        grouped and swiglu,
        "it needs Turbo grouped GEMM experts with SwiGLU (--swiglu)",
    )
    fused_router = _feature(
        turbo,
        "use_turbo_fused_router",
        moe and _get(config, "moe_router_load_balancing_type", "aux_loss") != "sinkhorn",
        "the model needs experts routed by top-k (not sinkhorn)",
    )
    # opt-in (None: off): the fused ops pay off where the pipelined backend beats the plain collectives
    async_tp = bool(turbo.use_turbo_async_tp) and _feature(
        turbo,
        "use_turbo_async_tp",
        gemm
        and bool(_get(config, "sequence_parallel", False))
        and int(_get(config, "tensor_model_parallel_size", 1) or 1) > 1,
        "it needs Turbo linears and tensor parallelism > 1 with --sequence-parallel",
    )
    if _get(config, "tp_comm_overlap", False) and gemm:
        raise ValueError(
            "tp_comm_overlap (Transformer-Engine userbuffers) cannot run with Turbo linears; "
            "turn it off or pass --no-use-turbo-gemm"
        )
    if _get(config, "fp4"):
        raise ValueError("--fp4 is not supported by the Primus-Turbo integration; train with --fp8")
    if deepep and _get(config, "moe_shared_expert_overlap", False):
        raise ValueError(
            "the Turbo dispatcher cannot overlap shared experts; drop --moe-shared-expert-overlap"
        )
    if deepep and _get(config, "moe_pad_expert_input_to_capacity", False):
        raise ValueError("the Turbo dispatcher does not pad expert input to capacity")
    fp8 = fp8_quant_config(config) if (gemm or grouped) else None
    fp8_param = _get(config, "fp8_param", False) or _get(config, "fp8_param_gather", False)  # config / args
    if (
        fp8_param
        and (gemm or grouped)
        and (fp8 is None or fp8.granularity not in Fp8PrimaryWeight.GRANULARITIES)
    ):
        raise ValueError(
            "fp8_param (--fp8-param-gather) keeps FP8 primary copies of the Turbo linears' weights: it "
            "needs --fp8 with --fp8-recipe tensorwise or blockwise"
        )
    if fp8 is not None and grouped and fp8.granularity is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError("Turbo grouped GEMM has no mxfp8 path; use --fp8-recipe tensorwise or blockwise")
    if fp8 is not None and _get(config, "first_last_layers_bf16", False):
        raise ValueError("first_last_layers_bf16 is not supported with Turbo FP8 linears")
    if not turbo.turbo_fp8_expert_wgrad and (fp8 is None or not grouped):
        raise ValueError(
            "turbo_fp8_expert_wgrad=False (--no-turbo-fp8-expert-wgrad) applies to Turbo grouped-GEMM "
            "experts under --fp8; this model has none"
        )
    auto_filter = turbo.turbo_fp8_auto_filter
    if auto_filter is not None and fp8 is None:
        raise ValueError(
            "turbo_fp8_auto_filter (--turbo-fp8-auto-filter) chooses between FP8 and bf16 per layer under "
            "--fp8 with Turbo linears or grouped GEMM; this model runs none in FP8"
        )
    if auto_filter == "auto":
        auto_filter = "graph" if _captures_cuda_graphs(config) else "eager"
    return ResolvedTurbo(
        attention=attention,
        gemm=gemm,
        grouped_gemm=grouped,
        deepep=deepep,
        rms_norm=rms_norm,
        fused_act_with_probs=fused_act,
        fused_router=fused_router,
        async_tp=async_tp,
        fp8=fp8,
        num_worst_tokens=turbo.turbo_num_worst_tokens,
        fp8_expert_wgrad=turbo.turbo_fp8_expert_wgrad,
        backward_on_caller_thread=turbo.turbo_backward_on_caller_thread,
        fp8_auto_filter=auto_filter,
    )


def _captures_cuda_graphs(config: Any) -> bool:
    """Whether the model config asks megatron-core for CUDA graphs (``cuda_graph_impl``, or the older
    ``enable_cuda_graph`` / ``external_cuda_graph``): the host path then leaves the step."""
    impl = _get(config, "cuda_graph_impl", "none")
    return impl not in (None, "none") or bool(
        _get(config, "enable_cuda_graph", False) or _get(config, "external_cuda_graph", False)
    )
