"""bench_moe.py --http: workload W over HTTP, `ironlm serve` against `llama-server` on the same GGUF file.

Requests: `RandomSpec` (bench/datasets.py, W's generator) with --num-requests of them, prompt lengths uniform in
--input-len, outputs in --output-len, random token ids, greedy, EOS ignored, all sent at once with at most
--concurrency in flight (bench/serve.py's streaming client). W itself is 64 requests; the default here is fewer
(the same length distribution and concurrency cap) because this model decodes ~30 tok/s alone on 2 cores and
the full W would take minutes per engine: see DEFAULT_REQUESTS.

The servers get the same settings where both have one: --threads (OMP_NUM_THREADS for ironlm; --threads and
--threads-batch for llama.cpp), one llama-server slot per request that can be in flight (--parallel, continuous
batching on), a slot context that holds the longest request (bench/llama_cpp.py's slot_context) and, for ironlm,
a KV pool of the same token count as llama-server's (parallel x slot context) and max_num_seqs = that parallel.
bench/serve_rounds.py runs them one at a time, alternating over --rounds, with each run's CPU split.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# W is 64 requests. A run lasts about as many decode steps as the longest output (256) plus the prompts' prefill, which
# llama.cpp does at ~100 tok/s on this model (llama-bench pp128, Q4_0): 16 requests (~4.4k prompt and ~2.2k output
# tokens, all in flight at once) keep llama-server's run near 90 s and ironlm's under a minute on the quiet 2-core
# machine, so two rounds of both fit ~6 minutes with the servers' start-up.
DEFAULT_REQUESTS = 16
BLOCK = 16  # ironlm's KV block size (its default): the pool is given in blocks


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--http: workload W over HTTP against llama-server")
    g.add_argument("--http", action="store_true")
    g.add_argument("--num-requests", type=int, default=DEFAULT_REQUESTS, help="W has 64")
    g.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    g.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    g.add_argument("--concurrency", type=int, default=64)
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--warmup", choices=("short", "none"), default="short",
                   help="untimed requests each server gets after it starts: short = two 8-token prompts")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--progress", action="store_true", help="progress bars")


def engines(path: Path, ds: Any, warm: Any, args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    from ironlm.bench.llama_cpp import LlamaServer, find_binary, slot_context
    from ironlm.bench.serve_rounds import Engine
    from ironlm.bench.server_process import ServerProcess

    binary = find_binary("llama-server")  # before any run: a missing build fails at once
    parallel = max(1, min(args.concurrency, len(ds.requests)))
    ctx = slot_context(ds.requests + (warm.requests if warm else []))
    blocks = parallel * ctx // BLOCK
    ironlm_args = ["--device", "cpu", "--seed", "0", "--max-model-len", str(ctx), "--max-num-seqs", str(parallel),
                   "--num-kv-blocks", str(blocks), "--block-size", str(BLOCK)]
    settings = {"threads": args.threads, "parallel": parallel, "ctx_per_slot": ctx, "kv_tokens": blocks * BLOCK,
                "ironlm_args": ironlm_args}
    return [Engine("ironlm", lambda: ServerProcess(str(path), ironlm_args, env={"OMP_NUM_THREADS": str(args.threads)})),
            Engine("llama.cpp", lambda: LlamaServer(path, threads=args.threads, parallel=parallel,
                                                    ctx_per_slot=ctx, binary=binary))], settings


def run_type(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ironlm.bench import datasets
    from ironlm.bench.serve import ServeConfig
    from ironlm.bench.serve_rounds import ratios, run_rounds
    from ironlm.bench.server_process import model_vocab_size

    spec = datasets.RandomSpec(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed)
    vocab = model_vocab_size(str(path))
    ds = datasets.random_dataset(spec, vocab)
    warm = datasets.warmup_dataset("random", vocab, args.warmup, random=spec)
    config = ServeConfig(model=str(path), max_concurrency=args.concurrency, progress=args.progress, seed=args.seed)
    pair, settings = engines(path, ds, warm, args)
    report = run_rounds(pair, config, ds, warm, args.rounds)
    return {"gguf": str(path), "dataset": ds.summary(), "settings": settings, **report,
            "ironlm_over_llama_cpp": ratios(report, "ironlm", "llama.cpp")}


def main(files: dict[str, Path], args: argparse.Namespace) -> int:
    from ironlm.bench.report import machine_info
    from ironlm.bench.serve_rounds import run_line

    machine = machine_info()
    out: dict[str, Any] = {"bench": "moe_http", "machine": machine, "types": {}}
    print(f"CPU: {machine['cpu_model']}; threads {args.threads} per server")
    failed = False
    for name, path in files.items():
        row = run_type(path, args)
        out["types"][name] = row
        d, st = row["dataset"], row["settings"]
        print(f"{name.upper()} ({path}): {d['num_requests']} requests, prompts {d['prompt_len_min']}-"
              f"{d['prompt_len_max']} ({d['prompt_tokens']} tokens), outputs {d['output_len_min']}-"
              f"{d['output_len_max']} ({d['output_tokens']} tokens), concurrency {args.concurrency}; "
              f"{st['parallel']} slots of {st['ctx_per_slot']} tokens, KV for {st['kv_tokens']} tokens")
        for run in row["runs"]:
            print("  " + run_line(run))
            s = run["summary"]
            failed |= s["failed"] > 0 or s["output_tokens"] != d["output_tokens"]
        for engine in ("ironlm", "llama.cpp"):
            cmd = next(run["command"] for run in row["runs"] if run["engine"] == engine)
            print(f"  {engine} server: {' '.join(map(str, cmd))}")
        r = row["ironlm_over_llama_cpp"]
        print(f"  {name.upper()} ironlm / llama-server output tok/s: "
              + ", ".join(f"round {i + 1} {x:.2f}x" for i, x in enumerate(r["per_round"]))
              + f"; medians {r['of_medians']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if failed:
        print("some requests failed or returned other than the requested token counts (see --json)")
    return 1 if failed else 0
