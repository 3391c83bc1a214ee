"""`cached_tokens` in usage: prompt tokens a request found in the prefix cache, reported per request.

The core reports, for each request it admits for the first time, how many prompt tokens hit the cache (whole
KV blocks); the engine records it on the request and HTTP (`usage.prompt_tokens_details.cached_tokens`) and
gRPC (`usage.cached_tokens`) report it. Prompts are token ids so the shared prefix has an exact length, and
each case runs under its own cache salt so blocks other tests cached can never hit.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from ironlm.grpc import ironlm_pb2 as pb
from server_utils import TINY_ENGINE_KW, GrpcServer, LiveServer, shared_server, wait_for

BLOCK = TINY_ENGINE_KW["block_size"]
SHARED = 5 * BLOCK + 2  # five full blocks and part of a sixth


@pytest.fixture(scope="module")
def http_server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def rpc(http_server: LiveServer):
    server = GrpcServer(http_server.engine)
    yield server
    server.stop()


def prompts(seed: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing their first SHARED tokens, differing after."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 200) for _ in range(SHARED)]
    return shared + [201, 202, 203], shared + [204, 205, 206, 207, 208]


def http_cached(server: LiveServer, prompt: list[int], salt: str, stream: bool = False) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    resp = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    if not stream:
        usage = resp.json()["usage"]
    else:
        events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return usage["prompt_tokens_details"]["cached_tokens"]


def grpc_cached(rpc: GrpcServer, prompt: list[int], salt: str, stream: bool = False) -> int:
    sampling = pb.SamplingParameters(max_tokens=3, temperature=0, ignore_eos=True)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), cache_salt=salt, sampling=sampling)
    if stream:
        msgs = list(rpc.stub.StreamGenerate(req, timeout=60))
        assert msgs[-1].finished
        usage = msgs[-1].usage
    else:
        usage = rpc.stub.Generate(req, timeout=60).usage
    assert usage.prompt_tokens == len(prompt)
    return usage.cached_tokens


@pytest.mark.parametrize("transport", ["http", "http-stream", "grpc", "grpc-stream"])
def test_a_shared_prefix_reports_its_full_blocks_as_cached(http_server: LiveServer, rpc: GrpcServer,
                                                          transport: str) -> None:
    def cached(prompt: list[int], salt: str) -> int:
        kind, _, mode = transport.partition("-")
        if kind == "http":
            got = http_cached(http_server, prompt, salt, stream=mode == "stream")
        else:
            got = grpc_cached(rpc, prompt, salt, stream=mode == "stream")
        assert wait_for(lambda: http_server.engine.num_inflight == 0)
        return got

    first, second = prompts(seed=len(transport))
    salt = f"cached-tokens-{transport}"
    assert cached(first, salt) == 0  # nothing of this salt cached yet
    # The second prompt shares SHARED tokens: only the whole blocks among them can be reused.
    assert cached(second, salt) == (SHARED // BLOCK) * BLOCK
    # The same prompt again: every full block of it is cached now (the partial last block never is).
    assert cached(second, salt) == (len(second) // BLOCK) * BLOCK
    # Another tenant shares nothing.
    assert cached(second, salt + "-other") == 0
