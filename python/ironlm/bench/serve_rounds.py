"""The same requests over HTTP through several servers in rounds: one server alive at a time, the order reversed
every other round (a drift in the machine's load then falls on both sides), each run's CPU time accounted.

A run starts its server, sends the untimed warm-up requests, then the timed ones (bench/serve.py's client: streamed
/v1/completions, greedy, EOS ignored), and stops the server. Its CPU time is split three ways from /proc: the
server's process tree, this client process, and everything else: on a shared machine the other processes' share
says how much the figures can be trusted.

A request whose text the server held back until the end (llama-server sends no chunk while the text so far ends in
an incomplete UTF-8 sequence, as a random-weight model's byte tokens can leave it for the whole output) still
counts as completed when the server's usage reports its tokens: it is in the throughput, not in the latency
statistics (its TTFT and TPOT are unknown), and the run reports how many there were (`held_back`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ironlm.bench.datasets import Dataset
from ironlm.bench.report import CpuWatch
from ironlm.bench.serve import RequestResult, ServeConfig, drive, summarize
from ironlm.bench.server_process import ServerProcess


@dataclass
class Engine:
    name: str
    make: Callable[[], ServerProcess]  # a fresh, unstarted server


_LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "ttft_p99_over_median")


def summarize_run(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """serve.summarize, with held-back requests completed for the counts and left out of the latencies."""
    held = [r for r in results if not r.success and r.token_chunks == 0 and r.output_tokens > 0]
    for r in held:
        r.success, r.error = True, ""
    summary = summarize(results, duration, {})
    if held:
        streamed = [r for r in results if r.success and r.token_chunks > 0]
        latency = summarize(streamed, duration, {})
        summary.update({k: latency[k] for k in _LATENCY_KEYS})
    summary["held_back"] = len(held)
    return summary


def run_once(engine: Engine, config: ServeConfig, ds: Dataset, warm: Dataset | None, label: str) -> dict[str, Any]:
    server = engine.make()
    t0 = time.perf_counter()
    server.start(config.startup_timeout_s)
    startup = time.perf_counter() - t0
    try:
        if warm is not None and warm.requests:
            drive(config, server.url, warm, None, f"{label} warm-up")
        assert server.proc is not None
        watch = CpuWatch()
        watch.start()
        results, duration = drive(config, server.url, ds, None, label)
        cpu = watch.stop(server.proc.pid)
        command = server.command()
    finally:
        server.stop()
    summary = summarize_run(results, duration)
    summary["cpu"] = cpu
    run: dict[str, Any] = {"engine": engine.name, "summary": summary, "command": command, "startup_s": startup}
    describe = getattr(server, "describe", None)
    if describe is not None:
        run["server"] = describe()
    return run


def run_rounds(engines: list[Engine], config: ServeConfig, ds: Dataset, warm: Dataset | None,
               rounds: int) -> dict[str, Any]:
    """Each round runs every engine once; odd rounds in reverse order. Per engine the median output tok/s."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    runs = []
    for r in range(rounds):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            run = run_once(engine, config, ds, warm, f"{engine.name} round {r + 1}")
            run["round"] = r
            runs.append(run)
    median = {e.name: statistics.median(run["summary"]["output_token_throughput"] for run in runs
                                        if run["engine"] == e.name) for e in engines}
    return {"runs": runs, "median_output_tok_s": median}


def ratios(report: dict[str, Any], ours: str, theirs: str) -> dict[str, Any]:
    """ours / theirs output tok/s: each round's, and of the medians."""
    by_round: dict[int, dict[str, float]] = {}
    for run in report["runs"]:
        by_round.setdefault(run["round"], {})[run["engine"]] = run["summary"]["output_token_throughput"]
    per_round = [r[ours] / r[theirs] for _, r in sorted(by_round.items()) if r.get(theirs)]
    med = report["median_output_tok_s"]
    return {"per_round": per_round, "of_medians": med[ours] / med[theirs] if med[theirs] else float("nan")}


def run_line(run: dict[str, Any]) -> str:
    s, cpu = run["summary"], run["summary"]["cpu"]
    others = ", ".join(f"{o['comm']} {o['cores']:.2f}" for o in cpu["top_others"])
    held = f" ({s['held_back']} held back: no latency)" if s["held_back"] else ""
    return (f"round {run['round'] + 1} {run['engine']} (started in {run['startup_s']:.0f} s): {s['completed']} "
            f"done{held}, {s['failed']} failed in {s['duration_s']:.1f} s, {s['output_token_throughput']:.1f} output tok/s, "
            f"{s['total_token_throughput']:.1f} total tok/s, TTFT median {s['ttft_ms']['median']:.0f} ms, "
            f"TPOT median {s['tpot_ms']['median']:.0f} ms; CPU cores busy: server {cpu['server_cores']:.2f}, "
            f"client {cpu['client_cores']:.2f}, other processes {cpu['other_cores']:.2f} of {cpu['cpus']}"
            + (f" (top: {others})" if others else ""))
