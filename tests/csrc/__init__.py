"""Tests of the C++/CUDA extension's ops (``torch.ops.primus_turbo_cpp_extension``)."""

import pytest
import torch

try:
    import primus_turbo._C  # noqa: F401  (loading the library registers the ops)

    _EXT_ERROR = None
except ImportError as exc:
    _EXT_ERROR = exc


def extension_marks(cuda_only: bool = False) -> list:
    """``pytestmark`` of a module testing the extension: a GPU (CUDA, or also ROCm) and a built ``_C``."""
    marks = [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
        pytest.mark.skipif(_EXT_ERROR is not None, reason=f"primus_turbo._C is not built: {_EXT_ERROR}"),
    ]
    if cuda_only:
        marks.append(pytest.mark.skipif(torch.version.hip is not None, reason="a CUDA-only op"))
    return marks
