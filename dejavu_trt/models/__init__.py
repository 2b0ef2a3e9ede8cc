"""Stage 1: load an HF causal LM (OPT or LLaMA family) and describe it through a family adapter."""
from .adapters import AttentionWeights, FamilyAdapter, MLPWeights, ModelDims, adapter_for
from .loading import LoadedModel, load_model
from .registry import ModelSpec, resolve

__all__ = ["AttentionWeights", "FamilyAdapter", "MLPWeights", "ModelDims", "adapter_for",
           "LoadedModel", "load_model", "ModelSpec", "resolve"]
