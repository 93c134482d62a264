"""Build script for primus_turbo: the Python/Triton package plus an optional C++/CUDA (HIP) extension _C."""

import os
import re

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
EXT_SOURCES = [  # relative to ROOT, which pip makes the working directory
    "csrc/pytorch/bindings.cpp",
    "csrc/pytorch/group_offs_ops.cpp",
    "csrc/kernels/grouped_gemm/group_offs.cu",
]
CUDA_ONLY_SOURCES = [  # PTX inline assembly and CUDA FP8 conversions: not hipified
    "csrc/pytorch/fp8_dual_block_ops.cpp",
    "csrc/kernels/quantization/fp8_dual_block.cu",
]
CUDA_ARCH = re.compile(r"^sm_(\d+[a-z]?)$")  # sm_90, sm_90a, sm_100a, sm_120f ...
ROCM_ARCH = re.compile(r"^gfx[0-9a-f]+(:[a-z]+[+-])*$")  # gfx942, gfx950, gfx90a:xnack- ...
DEFAULT_ARCHS = {False: "sm_90", True: "gfx942;gfx950"}  # keyed by is_rocm


def log(msg):
    print(f"primus_turbo: {msg}", flush=True)


def gpu_count(torch):
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver just means "no visible GPU" for the build
        return 0


def arch_flags_for(tokens, torch, is_rocm):
    """Compiler flags for the GPU_ARCHS tokens; archs of the other platform are dropped with a log line."""
    flags = []
    for arch in tokens:
        if arch == "native":
            if is_rocm:
                flags.append("--offload-arch=native")
            elif gpu_count(torch):
                caps = sorted({torch.cuda.get_device_capability(i) for i in range(gpu_count(torch))})
                flags += [f"-gencode=arch=compute_{ma}{mi},code=sm_{ma}{mi}" for ma, mi in caps]
            else:
                log("GPU_ARCHS has 'native' but no GPU is visible; ignoring it")
        elif CUDA_ARCH.match(arch):
            if is_rocm:
                log(f"ignoring CUDA arch {arch} from GPU_ARCHS on ROCm")
            else:
                num = CUDA_ARCH.match(arch).group(1)
                flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        elif ROCM_ARCH.match(arch):
            if is_rocm:
                flags.append(f"--offload-arch={arch}")
            else:
                log(f"ignoring ROCm arch {arch} from GPU_ARCHS on CUDA")
        else:
            raise SystemExit(f"primus_turbo: bad GPU_ARCHS entry {arch!r} (want sm_XY[a], gfxNNN or native)")
    return list(dict.fromkeys(flags))


def arch_flags(torch, is_rocm):
    requested = os.environ.get("GPU_ARCHS", "").strip()
    if not requested:
        requested = "native" if gpu_count(torch) else DEFAULT_ARCHS[is_rocm]
    tokens = [t.lower() for t in re.split(r"[;,\s]+", requested) if t]
    flags = arch_flags_for(tokens, torch, is_rocm)
    if not flags:
        fallback = DEFAULT_ARCHS[is_rocm]
        log(f"no usable arch in {requested!r} for {'ROCm' if is_rocm else 'CUDA'}; using {fallback}")
        flags = arch_flags_for(fallback.split(";"), torch, is_rocm)
    log(f"building _C for {' '.join(flags)}")
    return flags


def cxx_std(torch):
    # torch >= 2.12 defaults extensions to C++20 and its headers need it (2.14 refuses C++17); older: C++17.
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    return "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"


def skip(reason):
    log(f"C++/CUDA extension skipped ({reason}); Python and Triton ops still work")
    return [], {}


def extensions():
    """Return (ext_modules, cmdclass); both empty when the extension cannot or should not be built."""
    if os.environ.get("PRIMUS_TURBO_BUILD_EXT", "1").strip().lower() in ("0", "false", "no", "off"):
        return skip("PRIMUS_TURBO_BUILD_EXT=0")
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        return skip(f"torch is not importable: {exc}; use pip install --no-build-isolation")
    is_rocm = torch.version.hip is not None
    if torch.version.cuda is None and not is_rocm:
        return skip(f"torch {torch.__version__} is a CPU-only build")
    kit = "ROCM" if is_rocm else "CUDA"
    if (cpp_extension.ROCM_HOME if is_rocm else cpp_extension.CUDA_HOME) is None:
        return skip(f"no {kit} toolkit found; set {kit}_HOME")
    std = cxx_std(torch)
    ext = cpp_extension.CUDAExtension(  # hipified automatically when torch is a ROCm build
        name="primus_turbo._C",
        sources=EXT_SOURCES + ([] if is_rocm else CUDA_ONLY_SOURCES),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", std], "nvcc": ["-O3", std, *arch_flags(torch, is_rocm)]},
    )
    # BuildExtension compiles with ninja when available and honours MAX_JOBS for the number of parallel jobs.
    return [ext], {"build_ext": cpp_extension.BuildExtension}


# primus_turbo.integrations (and its subpackages, e.g. .megatron) live in the top-level folder integrations/.
packages = find_packages(include=["primus_turbo*"])
package_dir = {}
if os.path.isfile(os.path.join(ROOT, "integrations", "__init__.py")):
    package_dir["primus_turbo.integrations"] = "integrations"
    packages += ["primus_turbo.integrations"]
    subpackages = find_packages(where=os.path.join(ROOT, "integrations"))
    packages += [f"primus_turbo.integrations.{p}" for p in subpackages]

ext_modules, cmdclass = extensions()

setup(
    name="primus_turbo",
    version="0.1.0",
    description="PyTorch operator library: Triton and optional C++/CUDA kernels",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    install_requires=[],  # torch, triton, ... are installed by the Makefile; pip must never pull torch
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
