"""Stage: compare decode-step executors with polygraphy (Comparator / CompareFunc)."""
from .compare import compare, merge_results
from .runners import DecodeStepRunner, TorchDecodeRunner

__all__ = ["compare", "merge_results", "DecodeStepRunner", "TorchDecodeRunner"]
