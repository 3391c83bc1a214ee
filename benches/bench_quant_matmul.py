"""Weight-only quantized matmul on CPU: ironlm's QuantMatrix (q8, q4) against torch's own CPU ops and dense mm.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_quant_matmul.py [--m 1 8 64 512] [--shapes qkv lm_head]

On SmolLM2-135M's linear shapes, `out = x @ W^T` with x float32 [M, K]:
- ironlm q8 / q4: `QuantMatrix.from_float(w, 8, 0)` / `(w, 4, 32)`, `matmul(x, out=...)`;
- torch `_weight_int8pack_mm` (int8 per channel) and `_weight_int4pack_mm_for_cpu` (int4, groups of 32), fp32 x;
- `torch.mm` on fp32 and bf16 weights (bf16 x).
Prints a markdown table: median time, GB/s of weight bytes read, GFLOP/s, and the fastest per row.
`--decode-step` instead times every matmul of one batch-1 decode step of the default GGUF model (q, k, v and
gate, up fused with `QuantMatrix.concat`, the tied Q8_0 LM head), against dense fp32 and bf16 torch.mm.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ironlm._core import QuantMatrix, quant_isas

SHAPES = {  # name: (K = in_features, N = out_features)
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}
FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
)


@dataclass
class Method:
    name: str
    nbytes: int
    run: Callable[[], object]


def cpu_model() -> tuple[str, list[str]]:
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, [f for f in FLAGS if f in flags]


def methods(k: int, n: int, m: int, threads: int) -> list[Method]:
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    out = torch.empty(m, n)
    xn, on = x.numpy(), out.numpy()
    res: list[Method] = []
    for label, bits, group in [("ironlm q8", 8, 0), ("ironlm q4", 4, 32)]:
        q = QuantMatrix.from_float(w.numpy(), bits, group)
        res.append(Method(label, q.nbytes, lambda q=q: q.matmul(xn, out=on, threads=threads)))
    scale = w.abs().amax(1) / 127
    w8 = (w / scale[:, None]).round().to(torch.int8)
    res.append(
        Method("torch int8pack", w8.numel() + 4 * n, lambda: torch.ops.aten._weight_int8pack_mm(x, w8, scale))
    )
    gs = 32
    wg = w.view(n, k // gs, gs)
    lo, hi = wg.amin(2), wg.amax(2)
    s4 = (hi - lo) / 15
    q4 = ((wg - lo[..., None]) / s4[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    # torch's int4 convention: w = (q - 8) * scale + zero.
    sz = torch.stack([s4, lo + 8 * s4], -1).transpose(0, 1).contiguous()
    res.append(
        Method(
            "torch int4pack",
            packed.numel() + sz.numel() * 4,
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, gs, sz),
        )
    )
    res.append(Method("torch fp32 mm", w.numel() * 4, lambda: torch.mm(x, w.T, out=out)))
    wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
    res.append(Method("torch bf16 mm", wb.numel() * 2, lambda: torch.mm(xb, wb.T)))
    return res


def median_time(fn: Callable[[], object], budget: float, clock: Callable[[], float]) -> float:
    t0 = clock()
    fn()
    first = clock() - t0
    if first > 4 * budget:  # a path this slow is out of the race: one more call is enough
        t0 = clock()
        fn()
        return min(first, clock() - t0)
    times: list[float] = []
    start = clock()
    while len(times) < 3 or (clock() - start < budget and len(times) < 200):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def decode_step(threads: int, budget: float, clock: Callable[[], float]) -> None:
    import numpy as np

    from ironlm.model import default_model_path
    from ironlm.model.gguf import GGUFFile

    gf = GGUFFile(default_model_path())
    layers = 1 + max(int(n.split(".")[1]) for n in gf.tensors if n.startswith("blk."))

    def load(name: str) -> QuantMatrix:
        info = gf.tensors[name]
        return QuantMatrix.from_ggml(gf.raw(info), info.ggml_type, *info.shape)

    mats: list[QuantMatrix] = []
    for i in range(layers):
        b = f"blk.{i}."
        mats.append(QuantMatrix.concat([load(b + t + ".weight") for t in ("attn_q", "attn_k", "attn_v")]))
        mats.append(load(b + "attn_output.weight"))
        mats.append(QuantMatrix.concat([load(b + t + ".weight") for t in ("ffn_gate", "ffn_up")]))
        mats.append(load(b + "ffn_down.weight"))
    mats.append(load("output.weight" if "output.weight" in gf.tensors else "token_embd.weight"))
    xs = [np.random.default_rng(0).standard_normal((1, m.cols), dtype=np.float32) for m in mats]
    outs = [np.empty((1, m.rows), np.float32) for m in mats]

    def quant_step() -> None:
        for m, x, o in zip(mats, xs, outs):
            m.matmul(x, out=o, threads=threads)

    nbytes = sum(m.nbytes for m in mats)
    t = median_time(quant_step, budget, clock)
    print(
        f"| ironlm {'/'.join(sorted({m.kind for m in mats}))} | {nbytes / 1e6:.1f} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} |"
    )
    for dtype in (torch.float32, torch.bfloat16):
        ws = [torch.from_numpy(m.dequantize()).to(dtype) for m in mats]
        tx = [torch.from_numpy(x).to(dtype) for x in xs]

        def dense_step(ws: list[torch.Tensor] = ws, tx: list[torch.Tensor] = tx) -> None:
            for w, x in zip(ws, tx):
                torch.mm(x, w.T)

        nb = sum(w.numel() * w.element_size() for w in ws)
        t = median_time(dense_step, budget, clock)
        print(f"| torch.mm {dtype} | {nb / 1e6:.1f} | {t * 1e3:.2f} | {nb / t / 1e9:.1f} |")
    gf.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 512], help="activation rows")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timing per cell")
    ap.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: CPU time of this thread (needs --threads 1; per-core figures that hold on a loaded box)",
    )
    ap.add_argument(
        "--decode-step", action="store_true", help="time one batch-1 decode step's matmuls instead"
    )
    args = ap.parse_args()
    if args.clock == "thread" and args.threads != 1:
        ap.error("--clock thread needs --threads 1 (every op then runs on the calling thread)")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    model, flags = cpu_model()
    best, isas = quant_isas()
    print(f"CPU: {model}, {os.cpu_count()} cores; flags: {' '.join(flags)}")
    print(
        f"torch {torch.__version__}, {args.threads} threads; ironlm kernel path: {best} (of {', '.join(isas)})"
    )
    print(f"load average at start: {os.getloadavg()[0]:.2f}\n")
    if args.decode_step:
        print("| decode step, M = 1 | weight MB | ms | GB/s |\n|---|---|---|---|")
        decode_step(args.threads, args.budget, clock)
        return
    names: list[str] | None = None
    for shape in args.shapes:
        k, n = SHAPES[shape]
        for m in args.m:
            ms = methods(k, n, m, args.threads)
            if names is None:
                names = [x.name for x in ms]
                print(
                    "| shape (K→N) | M | "
                    + " | ".join(f"{x} µs / GB/s / GFLOP/s" for x in names)
                    + " | fastest |"
                )
                print("|---|---|" + "---|" * len(names) + "---|")
            cells, times = [], []
            for meth in ms:
                t = median_time(meth.run, args.budget, clock)
                times.append(t)
                cells.append(f"{t * 1e6:.0f} / {meth.nbytes / t / 1e9:.1f} / {2 * m * n * k / t / 1e9:.1f}")
            fastest = ms[min(range(len(ms)), key=times.__getitem__)].name
            print(f"| {shape} {k}→{n} | {m} | " + " | ".join(cells) + f" | {fastest} |", flush=True)


if __name__ == "__main__":
    main()
