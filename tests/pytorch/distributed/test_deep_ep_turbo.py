"""The TURBO (peer-memory) dispatch and combine over NCCL ranks on one host's GPUs, against the all-to-all
backend in the same processes: received rows, local top-k indices, weights, FP8 scales, per-expert counts,
the fixed-size path and combine. Needs two or more GPUs."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two or more GPUs"
    ),
]


def _worker(rank: int, world: int, store: str, worst: int, fp8: bool) -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
    from primus_turbo.pytorch.deep_ep import Buffer
    from primus_turbo.pytorch.ops import moe_combine, moe_dispatch
    from primus_turbo.pytorch.ops.moe import dispatch as dispatch_ops

    experts, topk, tokens, hidden = 16, 4, 300, 256
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(tokens, hidden, generator=gen).cuda().bfloat16()
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=-1).indices.cuda()
    idx[::7, -1] = -1
    weights = torch.rand(tokens, topk, generator=gen).cuda()
    payload = (x.to(torch.float8_e4m3fn), torch.rand(tokens, 2, generator=gen).cuda()) if fp8 else x
    results = {}
    for backend in (BackendType.TORCH, BackendType.TURBO):
        GlobalBackendManager.set_moe_dispatch_combine_backend(backend)
        buffer = Buffer(dist.group.WORLD)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
        recv, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            payload, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, num_worst_tokens=worst,
        )  # fmt: skip
        recv_x = recv[0] if fp8 else recv
        combined, combined_w, _ = buffer.combine(
            recv_x.float().bfloat16() if fp8 else recv_x, handle, topk_weights=recv_w
        )
        results[backend] = (recv, recv_idx, recv_w, counts, combined, combined_w)
        if not fp8:  # the autograd ops: gradients of the tokens and the weights
            dispatch_ops._BUFFERS.clear()
            leaf, w_leaf = x.clone().requires_grad_(), weights.clone().requires_grad_()
            got_x, _, got_w, _, op_handle = moe_dispatch(leaf, idx, w_leaf, experts, num_worst_tokens=worst)
            moe_combine(
                got_x * got_w.sum(1, keepdim=True).bfloat16(), op_handle
            ).float().square().sum().backward()
            results[backend] += (leaf.grad, w_leaf.grad)
    GlobalBackendManager.reset()
    ours, theirs = results[BackendType.TURBO], results[BackendType.TORCH]
    for mine, ref in zip(ours, theirs, strict=True):
        if isinstance(mine, tuple):
            for a, b in zip(mine, ref, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        elif isinstance(mine, torch.Tensor):
            torch.testing.assert_close(mine, ref, rtol=0, atol=0)
        else:
            assert mine == ref
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.parametrize(("worst", "fp8"), [(0, False), (600, False), (0, True)], ids=str)
def test_turbo_matches_the_all_to_all_backend(worst, fp8):
    world = min(torch.cuda.device_count(), 8)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(world, os.path.join(folder, "store"), worst, fp8), nprocs=world, join=True)
