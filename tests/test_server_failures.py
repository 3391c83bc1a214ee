"""Failures the server must survive or report: forward errors, a dead engine, faults, timeouts, draining.

All on the real tiny-model engine behind a real uvicorn server; faults are injected into its model forward
(server_utils.ForwardFaults), which runs on the engine thread exactly like a failing kernel would. Queue
limits, timeouts, priority, deadline and cache-salt isolation over HTTP and gRPC are in test_e2e_limits.py.
"""

from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest

from ironlm.grpc import ironlm_pb2 as pb
from server_utils import AsyncLLMEngine, RealServer, wait_for

COMPLETION = {"prompt": "abc", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
LONG = {**COMPLETION, "max_tokens": 200, "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Shared by the tests that leave the engine usable; each one restores what it changed."""
    server = RealServer(tmp_path_factory, grpc_server=True, max_num_seqs=8)
    yield server
    server.stop()


@pytest.fixture
def fresh(tmp_path_factory):
    """A private server for tests that kill or drain the engine."""
    servers: list[RealServer] = []

    def make(**kw) -> RealServer:
        servers.append(RealServer(tmp_path_factory, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


# OpenAI's error type for each status these failures answer with.
ERROR_TYPES = {500: "server_error", 503: "service_unavailable_error"}


def error_of(resp: httpx.Response, status: int) -> dict:
    """The OpenAI error body of a server-side failure: typed by its status, naming no request parameter."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == ERROR_TYPES[status] and err["param"] is None, err
    assert err["code"] is not None, err
    return err


def sse(resp_text: str) -> list[str]:
    return [e[len("data: "):] for e in resp_text.split("\n\n") if e]


def rpc_request(max_tokens: int = 5) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="abc", sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0,
                                                                         ignore_eos=True))


def test_forward_error_fails_that_request_and_frees_its_blocks(server: RealServer):
    server.faults.fail_next = 1
    err = error_of(httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30), 500)
    assert "injected forward failure" in err["message"] and err["type"] == "server_error"
    assert server.faults.failures == 1
    assert wait_for(server.idle), server.kv_blocks()
    ok = httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    server.faults.fail_next = 1
    events = sse(httpx.post(f"{server.base_url}/chat/completions", json={**CHAT, "stream": True}, timeout=30).text)
    assert "injected forward failure" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert wait_for(server.idle), server.kv_blocks()


def test_forward_error_mid_stream_ends_the_stream_with_an_error(server: RealServer):
    server.faults.delay = 0.01
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http, \
                http.stream("POST", "/v1/completions", json=LONG) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            server.faults.fail_next = 1
            rest = [line for line in lines if line]
    finally:
        server.faults.delay = 0.0
    body = json.loads(rest[-2][len("data: "):])
    assert "injected forward failure" in body["error"]["message"] and rest[-1] == "data: [DONE]"
    assert len(rest) < 200  # stopped early, not after all its tokens
    assert wait_for(server.idle), server.kv_blocks()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_forward_error_over_grpc_is_internal_and_frees_its_blocks(server: RealServer):
    stub = server.rpc.stub
    server.faults.fail_next = 1
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(rpc_request(), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INTERNAL and "injected forward failure" in exc.value.details()
    assert wait_for(server.idle), server.kv_blocks()

    server.faults.delay = 0.01
    received = 0
    try:
        with pytest.raises(grpc.RpcError) as exc:
            for msg in stub.StreamGenerate(rpc_request(max_tokens=200), timeout=30):
                received += sum(len(c.token_ids) for c in msg.completions)
                server.faults.fail_next = 1  # from the first message on: the next forward fails
    finally:
        server.faults.delay = 0.0
    assert exc.value.code() == grpc.StatusCode.INTERNAL and "injected forward failure" in exc.value.details()
    assert 0 < received < 200
    assert wait_for(server.idle), server.kv_blocks()
    assert stub.Generate(rpc_request(), timeout=30).usage.completion_tokens == 5


class FailingUpdate:
    """Stands in for the engine's core scheduler and fails `update` on demand: the engine's own bookkeeping
    raising after a good forward, which LLMEngine does not catch (AsyncLLMEngine's loop does)."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.fail_next = scheduler, 0

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)

    def update(self, *args, **kwargs):
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("injected bookkeeping failure")
        return self.scheduler.update(*args, **kwargs)


def test_failing_step_bookkeeping_fails_requests_then_restarts_the_engine_loop_when_it_repeats(fresh):
    server = fresh()
    core = FailingUpdate(server.engine.engine.scheduler)
    server.engine.engine.scheduler = core
    expected = httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30).json()["choices"][0]["text"]
    core.fail_next = 1
    err = error_of(httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30), 500)
    assert "injected bookkeeping failure" in err["message"]
    assert wait_for(server.idle), server.kv_blocks()  # aborted in the core: blocks and slots came back
    again = httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    # Three failed steps in a row mean the engine state is broken: the loop restarts it (a fresh scheduler, which
    # drops the failing stand-in) and serves on. Dying when restarts do not help: test_server_resilience.py.
    core.fail_next = 3
    for _ in range(2):
        error_of(httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30), 500)
    last = httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30)
    assert "restarted after 3 failed steps" in error_of(last, 500)["message"]  # the third: failed by the restart
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["engine_restarts"] == 1
    again = httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    assert wait_for(server.idle), server.kv_blocks()


class Fatal(BaseException):
    """Escapes the engine's per-step error handling (only `Exception` is a request's problem)."""


def test_dead_engine_turns_health_503_and_fails_fast(fresh):
    server = fresh(grpc_server=True)
    server.faults.delay = 0.02
    with httpx.Client(base_url=server.url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=LONG) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        server.faults.error = Fatal("GPU fell off the bus")
        server.faults.fail_next = 1
        rest = [line for line in lines if line]
    assert "error" in json.loads(rest[-2][len("data: "):]) and rest[-1] == "data: [DONE]"
    assert len(rest) < 50
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "engine_dead"
    err = error_of(httpx.post(f"{server.base_url}/completions", json=COMPLETION), 503)
    assert err["code"] == "engine_unavailable"
    with pytest.raises(grpc.RpcError) as exc:
        server.rpc.stub.Generate(rpc_request(), timeout=30)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_internal_fault_is_500_and_server_survives(server: RealServer, monkeypatch):
    def broken(messages, add_generation_prompt=True, **kwargs):
        raise KeyError("template bug")

    monkeypatch.setattr(server.engine.engine, "apply_chat_template", broken)
    err = error_of(httpx.post(f"{server.base_url}/chat/completions", json=CHAT, timeout=30), 500)
    assert err["type"] == "server_error"
    monkeypatch.undo()
    assert httpx.post(f"{server.base_url}/chat/completions", json=CHAT, timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert wait_for(server.idle), server.kv_blocks()


def test_timeout_before_any_token_is_503_and_the_request_is_aborted(server: RealServer):
    server.faults.gate.clear()  # the step holding the request never finishes a forward
    try:
        err = error_of(httpx.post(f"{server.base_url}/completions", json={**COMPLETION, "timeout": 0.3},
                                  timeout=30), 503)
        assert err["code"] == "timeout"
    finally:
        server.faults.gate.set()
    assert wait_for(server.idle), server.kv_blocks()


def test_draining_refuses_new_work(fresh):
    server = fresh()
    server.engine.begin_drain()
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert error_of(httpx.post(f"{server.base_url}/completions", json=COMPLETION), 503)["code"] == \
        "engine_unavailable"


def test_a_step_stuck_past_the_limit_turns_health_503(server: RealServer):
    """A hung step (a wedged kernel, a deadlock) leaves the engine thread alive: /health must still notice."""
    limit, server.engine.stall_timeout_s = server.engine.stall_timeout_s, 0.3
    try:
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        server.faults.delay = 1.5
        request = threading.Thread(target=httpx.post, args=(f"{server.base_url}/completions",),
                                   kwargs={"json": {**COMPLETION, "max_tokens": 2}, "timeout": 30})
        request.start()
        assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, timeout=5)
        body = httpx.get(f"{server.url}/health").json()
        assert body["status"] == "engine_stalled" and "limit 0.3 s" in body["error"]
        server.faults.delay = 0.0
        request.join()
        assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, timeout=5)
    finally:
        server.faults.delay = 0.0
        server.engine.stall_timeout_s = limit
    assert wait_for(server.idle), server.kv_blocks()


def test_stall_timeout_must_be_positive():
    with pytest.raises(ValueError, match="stall_timeout_s"):
        AsyncLLMEngine(None, start=False, stall_timeout_s=0)
