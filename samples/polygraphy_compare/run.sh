#!/usr/bin/env bash
# Compare a dense decode graph with its rewritten graph using the polygraphy CLI alone.
#   samples/polygraphy_compare/run.sh export/NAME/decode.onnx export/NAME/decode.sparse.onnx [WORK]
# Exit status: polygraphy's (0 = every output of every step within tolerance).
set -euo pipefail
DENSE=$1
SPARSE=$2
WORK=${3:-$(mktemp -d)}
mkdir -p "$WORK"
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python}
POLY=${POLYGRAPHY:-polygraphy}
ATOL=${ATOL:-1e-4}
RTOL=${RTOL:-1e-5}

"$PY" "$HERE/make_inputs.py" "$DENSE" "$WORK/inputs.json" --steps "${STEPS:-4}"
# Reference run: save every step's outputs (polygraphy's JSON format, no pickle).
"$POLY" run "$DENSE" --onnxrt --load-inputs "$WORK/inputs.json" --save-outputs "$WORK/dense_outputs.json"
# Rewritten graph (plugin nodes run through their ONNX local functions) against the saved outputs.
"$POLY" run "$SPARSE" --onnxrt --load-inputs "$WORK/inputs.json" --load-outputs "$WORK/dense_outputs.json" \
    --atol "$ATOL" --rtol "$RTOL" --check-error-stat elemwise
