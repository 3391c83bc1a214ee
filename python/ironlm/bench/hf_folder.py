"""An HF model folder (config, safetensors, tokenizer) made from a GGUF file, dequantized to one dtype.

What a vLLM user brings is an HF checkpoint, so the vLLM baseline and ironlm's "HF folder" runs load this
folder; `benches/build_vllm_cpu.sh` makes it from the built-in default GGUF. transformers reads the GGUF's
blocks and dequantizes them (`GgufConfig(dequantize=True)`: without it the model keeps a GGUF quantization
config that `save_pretrained` refuses to write).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_hf_folder(gguf: str | Path | None, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the HF folder for `gguf` (None: the built-in default model's file) to `out`; returns `out`.

    Written to a sibling temporary folder first and renamed, so a half-written folder is never taken for a
    finished one."""
    from transformers import AutoModelForCausalLM, GgufConfig

    from ironlm.bench.llama_cpp import gguf_path
    from ironlm.model.gguf import load_gguf_tokenizer

    src = gguf_path(gguf)
    dest = Path(out).expanduser()
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=dtype,
        quantization_config=GgufConfig(gguf_file=src.name, dequantize=True))
    try:
        model.save_pretrained(str(tmp))
        load_gguf_tokenizer(src).save_pretrained(str(tmp))
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ironlm.bench.hf_folder", description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="the GGUF file (default: the built-in default model's)")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    args = p.parse_args(argv)
    print(make_hf_folder(args.gguf, args.out, _DTYPES[args.dtype]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
