"""Fair share on the real engine (in process, default model): fcfs vs fair, two tenants.

1. Heavy vs light: tenant `heavy` queues 48 requests at once, tenant `light` sends 4 a moment later; light's
   TTFT (wall clock, from its add_request) under each policy.
2. Shares: both tenants keep 16 requests queued all the time (weights heavy=1, light=2 under fair); the
   served tokens (prompt + generated, from the core's per-tenant counters) split over a fixed number of steps.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_fair_share.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from ironlm import EngineConfig, LLMEngine, _core
from ironlm.bench.report import machine_info
from ironlm.sampling_params import SamplingParams

MAX_NUM_SEQS = 8


def engine(policy: str, model: str | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", scheduling_policy=policy, max_num_seqs=MAX_NUM_SEQS,
                                  tenant_weights="heavy=1,light=2", enable_prefix_caching=False))


def prompt(i: int) -> str:
    return f"Request {i}: write a short story about the number {i} and a lighthouse."


def heavy_vs_light(eng: LLMEngine) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i in range(48):
        eng.add_request(f"h{i}", prompt(i), params, tenant="heavy")
    for _ in range(3):
        eng.step()
    sent: dict[str, float] = {}
    ttft: dict[str, float] = {}
    for i in range(4):
        sent[f"l{i}"] = time.monotonic()
        eng.add_request(f"l{i}", prompt(100 + i), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        tenant="light")
    t0 = time.monotonic()
    while eng.has_unfinished_requests():
        for out in eng.step():
            rid = out.request_id
            if rid in sent and rid not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[rid] = time.monotonic() - sent[rid]
    total = time.monotonic() - t0
    return {"light_ttft_max_s": max(ttft.values()), "light_ttft_mean_s": sum(ttft.values()) / len(ttft),
            "drain_s": total}


def shares(eng: LLMEngine, steps: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = {t: s["input_tokens"] + s["output_tokens"] for t, s in eng.scheduler.tenant_stats().items()}
    n = 0
    for _ in range(steps):
        stats = eng.scheduler.tenant_stats()
        for tenant in ("heavy", "light"):
            for _ in range(int(stats.get(tenant, {"live": 0})["live"]), 16):
                eng.add_request(f"s{n}", prompt(n), params, tenant=tenant)
                n += 1
        eng.step()
    stats = eng.scheduler.tenant_stats()
    served = {t: stats[t]["input_tokens"] + stats[t]["output_tokens"] - base.get(t, 0) for t in ("heavy", "light")}
    eng.abort_request([f"s{i}" for i in range(n)])
    while eng.has_unfinished_requests():
        eng.step()
    return {"light_share": served["light"] / (served["light"] + served["heavy"]), **served}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", help="default: the built-in SmolLM2-135M-Instruct")
    ap.add_argument("--json")
    args = ap.parse_args()
    report = {"machine": machine_info(), "core_version": getattr(_core, "__version__", None), "results": {}}
    for policy in ("fcfs", "fair"):
        eng = engine(policy, args.model)
        res = {**heavy_vs_light(eng), **shares(eng, args.steps)}
        report["results"][policy] = res
        print(policy, json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
