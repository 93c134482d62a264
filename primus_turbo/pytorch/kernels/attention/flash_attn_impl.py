"""Flash attention custom ops ``primus_turbo::flash_attn_fwd`` / ``flash_attn_bwd`` and their backends.

The public op resolves one backend per call (``AttentionDispatcher.resolve``) and passes its name to
both custom ops, so the backward runs on the backend that ran the forward. Tensors are logical
[B, S, H, D] views of any layout with unit stride along D; outputs and gradients take their inputs'
layouts (``empty_in_layout``), in the real and the fake impls alike.

Window convention (both backends): query ``i`` sees key ``j`` when
``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; a negative bound is unbounded.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Hashable
from typing import Any, ClassVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    GlobalBackendManager,
    KernelBackend,
    precision_of,
)
from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.triton.attention import Varlen, flash_attn_bwd_triton, flash_attn_fwd_triton
from primus_turbo.triton.utils.device_info import interpreter_active, triton_unavailable_reason

__all__ = [
    "AttentionDispatcher",
    "Varlen",
    "empty_in_layout",
    "flash_attn_bwd_impl",
    "flash_attn_fwd_impl",
    "flash_attn_varlen_bwd_impl",
    "flash_attn_varlen_fwd_impl",
    "package_attention",
    "resolve_attention_backend",
    "sdpa_attention",
    "sdpa_runs",
]


def empty_in_layout(
    like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An empty tensor of logical ``shape`` whose dimensions lie in memory in the order of ``like``'s
    (bshd, sbhd, bhsd, ...), dense. Dense bshd and sbhd answer without sorting strides (host time on every
    call)."""
    if like.is_contiguous():
        return like.new_empty(shape, dtype=dtype or like.dtype)
    if like.dim() > 1 and like.transpose(0, 1).is_contiguous():
        swapped = (shape[1], shape[0], *shape[2:])
        return like.new_empty(swapped, dtype=dtype or like.dtype).transpose(0, 1)
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
    dense = like.new_empty([shape[d] for d in order], dtype=dtype or like.dtype)
    return dense.permute([order.index(d) for d in range(like.dim())])


def _allowed(s_q: int, s_k: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """[Sq, Sk] bool: the window rule of the module docstring."""
    rows = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    cols = torch.arange(s_k, device=device)[None, :]
    ok = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= cols <= rows + right
    if left >= 0:
        ok &= cols >= rows - left
    return ok


def _heads_first(t: torch.Tensor, group: int = 1) -> torch.Tensor:
    """fp32 [B, H * group, S, D] from [B, S, H, D], each head repeated ``group`` times (GQA)."""
    t = t.float().permute(0, 2, 1, 3)
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _probabilities(q, k, sink, scale, left, right):
    """(P [B, Hq, Sq, Sk] fp32, lse [B, Hq, Sq]) of the masked softmax with the optional sink logit."""
    group = q.shape[2] // k.shape[2]
    scores = _heads_first(q) @ _heads_first(k, group).transpose(-1, -2) * scale
    scores = scores.masked_fill(~_allowed(q.shape[1], k.shape[1], left, right, q.device), float("-inf"))
    if sink is not None:
        sink_col = sink.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([scores, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    return torch.exp(scores - safe[..., None]), lse


def _sdpa_covers(q: torch.Tensor, k: torch.Tensor, sink, left: int, right: int) -> bool:
    """Whether ``scaled_dot_product_attention`` computes this call: no sink, no left window, no mask or
    a causal one on square scores (where its top-left alignment is the bottom-right one), no empty axis."""
    if sink is not None or left >= 0 or 0 in (*q.shape[:3], k.shape[1]):
        return False
    return right < 0 or (right == 0 and q.shape[1] == k.shape[1])


# SDPA's own order prefers the flash kernel; on Hopper cuDNN's forward + backward is about 1.8x faster
# (docs/performance.md), so it goes first and PyTorch falls back along the list.
_SDPA_PRIORITY = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
_SDPA_PRIORITY_ORDER = [int(b) for b in _SDPA_PRIORITY]
_SDPA_FUSED = (
    torch.backends.cuda.can_use_cudnn_attention,
    torch.backends.cuda.can_use_flash_attention,
    torch.backends.cuda.can_use_efficient_attention,
)


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """The [B, H, S, D] view SDPA takes of a [B, S, H, D] tensor."""
    return t.transpose(1, 2)


def _sdpa_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, right: int) -> bool:
    """Whether one of SDPA's fused CUDA kernels (cuDNN, flash, memory-efficient) takes this call, so that
    routing it to SDPA never lands on the math fallback."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _sdpa_fused_for(index, q.dtype, q.shape[2], k.shape[2], q.shape[3], v.shape[3], right == 0)


@torch.compiler.assume_constant_result
def _sdpa_fused_for(
    index: int, dtype: torch.dtype, h_q: int, h_kv: int, d_qk: int, d_v: int, causal: bool
) -> bool:
    """``_sdpa_fused`` by head shape (dynamo cannot build ``SDPAParams``, so compiled code takes the
    answer as a constant)."""
    return _sdpa_fused_cached(index, dtype, h_q, h_kv, d_qk, d_v, causal)


@functools.lru_cache(maxsize=None)
def _sdpa_fused_cached(
    index: int, dtype: torch.dtype, h_q: int, h_kv: int, d_qk: int, d_v: int, causal: bool
) -> bool:
    q, k, v = (
        torch.empty(1, h, 128, d, dtype=dtype, device=torch.device("cuda", index))
        for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v))
    )
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, h_q != h_kv)
    return any(usable(params) for usable in _SDPA_FUSED)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, right: int
) -> torch.Tensor:
    """Attention through ``scaled_dot_product_attention`` with its own autograd (cuDNN first), for calls
    ``_sdpa_covers``; the output [B, Sq, Hq, Dv] in q's layout."""
    args = (_heads_view(q), _heads_view(k), _heads_view(v))
    kwargs = dict(is_causal=right == 0, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    if torch.compiler.is_compiling():
        with sdpa_kernel(list(_SDPA_PRIORITY), set_priority=True):
            out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    else:
        # sdpa_kernel costs tens of microseconds of host time per call (it saves and restores every
        # backend flag); eager calls set only the priority order, leaving the enabled backends as they are
        previous = torch._C._get_sdp_priority_order()
        torch._C._set_sdp_priority_order(
            _SDPA_PRIORITY_ORDER + [b for b in previous if b not in _SDPA_PRIORITY_ORDER]
        )
        try:
            out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
        finally:
            torch._C._set_sdp_priority_order(previous)
    out = _heads_view(out)
    if _same_order(out, q):
        return out
    return empty_in_layout(q, out.shape).copy_(out)


def _same_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a``'s dimensions longer than one lie in memory in ``b``'s order; dense bshd and sbhd
    answer without sorting strides (host time on every call)."""
    if b.is_contiguous():
        return a.is_contiguous()
    if b.transpose(0, 1).is_contiguous():
        return a.transpose(0, 1).is_contiguous()
    return _order(a) == _order(b)


def _order(t: torch.Tensor) -> list[int]:
    """The memory order of the dimensions longer than one, outermost first."""
    return sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: (-t.stride(d), d))


class TorchAttentionBackend(KernelBackend):
    """PyTorch. Calls that ``_sdpa_covers`` and that need neither the log-sum-exp nor a deterministic
    backward run end to end through ``scaled_dot_product_attention`` (``sdpa_attention``, with SDPA's
    own autograd; the public ops route them there). Everything else runs the fp32 math definition below,
    forward and backward, which materializes the [Sq, Sk] scores per head: the reference for sinks,
    windows, packed sequences (run one by one, their lengths read on the host) and the log-sum-exp.
    Any device, any dtype."""

    autotune = False

    @staticmethod
    def forward(q, k, v, sink, scale, left, right, out, varlen=None, **_: Any) -> torch.Tensor:
        if varlen is not None:
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
            for rows_q, rows_k in _sequences(varlen):
                parts = (q[None, rows_q], k[None, rows_k], v[None, rows_k], sink, scale, left, right)
                lse[:, rows_q] = TorchAttentionBackend.forward(*parts, out[None, rows_q])[0]
            return lse
        p, lse = _probabilities(q, k, sink, scale, left, right)
        group = q.shape[2] // k.shape[2]
        out.copy_((p @ _heads_first(v, group)).permute(0, 2, 1, 3))
        return lse

    @staticmethod
    def backward(do, q, k, v, out, lse, sink, scale, left, right, dq, dk, dv, varlen=None, **_: Any):
        if varlen is not None:
            dsink = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
            for rows_q, rows_k in _sequences(varlen):
                parts = [t[None, r] for t, r in ((do, rows_q), (q, rows_q), (k, rows_k), (v, rows_k))]
                parts += [out[None, rows_q], lse[None, :, rows_q], sink, scale, left, right]
                grads = [t[None, r] for t, r in ((dq, rows_q), (dk, rows_k), (dv, rows_k))]
                dsink += TorchAttentionBackend.backward(*parts, *grads)
            return dsink
        p, _ = _probabilities(q, k, sink, scale, left, right)
        group = q.shape[2] // k.shape[2]
        dof = _heads_first(do)
        delta = (dof * _heads_first(out)).sum(-1)
        dv_heads = p.transpose(-1, -2) @ dof
        ds = p * (dof @ _heads_first(v, group).transpose(-1, -2) - delta[..., None])
        dq.copy_((ds @ _heads_first(k, group) * scale).permute(0, 2, 1, 3))
        dk_heads = ds.transpose(-1, -2) @ _heads_first(q) * scale
        b, h_kv = k.shape[0], k.shape[2]
        dk.copy_(dk_heads.view(b, h_kv, group, *dk_heads.shape[2:]).sum(2).permute(0, 2, 1, 3))
        dv.copy_(dv_heads.view(b, h_kv, group, *dv_heads.shape[2:]).sum(2).permute(0, 2, 1, 3))
        return _sink_grad(sink, lse, delta)

    execute = forward


def _sequences(varlen: Varlen) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each packed sequence."""
    bounds_q, bounds_k = varlen.cu_seqlens_q.tolist(), varlen.cu_seqlens_k.tolist()
    return [
        (slice(bounds_q[i], bounds_q[i + 1]), slice(bounds_k[i], bounds_k[i + 1]))
        for i in range(len(bounds_q) - 1)
    ]


def _sink_grad(sink: torch.Tensor | None, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sink[h] = -sum over batch and queries of P(sink) * rowsum(dO * O); zeros without a sink."""
    if sink is None:
        return torch.zeros(lse.shape[1], dtype=torch.float32, device=lse.device)
    p_sink = torch.exp(sink.float()[None, :, None] - lse)
    return -(p_sink * delta).sum(dim=(0, 2))


class TritonAttentionBackend(KernelBackend):
    """This library's flash attention kernels: fp16/bf16, head dims up to 256."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return triton_unavailable_reason()

    @classmethod
    def unsupported_reason(cls, q, **_: Any) -> str | None:
        if q.device.type == "cpu" and not interpreter_active():
            return "CPU tensors need TRITON_INTERPRET=1"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16 or bf16 inputs, got {q.dtype}"
        return None

    @staticmethod
    def forward(q, k, v, sink, scale, left, right, out, varlen=None, **_: Any) -> torch.Tensor:
        return flash_attn_fwd_triton(q, k, v, sink, scale, left, right, out, varlen)

    @staticmethod
    def backward(do, q, k, v, out, lse, sink, scale, left, right, dq, dk, dv, varlen=None, **_: Any):
        delta = flash_attn_bwd_triton(do, q, k, v, out, lse, scale, left, right, dq, dk, dv, varlen)
        if varlen is not None:  # the sink gradient sums over the packed tokens as over a batch
            return _sink_grad(sink, lse[None], delta[None])
        return _sink_grad(sink, lse, delta)

    execute = forward


class _PackageAttentionBackend(KernelBackend):
    """Attention from an external package, available only where it imports. Such calls run end to end
    through the package's own ``flash_attn_func`` / ``flash_attn_varlen_func`` and its autograd (the public
    ops route them there, ``package_attention``), with the window convention of this module (the
    packages' own: bottom-right aligned, -1 unbounded)."""

    autotune = False
    module: ClassVar[str]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec(cls.module) is None:
            return f"the {cls.module} package is not installed"
        return None

    @classmethod
    def unsupported_reason(cls, q, k, v, sink, **_: Any) -> str | None:
        if sink is not None:
            return "has no attention sinks"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16 or bf16 inputs, got {q.dtype}"
        return None

    @classmethod
    def run(cls, q, k, v, scale, left, right, deterministic, return_lse, varlen=None):
        """``out``, or ``(out, lse)`` with ``return_lse``, from the package."""
        package = importlib.import_module(cls.module)
        options = dict(
            dropout_p=0.0,
            softmax_scale=scale,
            causal=False,
            window_size=(left, right),
            deterministic=deterministic,
        )
        options.update(cls.lse_option(return_lse))
        if varlen is None:
            result = package.flash_attn_func(q, k, v, **options)
        else:
            result = package.flash_attn_varlen_func(q, k, v, *varlen, **options)
        return (result[0], result[1]) if return_lse else result

    @staticmethod
    def lse_option(return_lse: bool) -> dict[str, bool]:
        return {"return_attn_probs": return_lse}

    @staticmethod
    def execute(**_: Any) -> Any:
        raise RuntimeError("package attention runs through package_attention, not the custom ops")


class FlashAttnPackageBackend(_PackageAttentionBackend):
    """The ``flash_attn`` package (FlashAttention 2): equal q/k and v head dims up to 256."""

    module = "flash_attn"

    @classmethod
    def unsupported_reason(cls, q, k, v, sink, **kwargs: Any) -> str | None:
        if q.shape[-1] != v.shape[-1] or q.shape[-1] > 256:
            return f"needs equal q/k and v head dims up to 256, got {q.shape[-1]}/{v.shape[-1]}"
        return super().unsupported_reason(q, k, v, sink, **kwargs)


class AiterAttentionBackend(_PackageAttentionBackend):
    """AMD's AITER (CK and assembly kernels, ROCm)."""

    module = "aiter"

    @staticmethod
    def lse_option(return_lse: bool) -> dict[str, bool]:
        return {"return_lse": return_lse}


class AttentionDispatcher(AutoKernelDispatcher):
    """Backend choice for flash attention. On GPUs: TORCH (SDPA, cuDNN first) for the calls SDPA runs end
    to end on a fused kernel, where it is faster than this library's kernels (docs/performance.md); the
    Triton kernels for the rest (sinks, left windows, causal with Sq != Sk, packed sequences, the
    log-sum-exp, deterministic mode). TORCH on CPUs."""

    op_name = "flash_attn"
    backends = {
        BackendType.TRITON: TritonAttentionBackend,
        BackendType.TORCH: TorchAttentionBackend,
        BackendType.AITER: AiterAttentionBackend,
        BackendType.FLASH_ATTN: FlashAttnPackageBackend,
    }

    @classmethod
    def make_key(cls, q, k, v, sink, left, right, varlen=None, sdpa=False, **_: Any) -> Hashable:
        if varlen is None:
            shape = (*q.shape, *k.shape[1:], v.shape[-1])
        else:  # packed token counts change every batch: key on the longest sequences instead
            lengths = (varlen.max_seqlen_q, varlen.max_seqlen_k)
            shape = ("varlen", *lengths, *q.shape[1:], *k.shape[1:], v.shape[-1])
        return (q.device.type, *shape, q.dtype, left, right, sink is None, sdpa)

    @classmethod
    def default_backend(cls, q, k, v, sink, left, right, varlen=None, sdpa=False, **_: Any) -> BackendType:
        if q.device.type != "cuda":
            return BackendType.TORCH
        if sdpa and varlen is None and _sdpa_covers(q, k, sink, left, right) and _sdpa_fused(q, k, v, right):
            return BackendType.TORCH
        return BackendType.TRITON

    @classmethod
    def tuning_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        q, v = kwargs["q"], kwargs["v"]
        return {**kwargs, "out": empty_in_layout(q, (*q.shape[:-1], v.shape[-1]))}


def resolve_attention_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    left: int,
    right: int,
    varlen: Varlen | None = None,
    sdpa: bool = False,
) -> str:
    """Name of the backend that runs this call's forward and backward. ``sdpa``: the caller can run the
    call end to end through ``sdpa_attention`` (it needs neither the log-sum-exp nor determinism)."""
    choice = GlobalBackendManager.get_attn_backend(precision_of(q.dtype))
    kwargs = dict(q=q, k=k, v=v, sink=sink, scale=scale, left=left, right=right, varlen=varlen, sdpa=sdpa)
    return AttentionDispatcher.resolve(choice, **kwargs).name


def package_attention(backend: str) -> type[_PackageAttentionBackend] | None:
    """The external package a call resolved to ``backend`` runs on, if any."""
    impl = AttentionDispatcher.backends[BackendType[backend]]
    return impl if issubclass(impl, _PackageAttentionBackend) else None


def sdpa_runs(backend: str, q: torch.Tensor, k: torch.Tensor, sink, left: int, right: int) -> bool:
    """Whether a call resolved to ``backend`` goes to ``sdpa_attention``: TORCH and covered by SDPA."""
    return backend == BackendType.TORCH.name and _sdpa_covers(q, k, sink, left, right)


def _backend(name: str) -> type[KernelBackend]:
    return AttentionDispatcher.backends[BackendType[name]]


@custom_op("primus_turbo::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    left: int,
    right: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, Dv] in q's layout, lse fp32 [B, Hq, Sq]) on the named backend."""
    out = empty_in_layout(q, (*q.shape[:3], v.shape[3]))
    lse = _backend(backend).forward(q, k, v, sink, scale, left, right, out)
    return out, lse


@flash_attn_fwd_impl.register_fake
def _flash_attn_fwd_fake(q, k, v, sink, scale, left, right, backend):
    out = empty_in_layout(q, (*q.shape[:3], v.shape[3]))
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@custom_op("primus_turbo::flash_attn_bwd", mutates_args=())
def flash_attn_bwd_impl(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    left: int,
    right: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv in the layouts of q, k, v; dsink fp32 [Hq], zeros without a sink)."""
    dq, dk, dv = (empty_in_layout(t, t.shape) for t in (q, k, v))
    dsink = _backend(backend).backward(do, q, k, v, out, lse, sink, scale, left, right, dq, dk, dv)
    return dq, dk, dv, dsink


@flash_attn_bwd_impl.register_fake
def _flash_attn_bwd_fake(do, q, k, v, out, lse, sink, scale, left, right, backend):
    dq, dk, dv = (empty_in_layout(t, t.shape) for t in (q, k, v))
    return dq, dk, dv, q.new_empty((q.shape[2],), dtype=torch.float32)


@custom_op("primus_turbo::flash_attn_varlen_fwd", mutates_args=())
def flash_attn_varlen_fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sink: torch.Tensor | None,
    scale: float,
    left: int,
    right: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: (out [Tq, Hq, Dv] in q's layout, lse fp32 [Hq, Tq]) on the named backend."""
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = empty_in_layout(q, (*q.shape[:2], v.shape[2]))
    lse = _backend(backend).forward(q, k, v, sink, scale, left, right, out, varlen)
    return out, lse


@flash_attn_varlen_fwd_impl.register_fake
def _flash_attn_varlen_fwd_fake(q, k, v, cu_q, cu_k, max_q, max_k, sink, scale, left, right, backend):
    out = empty_in_layout(q, (*q.shape[:2], v.shape[2]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@custom_op("primus_turbo::flash_attn_varlen_bwd", mutates_args=())
def flash_attn_varlen_bwd_impl(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sink: torch.Tensor | None,
    scale: float,
    left: int,
    right: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed sequences: (dq, dk, dv in the layouts of q, k, v; dsink fp32 [Hq], zeros without a sink)."""
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = (empty_in_layout(t, t.shape) for t in (q, k, v))
    dsink = _backend(backend).backward(do, q, k, v, out, lse, sink, scale, left, right, dq, dk, dv, varlen)
    return dq, dk, dv, dsink


@flash_attn_varlen_bwd_impl.register_fake
def _flash_attn_varlen_bwd_fake(
    do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, sink, scale, left, right, backend
):
    dq, dk, dv = (empty_in_layout(t, t.shape) for t in (q, k, v))
    return dq, dk, dv, q.new_empty((q.shape[1],), dtype=torch.float32)
