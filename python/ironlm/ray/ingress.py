"""The HTTP ingress of the Ray deployment: reads each request, computes its prefix-affinity key, forwards it to
an engine replica through the deployment handle (whose router is routing.PrefixAffinityRouter) and streams the
replica's response back. A request whose replica dies before the first body chunk is retried on another
replica up to `max_retries` times; once bytes have reached the client it cannot be retried, and a stream then
ends with an error event. GET /metrics gathers every replica's metrics under a `replica` label.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ironlm.exceptions import ReplicaRetriesExhausted
from ironlm.ray.replica import ForwardedRequest, ResponseHead
from ironlm.ray.routing import RouteHint, prefix_key

logger = logging.getLogger("ironlm.ray")

# Replica death before its first chunk: the actor died (or became unreachable) with the request assigned.
RETRYABLE: tuple[type[BaseException], ...] = (RayActorError,)
RETRIES_HEADER = "x-ironlm-retries"
_METRICS_TIMEOUT_S = 10.0
_DROPPED_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


class Ingress:
    """The Ray Serve deployment class of the ingress (see app.py): stateless, cheap, one or a few replicas."""

    def __init__(self, engine: Any, affinity_block: int, max_retries: int) -> None:
        self.engine = engine  # a DeploymentHandle of EngineReplica
        # Made once: handles derived by .options() before the first call would each start their own router,
        # and the router's affinity map and load counts must see every request.
        self.streaming = engine.options(stream=True)
        self.affinity_block = affinity_block
        self.max_retries = max_retries

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        forwarded = ForwardedRequest(
            method=request.method, path=request.url.path, query_string=request.url.query.encode(),
            headers=[(k.lower(), v) for k, v in request.headers.raw], body=body,
            client=(request.client.host, request.client.port) if request.client else None)
        if forwarded.method == "GET" and forwarded.path == "/metrics":
            return await self._gather_metrics()
        hint = RouteHint(prefix_key=prefix_key(forwarded.path, body, self.affinity_block))
        try:
            head, rest, retries = await self._start(forwarded, hint)
        except ReplicaRetriesExhausted as exc:
            return _error(503, f"no engine replica could take the request: {exc}")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers
                   if k.lower() not in _DROPPED_HEADERS}
        headers[RETRIES_HEADER] = str(retries)
        is_sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_body(head.body, rest, is_sse), status_code=head.status, headers=headers)

    async def _start(self, forwarded: ForwardedRequest,
                     hint: RouteHint) -> tuple[ResponseHead, AsyncIterator[Any], int]:
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            stream = self.streaming.handle_http.remote(forwarded, route=hint)
            try:
                head = await stream.__anext__()
            except RETRYABLE as exc:
                last = exc
                logger.warning("replica failed before the first token (attempt %d of %d): %r", attempt + 1,
                               self.max_retries + 1, exc)
                continue
            return head, stream, attempt
        raise ReplicaRetriesExhausted(repr(last))

    async def _gather_metrics(self) -> Response:
        """Every replica's /metrics in one exposition, each sample labelled with its replica."""
        results = await self.engine.broadcast("metrics_text").results_async(
            timeout_s=_METRICS_TIMEOUT_S, return_exceptions=True)
        texts = [r for r in results if isinstance(r, tuple)]  # a replica that died meanwhile is left out
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE_LATEST)


async def _body(first: bytes, rest: Any, is_sse: bool) -> AsyncIterator[bytes]:
    """`rest`: the replica's DeploymentResponseGenerator after the head."""
    try:
        if first:
            yield first
        async for chunk in rest:
            yield chunk
    except GeneratorExit:
        # The client went away: the replica's app must see the disconnect and abort the request in the engine.
        # Ray Serve cancels the calls of a cancelled HTTP request itself; this also covers a body closed without
        # that cancellation (a failed send).
        rest.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - the client has bytes already: end the stream, do not retry
        logger.warning("replica failed mid-response: %r", exc)
        if is_sse:
            err = {"error": {"message": f"the engine replica failed mid-stream: {type(exc).__name__}",
                             "type": "ServiceUnavailableError", "param": None, "code": 503}}
            yield f"data: {json.dumps(err)}\n\n".encode()


def _error(status: int, message: str) -> Response:
    body = {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": status}}
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus text expositions of several replicas as one, a `replica` label added to every sample."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            kind = "unknown" if family.type == "unknown" else family.type
            entry = families.setdefault(family.name, (kind, family.documentation, []))
            for s in family.samples:
                labels = {**s.labels, "replica": replica}
                rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                entry[2].append(f"{s.name}{{{rendered}}} {floatToGoString(s.value)}")
    lines: list[str] = []
    for family_name, (kind, doc, samples) in families.items():
        # As generate_latest writes them (and the parser reads them back): a counter's header names its sample.
        name = f"{family_name}_total" if kind == "counter" else family_name
        lines.append(f"# HELP {name} {doc.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
