"""RMSNorm custom ops ``primus_turbo::rmsnorm_fwd`` / ``rmsnorm_residual_fwd`` / ``rmsnorm_bwd`` on 2-D
(rows, H) views: the Triton kernels on GPUs (and under the interpreter), the TORCH reference elsewhere.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.kernels.quantization.dual_block_cuda import (
    PRODUCER_RMSNORM,
    dual_block_cuda,
    dual_block_cuda_usable,
)
from primus_turbo.pytorch.kernels.quantization.quantization_impl import (
    EMIT_MODES,
    fp8_producer_empty,
    fp8_producer_reference,
    fp8_triton_usable,
)
from primus_turbo.triton.normalization import (
    rmsnorm_bwd_triton,
    rmsnorm_fp8_triton,
    rmsnorm_fwd_triton,
    rmsnorm_rstd_triton,
)
from primus_turbo.triton.quantization import EMIT_BLOCK
from primus_turbo.triton.utils.device_info import triton_runs_on

__all__ = [
    "rmsnorm_bwd_impl",
    "rmsnorm_bwd_reference",
    "rmsnorm_fp8_fwd_impl",
    "rmsnorm_fwd_impl",
    "rmsnorm_fwd_reference",
    "rmsnorm_residual_fwd_impl",
]


def _use_triton(x: torch.Tensor) -> bool:
    return triton_runs_on(x.device)


def _weight(gamma: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    return gamma.float() + 1.0 if zero_centered else gamma.float()


# ATen's fused RMSNorm forward (one op, fp32 statistics) where this torch has it; its backward is CUDA-only
_FUSED_FWD = getattr(torch.ops.aten, "_fused_rms_norm", None)


def rmsnorm_fwd_reference(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, s, rstd)`` in fp32 math: ``s = x (+ residual)`` in x's dtype, ``y = s * rstd * w``."""
    s32 = x.float() if residual is None else x.float() + residual.float()
    s = x if residual is None else s32.to(x.dtype).contiguous()
    if _FUSED_FWD is not None and s32.numel():
        y32, rstd = _FUSED_FWD(s32, [s32.shape[1]], _weight(gamma, zero_centered), eps)
        return y32.to(x.dtype).contiguous(), s, rstd.view(-1)
    rstd = torch.rsqrt(s32.square().mean(dim=-1) + eps)
    y = (s32 * rstd[:, None] * _weight(gamma, zero_centered)).to(x.dtype).contiguous()
    return y, s, rstd


def rmsnorm_bwd_reference(
    dy: torch.Tensor,
    s: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered: bool,
    ds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dgamma)``, dgamma summed in fp32 and returned in gamma's dtype; ``ds`` (the gradient of s
    itself) is added to dx in fp32."""
    s_hat = s.float() * rstd[:, None]
    wdy = _weight(gamma, zero_centered) * dy.float()
    dx = rstd[:, None] * (wdy - s_hat * (s_hat * wdy).mean(dim=-1, keepdim=True))
    if ds is not None:
        dx = dx + ds.float()
    return dx.to(s.dtype).contiguous(), (dy.float() * s_hat).sum(dim=0).to(gamma.dtype)


def _fwd(x, gamma, eps, zero_centered, residual):
    if _use_triton(x):
        return rmsnorm_fwd_triton(x, gamma, eps, zero_centered, residual)
    return rmsnorm_fwd_reference(x, gamma, eps, zero_centered, residual)


@custom_op("primus_turbo::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd_impl(
    x: torch.Tensor, gamma: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` of 2-D ``x`` (rows, H)."""
    y, _, rstd = _fwd(x, gamma, eps, zero_centered, None)
    return y, rstd


@rmsnorm_fwd_impl.register_fake
def _rmsnorm_fwd_fake(x, gamma, eps, zero_centered):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("primus_turbo::rmsnorm_residual_fwd", mutates_args=())
def rmsnorm_residual_fwd_impl(
    x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, x + residual, rstd)`` of 2-D ``x`` and ``residual`` (rows, H)."""
    return _fwd(x, gamma, eps, zero_centered, residual)


@rmsnorm_residual_fwd_impl.register_fake
def _rmsnorm_residual_fwd_fake(x, residual, gamma, eps, zero_centered):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, torch.empty_like(y), x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("primus_turbo::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd_impl(
    dy: torch.Tensor,
    s: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered: bool,
    ds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dgamma)``, dgamma reduced over rows in fp32 in a fixed order and returned in gamma's dtype
    (the gradient autograd hands gamma); ``ds``, the gradient of the residual sum s itself
    (rmsnorm_residual), joins dx in the same pass."""
    if _use_triton(s):
        return rmsnorm_bwd_triton(dy, s, gamma, rstd, zero_centered, ds)
    return rmsnorm_bwd_reference(dy, s, gamma, rstd, zero_centered, ds)


@rmsnorm_bwd_impl.register_fake
def _rmsnorm_bwd_fake(dy, s, gamma, rstd, zero_centered, ds=None):
    return torch.empty(s.shape, dtype=s.dtype, device=s.device), s.new_empty(s.shape[1], dtype=gamma.dtype)


@custom_op("primus_turbo::rmsnorm_fp8_fwd", mutates_args=())
def rmsnorm_fp8_fwd_impl(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    zero_centered: bool,
    fp8_dtype: torch.dtype,
    granularity: int,
    block_size: int,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rstd, q, scale_inv, q_t, scale_inv_t)``: RMSNorm of 2-D ``x`` written only as FP8, equal bit for
    bit to ``quantize_fp8_with_trans`` of the unfused output (tensorwise, per row, or 1 x ``block_size``
    blocks); without ``columnwise``, ``q_t`` and ``scale_inv_t`` are empty and ``q``/``scale_inv`` are
    ``quantize_fp8`` along the hidden dimension."""
    if not fp8_triton_usable(x, fp8_dtype) or x.numel() == 0:
        y, _, rstd = rmsnorm_fwd_reference(x, gamma, eps, zero_centered)
        return (rstd, *fp8_producer_reference(y, fp8_dtype, granularity, block_size, columnwise))
    q, scale, q_t, scale_t = fp8_producer_empty(
        x.shape, fp8_dtype, granularity, block_size, columnwise, x.device
    )
    if columnwise and EMIT_MODES[granularity] == EMIT_BLOCK and _cuda_tiles(x, gamma, fp8_dtype, block_size):
        rstd = rmsnorm_rstd_triton(x, gamma, eps, zero_centered)
        dual_block_cuda(x, PRODUCER_RMSNORM, q, scale, q_t, scale_t, gamma, rstd, zero_centered)
        return rstd, q, scale, q_t, scale_t
    column = (q_t, scale_t) if columnwise else (None, None)
    rstd = rmsnorm_fp8_triton(
        x, gamma, eps, zero_centered, EMIT_MODES[granularity], q, scale, *column, block_size
    )
    return rstd, q, scale, q_t, scale_t


def _cuda_tiles(x: torch.Tensor, gamma: torch.Tensor, fp8_dtype: torch.dtype, block_size: int) -> bool:
    """Both 1 x 128 copies from the C++ kernel's tiles (after a Triton pass for rstd), where it runs."""
    return (
        dual_block_cuda_usable(x, fp8_dtype, block_size)
        and gamma.dtype in (torch.float32, x.dtype)
        and gamma.is_contiguous()
        and gamma.is_cuda
    )


@rmsnorm_fp8_fwd_impl.register_fake
def _rmsnorm_fp8_fwd_fake(x, gamma, eps, zero_centered, fp8_dtype, granularity, block_size, columnwise):
    outputs = fp8_producer_empty(x.shape, fp8_dtype, granularity, block_size, columnwise, x.device)
    return (x.new_empty(x.shape[0], dtype=torch.float32), *outputs)
