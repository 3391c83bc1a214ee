#!/usr/bin/env bash
# The GPU gate (benches/gpu_check.py: parity with transformers, CUDA graphs, whole-model quantization, the KV
# tier's pinned copies, grammar masks, a real `ironlm serve` over HTTP, the kernels' correctness and timings):
# one table, exit status 1 on any mismatch. Fits one device call of <= 8 minutes on an H200, setup included.
#
#   benches/gpu_check.sh [--dry-run] [--model PATH.gguf|HF_DIR] [--only a,b] [--skip a,b] [--budget-s N]
#
# --dry-run runs every check on CPU (Triton's interpreter, small sizes): run it before spending device time.
#
# The device machine reaches no registry and starts bare. benches/gpu_prepare.sh makes, here, what travels (the
# wheels of what the GPU image lacks, the default model in two pieces) and prints the two device calls; this
# script installs the wheels (pip --no-index --target, seconds), puts the model back together, copies the Triton
# kernels next to the carried extension (python/ironlm/kernels/*.py are build outputs, git-ignored), and runs.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${OUT:-bench_out/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Nothing is reachable from the device machine: never let a library wait on a network timeout.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

dry_run=0 model_arg=0
for a in "$@"; do
  [[ "$a" == --dry-run ]] && dry_run=1
  [[ "$a" == --model || "$a" == --model=* ]] && model_arg=1
done
# 1. carried wheels (.whl/ in this call, or copied to /tmp/ironlm-wheels by an earlier one); no index, no deps.
#    Not on a dry run: they are built for the device's CPython 3.12, and the developer's environment has it all.
mapfile -t wheels < <(ls .whl/*.whl /tmp/ironlm-wheels/*.whl 2>/dev/null)
if ((${#wheels[@]} && !dry_run)); then
  if [[ ! -f /tmp/ironlm-site/.installed ]]; then
    t0=$SECONDS
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ironlm-site "${wheels[@]}"; then
      touch /tmp/ironlm-site/.installed
      echo "gpu_check: ${#wheels[@]} wheels installed in $((SECONDS - t0)) s" >&2
    else
      echo "gpu_check: installing the carried wheels failed (the checks that need them will fail)" >&2
    fi
  fi
  export PYTHONPATH="/tmp/ironlm-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The kernels ship inside the wheel as ironlm.kernels; in a source tree `make develop` copies them there.
for k in kernels/*.py; do
  [[ -f "python/ironlm/kernels/$(basename "$k")" ]] || cp "$k" python/ironlm/kernels/
done
# 2. ironlm as installed (a wheel, an editable install), else from the source tree with the extension next to it
if ! "$PYTHON" -c "import ironlm._core as c; c.Scheduler" 2>/dev/null; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
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
if [[ -z "${IRONLM_MODEL:-}" ]] && ((!model_arg)); then
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
