"""Host microseconds per call of every public op and Megatron Turbo module, beside its PyTorch peer.

Each call is enqueued without synchronising (one sync after the timed loop), at tiny shapes that keep
the device idle, so what is timed is the host path: argument checks, backend resolution, autograd,
metadata ops and kernel launches. Forward alone runs under ``no_grad``; forward + backward runs the
forward with autograd and a backward from a fixed output gradient. The op and its peer alternate over
several rounds and each reports its median round. It runs on the CPU as well (the Python path is the
same; the TORCH backends do the math), so the trend shows without a GPU.

Peers are what a user would run instead: ``F.linear`` / ``torch.mm``, ``torch._grouped_mm``,
``F.rms_norm``, the eager gated-activation expression, PyTorch's FP8 quantization expression with
``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` (GPU), softmax + ``topk`` routing, ``argsort`` +
``index_select`` permutation, SDPA, and Megatron's local-spec modules.

Example::

    python -m benchmark.ops.training.bench_host_overhead -o host_overhead.csv
    python -m benchmark.ops.training.bench_host_overhead --only gemm,rmsnorm --calls 200
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from tabulate import tabulate

from benchmark.ops.training.bench_utils import HostCase as Case
from benchmark.ops.training.bench_utils import platform_name

__all__ = ["host_us", "main", "op_cases"]

_log = logging.getLogger(__name__)
_ROUND_US = 100_000.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(fn: Callable[[], object], calls: int, device: torch.device, warmup: int = 0) -> float:
    """Microseconds of host time per call of ``fn`` after ``warmup`` untimed calls, synchronising only
    after the timed loop."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    _sync(device)
    return elapsed / calls * 1e6


def _differentiable(out: object) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def _backward_step(fn: Callable[[], object], leaves: list[torch.Tensor]) -> Callable[[], None]:
    """``fn``'s forward with autograd, then backward from ones-like gradients made once."""
    outs = _differentiable(fn())
    grads = [torch.ones_like(t) for t in outs]

    def step() -> None:
        torch.autograd.backward(_differentiable(fn()), grads)
        for leaf in leaves:
            leaf.grad = None

    return step


def _paired(
    fns: Sequence[Callable[[], object]], calls: int, rounds: int, device: torch.device
) -> list[float]:
    """Median per-call host microseconds of each function, the functions alternating round by round.

    A slow call (a CPU reference path in milliseconds) gets fewer calls per round, at least 5, so that a
    round lasts about ``_ROUND_US`` at most."""
    per_call = []
    for fn in fns:
        fn()
        per_call.append(host_us(fn, 3, device))
    calls = max(5, min(calls, int(_ROUND_US / max(per_call))))
    for fn in fns:
        for _ in range(max(3, calls // 10)):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            samples[i].append(host_us(fn, calls, device))
    return [statistics.median(s) for s in samples]


def measure(case: Case, calls: int, rounds: int, device: torch.device) -> dict[str, object]:
    """One CSV row: forward (no grad) and forward + backward host microseconds, op and peer."""
    row: dict[str, object] = {"family": case.family, "op": case.name, "peer": case.peer_label}
    with torch.no_grad():
        times = _paired([case.turbo] + ([case.peer] if case.peer else []), calls, rounds, device)
    row["turbo_fwd_us"], row["peer_fwd_us"] = times[0], times[1] if case.peer else math.nan
    if case.fwd_only:
        row["turbo_fwd_bwd_us"] = row["peer_fwd_bwd_us"] = math.nan
    else:
        steps = [_backward_step(case.turbo, case.leaves)]
        if case.peer:
            steps.append(_backward_step(case.peer, case.leaves))
        times = _paired(steps, calls, rounds, device)
        row["turbo_fwd_bwd_us"], row["peer_fwd_bwd_us"] = times[0], times[1] if case.peer else math.nan
    row["fwd_ratio"] = row["turbo_fwd_us"] / row["peer_fwd_us"]
    row["fwd_bwd_ratio"] = row["turbo_fwd_bwd_us"] / row["peer_fwd_bwd_us"]
    row["target"] = case.target if case.target is not None else math.nan
    key = "fwd_ratio" if case.fwd_only else "fwd_bwd_ratio"
    row["meets"] = "" if case.target is None else ("yes" if row[key] <= case.target else "no")
    return row


def _leaf(*shape: int, device: torch.device, dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


class _ScaledMM(torch.autograd.Function):
    """The PyTorch peer of ``gemm_fp8`` tensorwise: quantize with torch ops, ``torch._scaled_mm`` each way
    (E4M3 forward operands, E5M2 output gradient), as a user of plain PyTorch writes it."""

    @staticmethod
    def forward(ctx, a, w):
        qa, sa = _quant_tensorwise(a, torch.float8_e4m3fn)
        qw, sw = _quant_tensorwise(w, torch.float8_e4m3fn)
        ctx.save_for_backward(a, w)
        return torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sw, out_dtype=a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, w = ctx.saved_tensors
        qg, sg = _quant_tensorwise(grad, torch.float8_e5m2)
        qwt, sw = _quant_tensorwise(w.t().contiguous(), torch.float8_e4m3fn)
        qat, sa = _quant_tensorwise(a.t().contiguous(), torch.float8_e4m3fn)
        qgt, sgt = _quant_tensorwise(grad.t().contiguous(), torch.float8_e5m2)
        da = torch._scaled_mm(qg, qwt.t(), scale_a=sg, scale_b=sw, out_dtype=a.dtype)
        dw = torch._scaled_mm(qgt, qat.t(), scale_a=sgt, scale_b=sa, out_dtype=w.dtype)
        return da, dw


def _quant_tensorwise(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax().float().clamp(min=1e-12)
    scale = fmax / amax
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def _quant_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = fmax / amax
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with its derivative written out (dgrad and wgrad as grouped GEMMs), the peer
    where torch's own backward of the op fails (the CPU in torch 2.13)."""

    @staticmethod
    def forward(ctx, a, w, ends):
        ctx.save_for_backward(a, w, ends)
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, grad):
        a, w, ends = ctx.saved_tensors
        da = torch._grouped_mm(grad, w, offs=ends)
        dw = torch._grouped_mm(grad.t(), a, offs=ends)
        return da, dw, None


class _ScaledGroupedMM(torch.autograd.Function):
    """The PyTorch peer of ``grouped_gemm_fp8`` rowwise: per-row quantization with torch ops and
    ``torch._scaled_grouped_mm`` for the forward and dgrad (E4M3 both, the only format it takes), the
    wgrad in bf16 (torch has no per-group scaled variable-K GEMM)."""

    @staticmethod
    def forward(ctx, a, w, ends):
        qa, sa = _quant_rows(a, torch.float8_e4m3fn)
        qw, sw = _quant_rows(w, torch.float8_e4m3fn)
        ctx.save_for_backward(a, w, ends)
        return torch._scaled_grouped_mm(
            qa, qw.transpose(1, 2), sa.squeeze(-1), sw.squeeze(-1), offs=ends, out_dtype=a.dtype
        )

    @staticmethod
    def backward(ctx, grad):
        a, w, ends = ctx.saved_tensors
        qg, sg = _quant_rows(grad, torch.float8_e4m3fn)  # torch._scaled_grouped_mm takes E4M3 only
        wt = w.transpose(1, 2).contiguous()
        qwt, swt = _quant_rows(wt, torch.float8_e4m3fn)
        da = torch._scaled_grouped_mm(
            qg, qwt.transpose(1, 2), sg.squeeze(-1), swt.squeeze(-1), offs=ends, out_dtype=a.dtype
        )
        dw = torch._grouped_mm(grad.t(), a, offs=ends)
        return da, dw, None


def _grouped_peer(a: torch.Tensor, w: torch.Tensor, lens: torch.Tensor) -> tuple[Callable[[], object], str]:
    """torch._grouped_mm from the same int64 group sizes (their int32 prefix sum made per call, as a caller
    of torch's op must), with torch's autograd where that works, else with the derivative written out."""
    try:
        out = torch._grouped_mm(a, w.transpose(1, 2), offs=torch.cumsum(lens, 0, dtype=torch.int32))
        out.backward(torch.ones_like(out))
        a.grad = w.grad = None
        label = "cumsum + torch._grouped_mm"
        return (
            lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=torch.cumsum(lens, 0, dtype=torch.int32))
        ), label
    except RuntimeError:
        a.grad = w.grad = None
        label = "cumsum + torch._grouped_mm (derivative in Python)"
        return (lambda: _GroupedMM.apply(a, w, torch.cumsum(lens, 0, dtype=torch.int32))), label


def _router_peer(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(scores, topk, dim=-1)
    probs = torch.zeros_like(scores).scatter(1, idx, top)
    routing = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing, scores


def _permute_peer(tokens: torch.Tensor, routing: torch.Tensor, probs: torch.Tensor):
    """Megatron's unfused permute: token indices sorted by expert, gathered with ``index_select``."""
    mask = routing.t().contiguous()
    token_idx = torch.arange(tokens.shape[0], device=tokens.device).expand(mask.shape[0], -1)
    sorted_idx = token_idx.masked_select(mask)
    permuted_probs = probs.t().contiguous().masked_select(mask)
    return tokens.index_select(0, sorted_idx), sorted_idx, permuted_probs


def _unpermute_peer(permuted: torch.Tensor, sorted_idx: torch.Tensor, probs: torch.Tensor, tokens: int):
    weighted = permuted * probs.unsqueeze(-1).to(permuted.dtype)
    out = permuted.new_zeros(tokens, permuted.shape[1])
    return out.index_add(0, sorted_idx, weighted)


def op_cases(device: torch.device, dtype: torch.dtype | None = None) -> list[Case]:
    """Every public op at a tiny shape on ``device``, with its peer."""
    from benchmark.ops.training.bench_gemm_fp8 import quant_config
    from primus_turbo.pytorch import ops
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity, float8_e4m3

    gpu = device.type == "cuda"
    # bf16 on GPUs; fp32 on the CPU, whose bf16 arithmetic is emulated and would hide the host path
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
    # tiny, so that the CPU's arithmetic stays small beside the host path; FP8 blocks need 128-multiples
    tokens, hidden, ffn, experts, topk, fp8_dim = 16, 32, 64, 4, 2, 128
    cases: list[Case] = []

    a = _leaf(tokens, hidden, device=device, dtype=dtype)
    w = _leaf(ffn, hidden, device=device, dtype=dtype)
    cases.append(
        Case(
            "gemm",
            "gemm",
            lambda: ops.gemm(a, w, trans_b=True),
            lambda: F.linear(a, w),
            [a, w],
            "F.linear",
            target=1.5,
        )
    )
    a = _leaf(2 * tokens, fp8_dim, device=device, dtype=dtype)  # MX blocks need M % 32 == 0
    w = _leaf(fp8_dim, fp8_dim, device=device, dtype=dtype)
    for name in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        config = quant_config(name)
        peer = (lambda: _ScaledMM.apply(a, w)) if gpu and name == "tensorwise" else None
        cases.append(
            Case(
                "gemm",
                f"gemm_fp8 {name}",
                lambda c=config: ops.gemm_fp8(a, w, trans_b=True, config=c),
                peer,
                [a, w],
                "quantize + torch._scaled_mm" if peer else "",
                target=2.0 if peer else None,
            )
        )

    lens = torch.full((experts,), tokens // experts * 2, device=device, dtype=torch.int64)
    ga = _leaf(tokens * 2, hidden, device=device, dtype=dtype)
    gw = _leaf(experts, ffn, hidden, device=device, dtype=dtype)
    ga8 = _leaf(tokens * 2, fp8_dim, device=device, dtype=dtype)
    gw8 = _leaf(experts, fp8_dim, fp8_dim, device=device, dtype=dtype)
    ends = torch.cumsum(lens, 0).to(torch.int32)
    peer, label = _grouped_peer(ga, gw, lens)
    cases.append(
        Case(
            "grouped_gemm",
            "grouped_gemm",
            lambda: ops.grouped_gemm(ga, gw, lens, trans_b=True),
            peer,
            [ga, gw],
            label,
            target=1.5,
        )
    )
    for name in ("tensorwise", "rowwise", "blockwise"):
        config = quant_config(name)
        peer = (lambda: _ScaledGroupedMM.apply(ga8, gw8, ends)) if gpu and name == "rowwise" else None
        cases.append(
            Case(
                "grouped_gemm",
                f"grouped_gemm_fp8 {name}",
                lambda c=config: ops.grouped_gemm_fp8(ga8, gw8, lens, trans_b=True, config=c),
                peer,
                [ga8, gw8],
                "quantize + torch._scaled_grouped_mm" if peer else "",
                target=2.0 if peer else None,
            )
        )

    x8 = _leaf(tokens, fp8_dim, device=device, dtype=dtype)
    gamma8 = _leaf(fp8_dim, device=device, dtype=dtype)
    x = _leaf(tokens, hidden, device=device, dtype=dtype)
    res = _leaf(tokens, hidden, device=device, dtype=dtype)
    gamma = _leaf(hidden, device=device, dtype=dtype)
    cases.append(
        Case(
            "norm",
            "rmsnorm",
            lambda: ops.rmsnorm(x, gamma),
            lambda: F.rms_norm(x, (hidden,), gamma, 1e-6),
            [x, gamma],
            "F.rms_norm",
            target=1.5,
        )
    )

    def residual_peer():
        s = x + res
        return F.rms_norm(s, (hidden,), gamma, 1e-6), s

    cases.append(
        Case(
            "norm",
            "rmsnorm_residual",
            lambda: ops.rmsnorm_residual(x, res, gamma),
            residual_peer,
            [x, res, gamma],
            "x + r, F.rms_norm",
            target=1.5,
        )
    )
    block = quant_config("blockwise")
    cases.append(
        Case(
            "norm",
            "rmsnorm_fp8 blockwise",
            lambda: ops.rmsnorm_fp8(x8, gamma8, block).grad_anchor,
            lambda: _quant_rows(F.rms_norm(x8, (fp8_dim,), gamma8, 1e-6), torch.float8_e4m3fn)[0],
            [x8, gamma8],
            "F.rms_norm + row quantize (fwd)",
            fwd_only=True,
        )
    )

    xg = _leaf(tokens, 2 * ffn, device=device, dtype=dtype)
    xg8 = _leaf(tokens, 2 * fp8_dim, device=device, dtype=dtype)
    probs = torch.rand(tokens, device=device, dtype=torch.float32).requires_grad_(True)

    def swiglu_peer():
        gate, up = xg.chunk(2, dim=-1)
        return F.silu(gate) * up

    cases.append(
        Case("activation", "swiglu", lambda: ops.swiglu(xg), swiglu_peer, [xg], "silu(g) * u", target=1.5)
    )
    cases.append(
        Case(
            "activation",
            "swiglu_with_probs",
            lambda: ops.swiglu_with_probs(xg, probs),
            lambda: swiglu_peer() * probs[:, None].to(dtype),
            [xg, probs],
            "silu(g) * u * p",
            target=1.5,
        )
    )
    cases.append(
        Case(
            "activation",
            "geglu",
            lambda: ops.geglu(xg),
            lambda: F.gelu(xg[:, :ffn], approximate="tanh") * xg[:, ffn:],
            [xg],
            "gelu(g) * u",
        )
    )
    cases.append(
        Case(
            "activation",
            "swiglu_fp8 blockwise",
            lambda: ops.swiglu_fp8(xg8, block).grad_anchor,
            lambda: _quant_rows(F.silu(xg8[:, :fp8_dim]) * xg8[:, fp8_dim:], torch.float8_e4m3fn)[0],
            [xg8],
            "silu(g) * u + row quantize (fwd)",
            fwd_only=True,
        )
    )

    xq = torch.randn(tokens, fp8_dim, device=device, dtype=dtype)
    for granularity, axis, bs in (
        (ScalingGranularity.TENSORWISE, None, None),
        (ScalingGranularity.ROWWISE, 1, None),
        (ScalingGranularity.BLOCKWISE, 1, 128),
    ):
        peer = (
            (lambda: _quant_tensorwise(xq, torch.float8_e4m3fn))
            if axis is None
            else (lambda: _quant_rows(xq, torch.float8_e4m3fn))
        )
        cases.append(
            Case(
                "quantization",
                f"quantize_fp8 {granularity.name.lower()}",
                lambda g=granularity, ax=axis, b=bs: ops.quantize_fp8(
                    xq, float8_e4m3, g, axis=ax, block_size=b
                ),
                peer,
                peer_label="torch amax / scale / cast",
                fwd_only=True,
            )
        )
    cases.append(
        Case(
            "quantization",
            "quantize_fp8_with_trans blockwise",
            lambda: ops.quantize_fp8_with_trans(
                xq, float8_e4m3, ScalingGranularity.BLOCKWISE, block_size=128
            ),
            lambda: (_quant_rows(xq, torch.float8_e4m3fn), _quant_rows(xq.t(), torch.float8_e4m3fn)),
            peer_label="torch row quantize, both axes",
            fwd_only=True,
        )
    )

    logits = _leaf(tokens, experts * 4, device=device, dtype=torch.float32)
    cases.append(
        Case(
            "moe",
            "router (softmax top-2)",
            lambda: ops.fused_group_topk_routing_with_aux_score(logits, topk)[::2],
            lambda: _router_peer(logits, topk)[::2],
            [logits],
            "softmax + topk + scatter",
        )
    )
    with torch.no_grad():
        probs_map, routing, _ = ops.fused_group_topk_routing_with_aux_score(logits, topk)
    probs_map = probs_map.detach().requires_grad_(True)
    pt = _leaf(tokens, hidden, device=device, dtype=dtype)
    rows = tokens * topk
    cases.append(
        Case(
            "moe",
            "moe_permute",
            lambda: ops.moe_permute(
                pt, routing, probs_map, num_local_experts=experts * 4, num_permuted_tokens=rows
            )[0],
            lambda: _permute_peer(pt, routing, probs_map)[0],
            [pt, probs_map],
            "masked_select + index_select",
            target=1.5,
        )
    )
    permuted = _leaf(rows, hidden, device=device, dtype=dtype)
    with torch.no_grad():
        _, row_id_map, *_ = ops.moe_permute(
            pt, routing, probs_map, num_local_experts=experts * 4, num_permuted_tokens=rows
        )
        _, sorted_idx, permuted_probs = _permute_peer(pt, routing, probs_map)
    cases.append(
        Case(
            "moe",
            "moe_unpermute",
            lambda: ops.moe_unpermute(permuted, row_id_map, probs_map),
            lambda: _unpermute_peer(permuted, sorted_idx, permuted_probs, tokens),
            [permuted, probs_map],
            "mul + index_add",
            target=1.5,
        )
    )

    heads, seq, dim = 2, 16, 32
    q = _leaf(1, seq, heads, dim, device=device, dtype=dtype)
    k = _leaf(1, seq, heads, dim, device=device, dtype=dtype)
    v = _leaf(1, seq, heads, dim, device=device, dtype=dtype)
    cases.append(
        Case(
            "attention",
            "flash_attn_func causal",
            lambda: ops.flash_attn_func(q, k, v, causal=True),
            lambda: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ),
            [q, k, v],
            "SDPA",
        )
    )
    return cases


@contextlib.contextmanager
def _one_rank_group(device: torch.device) -> Iterator[None]:
    """A one-rank process group in this process (gloo on the CPU, NCCL on a GPU)."""
    import os
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"file://{os.path.join(folder, 's')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def dispatch_cases(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[Case]:
    """moe_dispatch / moe_combine on a one-rank group beside the identity they reduce to there."""
    from primus_turbo.pytorch import ops

    tokens, hidden, experts, topk = 16, 32, 4, 2
    x = _leaf(tokens, hidden, device=device, dtype=dtype)
    idx = torch.stack([torch.randperm(experts, device=device)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, device=device, dtype=torch.float32).requires_grad_(True)

    def round_trip():
        recv, _, recv_w, _, handle = ops.moe_dispatch(x, idx, weights, experts, num_worst_tokens=tokens)
        return ops.moe_combine(recv, handle), recv_w

    return [
        Case(
            "moe",
            "moe_dispatch + moe_combine (1 rank)",
            round_trip,
            lambda: (x * 1, weights * 1),
            [x, weights],
            "identity (x * 1)",
        )
    ]


def _write_csv(path: str, rows: list[dict[str, object]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _table(rows: list[dict[str, object]]) -> str:
    headers = ["op", "peer", "fwd us", "peer fwd", "x", "fwd+bwd us", "peer f+b", "x", "target", "met"]
    body = [
        [
            r["op"],
            r["peer"],
            r["turbo_fwd_us"],
            r["peer_fwd_us"],
            r["fwd_ratio"],
            r["turbo_fwd_bwd_us"],
            r["peer_fwd_bwd_us"],
            r["fwd_bwd_ratio"],
            r["target"],
            r["meets"],
        ]
        for r in rows
    ]
    return tabulate(body, headers=headers, floatfmt=".2f", missingval="")


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    """Time every case (or those whose op name contains one of ``--only``'s words) and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated substrings of op names to keep")
    p.add_argument("--no-modules", action="store_true", help="skip the Megatron module rows")
    p.add_argument(
        "--backward-thread",
        choices=["device", "caller"],
        default="device",
        help="where autograd runs a GPU backward: its per-device worker thread (PyTorch's default) or the "
        "calling thread (what the Megatron integration sets); op and peer alike",
    )
    p.add_argument("-o", "--output", default="", help="CSV path")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    rows: list[dict[str, object]] = []
    threads = torch.autograd.set_multithreading_enabled(args.backward_thread == "device")
    with threads, _one_rank_group(device):
        cases = op_cases(device) + dispatch_cases(device)
        if not args.no_modules:
            from benchmark.ops.training.bench_host_modules import module_cases

            cases += module_cases(device)
        for case in cases:
            if wanted and not any(w in case.name for w in wanted):
                continue
            try:
                rows.append(measure(case, args.calls, args.rounds, device))
            except Exception as exc:  # one op that cannot run here (a missing kernel) must not hide the rest
                _log.warning("%s: %s: %s", case.name, type(exc).__name__, exc)
    print(
        f"host us per call, {platform_name(device.type)}, torch {torch.__version__}, "
        f"backward on the {args.backward_thread} thread"
    )
    print(_table(rows))
    if args.output and rows:
        _write_csv(args.output, rows)
    return rows


if __name__ == "__main__":
    main()
