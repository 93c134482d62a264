"""Compile the Triton kernels for an NVIDIA sm_90 target on a machine without a GPU.

The interpreter runs kernels as numpy code, so it cannot catch what only the compiler sees (type
errors in loop-carried values, unsupported layouts, shared memory). This script swaps Triton's driver
for a stub that reports an sm_90 device, captures the compile requests the launchers make, and
compiles each one to PTX. It prints one line per kernel and config and exits 1 if any fails.

    python scripts/compile_check.py            # every kernel, every CUDA config
    python scripts/compile_check.py --quick    # the first config of each kernel (CI)
    python scripts/compile_check.py --quick --sass-dir before/   # also write each kernel's SASS

Diffing two ``--sass-dir`` folders tells whether a refactor changed the machine code at all.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["PRIMUS_TURBO_TRITON_AUTOTUNE"] = "0"  # launchers pick their config on the host: no timing runs

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_requests: list[tuple] = []
_sass_dir: list[str] = []  # set by --sass-dir


class _Sm90Driver:
    """Just enough of a driver for JITFunction.run to reach compilation."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True


def _capture(self, key, signature, device, constexprs, options, attrs, warmup):
    _requests.append((self, signature, constexprs, options, attrs))


def _cuobjdump(kernel, flag: str) -> str:
    """cuobjdump's ``flag`` output for the kernel's cubin, or "" without cuobjdump."""
    cubin = kernel.asm.get("cubin")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(cuobjdump):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True).stdout


def _write_sass(label: str, kernel) -> None:
    """The kernel's SASS into the --sass-dir folder, one file per label (kernel names stripped)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")
    sass = _cuobjdump(kernel, "--dump-sass")
    with open(os.path.join(_sass_dir[0], f"{name}.sass"), "a") as f:
        f.write(re.sub(r"Function : \S+", "Function", sass))


def _resources(kernel) -> str:
    """``, N registers, S B spilled`` from the cubin's resource usage (cuobjdump), or "" without it."""
    usage = _cuobjdump(kernel, "--dump-resource-usage")
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    if regs is None:
        return ""
    return f", {regs.group(1)} registers, {stack.group(1) if stack else '?'} B stack"


def _compile_requests(label: str) -> bool:
    ok = True
    while _requests:
        fn, signature, constexprs, options, attrs = _requests.pop(0)
        try:
            source = getattr(fn, "ASTSource", ASTSource)  # Gluon kernels bring their own
            kernel = triton.compile(
                source(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__
            )
            print(f"[OK]   {label}: shared memory {kernel.metadata.shared} B{_resources(kernel)}", flush=True)
            if _sass_dir:
                _write_sass(label, kernel)
        except Exception as exc:  # report every failure, keep going
            ok = False
            print(
                f"[FAIL] {label}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}", flush=True
            )
    return ok


def _label(config: triton.Config) -> str:
    kw = config.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} s{config.num_stages} w{config.num_warps}"


def main(argv: list[str] | None = None) -> int:
    """Compile every selected kernel/config; 0 when all compile."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="first config of each kernel only")
    parser.add_argument(
        "--sass-dir", default="", help="also write each kernel's SASS into this (new or empty) folder"
    )
    args = parser.parse_args(argv)
    if args.sass_dir:
        os.makedirs(args.sass_dir, exist_ok=True)
        _sass_dir.append(args.sass_dir)
    driver.set_active(_Sm90Driver())
    JITFunction._do_compile = _capture

    import primus_turbo.triton.utils.device_info as device_info

    device_info.interpreter_active = lambda: False
    from primus_turbo.triton.activation import gated_act_kernel as act
    from primus_turbo.triton.attention import flash_attn_kernel as attn
    from primus_turbo.triton.attention import fp8_quant_kernel as attn_quant
    from primus_turbo.triton.gemm import gemm_fp8_block_sm90 as sm90
    from primus_turbo.triton.gemm import gemm_fp8_kernel as fp8
    from primus_turbo.triton.gemm import gemm_kernel as gemm
    from primus_turbo.triton.grouped_gemm import group_quant_kernel as group_quant
    from primus_turbo.triton.grouped_gemm import grouped_gemm_kernel as grouped
    from primus_turbo.triton.moe import ep_kernel as ep
    from primus_turbo.triton.moe import permute_kernel as permute
    from primus_turbo.triton.moe import router_kernel as router
    from primus_turbo.triton.normalization import rmsnorm_kernel as norm
    from primus_turbo.triton.quantization import fp4_quant_kernel as fp4q
    from primus_turbo.triton.quantization import fp8_quant_kernel as fp8q

    for module in (gemm, fp8, grouped):
        module.interpreter_active = lambda: False

    def configs(make):
        found = make()
        return found[:1] if args.quick else found

    bf16, e4m3, e5m2, f32 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32
    ok = True

    def attempt(label, launch):
        nonlocal ok
        try:
            launch()
        except Exception as exc:  # a launcher error before any compile request
            if not _requests:
                ok = False
                print(f"[FAIL] {label}: launcher {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
        ok &= _compile_requests(label)

    m, n, k = 1024, 1024, 1024
    for config in configs(gemm._tma_configs):
        kw = config.kwargs
        a, b = torch.empty(m, k, dtype=bf16), torch.empty(n, k, dtype=bf16)
        out = torch.empty(m, n, dtype=bf16)
        descs = gemm._tma_descriptors(a, b, out, False, True, config)
        buffers = (torch.empty(1, dtype=f32), torch.empty(1, dtype=torch.int32))
        flags = dict(
            TRANS_A=False, TRANS_B=True, ACCUMULATE=False, DTYPES="bf16", DOT_PRECISION="tf32", NUM_SMS=132
        )
        attempt(
            f"gemm tma {_label(config)} stream-k={kw['STREAM_K']}",
            lambda descs=descs, buffers=buffers, flags=flags, config=config: (
                gemm._gemm_tma_persistent_kernel.fn[(132,)](
                    *descs, *buffers, m, n, k, **flags, **config.all_kwargs()
                )
            ),
        )
    for config in configs(gemm._pointer_configs):
        a, b, out = torch.empty(m, k, dtype=bf16), torch.empty(k, n, dtype=bf16), torch.empty(m, n, dtype=f32)
        attempt(
            f"gemm pointer {_label(config)}",
            lambda a=a, b=b, out=out, config=config: gemm._gemm_pointer_kernel.fn[(1,)](
                a,
                b,
                out,
                m,
                n,
                k,
                *a.stride(),
                *b.stride(),
                *out.stride(),
                ACCUMULATE=True,
                DTYPES="bf16",
                DOT_PRECISION="tf32",
                **config.all_kwargs(),
            ),
        )
    for config in configs(fp8._configs):
        for use_tma, modes in ((True, (0, 0)), (True, (2, 3)), (False, (1, 1))):
            kw = config.kwargs
            a, b, out = (
                torch.empty(m, k, dtype=e4m3),
                torch.empty(n, k, dtype=e4m3),
                torch.empty(m, n, dtype=bf16),
            )
            scales = {
                0: torch.empty(()),
                1: torch.empty(m, 1),
                2: torch.empty(m, k // 128),
                3: torch.empty(n // 128, k // 128),
            }
            sa, sb = scales[modes[0]], scales[modes[1]]
            operands = (
                (
                    TensorDescriptor(a, a.shape, a.stride(), [kw["BLOCK_M"], kw["BLOCK_K"]]),
                    TensorDescriptor(b, b.shape, b.stride(), [kw["BLOCK_N"], kw["BLOCK_K"]]),
                )
                if use_tma
                else (a, b)
            )

            def strides(s):
                return (s.stride(0), s.stride(1)) if s.dim() == 2 else (0, 0)

            per_block = max(modes) >= 2
            launch_args = (
                m,
                n,
                k,
                a.stride(0),
                b.stride(0),
                out.stride(0),
                out.stride(1),
                *strides(sa),
                *strides(sb),
            )
            flags = dict(
                A_MODE=modes[0], B_MODE=modes[1], PER_BLOCK=per_block, SCALE_BLOCK=128 if per_block else 0
            )
            flags.update(ACCUMULATE=False, DTYPES="fp8", USE_TMA=use_tma, TMA_STORE=use_tma, NUM_SMS=132)
            flags.update(config.all_kwargs())
            tile = [config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]]
            c = TensorDescriptor(out, out.shape, out.stride(), tile) if use_tma else out
            attempt(
                f"gemm fp8 tma={use_tma} modes={modes} {_label(config)}",
                lambda operands=operands, c=c, sa=sa, sb=sb, launch_args=launch_args, flags=flags: (
                    fp8._gemm_fp8_kernel.fn[(132,)](*operands, c, sa, sb, *launch_args, **flags)
                ),
            )
    groups, tokens = 8, 4096
    offs = torch.empty(groups + 1, dtype=torch.int64)
    a16, w16 = torch.empty(tokens, k, dtype=bf16), torch.empty(groups, n, k, dtype=bf16)
    dy16 = torch.empty(tokens, n, dtype=bf16)
    a8, w8 = torch.empty(tokens, k, dtype=e5m2), torch.empty(groups, n, k, dtype=e4m3)
    lhs8, rhs8 = torch.empty(tokens, k, dtype=e4m3), torch.empty(tokens, n, dtype=e5m2)
    block = grouped.grouped_fp8_scale_block()
    block_rows = tokens // block + groups
    launches = [
        ("", grouped._grouped_gemm_kernel, lambda: grouped.grouped_gemm_triton(a16, w16, offs, True)),
        (
            "",
            grouped._grouped_gemm_variable_k_kernel,
            lambda: grouped.grouped_gemm_variable_k_triton(
                a16, dy16, offs, torch.empty(groups, k, n, dtype=f32), accumulate=True
            ),
        ),
        (
            "",
            grouped._grouped_gemm_fp8_kernel,
            lambda: grouped.grouped_gemm_fp8_triton(
                a8, torch.empty(tokens, 1), w8, torch.empty(groups, n, 1), offs, True, bf16
            ),
        ),
        (
            "blocks ",
            grouped._grouped_gemm_fp8_kernel,
            lambda: grouped.grouped_gemm_fp8_triton(
                a8,
                torch.empty(tokens, k // block),
                w8,
                torch.empty(groups, n // block, k // block),
                offs,
                True,
                bf16,
                block,
            ),
        ),
        (
            "",
            grouped._grouped_gemm_fp8_variable_k_kernel,
            lambda: grouped.grouped_gemm_fp8_variable_k_triton(
                lhs8, torch.empty(groups, k), rhs8, torch.empty(groups, n), offs, f32
            ),
        ),
        (
            "blocks ",
            grouped._grouped_gemm_fp8_variable_k_kernel,
            lambda: grouped.grouped_gemm_fp8_variable_k_triton(
                lhs8,
                torch.empty(block_rows, k),
                rhs8,
                torch.empty(block_rows, n),
                offs,
                f32,
                torch.empty(groups, dtype=torch.int64),
            ),
        ),
    ]
    from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_sm90 as grouped_sm90

    scale_blocks = torch.empty(groups, n // 128, k // 128)
    for label, a_scale, b_scale in (
        ("blocks", (torch.empty(k // 128, tokens).t(), 1, tokens), (scale_blocks, *scale_blocks.stride())),
        ("tensorwise", (torch.empty(()), 0, 0), (torch.empty(groups), 1, 0, 0)),
        ("rowwise", (torch.empty(tokens, 1), 1, 0), (torch.empty(()), 0, 0, 0)),
    ):
        columns = (torch.empty(groups, n), n, 1) if label == "rowwise" else None
        attempt(
            f"grouped fp8 sm90 (Gluon) {label}",
            lambda a_scale=a_scale, b_scale=b_scale, columns=columns: grouped_sm90.grouped_gemm_fp8_sm90(
                a8, a_scale, w8, b_scale, offs, torch.empty(tokens, n, dtype=bf16), columns
            ),
        )
    token_major = torch.empty(n, tokens, dtype=e5m2).t()
    for label, scales, out_dtype, accumulate in (
        ("tensorwise", (torch.empty(()), torch.empty(())), bf16, False),
        ("rowwise, accumulating", (torch.empty(groups, k), torch.empty(groups, n)), f32, True),
        ("blocks", (torch.empty(block_rows, k), torch.empty(block_rows, n)), bf16, False),
    ):
        attempt(
            f"grouped fp8 variable-K sm90 (Gluon) {label}",
            lambda label=label, scales=scales, out_dtype=out_dtype, accumulate=accumulate: (
                grouped_sm90.grouped_gemm_fp8_variable_k_sm90(
                    torch.empty(k, tokens, dtype=e4m3).t(),
                    scales[0],
                    token_major,
                    scales[1],
                    offs,
                    torch.empty(groups, k, n, dtype=out_dtype),
                    accumulate,
                    torch.empty(groups, dtype=torch.int64) if label == "blocks" else None,
                )
            ),
        )
    from primus_turbo.triton.grouped_gemm import grouped_gemm_sm90 as grouped16

    for trans_b in (True, False):
        weights = w16 if trans_b else torch.empty(groups, k, n, dtype=bf16)
        attempt(
            f"grouped bf16 sm90 (Gluon) {'K' if trans_b else 'N'}-major weights",
            lambda weights=weights, trans_b=trans_b: grouped16.grouped_gemm_sm90(
                a16, weights, offs, trans_b, torch.empty(tokens, n, dtype=bf16)
            ),
        )
    for out_dtype, accumulate in ((bf16, False), (f32, True)):
        attempt(
            f"grouped bf16 variable-K sm90 (Gluon) -> {out_dtype}",
            lambda out_dtype=out_dtype, accumulate=accumulate: grouped16.grouped_gemm_variable_k_sm90(
                dy16, a16, offs, torch.empty(groups, n, k, dtype=out_dtype), accumulate
            ),
        )
    for mode, kernel, launch in launches:
        all_configs = kernel.configs
        for config in all_configs[:1] if args.quick else all_configs:
            kernel.configs = [config]  # the untuned launcher takes the first config
            attempt(f"grouped {mode}{kernel.base_fn.__name__} {_label(config)}", launch)
        kernel.configs = all_configs
    x, gamma = torch.empty(64, 7168, dtype=bf16), torch.empty(7168, dtype=bf16)
    attempt("rmsnorm forward", lambda: norm.rmsnorm_fwd_triton(x, gamma, 1e-6, False))
    fc1 = torch.empty(64, 2 * 2048, dtype=bf16)

    def fp8_buffers(rows: int, hidden: int, mode: int, dual: bool):
        q, q_t = torch.empty(rows, hidden, dtype=e4m3), torch.empty(hidden, rows, dtype=e4m3)
        shapes = {0: ((), ()), 1: ((rows, 1), (hidden, 1)), 2: ((rows, hidden // 128), (hidden, rows // 128))}
        scale, scale_t = (torch.empty(shape) for shape in shapes[mode])
        return (q, scale, q_t, scale_t) if dual else (q, scale, None, None)

    for mode in (0, 1, 2):
        for dual in (True, False):
            group = 128 if mode == 2 else 0
            attempt(
                f"rmsnorm fp8 mode={mode} dual={dual}",
                lambda mode=mode, dual=dual, group=group: norm.rmsnorm_fp8_triton(
                    x, gamma, 1e-6, False, mode, *fp8_buffers(64, 7168, mode, dual), group
                ),
            )
            attempt(
                f"gated fp8 mode={mode} dual={dual}",
                lambda mode=mode, dual=dual, group=group: act.gated_act_fp8_triton(
                    fc1,
                    torch.empty(64),
                    torch.empty(64, dtype=torch.bool),
                    0,
                    mode,
                    *fp8_buffers(64, 2048, mode, dual),
                    group,
                ),
            )
    attempt(
        "gated forward",
        lambda: act.gated_act_fwd_triton(fc1, torch.empty(64), torch.empty(64, dtype=torch.bool), 0),
    )
    attempt(
        "gated backward",
        lambda: act.gated_act_bwd_triton(torch.empty(64, 2048, dtype=bf16), fc1, torch.empty(64), None, 1),
    )
    y = torch.empty(64, 7168, dtype=bf16)
    for label, group_rows, group_cols, emax in (
        ("row", 1, 7168, None),
        ("1x128", 1, 128, None),
        ("128x128", 128, 128, None),
        ("mx", 1, 32, 8),
    ):
        n_scales = (-(-64 // group_rows), -(-7168 // group_cols))
        scale = torch.empty(n_scales, dtype=torch.uint8 if emax else f32)
        attempt(
            f"quantize fp8 {label}",
            lambda group_rows=group_rows, group_cols=group_cols, scale=scale, emax=emax: (
                fp8q.quantize_fp8_groups_triton(
                    y, torch.empty(y.shape, dtype=e4m3), scale, group_cols, group_rows, emax
                )
            ),
        )
    attempt(
        "quantize fp8 dual 1x128",
        lambda: fp8q.quantize_fp8_dual_blocks_triton(
            y,
            torch.empty(y.shape, dtype=e4m3),
            torch.empty(64, 56),
            torch.empty(7168, 64, dtype=e4m3),
            torch.empty(7168, 1),
            128,
        ),
    )
    offs, ends = torch.tensor([0, 40, 40, 64]), torch.tensor([1, 1, 2])
    attempt(
        "quantize fp8 group columns", lambda: group_quant.quantize_fp8_group_columns_triton(y, offs, e4m3)
    )
    attempt(
        "quantize fp8 group blocks",
        lambda: group_quant.quantize_fp8_group_blocks_triton(y, offs, ends, e4m3, 128, 4),
    )
    e5m2_a = torch.empty(m, k, dtype=e5m2)
    for a_sm90, out_dtype in ((torch.empty(m, k, dtype=e4m3), bf16), (e5m2_a, f32)):
        attempt(
            f"gemm fp8 block sm90 (Gluon) {a_sm90.dtype} -> {out_dtype}",
            lambda a_sm90=a_sm90, out_dtype=out_dtype: sm90.gemm_fp8_block_sm90(
                a_sm90,
                torch.empty(k // 128, m).t(),
                torch.empty(n, k, dtype=e4m3),
                torch.empty(n // 128, k // 128),
                torch.empty(m, n, dtype=out_dtype),
            ),
        )
    attempt(
        "quantize fp8 tensorwise cast",
        lambda: fp8q.tensorwise_cast_fp8_triton(
            y, torch.empty(y.shape, dtype=e4m3), torch.empty(()), torch.empty(())
        ),
    )
    attempt(
        "quantize fp4",
        lambda: fp4q.quantize_fp4_rows_triton(
            y, torch.empty(64, 3584, dtype=torch.uint8), torch.empty(64, 224, dtype=torch.uint8)
        ),
    )
    for d_qk, d_v in ((128, 128), (192, 128)):
        q = torch.empty(2, 1024, 16, d_qk, dtype=bf16)
        k, v = torch.empty(2, 1024, 4, d_qk, dtype=bf16), torch.empty(2, 1024, 4, d_v, dtype=bf16)
        o, stats = torch.empty(2, 1024, 16, d_v, dtype=bf16), torch.empty(2, 16, 1024)
        attempt(
            f"attention forward d={d_qk}/{d_v} causal+sink",
            lambda q=q, k=k, v=v, o=o: attn.flash_attn_fwd_triton(q, k, v, torch.empty(16), 0.1, -1, 0, o),
        )
        attempt(
            f"attention backward d={d_qk}/{d_v} causal",
            lambda q=q, k=k, v=v, o=o, stats=stats: attn.flash_attn_bwd_triton(
                o,
                q,
                k,
                v,
                o,
                stats,
                0.1,
                -1,
                0,
                torch.empty_like(q),
                torch.empty_like(k),
                torch.empty_like(v),
            ),
        )
    q8, k8 = torch.empty(2, 1024, 16, 128, dtype=e4m3), torch.empty(2, 1024, 4, 128, dtype=e4m3)
    v8 = torch.empty(2, 4, 128, 1024, dtype=e4m3).permute(0, 3, 1, 2)
    scales = (torch.empty(2, 16, 8), torch.empty(2, 4, 8), torch.empty(2, 4, 8))
    attempt(
        "attention forward fp8 d=128 causal",
        lambda: attn.flash_attn_fwd_triton(
            q8, k8, v8, None, 0.1, -1, 0, torch.empty(2, 1024, 16, 128, dtype=bf16), None, scales
        ),
    )
    attempt(
        "attention fp8 block quantizer (sequence-contiguous)",
        lambda: attn_quant.quantize_attention_blocks_triton(
            torch.empty(2, 1024, 4, 128, dtype=bf16), e4m3, True
        ),
    )
    logits, bias = torch.empty(4096, 256), torch.empty(256)
    attempt(
        "moe router forward 256 experts, 8 groups",
        lambda: router.router_fwd_triton(logits, bias, 8, 8, 4, False, 2.5),
    )
    routing = torch.empty(4096, 256, dtype=torch.bool)
    attempt(
        "moe router backward 256 experts",
        lambda: router.router_bwd_triton(logits, routing, logits, logits, 8, False, 2.5),
    )
    hidden, rows_map = torch.empty(4096, 7168, dtype=bf16), torch.empty(4096, 256, dtype=torch.int32)
    permuted, experts = torch.empty(32768, 7168, dtype=bf16), torch.empty(256, dtype=torch.int32)
    attempt("moe expert layout", lambda: permute.expert_layout_triton(routing, 128, 40960))
    attempt("moe expert bounds", lambda: permute.expert_bounds_triton(rows_map))
    attempt(
        "moe permute (scatter rows)",
        lambda: permute.scatter_rows_triton(hidden, rows_map, experts, experts, logits, 32768, False),
    )
    for launch in (permute.ScatterLaunch(1024, 4, True, False), permute.ScatterLaunch(2048, 8, True, True)):
        attempt(
            f"moe permute (scatter rows, {tuple(launch)})",
            lambda launch=launch: permute.scatter_rows_triton(
                hidden, rows_map, experts, experts, None, 32768, False, launch
            ),
        )
    attempt(
        "moe unpermute backward (scaled scatter)",
        lambda: permute.scatter_rows_triton(hidden, rows_map, experts, experts, logits, 32768, True),
    )
    layout = ep.peer_layout(1 << 30, 2, 7168 * 2, 7168, 8, 56)
    table, in_rank = torch.empty(2, dtype=torch.int64), torch.empty(4096, 2, dtype=torch.int32)
    idx8, w8 = torch.empty(4096, 8, dtype=torch.int64), torch.empty(4096, 8)
    attempt(
        "ep dispatch push",
        lambda: ep.dispatch_push_triton(hidden, idx8, w8, None, in_rank, in_rank[0], table, 0, layout, 128),
    )
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    attempt("ep dispatch receive", lambda: ep.dispatch_receive_triton(buffer, layout, 8192, True, False))
    src = torch.empty(8192, dtype=torch.int32)
    rows8k = permuted[:8192]
    attempt("ep combine push", lambda: ep.combine_push_triton(rows8k, None, src, src, table, 0, layout))
    attempt("ep combine reduce", lambda: ep.combine_reduce_triton(buffer, in_rank, layout, bf16, True))
    attempt("moe unpermute (merge rows)", lambda: permute.merge_rows_triton(permuted, rows_map, logits))
    attempt("moe unpermute weight grad", lambda: permute.route_dots_triton(hidden, permuted, rows_map))
    print("all kernels compile for sm_90" if ok else "some kernels failed to compile for sm_90", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
