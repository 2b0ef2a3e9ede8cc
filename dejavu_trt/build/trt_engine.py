"""Stage 6 with TensorRT: the rewritten graph -> a `.plan`, through polygraphy's TensorRT loaders.

TensorRT cannot be installed on the machines this project is developed on, so this module has never run
against a real TensorRT; tests/test_build.py checks its wiring with the loaders stubbed. What it does, and
why:

* loads the plugin library (`LoadPlugins`: a plain dlopen, so the library's static registrars run) and
  asks the registry under which namespace our creators landed: the nodes' `plugin_namespace` attribute
  must name it, or the ONNX parser does not find the plugins;
* builds from the typed copy of the graph (rewrite/plan_graph.py): TensorRT 11 networks are strongly
  typed, so plugin weights and caches must already be in the build dtype (no fp16/bf16 builder flag);
* turns on `ALIASED_PLUGIN_IO_10_03`, without which the attention plugin's in-place KV caches are refused;
* allows two auxiliary streams, so the predictor nodes (which read an earlier layer's input) can overlap;
* checks that the parser made a plugin layer of every plugin node. A parser that finds an ONNX local
  function of the node's name may expand it instead (the onnx-tensorrt of TensorRT 10.1 always does);
  that engine would compute the reference math, dense-speed, and is refused.
"""
from __future__ import annotations

from pathlib import Path

from ..artifacts import atomic_file
from ..errors import DejaVuError
from ..ops.contract import OP_CONTRACT_VERSION, OP_NAMES, PLUGIN_NAMESPACE

MAX_AUX_STREAMS = 2


def registered_namespace(trt) -> str:
    """The namespace our plugin creators are registered under (the contract's, or "" from the static
    registrars); a clear error when they are not registered at all."""
    registry = trt.get_plugin_registry()
    for ns in (PLUGIN_NAMESPACE, ""):
        if all(registry.get_creator(op, OP_CONTRACT_VERSION, ns) is not None for op in OP_NAMES):
            return ns
    ours = sorted(f"{c.plugin_namespace}::{c.name} v{c.plugin_version}" for c in registry.all_creators
                  if c.name in OP_NAMES)
    raise DejaVuError(f"the plugin library loaded, but TensorRT's plugin registry lacks "
                      f"{', '.join(OP_NAMES)} version {OP_CONTRACT_VERSION} (found: {', '.join(ours) or 'none'}); "
                      f"rebuild libdejavu_trt_plugins.so from this version's plugins/")


def plugin_layer_check(trt, expected: int):
    """A network post-processing step: every plugin node must have become a plugin layer."""
    def check_plugin_layers(network) -> None:
        kinds = {getattr(trt.LayerType, k) for k in ("PLUGIN_V3", "PLUGIN_V2") if hasattr(trt.LayerType, k)}
        found = sum(1 for i in range(network.num_layers) if network.get_layer(i).type in kinds)
        if found != expected:
            raise DejaVuError(f"TensorRT's ONNX parser made {found} plugin layers of the graph's {expected} "
                              f"{PLUGIN_NAMESPACE} nodes: it expanded the others from their ONNX local functions "
                              f"(the reference math). This needs a parser that imports a node with a "
                              f"`plugin_namespace` attribute as its registered plugin (TensorRT 10.1's does not)")
    return check_plugin_layers


def build_plan(rewritten: Path, out: Path, *, dtype: str, library: Path, work: Path) -> Path:
    """Build and save the `.plan` (TensorRT and the plugin library must be present)."""
    import tensorrt as trt
    from polygraphy.backend.trt import (CreateConfig, EngineFromNetwork, LoadPlugins, NetworkFromOnnxPath,
                                        PostprocessNetwork, SaveEngine)
    from ..rewrite.plan_graph import PLAN_GRAPH_FILE, write_plan_graph

    LoadPlugins(plugins=[str(library)])()
    ns = registered_namespace(trt)
    typed = work / PLAN_GRAPH_FILE
    expected = write_plan_graph(rewritten, typed, dtype, ns)
    network = PostprocessNetwork(NetworkFromOnnxPath(str(typed), strongly_typed=True),
                                 func=plugin_layer_check(trt, expected), name="check_plugin_layers")
    config = CreateConfig(max_aux_streams=MAX_AUX_STREAMS,
                          preview_features=[trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03])
    with atomic_file(out) as tmp:   # a failed or interrupted build leaves no partial .plan
        SaveEngine(EngineFromNetwork(network, config=config), str(tmp))()
    return out
