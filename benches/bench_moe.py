"""A random-weight MoE of OLMoE-1B-7B's layer geometry, as GGUF Q8_0 / Q4_0 made by llama.cpp's own tools, run by
ironlm and by llama-bench on the same file with the same threads: single-stream prefill and decode.

    python benches/bench_moe.py [--layers 8] [--types q8_0,q4_0] [--threads 2] [--prompt 128] [--gen 64] [--rounds 2]
    python benches/bench_moe.py --http [--num-requests 16] [--concurrency 64] [--rounds 2] [--types q4_0]

Geometry (allenai/OLMoE-1B-7B-0924's config.json): hidden 2048, 16 heads (head_dim 128, no GQA), 64 experts of
1024, top-8, norm_topk_prob false, full-width qk-norm, vocab 50304, rms_norm_eps 1e-5. `--layers` scales the
depth (16 in the real model; 8 layers: ~3.5B parameters, ~3.7 GB at Q8_0) to fit the machine. Weights are random
(no hub here); a decode step's cost does not depend on their values, only on which experts are routed, and a
random router spreads tokens as a trained one roughly does.

Printed per type: ironlm's and llama.cpp's prefill and decode tokens/s, the bytes one decode token reads (the
attention and head matrices plus top_k of each layer's experts: the active weights) and the read rate that
implies, the bytes a decode step did stream (the same non-expert matrices plus the experts the core's MoE kernel
reports reading, `MoeBlock.streamed`, over the decode steps of the run) against those active bytes, and the
machine's busy fraction during each run (/proc/stat: other processes' load shows there). The per-layer call time
of that kernel against the per-expert loop is benches/bench_moe_layer.py.
Files go to --out (made once, reused); `--gguf PATH` runs an existing file instead.

`--http`: workload W over HTTP against llama-server (benches/moe_http.py): the same random requests (prompts
uniform in --input-len, outputs in --output-len, greedy, EOS ignored, streamed, at most --concurrency in flight)
through `ironlm serve` and `llama-server` on the same GGUF with the same threads, one server alive at a time, the
order alternated over --rounds; printed: each run's throughput, latency and CPU split (server, client, other
processes), both server command lines, the CPU model and the ironlm / llama-server output tok/s ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ironlm.bench.report import cpu_jiffies, cpu_model, read_bandwidth_gbs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_http  # benches/ is not a package: found through sys.path
from make_gemma_gguf import make_tokenizer, quantize


def _busy_since(start: tuple[int, int]) -> float:
    b1, t1 = cpu_jiffies()
    return (b1 - start[0]) / max(1, t1 - start[1])


def make_hf(out: Path, args: argparse.Namespace, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, OlmoeConfig

    config = OlmoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.expert_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=False, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(str(out))
    make_tokenizer(out, args.vocab)
    return out


def dense_bytes(llm: Any) -> int:
    """Weight bytes every decode token reads whatever its routing: every linear but the routed experts."""
    net = llm.engine.runner.model
    total = net.head.nbytes
    for layer in net.layers:
        total += layer.qkv.nbytes + layer.o.nbytes
        if layer.moe is None:
            total += layer.gate_up.nbytes + layer.down.nbytes
            continue
        total += layer.moe.router_weight.numel() * layer.moe.router_weight.element_size()
        if layer.moe.shared is not None:
            total += layer.moe.shared.gate_up.nbytes + layer.moe.shared.down.nbytes
    return total


def active_bytes(llm: Any) -> int:
    """Weight bytes one decode token reads: every linear but the experts, plus top_k experts a sparse layer."""
    total = dense_bytes(llm)
    for layer in llm.engine.runner.model.layers:
        if layer.moe is not None:
            experts = layer.moe.experts
            per_expert = sum(m.gate_up.nbytes + m.down.nbytes for m in experts) / len(experts)
            total += int(layer.moe.spec.top_k * per_expert)
    return total


def expert_bytes_read(llm: Any) -> int:
    """Routed-expert weight bytes the core's MoE kernel has read so far, all layers (MoeBlock.streamed)."""
    return sum(layer.moe.streamed for layer in llm.engine.runner.model.layers if layer.moe is not None)


class IronlmRun:
    """ironlm on one GGUF file, loaded once; `measure()` times a prefill and a decode (one round)."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        from ironlm import LLM

        torch.set_num_threads(args.threads)
        self.args = args
        # No prefix caching: every timed run sends the same prompt, which the cache would serve all but the last
        # token of, and "prefill" would time one token (the figures before this fix did).
        self.llm = LLM(str(path), device="cpu", seed=0, max_model_len=args.prompt + args.gen + 16,
                       enable_prefix_caching=False)
        self.prompt = {"prompt_token_ids": [(7 * i) % (args.vocab - 10) + 5 for i in range(args.prompt)]}
        self.timed(4)  # warm-up: first-call allocations, thread pool start

    def timed(self, n: int) -> float:
        from ironlm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        (out,) = self.llm.generate([self.prompt], sp, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if out.num_cached_tokens:
            raise RuntimeError(f"{out.num_cached_tokens} prompt tokens came from a cache: prefill is not timed")
        return elapsed

    def read(self, n: int) -> tuple[float, int]:
        before = expert_bytes_read(self.llm)
        return self.timed(n), expert_bytes_read(self.llm) - before

    def measure(self) -> dict[str, float]:
        args, llm = self.args, self.llm
        busy = cpu_jiffies()
        prefills = [self.read(1) for _ in range(args.reps)]
        fulls = [self.read(args.gen) for _ in range(args.reps)]
        prefill, full = min(t for t, _ in prefills), min(t for t, _ in fulls)
        # the decode steps' expert reads: a full run's less a prefill-only run's (the same prompt routes the same)
        step_experts = (fulls[-1][1] - prefills[-1][1]) / (args.gen - 1)
        out = {"prefill_tok_s": args.prompt / prefill, "decode_tok_s": (args.gen - 1) / max(full - prefill, 1e-9),
               "busy": _busy_since(busy), "active_bytes": float(active_bytes(llm)),
               "streamed_bytes": dense_bytes(llm) + step_experts}
        out["read_gb_s"] = out["active_bytes"] * out["decode_tok_s"] / 1e9
        out["streamed_over_active"] = out["streamed_bytes"] / out["active_bytes"]
        return out


def run_llama(path: Path, args: argparse.Namespace) -> dict[str, float]:
    from ironlm.bench.llama_cpp import run_bench

    busy = cpu_jiffies()
    out = run_bench(path, prompt_len=args.prompt, gen_len=args.gen, threads=args.threads)
    return {**out, "busy": _busy_since(busy)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "olmoe-random")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-size", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-llama", action="store_true", help="ironlm only (no llama.cpp build)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--gguf", type=Path, action="append", default=None,
                    help="an existing GGUF file to run (repeatable); skips making the model")
    moe_http.add_args(ap)
    args = ap.parse_args(argv)
    if args.gguf:
        files = {p.stem.rsplit(".", 1)[-1].lower(): p for p in args.gguf}
        return moe_http.main(files, args) if args.http else _single(files, args)
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_convert import convert_many  # type: ignore[import-not-found]  # tests/ is not a package

    hf = args.out / "hf"
    if not (hf / "config.json").is_file():
        make_hf(hf, args)
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    files: dict[str, Path] = {}
    for t in types:
        dest = args.out / f"olmoe-random.{t.upper()}.gguf"
        if not dest.is_file():
            if t == "q4_0":  # llama-quantize makes Q4_0, from bf16 (it refuses to requantize Q8_0)
                bf16 = args.out / "olmoe-random.BF16.gguf"
                if not bf16.is_file():
                    convert_many([(hf, "bf16")], args.out, "gpt-2", [bf16.name])
                if quantize(bf16, dest, "Q4_0") is None:
                    print("no llama-quantize binary: Q4_0 skipped")
                    continue
            else:
                convert_many([(hf, t)], args.out, "gpt-2", [dest.name])
        files[t] = dest
    if args.http:
        return moe_http.main(files, args)
    return _single(files, args)


def _median_row(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def _single(files: dict[str, Path], args: argparse.Namespace) -> int:
    """Per file: ironlm loaded once, then --rounds rounds of (ironlm, llama-bench), alternating, so that a drift
    in the machine's memory bandwidth (a shared VM's neighbours move it by up to 2x here) lands on both; medians
    and each round's ratio printed."""
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu_model()}
    print("CPU:", cpu_model())
    for t, path in files.items():
        engine = IronlmRun(path, args)
        rounds: list[dict[str, Any]] = []
        for _ in range(max(1, args.rounds)):
            one: dict[str, Any] = {"ironlm": engine.measure(), "machine_read_gb_s": read_bandwidth_gbs()}
            if not args.skip_llama:
                one["llama.cpp"] = run_llama(path, args)
                one["llama.cpp"]["read_gb_s"] = one["ironlm"]["active_bytes"] * one["llama.cpp"]["decode_tok_s"] / 1e9
            rounds.append(one)
        del engine
        row: dict[str, Any] = {"rounds": rounds, "ironlm": _median_row([r["ironlm"] for r in rounds]),
                               "machine_read_gb_s": statistics.median(r["machine_read_gb_s"] for r in rounds)}
        if not args.skip_llama:
            row["llama.cpp"] = _median_row([r["llama.cpp"] for r in rounds])
            row["decode_ratio_per_round"] = [r["ironlm"]["decode_tok_s"] / r["llama.cpp"]["decode_tok_s"]
                                             for r in rounds]
            # The most any engine reading the active bytes could beat llama.cpp by at the bandwidth of the round.
            row["decode_ratio_ceiling_per_round"] = [r["machine_read_gb_s"] / r["llama.cpp"]["read_gb_s"]
                                                     for r in rounds]
        results[t] = row
        print(t.upper(), json.dumps({k: v for k, v in row.items() if k != "rounds"}, indent=1))
        a = row["ironlm"]
        print(f"  {t.upper()}: a decode step streamed {a['streamed_bytes'] / 1e6:.1f} MB against "
              f"{a['active_bytes'] / 1e6:.1f} MB of active parameters ({a['streamed_over_active']:.3f})")
        if "llama.cpp" in row:
            a, b = row["ironlm"], row["llama.cpp"]
            per = ", ".join(f"{x:.2f}" for x in row["decode_ratio_per_round"])
            print(f"  {t.upper()}: decode {a['decode_tok_s']:.2f} vs {b['decode_tok_s']:.2f} tok/s "
                  f"({a['decode_tok_s'] / b['decode_tok_s']:.2f}x; rounds {per}), prefill {a['prefill_tok_s']:.1f} "
                  f"vs {b['prefill_tok_s']:.1f} ({a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x); medians of "
                  f"{len(rounds)} rounds; ironlm reads {a['active_bytes'] / 1e6:.0f} MB a token = "
                  f"{a['read_gb_s']:.1f} GB/s, llama.cpp {b['read_gb_s']:.1f}, the machine "
                  f"{row['machine_read_gb_s']:.1f} (torch sum; ratio ceiling each round: "
                  + ", ".join(f"{x:.2f}" for x in row["decode_ratio_ceiling_per_round"]) + ")")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
