"""bench/sse_client.py (the latency bench's streaming client) against a real uvicorn server on the tiny model."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time

import httpx
import pytest

from ironlm.bench.serve import RequestResult
from ironlm.bench.server_process import free_port
from ironlm.bench.sse_client import stream_request
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


def _canned_server(chunks: list[bytes]) -> tuple[str, threading.Thread]:
    """A socket that answers one request with `chunks` sent one `send` apart (events split across reads)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            while b"\r\n\r\n" not in conn.recv(65536):
                pass
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for c in chunks:
                conn.sendall(b"%x\r\n%s\r\n" % (len(c), c))
                time.sleep(0.01)
            conn.sendall(b"0\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"http://127.0.0.1:{port}/v1/completions", t


def test_counts_token_events_across_split_chunks():
    """The framing on fixed bytes: an event split over two chunks, two events in one, the end marker not counted."""
    ev = [json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": f}]}).encode()
          for t, f in [("a", None), ("b", None), ("cd", None), ("", "length")]]
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 4}}).encode()
    stream = b"".join(b"data: " + e + b"\n\n" for e in [*ev, usage]) + b"data: [DONE]\n\n"
    cut = [0, 9, len(ev[0]) + 8 + len(ev[1]) + 8 + 3, len(stream) - 5, len(stream)]
    url, t = _canned_server([stream[a:b] for a, b in itertools.pairwise(cut)])
    res = RequestResult(1, 4)
    stream_request(url, {"prompt": [5]}, res, 10)
    t.join(10)
    assert res.success and res.error == "" and res.output_tokens == 4
    assert res.token_chunks == 3 and len(res.itl) == 2


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
