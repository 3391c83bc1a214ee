"""One engine replica: an AsyncLLMEngine and the same FastAPI app `ironlm serve` runs (build_app), driven over
ASGI by requests the ingress forwards, so every route, streaming, auth and /metrics behave as in `ironlm serve`.

A response streams back as a ResponseHead (status, headers, first body) and then body chunks. The head waits for
the first body chunk, and in an event stream for the first event that carries a token (chat streams open with
role-only chunks, held back with it), so a replica that dies before its first token has sent the client nothing
and the ingress may retry the request elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from ironlm.config import EngineConfig, ServerConfig
from ironlm.ray.routing import RouteHint

logger = logging.getLogger("ironlm.ray")

REPLICA_HEADER = "x-ironlm-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it (body read in full: requests are small JSON)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def carries_token(body: bytes) -> bool:
    """Whether server-sent events hold a token (text, a content or tool-call delta), a finish, an error or the
    end; role-only chunks do not."""
    for event in body.split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        data = event[len(b"data: "):].strip()
        if data == b"[DONE]":
            return True
        try:
            obj = json.loads(data)
        except ValueError:
            return True  # not ours to interpret: let it through
        if not isinstance(obj, dict) or "error" in obj:
            return True
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if choice.get("text") or choice.get("finish_reason") or delta.get("content") or delta.get("tool_calls"):
                return True
    return False


class EngineReplica:
    """The Ray Serve deployment class of an engine replica (see app.py for its options)."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, threads: int = 1,
                 served_model_names: list[str] | None = None) -> None:
        import torch
        from ray import serve

        from ironlm.server.assemble import assemble

        # Ray reserves logical CPUs only; without this torch would start one thread per core of the machine
        # in every replica and the replicas would fight over the cores.
        torch.set_num_threads(threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        t0 = time.perf_counter()
        served = assemble(engine_config, server_config, served_model_names)
        self.engine, self.app = served.engine, served.app
        self.drain_timeout = server_config.drain_timeout
        logger.info("replica %s ready in %.2fs", self.replica_id, time.perf_counter() - t0)

    async def handle_http(self, request: ForwardedRequest,
                          route: RouteHint | None = None) -> AsyncIterator[ResponseHead | bytes]:
        """Run one request through the app; `route` is read by the router only."""
        messages: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await messages.put(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
            "query_string": request.query_string, "headers": request.headers, "client": request.client,
            "server": None,
        }
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            status, headers, pending = 500, [], b""
            started = sse = False
            while True:
                message = await messages.get()
                if message is None:  # the app returned (or raised) without finishing a response
                    if not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                    break
                if message["type"] == "http.response.start":
                    status = message["status"]
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
                    continue
                if message["type"] != "http.response.body":
                    continue
                chunk, more = message.get("body", b""), message.get("more_body", False)
                if not started:
                    pending += chunk
                    if (pending and (not sse or carries_token(pending))) or not more:
                        started = True
                        yield ResponseHead(status, headers, pending)
                elif chunk:
                    yield chunk
                if not more:
                    break
        finally:
            disconnected.set()  # a client gone mid-stream: the app sees the disconnect and aborts the request
            if not task.done():
                await asyncio.wait({task}, timeout=5.0)
                task.cancel()

    def metrics_text(self) -> tuple[str, str]:
        """(replica id, this replica's /metrics exposition), for the ingress's broadcast."""
        return self.replica_id, self.app.state.metrics.render().decode()

    def check_health(self) -> None:
        """Ray Serve calls this every health_check_period: raising marks the replica unhealthy and replaces it."""
        if self.engine.dead_error is not None:
            raise RuntimeError(f"engine dead: {self.engine.dead_error!r}")
        if not self.engine.is_healthy:
            raise RuntimeError("engine loop stopped")
        stalled = self.engine.stalled_for
        if stalled is not None:
            raise RuntimeError(f"engine step stuck for {stalled:.0f} s")

    async def __del__(self) -> None:
        # Ray Serve has already drained this replica (graceful_shutdown_timeout_s = drain_timeout) before calling
        # this; what remains in flight past that is aborted here.
        engine = getattr(self, "engine", None)
        if engine is not None:  # None: __init__ failed (e.g. a bad model path) before the engine existed
            await engine.shutdown(drain_timeout=min(5.0, self.drain_timeout))
