"""One adapter per model family: dimensions, and where the MLP and attention weights live.

Everything downstream (calibration, predictors, sparse reference, export, kernels) asks the
adapter instead of poking at HF module names, so adding a family means adding one class here.

Weights are returned in the op contract's layouts (docs/ops.md): MLP weights neuron-major
(`w_up`/`w_gate` [N, d], `w_down_t` [N, d]); attention weights head-major (`w_q` [H*hd, d],
`w_o_t` [H*hd, d] = o_proj.weight.T), with zero biases where the family has none.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..errors import DejaVuError


@dataclass(frozen=True)
class ModelDims:
    family: str               # "opt" | "llama"
    num_layers: int
    hidden_size: int          # d
    intermediate_size: int    # N, MLP neurons per layer
    num_heads: int            # H
    num_kv_heads: int         # Hkv (== H for OPT)
    head_dim: int             # hd
    vocab_size: int
    max_position: int
    activation: str           # "relu" | "gelu" | "silu_glu" (contract names)
    norm: str                 # "layernorm" | "rmsnorm"
    norm_eps: float
    rope_theta: float | None  # None: learned absolute positions (OPT)
    tie_word_embeddings: bool

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def mlp_params_per_layer(self) -> int:
        mats = 3 if self.activation == "silu_glu" else 2
        return mats * self.hidden_size * self.intermediate_size

    @property
    def attn_params_per_layer(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        return 2 * d * self.num_heads * hd + 2 * d * self.num_kv_heads * hd


@dataclass
class MLPWeights:
    activation: str
    w_up: torch.Tensor                 # [N, d]
    w_down_t: torch.Tensor             # [N, d]
    w_gate: torch.Tensor | None = None  # [N, d] (silu_glu)
    b_up: torch.Tensor | None = None    # [N]    (relu/gelu)
    b_down: torch.Tensor | None = None  # [d]    (relu/gelu)


@dataclass
class AttentionWeights:
    w_q: torch.Tensor    # [H*hd, d]
    w_k: torch.Tensor    # [Hkv*hd, d]
    w_v: torch.Tensor    # [Hkv*hd, d]
    w_o_t: torch.Tensor  # [H*hd, d]
    b_q: torch.Tensor    # [H*hd]
    b_k: torch.Tensor    # [Hkv*hd]
    b_v: torch.Tensor    # [Hkv*hd]
    b_o: torch.Tensor    # [d]
    scale: float


def _bias(linear: nn.Linear) -> torch.Tensor:
    if linear.bias is not None:
        return linear.bias.detach()
    return torch.zeros(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device)


class FamilyAdapter:
    """Base class; see OPTAdapter and LlamaAdapter."""

    family = ""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config

    # --- structure -------------------------------------------------------------------------
    def dims(self) -> ModelDims:
        raise NotImplementedError

    def layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def embed_tokens(self) -> nn.Embedding:
        raise NotImplementedError

    def attention(self, i: int) -> nn.Module:
        return self.layers()[i].self_attn

    def attn_norm(self, i: int) -> nn.Module:
        """Norm applied to the residual stream before attention."""
        raise NotImplementedError

    def mlp_norm(self, i: int) -> nn.Module:
        """Norm applied to the residual stream before the MLP."""
        raise NotImplementedError

    def mlp_input_module(self, i: int) -> nn.Module:
        """A module whose input is the (normalised) MLP input x."""
        raise NotImplementedError

    def mlp_down(self, i: int) -> nn.Linear:
        """The down projection; its input is the per-neuron activation a [.., N].

        Zeroing entries of that input is exactly "neuron skipped" (the down bias stays).
        """
        raise NotImplementedError

    def attn_out(self, i: int) -> nn.Linear:
        """The output projection; its input is the concatenated head outputs [.., H*hd].

        Zeroing a head's slice of that input is exactly "head skipped" (the output bias stays).
        """
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    # --- weights in contract layout ---------------------------------------------------------
    def mlp_weights(self, i: int) -> MLPWeights:
        raise NotImplementedError

    def attention_weights(self, i: int) -> AttentionWeights:
        a = self.attention(i)
        return AttentionWeights(
            w_q=a.q_proj.weight.detach(), w_k=a.k_proj.weight.detach(), w_v=a.v_proj.weight.detach(),
            w_o_t=self.attn_out(i).weight.detach().T.contiguous(),
            b_q=_bias(a.q_proj), b_k=_bias(a.k_proj), b_v=_bias(a.v_proj), b_o=_bias(self.attn_out(i)),
            scale=float(a.scaling))


class OPTAdapter(FamilyAdapter):
    """OPT: fc1 -> ReLU -> fc2, multi-head attention, learned positions (offset 2), LayerNorm."""

    family = "opt"

    def __init__(self, model):
        super().__init__(model)
        c = self.config
        if getattr(c, "word_embed_proj_dim", c.hidden_size) != c.hidden_size:
            raise DejaVuError("OPT variants with project_in/project_out (opt-350m) are not supported yet")
        if not getattr(c, "do_layer_norm_before", True):
            raise DejaVuError("OPT variants with post-layer norm (opt-350m) are not supported yet")

    def dims(self):
        c = self.config
        act = {"relu": "relu", "gelu": "gelu"}.get(c.activation_function)
        if act is None:
            raise DejaVuError(f"OPT activation {c.activation_function!r} is not supported (relu, gelu)")
        return ModelDims("opt", c.num_hidden_layers, c.hidden_size, c.ffn_dim, c.num_attention_heads,
                         c.num_attention_heads, c.hidden_size // c.num_attention_heads, c.vocab_size,
                         c.max_position_embeddings, act, "layernorm", 1e-5, None,
                         bool(getattr(c, "tie_word_embeddings", True)))

    def _decoder(self):
        return self.model.model.decoder

    def layers(self):
        return list(self._decoder().layers)

    def embed_tokens(self):
        return self._decoder().embed_tokens

    def embed_positions(self):
        return self._decoder().embed_positions

    def attn_norm(self, i):
        return self.layers()[i].self_attn_layer_norm

    def mlp_norm(self, i):
        return self.layers()[i].final_layer_norm

    def mlp_input_module(self, i):
        return self.layers()[i].fc1

    def mlp_down(self, i):
        return self.layers()[i].fc2

    def attn_out(self, i):
        return self.layers()[i].self_attn.out_proj

    def final_norm(self):
        return self._decoder().final_layer_norm

    def mlp_weights(self, i):
        layer = self.layers()[i]
        return MLPWeights(self.dims().activation, w_up=layer.fc1.weight.detach(),
                          w_down_t=layer.fc2.weight.detach().T.contiguous(),
                          b_up=_bias(layer.fc1), b_down=_bias(layer.fc2))


class LlamaAdapter(FamilyAdapter):
    """LLaMA: SwiGLU gate/up/down, GQA, RoPE (rotate_half), RMSNorm."""

    family = "llama"

    def dims(self):
        c = self.config
        if c.hidden_act not in ("silu", "swish"):
            raise DejaVuError(f"LLaMA-family activation {c.hidden_act!r} is not supported (silu)")
        rope = getattr(c, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise DejaVuError(f"RoPE scaling {rope.get('rope_type')!r} is not supported yet (default RoPE only)")
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return ModelDims("llama", c.num_hidden_layers, c.hidden_size, c.intermediate_size,
                         c.num_attention_heads, c.num_key_value_heads, hd, c.vocab_size,
                         c.max_position_embeddings, "silu_glu", "rmsnorm", float(c.rms_norm_eps),
                         float(theta), bool(getattr(c, "tie_word_embeddings", False)))

    def layers(self):
        return list(self.model.model.layers)

    def embed_tokens(self):
        return self.model.model.embed_tokens

    def attn_norm(self, i):
        return self.layers()[i].input_layernorm

    def mlp_norm(self, i):
        return self.layers()[i].post_attention_layernorm

    def mlp_input_module(self, i):
        return self.layers()[i].mlp

    def mlp_down(self, i):
        return self.layers()[i].mlp.down_proj

    def attn_out(self, i):
        return self.layers()[i].self_attn.o_proj

    def final_norm(self):
        return self.model.model.norm

    def mlp_weights(self, i):
        mlp = self.layers()[i].mlp
        if mlp.gate_proj.bias is not None:
            raise DejaVuError("LLaMA-family MLPs with biases are not supported")
        return MLPWeights("silu_glu", w_up=mlp.up_proj.weight.detach(),
                          w_down_t=mlp.down_proj.weight.detach().T.contiguous(),
                          w_gate=mlp.gate_proj.weight.detach())

    def rope_tables(self, max_len: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_len, hd/2] in the contract's rotate_half convention."""
        dims = self.dims()
        inv = 1.0 / (dims.rope_theta ** (torch.arange(0, dims.head_dim, 2, dtype=torch.float64) / dims.head_dim))
        ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
        return ang.cos().to(dtype), ang.sin().to(dtype)


_FAMILIES = {"opt": OPTAdapter, "llama": LlamaAdapter, "mistral": LlamaAdapter}


def family_of(config) -> str:
    mt = getattr(config, "model_type", None)
    if mt not in _FAMILIES:
        raise DejaVuError(f"model type {mt!r} is not supported; supported families: OPT, LLaMA")
    return _FAMILIES[mt].family


def adapter_for(model: nn.Module) -> FamilyAdapter:
    family_of(model.config)
    return _FAMILIES[model.config.model_type](model)
