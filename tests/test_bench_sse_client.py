"""bench/sse_client.py (the bench clients: blocking for the latency bench, asyncio for the serve bench) against a real
uvicorn server on the tiny model and against canned bytes."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time

import httpx
import pytest

from ironlm.bench import serve as bench_serve
from ironlm.bench.datasets import BenchRequest
from ironlm.bench.serve import RequestResult
from ironlm.bench.server_process import free_port
from ironlm.bench.sse_client import SseDecoder, astream_request, stream_request
from ironlm.bench.stream import stream_once
from server_utils import LiveServer, shared_server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


def test_counts_the_tokens_the_server_streams(server: LiveServer):
    res = stream_once(server.url, [5, 6, 7], 6)
    assert res.success and res.error == ""
    assert res.output_tokens == 6  # from the usage chunk
    assert res.token_chunks >= 1 and len(res.itl) == res.token_chunks - 1
    assert res.ttft > 0 and res.latency >= res.ttft and all(x >= 0 for x in res.itl)
    # A general client's view of the same request: the server may stream two tokens in one event (or the last one
    # with the finish_reason) when it runs ahead of the reader, so the two requests' chunk counts need not match.
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert 1 <= res.token_chunks <= 6 and 1 <= len(events) - 1 <= 6


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _canned_server(*answers: list[bytes]) -> tuple[str, threading.Thread]:
    """A socket that answers one request per entry of `answers`, in turn, with its pieces sent one `send` apart
    (events split across reads), then closes each connection."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        with srv:
            for pieces in answers:
                conn, _ = srv.accept()
                with conn:
                    while b"\r\n\r\n" not in conn.recv(65536):
                        pass
                    for piece in pieces:
                        conn.sendall(piece)
                        time.sleep(0.01)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"http://127.0.0.1:{port}/v1/completions", t


def _chunked(pieces: list[bytes]) -> list[bytes]:
    return [OK_HEAD, *(b"%x\r\n%s\r\n" % (len(c), c) for c in pieces), b"0\r\n\r\n"]


def _events() -> bytes:
    ev = [json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": f}]}).encode()
          for t, f in [("a", None), ("b", None), ("cd", None), ("", "length")]]
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 4}}).encode()
    return b"".join(b"data: " + e + b"\n\n" for e in [*ev, usage]) + b"data: [DONE]\n\n"


def _split(stream: bytes) -> list[bytes]:
    """An event split over two chunks, two events in one, the end marker cut."""
    first = stream.index(b"\n\n") + 2
    second = stream.index(b"\n\n", first) + 2
    cut = [0, 9, second + 3, len(stream) - 5, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(cut)]


def _run_async(url: str, res: RequestResult) -> tuple[bool, str | None]:
    return asyncio.run(astream_request(url, {"prompt": [5]}, res, 10))


@pytest.mark.parametrize("client", ["blocking", "asyncio"])
def test_counts_token_events_across_split_chunks(client: str):
    """The framing on fixed bytes: an event split over two chunks, two events in one, the end marker not counted."""
    url, t = _canned_server(_chunked(_split(_events())))
    res = RequestResult(1, 4)
    res.start = time.perf_counter()
    if client == "blocking":
        stream_request(url, {"prompt": [5]}, res, 10)
    else:
        assert _run_async(url, res) == (False, None)
    t.join(10)
    assert res.success and res.error == "" and res.output_tokens == 4
    assert res.token_chunks == 3 and len(res.itl) == 2 and res.latency >= res.ttft > 0


def test_decoder_byte_by_byte_and_a_plain_body():
    """Every cut of the chunked framing (sizes in hex with extensions, CRLFs split) gives the same events."""
    body = _events()
    framed = b"".join(_chunked([body[:7], body[7:100], body[100:]])[1:])
    framed = framed.replace(b"\r\n", b";ext=1\r\n", 1)  # a chunk extension on the first size line
    dec = SseDecoder(chunked=True)
    got = [e for i in range(len(framed)) for e in dec.feed(framed[i:i + 1])]
    assert dec.complete and got[-1] == b"[DONE]" and len(got) == 6
    assert [json.loads(g) for g in got[:-1]] == [json.loads(e[6:]) for e in body.split(b"\n\n")[:5]]
    plain = SseDecoder(chunked=False)
    assert plain.feed(body) == got and not plain.complete
    crlf = body.replace(b"\n", b"\r\n")  # CRLF line ends, fed 3 bytes at a time (some pairs cut in two)
    dec = SseDecoder(chunked=False, length=len(crlf))
    assert [e for i in range(0, len(crlf), 3) for e in dec.feed(crlf[i:i + 3])] == got and dec.complete
    with pytest.raises(ValueError):
        SseDecoder(chunked=True).feed(b"zz\r\n")


def test_async_client_retries_a_503_honouring_retry_after(monkeypatch):
    """bench/serve.py's retry loop on the light client: a 503 (its Retry-After read), then the answer."""
    busy = b'{"error": {"message": "busy"}}'
    url, t = _canned_server([b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 0\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(busy), busy)], _chunked([_events()]))
    res = RequestResult(1, 4)
    assert _run_async(url, res) == (True, "0") and res.error.startswith("HTTP 503") and "busy" in res.error
    req = BenchRequest(prompt_token_ids=[1, 2], output_len=4)
    res = asyncio.run(bench_serve._one_request(None, url, None, req, 10))  # the second answer
    t.join(10)
    assert res.success and res.retries == 0 and res.output_tokens == 4

    monkeypatch.setattr(bench_serve, "RETRY_BACKOFF_S", 0.001)
    refused = f"http://127.0.0.1:{free_port()}/v1/completions"
    res = asyncio.run(bench_serve._one_request(None, refused, None, req, 10, max_retries=2))
    assert not res.success and res.retries == 2 and "ConnectionRefusedError" in res.error


def test_async_client_on_the_live_server(server: LiveServer):
    """The serve bench's default client against uvicorn: tokens counted from the usage, a 400 reported."""
    req = BenchRequest(prompt_token_ids=[5, 6, 7], output_len=6)
    res = asyncio.run(bench_serve._one_request(None, f"{server.url}/v1/completions", None, req, 60))
    assert res.success and res.output_tokens == 6 and 1 <= res.token_chunks <= 6
    bad = RequestResult(1, 4)
    url = f"{server.url}/v1/completions"
    assert asyncio.run(astream_request(url, {"prompt": [5], "max_tokens": -1, "stream": True}, bad, 60)) \
        == (False, None)
    assert not bad.success and bad.error.startswith("HTTP 400") and "max_tokens" in bad.error


def test_an_http_error_is_reported_not_counted(server: LiveServer):
    res = RequestResult(1, 4)
    stream_request(f"{server.url}/v1/completions", {"prompt": [5], "max_tokens": -1, "stream": True}, res, 60)
    assert not res.success and res.error.startswith("HTTP 400") and "max_tokens" in res.error
    with pytest.raises(RuntimeError, match="HTTP 400"):
        stream_once(server.url, [], 4)  # an empty prompt


def test_a_refused_connection_is_an_error():
    res = RequestResult(1, 4)
    stream_request(f"http://127.0.0.1:{free_port()}/v1/completions", {"prompt": [5]}, res, 5)
    assert not res.success and "ConnectionRefusedError" in res.error
