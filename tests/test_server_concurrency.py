"""Continuous batching end to end: many concurrent streams, and client disconnects freeing KV blocks."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest

from server_utils import LiveServer, RealServer, shared_server, wait_for

N_CLIENTS = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """Its own engine, each forward slowed to >= 10 ms: 200 tokens outlast the client's reads, so a
    disconnect always lands mid-generation (the tiny model alone can finish before the client looks)."""
    server = RealServer(tmp_path_factory)
    server.faults.delay = 0.01
    yield server
    server.stop()


def idle(server: LiveServer) -> bool:
    s = server.engine.stats()
    return server.engine.num_inflight == 0 and s["blocks_used"] == 0 and s["num_requests_running"] == 0


def test_concurrent_streams_equal_their_sequential_greedy_outputs(server: LiveServer):
    prompts = [f"request number {i} says" + " more" * (i % 7) for i in range(N_CLIENTS)]
    lengths = [4 + i % 9 for i in range(N_CLIENTS)]
    sync = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    expected = [sync.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
                for p, n in zip(prompts, lengths)]

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=N_CLIENTS)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120,
                                      http_client=httpx.AsyncClient(limits=limits, timeout=120)) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    got = asyncio.run(main())
    assert [t for t, _ in got] == expected
    assert all(f == "length" for _, f in got)
    assert wait_for(lambda: idle(server))


def test_stream_disconnect_aborts_and_frees_blocks(slow: RealServer):
    server = slow
    assert wait_for(server.idle)
    generated = server.engine.stats()["generation_tokens_total"]
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=body) as resp:
        seen = 0
        lines = resp.iter_lines()  # kept: a dropped line iterator closes the connection right away
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                seen += bool(chunk["choices"][0]["text"])
            if seen >= 3:
                break
        assert server.engine.num_inflight == 1  # still generating while the client reads
    # leaving the with-blocks closed the connection mid-stream
    assert wait_for(server.idle), server.kv_blocks()
    assert server.engine.stats()["generation_tokens_total"] - generated < 200  # stopped early


def test_non_stream_disconnect_aborts(slow: RealServer):
    server = slow
    assert wait_for(server.idle)
    generated = server.engine.stats()["generation_tokens_total"]
    payload = json.dumps({"model": "tiny", "prompt": "another long story", "max_tokens": 200,
                          "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", server.http.port), timeout=10) as sock:
        sock.sendall(request)
        assert wait_for(lambda: server.engine.num_inflight == 1, timeout=10)
    assert wait_for(server.idle), server.kv_blocks()
    assert server.engine.stats()["generation_tokens_total"] - generated < 200
