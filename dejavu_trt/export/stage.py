"""`export_decode`: work dir (or model) -> export/NAME/decode.onnx plus a manifest."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx

from ..artifacts import MANIFEST, atomic_dir, read_manifest, write_manifest
from ..errors import DejaVuError
from ..ops.contract import OP_CONTRACT_VERSION
from .config import DEFAULT_MAX_CONTEXT, ONNX_OPSET, io_names
from .module import DecodeModel
from .onnx_graph import build_decode_graph

log = logging.getLogger(__name__)

EXPORT_KIND = "export"
DECODE_FILE = "decode.onnx"
SPARSE_FILE = "decode.sparse.onnx"
# Above this the weights go to an external-data file (protobuf's 2 GB limit).
EXTERNAL_DATA_BYTES = 1 << 30


def model_of_workdir(workdir: Path) -> tuple[str, dict]:
    """(model alias or folder, the work dir's manifest config) of a calibration work dir."""
    manifest = read_manifest(workdir, "workdir", verify=False)
    model = manifest.get("config", {}).get("model", {})
    name = model.get("alias") or model.get("name") or model.get("folder") if isinstance(model, dict) else model
    if not name:
        raise DejaVuError(f"{workdir}/manifest.json does not name its model; re-run `dejavu-trt calibrate`")
    return str(name), manifest["config"]


def save_onnx(proto: onnx.ModelProto, path: Path, data_name: str | None = None) -> None:
    """Save, moving weights to `<data_name or name>.data` only when the model is too big for one protobuf."""
    large = proto.ByteSize() > EXTERNAL_DATA_BYTES
    kwargs = dict(save_as_external_data=True, all_tensors_to_one_file=True,
                  location=(data_name or path.name) + ".data", size_threshold=1024) if large else {}
    onnx.save_model(proto, str(path), **kwargs)


def export_decode(source: str | Path, out: str | Path, *, max_context: int = DEFAULT_MAX_CONTEXT,
                  num_layers: int | None = None, loaded=None, check: bool = True) -> Path:
    """Export the dense decode step of a work dir's model (or of a model alias/folder).

    Writes OUT/decode.onnx and OUT/manifest.json (kind "export") atomically; returns the ONNX path.
    `loaded` (a `LoadedModel`) skips loading the model again; `num_layers` truncates the graph (for
    tests only: its logits are not the model's).
    """
    from ..models import load_model

    source_path = Path(source)
    workdir = None
    if source_path.is_dir() and (source_path / MANIFEST).is_file():
        workdir = source_path.resolve()
        model_name, _ = model_of_workdir(source_path)
    else:
        model_name = str(source)
    lm = loaded if loaded is not None else load_model(model_name)
    model = DecodeModel.from_adapter(lm.adapter, max_context, num_layers)
    cfg = model.cfg
    out = Path(out)
    meta = {"model": lm.spec.alias, "contract_version": OP_CONTRACT_VERSION}
    with atomic_dir(out) as tmp:
        proto = build_decode_graph(model, meta)
        save_onnx(proto, tmp / DECODE_FILE)
        del proto
        if check:
            onnx.checker.check_model(str(tmp / DECODE_FILE), full_check=True)
        config = {"model": lm.spec.alias, "model_folder": str(lm.folder), "workdir": str(workdir) if workdir else None,
                  "decode": json.loads(cfg.to_json()), "opset": ONNX_OPSET, "io": io_names(cfg.num_layers),
                  "truncated": cfg.truncated, "contract_version": OP_CONTRACT_VERSION}
        write_manifest(tmp, EXPORT_KIND, config)
    if cfg.truncated:
        log.warning("exported %d of %d layers: the graph's logits are not the model's", cfg.num_layers, cfg.model_layers)
    return out / DECODE_FILE
