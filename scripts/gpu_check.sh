#!/usr/bin/env bash
# GPU validation on the device machine: build (with the C++ extension), the GPU test suite, the
# deterministic suite and the GEMM benchmark. Logs and CSVs go to $OUT (default ./out).
#   SHAPES=quick|full   benchmark shape set (default quick)
#   BENCH_SHARD=i/n     run shard i of n of the shape set (default 0/1)
#   SKIP_TESTS=1        benchmark only
#   SKIP_BENCH=1        tests only
#   SKIP_OVERHEAD=1     skip the host-time-per-call benchmark
#   HOST=1              host microseconds per call of every public op and Megatron Turbo module against its
#                       PyTorch peer (bench_host_overhead.py; HOST_ONLY, op-name filter; BACKWARD_THREAD=caller
#                       runs each backward on the calling thread, as the Megatron integration does)
#   LAUNCHER=cached     launch @cached_launch kernels from their per-key cache in tests and benchmarks
#                       (PRIMUS_TURBO_TRITON_LAUNCHER; the tests also check every cached launch against Triton)
#   LAUNCH=1            host us per launch: Triton's launcher, @cached_launch and the prebuilt compiled handle
#                       (scripts/profile_triton_launch.py), then bench_host_overhead under each launcher
#   TEST_PATHS="..."    test paths (default tests), to split the suite over several device calls
#   TEST_WORKERS=n      pytest-xdist workers (default 8; fewer where memory-hungry tests share the GPU)
#   LAYOUTS=1           also time each GEMM layout (NN, NT, TN, TT) per backend
#   BACKENDS=...        benchmark backend labels (default HIPBLASLT,TRITON,AUTO)
#   SKIP_CSV=path       benchmark only the shapes that CSV lacks (finish a cut-off run)
#   TIMER=graph         time the GEMM and grouped GEMM benchmarks from CUDA-graph replays (device time only)
#   FP8=1               also run the FP8 GEMM benchmark for every granularity and the MXFP4 one
#                       (FP8_SHAPES, default lowp)
#   FP8_SWEEP=blockwise time every FP8 GEMM kernel config (tensorwise|rowwise|blockwise; blockwise adds the
#                       Hopper Gluon kernel's) on FP8_SWEEP_MNK (default 8192x8192x8192) next to
#                       torch._scaled_mm
#   SKIP_BF16=1         skip the bf16 GEMM benchmark
#   NORM_ACT=1          also run the RMSNorm / gated-activation benchmark (NORM_ACT_SHAPES, default quick)
#   NORM_ACT_SWEEP=1    time the RMSNorm-backward / gated-activation launch candidates against a same-size copy
#   DUAL_BLOCK=1        time the Triton and C++ dual 1 x 128 FP8 emitters (quantize, RMSNorm, SwiGLU) against a copy
#   GROUPED=1           also run the grouped GEMM benchmark, bf16 and FP8 (GROUPED_SHAPES, default quick;
#                       GROUPED_FP8, default "tensorwise rowwise blockwise"), and profile one FP8 step
#                       (GROUPED_PROFILE, G x T x N x K, default DeepSeek-V3 fc1 at EP 8)
#   GROUP_QUANT=1       time the grouped FP8 wgrad-operand quantizers' launch candidates against a copy
#   SM90_SWEEP=1        time the Hopper Gluon grouped GEMM kernels' launch candidates against the vendor ops
#   GROUPED_NCU=1       Nsight Compute (speed of light, memory) of the Gluon grouped FP8 forward and its peer
#                       under balanced, skewed and alternating 1024/3072 group sizes
#   GROUPED_HOST=1      kernel time, wall time and cProfile host time per grouped step (bf16 and FP8) at a
#                       host-bound expert shape (GROUPED_HOST_SHAPE, default Qwen3-30B-A3B fc2 at EP 8)
#   ATTN=1              also run the attention benchmark (ATTN_SEQS, default 2048,4096,8192; ATTN_BACKENDS,
#                       default TRITON,DEFAULT,FP8)
#   ATTN_SWEEP=1        time the Triton attention kernels' tile candidates against SDPA-cuDNN (ATTN_SEQS;
#                       ATTN_KERNELS, default fwd,fwd_fp8,dkdv,dq; ATTN_DQK, default 128,192)
#   ATTN_HOST=1         host time per attention call (TRITON, default route, bare SDPA, the launchers, a cProfile
#                       of the TRITON step) at a tiny shape (scripts/profile_attention_host.py)
#   MOE=1               also run the MoE router and permutation benchmarks
#   EP=1                the multi-process tests (NCCL), then dispatch / combine across every visible GPU on the
#                       TORCH and TURBO backends against Megatron's all-to-all path, bf16 and FP8
#                       (bench_moe_dispatch.py; needs 2+ GPUs)
#   ASYNC_TP=1          the async-TP tests (NCCL), then all-gather + GEMM and GEMM + reduce-scatter at the
#                       Llama-3-70B shapes across every visible GPU against the sequential path and PyTorch's
#                       symmetric-memory ops (bench_async_tp.py; needs 2+ GPUs)
#   E2E=1               Megatron MoE GPT training throughput, Turbo against the local spec (benchmark/e2e;
#                       E2E_VARIANTS, default all; E2E_STEPS, default 50; E2E_SIZE, default small (or
#                       finegrained: 128 experts top-8, or mixtral: two Mixtral-8x7B layers); E2E_NPROC, default 1; E2E_TP,
#                       default 1: tensor parallelism with sequence parallelism, expert parallelism NPROC / TP)
#   WEIGHT_QUANT=1      FP8 weight quantization, both layouts in one read against quantize-then-transpose
#                       (bench_fp8_weight_quant.py: Mixtral, DeepSeek-V3, Qwen3 experts, Llama-3-70B)
#   ADAMW_FP8=1         the FP8 primary weights' fused AdamW step against torch's fused AdamW + bf16 copy + FP8
#                       weight quantization (bench_adamw_fp8.py, the weights of bench_fp8_weight_quant.py)
#   STEP_PROFILE=1      where an eager Turbo step of the example spends its time (scripts/profile_megatron_step.py
#                       --syncs --cprofile at E2E_SIZE: synchronising calls, Python functions, kernels, host ops;
#                       STEP_PROFILE_ARGS replaces those flags, e.g. "--fp8 e4m3 --fp8-recipe blockwise";
#                       STEP_PROFILE_TAG names the log, default E2E_SIZE)
#   MEGATRON=1          install the carried megatron-core wheel (.whl/, name .whl in carry) into /tmp/site first
#                       (implied by E2E=1); the integration tests then run against it
#   PACK=name.tar.gz    archive for this call's logs and CSVs under $OUT (default results-<pid>.tar.gz)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
SHAPES=${SHAPES:-quick}
BENCH_SHARD=${BENCH_SHARD:-0/1}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
# the scripts import the checkout (and, below, the carried megatron-core)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The device tool returns at most 8 files: on exit every log and CSV except env.txt and tests.log moves
# into one archive, named per call so that several calls in one command keep theirs.
pack() {
  tar czf "$OUT/${PACK:-results-$$.tar.gz}" -C "$OUT" --exclude='*.tar.gz' --exclude=env.txt \
    --exclude=tests.log --remove-files . 2>/dev/null
  mkdir -p "$OUT"
}
trap pack EXIT
# The device image's default g++ (/opt/gcc) links its own libstdc++ into extensions, which crashes when
# torch formats error messages; the system compiler does not.
if [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"
fi

{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"

if [ "${MEGATRON:-0}" = 1 ] || [ "${E2E:-0}" = 1 ] || [ "${STEP_PROFILE:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -n 1 | tee -a "$OUT/env.txt"
fi

status=0
[ -n "${LAUNCHER:-}" ] && export PRIMUS_TURBO_TRITON_LAUNCHER=$LAUNCHER
make env 2>&1 | tail -n 40 | tee "$OUT/build.log" || status=1
.venv/bin/python -c "import torch, primus_turbo._C; print('C++ extension loaded')" 2>&1 | tee -a "$OUT/build.log"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  export PRIMUS_TURBO_TRITON_AUTOTUNE=0 PRIMUS_TURBO_TRITON_LAUNCH_CHECK=1
  timeout "${TEST_TIMEOUT:-420}" .venv/bin/python -m pytest ${TEST_PATHS:-tests} -n "${TEST_WORKERS:-8}" -v --tb=short -p no:cacheprovider \
    -p no:benchmark --durations=15 > "$OUT/tests.log" 2>&1 || status=1
  grep -E "FAILED|ERROR" "$OUT/tests.log" | head -n 40
  tail -n 40 "$OUT/tests.log"
  timeout "${DET_TIMEOUT:-120}" .venv/bin/python -m pytest ${TEST_PATHS:-tests} -n 4 -q -p no:cacheprovider \
    --deterministic-only > "$OUT/tests_deterministic.log" 2>&1 || status=1
  tail -n 15 "$OUT/tests_deterministic.log"
  unset PRIMUS_TURBO_TRITON_AUTOTUNE PRIMUS_TURBO_TRITON_LAUNCH_CHECK
fi

[ "${SKIP_BENCH:-0}" = 1 ] && exit $status
if [ "${SKIP_OVERHEAD:-0}" != 1 ]; then
  timeout 120 .venv/bin/python -m benchmark.ops.training.bench_gemm_overhead 2>&1 | tee "$OUT/overhead.log" || status=1
fi
if [ "${HOST:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_host_overhead \
    ${HOST_ONLY:+--only "$HOST_ONLY"} --backward-thread "${BACKWARD_THREAD:-device}" -o "$OUT/host_overhead.csv" 2>&1 | grep -v Warning \
    | tee "$OUT/bench_host_overhead.log" || status=1
fi
if [ "${LAUNCH:-0}" = 1 ]; then
  timeout 300 .venv/bin/python scripts/profile_triton_launch.py --calls 3000 2>&1 \
    | tee "$OUT/triton_launch.log" || status=1
  for launcher in triton cached; do
    PRIMUS_TURBO_TRITON_LAUNCHER=$launcher timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python \
      -m benchmark.ops.training.bench_host_overhead ${HOST_ONLY:+--only "$HOST_ONLY"} \
      -o "$OUT/host_overhead_$launcher.csv" 2>&1 | grep -v Warning | tee "$OUT/bench_host_overhead_$launcher.log" \
      || status=1
  done
fi
if [ "${FP8:-0}" = 1 ]; then
  for granularity in tensorwise rowwise blockwise mxfp8; do
    timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_gemm_turbo --dtype fp8 \
      --granularity "$granularity" --shapes "${FP8_SHAPES:-lowp}" --backends "${FP8_BACKENDS:-HIPBLASLT,TRITON,AUTO}" \
      --timer "${TIMER:-events}" -o "$OUT/gemm_fp8_${granularity}.csv" 2>&1 | grep -v "it/s\]" \
      | tee "$OUT/bench_fp8_${granularity}.log" || status=1
  done
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_gemm_turbo --dtype fp4 \
    --shapes "${FP8_SHAPES:-lowp}" --timer "${TIMER:-events}" -o "$OUT/gemm_fp4.csv" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/bench_fp4.log" || status=1
fi
if [ -n "${FP8_SWEEP:-}" ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_gemm_triton_configs \
    --mnk "${FP8_SWEEP_MNK:-8192x8192x8192}" --fp8 "$FP8_SWEEP" -o "$OUT/fp8_configs_${FP8_SWEEP}.csv" 2>&1 \
    | tee "$OUT/fp8_configs_${FP8_SWEEP}.log" || status=1
fi
if [ "${NORM_ACT:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_norm_act_turbo \
    --shapes "${NORM_ACT_SHAPES:-quick}" -o "$OUT/norm_act.csv" 2>&1 \
    | tee "$OUT/bench_norm_act.log" || status=1
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_norm_act_turbo --fused-fp8 \
    --shapes "${NORM_ACT_SHAPES:-quick}" -o "$OUT/norm_act_fused_fp8.csv" 2>&1 \
    | tee "$OUT/bench_norm_act_fused_fp8.log" || status=1
fi
if [ "${DUAL_BLOCK:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_fp8_dual_block \
    -o "$OUT/fp8_dual_block.csv" 2>&1 | tee "$OUT/bench_fp8_dual_block.log" || status=1
fi
if [ "${NORM_ACT_SWEEP:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_norm_act_configs \
    -o "$OUT/norm_act_configs.csv" 2>&1 | tee "$OUT/bench_norm_act_configs.log" || status=1
fi
if [ "${GROUP_QUANT:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_group_quant_configs \
    -o "$OUT/group_quant_configs.csv" 2>&1 | tee "$OUT/bench_group_quant_configs.log" || status=1
fi
if [ "${SM90_SWEEP:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_grouped_sm90_configs \
    -o "$OUT/grouped_sm90_configs.csv" 2>&1 | tee "$OUT/bench_grouped_sm90_configs.log" || status=1
fi
if [ "${GROUPED_HOST:-0}" = 1 ]; then
  timeout 300 .venv/bin/python scripts/profile_fp8_step.py --grouped "${GROUPED_HOST_SHAPE:-16x2048x2048x768}" \
    --host --rows 20 > "$OUT/profile_grouped_host.log" 2>&1 || status=1
  grep -E "step," "$OUT/profile_grouped_host.log"
fi
if [ "${GROUPED_NCU:-0}" = 1 ]; then
  timeout 300 "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --clock-control none \
    --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
    .venv/bin/python scripts/profile_grouped_kernel.py --kernel fp8 --lens 1024,3072 \
    > "$OUT/ncu_grouped.txt" 2>&1 || status=1
  grep -E "^  [_a-z]|Duration|DRAM Throughput|L2 Hit Rate" "$OUT/ncu_grouped.txt" | cut -c1-120
fi
if [ "${ATTN:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_attention_turbo \
    --seqs "${ATTN_SEQS:-2048,4096,8192}" --backends "${ATTN_BACKENDS:-TRITON,DEFAULT,FP8}" \
    -o "$OUT/attention.csv" 2>&1 \
    | tee "$OUT/bench_attention.log" || status=1
fi
if [ "${ATTN_SWEEP:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_attention_configs \
    --seqs "${ATTN_SEQS:-4096,8192}" --kernels "${ATTN_KERNELS:-fwd,fwd_fp8,dkdv,dq}" --dqk "${ATTN_DQK:-128,192}" \
    -o "$OUT/attention_configs.csv" 2>&1 \
    | tee "$OUT/bench_attention_configs.log" || status=1
fi
if [ "${ATTN_HOST:-0}" = 1 ]; then
  timeout 300 .venv/bin/python scripts/profile_attention_host.py > "$OUT/attention_host.log" 2>&1 \
    || status=1
  head -n 60 "$OUT/attention_host.log" | cut -c1-160
fi
if [ "${MOE:-0}" = 1 ]; then
  for timer in graph events; do
    timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_moe_router \
      --timer "$timer" -o "$OUT/moe_router_$timer.csv" 2>&1 | tee "$OUT/bench_moe_router_$timer.log" || status=1
  done
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_moe_permute \
    -o "$OUT/moe_permute.csv" 2>&1 | tee "$OUT/bench_moe_permute.log" || status=1
fi
if [ "${ASYNC_TP:-0}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-420}" .venv/bin/python -m pytest tests/pytorch/distributed/test_async_tp.py --dist-only -q \
    -p no:cacheprovider > "$OUT/tests_async_tp.log" 2>&1 || status=1
  tail -n 5 "$OUT/tests_async_tp.log"
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_async_tp -o "$OUT/async_tp.csv" 2>&1 \
    | tee "$OUT/bench_async_tp.log" || status=1
fi

if [ "${EP:-0}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-420}" .venv/bin/python -m pytest tests/pytorch/distributed --dist-only -q -p no:cacheprovider \
    > "$OUT/tests_dist.log" 2>&1 || status=1
  tail -n 5 "$OUT/tests_dist.log"
  for backend in TORCH TURBO; do
    for dtype in bf16 fp8; do
      flag=""
      [ "$dtype" = fp8 ] && flag="--fp8"
      PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=$backend timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python \
        -m benchmark.ops.training.bench_moe_dispatch $flag --worst -o "$OUT/moe_dispatch_${backend}_$dtype.csv" 2>&1 \
        | tee "$OUT/bench_moe_dispatch_${backend}_$dtype.log" || status=1
    done
  done
fi
if [ "${E2E:-0}" = 1 ]; then
  timeout "${E2E_TIMEOUT:-540}" .venv/bin/python -m benchmark.e2e.bench_megatron_moe --nproc "${E2E_NPROC:-1}" \
    --tp "${E2E_TP:-1}" --steps "${E2E_STEPS:-50}" --size "${E2E_SIZE:-small}" \
    ${E2E_VARIANTS:+--variants "$E2E_VARIANTS"} -o "$OUT/megatron_moe_${E2E_SIZE:-small}.csv" 2>&1 \
    | tee "$OUT/bench_megatron_moe_${E2E_SIZE:-small}.log" || status=1
fi
if [ "${WEIGHT_QUANT:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_fp8_weight_quant \
    -o "$OUT/fp8_weight_quant.csv" 2>&1 | tee "$OUT/bench_fp8_weight_quant.log" || status=1
fi
if [ "${ADAMW_FP8:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_adamw_fp8 \
    -o "$OUT/adamw_fp8.csv" 2>&1 | tee "$OUT/bench_adamw_fp8.log" || status=1
fi
if [ "${STEP_PROFILE:-0}" = 1 ]; then
  tag="${STEP_PROFILE_TAG:-${E2E_SIZE:-small}}"
  # shellcheck disable=SC2086  # STEP_PROFILE_ARGS is a list of the example's flags
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python scripts/profile_megatron_step.py \
    --size "${E2E_SIZE:-small}" ${STEP_PROFILE_ARGS:---syncs --cprofile --pstats $OUT/step_$tag.pstats} \
    > "$OUT/profile_step_$tag.log" 2>&1 || status=1
  grep -E "unprofiled|per step|synchronising calls" "$OUT/profile_step_$tag.log"
fi
if [ "${GROUPED:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_grouped_gemm_turbo \
    --shapes "${GROUPED_SHAPES:-quick}" --timer "${TIMER:-events}" -o "$OUT/grouped_gemm.csv" 2>&1 \
    | tee "$OUT/bench_grouped_gemm.log" || status=1
  for granularity in ${GROUPED_FP8:-tensorwise rowwise blockwise}; do
    timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_grouped_gemm_turbo \
      --dtype fp8 --granularity "$granularity" --backends TRITON,DEFAULT --shapes "${GROUPED_SHAPES:-quick}" \
      --timer "${TIMER:-events}" -o "$OUT/grouped_gemm_fp8_${granularity}.csv" 2>&1 | tee "$OUT/bench_grouped_gemm_fp8_${granularity}.log" \
      || status=1
  done
  timeout 300 .venv/bin/python scripts/profile_fp8_step.py --grouped "${GROUPED_PROFILE:-32x2048x4096x7168}" \
    > "$OUT/profile_grouped_fp8.log" 2>&1 || status=1
fi
[ "${SKIP_BF16:-0}" = 1 ] && exit $status
timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_gemm_turbo --shapes "$SHAPES" \
  --num-shards "${BENCH_SHARD#*/}" --shard-id "${BENCH_SHARD%/*}" \
  --backends "${BACKENDS:-HIPBLASLT,TRITON,AUTO}" --timer "${TIMER:-events}" \
  ${SKIP_CSV:+--skip-csv "$SKIP_CSV"} \
  -o "$OUT/gemm_${SHAPES}_${BENCH_SHARD%/*}.csv" 2>&1 | grep -v "it/s\]" \
  | tee "$OUT/bench_${SHAPES}_${BENCH_SHARD%/*}.log" || status=1
if [ "${LAYOUTS:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" .venv/bin/python -m benchmark.ops.training.bench_gemm_layouts \
    --shapes "$SHAPES" -o "$OUT/gemm_layouts_${SHAPES}.csv" 2>&1 | grep -v " INFO " \
    | tee "$OUT/bench_layouts_${SHAPES}.log" || status=1
fi
exit $status
