// CUDA, Meta and CPU impls of primus_turbo_cpp_extension::grouped_gemm_compute_offs (schema in bindings.cpp).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/grouped_gemm/group_offs.h"

namespace primus_turbo {
namespace {

constexpr const char *kOp = "grouped_gemm_compute_offs: ";

// Checks shared by every backend; device and layout checks live in the backend impls.
void check_group_lens(const at::Tensor &group_lens) {
    TORCH_CHECK(group_lens.dim() == 1, kOp, "group_lens must be a 1-D tensor, got a ", group_lens.dim(),
                "-D tensor");
    TORCH_CHECK(group_lens.scalar_type() == at::kLong, kOp, "group_lens must have dtype int64 (torch.long), got ",
                group_lens.scalar_type());
}

at::Tensor compute_offs_cuda(const at::Tensor &group_lens) {
    check_group_lens(group_lens);
    TORCH_CHECK(group_lens.is_cuda(), kOp, "group_lens must be a CUDA tensor, got device ", group_lens.device());
    TORCH_CHECK(group_lens.is_contiguous(), kOp, "group_lens must be contiguous");
    const c10::cuda::CUDAGuard device_guard(group_lens.device());
    const int64_t num_groups = group_lens.size(0);
    at::Tensor group_offs = at::empty({num_groups + 1}, group_lens.options());
    launch_compute_group_offs(group_lens.const_data_ptr<int64_t>(), group_offs.mutable_data_ptr<int64_t>(),
                              num_groups, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return group_offs;
}

// Shape-only impl for meta/fake tensors; SymInt-aware so torch.compile with dynamic shapes works.
at::Tensor compute_offs_meta(const at::Tensor &group_lens) {
    check_group_lens(group_lens);
    return at::empty_symint({group_lens.sym_size(0) + 1}, group_lens.options());
}

// Reference impl: a leading zero followed by the inclusive cumulative sum.
at::Tensor compute_offs_cpu(const at::Tensor &group_lens) {
    check_group_lens(group_lens);
    const int64_t num_groups = group_lens.size(0);
    at::Tensor group_offs = at::zeros({num_groups + 1}, group_lens.options());
    group_offs.narrow(0, 1, num_groups).copy_(at::cumsum(group_lens, 0));
    return group_offs;
}

} // namespace
} // namespace primus_turbo

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CUDA, m) {
    m.impl("grouped_gemm_compute_offs", &primus_turbo::compute_offs_cuda);
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, Meta, m) {
    m.impl("grouped_gemm_compute_offs", &primus_turbo::compute_offs_meta);
}

TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, CPU, m) {
    m.impl("grouped_gemm_compute_offs", &primus_turbo::compute_offs_cpu);
}
