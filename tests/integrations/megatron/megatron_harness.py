"""Test utilities for megatron-core models: spawn ranks, set up parallel state, build a tiny GPT, step it.

Without a GPU the ranks are gloo processes on the CPU and :func:`init_megatron` enables
``primus_turbo.integrations.megatron.cpu``; with GPUs they are NCCL ranks, one GPU each. Typical body::

    def _body(rank: int, world: int) -> None:
        init_megatron(tp=2)
        model = build_gpt(tiny_config(), get_gpt_layer_local_spec(normalization="RMSNorm"))
        loss, grads = loss_and_grads(model, synthetic_batch(seed=0))
        destroy_megatron()

    spawn(2, _body)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from primus_turbo.integrations.megatron.cpu import enable_megatron_on_cpu

__all__ = [
    "MOE_OVERRIDES",
    "build_gpt",
    "destroy_megatron",
    "init_megatron",
    "local_process_group",
    "loss_and_grads",
    "spawn",
    "synthetic_batch",
    "tiny_config",
    "tiny_moe_config",
]

# overrides that turn tiny_config() into a small MoE (local spec: SequentialMLP experts)
MOE_OVERRIDES: dict[str, Any] = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 64,
    "moe_token_dispatcher_type": "alltoall",
    "moe_aux_loss_coeff": 0.0,
    "moe_router_load_balancing_type": "none",
}

_undo_cpu_shim: Callable[[], None] | None = None


def _worker(rank: int, world: int, store: str, module: str, name: str, args: tuple) -> None:
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        backend = "nccl"
    # a file store: no TCP server thread in rank 0 to outlive (and abort) at exit
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    body = getattr(importlib.import_module(module), name)
    body(rank, world, *args)  # an exception reaches mp.spawn, which reports it
    dist.barrier()  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()
    # skip interpreter teardown: gloo's threads can abort it ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, body: Callable[..., None], *args: Any) -> None:
    """Run ``body(rank, world, *args)`` in ``world`` fresh processes joined in one process group.

    ``body`` must be a module-level function (it is found again by module and name in each process);
    ``args`` must pickle. A failure on any rank raises here with that rank's traceback. With GPUs, each
    rank takes one; the calling test is skipped when fewer than ``world`` are visible.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.spawn(_worker, args=(world, store, body.__module__, body.__name__, args), nprocs=world, join=True)


@contextlib.contextmanager
def local_process_group() -> Iterator[None]:
    """A one-rank process group in this process (gloo; NCCL with a GPU) for quick in-process tests.

    Destroyed on exit, and the CPU (and CUDA) RNG states are restored, so later tests see no trace.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    with tempfile.TemporaryDirectory() as folder, torch.random.fork_rng():
        store = os.path.join(folder, "store")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def init_megatron(tp: int = 1, ep: int = 1, seed: int = 1234, etp: int | None = None) -> None:
    """Set up megatron-core in a process whose ``torch.distributed`` group is already initialised.

    Enables the CPU shim when no GPU is visible, builds the parallel groups (``etp``: expert tensor
    parallel size, Megatron's default is ``tp``; TP=2 with EP=2 on 2 ranks needs ``etp=1``), seeds the
    CPU generator (``use_cpu_initialization`` draws weights from it, the same on every rank) and the
    model-parallel RNG tracker. Undo with :func:`destroy_megatron`.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    global _undo_cpu_shim
    if _undo_cpu_shim is None:
        _undo_cpu_shim = enable_megatron_on_cpu()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_megatron() -> None:
    """Tear down what :func:`init_megatron` set up: the parallel groups, then the CPU shim."""
    from megatron.core import parallel_state

    global _undo_cpu_shim
    parallel_state.destroy_model_parallel()
    if _undo_cpu_shim is not None:
        _undo_cpu_shim()
        _undo_cpu_shim = None


def tiny_config(**overrides: Any) -> Any:
    """A 2-layer GPT ``TransformerConfig`` (hidden 64, 4 heads, ffn 128, RMSNorm, SwiGLU, bf16).

    Parallel sizes come from megatron's parallel state (1 when it is not initialised); ``overrides``
    replace any field, e.g. ``sequence_parallel=True`` or ``**MOE_OVERRIDES``.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    sizes = {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 1}
    if parallel_state.model_parallel_is_initialized():
        sizes = {
            "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel_size": parallel_state.get_expert_tensor_parallel_world_size(),
        }
    fields: dict[str, Any] = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": 128,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "use_cpu_initialization": True,
        **sizes,
    }
    fields.update(overrides)
    return TransformerConfig(**fields)


def tiny_moe_config(**overrides: Any) -> Any:
    """:func:`tiny_config` with :data:`MOE_OVERRIDES` (4 experts, top-2, alltoall dispatcher)."""
    return tiny_config(**{**MOE_OVERRIDES, **overrides})


def build_gpt(
    config: Any, layer_spec: Any, vocab: int = 128, seq: int = 16, **gpt_kwargs: Any
) -> torch.nn.Module:
    """A ``GPTModel`` from a layer or block spec, in ``Float16Module`` when the config is bf16/fp16.

    The wrapper is not optional for bf16: the embedding's output is fp32 and the first bf16 linear
    rejects it. ``gpt_kwargs`` go to ``GPTModel`` (e.g. ``position_embedding_type="rope"``).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    model: torch.nn.Module = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        **gpt_kwargs,
    )
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def synthetic_batch(
    seed: int, batch: int = 2, seq: int = 16, vocab: int = 128
) -> dict[str, torch.Tensor | None]:
    """Next-token batch, identical on every rank for one seed: tokens, position_ids, attention_mask
    (``None``: the causal mask is implied), labels and a loss_mask with the last position masked out."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, -1] = 0
    return {
        "tokens": ids[:, :-1].contiguous().to(device),
        "position_ids": torch.arange(seq).expand(batch, seq).contiguous().to(device),
        "attention_mask": None,
        "labels": ids[:, 1:].contiguous().to(device),
        "loss_mask": loss_mask.to(device),
    }


def loss_and_grads(
    model: torch.nn.Module, batch: dict[str, torch.Tensor | None]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward with labels, mean loss over ``loss_mask``, backward; returns (fp32 loss, fp32 grad clones).

    Grads are cleared first, so calls do not accumulate. Names are those of the unwrapped ``GPTModel``.
    As Megatron's ``finalize_model_grads`` would, grads of parameters tagged ``sequence_parallel`` (norms,
    router) are summed over the tensor-parallel group in the returned clones; other grads are per rank
    (TP shards stay shards).
    """
    from megatron.core import parallel_state

    inner = getattr(model, "module", model)
    for param in model.parameters():
        param.grad = None
    per_token = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    loss_mask = batch["loss_mask"]
    loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    sum_over_tp = parallel_state.get_tensor_model_parallel_world_size() > 1
    grads: dict[str, torch.Tensor] = {}
    for name, param in inner.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is None:
            continue
        grad = grad.detach().float().clone()
        if sum_over_tp and getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=tp_group)
        grads[name] = grad
    return loss.detach(), grads
