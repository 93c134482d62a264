"""Async-TP ops over 2 and 3 gloo processes on the CPU (NCCL ranks where there is a GPU per rank) against
all_gather / matmul / reduce_scatter references that every rank computes from all ranks' seeds: several
weights sharing one gather, gather and scatter along a non-leading dimension, odd row counts per rank,
gradients of the input and every weight, opcheck and a fullgraph compile, and bad input."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import ScalingGranularity
from primus_turbo.pytorch.kernels.async_tp.async_tp_impl import (
    fused_all_gather_matmul_impl,
    fused_all_gather_scaled_matmul_impl,
    fused_matmul_reduce_scatter_impl,
)
from primus_turbo.pytorch.ops import (
    fused_all_gather_matmul,
    fused_all_gather_scaled_matmul,
    fused_matmul_reduce_scatter,
)

K, N = 16, 12
DEVICE = torch.device("cpu")  # each rank's device: its GPU under NCCL


def _worker(rank: int, world: int, store: str, body_name: str, args: tuple) -> None:
    global DEVICE
    backend = "gloo"
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        torch.cuda.set_device(rank)
        DEVICE, backend = torch.device("cuda", rank), "nccl"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    globals()[body_name](rank, world, *args)  # an exception reaches mp.spawn, which reports it
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort interpreter teardown


def _spawn(world: int, body, *args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.spawn(_worker, args=(world, store, body.__name__, args), nprocs=world, join=True)


def _shard(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)


def _weights(count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(K, N + 2 * i, generator=gen) / K**0.5).to(dtype) for i in range(count)]


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)


def _all_gather_matmul_body(rank, world, shape, gather_dim, count, dtype, return_a, backend) -> None:
    GlobalBackendManager.set_async_tp_backend(backend)
    shard = _shard(rank, shape, dtype).to(DEVICE).requires_grad_()
    bs = [b.to(DEVICE).requires_grad_() for b in _weights(count, dtype)]
    a, outs = fused_all_gather_matmul(shard, bs, gather_dim, dist.group.WORLD, return_a=return_a)
    # the reference: every rank's shard (same seeds), gathered, in fp64
    full = torch.cat([_shard(r, shape, dtype).double() for r in range(world)], dim=gather_dim)
    full.requires_grad_()
    ref_bs = [b.detach().cpu().double().requires_grad_() for b in bs]
    ref_outs = [full @ b for b in ref_bs]
    if return_a:
        torch.testing.assert_close(a.cpu(), full.detach().to(dtype), rtol=0, atol=0)
    else:
        assert a is None
    for out, ref in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(out.cpu().double(), ref.detach(), **_tolerance(dtype))
    # the same upstream gradient on every rank: each rank holds the whole output
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(ref.shape, generator=gen).to(dtype) for ref in ref_outs]
    loss = sum((o * g.to(DEVICE)).sum() for o, g in zip(outs, grads, strict=True))
    if return_a:  # a gradient through the returned A as well
        loss = loss + a.sum()
    loss.backward()
    ref_loss = sum((o * g.double()).sum() for o, g in zip(ref_outs, grads, strict=True))
    if return_a:
        ref_loss = ref_loss + full.sum()
    ref_loss.backward()
    # an all-gather's gradient is the reduce-scatter: the sum over ranks of each rank's (equal) gradient
    mine = full.grad.narrow(gather_dim, rank * shape[gather_dim], shape[gather_dim]) * world
    torch.testing.assert_close(shard.grad.cpu().double(), mine, **_tolerance(dtype))
    for b, ref_b in zip(bs, ref_bs, strict=True):
        torch.testing.assert_close(b.grad.cpu().double(), ref_b.grad, **_tolerance(dtype))


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["TORCH", "TURBO"])
@pytest.mark.parametrize(
    "world, shape, gather_dim, count, dtype, return_a",
    [
        (2, (3, K), 0, 1, torch.float32, True),  # an odd row count per rank
        (2, (5, 2, K), 0, 3, torch.float32, False),  # [s, b, h] and three weights sharing the gather
        (2, (2, 3, K), 1, 2, torch.float32, True),  # gathered along the second dimension
        (2, (4, K), 0, 1, torch.bfloat16, False),
        (3, (3, 2, K), 0, 2, torch.float32, True),  # a ring of three
    ],
)
def test_fused_all_gather_matmul(world, shape, gather_dim, count, dtype, return_a, backend):
    _spawn(world, _all_gather_matmul_body, shape, gather_dim, count, dtype, return_a, backend)


def _matmul_reduce_scatter_body(rank, world, shape, scatter_dim, dtype, reduce_op, backend) -> None:
    GlobalBackendManager.set_async_tp_backend(backend)
    a = _shard(rank, shape, dtype).to(DEVICE).requires_grad_()
    (b,) = _weights(1, dtype)
    b = (b + 0.1 * rank).to(DEVICE).requires_grad_()  # each rank's own weight shard (row-parallel)
    out = fused_matmul_reduce_scatter(a, b, scatter_dim, dist.group.WORLD, reduce_op)
    ref_as = [_shard(r, shape, dtype).double().requires_grad_() for r in range(world)]
    ref_bs = [(_weights(1, dtype)[0] + 0.1 * r).double().requires_grad_() for r in range(world)]
    total = sum(x @ w for x, w in zip(ref_as, ref_bs, strict=True))
    if reduce_op == "avg":
        total = total / world
    rows = shape[scatter_dim] // world
    ref = total.narrow(scatter_dim, rank * rows, rows)
    torch.testing.assert_close(out.cpu().double(), ref.detach(), **_tolerance(dtype))
    # rank r's upstream gradient for its own shard; the reference sums the shards' losses
    shard_grads = [
        torch.randn(ref.shape, generator=torch.Generator().manual_seed(20 + r)) for r in range(world)
    ]
    (out * shard_grads[rank].to(DEVICE, dtype)).sum().backward()
    ref_loss = sum(
        (total.narrow(scatter_dim, r * rows, rows) * shard_grads[r].double()).sum() for r in range(world)
    )
    ref_loss.backward()
    torch.testing.assert_close(a.grad.cpu().double(), ref_as[rank].grad, **_tolerance(dtype))
    torch.testing.assert_close(b.grad.cpu().double(), ref_bs[rank].grad, **_tolerance(dtype))


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["TORCH", "TURBO"])
@pytest.mark.parametrize(
    "world, shape, scatter_dim, dtype, reduce_op",
    [
        (2, (6, K), 0, torch.float32, "sum"),  # 3 rows per rank: odd
        (2, (4, 3, K), 0, torch.float32, "avg"),
        (2, (3, 4, K), 1, torch.float32, "sum"),
        (2, (8, K), 0, torch.bfloat16, "sum"),
        (3, (6, 2, K), 0, torch.float32, "sum"),  # a ring of three
    ],
)
def test_fused_matmul_reduce_scatter(world, shape, scatter_dim, dtype, reduce_op, backend):
    _spawn(world, _matmul_reduce_scatter_body, shape, scatter_dim, dtype, reduce_op, backend)


def _fused_wgrad_body(rank, world, backend) -> None:
    """Linear weights ([N, K], ``trans_b``) whose gradients go into ``main_grad`` (Megatron's fused wgrad),
    through both ops: a column-parallel then a row-parallel layer, as in an MLP under sequence parallelism."""
    GlobalBackendManager.set_async_tp_backend(backend)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(9)
    w1, w2 = (torch.randn(n, k, generator=gen) / k**0.5 for n, k in ((N, K), (K, N)))
    w2 = w2 + 0.1 * rank  # the row-parallel weight is this rank's own shard
    x = _shard(rank, (3, K), torch.float32)
    layers = [w.clone().to(DEVICE).requires_grad_() for w in (w1, w2)]
    for w in layers:
        w.main_grad = torch.ones(w.shape, device=DEVICE)  # accumulates onto what is there
    _, (h,) = fused_all_gather_matmul(x.to(DEVICE), [layers[0]], 0, group, return_a=False, trans_b=True,
                                      fuse_bgrad_accum_pattern="megatron")  # fmt: skip
    y = fused_matmul_reduce_scatter(h, layers[1], 0, group, trans_b=True, fuse_bgrad_accum_pattern="megatron")
    y.sum().backward()
    assert all(w.grad_added_to_main_grad for w in layers)
    # the reference, fp64: every rank's input rows and row-parallel weight. The row-parallel weight's
    # gradient comes from every rank's rows of the sum; this rank's column-parallel weight only feeds its
    # own row-parallel weight (the tensor-parallel split of the hidden dimension)
    xs = torch.cat([_shard(r, (3, K), torch.float64) for r in range(world)])
    ref1 = w1.double().requires_grad_()
    ref2s = [(w2 - 0.1 * rank + 0.1 * r).double().requires_grad_() for r in range(world)]
    sum(xs @ ref1.detach().t() @ w.t() for w in ref2s).sum().backward()
    (xs @ ref1.t() @ ref2s[rank].detach().t()).sum().backward()
    torch.testing.assert_close(layers[0].main_grad.cpu().double(), 1 + ref1.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layers[1].main_grad.cpu().double(), 1 + ref2s[rank].grad, rtol=1e-4, atol=1e-4)


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["TORCH", "TURBO"])
def test_fused_wgrad_into_main_grad(backend):
    _spawn(2, _fused_wgrad_body, backend)


def _quantized(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity):
    """(FP8 ``x``, its dequantising scales: 0-d or one per row), quantized in plain PyTorch (the op under
    test takes quantized inputs; this keeps the quantizer out of it)."""
    rowwise = granularity is ScalingGranularity.ROWWISE
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = amax.float().clamp(min=1e-12) / torch.finfo(dtype).max
    return (x / scale).to(dtype), scale


def _snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.double() - want.double()).pow(2).sum()
    return float(10 * torch.log10(want.double().pow(2).sum() / noise))


def _all_gather_scaled_matmul_body(rank, world, shape, gather_dim, a_gran, b_gran, dtype, return_a) -> None:
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(N + 4 * i, K, generator=gen) for i in range(2)]  # row-major [N, K]
    quantized = [_quantized(w, dtype, b_gran) for w in weights]
    bs = [q.to(DEVICE).t() for q, _ in quantized]  # column-major [K, N]
    b_scales = [(s.reshape(-1) if s.dim() else s).to(DEVICE) for _, s in quantized]
    shard = _shard(rank, shape, torch.float32) * (1 + rank)  # tensorwise scales differ per rank
    q, scale = (t.to(DEVICE) for t in _quantized(shard, dtype, a_gran))
    got_a, outs = fused_all_gather_scaled_matmul(q, bs, scale, b_scales, gather_dim, dist.group.WORLD,
                                                 return_a=return_a)  # fmt: skip
    outs = [out.cpu() for out in outs]
    shards = [_quantized(_shard(r, shape, torch.float32) * (1 + r), dtype, a_gran) for r in range(world)]
    dequant = torch.cat([(qr.float() * sr).double() for qr, sr in shards], dim=gather_dim)
    exact = torch.cat(
        [_shard(r, shape, torch.float32).double() * (1 + r) for r in range(world)], dim=gather_dim
    )
    if return_a:
        a, row_scales = (t.cpu() for t in got_a)
        assert torch.equal(
            a.view(torch.uint8), torch.cat([qr for qr, _ in shards], gather_dim).view(torch.uint8)
        )
        torch.testing.assert_close((a.float() * row_scales).double(), dequant, rtol=0, atol=0)
    else:
        assert got_a is None
    for out, (qb, sb), w in zip(outs, quantized, weights, strict=True):
        assert out.dtype == torch.bfloat16
        reference = dequant @ (qb.double() * (sb.double() if sb.dim() else sb.double())).t()
        torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=1e-2)  # the GEMM: bf16 output
        floor = 25 if dtype == torch.float8_e4m3fn else 20
        snr = _snr_db(out, exact @ w.double().t())
        assert snr >= floor, f"SNR {snr:.1f} dB < {floor}"  # against the unquantized product


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "shape, gather_dim, a_gran, b_gran, dtype, return_a",
    [
        ((3, K), 0, ScalingGranularity.TENSORWISE, ScalingGranularity.TENSORWISE, torch.float8_e4m3fn, True),
        ((4, 2, K), 0, ScalingGranularity.ROWWISE, ScalingGranularity.ROWWISE, torch.float8_e4m3fn, False),
        ((2, 3, K), 1, ScalingGranularity.ROWWISE, ScalingGranularity.TENSORWISE, torch.float8_e5m2, True),
    ],
)
def test_fused_all_gather_scaled_matmul(shape, gather_dim, a_gran, b_gran, dtype, return_a):
    _spawn(2, _all_gather_scaled_matmul_body, shape, gather_dim, a_gran, b_gran, dtype, return_a)


def _bad_input_body(rank, world) -> None:
    group = dist.group.WORLD
    a, (b,) = torch.randn(4, K), _weights(1, torch.float32)
    with pytest.raises(ValueError, match="leading dimensions"):
        fused_all_gather_matmul(a, [b], 1, group)
    with pytest.raises(ValueError, match="non-empty sequence"):
        fused_all_gather_matmul(a, [], 0, group)
    with pytest.raises(ValueError, match=r"\[K, N\] with K"):
        fused_all_gather_matmul(a, [b.t()], 0, group)
    with pytest.raises(TypeError, match="a's dtype"):
        fused_all_gather_matmul(a, [b.double()], 0, group)
    with pytest.raises(TypeError, match="a_shard must be one of"):
        fused_all_gather_matmul(a.long(), [b], 0, group)
    with pytest.raises(ValueError, match="divide by the group size"):
        fused_matmul_reduce_scatter(torch.randn(3, K), b, 0, group)
    with pytest.raises(ValueError, match="reduce_op must be one of"):
        fused_matmul_reduce_scatter(a, b, 0, group, "max")
    with pytest.raises(ValueError, match=r"\[N, K\] with K"):
        fused_matmul_reduce_scatter(a, b, 0, group, trans_b=True)
    with pytest.raises(ValueError, match="needs b.main_grad"):
        fused_all_gather_matmul(a, [b.t()], 0, group, trans_b=True, fuse_bgrad_accum_pattern="megatron")
    q, scale = _quantized(a, torch.float8_e4m3fn, ScalingGranularity.ROWWISE)
    qb, sb = _quantized(b.t().contiguous(), torch.float8_e4m3fn, ScalingGranularity.TENSORWISE)
    with pytest.raises(TypeError, match="a_shard must be one of"):
        fused_all_gather_scaled_matmul(a, [qb.t()], scale, [sb], 0, group)
    with pytest.raises(ValueError, match="column-major"):
        fused_all_gather_scaled_matmul(q, [qb.t().contiguous()], scale, [sb], 0, group)
    with pytest.raises(ValueError, match="row-wise"):
        fused_all_gather_scaled_matmul(q, [qb.t()], scale[:2], [sb], 0, group)
    with pytest.raises(ValueError, match="one b_scales entry each"):
        fused_all_gather_scaled_matmul(q, [qb.t()], scale, [], 0, group)
    GlobalBackendManager.set_async_tp_backend("TURBO")  # a pinned backend is never swapped silently
    try:
        with pytest.raises(ValueError, match="TURBO is not implemented"):
            fused_all_gather_scaled_matmul(q, [qb.t()], scale, [sb], 0, group)
    finally:
        GlobalBackendManager.set_async_tp_backend(None)


@pytest.mark.multigpu
def test_bad_input_raises():
    _spawn(2, _bad_input_body)


def _opcheck_and_compile_body(rank, world) -> None:
    group = dist.group.WORLD
    name = group.group_name
    a, bs = _shard(rank, (4, K), torch.float32).to(DEVICE), [w.to(DEVICE) for w in _weights(2, torch.float32)]
    torch.library.opcheck(fused_all_gather_matmul_impl, (a, bs, 0, name), test_utils=("test_schema",
                          "test_faketensor", "test_aot_dispatch_static"))  # fmt: skip
    torch.library.opcheck(fused_matmul_reduce_scatter_impl, (a, bs[0], 0, name, "sum"), test_utils=(
        "test_schema", "test_faketensor", "test_aot_dispatch_static"))  # fmt: skip
    q, scale = _quantized(a, torch.float8_e4m3fn, ScalingGranularity.ROWWISE)
    qb, sb = _quantized(bs[0].t().contiguous(), torch.float8_e4m3fn, ScalingGranularity.ROWWISE)
    args = (q, scale, [qb.t()], [sb.reshape(-1)], 0, name, torch.bfloat16)
    # opcheck's schema test multiplies every input, which torch does not implement for fp8 dtypes
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_static")
    torch.library.opcheck(fused_all_gather_scaled_matmul_impl, args, test_utils=checks)
    compiled = torch.compile(
        lambda *t: fused_all_gather_scaled_matmul(t[0], [t[2]], t[1], [t[3]], 0, group)[1][0],
        fullgraph=True,
        backend="aot_eager",
    )
    eager = fused_all_gather_scaled_matmul(q, [qb.t()], scale, [sb.reshape(-1)], 0, group)[1][0]
    assert torch.equal(compiled(q, scale, qb.t(), sb.reshape(-1)), eager)

    def step(x, w0, w1):
        _, outs = fused_all_gather_matmul(x, [w0, w1], 0, group, return_a=False)
        return fused_matmul_reduce_scatter(outs[0], w0.t().contiguous(), 0, group).sum() + outs[1].sum()

    leaves = [t.clone().requires_grad_() for t in (a, *bs)]
    eager = [t.clone().requires_grad_() for t in (a, *bs)]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    step(*eager).backward()
    for got, want in zip(leaves, eager, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.multigpu
def test_opcheck_and_compile():
    _spawn(2, _opcheck_and_compile_body)
