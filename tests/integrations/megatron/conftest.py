"""The Megatron integration's tests need megatron-core (CI installs 0.16; GPU runs carry 0.19)."""

import importlib.util

import pytest

if importlib.util.find_spec("megatron") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def megatron():
    """megatron-core set up in this process over a one-rank group (TP = EP = 1), torn down after."""
    import torch

    from tests.integrations.megatron.megatron_harness import (
        destroy_megatron,
        init_megatron,
        local_process_group,
    )

    with local_process_group():
        init_megatron()
        try:
            yield
        finally:
            destroy_megatron()
            torch._dynamo.reset()
