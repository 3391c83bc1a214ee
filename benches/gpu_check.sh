#!/usr/bin/env bash
# GPU check for a lent H200 (or any CUDA machine): kernel correctness + timing (benches/gpu_kernels.py), then
# end-to-end throughput of workload W on the default model, ironlm vs transformers. One call, <= 8 minutes;
# a short table is printed last, the full JSON and logs land in $OUT (default bench_out/gpu_check).
#
#   benches/gpu_check.sh [--dry-run] [--model PATH.gguf|HF_DIR] [--skip-kernels] [--skip-e2e] [--budget-s N]
#
# --dry-run exercises every step on CPU with tiny sizes and prints no timings worth reading.
#
# It uses the machine's own python3/torch/triton/transformers and installs nothing from a registry. What it
# needs from here travels with the device tool (see BENCHMARKS.md, "GPU check"):
#   - the Rust extension: carry python/ironlm/_core.abi3.so (abi3, x86-64; git-ignored, so name it in `carry`),
#     or wheels in .whl/ (ironlm-*.whl and e.g. gguf-*.whl), installed here with pip --no-index --target;
#     if neither imports and cargo + maturin are present, it builds the extension in place (not on --dry-run).
#   - the default model: the 98 MB GGUF is over one call's 64 MiB, so it travels as *.gguf.part-* pieces
#     over two calls (benches/gpu_prepare.sh makes them), or give any path with --model / $IRONLM_MODEL.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${OUT:-bench_out/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# 1. carried wheels (no index, no dependencies: the machine has torch & co)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ironlm-site .whl/*.whl || echo "gpu_check: installing .whl/ failed" >&2
  export PYTHONPATH="/tmp/ironlm-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# 2. ironlm as installed (a wheel, an editable install), else from the source tree with the extension next to it
if ! "$PYTHON" -c "import ironlm._core as c; c.Scheduler" 2>/dev/null; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
dry_run=0
for a in "$@"; do [[ "$a" == --dry-run ]] && dry_run=1; done
if ! "$PYTHON" -c "import ironlm._core as c; c.Scheduler" 2>/dev/null; then
  # Never on a dry run: there the extension is the developer's own build, left as it is.
  if ((!dry_run)) && command -v cargo >/dev/null && "$PYTHON" -m maturin --version >/dev/null 2>&1; then
    echo "gpu_check: building the Rust extension with maturin" >&2
    (cd "$PWD" && "$PYTHON" -m maturin build --release -o /tmp/ironlm-dist >"$OUT/build.log" 2>&1) &&
      "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/ironlm-build /tmp/ironlm-dist/ironlm-*.whl &&
      cp /tmp/ironlm-build/ironlm/_core*.so python/ironlm/
  fi
  if ! "$PYTHON" -c "import ironlm._core as c; c.Scheduler"; then
    echo "gpu_check: ironlm._core does not import: carry python/ironlm/_core.abi3.so or a wheel in .whl/" >&2
    exit 3
  fi
fi
# 3. the model: pieces carried in .gpu_model*/ (or copied to /tmp/ironlm-model-parts by an earlier call)
#    are put back together in /tmp
if [[ -z "${IRONLM_MODEL:-}" ]]; then
  mapfile -t parts < <(for f in .gpu_model*/*.part-* /tmp/ironlm-model-parts/*.part-*; do
    [[ -f "$f" ]] && echo "$(basename "$f") $f"; done | sort -u -k1,1 | cut -d' ' -f2)
  if ((${#parts[@]})); then
    for i in "${!parts[@]}"; do  # pieces .part-00, -01, ...: a missing one would make a corrupt file
      if [[ "${parts[$i]##*.part-}" != "$(printf '%02d' "$i")" ]]; then
        echo "gpu_check: model pieces are not .part-00..$(printf '%02d' $((${#parts[@]} - 1))): ${parts[*]}" >&2
        exit 4
      fi
    done
    name=$(basename "${parts[0]}")
    mkdir -p /tmp/ironlm-model && IRONLM_MODEL="/tmp/ironlm-model/${name%.part-*}"
    cat "${parts[@]}" >"$IRONLM_MODEL"
    echo "gpu_check: model put back together from ${#parts[@]} pieces: $IRONLM_MODEL" >&2
    export IRONLM_MODEL
  elif compgen -G ".gpu_model*/*.gguf" >/dev/null; then
    IRONLM_MODEL="$(ls "$PWD"/.gpu_model*/*.gguf | head -n1)"
    export IRONLM_MODEL
  fi
fi

exec "$PYTHON" benches/gpu_check.py --out "$OUT" "$@"
