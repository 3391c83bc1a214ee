"""The holes an outside probe found, each as a class: numeric bounds, body and prompt size, prompt lists, exact
queue capacity, slow and idle connections, content type and CORS, request chat templates, the OpenAPI document."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient

from ironlm.config import ServerConfig
from ironlm.server.api import build_app
from ironlm.server.http_limits import uvicorn_options
from server_utils import ForwardFaults, tiny_engine, wait_for

LIMITS = ServerConfig(max_request_bytes=200_000, max_prompts_per_request=4, timeout_keep_alive=0.5,
                      timeout_request_header=1.0, max_request_header_bytes=4096)
CHAT = [{"role": "user", "content": "hi"}]


class Served:
    """A uvicorn server with ironlm serve's connection limits, on a port bound first."""

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    **uvicorn_options(config)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started, 20)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Any]:
    eng = tiny_engine(tmp_path_factory, max_num_seqs=2, max_queue_len=2)
    yield eng
    asyncio.run(eng.shutdown(drain_timeout=0))


@pytest.fixture(scope="module")
def served(engine) -> Iterator[Served]:
    s = Served(build_app(engine, served_model_name="tiny", config=LIMITS), LIMITS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield client


def client_for(engine: Any, **config: Any) -> TestClient:
    return TestClient(build_app(engine, served_model_name="tiny", config=ServerConfig(**config)))


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err  # "logit_bias.5" names it
    return err


# ---- 1. numeric fields: out of range (beyond 64 bits too) is a 400 naming the field ----------------------------
BIG = 2**70
COMMON_BOUNDS = [("max_tokens", BIG), ("max_tokens", 0), ("n", BIG), ("n", 129), ("seed", BIG), ("seed", -BIG),
                 ("top_k", BIG), ("top_k", 100_000), ("top_k", -2), ("min_tokens", BIG), ("priority", BIG),
                 ("priority", -BIG), ("temperature", -1), ("temperature", 10**400), ("top_p", 2), ("min_p", 1.5),
                 ("presence_penalty", 3), ("repetition_penalty", 0), ("timeout", 1e300), ("deadline", -1),
                 ("stop_token_ids", [BIG]), ("stop_token_ids", [100_000]), ("logit_bias", {"5": 101}),
                 ("logit_bias", {"5": -1e300}), ("logit_bias", {str(BIG): 1}), ("logit_bias", {"100000": 1})]


@pytest.mark.parametrize(("field", "value"), COMMON_BOUNDS + [("logprobs", 21), ("logprobs", BIG),
                                                              ("best_of", BIG), ("prompt", [BIG])])
def test_completion_numeric_bounds(http: httpx.Client, field: str, value: Any):
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
    assert_error(resp, 400, field)


@pytest.mark.parametrize(("field", "value"), COMMON_BOUNDS + [("max_completion_tokens", BIG),
                                                              ("top_logprobs", 21), ("top_logprobs", BIG)])
def test_chat_numeric_bounds(http: httpx.Client, field: str, value: Any):
    body = {"messages": CHAT, "max_tokens": 2, "logprobs": True, field: value}
    assert_error(http.post("/v1/chat/completions", json=body), 400, field)


def test_non_finite_numbers_are_400(http: httpx.Client):
    body = '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}'
    resp = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400


def test_bounds_at_the_edge_are_accepted(http: httpx.Client):
    body = {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "logit_bias": {"5": 100, "6": -100}, "top_k": 50,
            "priority": -(2**63), "logprobs": 20, "timeout": 60}
    assert http.post("/v1/completions", json=body).status_code == 200


# ---- 2. body size and prompt size ------------------------------------------------------------------------------
def test_body_over_the_cap_is_413_by_content_length(http: httpx.Client):
    body = json.dumps({"prompt": "x" * 300_000})
    resp = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(resp, 413)


def test_chunked_body_over_the_cap_is_413_while_reading(http: httpx.Client):
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(100):  # 6.4 MB offered; the server stops reading after its 200 kB
            sent += 1
            yield b"x" * 65536
        yield b'"}'

    resp = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(resp, 413)


def test_long_prompt_refused_before_tokenizing(http: httpx.Client, engine):
    # Within the body cap, but more characters than max_model_len tokens can hold whatever the tokenizer does.
    text = "hello " * 30_000
    calls = []
    real = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for path, body, param in (("/v1/completions", {"prompt": text}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
                                   "messages"),
                                  ("/tokenize", {"prompt": text}, "prompt")):
            err = assert_error(http.post(path, json=body), 400, param)
            assert err["code"] == "context_length_exceeded"
    finally:
        del engine.tokenizer.encode
    assert not calls


def test_tokenizing_does_not_block_other_requests(http: httpx.Client, engine):
    """A prompt that tokenizes slowly (a stalled tokenizer here) holds neither the event loop nor the engine."""
    gate = threading.Event()
    real = engine.tokenizer.encode

    def slow(text: str, *a: Any, **k: Any) -> Any:
        if text.startswith("SLOW"):
            gate.wait(20)
        return real(text, *a, **k)

    engine.tokenizer.encode = slow
    try:
        with httpx.Client(base_url=http.base_url, timeout=30) as other:
            result: dict[str, Any] = {}
            t = threading.Thread(target=lambda: result.update(r=other.post(
                "/v1/completions", json={"prompt": "SLOW prompt", "max_tokens": 1})))
            t.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            resp = http.post("/v1/completions", json={"prompt": "fast", "max_tokens": 2})
            took = time.monotonic() - t0
            gate.set()
            t.join(20)
    finally:
        gate.set()
        del engine.tokenizer.encode
    assert resp.status_code == 200 and took < 5, took
    assert result["r"].status_code == 200


# ---- 3. a list of prompts --------------------------------------------------------------------------------------
def test_prompt_list_is_bounded(http: httpx.Client):
    assert_error(http.post("/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 1}), 400, "prompt")
    resp = http.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1, "echo": True})
    assert resp.status_code == 200, resp.text
    assert [c["text"][:1] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])] == ["a", "b", "c", "d"]
    assert_error(http.post("/v1/completions", json={"prompt": [[5]] * 5, "max_tokens": 1}), 400, "prompt")


def test_cancelled_prompt_list_leaves_no_unretrieved_exception(http: httpx.Client, engine, caplog):
    faults = ForwardFaults(engine.engine)
    faults.delay = 0.05
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            with pytest.raises(httpx.TimeoutException):
                http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 200, "ignore_eos": True},
                          timeout=0.5)
            assert wait_for(lambda: engine.num_inflight == 0 and engine.stats()["num_requests_running"] == 0, 15)
            gc.collect()
            time.sleep(0.2)
    finally:
        faults.remove()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


# ---- 4. the queue is full exactly at max_num_seqs running + max_queue_len waiting ------------------------------
def test_queue_full_exactly_at_capacity(served: Served, engine):
    faults = ForwardFaults(engine.engine)
    faults.delay = 0.05  # keeps the first four running/waiting while the fifth arrives
    body = {"prompt": "hello", "max_tokens": 150, "ignore_eos": True}
    results: list[int] = []
    try:
        with httpx.Client(base_url=served.url, timeout=60) as client:
            threads = [threading.Thread(target=lambda: results.append(client.post("/v1/completions",
                                                                                  json=body).status_code))
                       for _ in range(4)]
            for t in threads:
                t.start()
            assert wait_for(lambda: engine.num_inflight == 4, 10)
            resp = client.post("/v1/completions", json={**body, "max_tokens": 1})
            err = assert_error(resp, 503)
            assert err["code"] == "queue_full" and int(resp.headers["retry-after"]) >= 1
            faults.delay = 0.0
            for t in threads:
                t.join(60)
    finally:
        faults.remove()
    assert results == [200] * 4


def test_each_prompt_of_a_list_takes_a_queue_place(served: Served, engine):
    faults = ForwardFaults(engine.engine)
    faults.delay = 0.05
    body = {"prompt": "hello", "max_tokens": 150, "ignore_eos": True}
    results: list[int] = []
    try:
        with httpx.Client(base_url=served.url, timeout=60) as client:
            first = threading.Thread(target=lambda: results.append(
                client.post("/v1/completions", json={**body, "prompt": ["a", "b"]}).status_code))
            first.start()
            assert wait_for(lambda: engine.num_inflight == 2, 10)  # one request, two engine requests
            assert wait_for(lambda: engine.stats()["num_requests_running"] == 2, 10)
            # capacity 4: two places left, a list of three does not fit, and what it added is taken back
            assert_error(client.post("/v1/completions", json={**body, "prompt": ["c", "d", "e"]}), 503)
            assert wait_for(lambda: engine.num_inflight == 2, 10)
            faults.delay = 0.0
            first.join(60)
    finally:
        faults.remove()
    assert results == [200]


# ---- 5. slow headers, idle connections, big heads ------------------------------------------------------------
def _connect(served: Served) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_headers_get_408_and_are_closed(served: Served):
    sock = _connect(served)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    try:
        for _ in range(30):  # one header byte every 0.1 s would hold the connection forever without the deadline
            sock.sendall(b"X")
            time.sleep(0.1)
    except OSError:
        pass  # closed under us: what we want
    data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 5
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408


def test_silent_and_idle_keep_alive_connections_are_closed(served: Served):
    silent = _connect(served)
    t0 = time.monotonic()
    assert _read_all(silent) == b"" and time.monotonic() - t0 < 5
    sock = _connect(served)
    sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.1)
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    assert _read_all(sock) == b""  # the idle keep-alive connection is closed by the server
    assert time.monotonic() - t0 < 3


def test_oversized_head_is_431(served: Served):
    sock = _connect(served)
    try:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    except OSError:
        pass
    assert _read_all(sock).startswith(b"HTTP/1.1 431")


# ---- 6. content type and CORS --------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_json_routes_need_json_content_type(http: httpx.Client, content_type: str | None):
    headers = {} if content_type is None else {"content-type": content_type}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        resp = http.post(path, content=json.dumps({"prompt": "hi", "max_tokens": 1}), headers=headers)
        assert_error(resp, 415)


def test_json_with_charset_is_accepted(http: httpx.Client):
    resp = http.post("/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 1}),
                     headers={"content-type": "application/json; charset=utf-8"})
    assert resp.status_code == 200


def test_no_cors_by_default_and_configured_cors(http: httpx.Client, engine):
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    resp = http.options("/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in resp.headers
    client = client_for(engine, allowed_origins=("https://ok.example",), api_key="k")
    ok = client.options("/v1/completions", headers={**preflight, "Origin": "https://ok.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    bad = client.options("/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in bad.headers


# ---- 7. chat templates -----------------------------------------------------------------------------------------
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"


def test_request_chat_template_needs_trust(http: httpx.Client):
    body = {"messages": CHAT, "max_tokens": 1, "chat_template": TEMPLATE}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "chat_template")


def test_trusted_request_template_is_rendered_bounded(engine):
    client = client_for(engine, trust_request_chat_template=True)
    body = {"messages": CHAT, "max_tokens": 1, "temperature": 0}
    resp = client.post("/v1/chat/completions", json={**body, "chat_template": TEMPLATE})
    assert resp.status_code == 200
    expected = engine.tokenizer.encode("[user] hi\n>", add_special_tokens=False)
    assert resp.json()["usage"]["prompt_tokens"] == len(expected)
    for evil in ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
                 "{{ 'x' * 10**10 }}", "{{ '%0999999999d' | format(1) }}", "{{ ''.__class__.__mro__ }}",
                 "{% for i in range(99999) %}{{ 'xxxxxxxxxx' }}{% endfor %}"):
        t0 = time.monotonic()
        resp = client.post("/v1/chat/completions", json={**body, "chat_template": evil})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template", resp.text
        assert time.monotonic() - t0 < 5


def test_model_template_render_is_time_bounded(http: httpx.Client, engine, monkeypatch):
    from ironlm.server import chat_template

    monkeypatch.setattr(chat_template, "MODEL_RENDER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    assert_error(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}), 400, "messages")
    assert_error(http.post("/tokenize", json={"messages": CHAT}), 400, "messages")
    assert time.monotonic() - t0 < 5


def test_operator_chat_template(engine, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    for value in (str(path), TEMPLATE):
        client = client_for(engine, chat_template=value)
        resp = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        expected = engine.tokenizer.encode("[user] hi\n>", add_special_tokens=False)
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == len(expected)


# ---- 8. the OpenAPI document ----------------------------------------------------------------------------------
def test_openapi_declares_bodies_errors_and_metrics(http: httpx.Client):
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        post = doc["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and model in schemas
        for status in ("400", "413", "415", "500", "503"):
            assert post["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ErrorResponse")
    assert schemas["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0]["maximum"] == 20
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "maximum" in json.dumps(schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"])


def test_penalised_request_longer_than_the_pool_width_finishes(http: httpx.Client):
    # Found by the fuzz: the penalty pool grew inside inference mode, then its release at finish raised (500),
    # leaking the sampler slot so that the next penalised request failed too.
    body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "repetition_penalty": 1.8, "temperature": 0}
    for _ in range(2):
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length", resp.text
