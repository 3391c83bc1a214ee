"""bench/sse_client.py (the latency bench's streaming client) against a real uvicorn server on the tiny model."""

from __future__ import annotations

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
    # The same chunks a general client sees: one per token event, the end marker not counted.
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: {")]
    assert len(events) == res.token_chunks + 1  # + the finish_reason chunk


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
