"""Ray Serve benchmark: `ironlm bench serve --url` against `ironlm.ray` deployments of the default model.

Configurations: 1 replica; 2 replicas routed by power of two choices only (`--routing pow2`); 2 replicas with
prefix affinity (`--routing prefix`). Workload: `--groups` concurrent `ironlm bench serve --dataset prefix`
clients, each with its own seed and so its own shared prefix (tenants with different system prompts),
interleaved in time. Reported per configuration: prefix-cache hit rate over all replicas (from the ingress's
merged /metrics, before/after), requests each replica served, TTFT median/p99 over all requests and output
tokens/s over the span of the timed requests.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/bench_ray_serve.py --json bench_out/ray_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

CONFIGS = (("1 replica", 1, "prefix"), ("2 replicas, power of two", 2, "pow2"),
           ("2 replicas, prefix affinity", 2, "prefix"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, dict[str, float]]:
    """{replica: {series: value}} of the counters this benchmark reads."""
    wanted = {"ironlm:prefix_cache_hits_total", "ironlm:prefix_cache_queries_total", "ironlm:request_success_total",
              "ironlm:num_preemptions_total"}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for s in family.samples:
            if s.name in wanted:
                per = out.setdefault(s.labels["replica"], {})
                per[s.name] = per.get(s.name, 0.0) + s.value
    return out


def run_clients(url: str, args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], float]:
    ironlm = str(Path(sys.executable).with_name("ironlm"))
    procs, paths = [], []
    t0 = time.perf_counter()
    for g in range(args.groups):
        path = workdir / f"group{g}.json"
        cmd = [ironlm, "bench", "serve", "--url", url, "--dataset", "prefix", "--num-requests",
               str(args.requests_per_group), "--prefix-len", str(args.prefix_len), "--suffix-len",
               str(args.suffix_len), "--prefix-output-len", str(args.output_len), "--seed", str(100 * g),
               "--max-concurrency", str(args.max_concurrency), "--warmup", "short", "--no-progress",
               "--json", str(path)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        paths.append(path)
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"ironlm bench serve exited {p.returncode}")
    wall = time.perf_counter() - t0
    requests = [r for path in paths for r in json.loads(path.read_text())["requests"]]
    return requests, wall


def measure(label: str, replicas: int, routing: str, args: argparse.Namespace, url: str) -> dict[str, Any]:
    from ray import serve

    from ironlm import EngineConfig
    from ironlm.config import ServerConfig
    from ironlm.ray import RayConfig
    from ironlm.ray.app import APP_NAME, build_application

    ray_config = RayConfig(num_replicas=replicas, routing=routing, replica_cpus=args.replica_cpus,
                           affinity_margin=args.affinity_margin)
    t0 = time.perf_counter()
    engine = EngineConfig(num_kv_blocks=args.num_kv_blocks)
    serve.run(build_application(engine, ServerConfig(), ray_config), name=APP_NAME, route_prefix="/")
    startup = time.perf_counter() - t0
    try:
        before = scrape(url)
        with tempfile.TemporaryDirectory() as tmp:
            requests, wall = run_clients(url, args, Path(tmp))
        after = scrape(url)
    finally:
        serve.delete(APP_NAME)
    delta = {rep: {k: v - before.get(rep, {}).get(k, 0.0) for k, v in vals.items()} for rep, vals in after.items()}
    hits = sum(d["ironlm:prefix_cache_hits_total"] for d in delta.values())
    queries = sum(d["ironlm:prefix_cache_queries_total"] for d in delta.values())
    ok = [r for r in requests if r["success"]]
    ttft = np.array([r["ttft"] for r in ok]) * 1000.0
    span = max(r["end"] for r in requests) - min(r["start"] for r in requests)
    return {
        "label": label, "replicas": replicas, "routing": routing, "startup_s": round(startup, 1),
        "requests": len(requests), "failed": len(requests) - len(ok), "wall_s": round(wall, 2),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        # Recomputing a preempted request looks its prompt up again: its hits count twice in the rate.
        "preemptions": int(sum(d.get("ironlm:num_preemptions_total", 0.0) for d in delta.values())),
        "prompt_tokens_computed": int(queries - hits),
        # Warm-up requests included: each client sends two short ones first.
        "requests_per_replica": sorted(int(d["ironlm:request_success_total"]) for d in delta.values()),
        "ttft_ms": {"median": round(float(np.median(ttft)), 1), "p99": round(float(np.percentile(ttft, 99)), 1)},
        # Over the span of the timed requests (perf_counter is CLOCK_MONOTONIC, one clock for all clients),
        # not the clients' own start-up.
        "span_s": round(span, 2),
        "output_tok_s": round(sum(r["output_tokens"] for r in ok) / span, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=4, help="concurrent clients, one shared prefix each")
    p.add_argument("--requests-per-group", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8, help="per client")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="also each replica's torch threads")
    p.add_argument("--affinity-margin", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per replica (16 tokens each; default: the engine's 1 GiB on CPU). Fewer than "
                        "all prefixes need makes each replica's cache hold only some of them")
    p.add_argument("--only", type=int, nargs="+", help="indices into the configurations (0, 1, 2)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    import ray
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    port = _free_port()
    ray.init(num_cpus=max(2, int(2 * args.replica_cpus)), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        for i, (label, replicas, routing) in enumerate(CONFIGS):
            if args.only is not None and i not in args.only:
                continue
            row = measure(label, replicas, routing, args, url)
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
