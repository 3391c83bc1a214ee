"""Does `torch.compile` pay on CPU? The decoder's MLP block (RMSNorm, gate|up, SiLU-mul, down + residual) at decode
and prefill row counts: ironlm's eager ops (core RMSNorm / SiLU-mul + torch GEMMs) vs the same block in plain torch,
eager and compiled (inductor, static shapes).

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_torch_compile.py [--rows 1 64 512]

(Compiling the whole `DecoderLM.forward` does not get this far: dynamo's guards fail on the attention metadata's
numpy-backed block tables, see BENCHMARKS.md.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ironlm.model.layers import rms_norm, silu_and_mul

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_step import cpu_info

HIDDEN, INTER = 576, 1536  # SmolLM2-135M


def ironlm_block(h: torch.Tensor, nw: torch.Tensor, gu: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    x = silu_and_mul(torch.mm(rms_norm(h, nw, 1e-5), gu))
    return torch.addmm(h, x, down)


def torch_block(h: torch.Tensor, nw: torch.Tensor, gu: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    x = h.float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * nw
    g, u = torch.mm(x, gu).chunk(2, dim=-1)
    return torch.addmm(h, F.silu(g) * u, down)


def median_us(fn: Callable[..., torch.Tensor], *args: torch.Tensor, n: int = 200) -> float:
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    args = ap.parse_args(argv)
    name, flags = cpu_info()
    print(f"CPU: {name}, {torch.get_num_threads()} threads, flags: {' '.join(flags)}; torch {torch.__version__}")
    compiled = torch.compile(torch_block, dynamic=False)
    torch.manual_seed(0)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            nw = torch.randn(HIDDEN, dtype=dtype)
            gu = torch.randn(HIDDEN, 2 * INTER, dtype=dtype) * 0.02
            down = torch.randn(INTER, HIDDEN, dtype=dtype) * 0.02
            for m in args.rows:
                h = torch.randn(m, HIDDEN, dtype=dtype)
                t0 = time.perf_counter()
                compiled(h, nw, gu, down)
                compile_s = time.perf_counter() - t0
                ours = median_us(ironlm_block, h, nw, gu, down)
                plain = median_us(torch_block, h, nw, gu, down)
                comp = median_us(compiled, h, nw, gu, down)
                print(f"{str(dtype).removeprefix('torch.'):>8} M={m:<4} ironlm eager {ours:8.1f} us | torch eager "
                      f"{plain:8.1f} us | torch.compile {comp:8.1f} us ({comp / ours:.2f}x ironlm; compiled in "
                      f"{compile_s:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
