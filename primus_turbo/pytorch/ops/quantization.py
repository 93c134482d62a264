"""FP8 quantization: ``quantize_fp8``, ``dequantize_fp8`` and ``quantize_fp8_with_trans``.

Scale rules, shared by every backend (the TORCH reference defines them bit for bit):

- ``scale_inv`` is the dequantization multiplier: ``x ~= q.float() * scale_inv`` over each group.
- A group's scale is ``fp8_max / amax`` (fp32, capped at the fp32 maximum); an all-zero group gets
  scale 1, so nothing divides by zero.
- MX_BLOCKWISE scales are powers of two stored as E8M0 (``torch.float8_e8m0fnu``):
  ``2 ** (floor(log2(amax)) - emax)``, with ``emax`` the element format's largest exponent (8 for E4M3,
  15 for E5M2), clamped to [2**-127, 2**127].
- Values beyond the FP8 range saturate to +-fp8_max (scaled values can only exceed it through
  rounding, and +-inf inputs).
- A group that holds NaN or +-inf gets ``scale_inv = NaN`` (the E8M0 NaN code for MX), so anything
  computed from it is NaN instead of a finite, silently wrong number. Its elements are stored with
  scale 1: finite values saturate, NaN stays NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    ScalingGranularity,
    ScalingRecipe,
    fp8_dtype_for,
)
from primus_turbo.pytorch.core.validation import check_dtype, check_tensor
from primus_turbo.pytorch.kernels.quantization.quantization_fp4_impl import (
    FP4_DTYPE,
    dequantize_fp4_impl,
    quantize_fp4_impl,
    quantize_fp4_with_trans_impl,
)
from primus_turbo.pytorch.kernels.quantization.quantization_impl import (
    FP8_DTYPES,
    dequantize_fp8_impl,
    quantize_fp8_impl,
    quantize_fp8_with_trans_impl,
)

__all__ = [
    "FUSED_FP8_GRANULARITIES",
    "QuantizedTensor",
    "check_quantized_tensor",
    "dequantize_fp4",
    "dequantize_fp8",
    "fused_fp8_output",
    "fused_fp8_settings",
    "grad_anchor",
    "quantize_fp4",
    "quantize_fp4_with_trans",
    "quantize_fp8",
    "quantize_fp8_with_trans",
]

_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_SIZES = (16, 32, 64, 128, 256)
_MX_BLOCK = 32


def _check_axis(axis: int | None, ndim: int, granularity: ScalingGranularity) -> int:
    if axis is None:
        raise ValueError(f"{granularity.name} needs axis: the dimension whose elements share a scale")
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"axis must be an int in [{-ndim}, {ndim}), got {axis!r}")
    return axis % ndim


def _resolve(
    shape: torch.Size,
    granularity: ScalingGranularity,
    block_size: int | None,
    axis: int | None,
    scaling_recipe: ScalingRecipe | None,
) -> tuple[int, int, bool]:
    """Validated ``(block_size, axis, block_2d)`` as the custom ops take them (0 = none)."""
    if not isinstance(granularity, ScalingGranularity):
        raise TypeError(f"granularity must be a ScalingGranularity, got {granularity!r}")
    if scaling_recipe is not None and not isinstance(scaling_recipe, ScalingRecipe):
        raise TypeError(f"scaling_recipe must be a ScalingRecipe or None, got {scaling_recipe!r}")
    recipe = scaling_recipe or ScalingRecipe()
    if recipe.use_sr or recipe.use_rht:
        raise ValueError("stochastic rounding and the Hadamard transform apply to FP4, not FP8 quantization")
    block_2d = recipe.use_2d_block
    ndim = len(shape)
    if granularity is ScalingGranularity.TENSORWISE:
        if block_size is not None or axis is not None or block_2d:
            raise ValueError("TENSORWISE takes no block_size, axis or 2-D block recipe")
        return 0, 0, False
    if granularity is ScalingGranularity.ROWWISE:
        if block_size is not None or block_2d:
            raise ValueError("ROWWISE takes no block_size or 2-D block recipe")
        return 0, _check_axis(axis, ndim, granularity), False
    if granularity is ScalingGranularity.MX_BLOCKWISE:
        if block_size not in (None, _MX_BLOCK) or block_2d:
            raise ValueError(f"MX_BLOCKWISE uses 1-D blocks of {_MX_BLOCK}, got block_size={block_size!r}")
        axis = _check_axis(axis, ndim, granularity)
        if shape[axis] % _MX_BLOCK:
            raise ValueError(f"MX_BLOCKWISE needs dimension {axis} ({shape[axis]}) to be a multiple of 32")
        return _MX_BLOCK, axis, False
    if block_size not in _BLOCK_SIZES:
        raise ValueError(f"BLOCKWISE needs block_size in {_BLOCK_SIZES}, got {block_size!r}")
    if block_2d:
        if axis is not None or ndim != 2:
            raise ValueError("2-D block scaling takes a 2-D tensor (a weight) and no axis")
        return block_size, 1, True
    return block_size, _check_axis(axis, ndim, granularity), False


def _check_input(x: torch.Tensor, out_dtype: torch.dtype) -> None:
    check_tensor("x", x)
    check_dtype("x.dtype", x.dtype, _HIGH_PRECISION)
    check_dtype("out_dtype", out_dtype, FP8_DTYPES)


def quantize_fp8(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: ScalingGranularity,
    *,
    block_size: int | None = None,
    axis: int | None = None,
    scaling_recipe: ScalingRecipe | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (fp32/bf16/fp16) to ``out_dtype`` (an FP8 dtype); returns ``(q, scale_inv)``.

    - TENSORWISE: one scale; ``scale_inv`` is a 0-d fp32 tensor.
    - ROWWISE: one scale per slice along ``axis`` (the dimension that shares a scale); ``scale_inv``
      has ``x``'s shape with ``axis`` reduced to 1.
    - BLOCKWISE: blocks of ``block_size`` along ``axis`` (1 x 128 for activations), or with
      ``ScalingRecipe(use_2d_block=True)`` ``block_size x block_size`` tiles of a 2-D weight; partial
      edge blocks are allowed. ``scale_inv`` holds one fp32 value per block.
    - MX_BLOCKWISE: blocks of 32 along ``axis`` with E8M0 power-of-two scales.

    ``q`` is contiguous with ``x``'s shape. The scales of 1-D blocks (BLOCKWISE along ``axis``, MX) are
    stored block-major: the slowest-varying dimension is the block index along ``axis``, the layout
    cuBLASLt's block-scaled GEMMs read. See the module docstring for zeros, saturation and NaN/inf.
    """
    _check_input(x, out_dtype)
    block, dim, block_2d = _resolve(x.shape, granularity, block_size, axis, scaling_recipe)
    return call_op(quantize_fp8_impl, x, out_dtype, granularity.value, block, dim, block_2d)


def dequantize_fp8(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: ScalingGranularity,
    *,
    block_size: int | None = None,
    axis: int | None = None,
    scaling_recipe: ScalingRecipe | None = None,
) -> torch.Tensor:
    """``q * scale_inv`` in ``out_dtype``, with the arguments ``quantize_fp8`` was given."""
    check_tensor("q", q)
    check_dtype("q.dtype", q.dtype, FP8_DTYPES)
    check_tensor("scale_inv", scale_inv)
    check_dtype("out_dtype", out_dtype, _HIGH_PRECISION)
    block, dim, block_2d = _resolve(q.shape, granularity, block_size, axis, scaling_recipe)
    return call_op(dequantize_fp8_impl, q, scale_inv, out_dtype, granularity.value, block, dim, block_2d)


def quantize_fp8_with_trans(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: ScalingGranularity,
    *,
    block_size: int | None = None,
    scaling_recipe: ScalingRecipe | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both quantized copies a GEMM's forward and backward need, from a 2-D ``x`` (M, K).

    Returns ``(q, scale_inv, q_t, scale_inv_t)``: ``q`` is ``x`` quantized along K (axis 1), ``q_t`` is
    ``x`` quantized along M and stored transposed as a contiguous (K, M) tensor, so the wgrad GEMM
    reads it row-major. Tensorwise and 2-D block scales do not depend on the direction: ``q_t`` is
    then ``q`` transposed and ``scale_inv_t`` the transposed scales. 1-D block scales (BLOCKWISE 1 x
    block, MX) are stored block-major, the rows of each block adjacent (strides ``(1, rows)``), the
    layout cuBLASLt's block-scaled GEMMs read, so no GEMM call has to copy them.

    Under 2-D block scaling ``x`` may also be a stack of weights (G, M, K) (experts): each slice is
    quantized on its own, ``q_t`` is (G, K, M) and the scales (G, M / B, K / B) and (G, K / B, M / B).
    """
    _check_input(x, out_dtype)
    block_2d = scaling_recipe is not None and scaling_recipe.use_2d_block
    if not (block_2d and x.dim() == 3):
        check_tensor("x", x, dim=2)
    axis = None if granularity is ScalingGranularity.TENSORWISE or block_2d else 1
    block, _, block_2d = _resolve(x.shape[-2:], granularity, block_size, axis, scaling_recipe)
    if granularity is ScalingGranularity.MX_BLOCKWISE and x.shape[0] % _MX_BLOCK:
        raise ValueError(f"MX_BLOCKWISE with_trans needs M ({x.shape[0]}) to be a multiple of 32")
    return call_op(quantize_fp8_with_trans_impl, x, out_dtype, granularity.value, block, block_2d)


def _check_fp4_layout(x: torch.Tensor, granularity: ScalingGranularity, block_size: int, axis: int) -> None:
    if granularity is not ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(f"FP4 quantization is MX_BLOCKWISE only, got {granularity!r}")
    if block_size != _MX_BLOCK:
        raise ValueError(f"MXFP4 uses blocks of {_MX_BLOCK}, got block_size={block_size!r}")
    if axis not in (-1, x.dim() - 1):
        raise ValueError(f"FP4 quantizes along the last dimension (axis=-1), got axis={axis!r}")


def quantize_fp4(
    x: torch.Tensor,
    granularity: ScalingGranularity = ScalingGranularity.MX_BLOCKWISE,
    *,
    block_size: int = _MX_BLOCK,
    axis: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of ``x`` along its last dimension: ``(q, scale_inv)``.

    ``q`` is (..., K / 2) ``torch.float4_e2m1fn_x2`` (two E2M1 values per byte, element ``2i`` in the
    low nibble); ``scale_inv`` is (..., K / 32) E8M0. Values round to nearest even on the E2M1 grid
    {0, 0.5, 1, 1.5, 2, 3, 4, 6} and saturate at 6 times the scale; an all-zero group has scale 1; a
    group holding NaN or inf gets a NaN scale. K must be a multiple of 32.
    """
    check_tensor("x", x)
    check_dtype("x.dtype", x.dtype, _HIGH_PRECISION)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    _check_fp4_layout(x, granularity, block_size, axis)
    if x.shape[-1] % _MX_BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension ({x.shape[-1]}) to be a multiple of 32")
    return call_op(quantize_fp4_impl, x)


def dequantize_fp4(
    q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype, *, axis: int = -1
) -> torch.Tensor:
    """The values of ``quantize_fp4``'s ``(q, scale_inv)`` in ``out_dtype`` (exact for bf16 and fp32)."""
    check_tensor("q", q)
    check_dtype("q.dtype", q.dtype, (FP4_DTYPE, torch.uint8))
    check_tensor("scale_inv", scale_inv)
    check_dtype("out_dtype", out_dtype, _HIGH_PRECISION)
    _check_fp4_layout(q, ScalingGranularity.MX_BLOCKWISE, _MX_BLOCK, axis)
    if scale_inv.shape != (*q.shape[:-1], 2 * q.shape[-1] // _MX_BLOCK):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match q {tuple(q.shape)}")
    return call_op(dequantize_fp4_impl, q, scale_inv, out_dtype)


def quantize_fp4_with_trans(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 copies of a 2-D ``x`` (M, K) along K, and along M stored as (K, M / 2), in one call."""
    check_tensor("x", x, dim=2)
    check_dtype("x.dtype", x.dtype, _HIGH_PRECISION)
    if x.shape[0] % _MX_BLOCK or x.shape[1] % _MX_BLOCK:
        raise ValueError(f"MXFP4 with_trans needs M and K to be multiples of 32, got {tuple(x.shape)}")
    return call_op(quantize_fp4_with_trans_impl, x)


@dataclass(frozen=True)
class QuantizedTensor:
    """An FP8 tensor with its ``scale_inv`` and the settings that made them (see ``quantize_fp8``).

    Pass one to ``gemm_fp8`` to reuse a quantization (a cached FP8 weight, say). ``hp`` is the
    high-precision tensor it was quantized from, when there is one to differentiate: ``gemm_fp8`` then
    reads the FP8 data in forward and sends the gradient to ``hp``. ``data_t``/``scale_inv_t``, when
    present, are the copy quantized along dimension 0 and stored transposed (``quantize_fp8_with_trans``'s
    ``q_t``), which ``gemm_fp8`` reads for the weight gradient instead of quantizing again.

    A fused producer (``rmsnorm_fp8``, ``swiglu_fp8``) writes no high-precision output: it sets
    ``grad_anchor`` instead of ``hp``, a tensor of ``data``'s shape with no storage behind its elements
    (all strides 0), through which the gradient of its output reaches it. Without ``hp`` or
    ``grad_anchor`` the GEMM does not differentiate through the operand.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    granularity: ScalingGranularity
    block_size: int | None = None
    axis: int | None = None
    scaling_recipe: ScalingRecipe | None = None
    orig_dtype: torch.dtype = torch.bfloat16
    hp: torch.Tensor | None = None
    data_t: torch.Tensor | None = None
    scale_inv_t: torch.Tensor | None = None
    grad_anchor: torch.Tensor | None = None

    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        dtype: torch.dtype,
        granularity: ScalingGranularity,
        *,
        block_size: int | None = None,
        axis: int | None = None,
        scaling_recipe: ScalingRecipe | None = None,
    ) -> QuantizedTensor:
        """``quantize_fp8`` of ``x``, kept together with its settings."""
        data, scale_inv = quantize_fp8(
            x, dtype, granularity, block_size=block_size, axis=axis, scaling_recipe=scaling_recipe
        )
        return cls(data, scale_inv, granularity, block_size, axis, scaling_recipe, x.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def block_2d(self) -> bool:
        return self.scaling_recipe is not None and self.scaling_recipe.use_2d_block

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision values ``data * scale_inv`` (in ``orig_dtype`` unless ``dtype`` is given)."""
        return dequantize_fp8(
            self.data,
            self.scale_inv,
            dtype or self.orig_dtype,
            self.granularity,
            block_size=self.block_size,
            axis=self.axis,
            scaling_recipe=self.scaling_recipe,
        )


def check_quantized_tensor(name: str, x: QuantizedTensor) -> None:
    """A 2-D ``QuantizedTensor`` operand whose ``hp`` and ``data_t`` fit its ``data``."""
    check_tensor(f"{name}.data", x.data, dim=2)
    if x.hp is not None and x.hp.shape != x.data.shape:
        raise ValueError(f"{name}.hp has shape {tuple(x.hp.shape)}, {name}.data {tuple(x.data.shape)}")
    if x.data_t is not None and x.data_t.shape != x.data.shape[::-1]:
        raise ValueError(
            f"{name}.data_t has shape {tuple(x.data_t.shape)}, {name}.data {tuple(x.data.shape)}"
        )


# the scalings a fused producer (rmsnorm_fp8, swiglu_fp8) writes; MX blocks have none
FUSED_FP8_GRANULARITIES = (
    ScalingGranularity.TENSORWISE,
    ScalingGranularity.ROWWISE,
    ScalingGranularity.BLOCKWISE,
)


def fused_fp8_settings(config: object, producer: str) -> tuple[torch.dtype, int, int]:
    """``(fp8 dtype, granularity value, block size)`` for a producer that emits its output in FP8
    along the last dimension (``rmsnorm_fp8``, ``swiglu_fp8``): E4M3 under HYBRID, no MX."""
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"config must be a Float8QuantConfig, got {config!r}")
    if config.granularity not in FUSED_FP8_GRANULARITIES:
        raise ValueError(
            f"{producer} fuses TENSORWISE, ROWWISE or BLOCKWISE scaling, not {config.granularity.name}"
        )
    if config.granularity is ScalingGranularity.BLOCKWISE and config.block_size not in _BLOCK_SIZES:
        raise ValueError(f"{producer} needs block_size in {_BLOCK_SIZES}, got {config.block_size}")
    return fp8_dtype_for(config.format, is_forward=True), config.granularity.value, config.block_size or 0


def grad_anchor(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` tensor of ``q``'s shape whose elements share one storage element (strides 0): the
    differentiable output of a producer that writes its values only in FP8 (``q``)."""
    return torch.empty_strided(q.shape, (0,) * q.dim(), dtype=dtype, device=q.device)


def fused_fp8_output(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    q_t: torch.Tensor,
    scale_inv_t: torch.Tensor,
    config: Float8QuantConfig,
    anchor: torch.Tensor,
    columnwise: bool,
) -> QuantizedTensor:
    """The ``QuantizedTensor`` a fused producer returns: its FP8 data along the last dimension, the
    column-wise copy when ``columnwise``, and the producer's ``grad_anchor``."""
    axis = None if config.granularity is ScalingGranularity.TENSORWISE else 1
    column = (q_t, scale_inv_t) if columnwise else (None, None)
    return QuantizedTensor(
        q, scale_inv, config.granularity, config.block_size, axis, None, anchor.dtype, None, *column, anchor
    )
