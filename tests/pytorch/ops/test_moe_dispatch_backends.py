"""Backend selection of the expert-parallel ``Buffer``: DEEP_EP hands out the external package's own
buffer (built from the same arguments) or names the missing package; TURBO sizes its peer buffer and
needs CUDA; the dispatch ops size their buffer from the selected backend's hints. Single process: no
collective runs."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.deep_ep import Buffer
from primus_turbo.pytorch.deep_ep import buffer as buffer_module
from primus_turbo.pytorch.deep_ep.buffer import buffer_size_hints
from primus_turbo.pytorch.deep_ep.peer import peer_buffer_bytes
from primus_turbo.pytorch.ops.moe import dispatch


class _FakeConfig:
    def __init__(self, per_token: int) -> None:
        self.per_token = per_token

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return self.per_token * hidden_bytes * num_ranks

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class _FakeDeepEpBuffer:
    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, **kwargs) -> None:
        self.group, self.num_nvl_bytes, self.num_rdma_bytes, self.kwargs = (
            group,
            num_nvl_bytes,
            num_rdma_bytes,
            kwargs,
        )

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _FakeConfig:
        return _FakeConfig(256)

    @staticmethod
    def get_combine_config(num_ranks: int) -> _FakeConfig:
        return _FakeConfig(512)


@pytest.fixture
def deep_ep_backend(monkeypatch):
    GlobalBackendManager.set_moe_dispatch_combine_backend(BackendType.DEEP_EP)
    monkeypatch.setattr(dispatch, "_BUFFERS", {})
    yield monkeypatch
    GlobalBackendManager.reset()


def test_deep_ep_returns_the_packages_buffer(deep_ep_backend):
    deep_ep_backend.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=_FakeDeepEpBuffer))
    buffer = Buffer("ep-group", 1 << 20, 0, explicitly_destroy=True)
    assert isinstance(buffer, _FakeDeepEpBuffer)
    assert (buffer.group, buffer.num_nvl_bytes, buffer.kwargs) == (
        "ep-group",
        1 << 20,
        {"explicitly_destroy": True},
    )
    assert buffer_size_hints(4, 1000) == (512 * 1000 * 4, 0)


def test_deep_ep_without_the_package_names_it(deep_ep_backend):
    deep_ep_backend.setitem(sys.modules, "deep_ep", None)
    with pytest.raises(ValueError, match="needs the deep_ep package"):
        Buffer("ep-group")


def test_turbo_backend_sizes_its_peer_buffer_and_needs_cuda(monkeypatch):
    GlobalBackendManager.set_moe_dispatch_combine_backend(BackendType.TURBO)
    try:
        assert buffer_size_hints(2, 7168 * 2) == (peer_buffer_bytes(7168 * 2, 2), 0)
        monkeypatch.setattr(buffer_module.dist, "get_rank", lambda group: 0)
        monkeypatch.setattr(buffer_module.dist, "get_world_size", lambda group: 2)
        buffer = Buffer("ep-group")
        idx = torch.zeros(4, 2, dtype=torch.int64)
        with pytest.raises(ValueError, match="needs CUDA"):
            buffer.dispatch(
                torch.zeros(4, 8), topk_idx=idx, is_token_in_rank=torch.ones(4, 2, dtype=torch.bool),
                num_tokens_per_expert=torch.zeros(4, dtype=torch.int32),
            )  # fmt: skip
    finally:
        GlobalBackendManager.reset()


def test_dispatch_ops_size_and_keep_their_buffer(deep_ep_backend):
    deep_ep_backend.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=_FakeDeepEpBuffer))
    deep_ep_backend.setattr(dispatch.dist, "get_world_size", lambda group: 2)
    first = dispatch._buffer("ep-group", 7168 * 2)
    assert first.num_nvl_bytes == 512 * 7168 * 2 * 2
    assert dispatch._buffer("ep-group", 4096 * 2) is first  # smaller rows fit
    assert dispatch._buffer("ep-group", 0) is first  # what backward asks for
    larger = dispatch._buffer("ep-group", 8192 * 2)
    assert larger is not first and larger.num_nvl_bytes == 512 * 8192 * 2 * 2
