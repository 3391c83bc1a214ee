"""`ironlm bench serve`: online serving latency over real HTTP streaming (SSE), as `vllm bench serve` measures it.

Requests go to POST /v1/completions with `stream: true`, token-id prompts, `ignore_eos` and greedy sampling.
Arrivals are a Poisson process at `request_rate` (gamma-distributed gaps with shape `burstiness`: 1 is
Poisson, < 1 burstier, > 1 more regular; `inf` sends everything at once), optionally under a concurrency cap.

Per request: TTFT (send to first token chunk), E2E latency, TPOT = (E2E − TTFT) / (output tokens − 1) and
the inter-token gaps (ITL) between token chunks. Output tokens are the server's own `usage` count.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ironlm.bench.datasets import BenchRequest, Dataset, PrefixSpec, RandomSpec, make_dataset
from ironlm.bench.report import format_table, machine_info
from ironlm.bench.server_process import ServerProcess, model_vocab_size
from ironlm.stats import latency_summary


@dataclass
class ServeConfig:
    model: str | None = None  # for the server we start, and for the vocabulary of random prompts
    url: str | None = None  # an already-running server instead of starting one
    dataset: str = "random"
    random: RandomSpec = field(default_factory=RandomSpec)
    prefix: PrefixSpec = field(default_factory=PrefixSpec)
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    vocab_size: int | None = None  # default: read from the model
    seed: int = 0
    server_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0
    progress: bool = True


def quick(config: ServeConfig) -> ServeConfig:
    from dataclasses import replace

    return replace(config, random=RandomSpec(8, (16, 64), (8, 32), config.random.seed),
                   prefix=PrefixSpec(8, 256, 16, 8, config.prefix.seed))


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_tokens: int = 0
    token_chunks: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start) of n requests: gamma gaps with mean 1/rate, or all at 0 for rate inf."""
    if rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _http_errors() -> type[Exception]:
    import httpx

    return httpx.HTTPError


async def _one_request(client, url: str, model: str | None, req: BenchRequest, timeout: float) -> RequestResult:
    res = RequestResult(req.prompt_len, req.output_len)
    payload: dict[str, Any] = {"prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0.0,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    res.start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, timeout=timeout) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:300]
                    return res
                now = time.perf_counter()
                usage = obj.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens", 0))
                for choice in obj.get("choices") or ():
                    if choice.get("text") or choice.get("finish_reason") is None:  # a token, not the end marker
                        if res.token_chunks == 0:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        res.token_chunks += 1
                        last = now
        res.end = time.perf_counter()
        res.latency = res.end - res.start
        if not res.output_tokens:  # a server that sends no usage: one token per chunk
            res.output_tokens = res.token_chunks
        res.success = res.token_chunks > 0
        if not res.success:
            res.error = "no tokens streamed"
    except (OSError, ValueError, KeyError, TypeError, asyncio.TimeoutError, _http_errors()) as exc:
        # a failed request is counted as failed, never fatal to the benchmark
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    if not res.end:
        res.end = time.perf_counter()
    return res


async def _drive(config: ServeConfig, base_url: str, model_name: str | None, ds: Dataset) -> tuple[list, float]:
    import httpx
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + "/v1/completions"
    offsets = arrival_offsets(len(ds.requests), config.request_rate, config.burstiness, config.seed)
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = tqdm(total=len(ds.requests), unit="req", desc="serve bench", disable=not config.progress)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=config.request_timeout_s) as client:
        t0 = time.perf_counter()

        async def launch(req: BenchRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                res = await _one_request(client, url, model_name, req, config.request_timeout_s)
            else:
                async with sem:
                    res = await _one_request(client, url, model_name, req, config.request_timeout_s)
            bar.update(1)
            return res

        results = await asyncio.gather(*(launch(r, at) for r, at in zip(ds.requests, offsets)))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def _stats_ms(values: list[float]) -> dict[str, float]:
    return latency_summary(values, scale=1000.0)


def busy_fraction(results: list[RequestResult], duration: float) -> float:
    """Share of the run during which at least one request was in flight (union of request intervals)."""
    spans = sorted((r.start, r.end) for r in results if r.end > r.start)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / duration if duration > 0 else 0.0


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    checks = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return r.success and all(checks[k] * 1000.0 <= v for k, v in slo.items())


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    ttft = _stats_ms([r.ttft for r in ok])
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "expected_output_tokens": sum(r.expected_output_len for r in ok),
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "ttft_ms": ttft, "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl]), "e2el_ms": _stats_ms([r.latency for r in ok]),
        "ttft_p99_over_median": ttft["p99"] / ttft["median"] if ttft["median"] else 0.0,
        "busy_fraction": busy_fraction(results, duration),
        "errors": sorted({r.error for r in results if r.error})[:10],
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        summary["goodput"] = {"slo_ms": slo, "good_requests": good, "requests_per_s": good / duration}
    return summary


def run(config: ServeConfig) -> dict[str, Any]:
    for key in config.goodput:
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput SLO {key!r}: use ttft, tpot or e2el (in ms)")
    vocab = config.vocab_size or model_vocab_size(config.model)
    ds = make_dataset(config.dataset, vocab, random=config.random, prefix=config.prefix)
    server = None
    if config.url is None:
        server = ServerProcess(config.model, config.server_args)
        server.start(config.startup_timeout_s)
    base_url = config.url or server.url
    try:
        results, duration = asyncio.run(_drive(config, base_url, None, ds))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(results, duration, config.goodput)
    return {
        "bench": "serve",
        "config": {**asdict(config), "url": base_url, "started_server": server is not None},
        "machine": machine_info(),
        "dataset": ds.summary(),
        "summary": summary,
        "requests": [{k: v for k, v in asdict(r).items()} for r in results],
    }


def summary_text(report: dict[str, Any]) -> str:
    s = report["summary"]
    cfg = report["config"]
    lines = [(f"requests: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s "
              f"(rate {cfg['request_rate']}, burstiness {cfg['burstiness']}, "
              f"max concurrency {cfg['max_concurrency']}); server busy {100 * s['busy_fraction']:.0f}% of the run"),
             (f"throughput: {s['request_throughput']:.3f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
              f"{s['total_token_throughput']:.1f} total tok/s; output tokens {s['output_tokens']} "
              f"(expected {s['expected_output_tokens']})")]
    rows = [[name.upper(), s[key]["mean"], s[key]["median"], s[key]["p90"], s[key]["p99"]]
            for name, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2e", "e2el_ms"))]
    lines.append(format_table(["ms", "mean", "median", "p90", "p99"], rows))
    lines.append(f"TTFT p99 / median = {s['ttft_p99_over_median']:.2f}")
    if "goodput" in s:
        g = s["goodput"]
        lines.append(f"goodput {g['slo_ms']}: {g['good_requests']} requests, {g['requests_per_s']:.3f} req/s")
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    from ironlm.bench.report import plot_cdfs

    ok = [r for r in report["requests"] if r["success"]]
    series = {
        "TTFT": [r["ttft"] * 1000 for r in ok],
        "TPOT": [(r["latency"] - r["ttft"]) * 1000 / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1],
        "ITL": [g * 1000 for r in ok for g in r["itl"]],
        "E2E": [r["latency"] * 1000 for r in ok],
    }
    cfg = report["config"]
    plot_cdfs(path, series, title=f"ironlm serve: {len(ok)} requests, rate {cfg['request_rate']}/s, "
                                  f"concurrency cap {cfg['max_concurrency']}")
