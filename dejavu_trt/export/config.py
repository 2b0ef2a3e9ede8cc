"""Configuration of the canonical decode step: the model's dimensions plus the fixed context."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from ..errors import DejaVuError
from ..models.adapters import ModelDims

SUPPORTED_FAMILIES = ("opt", "llama")
DEFAULT_MAX_CONTEXT = 512
ONNX_OPSET = 17          # LayerNormalization exists; TensorRT 8.6+ and ONNX Runtime both support it
ONNX_IR_VERSION = 10     # local functions with attribute defaults need IR >= 9
METADATA_PREFIX = "dejavu_trt."


@dataclass(frozen=True)
class DecodeConfig:
    """Everything the decode-step module and its ONNX graph depend on besides the weights."""

    family: str
    num_layers: int          # layers exported (== the model's unless truncated for a test)
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    activation: str          # contract names: relu | gelu | silu_glu
    norm: str                # layernorm | rmsnorm
    norm_eps: float
    rope_theta: float | None
    max_context: int         # T, the KV-cache length
    model_layers: int        # layers of the full model (num_layers < model_layers: truncated graph)

    @classmethod
    def from_dims(cls, dims: ModelDims, max_context: int = DEFAULT_MAX_CONTEXT,
                  num_layers: int | None = None) -> "DecodeConfig":
        if dims.family not in SUPPORTED_FAMILIES:
            raise DejaVuError(f"family {dims.family!r} is not supported for export (supported: OPT, LLaMA)")
        if max_context < 2:
            raise DejaVuError(f"--max-context must be at least 2, got {max_context}")
        if dims.family == "opt" and max_context > dims.max_position:
            raise DejaVuError(f"--max-context {max_context} exceeds the model's {dims.max_position} learned positions")
        n = dims.num_layers if num_layers is None else int(num_layers)
        if not 1 <= n <= dims.num_layers:
            raise DejaVuError(f"--layers must be in 1..{dims.num_layers}, got {num_layers}")
        return cls(dims.family, n, dims.hidden_size, dims.intermediate_size, dims.num_heads, dims.num_kv_heads,
                   dims.head_dim, dims.vocab_size, dims.activation, dims.norm, dims.norm_eps, dims.rope_theta,
                   int(max_context), dims.num_layers)

    @property
    def rotary(self) -> bool:
        return self.family == "llama"

    @property
    def truncated(self) -> bool:
        return self.num_layers < self.model_layers

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def cache_shape(self, batch) -> tuple:
        return (batch, self.num_kv_heads, self.max_context, self.head_dim)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DecodeConfig":
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as e:
            raise DejaVuError(f"decode-graph metadata is unreadable ({e}); re-export the graph with this version") from None

    def with_layers(self, n: int) -> "DecodeConfig":
        return replace(self, num_layers=n)


def io_names(num_layers: int) -> dict[str, list[str]]:
    """Names of the decode graph's inputs and outputs, in order."""
    past = [f"past_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]
    return {"inputs": ["input_ids", "position", *past], "outputs": ["logits", *present]}
