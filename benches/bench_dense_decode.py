"""Dense checkpoints at the bandwidth limit: one stream decoding an HF bf16 folder, and the core's dense kernels
alone against torch.mm at M = 1..8, each against the machine's read bandwidth measured in the same run.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_dense_decode.py [--hf DIR] [--threads 2] [--quick]

Read bandwidth, two ways, best of 5: torch's `sum` over a 1 GiB fp32 tensor on --threads threads (the issue's
figure), and the core's own weight stream, `_core.dense_matmul` at M = 1 over a 1 GiB bf16 `[8192, 65536]` weight.
Decode: the model forward of one sequence stepped token by token (median step, --tokens steps after a 32-token
prompt; bench_decode_step's runner) and `LLM.generate` of one greedy stream (ignore_eos), both from the HF bf16
folder (made from the default GGUF by ironlm.bench.hf_folder unless --hf names one); a token streams every weight
once (the tied embedding table once, as the LM head), so weight bytes / step time is the GB/s achieved. Each runs
with the core's dense kernels (DenseLinear below CORE_MAX_ROWS rows) and without (torch's mm at every size).
Kernels: the model's five matmul shapes at M = 1..8, µs a call and weight GB/s, `dense_matmul` vs `torch.mm`,
cycling through enough copies of each weight (>= 256 MiB) that every call reads it from memory, not from cache.
Prints the CPU model and flags, the threads, and the other processes' CPU use during the run (/proc/stat).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench_decode_step import cpu_info, generate_tok_s, time_steps, weight_bytes
from ironlm import _core
from ironlm.bench.report import read_bandwidth_gbs
from ironlm.core_views import as_numpy
from ironlm.model import linear, load_model


def busy_jiffies() -> tuple[int, int]:
    """(every process's busy CPU jiffies, this process's), to report what the others used meanwhile."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    with open("/proc/self/stat") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    return busy, int(mine[11]) + int(mine[12])  # utime + stime


def best(calls: list[Callable[[], object]], reps: int) -> float:
    """The fastest single call, cycling through `calls` (each over its own copy of the weights, so that each reads
    them from memory) `reps` times after one warm-up round."""
    for call in calls:
        call()
    times = []
    for _ in range(reps):
        for call in calls:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return min(times)


def read_bandwidth(nbytes: int, threads: int, reps: int = 5) -> tuple[float, float]:
    """(torch sum, core dense_matmul stream) GB/s over `nbytes`."""
    torch_gbs = read_bandwidth_gbs(nbytes, reps)
    k = 8192
    w = torch.full((k, nbytes // 2 // k), 0.5, dtype=torch.bfloat16)
    v = torch.full((1, k), 0.5, dtype=torch.bfloat16)
    out = torch.empty(1, w.shape[1], dtype=torch.bfloat16)
    call = partial(_core.dense_matmul, as_numpy(v), as_numpy(w), as_numpy(out), False, None, "bfloat16", threads)
    return torch_gbs, nbytes / best([call], reps) / 1e9


def kernel_table(cfg: Any, rows: list[int], threads: int, stream_bytes: int, reps: int) -> list[str]:
    """µs a call and weight GB/s of dense_matmul vs torch.mm for the model's matmuls (bf16)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {"qkv": (h, q + 2 * kv, False), "o": (q, h, False), "gate_up": (h, 2 * inter, False),
              "down": (inter, h, False), "head": (h, cfg.vocab_size, True)}
    lines = [f"{'matmul':>8} {'K x N':>12} {'M':>2} {'core us':>9} {'GB/s':>6} {'torch us':>9} {'GB/s':>6} {'x':>5}"]
    for name, (k, n, transposed) in shapes.items():
        nbytes = k * n * 2
        copies = max(1, -(-stream_bytes // nbytes))
        # the head is the embedding table [vocab, hidden] seen transposed, as DecoderLM keeps it
        ws = [(torch.randn(n, k).bfloat16().t() if transposed else torch.randn(k, n).bfloat16()) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            out = torch.empty(m, n, dtype=torch.bfloat16)
            xn, on = as_numpy(x), as_numpy(out)
            core = [partial(_core.dense_matmul, xn, as_numpy(w), on, False, None, "bfloat16", threads) for w in ws]
            mm = [partial(torch.mm, x, w, out=out) for w in ws]
            tc, tt = best(core, reps), best(mm, reps)
            lines.append(f"{name:>8} {f'{k}x{n}':>12} {m:>2} {tc * 1e6:9.1f} {nbytes / tc / 1e9:6.1f} "
                         f"{tt * 1e6:9.1f} {nbytes / tt / 1e9:6.1f} {tt / tc:5.2f}")
        del ws
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default=None, help="an HF bf16 folder (default: made from the default GGUF)")
    ap.add_argument("--hf-cache", default="/tmp/ironlm-hf-bf16-default", help="where the made folder goes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="a short check of the script: few tokens and repeats")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    quick = args.quick
    tokens, reps = (12, 2) if quick else (args.tokens, 5)
    band_bytes, stream_bytes = (256 << 20, 32 << 20) if quick else (1 << 30, 256 << 20)
    rows = [1, 8] if quick else list(range(1, 9))

    busy0, mine0, t0 = *busy_jiffies(), time.perf_counter()
    name, flags = cpu_info()
    print(f"CPU: {name}, {args.threads} threads, flags: {' '.join(flags)}; dense path {_core.dense_isas()[0]}")
    torch_bw, core_bw = read_bandwidth(band_bytes, args.threads)
    print(f"read bandwidth ({band_bytes >> 20} MiB, best of 5): torch sum {torch_bw:.1f} GB/s, "
          f"core dense_matmul M=1 stream {core_bw:.1f} GB/s")

    folder = args.hf
    if folder is None:
        cache = Path(args.hf_cache)
        if not (cache / "config.json").exists():
            from ironlm.bench.hf_folder import make_hf_folder

            make_hf_folder(None, cache, torch.bfloat16)
        folder = str(cache)
    model = load_model(folder, dtype="bfloat16", device="cpu").model
    nbytes = weight_bytes(model)
    print(f"model: {folder} (bf16, {nbytes / 1e6:.0f} MB of weights streamed a token)")
    limit = linear.CORE_MAX_ROWS
    for label, core_rows in (("core dense kernels", limit), ("torch mm (before)", 0)):
        linear.CORE_MAX_ROWS = core_rows
        times, cpu = time_steps(model, 32, tokens)
        med = statistics.median(times)
        gbs = nbytes / med / 1e9
        print(f"  {label:>18}: decode step {med * 1e3:6.2f} ms ({1 / med:6.1f} tok/s, CPU {cpu * 1e3:.2f} ms), "
              f"{gbs:5.1f} GB/s = {gbs / torch_bw:.0%} of torch-sum, {gbs / core_bw:.0%} of core-stream bandwidth")
        tok_s, cpu_tok = generate_tok_s(folder, "bfloat16", new_tokens=tokens)
        print(f"  {'':>18}  LLM.generate one stream: {tok_s:6.1f} tok/s ({nbytes * tok_s / 1e9:5.1f} GB/s), "
              f"CPU {cpu_tok * 1e3:.1f} ms/token")
    linear.CORE_MAX_ROWS = limit
    cfg = model.config
    del model

    print("\n".join(kernel_table(cfg, rows, args.threads, stream_bytes, reps)))
    busy1, mine1, t1 = *busy_jiffies(), time.perf_counter()
    hz, cores = os.sysconf("SC_CLK_TCK"), torch.get_num_threads()
    others = ((busy1 - busy0) - (mine1 - mine0)) / hz / (t1 - t0)
    print(f"other processes' CPU during the run: {others:.2f} cores busy on average ({t1 - t0:.0f} s wall; "
          f"{cores} threads here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
