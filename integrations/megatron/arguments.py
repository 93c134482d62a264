"""``add_primus_turbo_args``: the ``--enable-primus-turbo`` switch and per-feature flags for Megatron-LM's
argument parser (pass it as ``extra_args_provider``)."""

from __future__ import annotations

import argparse

from primus_turbo.integrations.megatron.config import FEATURES, FP8_AUTO_FILTER_MODES, PrimusTurboConfig

__all__ = ["add_primus_turbo_args"]

_FEATURE_HELP = {
    "use_turbo_attention": "flash attention (TEDotProductAttention's slot)",
    "use_turbo_gemm": "linear layers: column/row parallel, layer-norm + linear",
    "use_turbo_grouped_gemm": "grouped-GEMM experts (needs --moe-grouped-gemm)",
    "use_turbo_deepep": "the expert-parallel (flex) token dispatcher over deep_ep.Buffer",
    "use_turbo_rms_norm": "RMSNorm layers, the final norm included",
    "use_turbo_fused_act_with_probs": "SwiGLU fused with the routing probabilities in the experts",
    "use_turbo_fused_router": "the MoE router's score function and top-k as one kernel each way",
    "use_turbo_async_tp": "all-gather + GEMM and GEMM + reduce-scatter fused in sequence-parallel linears",
}
_OPT_IN = {"use_turbo_async_tp"}  # off unless asked for


def add_primus_turbo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Primus-Turbo group to ``parser`` and return it (Megatron's ``extra_args_provider`` shape).

    ``--enable-primus-turbo`` turns on every feature the model can use; ``--no-use-turbo-X`` turns one off
    and ``--use-turbo-X`` insists on it. Read the result with ``PrimusTurboConfig.from_args(args)``.
    """
    group = parser.add_argument_group(title="Primus-Turbo")
    group.add_argument(
        "--enable-primus-turbo",
        action="store_true",
        help="fill Megatron's Transformer-Engine slots with Primus-Turbo modules",
    )
    for name in FEATURES:
        group.add_argument(
            "--" + name.replace("_", "-"),
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"Turbo {_FEATURE_HELP[name]} "
            + ("(default: off)" if name in _OPT_IN else "(default: on when the model can use it)"),
        )
    for name, what in (
        ("turbo_gemm_backend", "GEMM"),
        ("turbo_grouped_gemm_backend", "grouped GEMM"),
        ("turbo_attention_backend", "attention"),
        ("turbo_dispatch_backend", "MoE dispatch/combine"),
    ):
        group.add_argument(
            "--" + name.replace("_", "-"),
            default=None,
            help=f"{what} backend: a name (TRITON, ...), 'autotune' or per precision 'fp8:X,other:Y'",
        )
    group.add_argument(
        "--use-turbo-autotune", action="store_true", help="time eligible backends per shape and keep the best"
    )
    group.add_argument(
        "--turbo-num-worst-tokens",
        type=int,
        default=PrimusTurboConfig.turbo_num_worst_tokens,
        help="size expert-parallel receive buffers for this many tokens: dispatch without a host sync",
    )
    group.add_argument(
        "--turbo-fp8-expert-wgrad",
        action=argparse.BooleanOptionalAction,
        default=PrimusTurboConfig.turbo_fp8_expert_wgrad,
        help="under --fp8, the experts' weight gradients in FP8 (default); --no-turbo-fp8-expert-wgrad "
        "computes them in the parameters' dtype, faster where each expert sees few tokens",
    )
    group.add_argument(
        "--turbo-fp8-auto-filter",
        nargs="?",
        const="auto",
        default=None,
        choices=[mode for mode in FP8_AUTO_FILTER_MODES if mode],
        help="under --fp8, keep each linear / grouped linear in bf16 where the FP8 cost model finds FP8 "
        "slower at its shape (logged once per layer); 'eager' counts host time, 'graph' only device time, "
        "'auto' (the flag alone) follows --cuda-graph-impl",
    )
    group.add_argument(
        "--turbo-backward-on-caller-thread",
        action=argparse.BooleanOptionalAction,
        default=PrimusTurboConfig.turbo_backward_on_caller_thread,
        help="run each backward on the thread that calls it, not autograd's per-GPU worker thread "
        "(default; saves host time per backward node); --no-turbo-backward-on-caller-thread keeps "
        "PyTorch's default",
    )
    return parser
