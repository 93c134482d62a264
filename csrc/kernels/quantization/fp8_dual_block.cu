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
// ACT: the gated producer's activation (0 SiLU, 1 tanh-approximated GELU), 0 for the others
template <typename T, int FP8_KIND, int PRODUCER, int ACT>
__global__ void __launch_bounds__(kThreads, kMinBlocks) fp8_dual_block_kernel(const DualBlockParams p) {
    constexpr int kFp8Max = FP8_KIND == 0 ? 448 : 57344;
    constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
    constexpr bool kGated = PRODUCER == static_cast<int>(DualBlockProducer::kGated);
    constexpr bool kRmsNorm = PRODUCER == static_cast<int>(DualBlockProducer::kRmsNorm);
    constexpr int kInputs = kGated ? 2 : 1;
    constexpr int kWords = kSpan / 2;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    auto &smem = *reinterpret_cast<Staging<T, kInputs> *>(smem_raw);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int col_local = (lane % 16) * kSpan;
    const int row_local = warp * 16 + (lane / 16) * kSpan;
    const int64_t M = p.rows;
    const int64_t K = p.cols;
    const int64_t tiles_m = (M + kTile - 1) / kTile;
    const int64_t tiles_k = (K + kTile - 1) / kTile;
    const int64_t tiles = tiles_m * tiles_k;
    // tiles in row-major order: the blocks in flight read and write neighbouring stretches of the same rows.
    // RMSNorm's tiles follow a pass over x for rstd, so they go last rows first: at 4096 tokens those are
    // still in L2 (60 MB on H200)
    auto tile_row = [&](int64_t t) { return kRmsNorm ? tiles_m - 1 - t / tiles_k : t / tiles_k; };
    auto tile_col = [&](int64_t t) { return t % tiles_k; };
    const T *x = static_cast<const T *>(p.x);
    // the lane of a half-warp that ends the row-amax butterfly below holding row i of the thread's 8
    auto lane_of_row = [](int i) { return ((i >> 2) & 1) | (((i >> 1) & 1) << 1) | ((i & 1) << 2); };
    const int my_row = lane_of_row(lane % 8);

    // start copying this thread's pieces of a tile into shared memory and loading its factors; M % 16 == 0
    // and K % 8 == 0, so a thread's 8 rows, like its 8 columns, are all in or all out
    auto prefetch = [&](int64_t tile, Factors &f) {
        const int64_t row0 = tile_row(tile) * kTile + row_local;
        const int64_t col = tile_col(tile) * kTile + col_local;
        const bool inside = row0 < M && col < K;
        const T *src = x + (inside ? row0 * p.stride_x + col : 0);
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
            bool valid = inside;
            if (kGated && valid && p.row_mask != nullptr) valid = p.row_mask[row0 + i] != 0; // padding: not read
#pragma unroll
            for (int input = 0; input < kInputs; ++input) {
                copy_async16(&smem.input[input][row_local + i][col_local], src + (valid ? input * K : 0), valid);
            }
            if (inside) src += p.stride_x;
            f.live[i] = valid;
            if constexpr (kGated) {
                f.row[i] = !valid ? 0.0f
                           : p.probs != nullptr ? load_scalar(p.probs, p.probs_fp32, row0 + i, kBf16)
                                                : 1.0f;
            } else if constexpr (kRmsNorm) {
                f.row[i] = row0 < M ? p.rstd[row0 + i] : 0.0f;
            }
        }
        copy_async_commit();
        if constexpr (kRmsNorm) {
#pragma unroll
            for (int j = 0; j < kSpan; ++j) {
                const float g = col < K ? load_scalar(p.gamma, p.gamma_fp32, col + j, kBf16) : 0.0f;
                f.col[j] = p.zero_centered ? g + 1.0f : g;
            }
        }
    };

    Factors next;
    int64_t tile = blockIdx.x;
    if (tile < tiles) prefetch(tile, next);
    for (; tile < tiles; tile += gridDim.x) {
        const int64_t tile_m = tile_row(tile);
        const int64_t tile_k = tile_col(tile);
        const int64_t m0 = tile_m * kTile;
        const int64_t k0 = tile_k * kTile;
        const int64_t row0 = m0 + row_local;
        const int64_t col0 = k0 + col_local;
        const bool rows_in = row0 < M;
        const bool cols_in = col0 < K;
        const Factors f = next;

        copy_async_wait<0>();
        uint4 raw[kInputs][kSpan];
#pragma unroll
        for (int input = 0; input < kInputs; ++input) {
#pragma unroll
            for (int i = 0; i < kSpan; ++i) {
                raw[input][i] = *reinterpret_cast<const uint4 *>(&smem.input[input][row_local + i][col_local]);
            }
        }
        // each thread reads only its own pieces of the buffer, so the next tile streams in over this one's
        // math and stores (its copies follow these reads in program order; see copy_async16)
        if (tile + gridDim.x < tiles) prefetch(tile + gridDim.x, next);

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
