// Both 1 x 128 block FP8 copies of a producer's output from one read of its input; see fp8_dual_block.h.
//
// Persistent 256-thread blocks walk the 128 x 128 tiles. Each thread copies its own pieces of a tile into
// shared memory (16-byte cp.async) and reads back only those, so as soon as it holds the current tile in
// registers it starts the next tile's copy, which stays in flight across the math and the stores. Thread (warp w, lane l) owns rows
// 16w + 8(l / 16) + [0, 8) and columns 8(l % 16) + [0, 8) of a tile:
//   - the forward copy's row amaxes are shuffles within each half-warp; its 8-byte stores cover whole
//     128-byte rows of q;
//   - the column amaxes combine the thread's rows, the other half-warp and the 8 warps through shared
//     memory; each thread's 8 x 8 piece, quantized per column, is staged transposed in shared memory as
//     FP8 (16-byte pieces swizzled so that a warp's stores hit every bank once), and 8 threads then write
//     each column's 128 rows as one whole 128-byte line of q_t.
//
// The numerics are those of the Triton producers and quantize_fp8_with_trans, bit for bit: fp32 math, y
// rounded to the input dtype before quantization, NaN-propagating amaxes (a group holding NaN or inf gets
// a NaN scale and multiplier 1), multiplier = min(FP8_MAX / amax, FLT_MAX) rounded to nearest,
// scale_inv = 1 / multiplier, and a saturating round-to-nearest FP8 cast.
#include "fp8_dual_block.h"

#include <algorithm>
#include <cfloat>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace primus_turbo {
namespace {

constexpr int kTile = 128; // the 1 x 128 block along both dimensions
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSpan = 8;   // a thread owns kSpan rows x kSpan columns of a tile
constexpr int kPitch = kTile + 8; // elements per staged input row: 16-byte aligned, rows 4 banks apart
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Triton's fp32 exp and division lower to ex2.approx (after a multiply by -log2 e) and div.full; the same
// instructions here keep the gated output bit-identical to the Triton kernels'.
__device__ __forceinline__ float fast_sigmoid(float a) {
    float e, s;
    asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(a * -1.4426950408889634f));
    asm("div.full.f32 %0, %1, %2;" : "=f"(s) : "f"(1.0f), "f"(1.0f + e));
    return s;
}

__device__ __forceinline__ float gated_value(float gate, float linear, float prob, int act) {
    float activated;
    if (act == 0) {
        activated = gate * fast_sigmoid(gate);
    } else {
        const float inner = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
        const float t = 2.0f * fast_sigmoid(2.0f * inner) - 1.0f;
        activated = 0.5f * gate * (1.0f + t);
    }
    return activated * linear * prob;
}

// Magnitude bits: non-negative floats order like their bits and NaN orders above inf, so an unsigned
// maximum of these is a NaN-propagating amax.
__device__ __forceinline__ unsigned magnitude_bits(float v) { return __float_as_uint(fabsf(v)); }

struct GroupScale {
    float multiplier;
    float stored;
};

template <int FP8_MAX> __device__ __forceinline__ GroupScale group_scale(unsigned amax_bits) {
    if (amax_bits >= 0x7f800000u) { // inf or NaN
        return {1.0f, __uint_as_float(0x7fc00000u)};
    }
    const float amax = __uint_as_float(amax_bits);
    const float multiplier = amax > 0.0f ? fminf(__fdiv_rn(static_cast<float>(FP8_MAX), amax), FLT_MAX) : 1.0f;
    return {multiplier, __fdiv_rn(1.0f, multiplier)};
}

// Four values as FP8 bytes, the first in the lowest byte (memory order).
template <int FP8_KIND> __device__ __forceinline__ unsigned pack4(float a, float b, float c, float d) {
    constexpr __nv_fp8_interpretation_t kind = FP8_KIND == 0 ? __NV_E4M3 : __NV_E5M2;
    const unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind);
    const unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kind);
    return lo | (hi << 16);
}

// 16 bytes from global to shared memory without passing through registers (sm_80+; a plain copy before),
// zero-filled when !valid. A thread starts a copy into shared memory it has just read: the "memory" clobber
// keeps that read ahead of the copy, and the copy lands a global-memory latency later.
__device__ __forceinline__ void copy_async16(void *smem, const void *gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    *static_cast<uint4 *>(smem) = valid ? *static_cast<const uint4 *>(gmem) : make_uint4(0, 0, 0, 0);
#else
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int PENDING> __device__ __forceinline__ void copy_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

template <typename T> __device__ __forceinline__ void unpack8(const uint4 &raw, float out[kSpan]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < kSpan; ++j) {
        out[j] = to_float(__builtin_bit_cast(T, static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2)))));
    }
}

__device__ __forceinline__ float load_scalar(const void *ptr, bool fp32, int64_t i, bool bf16) {
    if (fp32) return static_cast<const float *>(ptr)[i];
    return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16 *>(ptr)[i])
                : __half2float(static_cast<const __half *>(ptr)[i]);
}

template <typename T, int INPUTS> struct Staging {
    T input[INPUTS][kTile][kPitch]; // the next input tile (gated: gate and linear halves)
    uint8_t transposed[kTile][kTile];  // q_t's tile, FP8, 16-byte pieces swizzled
    unsigned column_bits[kWarps][kTile];
    float column_multiplier[kTile];
};

template <typename T, int FP8_KIND, int PRODUCER>
__global__ void __launch_bounds__(kThreads) fp8_dual_block_kernel(const DualBlockParams p) {
    constexpr int kFp8Max = FP8_KIND == 0 ? 448 : 57344;
    constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
    constexpr bool kGated = PRODUCER == static_cast<int>(DualBlockProducer::kGated);
    constexpr bool kRmsNorm = PRODUCER == static_cast<int>(DualBlockProducer::kRmsNorm);
    constexpr int kInputs = kGated ? 2 : 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    auto &smem = *reinterpret_cast<Staging<T, kInputs> *>(smem_raw);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int col_local = (lane % 16) * kSpan;
    const int row_local = warp * 16 + (lane / 16) * kSpan;
    const int64_t M = p.rows;
    const int64_t K = p.cols;
    const int64_t tiles_m = (M + kTile - 1) / kTile;
    const int64_t tiles = tiles_m * ((K + kTile - 1) / kTile);
    const T *x = static_cast<const T *>(p.x);

    // start copying this thread's pieces of a tile into shared memory
    auto prefetch = [&](int64_t tile) {
        const int64_t m0 = (tile % tiles_m) * kTile;
        const int64_t col = (tile / tiles_m) * kTile + col_local;
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
            const int64_t row = m0 + row_local + i;
            bool valid = row < M && col < K;
            if (kGated && valid && p.row_mask != nullptr) valid = p.row_mask[row] != 0; // padding: not read
            const T *src = valid ? x + row * p.stride_x + col : x;
#pragma unroll
            for (int input = 0; input < kInputs; ++input) {
                copy_async16(&smem.input[input][row_local + i][col_local], src + (valid ? input * K : 0), valid);
            }
        }
        copy_async_commit();
    };

    int64_t tile = blockIdx.x;
    if (tile < tiles) prefetch(tile);
    for (; tile < tiles; tile += gridDim.x) {
        const int64_t tile_m = tile % tiles_m;
        const int64_t tile_k = tile / tiles_m;
        const int64_t m0 = tile_m * kTile;
        const int64_t k0 = tile_k * kTile;
        const int64_t col0 = k0 + col_local;
        const bool cols_in = col0 < K; // K % 8 == 0: a thread's 8 columns are all in or all out

        // per-row and per-column factors load while the tile is still arriving
        float weight[kSpan];
        float row_factor[kSpan];
        bool live[kSpan];
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
            const int64_t row = m0 + row_local + i;
            live[i] = row < M;
            row_factor[i] = 0.0f;
            if constexpr (kGated) {
                if (live[i] && p.row_mask != nullptr) live[i] = p.row_mask[row] != 0;
                row_factor[i] = !live[i] ? 0.0f
                                : p.probs != nullptr ? load_scalar(p.probs, p.probs_fp32, row, kBf16)
                                                     : 1.0f;
            } else if constexpr (kRmsNorm) {
                row_factor[i] = live[i] ? p.rstd[row] : 0.0f;
            }
        }
        if constexpr (kRmsNorm) {
#pragma unroll
            for (int j = 0; j < kSpan; ++j) {
                weight[j] = cols_in ? load_scalar(p.gamma, p.gamma_fp32, col0 + j, kBf16) : 0.0f;
                if (p.zero_centered) weight[j] += 1.0f;
            }
        }
        copy_async_wait<0>();
        float y[kSpan][kSpan];
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
            float s[kSpan];
            unpack8<T>(*reinterpret_cast<const uint4 *>(&smem.input[0][row_local + i][col_local]), s);
            if constexpr (kGated) {
                float linear[kSpan];
                unpack8<T>(*reinterpret_cast<const uint4 *>(&smem.input[1][row_local + i][col_local]), linear);
#pragma unroll
                for (int j = 0; j < kSpan; ++j) {
                    // masked rows read zeros, as the Triton kernel's masked loads do
                    y[i][j] = live[i] ? to_float(from_float<T>(gated_value(s[j], linear[j], row_factor[i], p.act)))
                                      : 0.0f;
                }
            } else if constexpr (kRmsNorm) {
#pragma unroll
                for (int j = 0; j < kSpan; ++j) y[i][j] = to_float(from_float<T>(s[j] * row_factor[i] * weight[j]));
            } else {
#pragma unroll
                for (int j = 0; j < kSpan; ++j) y[i][j] = s[j];
            }
        }
        // each thread loads and reads only its own pieces of the buffer, so the next tile can stream in
        // while this one is quantized and stored
        if (tile + gridDim.x < tiles) prefetch(tile + gridDim.x);

        // forward copy: one scale per row of the tile
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
            unsigned bits = 0;
#pragma unroll
            for (int j = 0; j < kSpan; ++j) bits = max(bits, magnitude_bits(y[i][j]));
#pragma unroll
            for (int offset = 1; offset < 16; offset <<= 1) {
                bits = max(bits, __shfl_xor_sync(kFullMask, bits, offset));
            }
            const GroupScale scale = group_scale<kFp8Max>(bits);
            const int64_t row = m0 + row_local + i;
            if (row < M && cols_in) {
                const float m = scale.multiplier;
                const uint2 packed = make_uint2(pack4<FP8_KIND>(y[i][0] * m, y[i][1] * m, y[i][2] * m, y[i][3] * m),
                                                pack4<FP8_KIND>(y[i][4] * m, y[i][5] * m, y[i][6] * m, y[i][7] * m));
                *reinterpret_cast<uint2 *>(static_cast<uint8_t *>(p.q) + row * K + col0) = packed;
            }
            if (row < M && lane % 16 == 0) {
                p.scale[row * p.scale_row_stride + tile_k * p.scale_block_stride] = scale.stored;
            }
        }

        // column amaxes: this thread's rows, the other half-warp, then the warps through shared memory
#pragma unroll
        for (int j = 0; j < kSpan; ++j) {
            unsigned bits = 0;
#pragma unroll
            for (int i = 0; i < kSpan; ++i) bits = max(bits, magnitude_bits(y[i][j]));
            bits = max(bits, __shfl_xor_sync(kFullMask, bits, 16));
            if (lane < 16) smem.column_bits[warp][col_local + j] = bits;
        }
        __syncthreads();
        if (threadIdx.x < kTile) {
            const int c = threadIdx.x;
            unsigned bits = 0;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) bits = max(bits, smem.column_bits[w][c]);
            const GroupScale scale = group_scale<kFp8Max>(bits);
            smem.column_multiplier[c] = scale.multiplier;
            if (k0 + c < K) p.scale_t[(k0 + c) * p.scale_t_row_stride + tile_m * p.scale_t_block_stride] = scale.stored;
        }
        __syncthreads();
        // this thread's 8 x 8 piece, quantized per column, into the transposed staging tile
        const int swizzle = (lane % 16) % 8;
#pragma unroll
        for (int j = 0; j < kSpan; ++j) {
            const float m = smem.column_multiplier[col_local + j];
            const uint2 packed = make_uint2(pack4<FP8_KIND>(y[0][j] * m, y[1][j] * m, y[2][j] * m, y[3][j] * m),
                                            pack4<FP8_KIND>(y[4][j] * m, y[5][j] * m, y[6][j] * m, y[7][j] * m));
            *reinterpret_cast<uint2 *>(&smem.transposed[col_local + j][(warp ^ swizzle) * 16 + (lane / 16) * 8]) =
                packed;
        }
        __syncthreads();
        // 8 threads write one column's 128 rows: whole 128-byte lines of q_t (M % 16 == 0)
#pragma unroll
        for (int it = 0; it < kTile * kTile / 16 / kThreads; ++it) {
            const int idx = it * kThreads + threadIdx.x;
            const int c = idx / 8;
            const int piece = idx % 8;
            const int64_t col = k0 + c;
            const int64_t row = m0 + piece * 16;
            if (col < K && row < M) {
                const uint4 v = *reinterpret_cast<const uint4 *>(&smem.transposed[c][(piece ^ ((c / 8) % 8)) * 16]);
                *reinterpret_cast<uint4 *>(static_cast<uint8_t *>(p.q_t) + col * M + row) = v;
            }
        }
        // not needed for the shared buffers (the next tile's own barriers order them): keeps a block's warps
        // on one tile
        __syncthreads();
    }
}

template <typename T, int FP8_KIND, int PRODUCER>
void launch_kernel(const DualBlockParams &params, int64_t tiles, cudaStream_t stream) {
    constexpr int kInputs = PRODUCER == static_cast<int>(DualBlockProducer::kGated) ? 2 : 1;
    constexpr size_t kSmem = sizeof(Staging<T, kInputs>);
    constexpr int kMaxDevices = 64;
    auto kernel = fp8_dual_block_kernel<T, FP8_KIND, PRODUCER>;
    // resident blocks per device, found on the first launch there (idempotent, so a race only repeats it)
    static int resident[kMaxDevices] = {};
    int device = 0;
    cudaGetDevice(&device);
    int blocks_per_device = device < kMaxDevices ? resident[device] : 0;
    if (blocks_per_device == 0) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
        int per_sm = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmem);
        int sms = 0;
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        blocks_per_device = std::max(per_sm, 1) * sms;
        if (device < kMaxDevices) resident[device] = blocks_per_device;
    }
    const int64_t blocks = std::min<int64_t>(tiles, blocks_per_device);
    kernel<<<static_cast<unsigned>(blocks), kThreads, kSmem, stream>>>(params);
}

template <typename T, int FP8_KIND>
void launch_typed(const DualBlockParams &params, DualBlockProducer producer, int64_t tiles, cudaStream_t stream) {
    switch (producer) {
    case DualBlockProducer::kGated:
        launch_kernel<T, FP8_KIND, 1>(params, tiles, stream);
        break;
    case DualBlockProducer::kRmsNorm:
        launch_kernel<T, FP8_KIND, 2>(params, tiles, stream);
        break;
    default:
        launch_kernel<T, FP8_KIND, 0>(params, tiles, stream);
    }
}

} // namespace

void launch_fp8_dual_block(const DualBlockParams &params, DualBlockProducer producer, HalfKind input,
                           Fp8Kind output, cudaStream_t stream) {
    const int64_t tiles = ((params.rows + kTile - 1) / kTile) * ((params.cols + kTile - 1) / kTile);
    if (tiles == 0) return;
    const bool e4m3 = output == Fp8Kind::kE4M3;
    if (input == HalfKind::kBFloat16) {
        e4m3 ? launch_typed<__nv_bfloat16, 0>(params, producer, tiles, stream)
             : launch_typed<__nv_bfloat16, 1>(params, producer, tiles, stream);
    } else {
        e4m3 ? launch_typed<__half, 0>(params, producer, tiles, stream)
             : launch_typed<__half, 1>(params, producer, tiles, stream);
    }
}

} // namespace primus_turbo
