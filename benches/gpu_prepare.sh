#!/usr/bin/env bash
# Prepare, on this (CPU) machine, what benches/gpu_check.sh needs on a lent GPU machine:
#   .gpu_model_a/, .gpu_model_b/  the default model's GGUF in two pieces (98 MB > one call's 64 MiB)
#   .whl/                         the pure-Python `gguf` wheel (transformers needs it to read GGUF files;
#                                 the GPU image has everything else)
# and lists these folders in .git/info/exclude so that they travel only when a call names them in `carry`.
# The Rust extension travels as python/ironlm/_core.abi3.so (build it first with `make develop`).
# BENCHMARKS.md ("GPU check") gives the two device calls that use them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

model=$("$PY" -c "from ironlm.model.default import default_model_path as p; print(p())")
for d in .gpu_model_a .gpu_model_b .whl; do
  grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done
rm -rf .gpu_model_a .gpu_model_b && mkdir -p .gpu_model_a .gpu_model_b .whl
name=$(basename "$model")
split -n 2 -d -a 2 "$model" "/tmp/$name.part-"
mv "/tmp/$name.part-00" .gpu_model_a/ && mv "/tmp/$name.part-01" .gpu_model_b/
gguf_version=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$gguf_version"
ls -la .gpu_model_a .gpu_model_b .whl python/ironlm/_core*.so
