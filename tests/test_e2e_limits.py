"""Queue limits, timeouts, scheduling policies and cache-salt isolation, end to end over HTTP and gRPC.

Each policy gets its own real tiny-model engine with one running slot (max_num_seqs=1), so a long request
holds the batch and whatever arrives next waits in the core's queue, where the limits and the policy act.
The model forward is slowed down (server_utils.ForwardFaults.delay) only to keep that request running.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest

from ironlm.grpc import ironlm_pb2 as pb
from server_utils import RealServer, wait_for

TRANSPORTS = ["http", "grpc"]
POLICIES = ["fcfs", "priority", "deadline"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, RealServer]]:
    made = {policy: RealServer(tmp_path_factory, grpc_server=True, scheduling_policy=policy, max_num_seqs=1,
                               max_queue_len=2) for policy in POLICIES}
    yield made
    for server in made.values():
        server.stop()


@pytest.fixture
def fcfs(servers) -> RealServer:
    return servers["fcfs"]


def stats(server: RealServer) -> dict:
    """As of the end of the engine's last step (a snapshot): poll it with wait_for."""
    return server.engine.stats()


@contextlib.contextmanager
def holding_the_batch(server: RealServer, delay: float = 0.05) -> Iterator[None]:
    """A long streaming request occupies the one running slot until the block exits (then it is aborted).

    230 tokens at >= `delay` s each: the block has over 10 s before the request could end on its own."""
    server.faults.delay = delay
    body = {"prompt": "hold the batch", "max_tokens": 230, "ignore_eos": True, "stream": True,
            "priority": -10}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a collected line iterator closes the connection (an abort)
            assert next(lines).startswith("data: {")
            assert wait_for(lambda: stats(server)["num_requests_running"] == 1)
            yield
    finally:
        server.faults.delay = 0.0
    assert wait_for(server.idle), server.kv_blocks()


def call(server: RealServer, transport: str, max_tokens: int = 3, **extra) -> tuple[int, dict]:
    """One greedy completion; returns (HTTP status or gRPC code name, parsed result or error)."""
    if transport == "http":
        body = {"prompt": "what comes next", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
        resp = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        if resp.status_code != 200:
            return resp.status_code, resp.json()["error"]
        data = resp.json()
        choice = data["choices"][0]
        return 200, {"text": choice["text"], "finish_reason": choice["finish_reason"],
                     "completion_tokens": data["usage"]["completion_tokens"]}
    sampling = pb.SamplingParameters(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    request = pb.GenerateRequest(text="what comes next", sampling=sampling, **extra)
    try:
        resp = server.rpc.stub.Generate(request, timeout=60)
    except grpc.RpcError as exc:
        return exc.code().name, {"message": exc.details()}
    c = resp.completions[0]
    return 200, {"text": c.text, "finish_reason": c.finish_reason, "completion_tokens": resp.usage.completion_tokens}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_queue_limit_counts_waiting_requests_only(fcfs: RealServer, transport: str):
    expected = call(fcfs, transport)
    assert expected[0] == 200
    with holding_the_batch(fcfs), httpx.Client(base_url=fcfs.url, timeout=60) as http:
        # One running + two waiting: max_queue_len=2 bounds the queue, not the batch, so both are accepted.
        waiting = [http.stream("POST", "/v1/completions", json={
            "prompt": "what comes next", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True})
            for _ in range(2)]
        with waiting[0] as first, waiting[1] as second:
            assert first.status_code == second.status_code == 200
            assert wait_for(lambda: stats(fcfs)["num_requests_waiting"] == 2)
            prompt_tokens = stats(fcfs)["prompt_tokens_total"]
            status, err = call(fcfs, transport)
            if transport == "http":
                assert status == 503 and err["code"] == "queue_full", err
            else:
                assert status == "UNAVAILABLE", err
            time.sleep(0.1)  # a few steps: the refused request must not show up in the engine
            assert stats(fcfs)["num_requests_waiting"] == 2 and stats(fcfs)["prompt_tokens_total"] == prompt_tokens
    assert call(fcfs, transport) == expected  # the queue drained; the engine serves as before


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timeout_while_queued_is_unavailable_and_leaves_the_queue(fcfs: RealServer, transport: str):
    with holding_the_batch(fcfs):
        t0 = time.monotonic()
        status, err = call(fcfs, transport, timeout=0.3)
        assert time.monotonic() - t0 < 5
        if transport == "http":
            assert status == 503 and err["code"] == "timeout", err
        else:
            assert status == "UNAVAILABLE", err
        assert wait_for(lambda: stats(fcfs)["num_requests_waiting"] == 0)
        assert stats(fcfs)["num_requests_running"] == 1  # the long request is untouched


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timeout_mid_generation_returns_the_partial_output(fcfs: RealServer, transport: str):
    fcfs.faults.delay = 0.02
    try:
        status, result = call(fcfs, transport, max_tokens=200, timeout=1.0)  # ~50 tokens at 20 ms
    finally:
        fcfs.faults.delay = 0.0
    assert status == 200 and result["finish_reason"] == "timeout", result
    assert 0 < result["completion_tokens"] < 200
    assert wait_for(fcfs.idle), fcfs.kv_blocks()


class FinishLog:
    """Request ids in the order the engine finished them (wraps the real step, on the engine thread)."""

    def __init__(self, server: RealServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.order: list[str] = []
        engine = server.engine.engine
        step = engine.step

        def logged_step():
            outputs = step()
            self.order.extend(o.request_id for o in outputs if o.finished)
            return outputs

        monkeypatch.setattr(engine, "step", logged_step)


# B arrives first but matters less: later priority value, later TTFT deadline.
EXPECTED_ORDER = {"fcfs": ["B", "C"], "priority": ["C", "B"], "deadline": ["C", "B"]}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_policy_orders_the_waiting_requests(servers, policy: str, transport: str, monkeypatch):
    server = servers[policy]
    log = FinishLog(server, monkeypatch)
    results: dict[str, tuple] = {}
    tags = {"B": {"priority": 5, "deadline": 60.0}, "C": {"priority": 0, "deadline": 5.0}}

    def send(tag: str) -> Callable[[], None]:
        rid = f"{tag}-{policy}-{transport}"
        return lambda: results.__setitem__(tag, call(server, transport, request_id=rid, **tags[tag]))

    with holding_the_batch(server):
        threads = []
        for n, tag in enumerate("BC", start=1):  # B is queued strictly before C
            threads.append(threading.Thread(target=send(tag)))
            threads[-1].start()
            assert wait_for(lambda n=n: stats(server)["num_requests_waiting"] == n)
        # leaving the block aborts the long request: the policy picks the next one
    for t in threads:
        t.join(60)
    assert results["B"][0] == results["C"][0] == 200, results
    assert results["B"][1] == results["C"][1]  # same prompt, greedy: order changes nothing else
    assert [rid.split("-")[0] for rid in log.order if rid[0] in "BC"] == EXPECTED_ORDER[policy]


def prefix_hits(server: RealServer) -> int:
    return stats(server)["prefix_cache_hits"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cache_salt_isolates_the_prefix_cache(fcfs: RealServer, transport: str):
    # A prompt of several full blocks (block_size 4), new to this engine: the first request misses.
    prompt = f"{transport}: tenant data for the model is in the world of the token " * 2

    def hits_of(**extra) -> tuple[int, str]:
        before = prefix_hits(fcfs)
        if transport == "http":
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **extra}
            resp = httpx.post(f"{fcfs.base_url}/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            text = resp.json()["choices"][0]["text"]
        else:
            req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParameters(
                max_tokens=2, temperature=0, ignore_eos=True), **extra)
            text = fcfs.rpc.stub.Generate(req, timeout=60).completions[0].text
        assert wait_for(lambda: fcfs.engine.num_inflight == 0)
        return prefix_hits(fcfs) - before, text

    first, text = hits_of(cache_salt="tenant-a")
    assert first == 0
    again, text_again = hits_of(cache_salt="tenant-a")
    assert again > 0 and text_again == text  # same tenant: its own prefix is reused
    assert hits_of(cache_salt="tenant-b") == (0, text)  # another tenant never sees tenant-a's blocks
    assert hits_of() == (0, text)  # nor does an unsalted request
    unsalted_again, _ = hits_of()
    assert unsalted_again > 0
    assert wait_for(fcfs.idle), fcfs.kv_blocks()
