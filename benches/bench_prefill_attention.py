"""CPU prefill attention of one chunk: the GEMM path (attention/cpu_prefill.py) against the torch path the CPU
backend used before it (`_prefill_one(half=True)`: SDPA in bf16, the explicit softmax for soft-capped logits
and sinks, a bool mask for windows and cached prefixes), SmolLM2-135M's heads (9 query / 3 KV heads of 64).

Chunks of L = 32 .. 2048 query rows, with no cached prefix and after a 512-token one, for plain causal
attention, soft-capped logits, sinks, a 128-token window and window + sinks (gpt-oss's sliding layers);
median of `--repeats` calls each, per thread count. Prints one row per case; `--json PATH` writes them.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_prefill_attention.py --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ironlm.attention import cpu_prefill
from test_cpu_prefill import _inputs, _torch_path

FEATURES = {"plain": (None, None, False), "softcap": (None, 30.0, False), "sinks": (None, None, True),
            "window128": (128, None, False), "window128+sinks": (128, None, True)}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 256, 512, 1024, 2048])
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 512])
    ap.add_argument("--features", nargs="+", default=list(FEATURES), choices=list(FEATURES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for feat in args.features:
            window, softcap, with_sinks = FEATURES[feat]
            for n in args.lengths:
                for ctx in args.contexts:
                    q, ks, vs = _inputs(n, ctx, 9, 3, dtype, 0)
                    sinks = torch.randn(9) if with_sinks else None
                    case = (q, ks, vs, ctx, 0.125, window, softcap, sinks)
                    old = _median_ms(lambda c=case: _torch_path(*c), args.repeats)
                    new = _median_ms(lambda c=case: cpu_prefill.attend(*c), args.repeats)
                    routed = cpu_prefill.serves(dtype, n, ctx + n, window, softcap, sinks)
                    rows.append({"threads": threads, "feature": feat, "rows": n, "context": ctx, "torch_ms": old,
                                 "gemm_ms": new, "speedup": old / new, "routed_to_gemm": routed})
                    print(f"threads={threads} {feat:16s} L={n:5d} ctx={ctx:5d} torch path {old:8.2f} ms  "
                          f"gemm {new:8.2f} ms  x{old / new:5.2f}  routed: {'gemm' if routed else 'torch'}",
                          flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
