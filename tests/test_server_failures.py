"""Failures the server must survive or report: forward errors, a dead engine, overload, faults, draining.

These need an engine that fails on demand, so they run on FakeEngine (LLMEngine's contract).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from fake_engine import FakeEngine
from ironlm.async_engine import AsyncLLMEngine
from ironlm.server.api import build_app
from server_utils import LiveServer, wait_for

COMPLETION = {"prompt": "abc", "max_tokens": 5}
CHAT = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 5}


@pytest.fixture
def make_server():
    servers = []

    def make(**kw) -> tuple[FakeEngine, LiveServer]:
        fake = FakeEngine(**kw)
        engine = AsyncLLMEngine(fake)
        server = LiveServer(build_app(engine, served_model_name="fake"), engine)
        servers.append(server)
        return fake, server

    yield make
    for s in servers:
        s.stop()


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def sse(resp_text: str) -> list[str]:
    return [e[len("data: "):] for e in resp_text.split("\n\n") if e]


def test_forward_error_fails_only_that_request(make_server):
    fake, server = make_server()
    fake.fail_forward_once = True
    err = error_of(httpx.post(f"{server.base_url}/completions", json=COMPLETION), 500)
    assert "injected forward failure" in err["message"] and err["type"] == "server_error"
    assert httpx.post(f"{server.base_url}/completions", json=COMPLETION).status_code == 200
    fake.fail_forward_once = True
    events = sse(httpx.post(f"{server.base_url}/chat/completions", json={**CHAT, "stream": True}).text)
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
    assert httpx.get(f"{server.url}/health").status_code == 200


class Fatal(BaseException):
    pass


def test_dead_engine_turns_health_503_and_fails_fast(make_server):
    fake, server = make_server(step_delay=0.02)
    with httpx.Client(base_url=server.url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json={**COMPLETION, "max_tokens": 200, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        fake.raise_in_step = Fatal("GPU fell off the bus")
        t0 = time.monotonic()
        rest = [line for line in lines if line]
        assert time.monotonic() - t0 < 5
    assert "error" in json.loads(rest[-2][6:]) and rest[-1] == "data: [DONE]"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "engine_dead"
    err = error_of(httpx.post(f"{server.base_url}/completions", json=COMPLETION), 503)
    assert err["code"] == "engine_unavailable"


def test_queue_full_is_503(make_server):
    fake, server = make_server(max_queue_len=1, step_delay=0.02)
    with httpx.Client(base_url=server.url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json={**COMPLETION, "max_tokens": 200, "stream": True}):
        assert wait_for(lambda: len(fake.requests) == 1)
        err = error_of(http.post("/v1/completions", json=COMPLETION), 503)
        assert err["code"] == "queue_full"


def test_internal_fault_is_500_and_server_survives(make_server):
    fake, server = make_server()

    def broken(messages, add_generation_prompt=True):
        raise KeyError("template bug")

    fake.apply_chat_template = broken  # type: ignore[method-assign]
    err = error_of(httpx.post(f"{server.base_url}/chat/completions", json=CHAT), 500)
    assert err["type"] == "server_error"
    assert httpx.post(f"{server.base_url}/completions", json=COMPLETION).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_timeout_before_any_token(make_server):
    fake, server = make_server()
    fake.gate.clear()
    try:
        err = error_of(httpx.post(f"{server.base_url}/completions", json={**COMPLETION, "timeout": 0.2}), 503)
        assert err["code"] == "timeout"
    finally:
        fake.gate.set()
    assert wait_for(lambda: not fake.requests)


def test_draining_refuses_new_work(make_server):
    _, server = make_server()
    server.engine.begin_drain()
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    error_of(httpx.post(f"{server.base_url}/completions", json=COMPLETION), 503)


def test_a_step_stuck_past_the_limit_turns_health_503(make_server):
    """A hung step (a wedged kernel, a deadlock) leaves the engine thread alive: /health must still notice."""
    fake, server = make_server(step_delay=0.01)
    server.engine.stall_timeout_s = 0.3
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    fake.step_delay = 1.5
    request = threading.Thread(target=httpx.post, args=(f"{server.base_url}/completions",),
                               kwargs={"json": {**COMPLETION, "max_tokens": 2}, "timeout": 30})
    request.start()
    assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, timeout=5)
    body = httpx.get(f"{server.url}/health").json()
    assert body["status"] == "engine_stalled" and "limit 0.3 s" in body["error"]
    fake.step_delay = 0.0
    request.join()
    assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, timeout=5)


def test_stall_timeout_must_be_positive():
    with pytest.raises(ValueError, match="stall_timeout_s"):
        AsyncLLMEngine(FakeEngine(), start=False, stall_timeout_s=0)
