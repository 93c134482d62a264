// Both 1 x 128 block FP8 copies of a producer's output from one read of its input (CUDA, no framework).
//
// A producer (plain copy, gated activation or RMSNorm) computes its output y (M x K, rounded to the input
// dtype) one 128 x 128 tile at a time; the tile is written quantized along K into q (M x K, one scale per
// row and 128 columns) and along M into q_t (K x M, one scale per column and 128 rows), the two operands
// an FP8 GEMM reads in its forward and weight-gradient products. No high-precision y is written.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace primus_turbo {

enum class DualBlockProducer : int { kCopy = 0, kGated = 1, kRmsNorm = 2 };
enum class HalfKind : int { kFloat16 = 0, kBFloat16 = 1 };
enum class Fp8Kind : int { kE4M3 = 0, kE5M2 = 1 };

struct DualBlockParams {
    const void *x;    // kCopy / kRmsNorm: M x K; kGated: M x 2K (gate half, then linear half)
    int64_t stride_x; // elements between rows of x; the column stride is 1
    int64_t rows;     // M
    int64_t cols;     // K
    // kRmsNorm: y = x * rstd[row] * (gamma[col] (+ 1 when zero_centered)), fp32 math
    const void *gamma;
    bool gamma_fp32; // gamma is fp32, else the input dtype
    bool zero_centered;
    const float *rstd;
    // kGated: y = act(gate) * linear (* probs[row]); rows whose row_mask byte is 0 give zeros
    int act; // 0 SiLU, 1 tanh-approximated GELU
    const void *probs;
    bool probs_fp32; // probs is fp32, else the input dtype
    const uint8_t *row_mask;
    // outputs: q (M x K) with scale[row * scale_row_stride + block * scale_block_stride], q_t (K x M) with
    // scale_t[col * scale_t_row_stride + block * scale_t_block_stride]; scales are fp32 scale_inv
    void *q;
    float *scale;
    int64_t scale_row_stride;
    int64_t scale_block_stride;
    void *q_t;
    float *scale_t;
    int64_t scale_t_row_stride;
    int64_t scale_t_block_stride;
};

// Launches persistent 256-thread blocks over the 128 x 128 tiles, asynchronously on `stream`. Needs 16-byte
// aligned x rows (and linear half), q and q_t, K % 8 == 0 and M % 16 == 0; validates nothing (the caller
// checks shapes, dtypes, alignment and the launch error).
void launch_fp8_dual_block(const DualBlockParams &params, DualBlockProducer producer, HalfKind input,
                           Fp8Kind output, cudaStream_t stream);

} // namespace primus_turbo
