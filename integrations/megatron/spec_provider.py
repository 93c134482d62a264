"""``TurboSpecProvider`` (a Megatron ``BackendSpecProvider``) and GPT layer/block spec helpers built on it.

Each slot holds a Turbo module where its feature is on, and otherwise the class of the fallback provider
(Transformer Engine's when it is installed, Megatron's local modules when not).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from typing import Any

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from primus_turbo.integrations.megatron.attention import TurboDotProductAttention
from primus_turbo.integrations.megatron.compat import (
    call_with_supported_kwargs,
    experts_spec,
    grouped_mlp_takes_legacy_flag,
)
from primus_turbo.integrations.megatron.config import ResolvedTurbo
from primus_turbo.integrations.megatron.experts import (
    TurboColumnParallelGroupedLinear,
    TurboGroupedMLP,
    TurboGroupedMLPWithFusedAct,
    TurboRowParallelGroupedLinear,
)
from primus_turbo.integrations.megatron.linear import (
    TurboColumnParallelLinear,
    TurboLayerNormColumnParallelLinear,
    TurboLinear,
    TurboRowParallelLinear,
)
from primus_turbo.integrations.megatron.norm import TurboNorm

__all__ = [
    "ALL_FEATURES",
    "TurboSpecProvider",
    "active_features",
    "fallback_provider",
    "get_gpt_decoder_block_turbo_spec",
    "get_gpt_layer_with_turbo_spec",
    "set_active_features",
]

_log = logging.getLogger(__name__)

ALL_FEATURES = ResolvedTurbo(
    attention=True,
    gemm=True,
    grouped_gemm=True,
    deepep=True,
    rms_norm=True,
    fused_act_with_probs=True,
    fused_router=True,
)
_active: list[ResolvedTurbo] = []

if HAVE_TE:
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider as _Fallback
else:
    _Fallback = LocalSpecProvider


def set_active_features(features: ResolvedTurbo | None) -> None:
    """The features a ``TurboSpecProvider()`` built without arguments uses (None: every feature)."""
    _active[:] = [] if features is None else [features]


def active_features() -> ResolvedTurbo:
    return _active[0] if _active else ALL_FEATURES


def fallback_provider() -> BackendSpecProvider:
    """Transformer Engine's provider when TE imports, else Megatron's local one."""
    return _Fallback()


class TurboSpecProvider(BackendSpecProvider):
    """Megatron's spec-provider protocol answered with Turbo modules for the enabled features."""

    def __init__(
        self, features: ResolvedTurbo | None = None, fallback: BackendSpecProvider | None = None
    ) -> None:
        self.features = features if features is not None else active_features()
        self.fallback = fallback if fallback is not None else fallback_provider()

    def linear(self) -> type:
        return TurboLinear if self.features.gemm else self.fallback.linear()

    def column_parallel_linear(self) -> type:
        return TurboColumnParallelLinear if self.features.gemm else self.fallback.column_parallel_linear()

    def row_parallel_linear(self) -> type:
        return TurboRowParallelLinear if self.features.gemm else self.fallback.row_parallel_linear()

    def fuse_layernorm_and_linear(self) -> bool:
        return True if self.features.gemm else self.fallback.fuse_layernorm_and_linear()

    def column_parallel_layer_norm_linear(self) -> type | None:
        if self.features.gemm:
            return TurboLayerNormColumnParallelLinear
        return self.fallback.column_parallel_layer_norm_linear()

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
        if self.features.rms_norm:
            return TurboNorm
        return call_with_supported_kwargs(
            self.fallback.layer_norm, rms_norm=rms_norm, for_qk=for_qk, has_residual=has_residual
        )

    def core_attention(self) -> type:
        return TurboDotProductAttention if self.features.attention else self.fallback.core_attention()

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, *args: Any) -> Any:
        """Turbo grouped experts when grouped GEMM is asked for; the signature follows the Megatron
        version (0.16 passes ``moe_use_legacy_grouped_gemm`` too)."""
        if moe_use_grouped_gemm and self.features.grouped_gemm and not any(args):
            experts = TurboGroupedMLPWithFusedAct if self.features.fused_act_with_probs else TurboGroupedMLP
            return experts_spec(experts, TurboColumnParallelGroupedLinear, TurboRowParallelGroupedLinear)
        return self.fallback.grouped_mlp_modules(moe_use_grouped_gemm, *args)

    def activation_func(self) -> Any:
        return None

    def describe(self) -> dict[str, str]:
        """Which class fills each slot (for the log)."""
        grouped = self.grouped_mlp_modules(True, *((False,) if grouped_mlp_takes_legacy_flag() else ()))
        experts = grouped[0] if isinstance(grouped, tuple) else getattr(grouped, "func", grouped)
        slots = {
            "column_parallel_linear": self.column_parallel_linear(),
            "row_parallel_linear": self.row_parallel_linear(),
            "layer_norm_linear": self.column_parallel_layer_norm_linear(),
            "layer_norm": self.layer_norm(rms_norm=True),
            "core_attention": self.core_attention(),
            "grouped_experts": experts,
        }
        return {slot: getattr(cls, "__name__", str(cls)) for slot, cls in slots.items()}


def get_gpt_layer_with_turbo_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    qk_l2_norm: bool = False,
    features: ResolvedTurbo | None = None,
    **kwargs: Any,
) -> ModuleSpec:
    """A GPT ``TransformerLayer`` spec shaped like Megatron's Transformer-Engine spec (the input norm
    fused into ``linear_qkv`` and ``linear_fc1``), filled by ``TurboSpecProvider(features)``."""
    if multi_latent_attention:
        raise ValueError("multi-latent attention is not provided by the Turbo layer spec")
    backend = TurboSpecProvider(features)
    if not backend.fuse_layernorm_and_linear():
        raise ValueError("the Turbo layer spec fuses the input norm into the linear: keep use_turbo_gemm on")
    mlp = call_with_supported_kwargs(
        gpt_layer_specs.get_mlp_module_spec_for_backend,
        backend=backend,
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        moe_use_legacy_grouped_gemm=False,
    )
    if qk_l2_norm:
        from megatron.core.transformer.torch_norm import L2Norm

        qk_norm = L2Norm
    else:
        qk_norm = backend.layer_norm(for_qk=True) if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_layer_norm_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


_PROVIDER_SITES = (
    "megatron.core.extensions.transformer_engine_spec_provider",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.moe_module_specs",
    "megatron.core.transformer.multi_token_prediction",
)
# the final norm: the block spec helper's TENorm, and the block's own default when given one layer spec
_NORM_SITES = (
    ("megatron.core.models.gpt.gpt_layer_specs", "TENorm"),
    ("megatron.core.transformer.transformer_block", "LayerNormImpl"),
)
_MISSING = object()


@contextlib.contextmanager
def bound_names(bindings: dict[tuple[str, str], Any]) -> Iterator[None]:
    """Temporarily set ``module.name = value`` for each ``(module, name)``; restore on exit."""
    saved = []
    try:
        for (module_name, name), value in bindings.items():
            module = importlib.import_module(module_name)
            saved.append((module, name, getattr(module, name, _MISSING)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, old in reversed(saved):
            if old is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, old)


def spec_bindings(features: ResolvedTurbo) -> dict[tuple[str, str], Any]:
    """The Megatron module names that, rebound, make Megatron's TE spec helpers build Turbo modules."""

    class _BoundProvider(TurboSpecProvider):
        def __init__(self) -> None:
            super().__init__(features)

    bindings: dict[tuple[str, str], Any] = {
        (site, "TESpecProvider"): _BoundProvider for site in _PROVIDER_SITES
    }
    bindings.update({site: _BoundProvider().layer_norm() for site in _NORM_SITES})
    return bindings


def get_gpt_decoder_block_turbo_spec(
    config: Any,
    features: ResolvedTurbo | None = None,
    qk_l2_norm: bool = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """Megatron's ``get_gpt_decoder_block_spec`` (dense/MoE layer pattern, pipeline slicing) with every
    layer from the Turbo spec and the final norm a Turbo norm too."""
    features = features if features is not None else active_features()
    with bound_names(spec_bindings(features)):
        return call_with_supported_kwargs(
            gpt_layer_specs.get_gpt_decoder_block_spec,
            config,
            use_transformer_engine=True,
            qk_l2_norm=qk_l2_norm,
            vp_stage=vp_stage,
            pp_rank=pp_rank,
        )
