"""Circuit breaker: when too many recent requests failed server-side, refuse new ones for a cool-down.

States: `closed` (normal; every finished request's outcome enters a rolling window of the last `window`), `open`
(the error rate over at least `min_requests` of them went above `threshold`: new requests get 503 + Retry-After
until `cooldown_s` has passed), `half_open` (up to `probes` requests are let through; one failure re-opens, all
of them succeeding closes the breaker with an empty window).

Failures are the engine's only: a 5xx response other than 503 to a request that reached the engine, or an error
event inside a 200 stream. Client faults (4xx, a client gone before its response started, timeouts the client
asked for: 503 `timeout`) and the server's own refusals (503: queue full, shed, draining) say nothing about the
engine's health and are not counted: counting its own 503s would let shedding trip the breaker, counting
disconnects would let anyone open it. Neither is a 500 raised before the engine was asked (parsing, templating,
tokenizing): a cool-down cannot cure such a bug, and counting it would hand whoever finds one the power to refuse
service to everyone.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ironlm.exceptions import InvalidArgumentError
from ironlm.server.errors import error_body

STATES = ("closed", "half_open", "open")  # the state gauge's values: 0, 1, 2
GUARDED_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Permit:
    """One admitted request; `epoch` ties a probe to the half-open period it was let through in."""

    probe: bool
    epoch: int


class CircuitBreaker:
    def __init__(self, *, window: int = 100, threshold: float = 0.05, min_requests: int = 20,
                 cooldown_s: float = 10.0, probes: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        checks = (("window", window >= 1), ("threshold", 0.0 <= threshold < 1.0),
                  ("min_requests", 1 <= min_requests <= window), ("cooldown_s", cooldown_s > 0),
                  ("probes", probes >= 1))
        for name, ok in checks:
            if not ok:
                raise InvalidArgumentError(f"circuit breaker {name}: invalid value", param=name)
        self.window, self.threshold, self.min_requests = window, threshold, min_requests
        self.cooldown_s, self.probes, self.clock = cooldown_s, probes, clock
        self.trips = 0
        self._outcomes: deque[bool] = deque(maxlen=window)  # True = failure
        self._state = "closed"
        self._opened_at = 0.0
        self._epoch = 0
        self._probes_out = self._probes_ok = 0
        # Outcomes come from the HTTP event loop and the gRPC one.
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            self._advance()
            return self._state

    def error_rate(self) -> float:
        with self._lock:
            return sum(self._outcomes) / len(self._outcomes) if self._outcomes else 0.0

    def allow(self) -> Permit | None:
        """A permit for one request, or None: refuse it (see `retry_after`)."""
        with self._lock:
            self._advance()
            if self._state == "closed":
                return Permit(False, self._epoch)
            if self._state == "half_open" and self._probes_out + self._probes_ok < self.probes:
                self._probes_out += 1
                return Permit(True, self._epoch)
            return None

    def retry_after(self) -> int:
        """Whole seconds until the breaker may let requests through again (at least 1)."""
        with self._lock:
            left = self._opened_at + self.cooldown_s - self.clock() if self._state == "open" else 1.0
            return max(1, math.ceil(left))

    def record(self, permit: Permit, failed: bool | None) -> None:
        """The outcome of a permitted request: True failed, False succeeded, None says nothing (4xx, 503, gone)."""
        with self._lock:
            if permit.probe:
                if permit.epoch != self._epoch or self._state != "half_open":
                    return  # a probe of an earlier half-open period
                self._probes_out -= 1
                if failed:
                    self._trip()
                elif failed is False:
                    self._probes_ok += 1
                    if self._probes_ok >= self.probes:
                        self._state = "closed"
                        self._outcomes.clear()
                return
            if failed is None or self._state != "closed":
                return  # requests admitted before a trip say nothing about the engine after it
            self._outcomes.append(failed)
            n = len(self._outcomes)
            if n >= self.min_requests and sum(self._outcomes) / n > self.threshold:
                self._trip()

    def snapshot(self) -> dict[str, Any]:
        state = self.state
        with self._lock:
            n = len(self._outcomes)
            body: dict[str, Any] = {"state": state, "error_rate": round(sum(self._outcomes) / n, 4) if n else 0.0,
                                    "window_requests": n, "threshold": self.threshold, "trips": self.trips}
        if state != "closed":
            body["retry_after_s"] = self.retry_after()
        return body

    def _trip(self) -> None:
        self._state = "open"
        self._opened_at = self.clock()
        self._epoch += 1
        self.trips += 1

    def _advance(self) -> None:
        if self._state == "open" and self.clock() - self._opened_at >= self.cooldown_s:
            self._state = "half_open"
            self._epoch += 1
            self._probes_out = self._probes_ok = 0


# ---- what a response says about the engine -------------------------------------------------------------------
class _Outcome:
    __slots__ = ("reached_engine", "stream_error")

    def __init__(self) -> None:
        self.stream_error: int | None = None
        self.reached_engine = False


_current: ContextVar[_Outcome | None] = ContextVar("ironlm_breaker_outcome", default=None)


def note_stream_error(status: int) -> None:
    """An error event sent inside a streaming (200) response, with the status it would have had: the breaker
    counts it like that status. The stream's body runs in the middleware's context (a copy of it, holding the
    same `_Outcome`), so this reaches the request's own record."""
    outcome = _current.get()
    if outcome is not None and outcome.stream_error is None:
        outcome.stream_error = status


def note_engine_reached() -> None:
    """The request is being handed to the engine (serving_common.start_streams): from here a 5xx is the engine's."""
    outcome = _current.get()
    if outcome is not None:
        outcome.reached_engine = True


def is_failure(status: int) -> bool | None:
    if 200 <= status < 400:
        return False
    if status >= 500 and status != 503:
        return True
    return None


def verdict(status: int, stream_error: int | None, gone: bool, reached_engine: bool) -> bool | None:
    """What one HTTP request says about the engine: an error event in its stream counts as that status; a
    client that left before its response started says nothing, whatever the app then answered nobody; nor
    does a failure before the engine was asked."""
    if stream_error is not None:
        return is_failure(stream_error)
    failed = None if gone else is_failure(status)
    return None if failed and not reached_engine else failed


class BreakerMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer streams): gates POSTs to the generation routes."""

    def __init__(self, app: ASGIApp, breaker: CircuitBreaker, paths: tuple[str, ...] = GUARDED_PATHS) -> None:
        self.app, self.breaker, self.paths = app, breaker, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") not in self.paths:
            await self.app(scope, receive, send)
            return
        permit = self.breaker.allow()
        if permit is None:
            await _refuse(send, self.breaker.retry_after())
            return
        outcome = _Outcome()
        token = _current.set(outcome)
        status = 0
        gone = False  # the client left before its response started: whatever follows is not the engine's doing

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def watch_receive() -> Message:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and status == 0:
                gone = True
            return message

        failed: bool | None = None
        try:
            await self.app(scope, watch_receive, send_status)
            failed = verdict(status, outcome.stream_error, gone, outcome.reached_engine)
        except Exception as exc:  # an unhandled error: the app's 500 (ServerErrorMiddleware sits outside us)
            failed = None if gone or isinstance(exc, ClientDisconnect) or not outcome.reached_engine else True
            raise
        finally:  # a cancelled request (client gone) records nothing
            _current.reset(token)
            self.breaker.record(permit, failed)


async def _refuse(send: Send, retry_after: int) -> None:
    body = json.dumps(error_body(503, "the server is failing too many requests and is refusing new ones for a "
                                      f"cool-down (circuit breaker open); retry in {retry_after} s",
                                 code="circuit_open")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(retry_after).encode())]})
    await send({"type": "http.response.body", "body": body})


class BreakerCollector(Collector):
    """`ironlm:circuit_breaker_trips_total` and `ironlm:circuit_breaker_state` (0 closed, 1 half-open, 2 open)."""

    def __init__(self, breaker: CircuitBreaker, model_name: str) -> None:
        self.breaker, self.model = breaker, model_name

    def collect(self) -> Iterator[Metric]:
        trips = CounterMetricFamily("ironlm:circuit_breaker_trips", "Times the circuit breaker opened.",
                                    labels=["model_name"])
        trips.add_metric([self.model], float(self.breaker.trips))
        yield trips
        state = GaugeMetricFamily("ironlm:circuit_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
                                  labels=["model_name"])
        state.add_metric([self.model], float(STATES.index(self.breaker.state)))
        yield state
