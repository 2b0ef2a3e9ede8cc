"""Stage: export the decode step to ONNX (canonical module -> dense graph)."""
from .config import DecodeConfig, io_names
from .module import DecodeModel, KVCache, SparsePlan, predictor_source

__all__ = ["DecodeConfig", "DecodeModel", "KVCache", "SparsePlan", "io_names", "predictor_source"]
