"""List the torch.compile graph breaks of Megatron ``TransformerLayer``s built with the Turbo spec (dense,
MoE with the Turbo dispatcher, and MoE with the load-balancing and z losses on), with the file and line of
each: the table in docs/megatron.md.

    PYTHONPATH=. python scripts/megatron_graph_breaks.py
"""

from __future__ import annotations

import warnings

import torch


def main() -> None:
    warnings.filterwarnings("ignore")
    from megatron.core import package_info
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.spec_utils import build_module

    from primus_turbo.integrations.megatron import (
        PrimusTurboConfig,
        apply_primus_turbo_to_megatron,
        get_gpt_layer_with_turbo_spec,
    )
    from tests.integrations.megatron.megatron_harness import (
        MOE_OVERRIDES,
        destroy_megatron,
        init_megatron,
        local_process_group,
        tiny_config,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"megatron-core {package_info.__version__}, {device}")
    with local_process_group():
        init_megatron()
        try:
            losses = dict(
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3
            )
            variants = {
                "dense": {},
                "MoE": dict(MOE_OVERRIDES, moe_grouped_gemm=True),
                "MoE, aux + z loss": dict(MOE_OVERRIDES, moe_grouped_gemm=True, **losses),
            }
            for name, overrides in variants.items():
                config = tiny_config(**overrides)
                moe = bool(overrides)
                patch = apply_primus_turbo_to_megatron(PrimusTurboConfig(enable_primus_turbo=True), config)
                try:
                    MoEAuxLossAutoScaler.set_loss_scale(torch.ones((), device=device))
                    spec = get_gpt_layer_with_turbo_spec(
                        num_experts=config.num_moe_experts, moe_grouped_gemm=moe
                    )
                    layer = build_module(spec, config=config, layer_number=1).to(device)
                    x = torch.randn(8, 2, config.hidden_size, dtype=torch.bfloat16, device=device)
                    explained = torch._dynamo.explain(layer)(x, attention_mask=None)
                finally:
                    patch.undo()
                    torch._dynamo.reset()
                print(f"{name}: {explained.graph_count} graphs, {explained.graph_break_count} breaks")
                for reason in explained.break_reasons:
                    frame = reason.user_stack[-1] if reason.user_stack else None
                    where = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}" if frame else "?"
                    print(f"  {where}: {reason.reason.splitlines()[0][:150]}")
        finally:
            destroy_megatron()


if __name__ == "__main__":
    main()
