"""Names of every environment variable the library reads, in one place."""

__all__ = [
    "ENV_ASYNC_TP_BACKEND",
    "ENV_ATTN_BACKEND",
    "ENV_AUTO_TUNE",
    "ENV_DEBUG_CHECKS",
    "ENV_GEMM_BACKEND",
    "ENV_GROUPED_GEMM_BACKEND",
    "ENV_LOG_LEVEL",
    "ENV_MOE_DISPATCH_COMBINE_BACKEND",
    "ENV_TRITON_AUTOTUNE",
    "ENV_TRITON_LAUNCHER",
    "ENV_TRITON_LAUNCH_CHECK",
]

ENV_LOG_LEVEL = "PRIMUS_TURBO_LOG_LEVEL"
ENV_AUTO_TUNE = "PRIMUS_TURBO_AUTO_TUNE"
ENV_GEMM_BACKEND = "PRIMUS_TURBO_GEMM_BACKEND"
ENV_GROUPED_GEMM_BACKEND = "PRIMUS_TURBO_GROUPED_GEMM_BACKEND"
ENV_ATTN_BACKEND = "PRIMUS_TURBO_ATTN_BACKEND"
ENV_MOE_DISPATCH_COMBINE_BACKEND = "PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND"
ENV_ASYNC_TP_BACKEND = "PRIMUS_TURBO_ASYNC_TP_BACKEND"
# "1" adds checks that need device values on the host (e.g. grouped GEMM group sizes): a sync per call.
ENV_DEBUG_CHECKS = "PRIMUS_TURBO_DEBUG_CHECKS"
# "0" skips per-shape Triton autotuning: kernels launch one config picked by a heuristic.
ENV_TRITON_AUTOTUNE = "PRIMUS_TURBO_TRITON_AUTOTUNE"
# "cached" launches @cached_launch kernels from a per-key cache of compiled kernels; "triton" (default)
# through Triton's own launcher.
ENV_TRITON_LAUNCHER = "PRIMUS_TURBO_TRITON_LAUNCHER"
# "1" checks every cached launch against the kernel Triton would have picked (slow; for the GPU suite).
ENV_TRITON_LAUNCH_CHECK = "PRIMUS_TURBO_TRITON_LAUNCH_CHECK"
