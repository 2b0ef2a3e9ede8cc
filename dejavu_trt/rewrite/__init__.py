"""Stage: rewrite the dense decode graph into dejavu_trt plugin nodes with ONNX local functions."""
from .rewrite import DEFAULT_KV_POLICY, KeptCounts, load_onnx, rewrite

__all__ = ["DEFAULT_KV_POLICY", "KeptCounts", "load_onnx", "rewrite"]
