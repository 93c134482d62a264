"""Flash attention against ``scaled_dot_product_attention`` with the cuDNN and the flash backends.

Per distinct attention shape of the config models ((Hq, Hkv, Dqk, Dv): Llama-3, Qwen2.5, Mixtral, and
DeepSeek-V3's MLA at 192/128) and sequence length, causal, bf16, batch 1 (``--batch``): forward and
forward + backward time and TFLOP/s of each backend label, each SDPA backend in the same run (calls
interleaved, ``time_interleaved``), the ratios, and an SNR check of the forward against SDPA's math
result (40 dB; 20 dB for the FP8 label, ``flash_attn_fp8_func``, whose backward is the bf16 one). SDPA
sees [B, H, S, D] views of the same bshd tensors and ``enable_gqa``; a backend that rejects a shape (the
flash backend has no 192/128) shows ``-``.

Example::

    python -m benchmark.ops.training.bench_attention_turbo --seqs 2048,4096,8192 -o attention.csv
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_utils import platform_name, time_interleaved, write_csv
from benchmark.ops.training.config import DEEPSEEK_V3, DENSE_MODELS

LOG = logging.getLogger("bench_attention_turbo")
SNR_PASS_DB = 40.0
FP8_SNR_PASS_DB = 20.0
SDPA_PEERS = ("CUDNN_ATTENTION", "FLASH_ATTENTION")


def attention_shapes() -> list[tuple[str, int, int, int, int]]:
    """(models, Hq, Hkv, Dqk, Dv) of the config models, duplicates merged."""
    shapes: dict[tuple[int, int, int, int], list[str]] = {}
    for m in DENSE_MODELS.values():
        shapes.setdefault((m.num_heads, m.num_kv_heads, m.head_dim, m.head_dim), []).append(m.name)
    mla = DEEPSEEK_V3
    d_qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    shapes.setdefault((mla.num_heads, mla.num_heads, d_qk, mla.v_head_dim), []).append(mla.name)
    return [("/".join(names), *shape) for shape, names in shapes.items()]


def causal_flops(s: int, h_q: int, d_qk: int, d_v: int, batch: int) -> float:
    """Forward FLOPs of causal attention: half of 2 * S^2 * H * (Dqk + Dv)."""
    return batch * h_q * s * s * (d_qk + d_v)


def sdpa_call(backend_name: str, q, k, v) -> Callable[[], torch.Tensor]:
    """SDPA restricted to one backend on [B, H, S, D] views of bshd tensors; the output is viewed back as
    bshd, so that every label takes the same output gradient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    gqa = q.shape[2] != k.shape[2]

    def run() -> torch.Tensor:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
            ).transpose(1, 2)

    return run


def snr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (reference.double() - actual.double()).pow(2).sum()
    return (10 * torch.log10(reference.double().pow(2).sum() / noise)).item()


def bench_case(label_fns: dict[str, Callable], q, k, v, device: str) -> dict[str, tuple[float, float]]:
    """(forward ms, forward + backward ms) per label, every label interleaved call by call."""
    names, calls = [], []
    for name, fn in label_fns.items():
        try:
            fn()
        except RuntimeError as exc:  # an SDPA backend without a kernel for this shape
            LOG.info("%s: %s", name, str(exc).splitlines()[0][:100])
            continue
        names.append(name)
        calls.append(fn)
    with torch.no_grad():
        fwd = time_interleaved(calls, None, device)
    grad = torch.randn_like(calls[0]())

    def step(fn):
        fn().backward(grad)

    fwd_bwd = time_interleaved([functools.partial(step, fn) for fn in calls], [q, k, v], device)
    return {name: (f, fb) for name, f, fb in zip(names, fwd, fwd_bwd, strict=True)}


def main(argv: list[str] | None = None) -> None:
    """Benchmark every (shape, sequence length), print the table and write the CSV."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="2048,4096,8192,16384", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--backends",
        default="TRITON,DEFAULT",
        help="BackendType names, DEFAULT (no pin, no autotune), AUTO (autotune), FP8 (flash_attn_fp8_func)",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("-o", "--output", default="bench_attention.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
    from primus_turbo.pytorch.kernels.attention.flash_attn_impl import AttentionDispatcher
    from primus_turbo.pytorch.ops import flash_attn_fp8_func, flash_attn_func

    labels = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    rows = []
    for models, h_q, h_kv, d_qk, d_v in attention_shapes():
        for seq in (int(s) for s in args.seqs.split(",")):
            gen = torch.Generator().manual_seed(0)

            def make(h, d, gen=gen, seq=seq):
                x = torch.randn(args.batch, seq, h, d, generator=gen, dtype=torch.bfloat16)
                return x.to(args.device).requires_grad_()

            q, k, v = make(h_q, d_qk), make(h_kv, d_qk), make(h_kv, d_v)
            peers = {name: sdpa_call(name, q, k, v) for name in SDPA_PEERS} if args.device == "cuda" else {}
            with torch.no_grad():  # fp32 math reference where it fits comfortably in memory
                full = (t.detach().float() for t in (q, k, v))
                reference = sdpa_call("MATH", *full)() if seq <= 4096 else None
            flops = causal_flops(seq, h_q, d_qk, d_v, args.batch)
            for label in labels:
                GlobalBackendManager.reset()
                if label == "AUTO":
                    GlobalBackendManager.set_auto_tune(True)
                elif label not in ("DEFAULT", "FP8"):
                    GlobalBackendManager.set_attn_backend(BackendType[label])
                row = {"Models": models, "Hq": h_q, "Hkv": h_kv, "Dqk": d_qk, "Dv": d_v, "Seq": seq}
                row["Backend"] = label
                fp8 = label == "FP8"
                try:
                    turbo = functools.partial(
                        flash_attn_fp8_func if fp8 else flash_attn_func, q, k, v, causal=True
                    )
                    with torch.no_grad():
                        out = turbo()
                    row["Selected"] = "TRITON" if fp8 else AttentionDispatcher.last_selected().name
                    row["SNR dB"] = snr_db(reference, out) if reference is not None else float("nan")
                    passing = FP8_SNR_PASS_DB if fp8 else SNR_PASS_DB
                    row["Check"] = "PASS" if reference is None or row["SNR dB"] >= passing else "FAIL"
                    times = bench_case({"turbo": turbo, **peers}, q, k, v, args.device)
                except Exception as exc:  # report the row and keep going
                    row["Check"] = f"ERROR {type(exc).__name__}: {exc}"[:200]
                    LOG.warning("%s", row["Check"])
                    rows.append(row)
                    continue
                fwd, fwd_bwd = times["turbo"]
                # the backward's five matmuls to the forward's two: 3.5x the forward FLOPs in all
                row.update({"Fwd TFLOPS": flops / fwd / 1e9, "Fwd+Bwd TFLOPS": 3.5 * flops / fwd_bwd / 1e9})
                for peer in SDPA_PEERS:
                    if peer in times:
                        name = peer.split("_")[0].lower()
                        row[f"{name} Fwd ratio"] = times[peer][0] / fwd
                        row[f"{name} Fwd+Bwd ratio"] = times[peer][1] / fwd_bwd
                row["Platform"], row["Torch"] = platform_name(args.device), torch.__version__
                rows.append(row)
                LOG.info("%s", {k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()})
            q.grad = k.grad = v.grad = None
    columns = ["Models", "Hq", "Hkv", "Dqk", "Dv", "Seq", "Backend", "Selected", "Check", "Fwd TFLOPS"]
    columns += ["Fwd+Bwd TFLOPS", "cudnn Fwd ratio", "cudnn Fwd+Bwd ratio"]
    columns += ["flash Fwd ratio", "flash Fwd+Bwd ratio"]
    print(tabulate([[r.get(c, "-") for c in columns] for r in rows], headers=columns, floatfmt=".2f"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
