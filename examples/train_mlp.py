"""Train a small MLP built from ``primus_turbo`` Linear layers on a synthetic regression task.

Prints the loss curve, the time per step and which backend served the GEMMs. Runs on a GPU when one
is visible (bf16), otherwise on the CPU (fp32).
"""

from __future__ import annotations

import argparse
import time

import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.gemm.gemm_impl import GemmDispatcher


def build_mlp(width: int, depth: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Sequential:
    """``depth`` hidden Turbo Linear layers with GELU, then a Linear head to one output."""
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [turbo.modules.Linear(width, width, device=device, dtype=dtype), torch.nn.GELU()]
    layers.append(turbo.modules.Linear(width, 1, device=device, dtype=dtype))
    return torch.nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--backend", choices=[b.name for b in BackendType], help="pin the GEMM backend")
    parser.add_argument("--autotune", action="store_true", help="time every GEMM backend per shape")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if args.backend:
        GlobalBackendManager.set_gemm_backend(args.backend)
    GlobalBackendManager.set_auto_tune(args.autotune)

    teacher = torch.randn(args.width, 1, device=device) / args.width**0.5
    model = build_mlp(args.width, args.depth, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"device={device} dtype={dtype} width={args.width} depth={args.depth} batch={args.batch}")

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.width, device=device)
        target = torch.sin(2 * x @ teacher)
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == 1 or step % 50 == 0 or step == args.steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}  loss {loss.item():.5f}  {1e3 * elapsed / step:.2f} ms/step")

    counts = GemmDispatcher.selection_counts()
    summary = ", ".join(
        f"{backend.name} x{n}" for backend, n in sorted(counts.items(), key=lambda kv: -kv[1])
    )
    print(f"gemm backends used (forward, dgrad, wgrad calls): {summary}")


if __name__ == "__main__":
    main()
