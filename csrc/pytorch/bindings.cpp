// Python module primus_turbo._C: importing it loads this library and registers the op schemas (below, and in
// TORCH_LIBRARY_FRAGMENTs next to ops built for one platform only).
#include <pybind11/pybind11.h>
#include <torch/library.h>

TORCH_LIBRARY(primus_turbo_cpp_extension, m) {
    // Exclusive prefix sum of int64 group lengths [G] into group offsets [G + 1]; impls in group_offs_ops.cpp.
    m.def("grouped_gemm_compute_offs(Tensor group_lens) -> Tensor", {at::Tag::pt2_compliant_tag});
}

// No Python functions: the ops are reached through torch.ops.primus_turbo_cpp_extension.*
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "primus_turbo C++/CUDA ops, registered under torch.ops.primus_turbo_cpp_extension";
}
