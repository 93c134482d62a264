"""The TURBO (peer-memory) dispatch and combine steps, several ranks simulated in one process over buffers
that share one address table: received rows, local top-k indices, weights and FP8 scales against a
reference built from every rank's inputs; the fixed-size path; a rank receiving nothing; combine's round
trip and combined weights; a dispatch that reuses a handle; too many tokens for the buffer."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.deep_ep.peer import (
    PeerHandle,
    Peers,
    combine_push,
    combine_reduce,
    dispatch_push,
    dispatch_receive,
)
from primus_turbo.triton.utils.device_info import triton_unavailable_reason
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]
pytestmark = pytest.mark.skipif(triton_unavailable_reason() is not None, reason="needs Triton")


def _inputs(rank, tokens, hidden, experts, topk, world, mode):
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=gen)
    if mode == "skip-rank-1":
        local = experts // world
        scores[:, local : 2 * local] = -1
    idx = scores.topk(topk, dim=-1).indices
    idx[::5, -1] = -1  # dropped routes
    weights = torch.rand(tokens, topk, generator=gen)
    return x, idx, weights


def _in_rank(idx, experts, world):
    local = experts // world
    dest = torch.where(idx >= 0, idx // local, world)
    return torch.zeros(idx.shape[0], world + 1, dtype=torch.bool).scatter(1, dest, True)[:, :world]


def _group(world, nbytes):
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE) for _ in range(world)]
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)
    return [Peers(rank, world, buffers[rank], table) for rank in range(world)]


@pytest.mark.parametrize(
    ("world", "experts", "topk", "mode", "fp8", "worst"),
    [(2, 8, 3, "random", False, 0), (3, 6, 2, "skip-rank-1", False, 0), (4, 8, 4, "random", True, 0),
     (2, 8, 2, "random", False, 40)],
    ids=str,
)  # fmt: skip
def test_dispatch_and_combine_match_the_reference(world, experts, topk, mode, fp8, worst):
    tokens, hidden = 17, 32
    peers = _group(world, 1 << 20)
    inputs = [_inputs(rank, tokens, hidden, experts, topk, world, mode) for rank in range(world)]
    scales = [torch.rand(tokens, 2) for _ in range(world)] if fp8 else [None] * world
    payload = [x.to(torch.float8_e4m3fn) if fp8 else x for x, _, _ in inputs]
    pushed = []
    for rank in range(world):
        x, idx, w = inputs[rank]
        in_rank = _in_rank(idx, experts, world)
        pushed.append(
            dispatch_push(
                peers[rank], payload[rank].to(DEVICE), idx.to(DEVICE), w.to(DEVICE),
                scales[rank].to(DEVICE) if fp8 else None, in_rank.to(DEVICE), experts,
            )
        )  # fmt: skip
    local = experts // world
    handles, received = [], []
    for rank in range(world):
        slot, sent, layout = pushed[rank]
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        recv_x, recv_idx, recv_w, recv_s, src_rank, src_pos = dispatch_receive(
            peers[rank], layout, worst or -1, dtype, hidden, True, fp8
        )
        rows, idx_rows, w_rows, s_rows = [], [], [], []
        for source in range(world):
            _, idx, w = inputs[source]
            mine = (idx >= 0) & (idx // local == rank)
            here = mine.any(dim=1)
            rows.append(payload[source][here])
            idx_rows.append(torch.where(mine, idx - rank * local, -1)[here])
            w_rows.append(torch.where(mine, w, 0.0)[here])
            if fp8:
                s_rows.append(scales[source][here])
        expected = torch.cat(rows)
        count = expected.shape[0]
        if mode == "skip-rank-1" and rank == 1:
            assert count == 0
        assert recv_x.shape[0] == (worst or count)
        assert torch.equal(recv_x[:count].view(torch.uint8).cpu(), expected.view(torch.uint8))
        assert torch.equal(recv_idx[:count].cpu(), torch.cat(idx_rows))
        assert torch.equal(recv_w[:count].cpu(), torch.cat(w_rows))
        assert (recv_idx[count:] == -1).all() and (src_rank[count:] == -1).all()
        if fp8:
            assert torch.equal(recv_s[:count].cpu(), torch.cat(s_rows))
        handles.append(PeerHandle(slot, sent, src_rank, src_pos, layout, local))
        received.append((recv_x, recv_w))
    if fp8:
        return
    # combine with identity experts: each token comes back once per rank it reached
    for rank in range(world):
        recv_x, recv_w = received[rank]
        combine_push(peers[rank], recv_x, recv_w, handles[rank])
    for rank in range(world):
        out, weights = combine_reduce(peers[rank], handles[rank], torch.bfloat16, True)
        x, idx, w = inputs[rank]
        copies = _in_rank(idx, experts, world).sum(1, keepdim=True)
        torch.testing.assert_close(out.float().cpu(), (x.float() * copies).bfloat16().float())
        torch.testing.assert_close(weights.cpu(), torch.where(idx >= 0, w, 0.0))
    # weights alone (the gradient of the dispatched weights travels this way)
    for rank in range(world):
        combine_push(peers[rank], None, 3 * received[rank][1], handles[rank])
    for rank in range(world):
        nothing, weights = combine_reduce(peers[rank], handles[rank], None, True)
        _, idx, w = inputs[rank]
        assert nothing is None
        torch.testing.assert_close(weights.cpu(), torch.where(idx >= 0, 3 * w, 0.0))


def test_dispatch_with_a_handle_moves_new_rows_the_same_way():
    world, experts, topk, tokens, hidden = 2, 4, 2, 9, 8
    local = experts // world
    peers = _group(world, 1 << 18)
    inputs = [_inputs(rank, tokens, hidden, experts, topk, world, "random") for rank in range(world)]
    pushed = []
    for rank, (x, idx, _) in enumerate(inputs):
        in_rank = _in_rank(idx, experts, world).to(DEVICE)
        pushed.append(dispatch_push(peers[rank], x.to(DEVICE), idx.to(DEVICE), None, None, in_rank, experts))
    handles = []
    for rank in range(world):
        slot, sent, layout = pushed[rank]
        received = dispatch_receive(peers[rank], layout, -1, torch.bfloat16, hidden, False, False)
        handles.append(PeerHandle(slot, sent, received[4], received[5], layout, local))
    for rank, (x, idx, _) in enumerate(inputs):
        dispatch_push(
            peers[rank], (2 * x).to(DEVICE), idx.to(DEVICE), None, None, None, experts, handles[rank]
        )
    for rank in range(world):
        rows = handles[rank].src_rank.numel()
        recv = dispatch_receive(peers[rank], handles[rank].layout, rows, torch.bfloat16, hidden, False, False)
        expected = [2 * x[((idx >= 0) & (idx // local == rank)).any(1)] for x, idx, _ in inputs]
        assert torch.equal(recv[0].cpu(), torch.cat(expected))


def test_too_many_tokens_for_the_buffer_raise():
    peers = _group(2, 4096)
    x = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEVICE)
    idx = torch.zeros(64, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="exceed"):
        dispatch_push(peers[0], x, idx, None, None, _in_rank(idx.cpu(), 4, 2).to(DEVICE), 4)
