"""FP8 grouped GEMM with autograd:
``grouped_gemm_fp8(a, b, group_lens, group_offs, trans_b, out_dtype, config, fuse_bgrad_accum_pattern,
b_quantized, fp8_wgrad)``.

Scaling per granularity (``Format.HYBRID``: E4M3 forward operands, E5M2 gradients):

- TENSORWISE: one scale for the tokens (``a``, the gradient), one per expert weight; wgrad reuses them.
- ROWWISE: one scale per token row along the reduction dimension; expert weights per row along K
  (forward) or N (dgrad); the wgrad operands get one scale per (group, column) over the group's
  tokens (``quantize_fp8_group_columns``).
- BLOCKWISE (the DeepSeek-V3 recipe): tokens and gradients 1 x B along the reduction dimension, each
  expert's weight in B x B tiles (which serve the forward and dgrad alike); the wgrad operands get one
  scale per column for every stretch of B tokens (aligned to multiples of B, cut at group boundaries:
  ``quantize_fp8_group_blocks``), so group sizes need not be multiples of B. K and N must be.

Layouts: every FP8 operand reaches its GEMM with the reduction dimension contiguous, the layout
Hopper's FP8 tensor cores read: weights K-major for the forward and N-major for dgrad (a transposed FP8
copy, or for ROWWISE the weights quantized along N into that layout), and the wgrad operands
token-major.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.fused_wgrad import check_fuse_bgrad_accum_pattern, finish_fused_wgrad
from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    ScalingGranularity,
    ScalingRecipe,
    fp8_dtype_for,
)
from primus_turbo.pytorch.core.validation import check_dtype, check_tensor
from primus_turbo.pytorch.kernels.grouped_gemm.group_offs_impl import compute_group_offs
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
    group_block_layout,
    grouped_gemm_fp8_impl,
    grouped_gemm_fp8_variable_k_accum_impl,
    grouped_gemm_fp8_variable_k_impl,
    quantize_fp8_experts_tensorwise_impl,
    quantize_fp8_group_blocks_impl,
    quantize_fp8_group_columns_impl,
    transpose_last_two_impl,
)
from primus_turbo.pytorch.ops.grouped_gemm import check_grouped_args, grouped_wgrad
from primus_turbo.pytorch.ops.quantization import (
    QuantizedTensor,
    check_quantized_tensor,
    grad_anchor,
    quantize_fp8,
    quantize_fp8_with_trans,
)

__all__ = ["QuantizedExperts", "grouped_gemm_fp8", "quantize_fp8_experts"]

_G = ScalingGranularity
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _quantize_tokens(x: torch.Tensor, dtype: torch.dtype, config: Float8QuantConfig):
    """Token-major operand [T, C] along C: one scale, one per row ([T, 1]) or per 1 x B block."""
    axis = None if config.granularity is _G.TENSORWISE else 1
    return quantize_fp8(x, dtype, config.granularity, block_size=config.block_size, axis=axis)


def _rowwise_along(b: torch.Tensor, dtype: torch.dtype, axis: int):
    """Expert weights [G, X, Y] with one scale per row along ``axis``, ``axis`` contiguous in memory."""
    if axis == 2:
        return quantize_fp8(b, dtype, _G.ROWWISE, axis=2)
    # along the middle dimension: quantize the rows of a transposed copy, which is the wanted layout
    q, scale = quantize_fp8(call_op(transpose_last_two_impl, b), dtype, _G.ROWWISE, axis=2)
    return q.transpose(1, 2), scale.transpose(1, 2)


def _quantize_experts(
    b: torch.Tensor, dtype: torch.dtype, config: Float8QuantConfig, trans_b: bool, dgrad: bool
):
    """Expert weights [G, N, K] (``trans_b``) or [G, K, N]: ``(q, scale)`` for the forward (reducing over
    K) and, with ``dgrad``, for the input gradient (reducing over N), else None. Each ``q`` has b's shape
    with its reduction dimension contiguous; scales are one per expert ([G, 1, 1]), per row along the
    reduction, or per B x B tile ([G, X / B, Y / B]), in b's layout. Tensorwise and 2-D block scales
    serve both directions, so there the dgrad copy is the forward's transposed."""
    k_axis = 2 if trans_b else 1
    n_axis = 3 - k_axis
    granularity = config.granularity
    if granularity is _G.ROWWISE:
        return _rowwise_along(b, dtype, k_axis), _rowwise_along(b, dtype, n_axis) if dgrad else None
    block, recipe = config.block_size, ScalingRecipe(use_2d_block=True)
    if not dgrad and k_axis == 2:  # the forward's layout is b's own: no transposed copy
        if granularity is _G.TENSORWISE:
            q, scale = quantize_fp8(b.reshape(b.shape[0], -1), dtype, _G.ROWWISE, axis=1)
            return (q.view(b.shape), scale.view(-1, 1, 1)), None
        q, scale = quantize_fp8(
            b.reshape(-1, b.shape[2]), dtype, granularity, block_size=block, scaling_recipe=recipe
        )
        return (q.view(b.shape), scale.view(b.shape[0], b.shape[1] // block, -1)), None
    # both layouts, from one read of each tile
    if granularity is _G.TENSORWISE:
        q, q_t, scale = call_op(quantize_fp8_experts_tensorwise_impl, b, dtype)
    else:
        q, scale, q_t, _ = quantize_fp8_with_trans(
            b, dtype, granularity, block_size=block, scaling_recipe=recipe
        )
    along = {2: q, 1: q_t.transpose(1, 2)}
    return (along[k_axis], scale), (along[n_axis], scale) if dgrad else None


@dataclass(frozen=True)
class QuantizedExperts:
    """Expert weights quantized once for ``grouped_gemm_fp8`` (``quantize_fp8_experts``): the forward's
    copy and the input gradient's, each ``(q, scale_inv)`` with its reduction dimension contiguous. Reuse
    it while the weights are unchanged (across micro-batches); the weight gradient still goes to ``b``."""

    forward: tuple[torch.Tensor, torch.Tensor]
    dgrad: tuple[torch.Tensor, torch.Tensor]
    config: Float8QuantConfig
    trans_b: bool
    shape: torch.Size


def quantize_fp8_experts(
    b: torch.Tensor, config: Float8QuantConfig | None = None, trans_b: bool = False
) -> QuantizedExperts:
    """The FP8 copies of expert weights ``b`` ([G, N, K] with ``trans_b``, else [G, K, N]) that
    ``grouped_gemm_fp8(a, b, ..., trans_b=trans_b, config=config, b_quantized=...)`` reads, made as it
    would make them."""
    config = _check_config(config)
    check_tensor("b", b, dim=3)
    check_dtype("b.dtype", b.dtype, _DTYPES)
    k, n = (b.shape[2], b.shape[1]) if trans_b else (b.shape[1], b.shape[2])
    _check_block_multiples(k, n, config)
    dtype = fp8_dtype_for(config.format, is_forward=True)
    with torch.no_grad():
        fwd, dgrad = _quantize_experts(b, dtype, config, trans_b, dgrad=True)
    return QuantizedExperts(fwd, dgrad, config, trans_b, b.shape)


def _block(config: Float8QuantConfig) -> int:
    return config.block_size if config.granularity is _G.BLOCKWISE else 0


def _wgrad_operands(ctx, grad_out, grad_t, grad_scale, grad_dtype, fwd_dtype, block_ends):
    """Token-major FP8 copies of ``grad_out`` and ``a`` with their scales, for the wgrad GEMM
    (``grad_t``: the tensorwise gradient already quantized and stored [N, T]; ``block_ends``: the block
    layout's running block count under BLOCKWISE)."""
    a, _, group_offs, qa, sa, qa_t, _, _ = ctx.saved_tensors
    config, block = ctx.config, _block(ctx.config)
    if config.granularity is _G.TENSORWISE:
        # the forward's scales serve the reduction over tokens too: transposed copies of the same values
        # (a fused producer of ``a`` wrote that copy already)
        qa_t = call_op(transpose_last_two_impl, qa) if qa_t is None else qa_t
        return grad_t.t(), grad_scale, qa_t.t(), sa
    if config.granularity is _G.BLOCKWISE:
        quantize = quantize_fp8_group_blocks_impl
        qg_t, sg_t = call_op(quantize, grad_out, group_offs, grad_dtype, block, block_ends)
        qa_t, sa_t = call_op(quantize, a, group_offs, fwd_dtype, block, block_ends)
        return qg_t, sg_t, qa_t, sa_t
    qg_t, sg_t = call_op(quantize_fp8_group_columns_impl, grad_out, group_offs, grad_dtype)
    qa_t, sa_t = call_op(quantize_fp8_group_columns_impl, a, group_offs, fwd_dtype)
    return qg_t, sg_t, qa_t, sa_t


class _GroupedGemmFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, a, b, group_offs, trans_b, out_dtype, config, accum_pattern, b_quantized, fp8_wgrad, a_quantized
    ):
        fwd_dtype = fp8_dtype_for(config.format, is_forward=True)
        if a_quantized is None:
            qa, sa, qa_t = *_quantize_tokens(a, fwd_dtype, config), None
        else:
            qa, sa, qa_t = a_quantized.data, a_quantized.scale_inv, a_quantized.data_t
        dgrad = ctx.needs_input_grad[0]
        if b_quantized is None:
            (qb, sb), dgrad_b = _quantize_experts(b, fwd_dtype, config, trans_b, dgrad)
        else:
            (qb, sb), dgrad_b = b_quantized.forward, b_quantized.dgrad
        out = call_op(grouped_gemm_fp8_impl, qa, sa, qb, sb, group_offs, trans_b, out_dtype, _block(config))
        # backward reads the weights' dgrad copy only (made here, next to the forward's), and the FP8
        # tokens only for a tensorwise FP8 wgrad (the other recipes quantize a along the tokens instead)
        qb_d, sb_d = dgrad_b if dgrad else (None, None)
        tensorwise_wgrad = fp8_wgrad and config.granularity is _G.TENSORWISE and ctx.needs_input_grad[1]
        qa, sa, qa_t = (qa, sa, qa_t) if tensorwise_wgrad else (None, None, None)
        ctx.save_for_backward(a, b, group_offs, qa, sa, qa_t, qb_d, sb_d)
        ctx.trans_b, ctx.config, ctx.accum_pattern, ctx.fp8_wgrad = trans_b, config, accum_pattern, fp8_wgrad
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, group_offs, _, _, _, qb, sb = ctx.saved_tensors
        config, trans_b = ctx.config, ctx.trans_b
        gran, block = config.granularity, _block(config)
        grad_dtype = fp8_dtype_for(config.format, is_forward=False)
        fwd_dtype = fp8_dtype_for(config.format, is_forward=True)
        grad_out = grad_out.contiguous()
        grad_a = grad_b = None
        qg = sg = qg_t = None
        fp8_wgrad = ctx.needs_input_grad[1] and ctx.fp8_wgrad
        if gran is _G.TENSORWISE and fp8_wgrad:
            # one amax for both GEMMs; the transposed copy is the wgrad's token-major operand
            qg, sg, qg_t, _ = quantize_fp8_with_trans(grad_out, grad_dtype, gran)
        elif ctx.needs_input_grad[0]:
            qg, sg = _quantize_tokens(grad_out, grad_dtype, config)
        if ctx.needs_input_grad[0]:  # dgrad reduces over N: the weights' copy along N
            grad_a = call_op(grouped_gemm_fp8_impl, qg, sg, qb, sb, group_offs, not trans_b, a.dtype, block)
        if ctx.needs_input_grad[1] and not fp8_wgrad:  # in a's dtype from the unquantized operands
            grad_b = grouped_wgrad(a, grad_out, b, group_offs, trans_b, ctx.accum_pattern)
        elif fp8_wgrad:
            # one block layout (group_blocks' running total and first rows) for both quantizers and the GEMM
            ends, base = group_block_layout(group_offs, block) if block else (None, None)
            qg_t, sg_t, qa_t, sa_t = _wgrad_operands(ctx, grad_out, qg_t, sg, grad_dtype, fwd_dtype, ends)
            # [G, N, K] = per group dy^T a for the transposed layout, else [G, K, N] = a^T dy
            operands = (*((qg_t, sg_t, qa_t, sa_t) if trans_b else (qa_t, sa_t, qg_t, sg_t)), group_offs)
            if ctx.accum_pattern == "megatron":
                call_op(grouped_gemm_fp8_variable_k_accum_impl, *operands, b.main_grad, block, base)
                grad_b = finish_fused_wgrad(b)
            else:
                grad_b = call_op(grouped_gemm_fp8_variable_k_impl, *operands, b.dtype, block, base)
        return grad_a, grad_b, None, None, None, None, None, None, None, None


def _check_config(config: Float8QuantConfig | None) -> Float8QuantConfig:
    config = Float8QuantConfig() if config is None else config
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"config must be a Float8QuantConfig, got {config!r}")
    if config.granularity not in (_G.TENSORWISE, _G.ROWWISE, _G.BLOCKWISE):
        raise ValueError(
            f"grouped_gemm_fp8 takes TENSORWISE, ROWWISE or BLOCKWISE scaling, not {config.granularity.name}"
        )
    return config


def _check_block_multiples(k: int, n: int, config: Float8QuantConfig) -> None:
    if config.granularity is _G.BLOCKWISE and (k % config.block_size or n % config.block_size):
        raise ValueError(
            f"grouped_gemm_fp8: BLOCKWISE needs K ({k}) and N ({n}) to be multiples of "
            f"block_size ({config.block_size})"
        )


def _check_b_quantized(b_quantized: QuantizedExperts, b: torch.Tensor, trans_b: bool, config) -> None:
    if not isinstance(b_quantized, QuantizedExperts):
        raise TypeError(f"b_quantized must be a QuantizedExperts (quantize_fp8_experts), got {b_quantized!r}")
    made = (b_quantized.shape, b_quantized.trans_b, b_quantized.config)
    if made != (b.shape, trans_b, config):
        raise ValueError(
            f"b_quantized was made for shape {tuple(made[0])}, trans_b={made[1]}, {made[2]}; this call has "
            f"b of shape {tuple(b.shape)}, trans_b={trans_b}, {config}"
        )


def _quantized_tokens(a: QuantizedTensor, config: Float8QuantConfig, fp8_wgrad: bool) -> torch.Tensor:
    """The differentiable stand-in of a pre-quantized ``a`` (its ``hp`` or fused producer's anchor; else a
    constant of its shape), after checking that the GEMM can read it as it would quantize ``a`` itself."""
    check_quantized_tensor("a", a)
    if a.granularity is not _G.TENSORWISE or config.granularity is not _G.TENSORWISE:
        raise ValueError(
            f"a QuantizedTensor a is read under TENSORWISE scaling only (a is {a.granularity.name}, "
            f"config {config.granularity.name}): the other scalings quantize a along each group's tokens "
            "for the weight gradient"
        )
    expected = fp8_dtype_for(config.format, is_forward=True)
    if a.data.dtype != expected:
        raise TypeError(f"a.data must be {expected} for config {config.format.name}, got {a.data.dtype}")
    if a.hp is not None:
        return a.hp
    if not fp8_wgrad:
        raise ValueError("fp8_wgrad=False needs the high-precision a: pass a QuantizedTensor with hp")
    return a.grad_anchor if a.grad_anchor is not None else grad_anchor(a.data, a.orig_dtype)


def grouped_gemm_fp8(
    a: torch.Tensor | QuantizedTensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: torch.Tensor | None = None,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
    config: Float8QuantConfig | None = None,
    fuse_bgrad_accum_pattern: str | None = None,
    b_quantized: QuantizedExperts | None = None,
    fp8_wgrad: bool = True,
) -> torch.Tensor:
    """``grouped_gemm`` with FP8 operands (TENSORWISE, ROWWISE or BLOCKWISE ``config``, default
    tensorwise E4M3), differentiable in ``a`` and ``b``; ``out_dtype`` defaults to ``a``'s dtype.
    BLOCKWISE needs K and N to be multiples of the block size. ``b_quantized`` (``quantize_fp8_experts``
    of ``b`` with the same ``trans_b`` and ``config``) is read instead of quantizing ``b`` again.
    ``fp8_wgrad=False`` computes the weight gradient in a's dtype from the unquantized ``a`` and output
    gradient (the forward and dgrad stay FP8): no wgrad quantization, and the faster choice where
    each expert sees few tokens (the block-scaled wgrad then runs slower than the bf16 one).

    Under TENSORWISE scaling ``a`` may be a ``QuantizedTensor`` (a fused producer's output, such as
    ``swiglu_fp8``'s): its FP8 rows are read as they are (its ``data_t`` copy by the weight gradient) and
    the gradient goes to its ``hp`` or producer."""
    config = _check_config(config)
    a_quantized = None
    if isinstance(a, QuantizedTensor):
        a_quantized, a = a, _quantized_tokens(a, config, fp8_wgrad)
    check_grouped_args(a, b, group_lens, trans_b)
    _check_block_multiples(a.shape[1], b.shape[1] if trans_b else b.shape[2], config)
    if b_quantized is not None:
        _check_b_quantized(b_quantized, b, trans_b, config)
    if not isinstance(fp8_wgrad, bool):
        raise TypeError(f"fp8_wgrad must be a bool, got {fp8_wgrad!r}")
    check_fuse_bgrad_accum_pattern(fuse_bgrad_accum_pattern, b)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    check_dtype("out_dtype", out_dtype, _DTYPES)
    group_offs = compute_group_offs(group_lens) if group_offs is None else group_offs
    a = a if a.stride(-1) == 1 or a_quantized is not None else a.contiguous()
    return _GroupedGemmFp8Function.apply(
        a, b, group_offs, trans_b, out_dtype, config, fuse_bgrad_accum_pattern, b_quantized, fp8_wgrad,
        a_quantized,
    )  # fmt: skip
