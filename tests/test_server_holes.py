"""Issue 21's server holes, each reproduced against a live uvicorn server with `ironlm serve`'s connection limits:
client faults that opened the circuit breaker, slow bodies and connection floods, logprob amplification,
continuous usage stats, the gRPC request id and the 413 a client must be able to read."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from ironlm.config import ServerConfig
from ironlm.grpc import ironlm_pb2 as pb
from ironlm.server.api import build_app
from server_utils import ForwardFaults, GrpcServer, LiveServer, tiny_engine, wait_for

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


def test_a_500_before_the_engine_is_logged_but_not_counted(serve, engine, caplog):
    """A request-handling bug (here: chat templating raising) is the server's, but a cool-down cannot cure it and
    whoever finds one must not be able to refuse service to everyone; engine failures still count."""
    server = serve(circuit_breaker_window=5, circuit_breaker_min_requests=5)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected templating bug")

    engine.apply_chat_template = broken
    try:
        for _ in range(6):
            assert httpx.post(f"{server.base_url}/chat/completions", json=chat, timeout=30).status_code == 500
    finally:
        del engine.apply_chat_template
    assert any("internal error" in r.getMessage() for r in caplog.records)  # still logged as the bug it is
    assert health(server)["circuit_breaker"]["window_requests"] == 0
    faults = ForwardFaults(engine.engine)
    faults.fail_next = 5
    try:  # the engine failing: counted, and the breaker opens
        codes = [httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30).status_code
                 for _ in range(6)]
    finally:
        faults.fail_next = 0
        faults.remove()
    assert codes[:5] == [500] * 5 and codes[5] == 503 and health(server)["circuit_breaker"]["trips"] == 1


# ---- 7: slow bodies and connection floods ---------------------------------------------------------------------
def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes (the test fails on a hang: recv times out)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_body_dripped_byte_by_byte_gets_408_and_is_closed(serve):
    server = serve(timeout_request_body=0.6, circuit_breaker_window=5, circuit_breaker_min_requests=1)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw_head() + b"{")
        t0 = time.monotonic()
        sock.settimeout(0.15)
        got = b""
        while not got and time.monotonic() - t0 < 5:  # keep dripping, as the probe did, until an answer comes
            sock.sendall(b" ")
            try:
                got = sock.recv(65536)
            except TimeoutError:
                continue
        raw = got + read_response(sock)
    assert 0.5 < time.monotonic() - t0 < 3
    status, err = status_and_error(raw)
    assert status == 408 and "request body" in err["message"] and set(err) == {"message", "type", "param", "code"}
    # The app saw a disconnect, not a failure: the breaker (min 1 request) stayed shut and the server serves.
    assert httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30).status_code == 200
    assert health(server)["circuit_breaker"]["trips"] == 0


def test_a_complete_body_is_not_timed_out(serve):
    server = serve(timeout_request_body=0.6)
    body = json.dumps(COMPLETION).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw_head(length=len(body), extra="Connection: close\r\n") + body[:5])
        time.sleep(0.3)  # slow, within the deadline
        sock.sendall(body[5:])
        status, _, _ = read_response(sock).partition(b"\r\n")
    assert status.split()[1] == b"200"


def test_open_connections_per_client_address_are_capped(serve):
    server = serve(max_connections_per_client=4)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            status, err = status_and_error(read_response(extra))
        assert status == 429 and err["code"] == "too_many_connections" and "127.0.0.1" in err["message"]
        idle.pop().close()  # one place frees: a normal request is served again
        assert wait_for(lambda: _completes(server), 10)
    finally:
        for sock in idle:
            sock.close()


def test_a_refused_connection_lingers_boundedly_and_frees_its_place(serve):
    server = serve(max_connections_per_client=1, timeout_request_header=0.3, timeout_keep_alive=0.5)
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")  # a head that never completes
        slow.settimeout(5)
        assert slow.recv(65536).startswith(b"HTTP/1.1 408")
        # This client neither reads on nor closes: the server's linger ends on its own, and the place frees.
        assert wait_for(lambda: _completes(server), 5)


def _completes(server: LiveServer) -> bool:
    try:
        return httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30).status_code == 200
    except httpx.TransportError:  # the 429 and close, while the server has not yet seen the freed connection
        return False


# ---- 10: a refused body is drained up to a bound, so the client reads its 413 --------------------------------
BIG = 20 * 1024**2  # the probe's 20 MB, against a 1 MiB cap


def send_then_read(server: LiveServer, request: bytes, then: bytes = b"") -> tuple[bytes, bytes]:
    """As most clients do: write the whole request, only then read; `then` goes on the same connection after the
    first response (which must have a Content-Length)."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        sock.settimeout(10)
        first = b""
        while b"\r\n\r\n" not in first:
            first += sock.recv(65536) or b"!"  # b"!": closed before a response head, fail below, not spin
            assert not first.endswith(b"!"), first
        head, _, body = first.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(body) < length:
            body += sock.recv(65536)
        second = b""
        if then:
            sock.sendall(then)
            second = read_response(sock)
    return head + b"\r\n\r\n" + body, second


def test_a_body_over_the_cap_by_content_length_reads_413_not_a_reset(serve):
    server = serve(max_request_bytes=1 << 20)
    good = json.dumps(COMPLETION).encode()
    first, second = send_then_read(server, raw_head(length=BIG) + b" " * BIG,
                                   then=raw_head(length=len(good), extra="Connection: close\r\n") + good)
    status, err = status_and_error(first)
    assert status == 413 and err["code"] == "request_too_large" and b"connection: close" not in first.lower()
    assert second.split()[1] == b"200"  # the drained connection stays usable


def test_a_chunked_body_over_the_cap_reads_413_not_a_reset(serve):
    server = serve(max_request_bytes=1 << 20)
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    first, _ = send_then_read(server, head + chunk * (BIG // 65536) + b"0\r\n\r\n")
    status, err = status_and_error(first)
    assert status == 413 and err["code"] == "request_too_large"


def test_a_wrong_content_type_reads_415_not_a_reset(serve):
    server = serve()
    body = b" " * (4 << 20)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    status, err = status_and_error(send_then_read(server, head.encode() + body)[0])
    assert status == 415 and err["code"] == "unsupported_media_type"


def test_a_body_over_the_drain_bound_is_cut_off_at_once(serve):
    server = serve(max_request_bytes=1 << 20, max_request_drain_bytes=2 << 20)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw_head(length=1 << 30))  # a gigabyte is not read: the 413 comes before any body byte
        status, err = status_and_error(read_response(sock))
    assert status == 413 and err["code"] == "request_too_large"


# ---- 10: logprob amplification is bounded per request ---------------------------------------------------------
def test_the_probes_amplifying_request_is_400_naming_logprobs(serve):
    server = serve()  # the default limit
    resp = httpx.post(f"{server.base_url}/completions", timeout=30,
                      json={**COMPLETION, "n": 128, "logprobs": 20, "max_tokens": 200, "stream": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"
    assert "512000" in resp.json()["error"]["message"]


def test_logprob_budget_counts_prompts_choices_tokens_and_top(serve):
    server = serve(max_request_logprobs=1000)

    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.base_url}/{route}", json=body, timeout=30)

    assert post("completions", {**COMPLETION, "n": 2, "logprobs": 20, "max_tokens": 10}).status_code == 200
    over = post("completions", {**COMPLETION, "n": 3, "logprobs": 20, "max_tokens": 20})
    assert over.status_code == 400 and over.json()["error"]["param"] == "logprobs"
    prompts = post("completions", {**COMPLETION, "prompt": ["a", "b", "c"], "logprobs": 20, "max_tokens": 20})
    assert prompts.status_code == 400 and "3 prompts" in prompts.json()["error"]["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "max_tokens": 10}
    assert post("chat/completions", {**chat, "n": 2, "top_logprobs": 20}).status_code == 200
    top = post("chat/completions", {**chat, "n": 8, "top_logprobs": 20})
    assert top.status_code == 400 and top.json()["error"]["param"] == "top_logprobs"
    # No max_tokens: the room left in max_model_len (256 here) is what may be generated.
    unbounded = post("chat/completions", {**{k: v for k, v in chat.items() if k != "max_tokens"}, "top_logprobs": 5})
    assert unbounded.status_code == 400 and unbounded.json()["error"]["param"] == "top_logprobs"
    plain = post("completions", {**COMPLETION, "n": 8, "max_tokens": 200})
    assert plain.status_code == 200, plain.text  # no logprobs asked for: no logprob budget


# ---- 10: stream_options.continuous_usage_stats is honoured, as in vLLM ------------------------------------------
def sse_events(server: LiveServer, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/{route}", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_continuous_usage_stats_put_usage_in_every_chunk(serve, route):
    server = serve()
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
                            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": "hello"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    events = sse_events(server, route, body)
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12  # 2 choices x 6 tokens
    prompt = final["usage"]["prompt_tokens"]
    seen: dict[int, int] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        u = chunk["usage"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
        assert u["completion_tokens"] >= seen.get(choice["index"], 0)  # its own choice's tokens so far
        seen[choice["index"]] = u["completion_tokens"]
    assert seen == {0: 6, 1: 6}
    # Without it (include_usage alone) the chunks carry usage: null, as in OpenAI.
    body["stream_options"] = {"include_usage": True}
    assert all(e["usage"] is None for e in sse_events(server, route, body)[:-1])


# ---- 10: the gRPC request id is bounded like HTTP's; gRPC has the same logprob budget ------------------------
@pytest.fixture
def rpc(engine) -> Iterator[Any]:
    server = GrpcServer(engine)
    yield server
    server.stop()


def test_grpc_request_id_is_bounded(rpc):
    sampling = pb.SamplingParameters(max_tokens=2, temperature=0)
    for rid in ("x" * 257, "x" * (1 << 20)):  # the probe sent 1 MB
        with pytest.raises(grpc.RpcError) as refused:
            rpc.stub.Generate(pb.GenerateRequest(text="hello", request_id=rid, sampling=sampling), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in refused.value.details()
    ok = rpc.stub.Generate(pb.GenerateRequest(text="hello", request_id="r" * 256, sampling=sampling), timeout=30)
    assert ok.request_id == "r" * 256 and ok.finished


def test_grpc_logprob_budget(rpc):
    sampling = pb.SamplingParameters(n=128, logprobs=20, max_tokens=200)
    with pytest.raises(grpc.RpcError) as refused:
        rpc.stub.Generate(pb.GenerateRequest(text="hello", sampling=sampling), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in refused.value.details()


# ---- the new limits are validated like the others ----------------------------------------------------------
@pytest.mark.parametrize(("name", "value"), [("timeout_request_body", 0), ("timeout_request_body", -1.0),
                                             ("max_connections_per_client", -1), ("max_request_drain_bytes", 0),
                                             ("max_request_logprobs", 0), ("max_connections_per_client", True)])
def test_new_limits_reject_bad_values(name, value):
    from ironlm.exceptions import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as bad:
        ServerConfig(**{name: value})
    assert bad.value.param == name


def test_the_connection_cap_can_be_turned_off(serve):
    server = serve(max_connections_per_client=0)  # 0 means no cap, not a cap of none
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        assert httpx.post(f"{server.base_url}/completions", json=COMPLETION, timeout=30).status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_an_early_answer_says_close_and_ends_the_connection_while_the_body_is_pending(serve):
    """Head and 10 of 100 body bytes, then nothing: the key check's 401 comes at once, says `connection: close`,
    and the server's FIN follows (read_response would time out on a connection kept waiting for the rest)."""
    server = serve(api_key="k")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw_head(length=100) + b"{" * 10)
        raw = read_response(sock)
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 401") and b"\r\nconnection: close" in head, raw[:400]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_an_early_answer_to_a_big_body_ends_the_connection_cleanly(serve):
    """A refusal sent before the body was read (here the key check's 401): the client reads that one answer and
    then the server's FIN, not a second, made-up 431 for the body bytes that followed. The answer says
    `connection: close`, so a pooled client never sends its next request into that FIN (without it httpx below
    failed now and then with "Server disconnected without sending a response")."""
    server = serve(api_key="k", max_request_bytes=1 << 20)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw_head(length=BIG // 4) + b" " * (BIG // 4))
        raw = read_response(sock)
    assert raw.count(b"HTTP/1.1 ") == 1, raw[:400]
    assert status_and_error(raw)[0] == 401
    assert b"\r\nconnection: close\r\n" in raw.partition(b"\r\n\r\n")[0].lower() + b"\r\n", raw[:400]
    with httpx.Client(timeout=30) as client:  # a pooled client reconnects and goes on
        assert client.post(f"{server.base_url}/completions", content=b" " * (BIG // 4),
                           headers={"Content-Type": "application/json"}).status_code == 401
        assert client.post(f"{server.base_url}/completions", json=COMPLETION,
                           headers={"Authorization": "Bearer k"}).status_code == 200
