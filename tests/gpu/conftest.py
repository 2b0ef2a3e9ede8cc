"""GPU kernel tests: skipped with a reason on machines without CUDA or without the built library."""
import pytest
import torch

from dejavu_trt import kernels


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device (these tests run on the GPU box: see plugins/README.md)"
    try:
        kernels.load_library()
    except kernels.KernelsUnavailable as e:
        return f"libdejavu_kernels not built: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    if reason is None:
        return
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=reason))
