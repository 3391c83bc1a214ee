"""One quantized MoE layer's routed experts on the CPU: the core's kernel (`_core.MoeExperts`, one call a layer)
against MoeBlock's per-expert loop (two QuantLinear calls and an activation an expert, from Python), and the weight
bytes a step streams against the active-parameter bytes.

    python benches/bench_moe_layer.py [--hidden 1024] [--experts 64] [--expert-size 512] [--top-k 8]
                                      [--bits 8,4] [--tokens 1,2,4,16] [--threads 2] [--reps 200]

Default geometry: OLMoE-1B-7B's layer (64 experts, top-8) at half its width (hidden 2048 -> 1024, experts of 1024
-> 512), int8 per channel and int4 in groups of 32 quantized at load (the kernels are the ones GGUF Q8_0 / Q4_0
blocks run on). Random weights and router: a step's cost depends on how many distinct experts its tokens pick,
which a random router spreads as a trained one roughly does.

Printed per (bits, tokens): the median call time of the loop and of the core (ms) and their ratio, bit-identity of
the two outputs, and the bytes streamed (the distinct routed experts' packed bytes, as the kernel reports them)
against the active-parameter bytes (tokens x top_k experts: what the step would read if no two tokens shared an
expert). At one token the two are equal by construction; from two tokens on, shared experts are read once. Also
the machine's busy fraction over the run (/proc/stat: other processes' load shows there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ironlm import _core
from ironlm.bench.report import cpu_jiffies
from ironlm.model.linear import QuantLinear
from ironlm.model.moe.experts import MoeBlock
from ironlm.model.moe.route import route
from ironlm.model.moe.spec import MoeConfig, RouteSpec
from ironlm.model.quantize import QuantSpec, from_float


def make_block(args: argparse.Namespace, bits: int) -> MoeBlock:
    cfg = MoeConfig(RouteSpec(args.experts, args.top_k), args.expert_size, (True,))
    block = MoeBlock(args.hidden, cfg, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    spec = QuantSpec(bits=bits, group_size=0 if bits == 8 else 32)
    block.quantize_(lambda pieces, bias: QuantLinear(
        _core.QuantMatrix.concat([from_float(w, spec) for _, w in pieces]), bias))
    return block


def time_calls(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(block: MoeBlock, tokens: int, reps: int) -> dict[str, float]:
    x = torch.randn(tokens, block.router_weight.shape[0], generator=torch.Generator().manual_seed(tokens))
    weights, ids = route(torch.mm(x, block.router_weight), block.spec)
    core = block.core
    assert core is not None and block.experts is not None
    with torch.no_grad():
        before = block.streamed
        got = block.run_experts(x, weights, ids)
        streamed = block.streamed - before
        t_core = time_calls(lambda: block.run_experts(x, weights, ids), reps)
        block.core = None
        try:
            want = block.run_experts(x, weights, ids)
            t_loop = time_calls(lambda: block.run_experts(x, weights, ids), reps)
        finally:
            block.core = core
    per_expert = block.experts[0].gate_up.nbytes + block.experts[0].down.nbytes
    active = tokens * block.spec.top_k * per_expert
    return {"loop_ms": t_loop, "core_ms": t_core, "speedup": t_loop / t_core, "identical": bool(torch.equal(got, want)),
            "streamed_mb": streamed / 1e6, "active_mb": active / 1e6, "streamed_over_active": streamed / active}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-size", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--tokens", default="1,2,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    busy = cpu_jiffies()
    results = []
    for bits in (int(b) for b in args.bits.split(",")):
        block = make_block(args, bits)
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = {"bits": bits, "tokens": tokens, **run(block, tokens, args.reps)}
            results.append(row)
            print(f"int{bits} T={tokens:3d}: loop {row['loop_ms']:.3f} ms, core {row['core_ms']:.3f} ms "
                  f"({row['speedup']:.2f}x), identical {row['identical']}; streamed {row['streamed_mb']:.2f} MB of "
                  f"{row['active_mb']:.2f} MB active ({row['streamed_over_active']:.2f})")
    b1, t1 = cpu_jiffies()
    frac = (b1 - busy[0]) / max(1, t1 - busy[1])
    print(f"machine busy {frac:.0%} over the run ({args.threads} threads asked)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "busy": frac, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
