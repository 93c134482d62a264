"""Megatron-Core integration, installed as ``primus_turbo.integrations.megatron``.

``--enable-primus-turbo`` (``add_primus_turbo_args`` for Megatron-LM's parser) or
``PrimusTurboConfig(enable_primus_turbo=True)`` for megatron-core users; ``apply_primus_turbo_to_megatron``
puts Turbo modules into Megatron's Transformer-Engine slots in place, and ``TurboSpecProvider`` with
``get_gpt_layer_with_turbo_spec`` / ``get_gpt_decoder_block_turbo_spec`` builds specs explicitly.
"""

from primus_turbo.integrations.megatron.arguments import add_primus_turbo_args
from primus_turbo.integrations.megatron.config import (
    PrimusTurboConfig,
    ResolvedTurbo,
    fp8_quant_config,
    resolve,
)
from primus_turbo.integrations.megatron.patch import (
    TurboPatch,
    apply_primus_turbo_to_megatron,
    remove_primus_turbo_from_megatron,
)
from primus_turbo.integrations.megatron.spec_provider import (
    TurboSpecProvider,
    get_gpt_decoder_block_turbo_spec,
    get_gpt_layer_with_turbo_spec,
)

__all__ = [
    "PrimusTurboConfig",
    "ResolvedTurbo",
    "TurboPatch",
    "TurboSpecProvider",
    "add_primus_turbo_args",
    "apply_primus_turbo_to_megatron",
    "fp8_quant_config",
    "get_gpt_decoder_block_turbo_spec",
    "get_gpt_layer_with_turbo_spec",
    "remove_primus_turbo_from_megatron",
    "resolve",
]
