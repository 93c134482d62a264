// Group offsets kernel: one block scans int64 group lengths chunk by chunk (plain CUDA, hipify-clean).
#include "group_offs.h"

namespace primus_turbo {
namespace {

// A power of two that is a multiple of both warp sizes (32 on NVIDIA, 64 on AMD).
constexpr int kBlockSize = 256;

__global__ void __launch_bounds__(kBlockSize)
    compute_group_offs_kernel(const int64_t *__restrict__ group_lens, int64_t *__restrict__ group_offs,
                              int64_t num_groups) {
    __shared__ int64_t scan[kBlockSize];
    const int tid = static_cast<int>(threadIdx.x);
    if (tid == 0) {
        group_offs[0] = 0;
    }
    int64_t carry = 0; // sum of all lengths in earlier chunks, identical in every thread
    for (int64_t base = 0; base < num_groups; base += kBlockSize) {
        const int64_t i = base + tid;
        scan[tid] = i < num_groups ? group_lens[i] : 0;
        __syncthreads();
        // Hillis-Steele inclusive scan over the chunk held in shared memory.
        for (int stride = 1; stride < kBlockSize; stride <<= 1) {
            const int64_t left = tid >= stride ? scan[tid - stride] : 0;
            __syncthreads();
            scan[tid] += left;
            __syncthreads();
        }
        if (i < num_groups) {
            group_offs[i + 1] = carry + scan[tid];
        }
        carry += scan[kBlockSize - 1];
        __syncthreads(); // everyone has read scan[] before the next chunk overwrites it
    }
}

} // namespace

void launch_compute_group_offs(const int64_t *group_lens, int64_t *group_offs, int64_t num_groups,
                               cudaStream_t stream) {
    compute_group_offs_kernel<<<1, kBlockSize, 0, stream>>>(group_lens, group_offs, num_groups);
}

} // namespace primus_turbo
