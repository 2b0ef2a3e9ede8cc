"""Write polygraphy input feeds for a decode graph: a teacher-forced decode of a few tokens.

Each step's feed (input_ids, position and the caches the dense graph produced so far) goes into a
polygraphy JSON file that `polygraphy run --load-inputs` replays, so both graphs see the same inputs.

    python make_inputs.py export/NAME/decode.onnx inputs.json [--steps 4] [--batch 1] [--seed 0]
"""
import argparse
import json

import onnx
import torch
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
from polygraphy.json import save_json

from dejavu_trt.compare.compare import decode_trajectory
from dejavu_trt.export.config import DecodeConfig

ap = argparse.ArgumentParser()
ap.add_argument("onnx")
ap.add_argument("out")
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()

meta = {p.key: p.value for p in onnx.load(args.onnx, load_external_data=False).metadata_props}
cfg = DecodeConfig.from_json(meta["dejavu_trt.config"])
tokens = torch.randint(100, min(cfg.vocab_size, 5000), (args.batch, args.steps + 1),
                       generator=torch.Generator().manual_seed(args.seed))
with OnnxrtRunner(SessionFromOnnx(args.onnx, providers=["CPUExecutionProvider"])) as runner:
    feeds, _, _ = decode_trajectory(runner, cfg, tokens, args.steps)
save_json(feeds, args.out, description="decode-step feeds")
print(json.dumps({"steps": args.steps, "batch": args.batch, "inputs": args.out}))
