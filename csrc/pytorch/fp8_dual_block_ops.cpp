// primus_turbo_cpp_extension::fp8_dual_block_emit: schema, CUDA and Meta impls. Built for CUDA only (the
// kernel uses cp.async and the CUDA FP8 conversions), so on ROCm the op does not exist and callers use the
// Triton kernels.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/quantization/fp8_dual_block.h"

namespace primus_turbo {
namespace {

constexpr const char *kOp = "fp8_dual_block_emit: ";
constexpr int64_t kBlock = 128;

bool aligned16(const at::Tensor &t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_scale(const at::Tensor &scale, int64_t rows, int64_t blocks, const char *name) {
    TORCH_CHECK(scale.scalar_type() == at::kFloat, kOp, name, " must be float32, got ", scale.scalar_type());
    TORCH_CHECK(scale.dim() == 2 && scale.size(0) == rows && scale.size(1) == blocks, kOp, name, " must have shape (",
                rows, ", ", blocks, "), got ", scale.sizes());
}

void check_device(const at::Tensor &t, const at::Tensor &x, const char *name) {
    TORCH_CHECK(t.device() == x.device(), kOp, name, " must be on x's device ", x.device(), ", got ", t.device());
}

void check_row_vector(const c10::optional<at::Tensor> &t, const at::Tensor &x, int64_t rows, const char *name) {
    if (!t.has_value()) return;
    check_device(*t, x, name);
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->is_contiguous(), kOp, name,
                " must be a contiguous vector of ", rows, " elements");
}

void fp8_dual_block_emit_cuda(const at::Tensor &x, const c10::optional<at::Tensor> &gamma,
                              const c10::optional<at::Tensor> &rstd, const c10::optional<at::Tensor> &probs,
                              const c10::optional<at::Tensor> &row_mask, int64_t producer, int64_t act,
                              bool zero_centered, const at::Tensor &q, const at::Tensor &scale, const at::Tensor &q_t,
                              const at::Tensor &scale_t) {
    TORCH_CHECK(producer >= 0 && producer <= 2, kOp, "producer must be 0 (copy), 1 (gated) or 2 (rmsnorm), got ",
                producer);
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1, kOp,
                "x must be a 2-D CUDA tensor with unit column stride");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, kOp,
                "x must be bfloat16 or float16, got ", x.scalar_type());
    const bool gated = producer == static_cast<int64_t>(DualBlockProducer::kGated);
    const bool rmsnorm = producer == static_cast<int64_t>(DualBlockProducer::kRmsNorm);
    TORCH_CHECK(!gated || x.size(1) % 2 == 0, kOp, "a gated input needs an even width, got ", x.size(1));
    const int64_t rows = x.size(0);
    const int64_t cols = gated ? x.size(1) / 2 : x.size(1);
    const auto fp8 = q.scalar_type();
    TORCH_CHECK(fp8 == at::kFloat8_e4m3fn || fp8 == at::kFloat8_e5m2, kOp,
                "q must be float8_e4m3fn or float8_e5m2, got ", fp8);
    TORCH_CHECK(q_t.scalar_type() == fp8, kOp, "q_t must have q's dtype");
    TORCH_CHECK(q.is_contiguous() && q.sizes() == at::IntArrayRef({rows, cols}), kOp, "q must be contiguous (", rows,
                ", ", cols, ")");
    TORCH_CHECK(q_t.is_contiguous() && q_t.sizes() == at::IntArrayRef({cols, rows}), kOp, "q_t must be contiguous (",
                cols, ", ", rows, ")");
    check_device(q, x, "q");
    check_device(scale, x, "scale");
    check_device(q_t, x, "q_t");
    check_device(scale_t, x, "scale_t");
    check_scale(scale, rows, (cols + kBlock - 1) / kBlock, "scale");
    check_scale(scale_t, cols, (rows + kBlock - 1) / kBlock, "scale_t");
    if (rmsnorm) {
        TORCH_CHECK(gamma.has_value() && rstd.has_value(), kOp, "rmsnorm needs gamma and rstd");
        check_row_vector(gamma, x, cols, "gamma");
        check_row_vector(rstd, x, rows, "rstd");
        TORCH_CHECK(gamma->scalar_type() == at::kFloat || gamma->scalar_type() == x.scalar_type(), kOp,
                    "gamma must be float32 or x's dtype");
        TORCH_CHECK(rstd->scalar_type() == at::kFloat, kOp, "rstd must be float32");
    }
    if (gated) {
        TORCH_CHECK(act == 0 || act == 1, kOp, "act must be 0 (SiLU) or 1 (tanh GELU), got ", act);
        check_row_vector(probs, x, rows, "probs");
        check_row_vector(row_mask, x, rows, "row_mask");
        TORCH_CHECK(!probs.has_value() || probs->scalar_type() == at::kFloat || probs->scalar_type() == x.scalar_type(),
                    kOp, "probs must be float32 or x's dtype");
        TORCH_CHECK(!row_mask.has_value() || row_mask->scalar_type() == at::kBool ||
                        row_mask->scalar_type() == at::kByte,
                    kOp, "row_mask must be bool or uint8");
    }
    TORCH_CHECK(aligned16(x) && x.stride(0) % 8 == 0 && cols % 8 == 0 && rows % 16 == 0 && aligned16(q) &&
                    aligned16(q_t),
                kOp, "needs 16-byte aligned rows: x's data and row stride, K % 8 == 0 and M % 16 == 0, got x ",
                x.sizes(), " with row stride ", x.stride(0));
    const c10::cuda::CUDAGuard device_guard(x.device());
    DualBlockParams params{};
    params.x = x.const_data_ptr();
    params.stride_x = x.stride(0);
    params.rows = rows;
    params.cols = cols;
    if (rmsnorm) {
        params.gamma = gamma->const_data_ptr();
        params.gamma_fp32 = gamma->scalar_type() == at::kFloat;
        params.zero_centered = zero_centered;
        params.rstd = rstd->const_data_ptr<float>();
    }
    if (gated) {
        params.act = static_cast<int>(act);
        params.probs = probs.has_value() ? probs->const_data_ptr() : nullptr;
        params.probs_fp32 = probs.has_value() && probs->scalar_type() == at::kFloat;
        params.row_mask = row_mask.has_value() ? static_cast<const uint8_t *>(row_mask->const_data_ptr()) : nullptr;
    }
    params.q = q.data_ptr();
    params.scale = scale.data_ptr<float>();
    params.scale_row_stride = scale.stride(0);
    params.scale_block_stride = scale.stride(1);
    params.q_t = q_t.data_ptr();
    params.scale_t = scale_t.data_ptr<float>();
    params.scale_t_row_stride = scale_t.stride(0);
    params.scale_t_block_stride = scale_t.stride(1);
    launch_fp8_dual_block(params, static_cast<DualBlockProducer>(producer),
                          x.scalar_type() == at::kBFloat16 ? HalfKind::kBFloat16 : HalfKind::kFloat16,
                          fp8 == at::kFloat8_e4m3fn ? Fp8Kind::kE4M3 : Fp8Kind::kE5M2,
                          at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Nothing to compute for meta/fake tensors: the op only writes its mutable arguments.
void fp8_dual_block_emit_meta(const at::Tensor &, const c10::optional<at::Tensor> &,
                              const c10::optional<at::Tensor> &, const c10::optional<at::Tensor> &,
                              const c10::optional<at::Tensor> &, int64_t, int64_t, bool, const at::Tensor &,
                              const at::Tensor &, const at::Tensor &, const at::Tensor &) {}

} // namespace
} // namespace primus_turbo

TORCH_LIBRARY_FRAGMENT(primus_turbo_cpp_extension, m) {
    // Both 1 x 128 block FP8 copies (q along the columns, q_t transposed) of a producer's output: 0 copy of
    // x, 1 gated activation of x = [gate | linear], 2 RMSNorm with a given rstd.
    m.def("fp8_dual_block_emit(Tensor x, Tensor? gamma, Tensor? rstd, Tensor? probs, Tensor? row_mask, "
          "int producer, int act, bool zero_centered, Tensor(a!) q, Tensor(b!) scale, Tensor(c!) q_t, "
          "Tensor(d!) scale_t) -> ()",
          {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CUDA, m) {
    m.impl("fp8_dual_block_emit", &primus_turbo::fp8_dual_block_emit_cuda);
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, Meta, m) {
    m.impl("fp8_dual_block_emit", &primus_turbo::fp8_dual_block_emit_meta);
}
