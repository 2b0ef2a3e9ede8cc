#!/usr/bin/env bash
# Compile every .cu under plugins/ for sm_80 and sm_90 (compile only, no GPU needed); fail on any error.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "compile_cuda: nvcc not found" >&2; exit 2; }
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
n=0
while IFS= read -r f; do
  echo "nvcc -c $f"
  "$NVCC" -std=c++17 -O3 -Werror all-warnings -Iplugins/common \
    -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
    -c "$f" -o "$out/$(basename "$f").o"
  n=$((n + 1))
done < <(find plugins -name '*.cu' -not -path '*/build/*' | sort)
[ "$n" -gt 0 ] || { echo "compile_cuda: no .cu files found" >&2; exit 1; }
echo "compile_cuda: $n files OK (sm_80, sm_90)"
