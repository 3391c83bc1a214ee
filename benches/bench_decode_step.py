"""Single-stream decode: the per-step time of the model forward at batch 1, against the memory bandwidth.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_decode_step.py [MODEL] [--dtype float32 bfloat16]
        [--context 32] [--steps 128] [--profile] [--generate]

A decode step at batch 1 reads every weight once, so its floor is weight bytes / memory bandwidth. This prints,
per dtype: the median model-forward time of a decode step (one sequence, growing from --context tokens), the
achieved weight-streaming rate (weight bytes / step time) and the machine's copy bandwidth (a 512 MiB tensor copy:
read + write bytes / time; and a read-only sum), with the CPU model and its SIMD flags. --profile adds torch.profiler's top ops of a
step, --generate the end-to-end tok/s of `LLM.generate` (greedy, 128 new tokens after a short prompt).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from ironlm.attention import AttentionMetadata
from ironlm.model import load_model

_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16",
          "amx_int8")


def cpu_info() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, [f for f in _FLAGS if f in flags]


def bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 5) -> tuple[float, float]:
    """(copy, read) GB/s, best of `repeats`: a copy of a `nbytes` fp32 tensor counting read + write bytes (like
    STREAM's copy), and a sum over it (read only, as a decode step reads its weights)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    best_copy = best_read = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        src.sum()
        t2 = time.perf_counter()
        best_copy, best_read = min(best_copy, t1 - t0), min(best_read, t2 - t1)
    return 2 * nbytes / best_copy / 1e9, nbytes / best_read / 1e9


class DecodeRunner:
    """One sequence against a private paged KV cache, stepped one token at a time through the model forward."""

    def __init__(self, model: Any, context: int, steps: int, block_size: int = 16) -> None:
        self.model = model
        cfg = model.config
        self.block_size = block_size
        self.num_blocks = -(-(context + steps + 1) // block_size)
        shape = (self.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                       for _ in range(cfg.num_layers)]
        self.table = np.arange(self.num_blocks, dtype=np.int32)[None, :]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (context,), generator=gen)
        self.length = 0
        self.token = self._forward(ids)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        meta = AttentionMetadata.from_lengths(context_lens=np.array([self.length]), query_lens=np.array([n]),
                                              block_tables=self.table, block_size=self.block_size)
        positions = torch.arange(self.length, self.length + n)
        logits = self.model(ids, positions, self.caches, meta, torch.tensor([n - 1]))
        self.length += n
        return logits.argmax(-1)

    def step(self) -> None:
        self.token = self._forward(self.token)


def weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def time_steps(model: Any, context: int, steps: int) -> tuple[list[float], float]:
    """Wall time of each step, and the process CPU time per step (all threads: on a shared machine, the
    figure that other processes' load does not inflate; exact at --threads 1, where nothing spins)."""
    runner = DecodeRunner(model, context, steps)
    for _ in range(3):
        runner.step()
    times = []
    cpu0 = time.process_time()
    for _ in range(steps - 3):
        t0 = time.perf_counter()
        runner.step()
        times.append(time.perf_counter() - t0)
    return times, (time.process_time() - cpu0) / (steps - 3)


def profile_step(model: Any, context: int, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    runner = DecodeRunner(model, context, 16)
    for _ in range(3):
        runner.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(8):
            runner.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def generate_tok_s(model: str | None, dtype: str, new_tokens: int = 128) -> float:
    import dataclasses

    from ironlm.config import EngineConfig
    from ironlm.llm import LLM
    from ironlm.sampling_params import SamplingParams

    # Dense weights, like the decode-step figure (a GGUF's blocks would otherwise stay quantized).
    dense = {"quantization": "none"} if "quantization" in {f.name for f in dataclasses.fields(EngineConfig)} else {}
    llm = LLM(model, dtype=dtype, kv_cache_memory="64MiB", **dense)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(["Warm-up"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = llm.generate(["The capital of France is"], params, use_tqdm=False)
    n = len(out[0].outputs[0].token_ids)
    return n / (time.perf_counter() - t0), (time.process_time() - cpu0) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: the built-in model)")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=32, help="prompt tokens before the first timed step")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of a decode step")
    ap.add_argument("--generate", action="store_true", help="also time LLM.generate end to end")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    name, flags = cpu_info()
    bw, read_bw = bandwidth_gbs()
    print(f"CPU: {name}, {torch.get_num_threads()} threads, flags: {' '.join(flags)}")
    print(f"memory bandwidth, 512 MiB fp32 tensor: copy {bw:.1f} GB/s (read + write), sum {read_bw:.1f} GB/s (read)")
    for dtype in args.dtype:
        model = load_model(args.model, dtype=dtype, device="cpu").model
        nbytes = weight_bytes(model)
        times, cpu = time_steps(model, args.context, args.steps)
        med = statistics.median(times)
        print(f"{dtype:>9}: decode step median {med * 1e3:6.2f} ms (min {min(times) * 1e3:.2f}, CPU {cpu * 1e3:.2f}; "
              f"{1 / med:5.1f} steps/s), weights {nbytes / 1e6:.0f} MB -> {nbytes / med / 1e9:5.1f} GB/s "
              f"= {nbytes / med / 1e9 / bw:.0%} of copy, {nbytes / med / 1e9 / read_bw:.0%} of read bandwidth")
        if args.profile:
            print(profile_step(model, args.context))
        if args.generate:
            tok_s, cpu_tok = generate_tok_s(args.model, dtype)
            print(f"           LLM.generate: {tok_s:.1f} tok/s, CPU {cpu_tok * 1e3:.1f} ms/token (greedy, 128 new tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
