"""Run the HTTP (and optional gRPC) server until SIGTERM/SIGINT, then drain and return normally.

On a signal: /health turns 503 and new requests are refused at once (the engine drains), uvicorn stops
accepting connections and waits up to `drain_timeout` for in-flight responses, gRPC likewise, then the
engine aborts what is left and its thread stops. The process then exits 0: a drained shutdown is a
success, not a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

from ironlm.config import ServerConfig
from ironlm.engine import EngineClient
from ironlm.server.http_limits import uvicorn_options

logger = logging.getLogger("ironlm.serve")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self.signal_time: float | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.signal_time is None:
            self.signal_time = time.monotonic()
            logger.info("signal %d: draining in-flight requests", sig)
            self._on_signal()
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the captured signal after shutdown (exit status 143 for SIGTERM);
            # we drained on purpose, so forget it and let the process exit 0.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()


async def serve_app(engine: EngineClient, app: FastAPI, *, host: str, port: int, drain_timeout: float,
                    log_level: str, grpc_port: int | None = None, model_names: list[str] | None = None,
                    api_key: str | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """`host`, `port`, `drain_timeout`, `log_level`: no defaults here, `ironlm serve`'s flags hold them."""
    server_config = getattr(app.state, "config", None) or ServerConfig()
    limits = uvicorn_options(server_config)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, int(drain_timeout)), access_log=False, **limits)
    server = _Server(config, on_signal=engine.begin_drain)
    grpc_server = None
    if grpc_port is not None:
        from ironlm.server.grpc_service import start_grpc_server

        t0 = time.perf_counter()
        grpc_server, bound = await start_grpc_server(engine, host, grpc_port,
                                                     model_names or [engine.model_name], api_key,
                                                     shedder=getattr(app.state, "shedder", None),
                                                     breaker=getattr(app.state, "breaker", None),
                                                     max_logprobs=server_config.max_request_logprobs)
        logger.info("gRPC listening on %s:%d (%.2fs)", host, bound, time.perf_counter() - t0)
    ready = asyncio.ensure_future(_announce_ready(server, host, port, on_ready))
    try:
        await server.serve()
    finally:
        ready.cancel()
        deadline = (server.signal_time or time.monotonic()) + drain_timeout
        if grpc_server is not None:
            await grpc_server.stop(grace=max(0.5, deadline - time.monotonic()))
        await engine.shutdown(drain_timeout=max(0.0, deadline - time.monotonic()))
        logger.info("stopped")


async def _announce_ready(server: _Server, host: str, port: int, on_ready: Callable[[], None] | None) -> None:
    t0 = time.perf_counter()
    while not server.started:
        await asyncio.sleep(0.02)
    logger.info("HTTP listening on http://%s:%d (%.2fs)", host, port, time.perf_counter() - t0)
    if on_ready is not None:
        on_ready()
