"""Overload with per-request timeouts: what load shedding changes, with and without it, on one `ironlm serve`.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_overload.py [MODEL] [--seconds 45] [--timeout 5]
        [--load 2] [--max-num-seqs 4] [--json F]

For each mode (shedding on, then `--no-load-shedding`) a fresh server: capacity is measured first (8 closed-loop
clients for 20 s, requests of 20-60 words and 32 output tokens), then Poisson arrivals at `load` x capacity for
`seconds`, every request with `"timeout": timeout`. Outcomes: `ok` (all 32 tokens in time), `partial` (200 with
finish_reason "timeout"), `503:timeout` (timed out before a token), `503:overloaded` (shed at once), with their
median and max latency; goodput = ok requests per second of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx

from ironlm.bench.server_process import ServerProcess

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "rivers", "run", "to", "sea",
         "and", "stars", "fall"]
OUTPUT_TOKENS = 32


def body(rng: random.Random, timeout: float | None) -> dict[str, Any]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
    out: dict[str, Any] = {"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}
    if timeout:
        out["timeout"] = timeout
    return out


async def one(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        resp = await client.post(url, json=payload)
    except httpx.HTTPError as exc:
        return f"error:{type(exc).__name__}", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    if resp.status_code == 200:
        return ("ok" if resp.json()["choices"][0]["finish_reason"] == "length" else "partial"), dt
    return f"{resp.status_code}:{resp.json().get('error', {}).get('code')}", dt


async def capacity(url: str, seconds: float = 20.0, clients: int = 8) -> float:
    rng, done = random.Random(1), 0
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=120) as client:
        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                kind, _ = await one(client, url, body(rng, None))
                done += kind == "ok"

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return done / (time.perf_counter() - t0)


async def overload(url: str, rate: float, seconds: float, timeout: float) -> tuple[list[tuple[str, float]], float]:
    rng = random.Random(2)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        tasks, at = [], 0.0
        t0 = time.perf_counter()
        while at < seconds:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(client, url, body(rng, timeout))))
            at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summary(results: list[tuple[str, float]], duration: float) -> dict[str, Any]:
    by: dict[str, list[float]] = {}
    for kind, dt in results:
        by.setdefault(kind, []).append(dt)
    out: dict[str, Any] = {kind: {"n": len(v), "median_s": round(statistics.median(v), 3), "max_s": round(max(v), 3)}
                           for kind, v in sorted(by.items())}
    return {**out, "sent": len(results), "goodput_req_s": round(len(by.get("ok", [])) / duration, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--load", type=float, default=2.0)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    report: dict[str, Any] = {}
    for mode, extra in (("shedding", []), ("no_shedding", ["--no-load-shedding"])):
        server = ServerProcess(args.model, ["--max-num-seqs", str(args.max_num_seqs), *extra])
        server.start(600)
        try:
            url = server.url + "/v1/completions"
            cap = asyncio.run(capacity(url))
            results, duration = asyncio.run(overload(url, args.load * cap, args.seconds, args.timeout))
        finally:
            server.stop()
        report[mode] = {"capacity_req_s": round(cap, 3), "rate_req_s": round(args.load * cap, 3),
                        "duration_s": round(duration, 1), **summary(results, duration)}
        print(mode, json.dumps(report[mode]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
