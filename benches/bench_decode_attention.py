"""Decode step: the ``cpu`` attention backend (fused paged kernel in the core) vs the ``torch`` path, side by side.

    .venv/bin/python benches/bench_decode_attention.py [MODEL] [--num-seqs 64] [--steps 5] [--repeats 6] [--json F]
    .venv/bin/python benches/bench_decode_attention.py --kernel [--dtype bf16 f32] [--threads 1 2] [--json F]

Admits workload W's prompts (lengths 32-512, seed 0), runs until every sequence is decoding, then times blocks of
decode steps, alternating the two backends on the same live batch (the noisy-neighbour drift of a shared machine
hits both alike). Reports the median step time and the time inside attention per step for each. (That the two
backends agree is tested in tests/test_attention_torch.py and end to end against transformers.)

With ``--kernel`` it times the core kernel alone (``_core.paged_decode_attention``) on random caches at workload
W's decode shape (SmolLM2-135M: 9 query / 3 KV heads of 64, blocks of 16 in shuffled order; 64 sequences of
contexts 100-700), on one sequence (context 600) and on one sequence's speculative verification (2, 3, 4 and 6 rows sharing
a block table, context 600), one sequence at context 4,000, one with Gemma 3 270M's heads (4 query / 1 KV of 256) at
2,000, and reports GFLOP/s (4 * head_dim flops per query head and attended position: the
logits' and the weighted sum's multiply-adds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from ironlm import _core
from ironlm.attention import get_backend
from ironlm.bench.datasets import RandomSpec, random_dataset
from ironlm.core_views import as_numpy
from ironlm.llm import LLM
from ironlm.sampling_params import SamplingParams

BACKENDS = ("cpu", "torch")


def _timed(name: str, spent: dict[str, float]) -> Any:
    backend = get_backend(name, "cpu")
    inner = backend.forward

    def forward(*args: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args)
        spent[name] += time.perf_counter() - t0
        return out

    backend.forward = forward
    # The ordinary forward's attention, backend against backend: the lean step (every CPU decode step by default)
    # calls the core's fused decode_attention_qkv itself and never `forward`.
    backend.fused_decode_qkv = False  # type: ignore[misc]
    return backend


def run(model: str | None, num_seqs: int, steps: int, repeats: int, input_len: tuple[int, int]) -> dict[str, Any]:
    llm = LLM(model, max_num_seqs=num_seqs)
    engine = llm.engine
    ds = random_dataset(RandomSpec(num_requests=num_seqs, input_len=input_len, output_len=(1, 1), seed=0),
                        engine.model_config.vocab_size)
    # Long enough to outlast the warm-up (early requests decode while later ones still prefill) and every timed
    # step: nobody finishes and the batch stays whole.
    params = SamplingParams(max_tokens=2 * steps * repeats + 256, ignore_eos=True, temperature=0.0)
    for i, r in enumerate(ds.requests):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params)
    started: set[str] = set()  # requests whose prefill is done (they have sampled a token)
    while len(started) < num_seqs:
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    if engine.stats()["num_requests_running"] != num_seqs:
        raise RuntimeError("the KV cache cannot hold every sequence at once: lower --num-seqs")

    spent = dict.fromkeys(BACKENDS, 0.0)
    backends = {name: _timed(name, spent) for name in BACKENDS}
    step_ms: dict[str, list[float]] = {name: [] for name in BACKENDS}
    for _ in range(repeats):
        for name in BACKENDS:
            engine.runner.model.set_attention_backend(backends[name])
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            step_ms[name].append((time.perf_counter() - t0) / steps * 1e3)
    context = int(sum(r.prompt_len for r in ds.requests) / num_seqs)
    result: dict[str, Any] = {"num_seqs": num_seqs, "mean_context": context, "steps": steps, "repeats": repeats}
    for name in BACKENDS:
        result[name] = {"step_ms_median": statistics.median(step_ms[name]), "step_ms": step_ms[name],
                        "attention_ms_per_step": spent[name] / (steps * repeats) * 1e3}
    result["speedup_step"] = result["torch"]["step_ms_median"] / result["cpu"]["step_ms_median"]
    result["speedup_attention"] = result["torch"]["attention_ms_per_step"] / result["cpu"]["attention_ms_per_step"]
    return result


DTYPES = {"f32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "f16": (torch.float16, "float16")}
# 8-bit caches under f32 queries (a GGUF's activations): the cache's type, the queries' f32
FP8 = {"e4m3": (torch.float8_e4m3fn, "float8_e4m3fn"), "e5m2": (torch.float8_e5m2, "float8_e5m2")}


def _kernel_case(lens: list[int], rows_per_table: int, hq: int, hkv: int, d: int, bs: int,
                 dtype: str) -> dict[str, Any]:
    """paged_decode_attention's arguments: one table per len, each repeated for `rows_per_table` consecutive rows
    (a verification's rows end one position apart)."""
    g = torch.Generator().manual_seed(0)
    tdtype, name = DTYPES.get(dtype, DTYPES["f32"])
    cdtype, cname = FP8.get(dtype, (tdtype, name))
    need = [-(-(n + rows_per_table) // bs) for n in lens]
    max_blocks, total = max(need), sum(need)
    ids = torch.randperm(total, generator=g).numpy().astype(np.int32)
    tables, seq_lens, at = [], [], 0
    for n, b in zip(lens, need):
        row = np.zeros(max_blocks, np.int32)
        row[:b] = ids[at : at + b]
        at += b
        for j in range(rows_per_table):
            tables.append(row)
            seq_lens.append(n + j)
    rows = len(seq_lens)
    kc = torch.randn(total, bs, hkv, d, generator=g).to(cdtype)
    vc = torch.randn(total, bs, hkv, d, generator=g).to(cdtype)
    q = torch.randn(rows, hq, d, generator=g).to(tdtype)
    out = torch.empty(rows, hq, d, dtype=tdtype)
    return {"q": as_numpy(q), "k_cache": as_numpy(kc), "v_cache": as_numpy(vc),
            "block_tables": np.stack(tables), "seq_lens": np.array(seq_lens, np.int32), "scale": d**-0.5,
            "out": as_numpy(out), "dtype": name, "cache_dtype": cname, "_keep": (q, kc, vc, out),
            "_flops": 4 * d * hq * sum(seq_lens)}


def _time_kernel(case: dict[str, Any], threads: int, seconds: float) -> tuple[float, float]:
    """Median wall and process-CPU seconds per call over calls filling about `seconds` (on a loaded machine the CPU
    time is the figure that waiting for a core does not inflate; exact at one thread, where nothing else runs)."""
    args = {k: v for k, v in case.items() if not k.startswith("_")}
    _core.paged_decode_attention(**args, threads=threads)
    t0 = time.perf_counter()
    _core.paged_decode_attention(**args, threads=threads)
    once = max(time.perf_counter() - t0, 1e-6)
    times, cpu = [], []
    for _ in range(max(5, int(seconds / once))):
        t0, c0 = time.perf_counter(), time.process_time()
        _core.paged_decode_attention(**args, threads=threads)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu)


def run_kernel(dtypes: list[str], threads: list[int], seconds: float) -> list[dict[str, Any]]:
    smol, gemma, bs = (9, 3, 64), (4, 1, 256), 16  # (query heads, KV heads, head dim): SmolLM2-135M, Gemma 3 270M
    rng = np.random.default_rng(0)
    cases = {"W: 64 seqs, ctx 100-700": ([int(x) for x in rng.integers(100, 701, 64)], 1, smol),
             "one seq, ctx 600": ([600], 1, smol),
             "one seq, ctx 4000": ([4000], 1, smol),
             "one seq, Gemma 3 270M heads, ctx 2000": ([2000], 1, gemma),
             "verify: 2 rows, one table, ctx 600": ([600], 2, smol),
             "verify: 3 rows, one table, ctx 600": ([600], 3, smol),
             "verify: 4 rows, one table, ctx 600": ([600], 4, smol),
             "verify: 6 rows, one table, ctx 600": ([600], 6, smol)}
    results = []
    for dtype in dtypes:
        for label, (lens, per, (hq, hkv, d)) in cases.items():
            case = _kernel_case(lens, per, hq, hkv, d, bs, dtype)
            for t in threads:
                sec, cpu = _time_kernel(case, t, seconds)
                r = {"case": label, "dtype": dtype, "threads": t, "ms": sec * 1e3, "cpu_ms": cpu * 1e3,
                     "gflops": case["_flops"] / sec / 1e9}
                print(f"  {label:36s} {dtype:4s} threads {t}: {r['ms']:8.3f} ms (CPU {r['cpu_ms']:8.3f} ms) "
                      f"{r['gflops']:6.1f} GFLOP/s")
                results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: the built-in model)")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="decode steps per timed block")
    ap.add_argument("--repeats", type=int, default=6, help="timed blocks per backend, alternating")
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--kernel", action="store_true", help="time the core kernel alone at W's shape (GFLOP/s)")
    ap.add_argument("--dtype", nargs="+", default=["bf16", "f32"], choices=sorted({**DTYPES, **FP8}),
                    help="with --kernel: the cache's type (e4m3 / e5m2 under f32 queries, the others their own)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="with --kernel")
    ap.add_argument("--seconds", type=float, default=2.0, help="with --kernel: timing per case")
    args = ap.parse_args(argv)
    if args.kernel:
        res = run_kernel(args.dtype, args.threads, args.seconds)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return 0
    r = run(args.model, args.num_seqs, args.steps, args.repeats, tuple(args.input_len))
    print(f"decode step, {r['num_seqs']} sequences, mean context {r['mean_context']} tokens "
          f"({r['repeats']} alternating blocks of {r['steps']} steps, medians)")
    for name in BACKENDS:
        print(f"  {name:5s}  step {r[name]['step_ms_median']:8.1f} ms   attention {r[name]['attention_ms_per_step']:8.1f} ms")
    print(f"  cpu / torch: step {r['speedup_step']:.2f}x faster, attention {r['speedup_attention']:.2f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
