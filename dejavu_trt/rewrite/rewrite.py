"""`rewrite`: dense decode graph -> plugin graph (onnx-graphsurgeon).

Per layer i of `export/NAME/decode.onnx`:

* the nodes named `layers.{i}.mlp/*` (checked against the exporter's own pattern) become one
  `dejavu_trt::DejaVuSparseMLP` node named `layers.{i}.mlp`, with the weights re-laid out
  neuron-major (`w_up`/`w_gate` [N, d] = transposed MatMul weights, `w_down_t` [N, d]);
* the nodes named `layers.{i}.attn/*` become `DejaVuHeadSparseAttention` (`layers.{i}.attn`), which
  reads and writes the same `past_*`/`present_*` caches;
* a `DejaVuLookaheadPredictor` node `layers.{i}.predictor` is added. It reads `hidden.{max(i-1,0)}`
  (the input of layer i-1; the embeddings for layers 0 and 1), so it depends on nothing layer i-1
  computes and TensorRT can run it on an auxiliary stream while layer i-1 runs; it outputs the
  int32 ascending index tensors `layers.{i}.mlp_idx` / `layers.{i}.head_idx`.

Every plugin op ships as an ONNX local function (rewrite/functions.py), so ONNX Runtime runs the
result as it is. Graph inputs and outputs are unchanged.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from ..artifacts import MANIFEST, atomic_file, read_manifest, write_manifest
from ..errors import ArtifactError, DejaVuError
from ..export.config import METADATA_PREFIX, ONNX_IR_VERSION, SUPPORTED_FAMILIES, DecodeConfig
from ..export.emitter import Emitter
from ..export.module import MLP, Attention, predictor_source
from ..export.onnx_graph import emit_dense_attention, emit_dense_mlp
from ..export.stage import DECODE_FILE, EXPORT_KIND, SPARSE_FILE, save_onnx
from ..ops.contract import (HEAD_ATTENTION_OP, KV_POLICIES, OP_CONTRACT_VERSION, PLUGIN_NAMESPACE, PREDICTOR_EPS,
                            PREDICTOR_OP, SPARSE_MLP_OP)
from .functions import (COMMON_ATTRS, head_attention_function, predictor_function, sparse_mlp_function)

log = logging.getLogger(__name__)

# Measured on SmolLM2 (docs/export.md): see the KV-policy section there for the numbers.
DEFAULT_KV_POLICY = "dense"


@dataclass
class KeptCounts:
    """Per-layer kept MLP units and heads, and the MLP selection unit."""

    mlp: list[int]
    heads: list[int]
    block_size: int = 1


# --- loading and checking inputs ----------------------------------------------------------------
def load_onnx(path: str | Path, load_weights: bool = True) -> onnx.ModelProto:
    path = Path(path)
    if not path.is_file():
        raise DejaVuError(f"{path} does not exist; give the decode.onnx written by `dejavu-trt export`")
    try:
        return onnx.load(str(path), load_external_data=load_weights)
    except Exception as e:  # protobuf raises DecodeError, RuntimeWarning-ish errors, ...
        raise DejaVuError(f"{path} is not an ONNX model ({e.__class__.__name__}); give the decode.onnx "
                          f"written by `dejavu-trt export`") from None


def graph_metadata(proto: onnx.ModelProto, path: Path) -> dict:
    meta = {p.key[len(METADATA_PREFIX):]: p.value for p in proto.metadata_props if p.key.startswith(METADATA_PREFIX)}
    if "kind" not in meta or "config" not in meta:
        raise DejaVuError(f"{path} is not a dejavu-trt decode graph (no {METADATA_PREFIX}* metadata): only graphs "
                          f"written by `dejavu-trt export` for the OPT and LLaMA families can be rewritten")
    cfg = json.loads(meta["config"])
    if cfg.get("family") not in SUPPORTED_FAMILIES:
        raise DejaVuError(f"{path} is a graph of the unsupported family {cfg.get('family')!r} "
                          f"(supported: {', '.join(SUPPORTED_FAMILIES)})")
    return meta


def find_workdir(onnx_path: Path, workdir: str | Path | None) -> Path:
    if workdir is not None:
        return Path(workdir)
    mdir = onnx_path.parent
    if (mdir / MANIFEST).is_file():
        wd = read_manifest(mdir, EXPORT_KIND, verify=False).get("config", {}).get("workdir")
        if wd:
            return Path(wd)
    raise DejaVuError(f"{onnx_path} was not exported from a work dir: pass --workdir DIR (a work dir with trained "
                      f"predictors and a sparsity plan)")


def load_predictors(source: str | Path) -> dict[str, torch.Tensor]:
    """Predictor tensors `layers.{l}.mlp_a` ... from a work dir or a predictors.safetensors file."""
    from ..predictors.model import PREDICTORS_FILE, LookaheadPredictors

    source = Path(source)
    if source.is_dir() and not (source / PREDICTORS_FILE).is_file():
        raise ArtifactError(f"{source} has no trained predictors ({PREDICTORS_FILE}); run "
                            f"`dejavu-trt train-predictors {source}` first")
    p = LookaheadPredictors.load(source)
    out = {}
    for l in range(p.num_layers):
        for k in ("mlp_a", "mlp_b", "head_a", "head_b"):
            out[f"layers.{l}.{k}"] = getattr(p, k)[l].float()
    out["__block_size__"] = torch.tensor(p.block_size)
    return out


def check_same_model(workdir: Path, graph_model: str | None) -> None:
    """A work dir calibrated on another model than the graph's is refused (same shapes or not)."""
    from ..export.stage import model_of_workdir

    if not (workdir / MANIFEST).is_file() or not graph_model:
        return  # load_predictors gives the precise error
    wd_model, _ = model_of_workdir(workdir)
    if Path(wd_model).name != Path(graph_model).name:
        raise DejaVuError(f"work dir {workdir} was calibrated on {wd_model}, but the graph is of {graph_model}; "
                          f"pass the work dir of this model")


def check_predictors(pred: dict[str, torch.Tensor], cfg: DecodeConfig, block_size: int) -> None:
    nb = cfg.intermediate_size // block_size
    want = {"mlp_a": (cfg.hidden_size, None), "mlp_b": (None, nb), "head_a": (cfg.hidden_size, None),
            "head_b": (None, cfg.num_heads)}
    for l in range(cfg.num_layers):
        for k, shape in want.items():
            name = f"layers.{l}.{k}"
            if name not in pred:
                raise DejaVuError(f"predictor tensor {name!r} is missing: the predictors do not match this "
                                  f"{cfg.num_layers}-layer graph; re-train them for this model")
            t = pred[name]
            if t.ndim != 2 or any(w is not None and w != s for w, s in zip(shape, t.shape)):
                raise DejaVuError(f"predictor tensor {name!r} has shape {list(t.shape)}, expected "
                                  f"{[s if s is not None else 'r' for s in shape]} for this graph "
                                  f"(d={cfg.hidden_size}, units={nb}, heads={cfg.num_heads})")


def kept_counts(cfg: DecodeConfig, workdir: Path | None, sparsity: float | None, head_sparsity: float | None,
                block_size: int) -> KeptCounts:
    """Fractions given on the command line win; otherwise the work dir's sparsity.json."""
    from ..errors import check_fraction
    from ..sparsity.plan import SparsityPlan, kept_count

    nb = cfg.intermediate_size // block_size
    if sparsity is not None or head_sparsity is not None:
        s, hs = check_fraction("--sparsity", sparsity) or 1.0, check_fraction("--head-sparsity", head_sparsity) or 1.0
        return KeptCounts([kept_count(s, nb)] * cfg.num_layers, [kept_count(hs, cfg.num_heads)] * cfg.num_layers,
                          block_size)
    if workdir is None:
        raise DejaVuError("no sparsity given: pass --sparsity/--head-sparsity or a work dir with sparsity.json")
    plan = SparsityPlan.load(workdir)
    if plan.num_layers < cfg.num_layers or plan.num_units != nb or plan.num_heads != cfg.num_heads:
        raise DejaVuError(f"{workdir}/sparsity.json ({plan.num_layers} layers, {plan.num_units} units, "
                          f"{plan.num_heads} heads) does not match this graph ({cfg.num_layers} layers, {nb} units, "
                          f"{cfg.num_heads} heads); re-run evaluate for this model")
    return KeptCounts(plan.mlp_kept_units[:cfg.num_layers], plan.heads_kept[:cfg.num_layers], plan.block_size)


# --- pattern checks -----------------------------------------------------------------------------
def expected_ops(cfg: DecodeConfig, part: str) -> list[str]:
    """Op types the exporter emits for one layer's `part` ("mlp" | "attn"), from the exporter itself."""
    from ..models.adapters import AttentionWeights

    g = gs.Graph(opset=17)
    e = Emitter(g, "probe")
    x = gs.Variable("x", np.float32)
    d, n, hd = 2, 2, 2
    z = lambda *s: torch.zeros(*s)  # noqa: E731
    if part == "mlp":
        emit_dense_mlp(e, x, MLP(cfg.activation, z(n, d), z(n, d), z(n, d), z(n), z(d)), "probe")
    else:
        w = AttentionWeights(z(cfg.num_heads * hd, d), z(cfg.num_kv_heads * hd, d), z(cfg.num_kv_heads * hd, d),
                             z(cfg.num_heads * hd, d), z(1), z(1), z(1), z(1), 1.0)
        rope = (gs.Constant("c", np.zeros((1, 1), np.float32)), gs.Constant("s", np.zeros((1, 1), np.float32)))
        emit_dense_attention(e, cfg, x, gs.Variable("p", np.int64), gs.Variable("k", np.float32),
                             gs.Variable("v", np.float32), Attention(cfg, w, None, None), rope, "probe")
    return [nd.op for nd in g.nodes]


def check_pattern(nodes: list[gs.Node], expected: list[str], scope: str, what: str) -> None:
    if not nodes:
        raise DejaVuError(f"no nodes named {scope}/* in the graph: expected the dense {what} pattern "
                          f"({' -> '.join(expected)}); was the graph written by `dejavu-trt export`?")
    for k, want in enumerate(expected):
        if k >= len(nodes):
            raise DejaVuError(f"{scope} ends after node {nodes[-1].name!r}, but the {what} pattern expects "
                              f"{len(expected)} nodes ({' -> '.join(expected)})")
        if nodes[k].op != want:
            raise DejaVuError(f"node {nodes[k].name!r} is a {nodes[k].op}, but the {what} pattern expects a {want} "
                              f"there ({' -> '.join(expected)})")
    if len(nodes) > len(expected):
        raise DejaVuError(f"node {nodes[len(expected)].name!r} ({nodes[len(expected)].op}) is not part of the {what} "
                          f"pattern ({' -> '.join(expected)})")


class _Graph:
    """Name lookups over a gs.Graph with DejaVuError for anything missing."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.tensors = graph.tensors()
        self.scopes: dict[str, list[gs.Node]] = {}
        for n in graph.nodes:
            self.scopes.setdefault(n.name.rsplit("/", 1)[0], []).append(n)

    def tensor(self, name: str, what: str) -> gs.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise DejaVuError(f"tensor {name!r} ({what}) is missing from the graph; was it written by "
                              f"`dejavu-trt export` of this version?")
        return t

    def weight(self, name: str, shape: tuple) -> np.ndarray:
        t = self.tensor(name, f"a weight of shape {list(shape)}")
        if not isinstance(t, gs.Constant) or tuple(t.shape) != tuple(shape):
            raise DejaVuError(f"tensor {name!r} should be a constant weight of shape {list(shape)}, got "
                              f"{'a variable' if not isinstance(t, gs.Constant) else list(t.shape)}")
        return np.asarray(t.values, dtype=np.float32)

    def detach(self, scope: str) -> None:
        for n in self.scopes.get(scope, []):
            n.inputs.clear()
            n.outputs.clear()


def _c(name: str, a) -> gs.Constant:
    return gs.Constant(name, np.ascontiguousarray(a, dtype=np.float32))


# --- the rewrite --------------------------------------------------------------------------------
def rewrite_graph(proto: onnx.ModelProto, cfg: DecodeConfig, pred: dict[str, torch.Tensor], kept: KeptCounts,
                  kv_policy: str, path: Path) -> onnx.ModelProto:
    graph = gs.import_onnx(proto)
    if any(n.domain == PLUGIN_NAMESPACE for n in graph.nodes):
        raise DejaVuError(f"{path} is already rewritten (it has {PLUGIN_NAMESPACE} plugin nodes); rewrite the dense "
                          f"decode.onnx instead")
    G = _Graph(graph)
    d, N, H, Hkv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mlp_ops, attn_ops = expected_ops(cfg, "mlp"), expected_ops(cfg, "attn")
    position = G.tensor("position", "graph input")
    if cfg.rotary:
        rope = [G.tensor("rope.cos", "RoPE table"), G.tensor("rope.sin", "RoPE table")]
    else:
        rope = [_c("rope.unused", np.zeros((1, 1)))] * 2
    new_nodes = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        check_pattern(G.scopes.get(f"{p}.mlp", []), mlp_ops, f"{p}.mlp", f"{cfg.family} MLP")
        check_pattern(G.scopes.get(f"{p}.attn", []), attn_ops, f"{p}.attn", f"{cfg.family} attention")

        # Predictor: reads the input of layer i-1, outputs this layer's index sets.
        mlp_idx = gs.Variable(f"{p}.mlp_idx", np.int32, [kept.mlp[i]])
        head_idx = gs.Variable(f"{p}.head_idx", np.int32, [kept.heads[i]])
        new_nodes.append(gs.Node(
            PREDICTOR_OP, f"{p}.predictor", domain=PLUGIN_NAMESPACE,
            attrs={"kept_units": kept.mlp[i], "kept_heads": kept.heads[i], "eps": PREDICTOR_EPS, **COMMON_ATTRS},
            inputs=[G.tensor(f"hidden.{predictor_source(i)}", "residual stream"),
                    *[_c(f"{p}.predictor.{k}", pred[f"{p}.{k}"].numpy()) for k in ("mlp_a", "mlp_b", "head_a", "head_b")]],
            outputs=[mlp_idx, head_idx]))

        # MLP: MatMul layout [in, out] -> neuron-major rows.
        m = f"{p}.mlp"
        if cfg.activation == "silu_glu":
            w = [_c(f"{m}.w_gate", G.weight(f"{m}.w_gate_t", (d, N)).T), _c(f"{m}.w_up", G.weight(f"{m}.w_up_t", (d, N)).T),
                 _c(f"{m}.w_down_t", G.weight(f"{m}.w_down", (N, d)))]
        else:
            w = [_c(f"{m}.w_up", G.weight(f"{m}.w_up_t", (d, N)).T), _c(f"{m}.b_up", G.weight(f"{m}.b_up", (N,))),
                 _c(f"{m}.w_down_t", G.weight(f"{m}.w_down", (N, d))), _c(f"{m}.b_down", G.weight(f"{m}.b_down", (d,)))]
        mlp_in, mlp_out = G.tensor(f"{m}_in", "MLP input"), G.tensor(f"{m}_out", "MLP output")
        G.detach(m)
        new_nodes.append(gs.Node(
            SPARSE_MLP_OP, m, domain=PLUGIN_NAMESPACE,
            attrs={"activation": cfg.activation, "block_size": kept.block_size, "kept_units": kept.mlp[i],
                   "num_neurons": N, **COMMON_ATTRS},
            inputs=[mlp_in, mlp_idx, *w], outputs=[mlp_out]))

        # Attention: MatMul layout -> HF/contract layout; zero biases where the family has none.
        a = f"{p}.attn"
        wq, wk, wv = (G.weight(f"{a}.w_{n}_t", (d, s)).T for n, s in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd)))
        wo = G.weight(f"{a}.w_o_t", (H * hd, d))
        if cfg.family == "opt":
            bq, bk, bv, bo = (G.weight(f"{a}.b_{n}", (s,)) for n, s in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd), ("o", d)))
        else:
            bq, bk, bv, bo = np.zeros(H * hd), np.zeros(Hkv * hd), np.zeros(Hkv * hd), np.zeros(d)
        scale = float(np.asarray(_scale_of(G, a)))
        ins = [G.tensor(f"{a}_in", "attention input"), head_idx, position,
               *[_c(f"{a}.{n}", t) for n, t in zip(("w_q", "w_k", "w_v", "w_o_t", "b_q", "b_k", "b_v", "b_o"),
                                                   (wq, wk, wv, wo, bq, bk, bv, bo))],
               *rope, G.tensor(f"past_key.{i}", "cache input"), G.tensor(f"past_value.{i}", "cache input")]
        outs = [G.tensor(f"{a}_out", "attention output"), G.tensor(f"present_key.{i}", "cache output"),
                G.tensor(f"present_value.{i}", "cache output")]
        G.detach(a)
        new_nodes.append(gs.Node(
            HEAD_ATTENTION_OP, a, domain=PLUGIN_NAMESPACE,
            attrs={"num_heads": H, "num_kv_heads": Hkv, "head_dim": hd, "kept_heads": kept.heads[i],
                   "rotary": int(cfg.rotary), "scale": scale, "kv_policy": kv_policy, **COMMON_ATTRS},
            inputs=ins, outputs=outs))

    # Position i64 was only used by the dense attention and (OPT) the position embedding.
    graph.nodes.extend(new_nodes)
    graph.functions = [predictor_function(), sparse_mlp_function(cfg.activation),
                       head_attention_function(cfg.rotary, kv_policy)]
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    out = gs.export_onnx(graph)
    out.ir_version = ONNX_IR_VERSION
    return out


def _scale_of(G: _Graph, scope: str):
    """The softmax scale is the scalar constant multiplied into the scores (the scope's first scalar Mul)."""
    for n in G.scopes[scope]:
        if n.op == "Mul":
            for t in n.inputs:
                if isinstance(t, gs.Constant) and t.values.size == 1:
                    return t.values
    raise DejaVuError(f"no softmax scale constant in {scope}: the attention pattern is not the exporter's")


def rewrite(onnx_path: str | Path, out: str | Path | None = None, *, workdir: str | Path | None = None,
            predictors: str | Path | None = None, sparsity: float | None = None, head_sparsity: float | None = None,
            kv_policy: str = DEFAULT_KV_POLICY, check: bool = True) -> Path:
    """Rewrite a dense decode graph into plugin nodes; returns the new file's path.

    `predictors` (a work dir or predictors.safetensors) defaults to the work dir; kept counts come
    from the fractions when given, else from the work dir's sparsity.json.
    """
    onnx_path = Path(onnx_path)
    if kv_policy not in KV_POLICIES:
        raise DejaVuError(f"--kv-policy must be one of {', '.join(KV_POLICIES)}, got {kv_policy!r}")
    proto = load_onnx(onnx_path)
    meta = graph_metadata(proto, onnx_path)
    if meta["kind"] != "decode-dense" or any(f.domain == PLUGIN_NAMESPACE for f in proto.functions):
        raise DejaVuError(f"{onnx_path} is already rewritten ({meta['kind']}); rewrite the dense decode.onnx instead")
    cfg = DecodeConfig.from_json(meta["config"])
    wd = Path(workdir) if workdir is not None else None
    if predictors is None:
        wd = find_workdir(onnx_path, workdir)
    if wd is not None:
        check_same_model(wd, meta.get("model"))
    pred = load_predictors(predictors if predictors is not None else wd)
    block_size = int(pred.pop("__block_size__"))
    if cfg.intermediate_size % block_size:
        raise DejaVuError(f"block size {block_size} does not divide the {cfg.intermediate_size} MLP neurons")
    check_predictors(pred, cfg, block_size)
    kept = kept_counts(cfg, wd, sparsity, head_sparsity, block_size)
    if kept.block_size != block_size:
        raise DejaVuError(f"sparsity.json uses block size {kept.block_size} but the predictors {block_size}; "
                          f"re-run evaluate after train-predictors")

    props = {p.key: p.value for p in proto.metadata_props}   # graphsurgeon does not carry them over
    new = rewrite_graph(proto, cfg, pred, kept, kv_policy, onnx_path)
    del proto
    info = {"kv_policy": kv_policy, "block_size": block_size, "mlp_kept_units": kept.mlp, "heads_kept": kept.heads,
            "contract_version": OP_CONTRACT_VERSION, "predictors": str(predictors or wd)}
    props.update({f"{METADATA_PREFIX}kind": "decode-sparse", f"{METADATA_PREFIX}rewrite": json.dumps(info)})
    onnx.helper.set_model_props(new, props)

    out = Path(out) if out else onnx_path.with_name(SPARSE_FILE if onnx_path.name == DECODE_FILE
                                                     else onnx_path.stem + ".sparse.onnx")
    with atomic_file(out) as tmp:
        tmp_onnx = tmp.with_suffix(".onnx")   # the checker wants an .onnx name
        try:
            save_onnx(new, tmp_onnx, data_name=out.name)
            if check:
                onnx.checker.check_model(str(tmp_onnx), full_check=True)
            tmp_onnx.replace(tmp)
        finally:
            tmp_onnx.unlink(missing_ok=True)
    _update_export_manifest(out.parent, info)
    return out


def _update_export_manifest(directory: Path, info: dict) -> None:
    """Re-checksum an export dir after adding the rewritten graph (keeps its config)."""
    if not (directory / MANIFEST).is_file():
        return
    try:
        m = read_manifest(directory, EXPORT_KIND, verify=False)
    except ArtifactError:
        return  # not our export dir: leave it alone
    write_manifest(directory, EXPORT_KIND, m["config"], {"rewrite": info})
