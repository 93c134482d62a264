"""The Megatron Turbo modules' rows of ``bench_host_overhead``: each Turbo module beside the Megatron
local-spec module it replaces, at a tiny size, inside a one-rank process group (TP = EP = 1).

Needs megatron-core; without it there are no module rows.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

from benchmark.ops.training.bench_utils import HostCase as Case

__all__ = ["module_cases"]

_log = logging.getLogger(__name__)


def _config(dtype: torch.dtype, **overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_grouped_gemm=True,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _init(w: torch.Tensor) -> None:
    torch.nn.init.normal_(w, std=0.02)


def module_cases(device: torch.device) -> list[Case]:
    """Turbo linear, norm, norm + linear and grouped-MLP modules against Megatron's local modules."""
    if importlib.util.find_spec("megatron") is None:
        _log.warning("megatron-core is not installed: no module rows")
        return []
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from primus_turbo.integrations.megatron.cpu import enable_megatron_on_cpu
    from primus_turbo.integrations.megatron.experts import TurboGroupedMLP
    from primus_turbo.integrations.megatron.linear import (
        TurboColumnParallelLinear,
        TurboLayerNormColumnParallelLinear,
        TurboRowParallelLinear,
    )
    from primus_turbo.integrations.megatron.norm import TurboRMSNorm

    enable_megatron_on_cpu()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = _config(dtype)
    hidden, ffn, tokens = config.hidden_size, config.ffn_hidden_size, 16
    x = torch.randn(tokens, 1, hidden, device=device, dtype=dtype, requires_grad=True)
    common = dict(config=config, init_method=_init, bias=False, skip_bias_add=False, is_expert=False)
    column = dict(common, gather_output=False)
    row = dict(common, input_is_parallel=True)

    def out(module):
        return lambda: module(x)[0]

    cases = []
    linears = {}
    for turbo_cls, local_cls, out_features, kwargs in (
        (TurboColumnParallelLinear, ColumnParallelLinear, ffn, column),
        (TurboRowParallelLinear, RowParallelLinear, hidden, row),
    ):
        turbo = turbo_cls(hidden, out_features, **kwargs).to(device)
        local = linears[local_cls] = local_cls(hidden, out_features, **kwargs).to(device)
        leaves = [x, turbo.weight, local.weight]
        cases.append(
            Case(
                "megatron", turbo_cls.__name__, out(turbo), out(local), leaves, local_cls.__name__, target=1.5
            )
        )
    local_col = linears[ColumnParallelLinear]
    turbo_norm = TurboRMSNorm(config, hidden, eps=1e-5).to(device)
    local_norm = WrappedTorchNorm(config, hidden, eps=1e-5).to(device)
    cases.append(
        Case(
            "megatron",
            "TurboRMSNorm",
            lambda: turbo_norm(x),
            lambda: local_norm(x),
            [x, turbo_norm.weight, local_norm.weight],
            "WrappedTorchNorm (torch RMSNorm)",
            target=1.5,
        )
    )
    turbo_ln = TurboLayerNormColumnParallelLinear(hidden, ffn, **column).to(device)

    def norm_then_linear():
        return local_col(local_norm(x))[0]

    cases.append(
        Case(
            "megatron",
            "TurboLayerNormColumnParallelLinear",
            out(turbo_ln),
            norm_then_linear,
            [x, turbo_ln.weight, local_col.weight, local_norm.weight],
            "WrappedTorchNorm + ColumnParallelLinear",
            target=1.5,
        )
    )
    cases.append(_grouped_mlp_case(config, TurboGroupedMLP, device, dtype, tokens, "TurboGroupedMLP"))
    # a fine-grained MoE's expert count, where per-expert parameter handling shows
    wide = _config(dtype, num_moe_experts=128, moe_router_topk=8)
    cases.append(_grouped_mlp_case(wide, TurboGroupedMLP, device, dtype, 256, "TurboGroupedMLP 128 experts"))
    return cases


def _grouped_mlp_case(
    config, mlp_cls, device: torch.device, dtype: torch.dtype, tokens: int, name: str
) -> Case:
    """``mlp_cls`` (the Turbo experts) beside the same experts as ``torch._grouped_mm`` calls."""
    hidden = config.hidden_size
    experts = config.num_moe_experts
    grouped = mlp_cls(experts, config).to(device)
    tokens_x = torch.randn(tokens * 2, hidden, device=device, dtype=dtype, requires_grad=True)
    counts = torch.full((experts,), tokens * 2 // experts, device=device, dtype=torch.int64)
    probs = torch.rand(tokens * 2, device=device)
    peer_w1 = torch.randn(experts, 2 * config.moe_ffn_hidden_size, hidden, device=device, dtype=dtype)
    peer_w2 = torch.randn(experts, hidden, config.moe_ffn_hidden_size, device=device, dtype=dtype)
    peer_w1.requires_grad_(True)
    peer_w2.requires_grad_(True)
    ends = torch.cumsum(counts, 0).to(torch.int32)

    def grouped_peer():
        """The experts as torch._grouped_mm calls (what TE's grouped experts amount to on one GPU)."""
        h = torch._grouped_mm(tokens_x, peer_w1.transpose(1, 2), offs=ends)
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up * probs[:, None].to(dtype)
        return torch._grouped_mm(h, peer_w2.transpose(1, 2), offs=ends)

    try:
        grouped_peer().sum().backward()
        peer = grouped_peer
    except RuntimeError:  # torch._grouped_mm has no working backward on the CPU in some versions
        peer = None
    return Case(
        "megatron",
        name,
        lambda: grouped(tokens_x, counts, probs)[0],
        peer,
        [tokens_x, peer_w1, peer_w2, *grouped.parameters()],
        "torch._grouped_mm experts" if peer else "",
    )
