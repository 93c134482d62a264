"""FP8 GEMM with autograd: ``gemm_fp8(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern)``.

Every GEMM of the step runs in the NT layout on FP8 copies quantized along its reduction dimension:

- forward ``out = A @ B`` reads ``A`` (M, K) and ``B^T`` (N, K), both quantized along K;
- dgrad ``dA = G @ B^T`` reads ``G`` (M, N) and ``B`` stored as (K, N), both quantized along N;
- wgrad ``dB = A^T @ G`` reads ``G^T`` (N, M) and ``A^T`` (K, M), both quantized along M.

``quantize_fp8_with_trans`` makes each operand's two copies in one pass, so backward reuses the
forward's column-wise copies instead of quantizing again. Scaling roles per granularity:

| granularity | activations and gradients | weights |
| --- | --- | --- |
| TENSORWISE | one scale | one scale |
| ROWWISE | one scale per row along the reduction dimension | same |
| BLOCKWISE | 1 x block along the reduction dimension | block x block tiles (used in both directions) |
| MX_BLOCKWISE | 1 x 32, E8M0 | 1 x 32, E8M0 |

``Format.HYBRID`` quantizes forward operands to E4M3 and gradients to E5M2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.fused_wgrad import check_fuse_bgrad_accum_pattern, finish_fused_wgrad
from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    ScalingGranularity,
    ScalingRecipe,
    fp8_dtype_for,
)
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import gemm_fp8_accum_impl, gemm_fp8_impl
from primus_turbo.pytorch.ops.quantization import (
    QuantizedTensor,
    check_quantized_tensor,
    quantize_fp8,
    quantize_fp8_with_trans,
)

__all__ = ["gemm_fp8", "quantize_fp8_weight"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_G = ScalingGranularity


class _Operand(NamedTuple):
    """FP8 copies of one operand: along the forward reduction dimension, and along the other one."""

    q: torch.Tensor
    scale: torch.Tensor
    q_other: torch.Tensor | None
    scale_other: torch.Tensor | None
    block_2d: bool


def _block(config: Float8QuantConfig) -> int:
    return config.block_size or 0


def _quantize_operand(
    x: torch.Tensor, dtype: torch.dtype, config: Float8QuantConfig, weight: bool, other: bool
):
    """Quantize a logical (rows, K) operand along K, and along rows too when ``other``."""
    block_2d = weight and config.granularity is _G.BLOCKWISE
    recipe = ScalingRecipe(use_2d_block=True) if block_2d else None
    block = config.block_size
    if other:
        q, s, q_t, s_t = quantize_fp8_with_trans(
            x, dtype, config.granularity, block_size=block, scaling_recipe=recipe
        )
        return _Operand(q, s, q_t, s_t, block_2d)
    axis = None if config.granularity is _G.TENSORWISE or block_2d else 1
    q, s = quantize_fp8(x, dtype, config.granularity, block_size=block, axis=axis, scaling_recipe=recipe)
    return _Operand(q, s, None, None, block_2d)


def quantize_fp8_weight(weight: torch.Tensor, config: Float8QuantConfig) -> QuantizedTensor:
    """A [N, K] weight quantized once for ``gemm_fp8(x, w, trans_b=True, config=config)`` calls: the copy
    along K the forward reads and the copy along N the input gradient reads, made as the GEMM would make
    them (2-D blocks for BLOCKWISE). Reuse it while the weight is unchanged (across micro-batches); the
    weight gradient still reaches ``weight``."""
    dtype = fp8_dtype_for(config.format, is_forward=True)
    with torch.no_grad():
        op = _quantize_operand(weight, dtype, config, weight=True, other=True)
    recipe = ScalingRecipe(use_2d_block=True) if op.block_2d else None
    axis = None if config.granularity is _G.TENSORWISE or op.block_2d else 1
    return QuantizedTensor(
        op.q,
        op.scale,
        config.granularity,
        config.block_size,
        axis,
        recipe,
        weight.dtype,
        hp=weight,
        data_t=op.q_other,
        scale_inv_t=op.scale_other,
    )


def _prequantized_operand(qt: QuantizedTensor, trans: bool, other: bool) -> _Operand:
    """Copies of a ``QuantizedTensor`` whose logical (rows, K) view is ``data.t()`` when ``trans``.

    The other copy is ``qt.data_t`` when the tensor carries one (a fused producer's column-wise copy).
    Otherwise tensorwise and 2-D block scales serve both directions, so it is a transposed copy; other
    scalings are quantized along the reduction dimension only, and their other copy is quantized from
    ``qt.hp`` when there is one, else from the dequantized values (a second rounding).
    """
    if not trans and qt.data_t is not None:
        column = (qt.data_t, qt.scale_inv_t) if other else (None, None)
        return _Operand(qt.data.contiguous(), qt.scale_inv, *column, qt.block_2d)
    q, s = (qt.data.t(), qt.scale_inv.t()) if trans else (qt.data, qt.scale_inv)
    q, s = q.contiguous(), s.contiguous()
    direction_free = qt.granularity is _G.TENSORWISE or qt.block_2d
    q_other = s_other = None
    if other and direction_free:
        q_other, s_other = q.t().contiguous(), s.t().contiguous()
    elif other:
        values = qt.hp if qt.hp is not None else qt.dequantize(torch.float32)
        values = values.t() if trans else values
        q_other, s_other = quantize_fp8(
            values.t(), qt.data.dtype, qt.granularity, block_size=qt.block_size, axis=1
        )
    return _Operand(q, s, q_other, s_other, qt.block_2d)


def _operand(x, qt, trans: bool, dtype: torch.dtype, config: Float8QuantConfig, weight: bool, other: bool):
    """Copies of an operand as stored (its logical (rows, K) form is the transpose when ``trans``):
    taken from the ``QuantizedTensor`` ``qt``, or quantized here from ``x``."""
    if qt is not None:
        return _prequantized_operand(qt, trans, other)
    return _quantize_operand(x.t() if trans else x, dtype, config, weight, other)


class _GemmFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, a_quantized, b_quantized, trans_a, trans_b, out_dtype, config, accum_pattern):
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fwd_dtype = fp8_dtype_for(config.format, is_forward=True)
        # logical A (M, K) and B^T (N, K): b is (N, K) when trans_b, else (K, N)
        lhs = _operand(a, a_quantized, trans_a, fwd_dtype, config, weight=False, other=need_b)
        rhs = _operand(b, b_quantized, not trans_b, fwd_dtype, config, weight=True, other=need_a)
        block = _block(config)
        gran = config.granularity.value
        out = call_op(
            gemm_fp8_impl, lhs.q, lhs.scale, rhs.q, rhs.scale, out_dtype, gran, block, False, rhs.block_2d
        )
        ctx.save_for_backward(lhs.q_other, lhs.scale_other, rhs.q_other, rhs.scale_other)
        ctx.trans_a, ctx.trans_b, ctx.rhs_2d = trans_a, trans_b, rhs.block_2d
        ctx.config, ctx.accum_pattern = config, accum_pattern
        ctx.a_dtype = a.dtype if a is not None else a_quantized.orig_dtype
        ctx.b = b if accum_pattern == "megatron" else None
        ctx.b_dtype = b.dtype if b is not None else b_quantized.orig_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a_t, a_t_scale, b_t, b_t_scale = ctx.saved_tensors
        config = ctx.config
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_dtype = fp8_dtype_for(config.format, is_forward=False)
        gran, block = config.granularity.value, _block(config)
        grad = _quantize_operand(grad_out, grad_dtype, config, weight=False, other=need_b)
        grad_a = grad_b = None
        if need_a:
            # dA = G @ B from G (M, N) and B stored (K, N), both along N; a stored (K, M) gets dA^T
            if ctx.trans_a:
                grad_a = call_op(
                    gemm_fp8_impl,
                    b_t,
                    b_t_scale,
                    grad.q,
                    grad.scale,
                    ctx.a_dtype,
                    gran,
                    block,
                    ctx.rhs_2d,
                    False,
                )
            else:
                grad_a = call_op(
                    gemm_fp8_impl,
                    grad.q,
                    grad.scale,
                    b_t,
                    b_t_scale,
                    ctx.a_dtype,
                    gran,
                    block,
                    False,
                    ctx.rhs_2d,
                )
        if need_b:
            # dB = A^T @ G from G^T (N, M) and A^T (K, M), both along M
            lhs, rhs = (grad.q_other, grad.scale_other), (a_t, a_t_scale)
            if not ctx.trans_b:
                lhs, rhs = rhs, lhs
            if ctx.accum_pattern == "megatron":
                b = ctx.b
                call_op(gemm_fp8_accum_impl, *lhs, *rhs, b.main_grad, gran, block, False, False)
                grad_b = finish_fused_wgrad(b)
            else:
                grad_b = call_op(gemm_fp8_impl, *lhs, *rhs, ctx.b_dtype, gran, block, False, False)
        return grad_a, grad_b, None, None, None, None, None, None, None


def _check_operand(name: str, x) -> None:
    if isinstance(x, QuantizedTensor):
        check_quantized_tensor(name, x)
        return
    check_tensor(name, x, dim=2)
    check_dtype(f"{name}.dtype", x.dtype, _DTYPES)


def _check_prequantized(name: str, x, trans: bool, k_axis_when_trans: int, config: Float8QuantConfig) -> None:
    """A ``QuantizedTensor`` operand must be quantized the way this GEMM reads it: the config's
    granularity and block size, along K (direction-free tensorwise or 2-D block scales aside; 2-D
    blocks only for the weight ``b``)."""
    if not isinstance(x, QuantizedTensor):
        return
    if x.granularity is not config.granularity:
        raise ValueError(
            f"{name} was quantized {x.granularity.name}, but config is {config.granularity.name}"
        )
    if x.granularity is _G.TENSORWISE:
        return
    if x.block_2d:
        if name == "a":
            raise ValueError("a QuantizedTensor with 2-D block scales can only be the weight b")
    else:
        k_axis = k_axis_when_trans if trans else 1 - k_axis_when_trans
        if x.axis is None or x.axis % 2 != k_axis:
            raise ValueError(
                f"{name} must be quantized along K (axis {k_axis} of its stored layout), got axis {x.axis}"
            )
    if x.granularity in (_G.BLOCKWISE, _G.MX_BLOCKWISE) and (x.block_size or 32) != (config.block_size or 32):
        raise ValueError(
            f"{name} was quantized with block_size {x.block_size}, config has {config.block_size}"
        )


def _check_args(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern) -> torch.dtype:
    _check_operand("a", a)
    _check_operand("b", b)
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"config must be a Float8QuantConfig, got {config!r}")
    for name, flag in (("trans_a", trans_a), ("trans_b", trans_b)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    a_data = a.data if isinstance(a, QuantizedTensor) else a
    b_data = b.data if isinstance(b, QuantizedTensor) else b
    check_same_device(a=a_data, b=b_data)
    m, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
    if k != k_b:
        raise ValueError(f"inner dimensions differ: op(a) is ({m}, {k}) and op(b) is ({k_b}, {n})")
    granularity = config.granularity
    if granularity is _G.BLOCKWISE and k % config.block_size:
        raise ValueError(f"BLOCKWISE needs K ({k}) to be a multiple of block_size ({config.block_size})")
    if granularity is _G.MX_BLOCKWISE and (m % 32 or n % 32 or k % 32):
        raise ValueError(f"MX_BLOCKWISE needs M, N and K to be multiples of 32, got ({m}, {n}, {k})")
    _check_prequantized("a", a, trans_a, k_axis_when_trans=0, config=config)
    _check_prequantized("b", b, trans_b, k_axis_when_trans=1, config=config)
    if out_dtype is None:
        hp = [x.dtype for x in (a, b) if isinstance(x, torch.Tensor)]
        out_dtype = hp[0] if hp else a.orig_dtype
    check_dtype("out_dtype", out_dtype, _DTYPES)
    # a cached FP8 weight accumulates into its high-precision source's main_grad
    check_fuse_bgrad_accum_pattern(fuse_bgrad_accum_pattern, _differentiable(b))
    return out_dtype


def _differentiable(x) -> torch.Tensor | None:
    """What the GEMM's gradient for ``x`` flows to: the tensor itself, or a ``QuantizedTensor``'s
    high-precision source or producer anchor."""
    if not isinstance(x, QuantizedTensor):
        return x
    return x.hp if x.hp is not None else x.grad_anchor


def gemm_fp8(
    a: torch.Tensor | QuantizedTensor,
    b: torch.Tensor | QuantizedTensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
    config: Float8QuantConfig | None = None,
    fuse_bgrad_accum_pattern: str | None = None,
) -> torch.Tensor:
    """``op(a) @ op(b)`` with FP8 operands, differentiable in high-precision ``a`` and ``b``.

    ``a`` is (M, K), or (K, M) with ``trans_a``; ``b`` is (K, N), or (N, K) with ``trans_b``. Each may be
    an fp16/bf16/fp32 tensor (quantized here with ``config``, default tensorwise E4M3) or a
    ``QuantizedTensor`` quantized along K with the same granularity; the gradient reaches its ``hp``
    source or the fused producer behind its ``grad_anchor`` (``rmsnorm_fp8``), and nothing otherwise.
    ``out_dtype`` defaults to the high-precision input dtype. ``fuse_bgrad_accum_pattern="megatron"``
    adds the weight gradient into ``b.main_grad`` as Megatron's gradient-accumulation fusion expects.
    """
    config = Float8QuantConfig() if config is None else config
    out_dtype = _check_args(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern)
    a_quantized = a if isinstance(a, QuantizedTensor) else None
    b_quantized = b if isinstance(b, QuantizedTensor) else None
    a_source = _differentiable(a)
    b_source = _differentiable(b)
    return _GemmFp8Function.apply(
        a_source,
        b_source,
        a_quantized,
        b_quantized,
        trans_a,
        trans_b,
        out_dtype,
        config,
        fuse_bgrad_accum_pattern,
    )
