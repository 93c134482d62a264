// Group offsets for grouped GEMM: exclusive prefix sum of int64 group lengths (CUDA/HIP, no framework).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace primus_turbo {

// Writes group_offs[0] = 0 and group_offs[i + 1] = group_offs[i] + group_lens[i] for i in [0, num_groups).
// group_lens holds num_groups values and group_offs num_groups + 1, both in device memory; num_groups >= 0.
// The launch is asynchronous on `stream` and validates nothing; the caller checks the launch error
// (e.g. cudaGetLastError / C10_CUDA_KERNEL_LAUNCH_CHECK) right after this returns.
void launch_compute_group_offs(const int64_t *group_lens, int64_t *group_offs, int64_t num_groups,
                               cudaStream_t stream);

} // namespace primus_turbo
