"""Multi-prompt completions are admitted all or none, in arrival order (issue 21 item 8): with room for 24
sequences (8 running + 16 waiting), four concurrent 8-prompt requests all got `queue_full` (zero goodput): their
prompts went in interleaved, each request hit the bound on a later prompt and rolled its own back."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server_utils import RealServer, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = RealServer(tmp_path_factory, max_num_seqs=8, max_queue_len=16)
    server.faults.delay = 0.01  # every request is still running when the last one arrives
    yield server
    server.stop()


async def _completions(url: str, n_requests: int, n_prompts: int) -> list[httpx.Response]:
    body = {"model": "tiny", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await asyncio.gather(*(
            http.post("/v1/completions", json={**body, "prompt": [f"request {r} prompt {p}" for p in range(n_prompts)]})
            for r in range(n_requests)))


def test_concurrent_lists_that_do_not_all_fit_serve_the_ones_that_do(server: RealServer) -> None:
    replies = asyncio.run(_completions(server.url, n_requests=4, n_prompts=8))
    served = [r for r in replies if r.status_code == 200]
    assert len(served) >= 3, [r.status_code for r in replies]
    for r in served:
        assert sorted(c["index"] for c in r.json()["choices"]) == list(range(8))
        assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
    for r in replies:
        if r.status_code != 200:  # the one that did not fit: refused whole, with the reason
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    assert wait_for(server.idle), server.kv_blocks()  # nothing of the refused request was left behind


def test_a_list_larger_than_the_capacity_is_refused_whole(server: RealServer) -> None:
    (reply,) = asyncio.run(_completions(server.url, n_requests=1, n_prompts=25))
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "queue_full"
    assert wait_for(server.idle), server.kv_blocks()
    (again,) = asyncio.run(_completions(server.url, n_requests=1, n_prompts=24))  # exactly the capacity
    assert again.status_code == 200 and len(again.json()["choices"]) == 24
