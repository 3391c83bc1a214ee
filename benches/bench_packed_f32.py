"""The core's packed f32 GEMM (`_core.PackedF32`, what DenseLinear runs f32 calls of up to `packed_f32_rows()` rows
on) against torch.mm at SmolLM2-135M's shapes, side by side in one process.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_packed_f32.py [--rows 19,34,64,512] [--rounds 3]

Per shape and M: the best of 7 calls of each (after one warm-up call) (weights in cache: the compute rate, not the bandwidth), µs and
GFLOP/s, and torch's time / ours. Then a layer's four GEMMs summed, the two alternating for --rounds rounds over
--layer-rows, and the median ratio per M (the VM's speed drifts between minutes, so only the alternating figure is
a ratio). Prints the CPU model and flags and the threads.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_dense_decode import best
from ironlm import _core
from ironlm.bench.report import machine_info

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}


def pair(packed: _core.PackedF32, weight: torch.Tensor, m: int, threads: int, reps: int) -> tuple[float, float]:
    """(ours, torch.mm's) best time of an `[m, k]` call into this weight."""
    x, out = torch.randn(m, weight.shape[0]), torch.empty(m, weight.shape[1])
    x_np, out_np = x.numpy(), out.numpy()
    ours = best([lambda: packed.matmul(x_np, out_np, False, None, threads)], reps)
    return ours, best([lambda: torch.mm(x, weight, out=out)], reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,3,8,19,34,64,512")
    p.add_argument("--layer-rows", default="65,128,256,512,1024,2048")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(f"cpu: {info.get('cpu_model')}; flags {' '.join(_core.cpu_features())}; threads {args.threads}")
    weights = {name: torch.randn(k, n) for name, (k, n) in SHAPES.items()}
    packed = {name: _core.PackedF32(w.numpy()) for name, w in weights.items()}
    for name, (k, n) in SHAPES.items():
        for m in (int(v) for v in args.rows.split(",")):
            if name == "head" and m > 64:
                continue  # a prefill computes the head on its last rows only
            tp, tt = pair(packed[name], weights[name], m, args.threads, 7)
            flop = 2 * m * k * n
            print(f"{name:8s} M={m:5d}  packed {tp * 1e6:10.1f} us {flop / tp / 1e9:6.1f} GFLOP/s  |  torch.mm "
                  f"{tt * 1e6:10.1f} us {flop / tt / 1e9:6.1f}  |  torch / packed {tt / tp:5.2f}", flush=True)
    layer = [name for name in SHAPES if name != "head"]
    ratios: dict[int, list[float]] = {}
    for r in range(args.rounds):
        for m in (int(v) for v in args.layer_rows.split(",")):
            tp = tt = 0.0
            for name in layer:
                ours, theirs = pair(packed[name], weights[name], m, args.threads, 3)
                tp, tt = tp + ours, tt + theirs
            ratios.setdefault(m, []).append(tt / tp)
            flop = 2 * m * sum(SHAPES[name][0] * SHAPES[name][1] for name in layer)
            print(f"round {r} layer M={m:5d}: packed {tp * 1e3:8.2f} ms ({flop / tp / 1e9:5.1f} GFLOP/s), torch.mm "
                  f"{tt * 1e3:8.2f} ms ({flop / tt / 1e9:5.1f}), torch / packed {tt / tp:4.2f}", flush=True)
    for m, v in ratios.items():
        print(f"layer M={m:5d}: median torch / packed {statistics.median(v):.2f} over {len(v)} rounds")


if __name__ == "__main__":
    main()
