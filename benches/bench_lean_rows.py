"""The lean CPU step at 1 row against k+1 rows (speculative verification): what a verify step costs next to a plain
decode step, lean and through the ordinary forward, interleaved so that both see the same machine load.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_lean_rows.py [--model GGUF] [--threads 2]

Default model (its GGUF blocks kept), one sequence with a 600-token context and t query rows at t = 1, 6, 12, 18,
24 (above 6 rows: t / 6 sequences of 6 rows each, a few streams verifying 5 proposals); best and median of 12 steps
each way, and the other processes' CPU use during the run (/proc/stat). About a minute on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ironlm.attention import AttentionMetadata, CpuAttention
from ironlm.bench.report import cpu_jiffies
from ironlm.model import lean, load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model, quantization="auto", attn_backend=CpuAttention()).model
    cfg, bs, blocks, ctx = model.config, 16, 256, 600
    shape = (blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)) for _ in range(cfg.num_layers)]

    def step(t: int, lean_on: bool) -> float:
        lean.LEAN_MAX_TOKENS = 64 if lean_on else 0
        seqs = max(1, t // 6)
        rows = t // seqs
        table = np.arange(seqs * 48, dtype=np.int32).reshape(seqs, 48)
        meta = AttentionMetadata.from_lengths(context_lens=np.full(seqs, ctx), query_lens=np.full(seqs, rows),
                                              block_tables=table, block_size=bs)
        ids = torch.arange(100, 100 + t)
        pos = torch.from_numpy(np.tile(np.arange(ctx, ctx + rows), seqs))
        t0 = time.perf_counter()
        model(ids, pos, kv, meta, torch.arange(t))
        return time.perf_counter() - t0

    saved = lean.LEAN_MAX_TOKENS
    b0 = cpu_jiffies()
    for t in (1, 6, 12, 18, 24):
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(a.steps + 2):
            for on in (True, False):
                dt = step(t, on)
                if i >= 2:  # two warm-up steps each way
                    times[on].append(dt)
        fmt = {on: f"best {min(v) * 1e3:.1f} median {np.median(v) * 1e3:.1f} ms" for on, v in times.items()}
        print(f"t={t:2d}: lean {fmt[True]} | ordinary {fmt[False]}", flush=True)
    b1 = cpu_jiffies()
    lean.LEAN_MAX_TOKENS = saved
    print(f"machine busy share over the run (ours included): {(b1[0] - b0[0]) / max(1, b1[1] - b0[1]):.2f}")


if __name__ == "__main__":
    main()
