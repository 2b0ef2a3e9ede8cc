"""Stage: export the decode step to ONNX (canonical module -> dense graph)."""
from .config import DecodeConfig, io_names
from .module import DecodeModel, KVCache, SparsePlan, predictor_source


def export_decode(*args, **kwargs):
    """See `dejavu_trt.export.stage.export_decode` (imported lazily: it pulls in onnx)."""
    from .stage import export_decode as _export
    return _export(*args, **kwargs)


__all__ = ["DecodeConfig", "DecodeModel", "KVCache", "SparsePlan", "export_decode", "io_names", "predictor_source"]
