"""The decoder described by an engine package, as functions over its tensors.

Prefill is dense (every neuron and head). A decode step is sparse: before layer l runs, the
lookahead predictor for layer l+1 reads layer l's input (layer 0's and layer 1's predictors read
the embeddings), so on a GPU it runs on a side stream while layer l runs, joined by an event.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import DejaVuError
from ..models.adapters import ModelDims
from ..models.loading import parse_dtype
from .ops import LayerWeights
from .package import EngineConfig, EnginePackage

_LAYER_KEYS = ("attn_norm.weight", "attn_norm.bias", "mlp_norm.weight", "mlp_norm.bias", "w_q", "w_k", "w_v",
               "w_o_t", "b_q", "b_k", "b_v", "b_o", "w_up", "w_gate", "w_down_t", "b_up", "b_down",
               "mlp_a", "mlp_b", "head_a", "head_b")


@dataclass
class DecoderWeights:
    """Tensors of one engine on one device in one dtype; shared by dense and sparse executors."""

    config: EngineConfig
    dims: ModelDims
    device: torch.device
    dtype: torch.dtype
    embed: torch.Tensor
    positions: torch.Tensor | None
    final_norm: tuple
    lm_head: torch.Tensor
    layers: list[LayerWeights]
    rope: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0
        tensors = [self.embed, self.lm_head, self.positions, *self.final_norm]
        tensors += [t for lw in self.layers for t in lw.values()]
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    @classmethod
    def from_tensors(cls, config: EngineConfig, weights: dict, predictors: dict, device="cpu",
                     dtype: str | torch.dtype | None = None, max_context: int | None = None) -> "DecoderWeights":
        dims = config.model_dims
        dev = torch.device(device)
        dt = parse_dtype(dtype or config.dtype)
        put = lambda t: None if t is None else t.to(device=dev, dtype=dt).contiguous()  # noqa: E731
        layers = []
        for i in range(dims.num_layers):
            src = {**{k: v for k, v in weights.items() if k.startswith(f"layers.{i}.")},
                   **{k: v for k, v in predictors.items() if k.startswith(f"layers.{i}.")}}
            layers.append(LayerWeights({k: put(src.get(f"layers.{i}.{k}")) for k in _LAYER_KEYS}))
        embed = put(weights["embed_tokens"])
        lm_head = put(weights["lm_head"]) if "lm_head" in weights else embed
        rope = None
        if dims.rope_theta is not None:
            T = max_context or config.max_context
            hd = dims.head_dim
            inv = 1.0 / (dims.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
            ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
            rope = (ang.cos().float().to(dev), ang.sin().float().to(dev))
        return cls(config, dims, dev, dt, embed, put(weights.get("embed_positions")),
                   (put(weights["final_norm.weight"]), put(weights.get("final_norm.bias"))), lm_head, layers, rope)

    def add_dense_layout(self) -> None:
        """HF-layout copies of the down and output projections ([d, N], [d, H*hd]) for the dense baseline,
        whose cuBLAS GEMVs are fastest in that layout. Costs their bytes once more on the device."""
        for lw in self.layers:
            if lw.get("w_down") is None:
                lw["w_down"] = lw["w_down_t"].T.contiguous()
                lw["w_o"] = lw["w_o_t"].T.contiguous()

    _FOLD_GROUPS = {"mlp": ("mlp_norm", (("w_up", "b_up"), ("w_gate", None))),
                    "attn": ("attn_norm", (("w_q", "b_q"), ("w_k", "b_k"), ("w_v", "b_v")))}

    def folded_norm_bytes(self, which) -> int:
        """Device bytes add_folded_norms(which) would add (copies not made yet)."""
        total = 0
        for name in which:
            for lw in self.layers:
                for wname, bname in self._FOLD_GROUPS[name][1]:
                    for k in (wname, bname):
                        if k and lw.get(k) is not None and lw.get(f"{k}_nf") is None:
                            total += lw[k].numel() * lw[k].element_size()
        return total

    def add_folded_norms(self, which) -> None:
        """Copies of the input-side weights of the ops after a folded norm, with the norm's weight and bias
        folded in (suffix _nf): "mlp" (mlp_norm into w_up, w_gate, b_up) and/or "attn" (attn_norm into w_q,
        w_k, w_v and their biases). The kernels' folded calls normalise their input themselves from row
        statistics the op before wrote, so the decode step launches no norm kernel there. Costs those weights'
        bytes once more on the device."""
        from ..kernels import fold_norm
        for name in which:
            norm, mats = self._FOLD_GROUPS[name]
            for lw in self.layers:
                g, beta = lw[f"{norm}.weight"], lw[f"{norm}.bias"]
                for wname, bname in mats:
                    if lw.get(wname) is None or lw.get(f"{wname}_nf") is not None:
                        continue
                    lw[f"{wname}_nf"], b = fold_norm(lw[wname], g, beta, lw.get(bname) if bname else None)
                    if bname:
                        lw[f"{bname}_nf"] = b

    @classmethod
    def from_package(cls, pkg: EnginePackage, device="cpu", dtype=None, max_context=None) -> "DecoderWeights":
        return cls.from_tensors(pkg.config, pkg.weights, pkg.predictors, device, dtype, max_context)


class Decoder:
    """Prefill and decode-step functions over DecoderWeights with one op backend."""

    def __init__(self, w: DecoderWeights, ops, *, dense: bool = False, kv_policy: str | None = None,
                 side_stream: torch.cuda.Stream | None = None, fold_norms=()):
        self.w, self.ops, self.dense = w, ops, dense
        # norms folded into the sparse op after them ("mlp", "attn"; KernelOps only, after
        # DecoderWeights.add_folded_norms): each op writes its output's row statistics for the next one
        self.fold_norms = frozenset(() if dense else fold_norms)
        self.dims = w.dims
        self.kv_policy = kv_policy or w.config.kv_policy
        self.side_stream = side_stream
        self.kept = w.config.mlp_kept_units
        self.kept_heads = w.config.heads_kept
        self.block = w.config.block_size
        self.record: list | None = None   # set to a list to capture (layer, mlp_input, mlp_idx) for metrics

    # --- pieces ---------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.ops.embed(self.w.embed, self.w.positions, tokens, positions, self.w.config.position_offset)

    def norm(self, x, which: str, lw: LayerWeights | None = None):
        d = self.dims
        if which == "final":
            return self.ops.norm(x, self.w.final_norm[0], self.w.final_norm[1], d.norm, d.norm_eps)
        return self.ops.norm(x, lw[f"{which}.weight"], lw[f"{which}.bias"], d.norm, d.norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits in the weights' dtype."""
        return F.linear(self.norm(h, "final"), self.w.lm_head)

    # --- prefill (dense, whole prompt) ----------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, k_caches, v_caches) -> torch.Tensor:
        """tokens [B, P] -> logits of the last position [B, V]; fills cache slots 0..P-1."""
        B, P = tokens.shape
        d = self.dims
        H, Hkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        pos = torch.arange(P, device=tokens.device)
        h = self.embed(tokens, pos[None, :].expand(B, P))
        for i, lw in enumerate(self.w.layers):
            x = self.norm(h, "attn_norm", lw)
            q = F.linear(x, lw.w_q, lw.b_q).view(B, P, H, hd).transpose(1, 2)
            k = F.linear(x, lw.w_k, lw.b_k).view(B, P, Hkv, hd).transpose(1, 2)
            v = F.linear(x, lw.w_v, lw.b_v).view(B, P, Hkv, hd).transpose(1, 2)
            if self.w.rope is not None:
                from ..ops.reference import apply_rope
                cos, sin = self.w.rope[0][:P], self.w.rope[1][:P]
                q, k = apply_rope(q, cos, sin).to(x.dtype), apply_rope(k, cos, sin).to(x.dtype)
            k_caches[i][:, :, :P] = k.to(k_caches[i].dtype)
            v_caches[i][:, :, :P] = v.to(v_caches[i].dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.w.config.attention_scale[i],
                                               enable_gqa=H != Hkv)
            h = h + F.linear(o.transpose(1, 2).reshape(B, P, H * hd), lw.w_o_t.T, lw.b_o)
            x = self.norm(h, "mlp_norm", lw)
            h = h + self.ops.dense_mlp(x.reshape(B * P, -1), lw, d.activation, self.block).view(B, P, -1)
        return self.logits(h[:, -1])

    # --- decode step ----------------------------------------------------------------------------
    def _predict(self, layer: int, h: torch.Tensor, out: list):
        lw = self.w.layers[layer]
        out[layer] = self.ops.predictor(h, lw, self.kept[layer], self.kept_heads[layer])

    def decode_step(self, tokens: torch.Tensor, position: torch.Tensor, k_caches, v_caches) -> torch.Tensor:
        """tokens [B], position [B] int32 -> logits [B, V] in the weights' dtype (the executor's greedy tail
        converts them); writes cache slot `position`."""
        d = self.dims
        L = d.num_layers
        h = self.embed(tokens, position)
        rope = self.w.rope
        idx: list = [None] * L
        events: list = [None] * L
        inputs = [h]  # kept alive for the whole step: the side stream may still be reading them
        ctx = self.ops.step_context(position, k_caches[0].shape[2], rope)
        sparse = not self.dense
        if sparse:
            self._predict(0, h, idx)
            if L > 1:
                events[1] = self._launch_predictor(1, h, idx)
        fold_attn, fold_mlp = "attn" in self.fold_norms, "mlp" in self.fold_norms
        h_stats = self.ops.row_stats(h) if fold_attn else None  # layer 0's input; later ones from the MLP
        for i, lw in enumerate(self.w.layers):
            if sparse and i >= 1 and i + 1 < L:
                events[i + 1] = self._launch_predictor(i + 1, h, idx)  # reads layer i's input
            if events[i] is not None:
                torch.cuda.current_stream().wait_event(events[i])
            scale = self.w.config.attention_scale[i]
            akw = dict(dims=d, scale=scale, rope=rope, kv_policy=self.kv_policy, ctx=ctx)
            if not sparse:
                x = self.norm(h, "attn_norm", lw)
                h = h + self.ops.dense_attention(x, position, lw, k_caches[i], v_caches[i], dims=d, scale=scale,
                                                 rope=rope, ctx=ctx)
                h = h + self.ops.dense_mlp(self.norm(h, "mlp_norm", lw), lw, d.activation, self.block)
                inputs.append(h)
                continue
            # h + op(x): the kernels fuse the residual add (a new tensor: the side stream reads h)
            mlp_idx, head_idx = idx[i]
            a_stats = {"y_stats": self.ops.empty_stats(h)} if fold_mlp else {}
            if fold_attn:  # the attention normalises h itself, from the row statistics of the op before
                h = self.ops.attention_residual_folded(h, h_stats, head_idx, position, lw, k_caches[i], v_caches[i],
                                                       norm_kind=d.norm, eps=d.norm_eps, **akw, **a_stats)
            else:
                h = self.ops.attention_residual(h, self.norm(h, "attn_norm", lw), head_idx, position, lw,
                                                k_caches[i], v_caches[i], **akw, **a_stats)
            m_stats = {"y_stats": self.ops.empty_stats(h)} if fold_attn and i + 1 < L else {}
            if fold_mlp:  # likewise the MLP, from the attention's statistics
                if self.record is not None:
                    self.record.append((i, self.norm(h, "mlp_norm", lw), mlp_idx))
                h = self.ops.mlp_residual_folded(h, a_stats["y_stats"], mlp_idx, lw, d.activation, self.block,
                                                 d.norm, d.norm_eps, **m_stats)
            else:
                x = self.norm(h, "mlp_norm", lw)
                if self.record is not None:
                    self.record.append((i, x, mlp_idx))
                h = self.ops.mlp_residual(h, x, mlp_idx, lw, d.activation, self.block, **m_stats)
            h_stats = m_stats.get("y_stats")
            inputs.append(h)
        return self.lm_head(h)

    def _launch_predictor(self, layer: int, h: torch.Tensor, idx: list):
        """Predictor for `layer` on the side stream (or inline when there is none); returns the join event."""
        if self.side_stream is None:
            self._predict(layer, h, idx)
            return None
        main = torch.cuda.current_stream()
        self.side_stream.wait_stream(main)
        with torch.cuda.stream(self.side_stream):
            self._predict(layer, h, idx)
            ev = torch.cuda.Event()
            ev.record(self.side_stream)
        return ev


def check_dense_shapes(dims: ModelDims) -> None:
    if dims.num_heads % dims.num_kv_heads:
        raise DejaVuError(f"{dims.num_heads} heads are not a multiple of {dims.num_kv_heads} KV heads")
