"""Prometheus metrics, named like vLLM's with the `ironlm:` prefix.

Engine-wide figures (queue sizes, KV usage, token and prefix-cache counters) are read from the engine's
stats snapshot at scrape time by a custom collector, so they cost nothing between scrapes. Per-request
timings are observed on the engine thread as outputs come out of a step, which measures the engine and
not how fast each HTTP client reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ironlm.engine.outputs import RequestOutput
from ironlm.engine.protocol import OutputObserver

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)

# (metric, stats key, help) for values that come straight from engine.stats()
_GAUGES = (
    ("num_requests_running", "num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage_perc", ("Fraction of KV blocks held by requests (1 = full); "
                                                    "cached-but-evictable blocks are not counted.")),
    ("model_weight_bytes", "model_weight_bytes", ("Resident bytes of the model weights as stored (quantized "
                                                  "blocks or dense tensors).")),
    ("kv_bytes_per_token", "kv_bytes_per_token", ("KV cache bytes one token occupies over all layers (one latent "
                                                  "row per layer under multi-head latent attention).")),
    ("result_cache_size", "result_cache_size", "Finished results held by the result cache (--result-cache-size)."),
    ("kv_waste_perc", "kv_waste_perc", ("Internal fragmentation of the running sequences' KV blocks: 1 - token "
                                        "slots filled / token slots held.")),
    ("kv_blocks_pinned", "blocks_pinned", "Device KV blocks pinned for good (--kv-pin-prefix)."),
)
_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens of all requests added."),
    ("generation_tokens", "generation_tokens_total", "Tokens generated."),
    ("num_preemptions", "num_preemptions", "Requests preempted (recomputed) for lack of KV blocks."),
    ("engine_restarts", "num_engine_restarts", "Engine loop restarts after repeated step failures."),
    ("dedupe_hits", "dedupe_hits_total", "Requests that joined an identical running request's sequence."),
    ("result_cache_hits", "result_cache_hits_total", "Requests answered from the result cache, without the engine."),
    ("kv_promotions", "kv_promotions", "KV blocks copied back from the tier to the device pool (hits, swap-ins)."),
    ("kv_demotions", "kv_demotions", "KV blocks copied from the device pool down to the tier (evictions, swap-outs)."),
    ("kv_swap_in_blocks", "swap_in_blocks", "KV blocks of preempted requests copied back on resume (--swap-space)."),
    ("kv_swap_out_blocks", "swap_out_blocks", "KV blocks of preempted requests copied to the tier (--swap-space)."),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Sequence-steps that verified speculative proposals."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Speculative tokens proposed."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Speculative tokens accepted."),
    ("spec_decode_grammar_cut_tokens", "spec_decode_grammar_cut_tokens",
     "Speculative tokens a structured-output grammar rejected before verification."),
    ("spec_decode_paused_steps", "spec_decode_paused_steps",
     "Steps the speculation cost model ran without proposals (predicted slower: compute-bound or poor acceptance)."),
)
_TIERS = ("device", "host", "disk")
_TIER_OF_KIND = {"memory": "host", "disk": "disk"}  # LLMEngine.stats()["kv_tier"] -> the tier label


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict], healthy: Callable[[], bool], model_name: str) -> None:
        self._stats, self._healthy, self._model = stats, healthy, model_name

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(f"ironlm:{name}", doc, labels=["model_name"])
            g.add_metric([self._model], float(s.get(key, 0)))
            yield g
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(f"ironlm:{name}", doc, labels=["model_name"])
            c.add_metric([self._model], float(s.get(key, 0)))
            yield c
        blocks = GaugeMetricFamily("ironlm:kv_cache_blocks", "KV blocks by state.", labels=["model_name", "state"])
        for state in ("free", "used", "cached"):
            blocks.add_metric([self._model, state], float(s.get(f"blocks_{state}", 0)))
        yield blocks
        yield from self._kv_tiers(s)
        yield from self._spec(s)
        up = GaugeMetricFamily("ironlm:engine_healthy", "1 while the engine loop is alive.", labels=["model_name"])
        up.add_metric([self._model], 1.0 if self._healthy() else 0.0)
        yield up


    def _spec(self, s: dict) -> Iterator[Metric]:
        """Speculative decoding: accepted tokens by proposal position, and the mean accepted length."""
        pos = CounterMetricFamily("ironlm:spec_decode_num_accepted_tokens_per_pos", "Speculative tokens accepted, "
                                  "by position in the proposal (0 = first).", labels=["model_name", "position"])
        for i, n in enumerate(s.get("spec_decode_accepted_per_pos", ())):
            pos.add_metric([self._model, str(i)], float(n))
        yield pos
        mean = GaugeMetricFamily("ironlm:spec_decode_mean_acceptance_length", "Tokens per speculative "
                                 "verification (accepted + the one sampled after them).", labels=["model_name"])
        mean.add_metric([self._model], float(s.get("spec_decode_mean_acceptance_length", 0.0)))
        yield mean
        rate = GaugeMetricFamily("ironlm:spec_decode_acceptance_rate_per_pos", "Share of verifications that "
                                 "accepted the proposal at this position (0 = first).",
                                 labels=["model_name", "position"])
        for i, r in enumerate(s.get("spec_decode_acceptance_per_pos", ())):
            rate.add_metric([self._model, str(i)], float(r))
        yield rate
        budget = GaugeMetricFamily("ironlm:spec_decode_budget", "The speculation cost model's proposal budget for "
                                   "the last step (0: paused, -1: no cost model).", labels=["model_name"])
        budget.add_metric([self._model], float(s.get("spec_decode_budget", -1)))
        yield budget
        total = GaugeMetricFamily("ironlm:spec_decode_acceptance_rate", "Accepted / proposed speculative tokens.",
                                  labels=["model_name"])
        total.add_metric([self._model], float(s.get("spec_decode_acceptance_rate", 0.0)))
        yield total

    def _kv_tiers(self, s: dict) -> Iterator[Metric]:
        """Where cached KV blocks live, and which tier prefix-cache hits were served from."""
        lower = _TIER_OF_KIND.get(s.get("kv_tier") or "")
        device_hits = s.get("prefix_cache_hits", 0) - s.get("prefix_hits_tier", 0)
        on_tier = s.get("tier_blocks_used", 0)
        blocks = GaugeMetricFamily("ironlm:kv_offload_blocks", "KV blocks held per tier (device: used + cached).",
                                   labels=["model_name", "tier"])
        hits = CounterMetricFamily("ironlm:prefix_cache_hits_by_tier", "Prompt tokens found in the prefix cache, "
                                   "by the tier their blocks were on (device, or host/disk: promoted).",
                                   labels=["model_name", "tier"])
        for tier in _TIERS:
            if tier == "device":
                held, hit = s.get("blocks_used", 0) + s.get("blocks_cached", 0), device_hits
            else:
                held, hit = (on_tier, s.get("prefix_hits_tier", 0)) if tier == lower else (0, 0)
            blocks.add_metric([self._model, tier], float(held))
            hits.add_metric([self._model, tier], float(hit))
        yield blocks
        yield hits


class ObserverGroup:
    """Several output observers behind the engine's one hook (metrics, the shedder's load tracker), in order."""

    def __init__(self, *observers: OutputObserver) -> None:
        self.observers = observers

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for observer in self.observers:
            observer.on_outputs(outputs, now)

    def on_aborted(self, request_ids: list[str]) -> None:
        for observer in self.observers:
            observer.on_aborted(request_ids)


class ServerMetrics:
    """Implements the AsyncLLMEngine output-observer protocol (on_outputs / on_aborted)."""

    def __init__(self, stats: Callable[[], dict], healthy: Callable[[], bool], model_name: str,
                 registry: CollectorRegistry | None = None) -> None:
        # A registry per server: several servers (tests) in one process do not collide.
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("ironlm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("ironlm:inter_token_latency_seconds", "Time between two output tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("ironlm:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("ironlm:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                               buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("ironlm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model = model_name
        for reason in ("stop", "length", "abort", "timeout", "error"):
            self._success.labels(model_name, reason)  # export zeros: rate() works from the first request
        self.registry.register(_StatsCollector(stats, healthy, model_name))
        # request id -> (time of its last new token, tokens seen); engine thread only.
        self._progress: dict[str, tuple[float, int]] = {}

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            n_tokens = sum(len(c.token_ids) for c in out.outputs)
            prev = self._progress.get(out.request_id)
            if prev is None:
                if n_tokens:
                    ttft = out.metrics.ttft
                    self.ttft.observe(ttft if ttft is not None else 0.0)
            elif n_tokens > prev[1]:
                self.itl.observe(now - prev[0])
            if n_tokens and (prev is None or n_tokens > prev[1]):
                self._progress[out.request_id] = (now, n_tokens)
            if out.finished:
                self._progress.pop(out.request_id, None)
                self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        reason = "error" if out.error else next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
        self._success.labels(self._model, reason).inc()

    def on_aborted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._progress.pop(rid, None)
            self._success.labels(self._model, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

