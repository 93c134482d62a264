// Both 1 x 128 block FP8 copies of a producer's output from one read of its input; see fp8_dual_block.h.
//
// Persistent 256-thread blocks walk the 128 x 128 tiles in row-major order. Each thread copies its own
// pieces of a tile into shared memory (16-byte cp.async) and reads back only those, so as soon as it holds
// the current tile in registers it starts the next tile's copy (and loads its per-row and per-column
// factors), which stay in flight across the math and the stores. The kernel is bound by instruction issue
// more than by memory latency, so y stays packed in the input dtype and every step is counted. Thread
// (warp w, lane l) owns rows 16w + 8(l / 16) + [0, 8) and columns 8(l % 16) + [0, 8) of a tile:
//   - the forward copy's row amaxes: a butterfly over the half-warp leaves each lane one row's amax, so a
//     lane computes one scale and the multipliers are shuffled back; 8-byte stores cover whole 128-byte
//     rows of q;
//   - the column amaxes combine the thread's rows, the other half-warp and the 8 warps through shared
//     memory; each thread's 8 x 8 piece, quantized per column, is staged transposed in shared memory as
//     FP8 (16-byte pieces swizzled so that a warp's stores hit every bank once), and 8 threads then write
//     each column's 128 rows as one whole 128-byte line of q_t.
//
// The numerics are those of the Triton producers and quantize_fp8_with_trans, bit for bit: fp32 math, y
// rounded to the input dtype before quantization, NaN-propagating amaxes (a group holding NaN or inf gets
// a NaN scale and multiplier 1), multiplier = min(FP8_MAX / amax, FLT_MAX) rounded to nearest,
// scale_inv = 1 / multiplier, and a saturating round-to-nearest FP8 cast.
//
// RMSNorm needs each row's rstd before its first tile, so fp8_dual_block_kernel takes it from a pass over x
// before. fp8_rmsnorm_cluster_kernel (sm_90, K <= 4096) reads x once instead: a cluster of 16 blocks holds
// a 128-row strip in shared memory, two tiles a block, and adds the blocks' row sums through distributed
// shared memory before emitting the tiles as above. Its row sums add in another order than the Triton
// forward's, so rstd may differ in the last bit and the copies by one FP8 ulp.
#include "fp8_dual_block.h"

#include <algorithm>
#include <cfloat>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_fp8.h>

namespace primus_turbo {
namespace {

namespace cg = cooperative_groups;

constexpr int kTile = 128; // the 1 x 128 block along both dimensions
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSpan = 8;   // a thread owns kSpan rows x kSpan columns of a tile
constexpr int kPitch = kTile + 8; // elements per staged input row: 16-byte aligned, rows 4 banks apart
constexpr unsigned kFullMask = 0xffffffffu;

// The Triton gated kernels' sigmoid on NVIDIA, the same PTX: exp(-a) as ex2.approx.ftz of a * -log2 e, then
// rcp.approx.ftz of 1 + that (flushing a subnormal exp changes nothing: 1 + it rounds to 1), so the gated
// output stays bit-identical to theirs.
__device__ __forceinline__ float fast_sigmoid(float a) {
    float s;
    asm("{\n\t.reg .f32 t;\n\tmul.f32 t, %1, 0fBFB8AA3B;\n\tex2.approx.ftz.f32 t, t;\n\t"
        "add.f32 t, t, 0f3F800000;\n\trcp.approx.ftz.f32 %0, t;\n\t}"
        : "=f"(s)
        : "f"(a));
    return s;
}

template <int ACT> __device__ __forceinline__ float gated_value(float gate, float linear, float prob) {
    float activated;
    if constexpr (ACT == 0) {
        activated = gate * fast_sigmoid(gate);
    } else {
        const float inner = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
        const float t = 2.0f * fast_sigmoid(2.0f * inner) - 1.0f;
        activated = 0.5f * gate * (1.0f + t);
    }
    return activated * linear * prob;
}

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

// y is kept as the input dtype, two values per word (first in the low half), so a thread's 8 x 8 piece
// costs 32 registers.
template <typename T> __device__ __forceinline__ unsigned pack_pair(float a, float b) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<const unsigned *>(&v);
    } else {
        const __half2 v = __floats2half2_rn(a, b);
        return *reinterpret_cast<const unsigned *>(&v);
    }
}
template <typename T> __device__ __forceinline__ float2 unpack_pair(unsigned w) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    } else {
        return __half22float2(*reinterpret_cast<const __half2 *>(&w));
    }
}
// Magnitude bits of both halves: they order like the values (NaN above inf) in either dtype.
__device__ __forceinline__ unsigned pair_magnitudes(unsigned w) { return w & 0x7fff7fffu; }
// The fp32 magnitude bits of one half's magnitude bits.
template <typename T> __device__ __forceinline__ unsigned float_bits(unsigned half_bits) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        return half_bits << 16;
    } else {
        return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(half_bits))));
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
    unsigned column_bits[kWarps][kTile / 2]; // magnitude bits in the input dtype, two columns per word
    float column_multiplier[kTile];
};

// Per-row and per-column factors of a tile: RMSNorm's rstd and gamma, the gated producer's probs (0 for
// masked and missing rows). Loaded with the tile's copy, used once it has landed.
struct Factors {
    float row[kSpan];
    float col[kSpan];
    bool live[kSpan];
};

// Two blocks per SM (128 registers a thread): the gated producer's shared memory allows no more, and three
// blocks of the others (80 registers) measured no faster.
constexpr int kMinBlocks = 2;
// Thread (warp, lane)'s place in a tile: rows row_local + [0, kSpan), columns col_local + [0, kSpan).
struct TileLane {
    int warp;
    int lane;
    int col_local;
    int row_local;
    int my_row; // the row (of its 8) whose amax this lane holds after the butterfly below
};
// the lane of a half-warp that ends the row-amax butterfly below holding row i of the thread's 8
__device__ __forceinline__ int lane_of_row(int i) { return ((i >> 2) & 1) | (((i >> 1) & 1) << 1) | ((i & 1) << 2); }
__device__ __forceinline__ TileLane tile_lane() {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    return {warp, lane, (lane % 16) * kSpan, warp * 16 + (lane / 16) * kSpan, lane_of_row(lane % 8)};
}

// One tile (tile_m, tile_k) whose input (input[0], and input[1] for the gated linear half) this thread's
// copies have landed in, with its factors f: both copies and their scales, staged through smem.
// after_read() runs once the thread has read its pieces of the input (it may start the next copy there).
template <typename T, int FP8_KIND, int PRODUCER, int ACT, typename Smem, typename AfterRead>
__device__ __forceinline__ void emit_tile(const DualBlockParams &p, const T (*input)[kTile][kPitch], Smem &smem,
                                          int64_t tile_m, int64_t tile_k, const Factors &f, AfterRead &&after_read) {
    constexpr int kFp8Max = FP8_KIND == 0 ? 448 : 57344;
    constexpr bool kGated = PRODUCER == static_cast<int>(DualBlockProducer::kGated);
    constexpr bool kRmsNorm = PRODUCER == static_cast<int>(DualBlockProducer::kRmsNorm);
    constexpr int kInputs = kGated ? 2 : 1;
    constexpr int kWords = kSpan / 2;
    const auto [warp, lane, col_local, row_local, my_row] = tile_lane();
    const int64_t M = p.rows;
    const int64_t K = p.cols;
    const int64_t m0 = tile_m * kTile;
    const int64_t k0 = tile_k * kTile;
    const int64_t row0 = m0 + row_local;
    const int64_t col0 = k0 + col_local;
    const bool rows_in = row0 < M;
    const bool cols_in = col0 < K;
    uint4 raw[kInputs][kSpan];
#pragma unroll
    for (int k = 0; k < kInputs; ++k) {
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
            raw[k][i] = *reinterpret_cast<const uint4 *>(&input[k][row_local + i][col_local]);
        }
    }
    // each thread reads only its own pieces of the buffer, so the next tile streams in over this one's
    // math and stores (its copies follow these reads in program order; see copy_async16)
    after_read();

    unsigned y[kSpan][kWords];
#pragma unroll
    for (int i = 0; i < kSpan; ++i) {
        const unsigned words[kWords] = {raw[0][i].x, raw[0][i].y, raw[0][i].z, raw[0][i].w};
        if constexpr (kGated) {
            const unsigned linear[kWords] = {raw[1][i].x, raw[1][i].y, raw[1][i].z, raw[1][i].w};
#pragma unroll
            for (int w = 0; w < kWords; ++w) {
                // masked rows read zeros, as the Triton kernel's masked loads do
                const float2 g = unpack_pair<T>(words[w]);
                const float2 l = unpack_pair<T>(linear[w]);
                y[i][w] = f.live[i] ? pack_pair<T>(gated_value<ACT>(g.x, l.x, f.row[i]),
                                                   gated_value<ACT>(g.y, l.y, f.row[i]))
                                    : 0u;
            }
        } else if constexpr (kRmsNorm) {
#pragma unroll
            for (int w = 0; w < kWords; ++w) {
                const float2 s = unpack_pair<T>(words[w]);
                y[i][w] = pack_pair<T>(s.x * f.row[i] * f.col[2 * w], s.y * f.row[i] * f.col[2 * w + 1]);
            }
        } else {
#pragma unroll
            for (int w = 0; w < kWords; ++w) y[i][w] = words[w];
        }
    }

    // forward copy, one scale per row of the tile: a butterfly over the half-warp halves the rows a
    // lane carries at each step, so each lane ends with one row's amax and computes one scale
    unsigned amax[kSpan];
#pragma unroll
    for (int i = 0; i < kSpan; ++i) {
        unsigned pair = 0;
#pragma unroll
        for (int w = 0; w < kWords; ++w) pair = __vmaxu2(pair, pair_magnitudes(y[i][w]));
        amax[i] = max(pair & 0xffffu, pair >> 16);
    }
#pragma unroll
    for (int half = kSpan / 2, offset = 1; half >= 1; half /= 2, offset *= 2) {
        const bool upper = lane & offset;
#pragma unroll
        for (int k = 0; k < half; ++k) {
            const unsigned send = upper ? amax[k] : amax[k + half];
            const unsigned keep = upper ? amax[k + half] : amax[k];
            amax[k] = max(keep, __shfl_xor_sync(kFullMask, send, offset));
        }
    }
    amax[0] = max(amax[0], __shfl_xor_sync(kFullMask, amax[0], 8));
    const GroupScale row_scale = group_scale<kFp8Max>(float_bits<T>(amax[0]));
    if (rows_in && lane % 16 < 8) {
        p.scale[(row0 + my_row) * p.scale_row_stride + tile_k * p.scale_block_stride] = row_scale.stored;
    }
    float row_multiplier[kSpan];
#pragma unroll
    for (int i = 0; i < kSpan; ++i) {
        row_multiplier[i] = __shfl_sync(kFullMask, row_scale.multiplier, (lane & 16) | lane_of_row(i));
    }
    if (rows_in && cols_in) {
        uint8_t *q_row = static_cast<uint8_t *>(p.q) + row0 * K + col0;
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
            const float m = row_multiplier[i];
            float v[kSpan];
#pragma unroll
            for (int w = 0; w < kWords; ++w) {
                const float2 pv = unpack_pair<T>(y[i][w]);
                v[2 * w] = pv.x * m;
                v[2 * w + 1] = pv.y * m;
            }
            *reinterpret_cast<uint2 *>(q_row) = make_uint2(pack4<FP8_KIND>(v[0], v[1], v[2], v[3]),
                                                           pack4<FP8_KIND>(v[4], v[5], v[6], v[7]));
            q_row += K;
        }
    }

    // column amaxes: this thread's rows, the other half-warp, then the warps through shared memory
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
        unsigned pair = 0;
#pragma unroll
        for (int i = 0; i < kSpan; ++i) pair = __vmaxu2(pair, pair_magnitudes(y[i][w]));
        pair = __vmaxu2(pair, __shfl_xor_sync(kFullMask, pair, 16));
        if (lane < 16) smem.column_bits[warp][col_local / 2 + w] = pair;
    }
    __syncthreads();
    if (threadIdx.x < kTile) {
        const int c = threadIdx.x;
        unsigned bits = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) bits = __vmaxu2(bits, smem.column_bits[w][c / 2]);
        const GroupScale scale = group_scale<kFp8Max>(float_bits<T>((bits >> (16 * (c % 2))) & 0xffffu));
        smem.column_multiplier[c] = scale.multiplier;
        if (k0 + c < K) p.scale_t[(k0 + c) * p.scale_t_row_stride + tile_m * p.scale_t_block_stride] = scale.stored;
    }
    __syncthreads();
    // this thread's 8 x 8 piece, quantized per column, into the transposed staging tile
    const int slot = (warp ^ ((lane % 16) % 8)) * 16 + (lane / 16) * 8;
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
        const float m_lo = smem.column_multiplier[col_local + 2 * w];
        const float m_hi = smem.column_multiplier[col_local + 2 * w + 1];
        float lo[kSpan], hi[kSpan];
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
            const float2 pv = unpack_pair<T>(y[i][w]);
            lo[i] = pv.x * m_lo;
            hi[i] = pv.y * m_hi;
        }
        *reinterpret_cast<uint2 *>(&smem.transposed[col_local + 2 * w][slot]) =
            make_uint2(pack4<FP8_KIND>(lo[0], lo[1], lo[2], lo[3]), pack4<FP8_KIND>(lo[4], lo[5], lo[6], lo[7]));
        *reinterpret_cast<uint2 *>(&smem.transposed[col_local + 2 * w + 1][slot]) =
            make_uint2(pack4<FP8_KIND>(hi[0], hi[1], hi[2], hi[3]), pack4<FP8_KIND>(hi[4], hi[5], hi[6], hi[7]));
    }
    __syncthreads();
    // 8 threads write one column's 128 rows: whole 128-byte lines of q_t (M % 16 == 0)
    constexpr int kColumnsPerPass = kThreads / 8;
    const int piece = threadIdx.x % 8;
    const int64_t row = m0 + piece * 16;
    uint8_t *q_t = static_cast<uint8_t *>(p.q_t) + (k0 + threadIdx.x / 8) * M + row;
#pragma unroll
    for (int it = 0; it < kTile / kColumnsPerPass; ++it) {
        const int c = it * kColumnsPerPass + threadIdx.x / 8;
        if (k0 + c < K && row < M) {
            *reinterpret_cast<uint4 *>(q_t) =
                *reinterpret_cast<const uint4 *>(&smem.transposed[c][(piece ^ ((c / 8) % 8)) * 16]);
        }
        q_t += kColumnsPerPass * M;
    }
    // no barrier here: the next tile writes column_bits after this tile's last two barriers (past their
    // reads), column_multiplier and transposed only after its own first and second barriers, which
    // every thread reaches after this tile's reads
}

// RMSNorm's factors of tile (tile_m, tile_k) for this thread: rstd (rstd_tile: from the tile's first row on,
// in global or shared memory) and gamma.
template <typename T>
__device__ __forceinline__ void rmsnorm_factors(const DualBlockParams &p, int64_t tile_m, int64_t tile_k,
                                                const float *rstd_tile, Factors &f) {
    constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
    const TileLane t = tile_lane();
    const int64_t row0 = tile_m * kTile + t.row_local;
    const int64_t col = tile_k * kTile + t.col_local;
#pragma unroll
    for (int i = 0; i < kSpan; ++i) f.row[i] = row0 < p.rows ? rstd_tile[t.row_local + i] : 0.0f;
#pragma unroll
    for (int j = 0; j < kSpan; ++j) {
        const float g = col < p.cols ? load_scalar(p.gamma, p.gamma_fp32, col + j, kBf16) : 0.0f;
        f.col[j] = p.zero_centered ? g + 1.0f : g;
    }
}

// Start copying this thread's pieces of tile (tile_m, tile_k) into input (input[1]: the gated linear half)
// and fill the gated producer's factors; M % 16 == 0 and K % 8 == 0, so a thread's 8 rows, like its 8
// columns, are all in or all out.
template <typename T, int PRODUCER>
__device__ __forceinline__ void copy_tile(const DualBlockParams &p, T (*input)[kTile][kPitch], int64_t tile_m,
                                          int64_t tile_k, Factors &f) {
    constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
    constexpr bool kGated = PRODUCER == static_cast<int>(DualBlockProducer::kGated);
    constexpr int kInputs = kGated ? 2 : 1;
    const TileLane t = tile_lane();
    const int64_t M = p.rows;
    const int64_t K = p.cols;
    const int64_t row0 = tile_m * kTile + t.row_local;
    const int64_t col = tile_k * kTile + t.col_local;
    const bool inside = row0 < M && col < K;
    const T *src = static_cast<const T *>(p.x) + (inside ? row0 * p.stride_x + col : 0);
#pragma unroll
    for (int i = 0; i < kSpan; ++i) {
        bool valid = inside;
        if (kGated && valid && p.row_mask != nullptr) valid = p.row_mask[row0 + i] != 0; // padding: not read
#pragma unroll
        for (int k = 0; k < kInputs; ++k) {
            copy_async16(&input[k][t.row_local + i][t.col_local], src + (valid ? k * K : 0), valid);
        }
        if (inside) src += p.stride_x;
        f.live[i] = valid;
        if constexpr (kGated) {
            f.row[i] = !valid ? 0.0f
                       : p.probs != nullptr ? load_scalar(p.probs, p.probs_fp32, row0 + i, kBf16)
                                            : 1.0f;
        }
    }
    copy_async_commit();
}

// ACT: the gated producer's activation (0 SiLU, 1 tanh-approximated GELU), 0 for the others
template <typename T, int FP8_KIND, int PRODUCER, int ACT>
__global__ void __launch_bounds__(kThreads, kMinBlocks) fp8_dual_block_kernel(const DualBlockParams p) {
    constexpr bool kRmsNorm = PRODUCER == static_cast<int>(DualBlockProducer::kRmsNorm);
    constexpr int kInputs = PRODUCER == static_cast<int>(DualBlockProducer::kGated) ? 2 : 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    auto &smem = *reinterpret_cast<Staging<T, kInputs> *>(smem_raw);
    const int64_t tiles_m = (p.rows + kTile - 1) / kTile;
    const int64_t tiles_k = (p.cols + kTile - 1) / kTile;
    const int64_t tiles = tiles_m * tiles_k;
    // tiles in row-major order: the blocks in flight read and write neighbouring stretches of the same rows.
    // RMSNorm's tiles follow a pass over x for rstd, so they go last rows first: at 4096 tokens those are
    // still in L2 (60 MB on H200)
    auto tile_row = [&](int64_t t) { return kRmsNorm ? tiles_m - 1 - t / tiles_k : t / tiles_k; };
    auto tile_col = [&](int64_t t) { return t % tiles_k; };
    // start a tile's copy and load its factors, which stay in flight over the previous tile's math
    auto prefetch = [&](int64_t t, Factors &f) {
        const int64_t tile_m = tile_row(t);
        copy_tile<T, PRODUCER>(p, smem.input, tile_m, tile_col(t), f);
        if constexpr (kRmsNorm) rmsnorm_factors<T>(p, tile_m, tile_col(t), p.rstd + tile_m * kTile, f);
    };

    Factors next;
    int64_t tile = blockIdx.x;
    if (tile < tiles) prefetch(tile, next);
    for (; tile < tiles; tile += gridDim.x) {
        const Factors f = next;
        copy_async_wait<0>();
        emit_tile<T, FP8_KIND, PRODUCER, ACT>(p, smem.input, smem, tile_row(tile), tile_col(tile), f, [&] {
            if (tile + gridDim.x < tiles) prefetch(tile + gridDim.x, next);
        });
    }
}

// The cluster kernel's shared memory: the staging of one tile's copies, the row sums and rstd of a strip,
// then (dynamic) this block's input tiles of the strip.
struct ClusterShared {
    uint8_t transposed[kTile][kTile];
    unsigned column_bits[kWarps][kTile / 2];
    float column_multiplier[kTile];
    float row_sum[2][kTile]; // this block's sums of squares of a strip's rows, alternate strips
    float rstd[kTile];
};

// RMSNorm with one read of x: a cluster of blocks owns a 128-row strip at a time, block r its tiles
// r, r + C, ... along K, all held in shared memory. Each thread sums the squares of its pieces of them;
// the blocks add their row sums through distributed shared memory in rank order (the same rstd in every
// block, written to p.rstd_out by rank 0), and each block emits its tiles as fp8_dual_block_kernel does.
// Once a thread has read its pieces of a tile, it starts copying its pieces of the cluster's next strip
// into that buffer.
template <typename T, int FP8_KIND>
__global__ void __launch_bounds__(kThreads, kMinBlocks) fp8_rmsnorm_cluster_kernel(const DualBlockParams p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 // clusters; never launched on older GPUs
    constexpr int kRms = static_cast<int>(DualBlockProducer::kRmsNorm);
    using Tile = T[kTile][kPitch];
    extern __shared__ __align__(16) unsigned char smem_raw[];
    auto &smem = *reinterpret_cast<ClusterShared *>(smem_raw);
    Tile *tiles = reinterpret_cast<Tile *>(smem_raw + sizeof(ClusterShared));
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    const int blocks = static_cast<int>(cluster.num_blocks());
    const int64_t clusters = gridDim.x / blocks;
    const TileLane t = tile_lane();
    const int64_t M = p.rows;
    const int64_t tiles_m = (M + kTile - 1) / kTile;
    const int64_t tiles_k = (p.cols + kTile - 1) / kTile;
    const int mine = static_cast<int>((tiles_k - rank + blocks - 1) / blocks); // this block's tiles of a strip
    Factors unused;
    int64_t strip = blockIdx.x / blocks;
    if (strip < tiles_m) {
        for (int j = 0; j < mine; ++j) copy_tile<T, kRms>(p, &tiles[j], strip, rank + j * int64_t(blocks), unused);
    }
    for (int parity = 0; strip < tiles_m; strip += clusters, parity ^= 1) {
        copy_async_wait<0>();
        float squares[kSpan] = {};
        for (int j = 0; j < mine; ++j) {
#pragma unroll
            for (int i = 0; i < kSpan; ++i) {
                const uint4 raw = *reinterpret_cast<const uint4 *>(&tiles[j][t.row_local + i][t.col_local]);
                const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    const float2 v = unpack_pair<T>(words[w]);
                    squares[i] = fmaf(v.x, v.x, squares[i]);
                    squares[i] = fmaf(v.y, v.y, squares[i]);
                }
            }
        }
        // the 16 lanes of a half-warp share these rows
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
#pragma unroll
            for (int offset = 1; offset < 16; offset *= 2) squares[i] += __shfl_xor_sync(kFullMask, squares[i], offset);
        }
        if (t.lane % 16 == 0) {
#pragma unroll
            for (int i = 0; i < kSpan; ++i) smem.row_sum[parity][t.row_local + i] = squares[i];
        }
        // every block's sums are in place; a block rewrites this parity's sums two strips on, after the next
        // strip's barrier, which each block reaches after its reads of these
        cluster.sync();
        const int64_t m0 = strip * kTile;
        if (threadIdx.x < kTile) {
            float total = 0.0f;
            for (int q = 0; q < blocks; ++q) total += cluster.map_shared_rank(&smem.row_sum[parity][0], q)[threadIdx.x];
            const float rstd = 1.0f / sqrtf(total / static_cast<float>(p.cols) + p.eps);
            smem.rstd[threadIdx.x] = rstd;
            if (rank == 0 && m0 + threadIdx.x < M) p.rstd_out[m0 + threadIdx.x] = rstd;
        }
        __syncthreads();
        const int64_t next = strip + clusters;
        for (int j = 0; j < mine; ++j) {
            const int64_t tile_k = rank + j * int64_t(blocks);
            Factors f;
            rmsnorm_factors<T>(p, strip, tile_k, smem.rstd, f);
            emit_tile<T, FP8_KIND, kRms, 0>(p, &tiles[j], smem, strip, tile_k, f, [&] {
                if (next < tiles_m) copy_tile<T, kRms>(p, &tiles[j], next, tile_k, unused);
            });
        }
        // smem.rstd is rewritten after the next strip's cluster barrier, past every thread's reads of it here
    }
    // no block leaves while another may still read its row sums
    cluster.sync();
#endif
}

template <typename T, int FP8_KIND, int PRODUCER, int ACT = 0>
void launch_kernel(const DualBlockParams &params, int64_t tiles, cudaStream_t stream) {
    constexpr int kInputs = PRODUCER == static_cast<int>(DualBlockProducer::kGated) ? 2 : 1;
    constexpr size_t kSmem = sizeof(Staging<T, kInputs>);
    constexpr int kMaxDevices = 64;
    auto kernel = fp8_dual_block_kernel<T, FP8_KIND, PRODUCER, ACT>;
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
        params.act == 0 ? launch_kernel<T, FP8_KIND, 1, 0>(params, tiles, stream)
                        : launch_kernel<T, FP8_KIND, 1, 1>(params, tiles, stream);
        break;
    case DualBlockProducer::kRmsNorm:
        launch_kernel<T, FP8_KIND, 2>(params, tiles, stream);
        break;
    default:
        launch_kernel<T, FP8_KIND, 0>(params, tiles, stream);
    }
}

// Clusters of 16 blocks (8 where 16 do not fit), each holding at most two of a strip's tiles: two blocks
// per SM. On H200 (CUDA graphs, 4096-16384 tokens) 16 blocks of two tiles ran 16384 x 4096 at 0.61 of a
// same-size copy against 0.53 for the rstd pass and tiles; clusters of 8 (four tiles a block) or 16
// blocks of four tiles (K 7168-8192: one block per SM) were slower than the two passes.
template <typename T, int FP8_KIND>
bool launch_rmsnorm_cluster(const DualBlockParams &params, cudaStream_t stream) {
    constexpr int kMaxDevices = 64;
    constexpr int64_t kMaxTilesK = kRmsNormSingleReadCols / kTile;
    constexpr size_t kTileBytes = sizeof(T[kTile][kPitch]);
    auto kernel = fp8_rmsnorm_cluster_kernel<T, FP8_KIND>;
    const int64_t tiles_k = (params.cols + kTile - 1) / kTile;
    const int64_t strips = (params.rows + kTile - 1) / kTile;
    int device = 0;
    cudaGetDevice(&device);
    if (tiles_k > kMaxTilesK || device >= kMaxDevices) return false;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.attrs = &attribute;
    config.numAttrs = 1;
    config.blockDim = dim3(kThreads);
    config.stream = stream;
    auto shape = [&](int blocks) {
        attribute.val.clusterDim.x = blocks;
        config.dynamicSmemBytes = sizeof(ClusterShared) + ((tiles_k + blocks - 1) / blocks) * kTileBytes;
    };
    // cluster size (-1: none fits) and resident clusters per device and row width, found on the first
    // launch there (idempotent, so a race only repeats it)
    static int found[kMaxDevices][kMaxTilesK + 1][2] = {};
    int *cached = found[device][tiles_k];
    if (cached[0] == 0) {
        // at most four tiles a block (clusters of 8 at K = 4096)
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(sizeof(ClusterShared) + 4 * kTileBytes));
        cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        int blocks = -1;
        int resident = 0;
        for (const int size : {16, 8}) {
            shape(static_cast<int>(std::min<int64_t>(size, tiles_k)));
            config.gridDim = dim3(attribute.val.clusterDim.x * static_cast<unsigned>(strips));
            if (cudaOccupancyMaxActiveClusters(&resident, kernel, &config) == cudaSuccess && resident > 0) {
                blocks = static_cast<int>(attribute.val.clusterDim.x);
                break;
            }
            cudaGetLastError(); // a refused size is not an error of the caller's
        }
        cached[1] = resident;
        cached[0] = blocks;
    }
    if (cached[0] < 0) return false;
    shape(cached[0]);
    config.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(strips, cached[1]) * cached[0]));
    cudaLaunchKernelEx(&config, kernel, params);
    return true;
}

} // namespace

bool launch_fp8_rmsnorm_dual_block(const DualBlockParams &params, HalfKind input, Fp8Kind output,
                                   cudaStream_t stream) {
    if (params.rows == 0 || params.cols == 0) return true;
    const bool e4m3 = output == Fp8Kind::kE4M3;
    if (input == HalfKind::kBFloat16) {
        return e4m3 ? launch_rmsnorm_cluster<__nv_bfloat16, 0>(params, stream)
                    : launch_rmsnorm_cluster<__nv_bfloat16, 1>(params, stream);
    }
    return e4m3 ? launch_rmsnorm_cluster<__half, 0>(params, stream) : launch_rmsnorm_cluster<__half, 1>(params, stream);
}

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
