"""`dejavu_trt.Engine`: load an engine package and generate text with it.

    engine = dejavu_trt.Engine.load("engines/smollm2")
    print(engine.generate("The state of the union is", max_new_tokens=32))

On a CUDA machine the CUDA executor runs (kernels when the library is built, else the torch
fallback); elsewhere the CPU reference executor runs in fp32.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import DejaVuError
from .decoder import DecoderWeights
from .executor import Executor
from .metrics import RuntimeMetrics
from .package import EnginePackage, load_engine_package


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DejaVuError("--device cuda was requested but torch sees no CUDA device; use --device cpu")
    return dev


class Engine:
    def __init__(self, package: EnginePackage, *, device=None, ops: str = "auto", max_context: int | None = None,
                 metrics: RuntimeMetrics | None = None, side_stream: bool = True, cuda_graph: bool = True):
        self.package = package
        self.config = package.config
        self.device = resolve_device(device)
        self.ops = ops
        self.max_context = int(max_context or self.config.max_context)
        if self.max_context < 2:
            raise DejaVuError(f"--max-context must be at least 2, got {self.max_context}")
        # The CPU fallback is the fp32 reference; a GPU runs the engine's own dtype.
        dtype = torch.float32 if self.device.type == "cpu" else None
        self.weights = DecoderWeights.from_package(package, self.device, dtype, self.max_context)
        self.tokenizer = package.tokenizer()
        self.metrics = metrics
        self.side_stream, self.cuda_graph = side_stream, cuda_graph
        self._executors: dict = {}

    @classmethod
    def load(cls, path: str | Path, *, device=None, ops: str = "auto", max_context: int | None = None,
             metrics_port: int | None = None, plan: bool = False, **kw) -> "Engine":
        """Load and verify an engine package (checksums, op-contract version)."""
        package = load_engine_package(path, require_plan=plan)
        metrics = None
        if metrics_port is not None:
            metrics = RuntimeMetrics()
            metrics.serve(metrics_port)
        return cls(package, device=device, ops=ops, max_context=max_context, metrics=metrics, **kw)

    # --- executors --------------------------------------------------------------------------------
    def executor(self, *, dense: bool = False, batch: int = 1, context: int | None = None) -> Executor:
        """A cached executor (CUDA graphs are captured once per executor). CPU executors size the cache
        to the request instead of the engine's whole context."""
        T = self.max_context if self.device.type == "cuda" or context is None else min(context, self.max_context)
        key = (dense, batch, T)
        if key not in self._executors:
            self._executors[key] = Executor(self.weights, dense=dense, ops=self.ops, batch=batch, max_context=T,
                                            side_stream=self.side_stream, cuda_graph=self.cuda_graph)
        return self._executors[key]

    def encode(self, prompt: str) -> torch.Tensor:
        ids = self.tokenizer(prompt, add_special_tokens=True, return_tensors="pt")["input_ids"][0]
        if ids.numel() == 0:
            raise DejaVuError("the prompt is empty: give some text")
        if ids.numel() >= self.max_context:
            raise DejaVuError(f"the prompt has {ids.numel()} tokens but the context holds {self.max_context}: "
                              f"shorten the prompt or raise --max-context")
        return ids

    # --- generation -------------------------------------------------------------------------------
    def generate_ids(self, prompt_ids: torch.Tensor, max_new_tokens: int = 32, *, dense: bool = False,
                     stop_at_eos: bool = True) -> Iterator[int]:
        """Greedy decoding, batch 1: yields token ids as they are produced."""
        if max_new_tokens < 1:
            raise DejaVuError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        P = prompt_ids.numel()
        if P >= self.max_context:
            raise DejaVuError(f"the prompt has {P} tokens but the context holds {self.max_context}: "
                              f"shorten the prompt or raise --max-context")
        n = min(max_new_tokens, self.max_context - P)
        ex = self.executor(dense=dense, batch=1, context=P + n)
        m = self.metrics
        if m is not None:
            m.set_mode(self.config, dense)
        eos = self.config.eos_token_id
        logits = ex.prefill(prompt_ids[None])
        tok = int(logits[0].argmax())
        t_last = time.perf_counter()
        yield tok
        for _ in range(n - 1):
            if stop_at_eos and eos is not None and tok == eos:
                return
            sample = m is not None and not dense and m.should_sample()
            if sample:
                ex.decoder.record = []
            try:
                ex.step(eager=sample)
            finally:
                records, ex.decoder.record = ex.decoder.record, None
            tok = int(ex.tokens[0])
            now = time.perf_counter()
            if m is not None:
                m.observe_tbt((now - t_last) * 1e3)
                if sample:
                    m.observe_accuracy(records, self.weights, self.weights.dims.activation, self.config.block_size)
            t_last = now
            yield tok

    def stream(self, prompt: str, max_new_tokens: int = 32, *, dense: bool = False) -> Iterator[str]:
        """Yields text pieces as tokens are decoded (multi-byte characters are held until complete)."""
        ids: list[int] = []
        shown = ""
        for tok in self.generate_ids(self.encode(prompt), max_new_tokens, dense=dense):
            if tok == self.config.eos_token_id:
                break
            ids.append(tok)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            yield text[len(shown):]
            shown = text

    def generate(self, prompt: str, max_new_tokens: int = 32, *, dense: bool = False,
                 on_text: Callable[[str], None] | None = None) -> str:
        out = []
        for piece in self.stream(prompt, max_new_tokens, dense=dense):
            out.append(piece)
            if on_text is not None:
                on_text(piece)
        return "".join(out)
