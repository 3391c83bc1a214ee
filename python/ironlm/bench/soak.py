"""`ironlm bench soak`: overload the server for minutes and check it gives everything back afterwards.

1. Capacity: a short closed loop (`capacity_concurrency` clients, each sending its next request when the last one
   ended) of well-behaved traffic; capacity = completed requests per second.
2. Soak: open-loop Poisson arrivals at `load` x capacity for `minutes`, of mixed traffic: completions and chat,
   streamed or not, greedy or sampled, a share of identical greedy requests (what dedupe shares), clients that
   disconnect mid-stream or give up on a plain request (aborts), and a few deliberately bad requests. Every valid
   request carries its own `timeout`, so the server can shed what it could not serve in time (503) instead of
   queueing without bound. Nothing is retried: a 503 is counted as shed.
3. Drain: wait for the clients still in flight (cancelling them after `drain_timeout_s`), then read /metrics until
   the engine is empty: running and waiting requests left over are *leaked*, as are KV blocks still held by
   requests (blocks only the prefix cache holds are free to evict, not leaked). Server RSS is sampled throughout;
   the growth is the end minus the sample taken after the capacity phase (allocators warmed up).

Outcomes per request: completed (200, finished by stop/length), timed_out (its own timeout: a 200 with finish reason
"timeout" or a 503 "timeout"), shed (any other 503), disconnected (the client left on purpose), rejected (a bad
request answered 4xx, as it must be), failed (anything else: 5xx, an error inside a stream, a stream cut short, a
connection error, a 4xx to a valid request or a 200 to a bad one).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ironlm.bench.datasets import token_floor
from ironlm.bench.report import format_table, machine_info
from ironlm.bench.server_process import ServerProcess, model_vocab_size, parse_metrics

OUTCOMES = ("completed", "timed_out", "shed", "disconnected", "rejected", "failed")
_WORDS = ("river", "engine", "garden", "winter", "signal", "market", "planet", "window", "letter", "forest",
          "bridge", "silver", "harbor", "thunder", "lantern", "meadow", "canyon", "violin", "orbit", "pepper")
_CAPACITY_MIN_COMPLETED = 8  # the capacity run goes on past its length until this many completed
_DUPLICATE_POOL = 4  # distinct identical-request payloads: each is sent many times over the run


@dataclass
class SoakConfig:
    model: str | None = None  # for the server we start, and the vocabulary of random prompts
    url: str | None = None  # soak a running server instead of starting `ironlm serve`
    server_pid: int | None = None  # with `url`: the process whose RSS to follow (default: unknown, not reported)
    minutes: float = 10.0
    load: float = 2.0  # offered rate = load x measured capacity
    capacity_seconds: float = 30.0
    capacity_concurrency: int = 16
    input_len: tuple[int, int] = (32, 256)  # prompt tokens of completions
    output_len: tuple[int, int] = (16, 128)
    request_timeout: float = 30.0  # each request's own `timeout` (s): what lets the server shed
    stream_share: float = 0.6
    chat_share: float = 0.3
    greedy_share: float = 0.5
    duplicate_share: float = 0.05
    disconnect_share: float = 0.1
    bad_share: float = 0.02
    drain_timeout_s: float = 60.0  # clients still in flight after the soak get this long, then are cancelled
    settle_timeout_s: float = 30.0  # then the engine gets this long to show empty
    rss_interval_s: float = 10.0
    vocab_size: int | None = None
    seed: int = 0
    server_args: list[str] = field(default_factory=list)
    threads: int | None = None
    startup_timeout_s: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("minutes", "load", "capacity_seconds", "request_timeout", "drain_timeout_s", "settle_timeout_s",
                     "rss_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.capacity_concurrency < 1:
            raise ValueError(f"capacity_concurrency must be >= 1, got {self.capacity_concurrency}")
        for name in ("stream_share", "chat_share", "greedy_share", "duplicate_share", "disconnect_share",
                     "bad_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range [lo, hi] with 1 <= lo <= hi, got [{lo}, {hi}]")


def quick(config: SoakConfig) -> SoakConfig:
    """Seconds, not minutes (`--quick`, the test): small requests, a short capacity run."""
    from dataclasses import replace

    return replace(config, minutes=min(config.minutes, 0.25), capacity_seconds=min(config.capacity_seconds, 4.0),
                   capacity_concurrency=min(config.capacity_concurrency, 4), input_len=(4, 24), output_len=(2, 12),
                   drain_timeout_s=min(config.drain_timeout_s, 20.0), rss_interval_s=min(config.rss_interval_s, 2.0))


@dataclass
class Planned:
    """One request to send: where, what, and how the client behaves."""

    kind: str  # completion | chat | duplicate | bad:<what>
    path: str
    body: dict[str, Any] | bytes  # bytes: sent as is (a malformed body)
    stream: bool
    disconnect_after_chunks: int | None = None  # streams: leave after this many data chunks
    give_up_after_s: float | None = None  # plain requests: the client's own timeout (it aborts the request)

    @property
    def bad(self) -> bool:
        return self.kind.startswith("bad:")


@dataclass
class Result:
    kind: str
    outcome: str
    status: int = 0
    detail: str = ""
    start: float = 0.0
    end: float = 0.0


# ---- the traffic ---------------------------------------------------------------------------------------
def _bad_requests(vocab: int, model: str | None) -> list[tuple[str, str, dict[str, Any] | bytes]]:
    """(what, path, body) of requests every OpenAI-compatible server must refuse with a 4xx."""
    return [
        ("malformed_json", "/v1/completions", b'{"prompt": "unterminated'),
        ("negative_max_tokens", "/v1/completions", {"prompt": "hello", "max_tokens": -1}),
        ("huge_max_tokens", "/v1/completions", {"prompt": "hello", "max_tokens": 2**70}),
        ("temperature_not_a_number", "/v1/completions", {"prompt": "hello", "temperature": "hot"}),
        ("token_beyond_vocab", "/v1/completions", {"prompt": [1, vocab + 5], "max_tokens": 2}),
        ("unknown_model", "/v1/completions", {"prompt": "hello", "model": f"{model or 'x'}-missing"}),
        ("empty_messages", "/v1/chat/completions", {"messages": [], "max_tokens": 2}),
        ("logit_bias_out_of_range", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 1000}}),
    ]


class Traffic:
    """Draws the soak's requests (seeded): every call to `next()` is one request."""

    def __init__(self, config: SoakConfig, vocab: int, seed: int) -> None:
        self.config, self.vocab = config, vocab
        self.rng = np.random.default_rng(seed)
        self.low = token_floor(vocab)
        self.bad = _bad_requests(vocab, None)
        self.n_bad = 0
        dup_rng = np.random.default_rng(config.seed + 7919)  # the same pool in the capacity and soak phases
        self.duplicates = [self._completion(dup_rng, greedy=True) for _ in range(_DUPLICATE_POOL)]

    def _len(self, rng: np.random.Generator, span: tuple[int, int]) -> int:
        return int(rng.integers(span[0], span[1] + 1))

    def _sampling(self, rng: np.random.Generator, greedy: bool) -> dict[str, Any]:
        if greedy:
            return {"temperature": 0.0}
        return {"temperature": 0.8, "top_p": 0.95}

    def _completion(self, rng: np.random.Generator, greedy: bool) -> dict[str, Any]:
        prompt = rng.integers(self.low, self.vocab, size=self._len(rng, self.config.input_len)).tolist()
        return {"prompt": prompt, "max_tokens": self._len(rng, self.config.output_len), "ignore_eos": True,
                **self._sampling(rng, greedy)}

    def _chat(self, rng: np.random.Generator, greedy: bool) -> dict[str, Any]:
        # About one word per 8 prompt tokens: real tokenizers take 1-2 tokens a word, byte-level test ones up to 8.
        lo, hi = self.config.input_len
        n_words = self._len(rng, (max(1, lo // 8), max(1, hi // 8)))
        words = " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n_words))
        return {"messages": [{"role": "user", "content": f"Write about {words}."}],
                "max_tokens": self._len(rng, self.config.output_len), **self._sampling(rng, greedy)}

    def next(self, well_behaved: bool = False) -> Planned:
        """A request of the mix; `well_behaved`: no bad requests, no disconnects (the capacity run)."""
        c, rng = self.config, self.rng
        if not well_behaved and rng.random() < c.bad_share:
            what, path, body = self.bad[self.n_bad % len(self.bad)]
            self.n_bad += 1
            return Planned(f"bad:{what}", path, body, stream=False)
        stream = bool(rng.random() < c.stream_share)
        if rng.random() < c.duplicate_share:
            kind, path = "duplicate", "/v1/completions"
            body = dict(self.duplicates[int(rng.integers(0, len(self.duplicates)))])
        elif rng.random() < c.chat_share:
            kind, path, body = "chat", "/v1/chat/completions", self._chat(rng, bool(rng.random() < c.greedy_share))
        else:
            kind, path = "completion", "/v1/completions"
            body = self._completion(rng, bool(rng.random() < c.greedy_share))
        body = {**body, "stream": stream, "timeout": c.request_timeout}
        planned = Planned(kind, path, body, stream)
        if not well_behaved and rng.random() < c.disconnect_share:
            if stream:
                planned.disconnect_after_chunks = int(rng.integers(1, 5))
            else:
                planned.give_up_after_s = float(rng.uniform(0.05, 1.0))
        return planned


# ---- one request ---------------------------------------------------------------------------------------
def _error_code(text: str) -> str | None:
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


async def send(client: Any, base_url: str, planned: Planned, timeout: float) -> Result:
    import httpx

    res = Result(planned.kind, "failed", start=time.monotonic())
    kwargs: dict[str, Any] = {"content": planned.body} if isinstance(planned.body, bytes) else {"json": planned.body}
    try:
        if planned.stream:
            await _stream(client, base_url + planned.path, kwargs, planned, res, timeout)
        else:
            limit = planned.give_up_after_s or timeout
            resp = await client.post(base_url + planned.path, timeout=limit, **kwargs)
            _classify(res, planned, resp.status_code, resp.text)
    except httpx.TimeoutException as exc:
        if planned.give_up_after_s is not None:
            res.outcome, res.detail = "disconnected", "client gave up"
        else:
            res.detail = f"client timeout: {type(exc).__name__}"
    except (httpx.HTTPError, OSError, ValueError) as exc:  # never fatal to the soak: counted as failed
        res.detail = f"{type(exc).__name__}: {exc}"[:300]
    res.end = time.monotonic()
    return res


def _classify(res: Result, planned: Planned, status: int, text: str) -> None:
    res.status = status
    if planned.bad:
        res.outcome = "rejected" if 400 <= status < 500 else ("shed" if status == 503 else "failed")
        if res.outcome == "failed":
            res.detail = f"bad request {planned.kind} answered {status}: {text[:200]}"
        return
    if status == 200:
        finishes = [c.get("finish_reason") for c in json.loads(text).get("choices", ())]
        res.outcome = "timed_out" if "timeout" in finishes else "completed"
        return
    if status == 503:
        res.outcome = "timed_out" if _error_code(text) == "timeout" else "shed"
        return
    res.detail = f"HTTP {status}: {text[:200]}"


async def _stream(client: Any, url: str, kwargs: dict[str, Any], planned: Planned, res: Result,
                  timeout: float) -> None:
    async with client.stream("POST", url, timeout=timeout, **kwargs) as resp:
        if resp.status_code != 200:
            _classify(res, planned, resp.status_code, (await resp.aread()).decode(errors="replace"))
            return
        res.status, chunks, finishes, done = 200, 0, [], False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                res.detail = f"error inside the stream: {str(obj['error'])[:200]}"
                return
            chunks += 1
            finishes += [c["finish_reason"] for c in obj.get("choices", ()) if c.get("finish_reason")]
            if planned.disconnect_after_chunks is not None and chunks >= planned.disconnect_after_chunks:
                res.outcome, res.detail = "disconnected", f"left after {chunks} chunks"
                return  # leaving the `async with` closes the connection mid-stream: the server must abort
        if not done or not finishes:
            res.detail = "stream ended without [DONE] or a finish reason"
            return
        res.outcome = "timed_out" if "timeout" in finishes else "completed"


# ---- the server's side: /metrics and RSS ------------------------------------------------------------------
def metric(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when absent)."""
    return sum(v for n, lb, v in samples if n == name and all(lb.get(k) == x for k, x in labels.items()))


async def scrape(client: Any, base_url: str) -> list[tuple[str, dict[str, str], float]]:
    resp = await client.get(base_url + "/metrics", timeout=30.0)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of a process (Linux /proc), or None where it cannot be read."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _engine_state(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    return {"running": metric(samples, "ironlm:num_requests_running"),
            "waiting": metric(samples, "ironlm:num_requests_waiting"),
            "kv_cache_usage_perc": metric(samples, "ironlm:kv_cache_usage_perc"),
            "kv_blocks_used": metric(samples, "ironlm:kv_cache_blocks", state="used")}


# ---- the phases ----------------------------------------------------------------------------------------
class _Soak:
    def __init__(self, config: SoakConfig, base_url: str, pid: int | None, vocab: int) -> None:
        self.config, self.base_url, self.pid = config, base_url.rstrip("/"), pid
        self.traffic = Traffic(config, vocab, config.seed)
        self.results: list[Result] = []
        self.rss: list[tuple[float, int]] = []  # (seconds into the soak, bytes)
        self.client_timeout = config.request_timeout + 60.0

    def log(self, message: str) -> None:
        if self.config.progress:
            print(f"[soak] {message}", file=sys.stderr, flush=True)

    async def capacity(self, client: Any) -> dict[str, Any]:
        c = self.config
        t0 = time.monotonic()
        stop_at, give_up_at = t0 + c.capacity_seconds, t0 + 10 * c.capacity_seconds + 60.0
        results: list[Result] = []

        def measuring() -> bool:
            # A rate needs a few completions: on a busy machine the first ones can take longer than the run.
            now = time.monotonic()
            enough = sum(r.outcome == "completed" for r in results) >= _CAPACITY_MIN_COMPLETED
            return now < give_up_at and (now < stop_at or not enough)

        async def worker() -> None:
            while measuring():
                results.append(await send(client, self.base_url, self.traffic.next(well_behaved=True),
                                          self.client_timeout))

        await asyncio.gather(*(worker() for _ in range(c.capacity_concurrency)))
        elapsed = time.monotonic() - t0
        counts = Counter(r.outcome for r in results)
        if not counts["completed"]:
            details = sorted({r.detail for r in results if r.detail})[:5]
            raise RuntimeError(f"capacity run completed no request in {elapsed:.1f} s: {dict(counts)} {details}")
        return {"requests_per_s": counts["completed"] / elapsed, "completed": counts["completed"],
                "elapsed_s": elapsed, "concurrency": c.capacity_concurrency, "outcomes": dict(counts)}

    async def soak(self, client: Any, rate: float) -> float:
        c = self.config
        duration = c.minutes * 60.0
        rng = np.random.default_rng(c.seed + 1)
        tasks: set[asyncio.Task[Result]] = set()
        t0 = time.monotonic()
        sampler = asyncio.ensure_future(self._sample_rss(t0))
        reporter = asyncio.ensure_future(self._report_progress(t0, tasks))
        at = 0.0
        try:
            while True:
                at += float(rng.exponential(1.0 / rate))
                if at >= duration:
                    break
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(send(client, self.base_url, self.traffic.next(), self.client_timeout))
                tasks.add(task)
                task.add_done_callback(self._collect(tasks))
            if tasks:
                self.log(f"soak over after {time.monotonic() - t0:.0f} s; waiting for {len(tasks)} clients")
                _, pending = await asyncio.wait(set(tasks), timeout=c.drain_timeout_s)
                for task in pending:  # cancelling a client closes its connection: the server sees it leave
                    task.cancel()
                    self.results.append(Result("unfinished", "disconnected", detail="cancelled after the soak"))
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            sampler.cancel()
            reporter.cancel()
        return time.monotonic() - t0

    def _collect(self, tasks: set[asyncio.Task[Result]]) -> Any:
        def done(task: asyncio.Task[Result]) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is None:
                self.results.append(task.result())
            elif not task.cancelled():
                self.results.append(Result("unknown", "failed", detail=repr(task.exception())[:300]))
        return done

    async def _sample_rss(self, t0: float) -> None:
        while True:
            value = rss_bytes(self.pid)
            if value is not None:
                self.rss.append((time.monotonic() - t0, value))
            await asyncio.sleep(self.config.rss_interval_s)

    async def _report_progress(self, t0: float, tasks: set[asyncio.Task[Result]]) -> None:
        while True:
            await asyncio.sleep(30.0)
            counts = Counter(r.outcome for r in self.results)
            self.log(f"{time.monotonic() - t0:.0f} s: {len(self.results)} done, {len(tasks)} in flight, "
                     + ", ".join(f"{k} {counts[k]}" for k in OUTCOMES))

    async def settle(self, client: Any) -> dict[str, Any]:
        """Poll /metrics until no request is running or waiting and no KV block is held (or the timeout)."""
        deadline = time.monotonic() + self.config.settle_timeout_s
        t0 = time.monotonic()
        while True:
            state = _engine_state(await scrape(client, self.base_url))
            empty = not (state["running"] or state["waiting"] or state["kv_blocks_used"])
            if empty or time.monotonic() > deadline:
                return {**state, "settled_after_s": time.monotonic() - t0, "empty": empty}
            await asyncio.sleep(0.5)


async def _run_against(config: SoakConfig, base_url: str, pid: int | None, vocab: int) -> dict[str, Any]:
    import httpx

    soak = _Soak(config, base_url, pid, vocab)
    # A fresh connection per request: a kept-alive one can be closed by the server's idle timeout just as the next
    # request goes out on it, a client-side race that would read as a server failure here.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        rss_start = rss_bytes(pid)
        soak.log(f"measuring capacity: {config.capacity_concurrency} clients, closed loop, "
                 f"{config.capacity_seconds:g} s")
        capacity = await soak.capacity(client)
        rate = config.load * capacity["requests_per_s"]
        rss_warm = rss_bytes(pid)
        soak.log(f"capacity {capacity['requests_per_s']:.2f} req/s; soaking {config.minutes:g} min at "
                 f"{config.load:g}x = {rate:.2f} req/s (Poisson)")
        duration = await soak.soak(client, rate)
        leak = await soak.settle(client)
        rss_end = rss_bytes(pid)
        samples = await scrape(client, base_url)
        health = (await client.get(base_url + "/health", timeout=30.0)).status_code
    results = soak.results
    counts = Counter(r.outcome for r in results)
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        by_kind.setdefault(r.kind.split(":")[0], dict.fromkeys(OUTCOMES, 0))[r.outcome] += 1
    rss_values = [v for _, v in soak.rss]
    summary = {
        "sent": len(results), **{k: counts[k] for k in OUTCOMES},
        "bad_sent": sum(r.kind.startswith("bad:") for r in results),
        "duration_s": duration, "offered_rate": rate,
        "completed_per_s": counts["completed"] / duration if duration else 0.0,
        "leaked": int(leak["running"] + leak["waiting"]), "kv_blocks_used_after": int(leak["kv_blocks_used"]),
        "health_after": health,
        "by_kind": by_kind,
        "failures": _failures(results),
    }
    server = {"requests_shed_total": metric(samples, "ironlm:requests_shed_total"),
              "circuit_breaker_trips_total": metric(samples, "ironlm:circuit_breaker_trips_total"),
              "dedupe_hits_total": metric(samples, "ironlm:dedupe_hits_total"),
              "result_cache_hits_total": metric(samples, "ironlm:result_cache_hits_total"),
              "request_success_total": {lb.get("finished_reason", ""): v for n, lb, v in samples
                                        if n == "ironlm:request_success_total"},
              "num_preemptions_total": metric(samples, "ironlm:num_preemptions_total")}
    rss = {"pid": pid, "start_bytes": rss_start, "warm_bytes": rss_warm, "end_bytes": rss_end,
           "peak_bytes": max(rss_values, default=None),
           "growth_bytes": rss_end - rss_warm if rss_end is not None and rss_warm is not None else None,
           "growth_second_half_bytes": _second_half_growth(soak.rss, duration),
           "samples": soak.rss}
    return {"capacity": capacity, "summary": summary, "leak": leak, "rss": rss, "server_metrics": server}


def _second_half_growth(samples: list[tuple[float, int]], duration: float) -> int | None:
    """RSS growth from the middle of the soak to its end: the steady state, after the high-water marks that
    the load's first minutes set (allocator arenas, batch-sized buffers) are reached."""
    half = [v for t, v in samples if t >= duration / 2]
    return half[-1] - half[0] if len(half) >= 2 else None


def _failures(results: list[Result], per_kind: int = 3) -> dict[str, list[str]]:
    """A few distinct failure details of each request kind (one kind's flood must not hide another's)."""
    out: dict[str, list[str]] = {}
    for r in results:
        if r.outcome == "failed":
            seen = out.setdefault(r.kind, [])
            if r.detail not in seen and len(seen) < per_kind:
                seen.append(r.detail)
    return out


def run(config: SoakConfig) -> dict[str, Any]:
    vocab = config.vocab_size or model_vocab_size(config.model)
    server = None
    pid: int | None
    if config.url is None:
        env = {} if config.threads is None else {"OMP_NUM_THREADS": str(config.threads)}
        server = ServerProcess(config.model, config.server_args, env=env)
        server.start(config.startup_timeout_s)
        assert server.proc is not None
        base_url, pid = server.url, server.proc.pid
    else:
        base_url, pid = config.url, config.server_pid
    try:
        result = asyncio.run(_run_against(config, base_url, pid, vocab))
    finally:
        if server is not None:
            server.stop()
    return {"bench": "soak", "config": {**asdict(config), "url": base_url, "started_server": server is not None},
            "machine": machine_info(), **result}


def passed(report: dict[str, Any]) -> bool:
    """Nothing leaked, no request failed, and the server is healthy afterwards."""
    s = report["summary"]
    return s["leaked"] == 0 and s["kv_blocks_used_after"] == 0 and s["failed"] == 0 and s["health_after"] == 200


def _mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"


def _signed_mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:+.1f} MiB"


def summary_text(report: dict[str, Any]) -> str:
    s, cap, rss, srv = report["summary"], report["capacity"], report["rss"], report["server_metrics"]
    cfg = report["config"]
    head = (f"soak: {s['duration_s'] / 60:.1f} min at {cfg['load']:g}x capacity; capacity "
            f"{cap['requests_per_s']:.2f} req/s ({cap['concurrency']} clients, closed loop, "
            f"{cap['elapsed_s']:.0f} s) -> offered {s['offered_rate']:.2f} req/s, Poisson")
    lines = [head]
    growth_text = _signed_mb(rss["growth_bytes"])
    rows = [["sent", s["sent"]], ["completed", s["completed"]], ["shed (503)", s["shed"]],
            ["timed out (own timeout)", s["timed_out"]], ["client disconnects / aborts", s["disconnected"]],
            ["bad requests rejected (4xx)", f"{s['rejected']} of {s['bad_sent']}"], ["failed", s["failed"]],
            ["leaked requests (running + waiting after drain)", s["leaked"]],
            ["KV blocks held after drain", s["kv_blocks_used_after"]],
            ["/health after", s["health_after"]],
            ["server RSS after capacity run -> end", f"{_mb(rss['warm_bytes'])} -> {_mb(rss['end_bytes'])}"],
            ["server RSS growth (peak)", f"{growth_text} (peak {_mb(rss['peak_bytes'])})"],
            ["server RSS growth over the soak's second half", _signed_mb(rss["growth_second_half_bytes"])]]
    lines.append(format_table(["outcome", "requests"], rows))
    lines.append(f"completed {s['completed_per_s']:.2f} req/s; server: shed {srv['requests_shed_total']:.0f}, "
                 f"breaker trips {srv['circuit_breaker_trips_total']:.0f}, dedupe hits {srv['dedupe_hits_total']:.0f}, "
                 f"result cache hits {srv['result_cache_hits_total']:.0f}, preemptions "
                 f"{srv['num_preemptions_total']:.0f}")
    if s["failures"]:
        lines += [f"failed {kind}: " + "; ".join(details) for kind, details in s["failures"].items()]
    lines.append("PASS: nothing leaked, nothing failed" if passed(report) else "FAIL: see above")
    return "\n".join(lines)
