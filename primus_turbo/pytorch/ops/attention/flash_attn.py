"""Dense flash attention with autograd: ``flash_attn_func``."""

from __future__ import annotations

import math

import torch

from primus_turbo.common.constants import ENV_DEBUG_CHECKS
from primus_turbo.common.env import env_reader
from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.attention.flash_attn_impl import (
    Varlen,
    flash_attn_bwd_impl,
    flash_attn_fwd_impl,
    flash_attn_varlen_bwd_impl,
    flash_attn_varlen_fwd_impl,
    package_attention,
    resolve_attention_backend,
    sdpa_attention,
    sdpa_runs,
)
from primus_turbo.triton.attention import MAX_HEAD_DIM

_debug_checks_env = env_reader(ENV_DEBUG_CHECKS)

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_grad(grad_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output gradient in the inputs' dtype with unit stride along the head dimension."""
    grad_out = grad_out.to(dtype)
    return grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()


def _run(function: type[torch.autograd.Function], forward_op, args: tuple, grads_from, return_lse: bool):
    """Through ``function`` when a gradient is needed (any of ``grads_from`` requires one), else the
    forward custom op alone; ``out`` or ``(out, lse)``."""
    needs_grad = any(t is not None and t.requires_grad for t in grads_from)
    if torch.is_grad_enabled() and needs_grad:
        out, lse = function.apply(*args)
    else:
        out, lse = call_op(forward_op, *args)
    return (out, lse) if return_lse else out


class _FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, scale, left, right, backend):
        out, lse = call_op(flash_attn_fwd_impl, q, k, v, sink, scale, left, right, backend)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.scale, ctx.left, ctx.right, ctx.backend = scale, left, right, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        grad_out = kernel_grad(grad_out, q.dtype)
        dq, dk, dv, dsink = call_op(
            flash_attn_bwd_impl,
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            sink,
            ctx.scale,
            ctx.left,
            ctx.right,
            ctx.backend,
        )
        return dq, dk, dv, (dsink if sink is not None else None), None, None, None, None


class _FlashAttnVarlenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, sink, scale, left, right, backend):
        packing = (cu_q, cu_k, max_q, max_k)
        out, lse = call_op(flash_attn_varlen_fwd_impl, q, k, v, *packing, sink, scale, left, right, backend)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sink)
        ctx.lengths, ctx.scale, ctx.window, ctx.backend = (max_q, max_k), scale, (left, right), backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, cu_q, cu_k, sink = ctx.saved_tensors
        grad_out = kernel_grad(grad_out, q.dtype)
        dq, dk, dv, dsink = call_op(
            flash_attn_varlen_bwd_impl,
            grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.lengths, sink, ctx.scale, *ctx.window, ctx.backend,
        )  # fmt: skip
        dsink = dsink if sink is not None else None
        return dq, dk, dv, None, None, None, None, dsink, None, None, None, None


def window_bounds(causal: bool, window_size: tuple[int, int], s_q: int, s_k: int) -> tuple[int, int]:
    """(left, right) key bounds around the diagonal (-1: unbounded); causal caps right at 0, and a bound
    that reaches past every key (>= Sq + Sk) is unbounded, so all backends compute the same thing."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    ):
        raise ValueError(f"window_size must be two ints >= -1 (-1: unbounded), got {window_size!r}")
    left, right = (-1 if bound >= s_q + s_k else bound for bound in window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float | None,
    sink: torch.Tensor | None,
) -> float:
    """Shapes, dtypes, devices, strides and options of a dense attention call; returns the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dim=4)
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} needs unit stride along its last (head) dimension, got strides {t.stride()}"
            )
    check_dtype("q.dtype", q.dtype, _DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_same_device(q=q, k=k, v=v, **({"sink": sink} if sink is not None else {}))
    b, _, h_q, d_qk = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must share [B, S, H]: k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != d_qk:
        raise ValueError(f"q and k head dims differ: {d_qk} and {k.shape[3]}")
    h_kv = k.shape[2]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of key/value heads ({h_kv})")
    if max(d_qk, v.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported, got q/k {d_qk} and v {v.shape[3]}")
    if dropout_p != 0.0:
        raise ValueError(f"attention dropout is not supported (dropout_p must be 0.0, got {dropout_p})")
    if sink is not None:
        check_tensor("sink", sink, dim=1)
        if sink.dtype != torch.float32 or sink.shape[0] != h_q:
            raise ValueError(
                f"sink must be fp32 [{h_q}] (one logit per query head), got {sink.dtype} {tuple(sink.shape)}"
            )
    if softmax_scale is None:
        return d_qk**-0.5 if d_qk else 1.0
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float, got {softmax_scale!r}")
    if not 0 < softmax_scale < math.inf:  # the kernels take row maxima of unscaled scores
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale!r}")
    return float(softmax_scale)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sink: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over logical [B, S, H, D] tensors, differentiable in q, k, v and ``sink``.

    ``q`` [B, Sq, Hq, Dqk], ``k`` [B, Sk, Hkv, Dqk], ``v`` [B, Sk, Hkv, Dv]; the memory layout may be bshd,
    sbhd (Megatron's sequence-first views) or bhsd, read through strides without copies, and the output
    [B, Sq, Hq, Dv] takes q's layout. ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA). ``causal`` aligns the
    mask to the bottom-right corner when Sq != Sk; ``window_size=(left, right)`` limits each query to keys
    within ``left`` before and ``right`` after its diagonal (-1: unbounded). ``sink`` is a learned fp32
    logit per query head added to every softmax denominator. Rows that see no key return zeros.
    ``deterministic`` keeps the call off SDPA's fused kernels (their backward may add with atomics); this
    library's kernels never use atomics. ``return_lse`` also returns the fp32 log-sum-exp [B, Hq, Sq].
    """
    scale = check_attention_args(q, k, v, dropout_p, softmax_scale, sink)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    left, right = window_bounds(causal, window_size, q.shape[1], k.shape[1])
    sdpa = not (return_lse or deterministic)
    backend = resolve_attention_backend(q, k, v, sink, scale, left, right, sdpa=sdpa)
    if sdpa and sdpa_runs(backend, q, k, sink, left, right):
        return sdpa_attention(q, k, v, scale, right)
    package = package_attention(backend)
    if package is not None:
        return package.run(q, k, v, scale, left, right, deterministic, return_lse)
    args = (q, k, v, sink, scale, left, right, backend)
    return _run(_FlashAttnFunction, flash_attn_fwd_impl, args, (q, k, v, sink), return_lse)


def _check_cu_seqlens(cu_q, cu_k, max_q, max_k, tokens_q: int, tokens_k: int, device: torch.device) -> None:
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        check_tensor(name, cu, dim=1)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.device != device:
            raise ValueError(f"{name} must be on {device} with q, got {cu.device}")
    if cu_q.numel() < 1 or cu_q.numel() != cu_k.numel():
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must both hold B + 1 offsets, "
            f"got {cu_q.numel()} and {cu_k.numel()}"
        )
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    # the offsets' values: where they already are on the host, or when asked; never while compiling
    if torch.compiler.is_compiling():
        return
    if cu_q.device.type != "cpu" and _debug_checks_env() != "1":
        return
    for name, cu, tokens, longest in (
        ("cu_seqlens_q", cu_q, tokens_q, max_q),
        ("cu_seqlens_k", cu_k, tokens_k, max_k),
    ):
        lengths = cu.diff()
        if int(cu[0]) != 0 or int(cu[-1]) != tokens or bool((lengths < 0).any()):
            raise ValueError(f"{name} must rise from 0 to {tokens} (the packed tokens), got {cu.tolist()}")
        if lengths.numel() and int(lengths.max()) > longest:
            raise ValueError(
                f"{name} holds a sequence of {int(lengths.max())} tokens, over the max of {longest}"
            )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sink: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_func`` over packed sequences (THD): ``q`` [Tq, Hq, Dqk], ``k`` [Tk, Hkv, Dqk],
    ``v`` [Tk, Hkv, Dv], where sequence ``i`` holds rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` (int32
    [B + 1] on the tensors' device) of at most ``max_seqlen`` tokens. Masks, windows and sinks apply per
    sequence. Returns ``out`` [Tq, Hq, Dv] (and the fp32 ``lse`` [Hq, Tq] with ``return_lse``). The
    offsets' values are checked where they are on the host, or with ``PRIMUS_TURBO_DEBUG_CHECKS=1``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dim=3)
    scale = check_attention_args(q[None], k[None], v[None], dropout_p, softmax_scale, sink)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    _check_cu_seqlens(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0], q.device
    )
    left, right = window_bounds(causal, window_size, max_seqlen_q, max_seqlen_k)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    backend = resolve_attention_backend(q, k, v, sink, scale, left, right, varlen)
    package = package_attention(backend)
    if package is not None:
        return package.run(q, k, v, scale, left, right, deterministic, return_lse, varlen)
    args = (
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        sink,
        scale,
        left,
        right,
        backend,
    )
    return _run(_FlashAttnVarlenFunction, flash_attn_varlen_fwd_impl, args, (q, k, v, sink), return_lse)
