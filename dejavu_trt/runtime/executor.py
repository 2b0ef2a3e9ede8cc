"""Executors: run an engine's decode loop on a device.

One class serves both targets:

* CPU (the reference fallback): the op contract's torch reference in fp32, eager.
* CUDA: preallocated KV cache and token/position buffers, the predictor for layer l+1 on a
  non-blocking side stream overlapping layer l, and the whole decode step (greedy argmax and the
  advance of the token/position buffers included) captured in one CUDA graph, for batch 1..16.

`dense=True` gives the baseline: every neuron and head active, cuBLAS for the projections.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import time

import torch

from ..errors import DejaVuError
from . import choice_cache
from .decoder import Decoder, DecoderWeights
from .ops import make_ops
from .package import MAX_BATCH

GiB = float(1 << 30)


def allocate(shape, dtype, device, what: str, context: str = "") -> torch.Tensor:
    """torch.zeros with CUDA out-of-memory turned into a one-line error naming the sizes tried."""
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except torch.OutOfMemoryError:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        free = ""
        if torch.device(device).type == "cuda":
            try:
                f, t = torch.cuda.mem_get_info(device)
                free = f"; {f / GiB:.2f} GiB of {t / GiB:.2f} GiB free"
            except Exception:  # noqa: BLE001 - the report must not fail while reporting
                pass
        raise DejaVuError(f"CUDA out of memory allocating {what} {tuple(shape)} {str(dtype).replace('torch.', '')} "
                          f"= {nbytes / GiB:.2f} GiB{context}{free}; use a smaller --batch or --max-context") from None


# The fused MLP's grid in batch 1's slack candidates: sized for this many fewer SMs, the two that the predictor's
# top-k CTAs (one per part, 1024 threads each) hold whole on the side stream (benchmarks/RESULTS.md, session 15).
MLP_GRID_SLACK = 2

FOLDS = {"none": (), "0": (), "mlp": ("mlp",), "attn": ("attn",), "all": ("attn", "mlp"), "1": ("attn", "mlp")}
FOLD_AUTO = "auto"


def resolve_fold_norms(fold_norms, ops, *, dense: bool, batch: int):
    """Which norms the sparse decode folds into the op after them (benchmarks/RESULTS.md, sessions 7, 12, 14).

    None: $DEJAVU_FOLD_NORMS (none | mlp | attn | all | auto), default "mlp" at batch 2-4 and "auto" at batch 1;
    True / False: all / none; "auto" is also accepted. Only where the op backend can (the kernels) and at
    batch <= 4, where the partial-sum reductions write the statistics (above it a separate read-back kernel
    would, measured slower). Folding attn_norm too measured slower (the attention's first kernel carries the
    predictor's join). Returns a tuple, or FOLD_AUTO: at batch 1 whether folding mlp_norm pays depends on the
    shape (session 14: faster at d = 576-4608 and 6144, slower at OPT-13B's 5120, where the predictor's side
    stream loses the norm kernel's window), so the executor times both graphs when it captures and keeps the
    faster one (Executor._capture)."""
    if fold_norms is None:
        key = os.environ.get("DEJAVU_FOLD_NORMS", "mlp" if batch > 1 else FOLD_AUTO)
        if key not in FOLDS and key != FOLD_AUTO:
            raise DejaVuError(f"DEJAVU_FOLD_NORMS={key!r}: use one of {', '.join(FOLDS)}, {FOLD_AUTO}")
        fold_norms = key if key == FOLD_AUTO else FOLDS[key]
    elif fold_norms is True or fold_norms is False:
        fold_norms = FOLDS["all"] if fold_norms else ()
    if dense or batch > 4 or not getattr(ops, "folds_norms", False):
        return ()
    if fold_norms == FOLD_AUTO:
        return FOLD_AUTO if batch == 1 else FOLDS["mlp"]
    return tuple(sorted(set(fold_norms)))


class Executor:
    def __init__(self, weights: DecoderWeights, *, dense: bool = False, ops: str = "auto", batch: int = 1,
                 max_context: int | None = None, side_stream: bool = True, cuda_graph: bool = True,
                 kv_policy: str | None = None, fold_norms: bool | None = None,
                 predictor_priority: str | None = None, mlp_grid_slack: int | None = None):
        cfg = weights.config
        if not 1 <= batch <= min(cfg.max_batch, MAX_BATCH):
            raise DejaVuError(f"batch {batch} is outside 1..{min(cfg.max_batch, MAX_BATCH)} (the engine's maximum); "
                              f"use a smaller --batch")
        self.w = weights
        self.device = weights.device
        self.cuda = self.device.type == "cuda"
        if ops == "auto" and not self.cuda:
            ops = "reference"
        self.ops = make_ops(ops)
        self.batch = batch
        self.T = int(max_context or cfg.max_context)
        if weights.rope is not None and weights.rope[0].shape[0] < self.T:
            raise DejaVuError(f"max context {self.T} exceeds the RoPE table ({weights.rope[0].shape[0]}) "
                              f"these weights were loaded with")
        self.dense = dense
        if dense and self.cuda:
            weights.add_dense_layout()
        self.use_graph = cuda_graph and self.cuda
        stream = None
        if side_stream and self.cuda and not dense:
            # The predictor's side stream at high priority: the block scheduler then places its CTAs ahead of
            # the main stream's, whose next kernel is always waiting to become resident (programmatic dependent
            # launch). With mlp_norm folded, the layer has no one-CTA kernel left between the attention and
            # the MLP where the predictor's kernels found room: 3.04 vs 3.11 ms/token at normal priority
            # (benchmarks/RESULTS.md, session 7). DEJAVU_PREDICTOR_PRIORITY=normal for A/B runs.
            prio = predictor_priority or os.environ.get("DEJAVU_PREDICTOR_PRIORITY", "high")
            if prio not in ("high", "normal"):
                raise DejaVuError(f"DEJAVU_PREDICTOR_PRIORITY={prio!r}: use high or normal")
            stream = torch.cuda.Stream(device=self.device, priority=-1 if prio == "high" else 0)
        fold = resolve_fold_norms(fold_norms, self.ops, dense=dense, batch=batch)
        # auto (batch 1): decode unfolded until the graph is captured, then capture the step variants too
        # (mlp_norm folded or not, the fused MLP's grid leaving the predictor's SMs free or not) and keep the
        # fastest; without a graph (eager steps are bound by the host) it stays unfolded on the whole device
        self.fold_auto = fold == FOLD_AUTO and self.use_graph
        self.fold_norms = () if fold == FOLD_AUTO else fold
        # None: the library's setting (0 unless DJV_MLP_SLACK says otherwise); an int pins it for this executor
        self.mlp_grid_slack = mlp_grid_slack
        if mlp_grid_slack is not None and not hasattr(self.ops, "set_mlp_grid_slack"):
            raise DejaVuError(f"mlp_grid_slack needs the CUDA kernels (ops {self.ops.name!r} has no fused MLP)")
        self.step_choice: dict | None = None  # what the auto choice measured (ms per step per candidate)
        self._pending_choice_key: str | None = None  # where a fresh choice goes in the machine's cache
        if self.fold_norms:
            weights.add_folded_norms(self.fold_norms)
        self.decoder = Decoder(weights, self.ops, dense=dense, kv_policy=kv_policy, side_stream=stream,
                               fold_norms=self.fold_norms)
        d = weights.dims
        shape = (batch, d.num_kv_heads, self.T, d.head_dim)
        ctx = (f" (KV cache of {d.num_layers} layers x 2 for batch {batch} x context {self.T}; "
               f"weights {weights.nbytes / GiB:.2f} GiB already placed)")
        self.k_caches = [allocate(shape, weights.dtype, self.device, "the KV cache", ctx) for _ in range(d.num_layers)]
        self.v_caches = [allocate(shape, weights.dtype, self.device, "the KV cache", ctx) for _ in range(d.num_layers)]
        self.tokens = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.position = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.logits: torch.Tensor | None = None
        self.pos_host = 0
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)

    # --- prompt -------------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, P] (or [P]) -> last-position logits [B, V]; the next decode step starts at slot P."""
        tokens = tokens.to(self.device)
        if tokens.ndim == 1:
            tokens = tokens[None].expand(self.batch, -1)
        if tokens.shape[0] != self.batch:
            raise DejaVuError(f"prompt batch {tokens.shape[0]} does not match the executor's batch {self.batch}")
        P = tokens.shape[1]
        if P < 1:
            raise DejaVuError("the prompt is empty: give at least one token")
        if P >= self.T:
            raise DejaVuError(f"the prompt has {P} tokens but the context holds {self.T} (prompt plus generated "
                              f"tokens): shorten the prompt or raise --max-context")
        with torch.inference_mode():
            logits = self.decoder.prefill(tokens, self.k_caches, self.v_caches)
            self.tokens.copy_(logits.argmax(-1))
            self.position.fill_(P)
        self.pos_host = P
        return logits

    # --- decode -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _kernel_setting(self, setter: str, value):
        """The kernels' process-wide setting `setter` (an ops method returning the previous value) at `value`
        while this executor enqueues kernels (a graph keeps what it captured); untouched when value is None
        or the ops have no such setting (the torch and reference ops)."""
        set_value = getattr(self.ops, setter, None)
        if value is None or set_value is None:
            yield
            return
        prev = set_value(value)
        try:
            yield
        finally:
            set_value(prev)

    def _grid_slack(self, sms: int | None):
        """The fused MLP's grid slack (the constructor refuses a pinned slack without the kernels)."""
        return self._kernel_setting("set_mlp_grid_slack", sms)

    def _indices_ready(self):
        """The kernels' promise that each op's indices were written two kernels or more before it: the decode
        step joins every predictor before the norm kernel that precedes the op that reads its indices, so
        the ops' first kernels may read indices and first weight rows before their launch wait."""
        return self._kernel_setting("set_indices_ready", True)

    def _step_body(self) -> None:
        with self._grid_slack(self.mlp_grid_slack), self._indices_ready():
            self._decode_into_buffers()

    def _decode_into_buffers(self) -> None:
        logits = self.decoder.decode_step(self.tokens, self.position, self.k_caches, self.v_caches)
        if self.logits is None:
            self.logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        self.ops.greedy_tail(logits, self.logits, self.tokens, self.position)  # logits, argmax, position + 1

    def step(self, tokens: torch.Tensor | None = None, *, eager: bool = False) -> torch.Tensor:
        """One decode step for the tokens in the buffer (greedy continuation by default, or `tokens`).

        Returns the logits [B, V]; afterwards the token buffer holds their argmax and the position is
        one further, so repeated calls decode greedily without any host round trip.
        """
        if self.pos_host >= self.T:
            raise DejaVuError(f"the context of {self.T} tokens is full: generate fewer tokens or raise --max-context")
        if tokens is not None:
            tokens = torch.as_tensor(tokens).reshape(self.batch)
            V = self.w.embed.shape[0]
            if not tokens.is_cuda and bool(((tokens < 0) | (tokens >= V)).any()):  # the embedding kernel would give NaN
                raise DejaVuError(f"token ids {tokens.tolist()} are outside the vocabulary of {V}")
            self.tokens.copy_(tokens.to(self.device))
        with torch.inference_mode():
            if self.use_graph and not eager:
                if self.graph is None:
                    self._capture()
                self.graph.replay()
            else:
                self._step_body()
        self.pos_host += 1
        return self.logits

    def _capture(self) -> None:
        """Capture one decode step. The step is idempotent for the same token and position (it rewrites the
        same cache slot), so the warm-up runs are undone by resetting the buffers before capture."""
        tok0, pos0 = self.tokens.clone(), self.position.clone()
        if self.fold_auto:
            self._adopt_cached_choice()  # a choice timed before on this machine: capture only that variant
        # auto: the trial replays of the graph that loses may write cache entries the kept one does not
        # (another head selection after a rounding difference); the slot is restored before the kept replay
        slot = ([c[:, :, self.pos_host].clone() for c in self.k_caches + self.v_caches] if self.fold_auto else None)
        self.graph = self._capture_step(tok0, pos0)
        if self.fold_auto:
            self.fold_auto = False
            self._choose_step(tok0, pos0)
            for c, saved in zip(self.k_caches + self.v_caches, slot):
                c[:, :, self.pos_host].copy_(saved)

    def _capture_step(self, tok0: torch.Tensor, pos0: torch.Tensor) -> torch.cuda.CUDAGraph:
        warm = torch.cuda.Stream(device=self.device)
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(2):
                self.tokens.copy_(tok0)
                self.position.copy_(pos0)
                self._step_body()
        torch.cuda.current_stream().wait_stream(warm)
        self.tokens.copy_(tok0)
        self.position.copy_(pos0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step_body()
        return graph

    def _slack_candidates(self) -> bool:
        """Whether batch 1's choice also times the fused MLP's grid with MLP_GRID_SLACK SMs left free: only
        the sm_90 fused MLP has that grid, and only a side stream's predictor can use the room."""
        return (self.mlp_grid_slack is None and hasattr(self.ops, "set_mlp_grid_slack")
                and self.decoder.side_stream is not None
                and torch.cuda.get_device_capability(self.device)[0] >= 9)

    def _variants(self, only: str | None = None) -> tuple[dict, str | None]:
        """Batch 1's candidates, name -> (decoder, folds, grid slack): mlp_norm unfolded ("none") or folded
        ("mlp"), each also with the fused MLP's grid MLP_GRID_SLACK SMs short ("+slack2"). Which is fastest
        depends on the shape (benchmarks/RESULTS.md, sessions 14-15). The folded weight copies live in a private
        view of the weights, so they are freed when an unfolded candidate wins and other executors sharing
        these weights never see them. `only`: build just that candidate (a cached choice). Also returns why
        mlp_norm cannot be folded, if it cannot."""
        plain_decoder = self.decoder
        pinned = self.mlp_grid_slack  # None unless the caller pinned it (then no slack candidates)
        slack = f"+slack{MLP_GRID_SLACK}"
        out = {"none": (plain_decoder, (), pinned)}
        reason = None
        folded_decoder = None
        if only is None or only.startswith("mlp"):
            w = self.w
            extra = w.folded_norm_bytes(("mlp",))
            free, _ = torch.cuda.mem_get_info(self.device)
            if extra > free // 2:  # the copies must not crowd out the KV cache or other executors
                reason = f"folded copies ({extra / GiB:.2f} GiB) exceed half the free memory ({free / GiB:.2f} GiB)"
            else:
                view = dataclasses.replace(w, layers=[type(lw)(lw) for lw in w.layers])
                view.add_folded_norms(("mlp",))
                folded_decoder = copy.copy(plain_decoder)  # same ops object (tests may wrap it), same side stream
                folded_decoder.w, folded_decoder.fold_norms = view, frozenset(("mlp",))
                out["mlp"] = (folded_decoder, ("mlp",), pinned)
        if self._slack_candidates():
            out["none" + slack] = (plain_decoder, (), MLP_GRID_SLACK)
            if folded_decoder:
                out["mlp" + slack] = (folded_decoder, ("mlp",), MLP_GRID_SLACK)
        return out, reason

    def _choice_key(self) -> str:
        """What batch 1's timings depend on (choice_cache): device, kernel library, shape, kept counts, context
        and this executor's settings; the environment is added by choice_key."""
        from .. import kernels
        props = torch.cuda.get_device_properties(self.device)
        dec = self.decoder
        lib = kernels.library_path()
        return choice_cache.choice_key({
            "device": [props.name, props.multi_processor_count, props.major, props.minor, props.total_memory],
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "library": choice_cache.file_digest(lib) if lib.exists() else None,
            "ops": self.ops.name, "dims": dataclasses.asdict(self.w.dims), "dtype": str(self.w.dtype),
            "kept": list(dec.kept), "kept_heads": list(dec.kept_heads), "kv_policy": dec.kv_policy,
            "block": dec.block, "context": self.T, "batch": self.batch, "pinned_slack": self.mlp_grid_slack,
            "side_stream": None if dec.side_stream is None else dec.side_stream.priority,
            "grid_slack_candidate": MLP_GRID_SLACK,
        })

    def _adopt_cached_choice(self) -> None:
        key = self._choice_key()
        names = ["none", "mlp", f"none+slack{MLP_GRID_SLACK}", f"mlp+slack{MLP_GRID_SLACK}"]
        entry = choice_cache.lookup(key, names if self._slack_candidates() else names[:2])
        if entry is None:
            self._pending_choice_key = key
            return
        variants, reason = self._variants(only=entry["chosen"])
        if entry["chosen"] not in variants:  # e.g. folding no longer fits in memory: time afresh
            self._pending_choice_key = key
            return
        self.decoder, self.fold_norms, self.mlp_grid_slack = variants[entry["chosen"]]
        self.fold_auto = False
        self.step_choice = {"chosen": entry["chosen"], "ms_per_step": entry["ms_per_step"],
                            "cached": str(choice_cache.cache_path())}

    def _choose_step(self, tok0: torch.Tensor, pos0: torch.Tensor, rounds: int = 3, reps: int = 8) -> None:
        """Batch 1's timed choice among _variants(): each is captured as its own graph and all are timed
        alternately, each replay from the same token and position, so the cache ends as one step of the kept
        graph leaves it. The result is stored in the machine's choice cache (choice_cache)."""
        variants, reason = self._variants()
        candidates = {"none": (self.graph, *variants.pop("none"))}  # name -> (graph, decoder, folds, slack)
        for name, (decoder, folds, slack) in variants.items():
            self.decoder = decoder
            with self._grid_slack(slack):
                candidates[name] = (self._capture_step(tok0, pos0), decoder, folds, slack)
        times: dict[str, list[float]] = {name: [] for name in candidates}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for r in range(rounds + 1):  # round 0 warms them up
            for name, (graph, *_rest) in candidates.items():
                self.tokens.copy_(tok0)
                self.position.copy_(pos0)
                graph.replay()
                start.record()
                for _ in range(reps):
                    self.tokens.copy_(tok0)
                    self.position.copy_(pos0)
                    graph.replay()
                end.record()
                end.synchronize()
                if r:
                    times[name].append(start.elapsed_time(end) / reps)
        best = {k: min(v) for k, v in times.items()}
        chosen = min(best, key=best.get)
        self.step_choice = {"chosen": chosen, "ms_per_step": {k: round(v, 4) for k, v in best.items()}}
        if reason:
            self.step_choice["reason"] = f"mlp_norm not folded: {reason}"
        # the losers' graphs, and the folded decoder and weight view when unfolded wins, go out of scope here
        self.graph, self.decoder, self.fold_norms, self.mlp_grid_slack = candidates[chosen]
        # the kept graph runs last from (tok0, pos0): the buffers and the cache slot are as after a capture
        self.tokens.copy_(tok0)
        self.position.copy_(pos0)
        key = self._pending_choice_key
        if key is not None and not reason:  # a memory-forced choice is not the machine's choice
            choice_cache.store(key, self.step_choice)

    def timed_steps(self, n: int) -> list[float]:
        """Run n greedy steps back to back; milliseconds between consecutive tokens (device events on CUDA)."""
        if self.pos_host + n + 1 > self.T:
            raise DejaVuError(f"{n} steps from position {self.pos_host} overflow the context of {self.T}")
        if not self.cuda:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                self.step()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        self.step()  # capture outside the timed region
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            self.step()
            events[i + 1].record()
        torch.cuda.synchronize(self.device)
        return [events[i].elapsed_time(events[i + 1]) for i in range(n)]
