"""What an 8-bit KV cache costs in accuracy: the default model's token logprobs over the committed text
(benches/data/ppl_text.txt, ironlm.bench.perplexity's) teacher-forced through the paged cache with the cache the
engine serves by default (16-bit over quantized weights), e4m3 (`--kv-cache-dtype fp8`) and e5m2, and with an f32
cache as the reference of all three.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_kv_fp8.py [MODEL] [--mode auto] [--chunk 64]

Reports each cache's perplexity, its change against the f32 cache, and the mean and largest |logprob difference| a
token. Chunks of `--chunk` tokens: a chunk's rows attend earlier chunks through the cache and their own rows rounded
as the cache holds them (CpuAttention's round_to_cache), so every key a token sees went through the cache's type.
Speed is measured elsewhere: `benches/profile_w.py --engine-arg kv_cache_dtype=fp8` and `ironlm bench serve
--server-arg=--kv-cache-dtype=fp8` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ironlm.bench.perplexity import MODES, load, perplexity, served_kv_dtype, text_token_ids, token_logprobs
from ironlm.bench.report import machine_info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: the built-in model)")
    ap.add_argument("--mode", default="auto", choices=sorted(MODES), help="weights as bench perplexity's modes")
    ap.add_argument("--chunk", type=int, default=64, help="tokens a chunk (smaller: more keys read from the cache)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    loaded = load(args.model, args.mode)
    tokens = text_token_ids(loaded.tokenizer)[: args.max_tokens]
    caches = {"float32": torch.float32, "served": served_kv_dtype(loaded), "fp8 (e4m3)": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}
    if loaded.model.dtype == torch.bfloat16:
        del caches["float32"]  # a bf16 model's cache is bf16 at most: the served one is the reference
    got: dict[str, np.ndarray] = {}
    rows = []
    for name, dt in caches.items():
        t0 = time.perf_counter()
        got[name] = token_logprobs(loaded, tokens, chunk_size=args.chunk, kv_dtype=dt)
        rows.append({"cache": name, "dtype": str(dt).removeprefix("torch."), "ppl": perplexity(got[name]),
                     "seconds": time.perf_counter() - t0})
    ref_name = "float32" if "float32" in got else "served"
    ref, ref_ppl = got[ref_name], rows[list(caches).index(ref_name)]["ppl"]
    for r in rows:
        diff = np.abs(got[r["cache"]] - ref)
        r["ppl_rel"] = r["ppl"] / ref_ppl - 1.0
        r["mean_abs_dlogprob"], r["max_abs_dlogprob"] = float(diff.mean()), float(diff.max())
        print(f"{r['cache']:12s} {r['dtype']:14s} ppl {r['ppl']:.4f} ({100 * r['ppl_rel']:+.3f} % vs {ref_name}) "
              f"|dlogprob| mean {r['mean_abs_dlogprob']:.5f} max {r['max_abs_dlogprob']:.4f}")
    report = {"benchmark": "kv_fp8", "machine": machine_info("cpu"), "model": loaded.path, "mode": args.mode,
              "model_dtype": str(loaded.model.dtype).removeprefix("torch."), "tokens": len(tokens),
              "chunk": args.chunk, "reference": ref_name, "results": rows}
    print(f"CPU: {report['machine'].get('cpu_model')}, {len(tokens)} tokens, chunks of {args.chunk}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
