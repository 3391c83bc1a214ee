#!/usr/bin/env bash
# Prepare, on this (CPU) machine, everything benches/gpu_check.sh needs on a lent GPU machine, which reaches no
# registry and starts bare, so that its minutes go to the checks rather than to installing:
#   .whl/          wheels (CPython 3.12, manylinux x86-64, the versions installed here) of what ironlm serves with
#                  and the gate's client needs beyond the GPU image (fastapi, uvicorn, pydantic, openai, gguf,
#                  grpcio, protobuf, ... and their requirements); gpu_check.sh installs them with pip --no-index
#                  --target in a few seconds
#   .gpu_model_a/, .gpu_model_b/   the default model's GGUF (98 MB) in two pieces, cut so that each device call's
#                  transfer (working tree + carried paths, 64 MiB at most) holds one piece with what travels beside it
# and lists these folders in .git/info/exclude so that they travel only when a call names them in `carry`.
# The Rust extension travels as python/ironlm/_core.abi3.so (built here by `make develop`; abi3, x86-64).
#
# The two device calls (the second within the machine's 30 s warm window; gpu_check.sh also finds everything
# in the folders of a single call that carries them all):
#   1. carry [".gpu_model_a", ".whl"]
#      command: mkdir -p /tmp/ironlm-model-parts /tmp/ironlm-wheels && cp .gpu_model_a/* /tmp/ironlm-model-parts/ && cp .whl/* /tmp/ironlm-wheels/
#   2. carry [".gpu_model_b", "python/ironlm/_core.abi3.so"], timeout_s 540
#      command: cp .gpu_model_b/* /tmp/ironlm-model-parts/ && set -o pipefail && benches/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log
#   gpu_check.sh writes gpu_check.json (updated after every check), gpu_kernels.json/.log, e2e_throughput.json
#   into $OUT, which the device tool sets and brings back.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((3 * 1024 * 1024))  # the transfer's own overhead, and files added to the tree before the calls

for d in .gpu_model_a .gpu_model_b .whl; do
  grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done
so=python/ironlm/_core.abi3.so
[[ -f "$so" ]] || { echo "gpu_prepare: $so is missing: run make develop first" >&2; exit 1; }

# 1. wheels: the closure of these distributions' requirements as installed here, less what the GPU image has
#    (torch and the Hugging Face stack above all; KINDS.md lists the image).
ON_IMAGE=torch,triton,numpy,transformers,tokenizers,safetensors,huggingface-hub,hf-xet,sentencepiece,pyyaml,tqdm
ON_IMAGE+=,jinja2,markupsafe,filelock,fsspec,packaging,regex,requests,urllib3,charset-normalizer,psutil,setuptools
ON_IMAGE+=,networkx,sympy,mpmath
"$PY" - "$ON_IMAGE" fastapi uvicorn openai gguf protobuf grpcio prometheus-client httpx >/tmp/ironlm-wheels.txt <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skip = {canonicalize_name(n) for n in sys.argv[1].split(",")}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "extra": ""}
seen: dict[str, str] = {}
todo = [canonicalize_name(n) for n in sys.argv[2:]]
while todo:
    name = todo.pop()
    if name in seen or name in skip:
        continue
    dist = md.distribution(name)
    seen[name] = dist.version
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(canonicalize_name(req.name))
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
EOF
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl -r /tmp/ironlm-wheels.txt
echo "gpu_prepare: $(ls .whl | wc -l) wheels for $(wc -l </tmp/ironlm-wheels.txt) requirements, $(du -sh .whl | cut -f1)"

# 2. the model, cut so that call 1 (tree + piece a + wheels) and call 2 (tree + piece b + extension) both fit.
model=$("$PY" -c "from ironlm.model.default import default_model_path as p; print(p())")
tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
wheels=$(du -sb .whl | cut -f1)
size=$(stat -c %s "$model")
so_size=$(stat -c %s "$so")
# piece a = (model + extension - wheels) / 2 balances the two calls
a=$(((size + so_size - wheels) / 2))
((a > 0 && a < size)) || a=$((size / 2))
call1=$((tree + untracked + a + wheels))
call2=$((tree + untracked + size - a + so_size))
if ((call1 + MARGIN > LIMIT || call2 + MARGIN > LIMIT)); then
  echo "gpu_prepare: the calls would carry $call1 and $call2 bytes, over 64 MiB less a margin" >&2
  exit 1
fi
rm -rf .gpu_model_a .gpu_model_b && mkdir -p .gpu_model_a .gpu_model_b
name=$(basename "$model")
head -c "$a" "$model" >".gpu_model_a/$name.part-00"
tail -c +$((a + 1)) "$model" >".gpu_model_b/$name.part-01"
cmp <(cat ".gpu_model_a/$name.part-00" ".gpu_model_b/$name.part-01") "$model"
echo "gpu_prepare: call 1 carries $((call1 / 1048576)) MiB, call 2 $((call2 / 1048576)) MiB (limit 64)"
ls -la .gpu_model_a .gpu_model_b "$so"
