"""Train a mixture-of-experts GPT with Megatron-Core and ``--enable-primus-turbo`` on synthetic data.

Builds the model the way Megatron-LM's ``pretrain_gpt`` does (``get_gpt_decoder_block_spec`` with the
Transformer-Engine layer spec), after ``apply_primus_turbo_to_megatron`` has put Turbo modules into those
slots; prints which class fills each slot, the per-step loss and tokens/s. ``--compare`` also trains
Megatron's local spec from the same initial weights on the same data and prints both side by side.

Without a GPU it trains a tiny model over 2 gloo processes with expert parallelism 2 (the portable
dispatch backend); with GPUs, ``--size small`` is a realistic small model (hidden 2048, 8 layers, 16
experts top-2, sequence 4096) on ``--nproc`` GPUs, and ``--size finegrained`` a fine-grained MoE (hidden
2048, 4 layers, 128 experts top-8 of ffn 768), whose many short expert kernels make the host path show,
and ``--size mixtral`` two Mixtral-8x7B layers (hidden 4096, 32 heads, 8 experts top-2 of ffn 14336),
whose large expert GEMMs set the pace.

    python examples/megatron/train_moe.py                      # CPU: tiny, 2 processes, EP 2
    python examples/megatron/train_moe.py --size small --nproc 1 --compare --enable-primus-turbo
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from primus_turbo.integrations.megatron import add_primus_turbo_args, apply_primus_turbo_to_megatron

SIZES = {
    "tiny": dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=4,
        moe_router_topk=2, moe_ffn_hidden_size=64, seq=64, vocab=256, batch=2,
    ),
    "small": dict(
        num_layers=8, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632, num_moe_experts=16,
        moe_router_topk=2, moe_ffn_hidden_size=1408, seq=4096, vocab=32768, batch=1,
    ),
    # Mixtral-8x7B's layer (8 experts top-2, expert ffn 14336): few large experts, GEMM-bound
    "mixtral": dict(
        num_layers=2, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336, num_moe_experts=8,
        moe_router_topk=2, moe_ffn_hidden_size=14336, seq=4096, vocab=32000, batch=1,
    ),
    # fine-grained experts (DeepSeek / Qwen3-MoE style): many small experts, so many short kernels a step
    "finegrained": dict(
        num_layers=4, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632, num_moe_experts=128,
        moe_router_topk=8, moe_ffn_hidden_size=768, seq=4096, vocab=32768, batch=1,
    ),
}  # fmt: skip


FINAL_STEPS = 10
CUDA_GRAPH_IMPLS = ("none", "step", "local", "full_iteration")
MEGATRON_GRAPH_IMPLS = ("local", "full_iteration")  # run through Megatron's forward_backward_func
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")


@dataclass
class StepLog:
    """One training step: loss, the forward+backward time, the host time to enqueue it (equal to the step
    time when the host, not the GPU, sets the pace), the optimizer step's time, and the GPU memory held
    after the step per model parameter (weights, gradients, optimizer state, FP8 weight copies)."""

    step: int
    loss: float
    fwd_bwd_s: float
    host_s: float
    opt_s: float = 0.0
    bytes_per_param: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    gpu = torch.cuda.is_available()
    parser.add_argument("--size", choices=sorted(SIZES), default="small" if gpu else "tiny")
    parser.add_argument("--nproc", type=int, default=1 if gpu else 2, help="processes (GPUs)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallel on)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the tokens/s median")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--compare", action="store_true", help="also train Megatron's local spec")
    parser.add_argument("--local-only", action="store_true", help="train only Megatron's local spec")
    parser.add_argument("--fp8", choices=["e4m3", "hybrid"], default=None)
    parser.add_argument(
        "--fp8-recipe", choices=["tensorwise", "blockwise", "mxfp8", "delayed"], default="delayed"
    )
    parser.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="FP8 primary weights (Megatron's fp8_param): the Turbo model's FP8 linears keep their weights' "
        "FP8 copies, which the optimizer (Primus-Turbo's FusedAdamW) writes in its step, so no forward "
        "quantizes a weight",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the Turbo GPT model as one graph: embedding, layers, output layer and loss",
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode without CUDA graphs (default, max-autotune-no-cudagraphs); for CUDA "
        "graphs add --cuda-graph",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="capture the Turbo model's forward+backward in one CUDA graph after the warm-up steps and "
        "replay it (one GPU: the one-rank MoE path never waits for the host); the local spec stays eager. "
        "Same as --cuda-graph-impl step",
    )
    parser.add_argument(
        "--cuda-graph-impl",
        choices=CUDA_GRAPH_IMPLS,
        default="none",
        help="CUDA graphs for the Turbo model: 'step' is this example's own capture of the forward+backward; "
        "'local' is megatron-core's per-layer graphs (cuda_graph_impl='local', scope from "
        "--cuda-graph-modules) and 'full_iteration' its whole forward_backward_func graph, both run through "
        "Megatron's schedule (default: none)",
    )
    parser.add_argument(
        "--cuda-graph-modules",
        nargs="*",
        choices=CUDA_GRAPH_MODULES,
        default=[],
        help="with --cuda-graph-impl local: the parts of each layer captured (megatron-core's "
        "cuda_graph_modules; none given: the whole layer)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per step (gradient accumulation); FP8 weights are quantized on the first only",
    )
    parser.add_argument("--csv", default=None, help="write per-step rows here")
    add_primus_turbo_args(parser)
    args = parser.parse_args(argv)
    if not args.local_only:
        args.enable_primus_turbo = True  # the example's point: implied unless --local-only
    if args.micro_batches < 1:
        parser.error("--micro-batches must be at least 1")
    if args.cuda_graph:
        if args.cuda_graph_impl not in ("none", "step"):
            parser.error(f"--cuda-graph is --cuda-graph-impl step, not {args.cuda_graph_impl}")
        args.cuda_graph_impl = "step"
    args.cuda_graph = args.cuda_graph_impl == "step"
    if args.cuda_graph_modules and args.cuda_graph_impl != "local":
        parser.error("--cuda-graph-modules selects the parts of megatron-core's --cuda-graph-impl local")
    if args.cuda_graph and args.micro_batches > 1:
        parser.error("--cuda-graph captures one micro-batch a step: its gradients are rewritten, not summed")
    if args.cuda_graph_impl != "none" and (args.nproc != 1 or not torch.cuda.is_available()):
        parser.error(f"--cuda-graph-impl {args.cuda_graph_impl} needs one GPU (--nproc 1): "
                     "multi-rank dispatch sizes its buffers on the host")  # fmt: skip
    if args.cuda_graph_impl in MEGATRON_GRAPH_IMPLS and (args.compile or args.local_only):
        parser.error(f"--cuda-graph-impl {args.cuda_graph_impl} graphs the eager Turbo model: drop "
                     "--compile / --local-only")  # fmt: skip
    if args.compile_mode in ("reduce-overhead", "max-autotune"):
        # CUDA-graph trees own their outputs' memory; Megatron's MoE metrics tracker keeps one across steps
        parser.error(f"--compile-mode {args.compile_mode} takes CUDA graphs per layer, which Megatron's MoE "
                     "logging breaks; use --compile --cuda-graph (one graph of the whole step)")  # fmt: skip
    return args


def transformer_kwargs(args: argparse.Namespace) -> dict:
    """``TransformerConfig`` fields for ``--size`` (SwiGLU, RMSNorm, bf16, no dropout, no biases)."""
    size = {k: v for k, v in SIZES[args.size].items() if k not in ("seq", "vocab", "batch")}
    ep = args.nproc // args.tp
    return dict(
        size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=args.tp,
        sequence_parallel=args.tp > 1,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=True,
        moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss",
        moe_router_dtype="fp32",
        fp8=args.fp8,
        fp8_recipe=args.fp8_recipe,
        fp8_param=args.fp8_param_gather,
    )


def megatron_graph_kwargs(args: argparse.Namespace) -> dict:
    """``TransformerConfig`` fields of megatron-core's own CUDA graphs for ``--cuda-graph-impl``."""
    if args.cuda_graph_impl not in MEGATRON_GRAPH_IMPLS:
        return {}
    graph = dict(cuda_graph_impl=args.cuda_graph_impl, cuda_graph_warmup_steps=args.warmup)
    if args.cuda_graph_impl == "local":
        graph["cuda_graph_modules"] = list(args.cuda_graph_modules)
    return graph


def synthetic_batch(step: int, rank: int, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """Learnable token sequences: each token a fixed affine map of the one before, 10% noise."""
    size = SIZES[args.size]
    vocab, seq, batch = size["vocab"], size["seq"], size["batch"]
    gen = torch.Generator().manual_seed(args.seed * 1000003 + step * 101 + rank)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(1, seq + 1):
        tokens[:, t] = (tokens[:, t - 1] * 5 + 3) % vocab
    noise = torch.rand(batch, seq + 1, generator=gen) < 0.1
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)
    return tokens.to(device)


def build_model(args: argparse.Namespace, turbo: bool, device: torch.device) -> torch.nn.Module:
    """A ``GPTModel`` from Megatron's TE spec builder (Turbo slots once patched), or its local spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = transformer_kwargs(args)
    if turbo:
        kwargs.update(megatron_graph_kwargs(args))
        # "step" is this example's own capture, not a megatron-core setting
        patch_args = argparse.Namespace(**{**vars(args), "cuda_graph_impl": "none", **kwargs})
        if args.cuda_graph and args.turbo_fp8_auto_filter == "auto":
            patch_args.turbo_fp8_auto_filter = "graph"  # the example's own capture: no host path per step
        apply_primus_turbo_to_megatron(
            patch_args
        )  # before the config: it answers Megatron's TE gates for FP8
        kwargs["moe_token_dispatcher_type"] = patch_args.moe_token_dispatcher_type
    else:
        kwargs.update(fp8=None, fp8_param=False, moe_grouped_gemm=False)
    config = TransformerConfig(**kwargs)
    if turbo:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
    size = SIZES[args.size]
    model = GPTModel(config, spec, vocab_size=size["vocab"], max_sequence_length=size["seq"])
    if args.compile:
        # the whole model, not layer by layer: the graph then includes the cross-entropy loss over the
        # vocabulary (a dozen elementwise passes over the logits in eager Megatron) and runs once a step
        model.compile(mode=args.compile_mode)
    return Float16Module(config, model).to(device)


def _add_main_grads(model: torch.nn.Module) -> None:
    """Move the fp32 ``main_grad`` buffers into ``.grad`` and zero them in place (their addresses are in
    megatron-core's backward graphs): with ``cuda_graph_impl='local'`` a captured layer adds its weight
    gradients to ``param.main_grad``, the buffer Megatron's DDP wrapper gives each parameter."""
    for param in model.parameters():
        grad = param.main_grad.to(param.dtype)
        param.grad = grad if param.grad is None else param.grad + grad
        param.main_grad.zero_()


def _reduce_grads(model: torch.nn.Module) -> None:
    """Data-parallel gradient mean (experts over the expert-data-parallel group) and the sum of
    sequence-parallel norm gradients over the TP group: what Megatron's DDP and finalize_model_grads do."""
    from megatron.core import parallel_state as ps

    dp, edp, tp = (
        ps.get_data_parallel_group(),
        ps.get_expert_data_parallel_group(),
        ps.get_tensor_model_parallel_group(),
    )
    for param in model.parameters():
        if param.grad is None:
            continue
        if getattr(param, "sequence_parallel", False) and dist.get_world_size(tp) > 1:
            dist.all_reduce(param.grad, group=tp)
        group = dp if getattr(param, "allreduce", True) else edp
        if dist.get_world_size(group) > 1:
            dist.all_reduce(param.grad, group=group)
            param.grad /= dist.get_world_size(group)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GraphedStep:
    """Forward+backward of a training step captured once in a CUDA graph, then replayed.

    A host-bound step (many short kernels) runs at the GPU's pace when replayed. The batch is copied into
    a static tensor; the gradients are the graph's own tensors, rewritten (not accumulated) by each
    replay, so they are never set to None after the capture. The optimizer step stays outside the graph.
    """

    WARMUP = 2  # eager passes on a side stream before the capture (lazy init, autotune, allocator)

    def __init__(
        self,
        step: Callable[[torch.Tensor], torch.Tensor],
        tokens: torch.Tensor,
        zero_grad: Callable[[], None],
    ) -> None:
        self.tokens = tokens.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                step(self.tokens)
        torch.cuda.current_stream().wait_stream(side)
        zero_grad()  # the capture's backward then allocates the gradients in the graph's pool
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = step(self.tokens)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.loss


def megatron_schedule(
    model: torch.nn.Module, args: argparse.Namespace, position_ids: torch.Tensor, mask: torch.Tensor
) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Forward+backward of one step's micro-batches through megatron-core's ``forward_backward_func``,
    which drives its own CUDA graphs: per-layer graphs recorded on the first step and created at its end
    (``cuda_graph_impl='local'``), or the whole function captured after ``args.warmup`` steps
    (``FullCudaGraphWrapper``, ``'full_iteration'``; it copies each batch into static buffers)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    schedule = get_forward_backward_func()
    if args.cuda_graph_impl == "full_iteration":
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        schedule = FullCudaGraphWrapper(schedule, cuda_graph_warmup_steps=args.warmup)
    size = SIZES[args.size]

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)["tokens"]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        output = model(inputs, position_ids.expand_as(inputs), mask, labels=labels)

        def loss_func(per_token: torch.Tensor):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    def run(batches: list[torch.Tensor]) -> torch.Tensor:
        losses = schedule(
            forward_step_func=forward_step,
            data_iterator=iter([{"tokens": tokens} for tokens in batches]),
            model=model,
            num_microbatches=len(batches),
            seq_length=size["seq"],
            micro_batch_size=size["batch"],
            forward_only=False,
        )
        return torch.stack([item["loss"] for item in losses]).mean()

    return run


def set_aux_loss_scale(args: argparse.Namespace, device: torch.device) -> None:
    """As Megatron's schedule does each step: the aux losses' gradient scale (1 / micro-batches, no loss
    scaling), with the schedule's shape [1]."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1 / args.micro_batches, device=device))


def causal_inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids [1, seq], the causal attention mask [1, 1, seq, seq], True where masked)."""
    seq = SIZES[args.size]["seq"]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
    return torch.arange(seq, device=device)[None], mask


def forward_backward_step(
    model: torch.nn.Module, args: argparse.Namespace, position_ids: torch.Tensor, mask: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One micro-batch's forward and backward (the loss over ``args.micro_batches``), returning the loss."""

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        loss = model(inputs, position_ids.expand_as(inputs), mask, labels=labels).float().mean()
        (loss / args.micro_batches).backward()
        # detached: a live autograd graph keeps its parameters' gradient-accumulator nodes, which remember
        # the stream they were made on, and a CUDA-graph capture must not find the default stream's there
        return loss.detach()

    return forward_backward


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Adam, no weight decay: PyTorch's, or with ``--fp8-param-gather`` Primus-Turbo's ``FusedAdamW``, whose
    step also writes the FP8 copies of the weights that have them (the others take PyTorch's update)."""
    if model.config.fp8_param:
        from primus_turbo.pytorch.optim import FusedAdamW

        return FusedAdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return torch.optim.Adam(model.parameters(), lr=args.lr)


def train(
    model: torch.nn.Module, args: argparse.Namespace, rank: int, device: torch.device, impl: str = "none"
) -> list[StepLog]:
    """``args.steps`` Adam steps of ``args.micro_batches`` micro-batches each on the synthetic data of this
    data-parallel rank. ``impl`` is the model's CUDA-graph implementation: "step" replays this example's
    graph of the forward+backward after ``args.warmup`` steps; "local" and "full_iteration" run the
    step through megatron-core's schedule, which captures and replays its own graphs."""
    from megatron.core import parallel_state as ps

    set_aux_loss_scale(args, device)
    optimizer = make_optimizer(model, args)
    params = sum(p.numel() for p in model.parameters())
    if impl == "local":
        for param in model.parameters():
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
    data_rank = ps.get_data_parallel_rank()
    position_ids, mask = causal_inputs(args, device)
    forward_backward = forward_backward_step(model, args, position_ids, mask)
    graphed: GraphedStep | None = None
    scheduled = megatron_schedule(model, args, position_ids, mask) if impl in MEGATRON_GRAPH_IMPLS else None
    logs = []
    for step in range(args.steps):
        batches = [
            synthetic_batch(step * args.micro_batches + i, data_rank, args, device)
            for i in range(args.micro_batches)
        ]
        if impl == "step" and step >= args.warmup and graphed is None:
            graphed = GraphedStep(forward_backward, batches[0], lambda: optimizer.zero_grad(set_to_none=True))
        run = graphed or forward_backward
        model.set_is_first_microbatch()  # as Megatron's schedule: FP8 weights are quantized again
        _sync(device)
        start = time.perf_counter()
        if scheduled is not None:
            loss = scheduled(batches)
        else:
            loss = sum(run(tokens) for tokens in batches) / args.micro_batches
        host = time.perf_counter() - start
        _sync(device)
        elapsed = time.perf_counter() - start
        if impl == "local":
            _add_main_grads(model)
        _reduce_grads(model)
        _sync(device)
        opt_start = time.perf_counter()
        optimizer.step()
        _sync(device)
        opt_s = time.perf_counter() - opt_start
        # a whole-step graph owns the gradients from its capture on: each replay rewrites them
        graph_owns_grads = graphed is not None or (impl == "full_iteration" and step >= args.warmup)
        if not graph_owns_grads:
            optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        held = torch.cuda.memory_allocated(device) / params if device.type == "cuda" else 0.0
        logs.append(StepLog(step, mean_loss.item() / dist.get_world_size(), elapsed, host, opt_s, held))
    return logs


def final_loss(logs: list[StepLog]) -> float:
    """The loss at the end of training: the mean of the last steps (one batch's loss is noisy)."""
    tail = logs[-FINAL_STEPS:]
    return sum(log.loss for log in tail) / len(tail)


def _timed(logs: list[StepLog], args: argparse.Namespace) -> list[StepLog]:
    """The steps after the warm-up (all of them when there are no more)."""
    return logs[args.warmup :] or logs


def tokens_per_s(logs: list[StepLog], args: argparse.Namespace) -> float:
    return _tokens_per_step(args) / statistics.median(log.fwd_bwd_s for log in _timed(logs, args))


def _tokens_per_step(args: argparse.Namespace) -> int:
    size = SIZES[args.size]
    return size["seq"] * size["batch"] * args.micro_batches * (args.nproc // args.tp)


def _describe(model: torch.nn.Module) -> str:
    layer = model.module.decoder.layers[0]
    attn, mlp = layer.self_attention, layer.mlp
    slots = {
        "linear_qkv": attn.linear_qkv,
        "core_attention": attn.core_attention,
        "linear_proj": attn.linear_proj,
        "pre_mlp_layernorm": layer.pre_mlp_layernorm,
        "experts": getattr(mlp, "experts", mlp),
        "token_dispatcher": getattr(mlp, "token_dispatcher", None),
        "final_layernorm": model.module.decoder.final_layernorm,
    }
    return "\n".join(f"  {slot:18s} {type(module).__name__}" for slot, module in slots.items())


def _worker(rank: int, args: argparse.Namespace, store: str) -> None:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        from primus_turbo.integrations.megatron.cpu import enable_megatron_on_cpu

        enable_megatron_on_cpu()
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if gpu else "gloo", init_method=f"file://{store}", rank=rank, world_size=args.nproc
    )
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(args.tp, expert_model_parallel_size=args.nproc // args.tp)
    runs = []
    if args.compare or args.local_only:
        runs.append("local")
    if not args.local_only:
        runs.append("turbo")
    models, results = {}, {}
    for name in runs:
        torch.manual_seed(args.seed)
        # megatron-core's graphs need its graph-safe RNG tracker
        model_parallel_cuda_manual_seed(
            args.seed, use_cudagraphable_rng=args.cuda_graph_impl in MEGATRON_GRAPH_IMPLS
        )
        models[name] = build_model(args, name != "local", device)
    if "local" in models and len(models) > 1:
        from primus_turbo.integrations.megatron.state_dict import local_to_te_state_dict

        other = models[runs[-1]]
        other.module.load_state_dict(
            local_to_te_state_dict(models["local"].module.state_dict(), other.module.state_dict().keys()),
            strict=False,
        )
    for name in runs:
        if rank == 0:
            ep = args.nproc // args.tp
            print(f"[{name}] {args.size} model, {args.nproc} process(es), TP {args.tp}, EP {ep}")
            print(_describe(models[name]), flush=True)
        impl = args.cuda_graph_impl if name != "local" else "none"
        # the local spec keeps PyTorch's backward threading; the patch moved Turbo's to the calling thread
        # (--no-turbo-backward-on-caller-thread keeps PyTorch's for both)
        threads = torch.autograd.set_multithreading_enabled
        with threads(True) if name == "local" else contextlib.nullcontext():
            results[name] = train(models[name], args, rank, device, impl)
    if rank == 0:
        _report(results, args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo's threads can abort it


def _report(results: dict[str, list[StepLog]], args: argparse.Namespace) -> None:
    names = list(results)
    print("step " + " ".join(f"{n + ' loss':>12s} {n + ' tok/s':>12s}" for n in names))
    tokens = _tokens_per_step(args)
    for i in range(args.steps):
        print(
            f"{i:4d} "
            + " ".join(f"{results[n][i].loss:12.4f} {tokens / results[n][i].fwd_bwd_s:12.0f}" for n in names)
        )
    rates = {n: tokens_per_s(results[n], args) for n in names}
    print("median tokens/s (fwd+bwd): " + ", ".join(f"{n} {r:,.0f}" for n, r in rates.items()))
    hosts = {n: statistics.median(log.host_s for log in _timed(results[n], args)) for n in names}
    print("median host ms to enqueue a step: " + ", ".join(f"{n} {h * 1e3:.1f}" for n, h in hosts.items()))
    opts = {n: statistics.median(log.opt_s for log in _timed(results[n], args)) for n in names}
    print("median optimizer step ms: " + ", ".join(f"{n} {t * 1e3:.1f}" for n, t in opts.items()))
    held = {n: results[n][-1].bytes_per_param for n in names}
    if any(held.values()):
        listing = ", ".join(f"{n} {b:.2f}" for n, b in held.items())
        print(f"GPU memory held after a step, bytes per parameter: {listing}")
    if len(names) == 2:
        a, b = names
        loss_a, loss_b = final_loss(results[a]), final_loss(results[b])
        gap = abs(loss_b - loss_a) / loss_a
        print(f"{b} / {a}: {rates[b] / rates[a]:.2f}x tokens/s; final loss {loss_b:.4f} vs {loss_a:.4f} "
              f"({gap:.2%} apart; mean of the last {FINAL_STEPS} steps)")  # fmt: skip
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(
                ["run", "step", "loss", "fwd_bwd_ms", "host_ms", "tokens_per_s", "opt_ms", "bytes_per_param"]
            )
            for n in names:
                for log in results[n]:
                    rate = tokens / log.fwd_bwd_s
                    times = f"{log.fwd_bwd_s * 1e3:.3f}", f"{log.host_s * 1e3:.3f}"
                    extra = f"{log.opt_s * 1e3:.3f}", f"{log.bytes_per_param:.3f}"
                    writer.writerow([n, log.step, f"{log.loss:.6f}", *times, f"{rate:.1f}", *extra])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(args, os.path.join(folder, "store")), nprocs=args.nproc, join=True)
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
