"""Expert-parallel dispatch and combine over 2 and 4 gloo processes on the CPU (NCCL ranks on GPU machines
run the same bodies), against a single-process reference that every rank computes from all ranks' seeds:
random routing, a rank receiving no tokens, all tokens to one rank, top-k 1..8, the fixed-size path,
the weighted-identity round trip, gradients, and bad input raising on every rank."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from primus_turbo.pytorch.deep_ep import Buffer
from primus_turbo.pytorch.ops import moe_combine, moe_dispatch

TOKENS, HIDDEN = 24, 16


def _worker(rank: int, world: int, store: str, body_name: str, args: tuple) -> None:
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    # a file store: no TCP server thread in rank 0 to outlive (and abort) at exit
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    globals()[body_name](rank, world, *args)  # an exception reaches mp.spawn, which reports it
    dist.barrier()  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()
    # skip interpreter teardown: gloo's threads can abort it ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(world: int, body, *args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.spawn(_worker, args=(world, store, body.__name__, args), nprocs=world, join=True)


def _inputs(rank: int, experts: int, topk: int, mode: str):
    """Rank ``rank``'s tokens, top-k indices and fp32 weights (the same on every process)."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    scores = torch.rand(TOKENS, experts, generator=gen)
    if mode == "skip-rank-1":  # no token picks rank 1's experts
        local = experts // int(os.environ["WORLD"])
        scores[:, local : 2 * local] = -1
    elif mode == "all-to-rank-0":
        scores[:, experts // int(os.environ["WORLD"]) :] = -1
    idx = scores.topk(topk, dim=-1).indices
    if mode == "dropped":
        idx[::3, -1] = -1
    weights = torch.rand(TOKENS, topk, generator=gen)
    return x, idx, weights


def _expected_received(rank: int, world: int, experts: int, topk: int, mode: str):
    """Rows this rank must receive: every source rank's tokens that route here, in source order."""
    local = experts // world
    rows, idx_rows, weight_rows = [], [], []
    for source in range(world):
        x, idx, w = _inputs(source, experts, topk, mode)
        here = ((idx >= 0) & (idx // local == rank)).any(dim=1)
        mine = (idx >= 0) & (idx // local == rank)
        rows.append(x[here])
        idx_rows.append(torch.where(mine, idx - rank * local, -1)[here])
        weight_rows.append(torch.where(mine, w, 0.0)[here])
    return torch.cat(rows), torch.cat(idx_rows), torch.cat(weight_rows)


def _round_trip_body(rank: int, world: int, experts: int, topk: int, mode: str, worst: int) -> None:
    os.environ["WORLD"] = str(world)
    x, idx, w = _inputs(rank, experts, topk, mode)
    x.requires_grad_()
    w.requires_grad_()
    dispatched = moe_dispatch(x, idx, w, experts, num_worst_tokens=worst)
    recv_x, recv_idx, recv_w, tokens_per_expert, handle = dispatched
    exp_x, exp_idx, exp_w = _expected_received(rank, world, experts, topk, mode)
    count = exp_x.shape[0]
    if worst:
        assert recv_x.shape[0] == worst and (recv_idx[count:] == -1).all() and not recv_x[count:].any()
    assert torch.equal(recv_x[:count], exp_x) and torch.equal(recv_idx[:count], exp_idx)
    assert torch.equal(recv_w[:count], exp_w)
    local = experts // world
    assert torch.equal(tokens_per_expert, torch.bincount(exp_idx[exp_idx >= 0], minlength=local))
    # the experts: scale each received row by its local weights, then combine = the weighted identity
    expert_out = recv_x * recv_w.sum(dim=1, keepdim=True)
    combined = moe_combine(expert_out, handle)
    expected = x.detach() * torch.where(idx >= 0, w.detach(), 0.0).sum(dim=1, keepdim=True)
    torch.testing.assert_close(combined, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7 + rank))
    combined.backward(grad)
    # d/dx: the summed weights; d/dw[t, k]: <grad[t], x[t]> for routed slots
    torch.testing.assert_close(x.grad, grad * torch.where(idx >= 0, w.detach(), 0.0).sum(1, keepdim=True))
    dots = (grad * x.detach()).sum(dim=1, keepdim=True).expand_as(w)
    torch.testing.assert_close(w.grad, torch.where(idx >= 0, dots, 0.0), rtol=1e-5, atol=1e-5)


def _bad_input_body(rank: int, world: int) -> None:
    buffer = Buffer(dist.group.WORLD)
    idx = torch.full((4, 2), 9, dtype=torch.int64)
    with pytest.raises(ValueError, match="topk_idx values"):
        buffer.get_dispatch_layout(idx, 8)
    with pytest.raises(ValueError, match="multiple of the group size"):
        buffer.get_dispatch_layout(torch.zeros(4, 2, dtype=torch.int64), 7)
    with pytest.raises(ValueError, match="float32"):
        moe_dispatch(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2).half(), 8)
    with pytest.raises(ValueError, match="low-latency"):
        Buffer(dist.group.WORLD, low_latency_mode=True)
    # a bad value on one rank only: every rank raises, none is left waiting in a collective
    idx = torch.zeros(4, 2, dtype=torch.int64)
    if rank == 0:
        idx[0, 0] = 99
    with pytest.raises(ValueError, match="on every rank"):
        buffer.get_dispatch_layout(idx, 8)
    dist.barrier()


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "world,experts,topk,mode,worst",
    [
        (2, 8, 2, "random", 0),
        (2, 8, 1, "random", 0),
        (2, 16, 8, "random", 0),
        (4, 16, 4, "random", 0),
        (4, 16, 3, "skip-rank-1", 0),
        (4, 8, 2, "all-to-rank-0", 0),
        (2, 8, 3, "dropped", 0),
        (4, 16, 4, "random", 4 * TOKENS),
        (2, 8, 2, "all-to-rank-0", 2 * TOKENS),
    ],
    ids=str,
)
def test_dispatch_combine_round_trip(world, experts, topk, mode, worst):
    _spawn(world, _round_trip_body, experts, topk, mode, worst)


@pytest.mark.multigpu
def test_bad_input_raises_on_every_rank():
    _spawn(2, _bad_input_body)


def _token_dispatcher_body(rank: int, world: int, worst: int) -> None:
    from primus_turbo.pytorch.modules import DeepEPTokenDispatcher

    experts, topk, pad = 8, 2, 4
    gen = torch.Generator().manual_seed(50 + rank)
    hidden = torch.randn(3, TOKENS // 3, HIDDEN, generator=gen).requires_grad_()
    logits = torch.randn(TOKENS, experts, generator=gen)
    top = logits.topk(topk, dim=-1).indices
    routing_map = torch.zeros(TOKENS, experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(logits, dim=-1) * routing_map
    capacity = world * TOKENS * topk + experts * pad if worst else -1
    dispatcher = DeepEPTokenDispatcher(
        experts, topk, pad_multiple=pad, permute_max_token_num=capacity, num_worst_tokens=worst
    )
    permuted, tokens_per_expert, permuted_probs = dispatcher.token_dispatch(hidden, probs, routing_map)
    # global expert e scales its rows by e + 1 and applies the rows' routing probabilities
    local = experts // world
    padded = (tokens_per_expert + pad - 1) // pad * pad
    starts = padded.cumsum(0) - padded
    expert_scale = torch.zeros(permuted.shape[0])
    for e in range(local):
        begin = int(starts[e])
        expert_scale[begin : begin + int(tokens_per_expert[e])] = rank * local + e + 1.0
    out = dispatcher.token_combine(permuted * (expert_scale * permuted_probs)[:, None])
    assert out.shape == hidden.shape
    weights = (probs * (torch.arange(experts) + 1.0)).sum(dim=1, keepdim=True)
    expected = hidden.detach().reshape(TOKENS, HIDDEN) * weights
    torch.testing.assert_close(out.reshape(TOKENS, HIDDEN), expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    torch.testing.assert_close(hidden.grad.reshape(TOKENS, HIDDEN), weights.expand(TOKENS, HIDDEN))


@pytest.mark.multigpu
@pytest.mark.parametrize("worst", [0, 2 * TOKENS])
def test_token_dispatcher_runs_the_moe_data_path(worst):
    _spawn(2, _token_dispatcher_body, worst)


def _moe_layer_body(rank: int, world: int) -> None:
    from primus_turbo.pytorch.modules import DeepEPTokenDispatcher
    from primus_turbo.pytorch.ops import fused_group_topk_routing_with_aux_score, grouped_gemm

    experts, topk = 4, 2
    local = experts // world
    weights = torch.randn(experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(9)) * HIDDEN**-0.5
    gen = torch.Generator().manual_seed(60 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).requires_grad_()
    logits = torch.randn(TOKENS, experts, generator=gen)
    probs, routing_map, _ = fused_group_topk_routing_with_aux_score(logits, topk, score_function="sigmoid")
    dispatcher = DeepEPTokenDispatcher(experts, topk)
    permuted, tokens_per_expert, permuted_probs = dispatcher.token_dispatch(x, probs, routing_map)
    mine = weights[rank * local : (rank + 1) * local]
    expert_out = grouped_gemm(permuted, mine, tokens_per_expert, trans_b=True) * permuted_probs[:, None]
    out = dispatcher.token_combine(expert_out)
    reference = sum(
        probs[:, e : e + 1] * (x.detach() @ weights[e].t()) for e in range(experts)
    )  # probs are 0 off the route
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    expected_grad = sum(probs[:, e : e + 1] * weights[e].sum(0)[None, :] for e in range(experts))
    torch.testing.assert_close(x.grad, expected_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.multigpu
def test_moe_layer_router_dispatch_grouped_gemm_combine():
    _spawn(2, _moe_layer_body)


def _no_tokens_body(rank: int, world: int) -> None:
    x, idx, w = torch.zeros(0, HIDDEN), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)
    recv_x, recv_idx, _, tokens_per_expert, handle = moe_dispatch(x, idx, w, 8, num_worst_tokens=8)
    assert recv_x.shape == (8, HIDDEN) and not recv_x.any() and (recv_idx == -1).all()
    assert not tokens_per_expert.any()
    assert moe_combine(recv_x, handle).shape == (0, HIDDEN)


@pytest.mark.multigpu
def test_fixed_size_path_with_no_tokens_anywhere():
    _spawn(2, _no_tokens_body)
