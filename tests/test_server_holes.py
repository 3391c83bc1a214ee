"""Issue 21's server holes, each reproduced against a live uvicorn server with `ironlm serve`'s connection limits:
client faults that opened the circuit breaker, slow bodies and connection floods, logprob amplification,
continuous usage stats, the gRPC request id and the 413 a client must be able to read."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ironlm.config import ServerConfig
from ironlm.server.api import build_app
from server_utils import ForwardFaults, LiveServer, tiny_engine, wait_for

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Any]:
    eng = tiny_engine(tmp_path_factory, max_num_seqs=8)
    yield eng
    asyncio.run(eng.shutdown(drain_timeout=0))


@pytest.fixture
def serve(engine) -> Iterator[Any]:
    servers: list[LiveServer] = []

    def start(**config: Any) -> LiveServer:
        limits = ServerConfig(**config)
        servers.append(LiveServer(build_app(engine, served_model_name="tiny", config=limits), engine, limits))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def health(server: LiveServer) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def raw_head(path: str = "/v1/completions", length: int = 100, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
            f"{extra}\r\n").encode()


# ---- 4: client faults never count toward the circuit breaker ------------------------------------------------
def test_client_disconnects_4xx_and_client_timeouts_do_not_open_the_breaker(serve, engine, caplog):
    server = serve(circuit_breaker_window=20, circuit_breaker_min_requests=5)
    caplog.set_level(logging.ERROR)
    # The probe's attack: headers and one body byte, then gone (each raised ClientDisconnect in the body read).
    for _ in range(25):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(raw_head() + b"{")
    for _ in range(5):  # the client's own mistakes
        bad = httpx.post(f"{server.base_url}/completions", json={**COMPLETION, "max_tokens": -1}, timeout=10)
        assert bad.status_code == 400
    faults = ForwardFaults(engine.engine)
    faults.delay = 0.3
    try:  # a timeout the client asked for, expiring before any token: 503 timeout
        late = httpx.post(f"{server.base_url}/completions", json={**COMPLETION, "timeout": 0.05}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "timeout"
    finally:
        faults.delay = 0.0
        faults.remove()
    time.sleep(0.3)  # let the server finish tearing down the dropped connections
    ok = httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30)
    assert ok.status_code == 200, ok.text
    breaker = health(server)["circuit_breaker"]
    assert breaker["state"] == "closed" and breaker["trips"] == 0
    assert breaker["window_requests"] == 1 and breaker["error_rate"] == 0.0  # only the good request counted
    # A disconnect is no internal error: nothing logged at ERROR (neither ironlm's handler nor uvicorn's).
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'ironlm:request_success_total{finished_reason="error",model_name="tiny"} 0.0' in text
    assert 'ironlm:circuit_breaker_trips_total{model_name="tiny"} 0.0' in text


def test_a_client_gone_mid_request_does_not_count(serve, engine):
    server = serve(circuit_breaker_window=5, circuit_breaker_min_requests=5)
    faults = ForwardFaults(engine.engine)
    faults.delay = 0.05
    try:
        for _ in range(6):  # a request the engine is serving when the client leaves
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.base_url}/completions", json={**COMPLETION, "max_tokens": 50}, timeout=0.2)
        assert wait_for(lambda: engine.num_inflight == 0, 20)
    finally:
        faults.delay = 0.0
        faults.remove()
    assert httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30).status_code == 200
    assert health(server)["circuit_breaker"]["trips"] == 0
