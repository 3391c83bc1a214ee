"""Load shedding: refuse at once (503 + Retry-After) a request the server cannot serve in time.

The estimate. Requests wait only while the running batch is full (or the KV pool is), and then the queue moves at
the rate running requests finish: a new request is admitted at about the (ahead + 1)-th finish from now, so its
wait is `(ahead + 1) / completion_rate` (the last of a k-prompt request's: `ahead + k`), where `ahead` is the
number of waiting requests that will be scheduled before it and `completion_rate` the measured finishes per second
over the last `_RATE_WINDOW_S`. `ahead` is the engine's own waiting count, and under the `priority` policy only
those of them with a priority at least as good (lower value) as the new request's, which the tracker below knows
from the requests it admitted and not yet saw produce a token. Before enough requests have finished to measure a
rate, nothing is shed by estimate (the queue-full limit still holds).

Its own service then takes about `prefill + (max_tokens - 1) * tpot`, both the means of recently finished requests
(measured under the current load, so the batch's slowdown is in them).

Shed, while requests are waiting (an idle server takes every request: a timeout is the client's to choose), when
- the estimated wait plus service exceeds the request's own `timeout`: it would time out, in the queue or with a
  partial answer, after holding a place others could have used; or the estimated wait exceeds `shed_max_wait`
  for a request without a timeout;
- at least `shed_priority_waiting` requests of a strictly better priority are waiting: under pressure the worse
  priorities go first, so the better ones keep the queue.
Retry-After says when the queue ahead would have drained enough, at least 1 s.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ironlm.engine import EngineClient
from ironlm.engine.outputs import RequestOutput
from ironlm.server.errors import APIError

_RATE_WINDOW_S = 30.0  # finishes older than this say little about the current load
_RATE_MIN_FINISHES = 4
REASONS = ("wait", "priority", "service")


@dataclass
class ShedDecision:
    reason: str  # one of REASONS
    retry_after: int
    message: str


class LoadTracker:
    """Observes the engine's outputs (an OutputObserver, engine thread) and the server's admissions (event loop):
    the priorities of admitted requests that have not produced a token yet, and recent finish times."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._pending: dict[str, int] = {}  # request id -> priority
        self._finishes: deque[float] = deque(maxlen=256)
        self._service: deque[tuple[float, float]] = deque(maxlen=64)  # recent (prefill s, s per output token)
        self._lock = threading.Lock()

    def admitted(self, request_id: str, priority: int) -> None:
        """Called before the request goes to the engine, so its first output cannot come before this."""
        with self._lock:
            self._pending[request_id] = priority

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        t = self.clock()
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._finishes.append(t)
                    self._pending.pop(out.request_id, None)
                    self._measure(out)
                elif any(c.token_ids for c in out.outputs):
                    self._pending.pop(out.request_id, None)

    def _measure(self, out: RequestOutput) -> None:
        m = out.metrics
        tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        if m.first_scheduled_time is None or m.first_token_time is None or m.last_token_time is None or tokens < 2:
            return
        self._service.append((m.first_token_time - m.first_scheduled_time,
                              (m.last_token_time - m.first_token_time) / (tokens - 1)))

    def service_time(self, max_tokens: int) -> float:
        """Expected seconds from being scheduled to the last of `max_tokens` tokens (0 before any measurement)."""
        with self._lock:
            samples = list(self._service)
        if not samples:
            return 0.0
        prefill = statistics.fmean(p for p, _ in samples)
        return prefill + (max_tokens - 1) * statistics.fmean(t for _, t in samples)

    def on_aborted(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._pending.pop(rid, None)

    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def pending_better_than(self, priority: int, inclusive: bool) -> int:
        with self._lock:
            if inclusive:
                return sum(p <= priority for p in self._pending.values())
            return sum(p < priority for p in self._pending.values())

    def completion_rate(self) -> float | None:
        """Finished requests per second over the last `_RATE_WINDOW_S`; None before there are enough of them."""
        now = self.clock()
        with self._lock:
            recent = [t for t in self._finishes if now - t <= _RATE_WINDOW_S]
        if len(recent) < _RATE_MIN_FINISHES:
            return None
        span = now - recent[0]
        return len(recent) / span if span > 0 else None


class Shedder:
    def __init__(self, engine: EngineClient, tracker: LoadTracker, *, max_wait_s: float | None = None,
                 priority_waiting: int | None = None, priority_policy: bool = False) -> None:
        """`priority_policy`: the engine orders its queue by priority, so better priorities wait behind fewer."""
        self.engine, self.tracker = engine, tracker
        self.max_wait_s, self.priority_waiting, self.priority_policy = max_wait_s, priority_waiting, priority_policy
        self.shed = dict.fromkeys(REASONS, 0)

    def decide(self, num_requests: int, priority: int, timeout: float | None,
               max_tokens: int | None = None) -> ShedDecision | None:
        stats = self.engine.stats()
        waiting = int(stats.get("num_requests_waiting", 0))
        if not waiting:  # nothing queued: a new request is scheduled at the next step...
            return self._decide_admitted(int(stats.get("num_requests_running", 0)), timeout, max_tokens)
        if self.priority_waiting is not None:
            better = min(waiting, self.tracker.pending_better_than(priority, inclusive=False))
            if better >= self.priority_waiting:
                rate = self.tracker.completion_rate()
                return ShedDecision("priority", _seconds(better / rate if rate else 1.0),
                                    f"{better} requests of a better priority than {priority} are waiting")
        limit = timeout if timeout is not None else self.max_wait_s
        rate = self.tracker.completion_rate()
        if limit is None or rate is None:
            return None
        ahead = waiting
        if self.priority_policy:
            ahead = min(waiting, self.tracker.pending_better_than(priority, inclusive=True))
        wait = (ahead + num_requests) / rate
        service = self.tracker.service_time(max_tokens) if timeout is not None and max_tokens else 0.0
        if wait + service <= limit:
            return None
        what = f"queue wait {wait:.1f} s ({ahead} requests ahead, {rate:.2f} finish per second)"
        if service:
            what += f" + {service:.1f} s for {max_tokens} tokens"
        return ShedDecision("wait", _seconds(min(wait, wait + service - limit)),
                            f"the estimated {what} exceeds the request's "
                            f"{'timeout' if timeout is not None else 'wait limit'} ({limit:g} s)")

    def _decide_admitted(self, running: int, timeout: float | None, max_tokens: int | None) -> ShedDecision | None:
        """...but a batch with room (the default 256 sequences on a CPU) can still be too slow: refuse a request
        whose own tokens, at the pace the running batch's requests were served, outlast its timeout. An idle
        engine takes everything (its timeout is then the client's choice)."""
        if not running or timeout is None or not max_tokens:
            return None
        service = self.tracker.service_time(max_tokens)
        if service <= timeout:
            return None
        return ShedDecision("service", _seconds(service - timeout),
                            f"the estimated {service:.1f} s for {max_tokens} tokens at the pace of the {running} "
                            f"running requests exceeds the request's timeout ({timeout:g} s)")

    def check(self, num_requests: int, priority: int, timeout: float | None, max_tokens: int | None = None) -> None:
        """Raise a 503 APIError with Retry-After if the request should be shed."""
        decision = self.decide(num_requests, priority, timeout, max_tokens)
        if decision is None:
            return
        self.shed[decision.reason] += 1
        raise APIError(503, f"the server is overloaded: {decision.message}; retry in {decision.retry_after} s",
                       code="overloaded", headers={"Retry-After": str(decision.retry_after)})


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))


class ShedCollector(Collector):
    """`ironlm:requests_shed_total{reason}`: requests refused at once by the shedder."""

    def __init__(self, shedder: Shedder, model_name: str) -> None:
        self.shedder, self.model = shedder, model_name

    def collect(self) -> Iterator[Metric]:
        shed = CounterMetricFamily("ironlm:requests_shed", "Requests refused at once (503) by load shedding.",
                                   labels=["model_name", "reason"])
        for reason, count in self.shedder.shed.items():
            shed.add_metric([self.model, reason], float(count))
        yield shed


def engine_setting(engine: EngineClient, name: str) -> Any:
    """An EngineConfig value of the engine behind the async one (None for engines without a config: test doubles)."""
    config = getattr(getattr(engine, "engine", None), "config", None)
    return getattr(config, name, None)
