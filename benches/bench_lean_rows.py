"""The lean CPU step at 1 row against k+1 rows (speculative verification): what a verify step costs next to a plain
decode step, lean and through the ordinary forward, interleaved so that both see the same machine load.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_lean_rows.py [--model GGUF] [--threads 2]

Default model (its GGUF blocks kept), one sequence with a 600-token context and t query rows at t = 1, 6, 12, 18,
24 (above 6 rows: t / 6 sequences of 6 rows each, a few streams verifying 5 proposals); best and median of 12 steps
each way, and the other processes' CPU use during the run (/proc/stat). About a minute on a quiet 2-core machine.

    ... benches/bench_lean_rows.py --phases [--rows 1,2,...,9]

One sequence verifying t - 1 proposals (t rows, the lean step taken at every t), the t values interleaved round by
round; per t the median step and the median of each phase (benches/lean_phases.py: each projection's GEMM by
matrix kind, the LM head, attention, norms, activation, glue), and each phase's cost relative to t = 1.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from ironlm.attention import AttentionMetadata, CpuAttention
from ironlm.bench.report import cpu_jiffies
from ironlm.model import lean, load_model

try:
    from lean_phases import PhaseClock, instrument, timed_step
except ImportError:  # run from elsewhere than benches/
    from benches.lean_phases import PhaseClock, instrument, timed_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--phases", action="store_true", help="one sequence, t rows, per-phase medians")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9", help="--phases: the row counts t")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="--phases: cpu = the thread's CPU time (with --threads 1: a loaded machine's descheduled "
                         "time left out)")
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
    if a.phases:
        if a.clock == "cpu" and a.threads != 1:
            ap.error("--clock cpu needs --threads 1 (the other threads' CPU time is not the caller's)")
        now = time.thread_time if a.clock == "cpu" else time.perf_counter
        phases(model, step, [int(x) for x in a.rows.split(",")], a.steps, PhaseClock(now))
        lean.LEAN_MAX_TOKENS = saved
        return
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


def phases(model: torch.nn.Module, step: Callable[[int, bool], float], rows: list[int], steps: int,
           clock: PhaseClock) -> None:
    """Per-phase medians at each t, the t values alternating within every round (same machine load for all)."""
    undo = instrument(model, clock)
    got: dict[int, list[dict[str, float]]] = {t: [] for t in rows}
    b0, c0 = cpu_jiffies(), time.process_time()
    try:
        for i in range(steps + 2):
            for t in rows:
                ph = timed_step(model, clock, lambda t=t: step(t, True))
                if i >= 2:
                    got[t].append(ph)
    finally:
        undo()
    b1, c1 = cpu_jiffies(), time.process_time()
    names = sorted({k for v in got.values() for ph in v for k in ph if k != "total"}) + ["total"]
    med = {t: {k: float(np.median([ph.get(k, 0.0) for ph in v])) * 1e3 for k in names} for t, v in got.items()}
    base = med[rows[0]]
    print(f"median ms per step (x: relative to t={rows[0]}); {steps} steps each, after 2 warm-up rounds")
    print(f"{'phase':>12} " + " ".join(f"{'t=' + str(t):>13}" for t in rows))
    for k in names:
        cells = [f"{med[t][k]:6.2f} {med[t][k] / max(base[k], 1e-9):5.2f}x" for t in rows]
        print(f"{k:>12} " + " ".join(cells))
    best = {t: min(ph["total"] for ph in v) * 1e3 for t, v in got.items()}
    print(f"{'best total':>12} " + " ".join(f"{best[t]:6.2f} {best[t] / best[rows[0]]:5.2f}x" for t in rows))
    hz, ncpu = 100, os.cpu_count() or 1  # USER_HZ: /proc/stat's jiffies
    others = ((b1[0] - b0[0]) / hz - (c1 - c0)) / max(1e-9, (b1[1] - b0[1]) / hz / ncpu)
    print(f"other processes' CPU during the run: {others:.2f} of the machine's {ncpu} cores")


if __name__ == "__main__":
    main()
