"""Engine packages: everything a runtime needs to decode, in one checked folder.

    engines/NAME/
      manifest.json          tool, op-contract and library versions, config, sha256 of every file
      weights.safetensors    decoder weights in the op contract's layouts (MLP neuron-major)
      predictors.safetensors lookahead predictors: layers.{l}.mlp_a/mlp_b/head_a/head_b
      tokenizer/             the HF tokenizer files
      engine.plan            TensorRT plan (only where TensorRT was importable at build time)

Loading refuses, with one line that says what to do: a missing folder, a corrupt or foreign
manifest, a checksum mismatch, an op-contract version other than this tool's, or a requested .plan
whose plugin library is absent.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..artifacts import load_safetensors, read_manifest, save_safetensors, write_manifest
from ..errors import ArtifactError, DejaVuError
from ..models.adapters import FamilyAdapter, ModelDims
from ..kernels import TRT_PLUGIN_LIBRARY
from ..ops import OP_CONTRACT_VERSION

ENGINE_KIND = "engine"
WEIGHTS_FILE = "weights.safetensors"
PREDICTORS_FILE = "predictors.safetensors"
TOKENIZER_DIR = "tokenizer"
WEIGHTS_FORMAT = "dejavu-engine-weights-v1"
PREDICTORS_FORMAT = "dejavu-engine-predictors-v1"
MAX_BATCH = 16  # the op contract's batch limit (docs/ops.md)
PLUGIN_LIBRARY_ENV = "DEJAVU_PLUGIN_LIBRARY"


@dataclass
class EngineConfig:
    """What an executor needs besides the tensors; stored as the manifest's `config`."""

    model: str
    dims: dict                      # ModelDims.to_dict()
    dtype: str                      # "fp16" | "bf16" | "fp32": dtype of the stored weights
    mlp_kept_units: list[int]       # K per layer (in units of block_size neurons)
    heads_kept: list[int]           # Kh per layer
    block_size: int = 1
    kv_policy: str = "dense"
    max_context: int = 2048
    max_batch: int = MAX_BATCH
    attention_scale: list[float] = field(default_factory=list)
    position_offset: int = 0        # OPT's learned positions start at row 2
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    plan: str | None = None         # file name of the TensorRT plan, when one was built
    build: dict = field(default_factory=dict)   # headline figures from the build report

    @property
    def model_dims(self) -> ModelDims:
        return ModelDims(**self.dims)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class EnginePackage:
    path: Path
    manifest: dict
    config: EngineConfig
    weights: dict[str, torch.Tensor]
    predictors: dict[str, torch.Tensor]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR

    def tokenizer(self):
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{self.tokenizer_dir} holds no readable tokenizer ({str(e).splitlines()[0]}); "
                                f"rebuild the engine") from None


# --- writing -------------------------------------------------------------------------------------

def _norm_tensors(prefix: str, norm: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.weight": norm.weight.detach()}
    if getattr(norm, "bias", None) is not None:
        out[f"{prefix}.bias"] = norm.bias.detach()
    return out


def engine_weights(adapter: FamilyAdapter) -> tuple[dict[str, torch.Tensor], dict]:
    """Every decoder tensor in contract layout, plus the per-model facts the executor needs."""
    dims = adapter.dims()
    w: dict[str, torch.Tensor] = {"embed_tokens": adapter.embed_tokens().weight.detach()}
    extra = {"attention_scale": [], "position_offset": 0}
    if dims.family == "opt":
        pos = adapter.embed_positions()
        w["embed_positions"] = pos.weight.detach()
        extra["position_offset"] = int(getattr(pos, "offset", 2))
    w.update(_norm_tensors("final_norm", adapter.final_norm()))
    if not dims.tie_word_embeddings:
        w["lm_head"] = adapter.lm_head().weight.detach()
    for i in range(dims.num_layers):
        p = f"layers.{i}"
        w.update(_norm_tensors(f"{p}.attn_norm", adapter.attn_norm(i)))
        w.update(_norm_tensors(f"{p}.mlp_norm", adapter.mlp_norm(i)))
        a = adapter.attention_weights(i)
        for name in ("w_q", "w_k", "w_v", "w_o_t", "b_q", "b_k", "b_v", "b_o"):
            w[f"{p}.{name}"] = getattr(a, name)
        extra["attention_scale"].append(a.scale)
        m = adapter.mlp_weights(i)
        for name in ("w_up", "w_down_t", "w_gate", "b_up", "b_down"):
            t = getattr(m, name)
            if t is not None:
                w[f"{p}.{name}"] = t
    return w, extra


def write_engine_package(out: str | Path, *, adapter: FamilyAdapter, tokenizer, predictors: dict[str, torch.Tensor],
                         config: EngineConfig, plan_file: str | Path | None = None,
                         extra_files: dict[str, str] | None = None) -> dict:
    """Write the package atomically (a failed write leaves the previous package, or none)."""
    from ..artifacts import atomic_dir

    dtype = _torch_dtype(config.dtype)
    weights, extra = engine_weights(adapter)
    config.attention_scale = extra["attention_scale"]
    config.position_offset = extra["position_offset"]
    out = Path(out)
    with atomic_dir(out) as tmp:
        save_safetensors(tmp / WEIGHTS_FILE, {k: v.to(dtype) for k, v in weights.items()},
                         {"format": WEIGHTS_FORMAT})
        save_safetensors(tmp / PREDICTORS_FILE, {k: v.to(dtype) for k, v in predictors.items()},
                         {"format": PREDICTORS_FORMAT})
        tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        if plan_file is not None:
            shutil.copy2(plan_file, tmp / Path(plan_file).name)
            config.plan = Path(plan_file).name
        manifest = write_manifest(tmp, ENGINE_KIND, config.to_dict(),
                                  extra={"op_contract_version": OP_CONTRACT_VERSION})
    return manifest


def _torch_dtype(name: str) -> torch.dtype:
    from ..models.loading import parse_dtype
    return parse_dtype(name)


# --- loading -------------------------------------------------------------------------------------

def plugin_library_path() -> Path:
    """Where the TensorRT plugin library is looked for: $DEJAVU_PLUGIN_LIBRARY, else libdejavu_trt_plugins.so
    beside the kernels library ($DEJAVU_KERNELS_LIB, else plugins/build/)."""
    env = os.environ.get(PLUGIN_LIBRARY_ENV)
    if env:  # an explicit choice is never silently replaced by another copy
        return Path(env)
    from ..kernels import library_path
    return library_path().with_name(TRT_PLUGIN_LIBRARY)


def plugin_library() -> Path | None:
    """The TensorRT plugin library if it exists, else None."""
    lib = plugin_library_path()
    return lib if lib.is_file() else None


def missing_plugin_library_message(what: str) -> str:
    return (f"{what} needs the TensorRT plugin library {TRT_PLUGIN_LIBRARY}, which is not at "
            f"{plugin_library_path()}: build it with TensorRT present (python -m dejavu_trt.kernels.build "
            f"--trt-include TENSORRT_ROOT/include) or set {PLUGIN_LIBRARY_ENV}")


def read_engine_manifest(path: str | Path, verify: bool = True) -> dict:
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"engine package {path} does not exist; build one with `dejavu-trt build MODEL --out {path}`")
    manifest = read_manifest(path, ENGINE_KIND, verify=verify)
    version = manifest.get("op_contract_version")
    if version != OP_CONTRACT_VERSION:
        raise ArtifactError(f"{path} was built for op contract version {version!r}; this dejavu-trt implements "
                            f"version {OP_CONTRACT_VERSION!r}: rebuild the engine with this version")
    return manifest


def load_engine_package(path: str | Path, *, require_plan: bool = False) -> EnginePackage:
    """Load and check a package (manifest, checksums, op contract, tensors)."""
    path = Path(path)
    manifest = read_engine_manifest(path)
    try:
        config = EngineConfig.from_dict(manifest["config"])
        dims = config.model_dims
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{path / 'manifest.json'} has an incomplete config ({e}); rebuild the engine") from None
    if require_plan:
        if not config.plan:
            raise DejaVuError(f"{path} holds no TensorRT plan (TensorRT was not available when it was built); "
                              f"run it without --plan to use the CUDA executor")
        if plugin_library() is None:
            raise DejaVuError(missing_plugin_library_message(str(path / config.plan)))
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            raise DejaVuError(f"{path / config.plan} needs TensorRT, which is not installed here; run without --plan "
                              f"(the CUDA executor runs the same package)") from None
        raise DejaVuError("running a TensorRT plan is not implemented in this version; run without --plan")
    weights, _ = load_safetensors(path / WEIGHTS_FILE, expect_format=WEIGHTS_FORMAT)
    predictors, _ = load_safetensors(path / PREDICTORS_FILE, expect_format=PREDICTORS_FORMAT)
    _check_tensors(path, config, dims, weights, predictors)
    return EnginePackage(path, manifest, config, weights, predictors)


def _check_tensors(path, config: EngineConfig, dims: ModelDims, weights, predictors) -> None:
    L = dims.num_layers
    if len(config.mlp_kept_units) != L or len(config.heads_kept) != L:
        raise ArtifactError(f"{path}: the config has kept counts for {len(config.mlp_kept_units)} layers, the model "
                            f"{L}; rebuild the engine")
    need = ["embed_tokens"] + [f"layers.{i}.{n}" for i in range(L) for n in ("w_q", "w_up", "w_down_t")]
    need += [f"layers.{i}.{n}" for i in range(L) for n in ("mlp_a", "mlp_b", "head_a", "head_b")]
    for name in need:
        if name not in weights and name not in predictors:
            raise ArtifactError(f"{path}: tensor {name} is missing; rebuild the engine")
