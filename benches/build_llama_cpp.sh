#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, `llama-bench`, `llama-perplexity`, `llama-quantize` (Q4_0 files for the MoE and
# Gemma benches) and the speculative examples once, for the llama.cpp baseline of
# `ironlm bench {throughput,serve,latency,perplexity} --baseline llama.cpp`.
#
# The source is the llama.cpp that the `llama-cpp-python` source distribution on PyPI vendors,
# so the build needs nothing but PyPI and a C++ compiler. The result lives in a git-ignored
# folder (.llama.cpp/ by default); a second run with the same pinned version does nothing.
# The whole build runs at the lowest CPU priority: the build machine is shared.
#
# Environment: LLAMA_CPP_PYTHON_VERSION (pin), LLAMA_CPP_DIR (output folder),
#              PYTHON (interpreter whose pip downloads the sdist and, if needed, cmake),
#              JOBS (parallel compile jobs; default: all cores).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${LLAMA_CPP_DIR:-$ROOT/.llama.cpp}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-$(nproc)}"
BIN="$DEST/build/bin"

# -march=native turns on AMX wherever /proc/cpuinfo lists it, but some VMs list AMX without letting a
# process use it (the tile instructions fault), and then every llama.cpp matmul crashes. Run a tiny AMX
# program first and build without AMX unless it works.
amx_usable() {
    grep -qw amx_tile /proc/cpuinfo || return 1
    local dir ok=1
    dir="$(mktemp -d)"
    cat > "$dir/probe.c" <<'EOF'
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, as ggml asks for it */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;
    struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; }
        __attribute__((aligned(64))) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.colsb[0] = 64;
    cfg.rows[0] = 16;
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF
    if "${CC:-cc}" -O2 -mamx-tile "$dir/probe.c" -o "$dir/probe" 2>/dev/null && "$dir/probe" 2>/dev/null; then
        ok=0
    fi
    rm -rf "$dir"
    return $ok
}
if amx_usable; then AMX=on; NO_AMX_FLAGS=""; else AMX=off; NO_AMX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
# The stamp names everything that changes the binaries: another pin or AMX verdict rebuilds.
STAMP="$DEST/build/.built-from-llama-cpp-python-$VERSION-amx-$AMX"

print_paths() {
    echo "llama-server: $BIN/llama-server"
    echo "llama-bench:  $BIN/llama-bench"
    echo "llama-perplexity: $BIN/llama-perplexity"
    echo "llama-quantize: $BIN/llama-quantize"
}

if [[ -f "$STAMP" && -x "$BIN/llama-server" && -x "$BIN/llama-bench" && -x "$BIN/llama-perplexity" \
      && -x "$BIN/llama-quantize" ]]; then
    echo "llama.cpp (llama-cpp-python $VERSION) already built in $DEST"
    print_paths
    exit 0
fi

# Children inherit the niceness, so pip, cmake and every compiler process run at priority 19.
renice -n 19 -p $$ >/dev/null

mkdir -p "$DEST/sdist"
# Ignored by git wherever LLAMA_CPP_DIR points, not only at the checkout's .llama.cpp/.
printf '*\n' > "$DEST/.gitignore"
SDIST="$DEST/sdist/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    # --no-binary for this one package only: with :all: pip would also compile the sdist's own
    # build backend dependencies (cmake among them) from source just to read its metadata.
    "$PYTHON" -m pip download --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DEST/sdist"
fi

SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    rm -rf "$DEST/src"
    mkdir -p "$DEST/src"
    tar -xzf "$SDIST" -C "$DEST/src"
fi
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    echo "error: $SDIST has no vendor/llama.cpp/CMakeLists.txt" >&2
    exit 1
fi

CMAKE="$(command -v cmake || true)"
if [[ -z "$CMAKE" ]]; then
    CMAKE="$(dirname "$PYTHON")/cmake"
    if [[ ! -x "$CMAKE" ]]; then
        "$PYTHON" -m pip install --disable-pip-version-check -q cmake
    fi
fi

# A changed version or an earlier failed configure must not leave stale objects behind.
rm -rf "$DEST/build"
# GGML_NATIVE: -march=native, as a llama.cpp user building on this machine gets (GCC lets an explicit
# -mno-amx-* win over what -march=native implies). Static libraries, so the two binaries run from
# anywhere without LD_LIBRARY_PATH.
echo "AMX usable: $AMX"
"$CMAKE" -S "$SRC" -B "$DEST/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$NO_AMX_FLAGS" \
    -DCMAKE_CXX_FLAGS="$NO_AMX_FLAGS" \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF \
    -DGGML_METAL=OFF \
    -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON
"$CMAKE" --build "$DEST/build" --config Release -j "$JOBS" --target llama-server llama-bench llama-perplexity \
    llama-lookup llama-speculative llama-lookahead llama-quantize

touch "$STAMP"
print_paths
