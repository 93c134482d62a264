// Python module primus_turbo._C: importing it loads this library and registers the op schemas below.
#include <pybind11/pybind11.h>
#include <torch/library.h>

TORCH_LIBRARY(primus_turbo_cpp_extension, m) {
    // Exclusive prefix sum of int64 group lengths [G] into group offsets [G + 1]; impls in group_offs_ops.cpp.
    m.def("grouped_gemm_compute_offs(Tensor group_lens) -> Tensor", {at::Tag::pt2_compliant_tag});
    // Both 1 x 128 block FP8 copies (q along the columns, q_t transposed) of a producer's output: 0 copy of
    // x, 1 gated activation of x = [gate | linear], 2 RMSNorm with a given rstd; impls in
    // fp8_dual_block_ops.cpp.
    m.def("fp8_dual_block_emit(Tensor x, Tensor? gamma, Tensor? rstd, Tensor? probs, Tensor? row_mask, "
          "int producer, int act, bool zero_centered, Tensor(a!) q, Tensor(b!) scale, Tensor(c!) q_t, "
          "Tensor(d!) scale_t) -> ()",
          {at::Tag::pt2_compliant_tag});
}

// No Python functions: the ops are reached through torch.ops.primus_turbo_cpp_extension.*
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "primus_turbo C++/CUDA ops, registered under torch.ops.primus_turbo_cpp_extension";
}
