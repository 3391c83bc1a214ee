"""ironlm on Ray Serve (python/ironlm/ray): a local Ray on CPU, the tiny model, two engine replicas.

One module-scoped deployment serves every test, in order: the replica-death test kills a replica and waits for
Ray Serve to replace it, the last one scales down to one replica while streams are in flight. Pure helpers
(the affinity key, the metrics merge, RayConfig) are tested without a Ray cluster. Ray is imported plainly: it is
a test dependency, and a broken install must fail the suite rather than skip it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import ray  # a test dependency (ironlm[test] pulls ironlm[ray]): a broken install fails here, never skips
from ray import serve

from ironlm.exceptions import InvalidArgumentError
from ironlm.ray.config import RayConfig

BLOCK = 64  # affinity_block of the test deployment, in characters


@dataclass
class Deployment:
    url: str
    deploy: Callable[[int], None]  # (re)deploy with this many engine replicas


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from ironlm import EngineConfig
    from ironlm.config import ServerConfig
    from ironlm.ray.app import APP_NAME, build_application
    from server_utils import TINY_ENGINE_KW, tiny_model_path

    port = _free_port()
    # Logical CPUs only: two replicas at 0.5 each plus the 0-CPU ingress fit any machine.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # max_num_seqs 2: a burst leaves requests waiting inside a replica, not yet streaming.
        engine_config = EngineConfig(model=str(tiny_model_path(tmp_path_factory)), device="cpu",
                                     **{**TINY_ENGINE_KW, "max_num_seqs": 2})
        # A drain's bound, not what the tests measure: in `make test` beside another worker's load, the downscale
        # test's queued streams once needed more than 20 s to finish, and the replica cut the last one.
        server_config = ServerConfig(drain_timeout=60.0)

        def deploy(replicas: int) -> None:
            ray_config = RayConfig(num_replicas=replicas, replica_cpus=0.5, affinity_block=BLOCK,
                                   affinity_margin=8, max_ongoing_requests=16, health_check_period=1.0,
                                   health_check_timeout=10.0)
            app = build_application(engine_config, server_config, ray_config, served_model_names=["tiny"])
            serve.run(app, name=APP_NAME, route_prefix="/")

        deploy(2)
        yield Deployment(f"http://127.0.0.1:{port}", deploy)
    finally:
        serve.shutdown()
        ray.shutdown()


def _completion(prompt: str, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


async def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))


def _cache_hits(url: str) -> dict[str, float]:
    """ironlm:prefix_cache_hits_total per replica, from the ingress's merged /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    hits = {}
    for line in text.splitlines():
        if line.startswith("ironlm:prefix_cache_hits_total{"):
            labels, value = line.rsplit(" ", 1)
            replica = labels.split('replica="', 1)[1].split('"', 1)[0]
            hits[replica] = float(value)
    return hits


def test_concurrent_requests_succeed_and_spread_over_both_replicas(deployment: Deployment) -> None:
    url = deployment.url
    # Distinct prompts shorter than one affinity block: routed by load alone.
    bodies = [_completion(f"request {i}: hello") for i in range(32)]
    responses = asyncio.run(_post_all(url, bodies))
    assert [r.status_code for r in responses] == [200] * 32, [r.text for r in responses if r.status_code != 200]
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in responses)
    replicas = [r.headers["x-ironlm-replica"] for r in responses]
    assert len(set(replicas)) == 2, replicas
    assert min(replicas.count(r) for r in set(replicas)) >= 4, replicas  # both really took a share


def test_metrics_cover_every_replica_and_health(deployment: Deployment) -> None:
    url = deployment.url
    text = httpx.get(f"{url}/metrics", timeout=60).text
    waiting = [line for line in text.splitlines() if line.startswith("ironlm:num_requests_waiting{")]
    assert len(waiting) == 2 and len({line.split('replica="')[1] for line in waiting}) == 2, waiting
    health = httpx.get(f"{url}/health", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    bad = httpx.post(f"{url}/v1/completions", json={**_completion("x"), "max_tokens": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_prefix_sharing_requests_land_on_one_replica(deployment: Deployment) -> None:
    url = deployment.url
    shared = "The shared system preamble of a tenant: answer briefly and politely, in English. " * 2
    assert len(shared) >= BLOCK
    before = _cache_hits(url)
    replicas = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(8):
            r = client.post("/v1/completions", json=_completion(f"{shared} question {i}?"))
            assert r.status_code == 200, r.text
            replicas.append(r.headers["x-ironlm-replica"])
    assert len(set(replicas)) == 1, replicas
    after = _cache_hits(url)
    owner = replicas[0]
    # 7 later requests each find at least the shared prefix's full blocks cached on the owner.
    assert after[owner] - before.get(owner, 0.0) >= 7 * (len(shared) // 8)
    others = [rep for rep in after if rep != owner]
    assert all(after[rep] == before.get(rep, 0.0) for rep in others), (before, after)


def _finished(url: str, reason: str = "abort") -> float:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ironlm:request_success_total{") and f'finished_reason="{reason}"' in line)


def test_client_disconnect_aborts_the_request_in_its_replica(deployment: Deployment) -> None:
    """A stream the client hangs up on is aborted in its replica. The tiny model can finish its 200 tokens before the
    hang-up crosses the proxy (seen once under a loaded make test): such a try ends as "length", not "abort", and is
    tried again; an abort must come within three tries, and no try may end otherwise."""
    url = deployment.url
    for _ in range(3):
        aborted, done = _finished(url), _finished(url, "length")
        with httpx.Client(base_url=url, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=_completion("go on", max_tokens=200, stream=True)) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first token arrived; now hang up
        deadline = time.monotonic() + 30
        while (_finished(url), _finished(url, "length")) == (aborted, done) and time.monotonic() < deadline:
            time.sleep(0.5)
        now = (_finished(url), _finished(url, "length"))
        if now == (aborted + 1, done):
            return
        assert now == (aborted, done + 1), f"the request neither aborted nor finished: {now} vs {(aborted, done)}"
    pytest.fail("three streams finished before their client's hang-up reached the replica")


async def _stream(client: httpx.AsyncClient, body: dict[str, Any],
                  started: asyncio.Event) -> tuple[str, int, int]:
    """(outcome, tokens received, retries): outcome is "done", or "error" (an error event or a broken stream)."""
    tokens = retries = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            retries = int(r.headers.get("x-ironlm-retries", 0))
            if r.status_code != 200:
                return f"status {r.status_code}", tokens, retries
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return "done", tokens, retries
                event = json.loads(data)
                if "error" in event:
                    return "error", tokens, retries
                tokens += 1
                started.set()
    except httpx.HTTPError:
        return "error", tokens, retries
    return "error", tokens, retries  # ended without [DONE]


def _engine_replica_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA" in a["name"] and "IronlmEngine" in a["name"]]


async def _kill_mid_run(url: str) -> list[tuple[str, int, int]]:
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:
        started = asyncio.Event()
        # 32 streams, so that past the affinity margin both replicas hold requests still queued (max_num_seqs 2)
        # when the first token arrives, whichever replica is killed (16 could all finish on one side first).
        bodies = [_completion(f"stream {i}: tell me a story", max_tokens=48, stream=True) for i in range(32)]
        tasks = [asyncio.ensure_future(_stream(client, b, started)) for b in bodies]
        await asyncio.wait_for(started.wait(), 120)
        victim = await _replica_with_waiting_requests(client)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return list(await asyncio.gather(*tasks))


async def _replica_with_waiting_requests(client: httpx.AsyncClient) -> str:
    """The actor name of the replica with the most requests queued in its engine, once one has any.

    Killing whichever replica came first let a run pass vacuously or fail: on a slow machine the router had
    given that replica one request, so nothing queued there could be retried (CI, stop 30)."""
    deadline = time.monotonic() + 60
    while True:
        text = (await client.get("/metrics", timeout=60)).text
        waiting = {line.split('replica="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines() if line.startswith("ironlm:num_requests_waiting{")}
        busiest = max(waiting, key=lambda r: waiting[r], default=None)
        if busiest is not None and waiting[busiest] >= 2:
            break
        assert time.monotonic() < deadline, f"no replica queued two requests: {text}"
        await asyncio.sleep(0.05)
    names = [n for n in _engine_replica_actors() if n.endswith(f"#{busiest}")]
    assert len(names) == 1, (busiest, _engine_replica_actors())
    return names[0]


def test_killed_replica_loses_no_unstarted_request_and_recovers(deployment: Deployment) -> None:
    url = deployment.url
    assert len(_engine_replica_actors()) == 2
    outcomes = asyncio.run(_kill_mid_run(url))
    # A request fails only if its replica died after it had streamed tokens; everything else was retried.
    lost = [(outcome, tokens) for outcome, tokens, _ in outcomes if outcome != "done"]
    assert all(outcome == "error" and tokens > 0 for outcome, tokens in lost), outcomes
    assert sum(outcome == "done" for outcome, _, _ in outcomes) >= 8, outcomes
    # Requests queued inside the killed replica (two run at once there) were retried on the survivor.
    assert any(outcome == "done" and retries > 0 for outcome, _, retries in outcomes), outcomes

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        app = serve.status().applications["ironlm"]
        engine = app.deployments["IronlmEngine"]
        if app.status == "RUNNING" and engine.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the deployment did not recover: {serve.status()}")
    responses = asyncio.run(_post_all(url, [_completion(f"after {i}: hello") for i in range(8)]))
    assert [r.status_code for r in responses] == [200] * 8


async def _streams_across_downscale(deployment: Deployment) -> tuple[int, list[tuple[str, int, int]]]:
    """(streams still running when the downscale began, outcomes)"""
    async with httpx.AsyncClient(base_url=deployment.url, timeout=180) as client:
        started = asyncio.Event()
        bodies = [_completion(f"drain {i}: tell me a story", max_tokens=160, stream=True) for i in range(8)]
        tasks = [asyncio.ensure_future(_stream(client, b, started)) for b in bodies]
        await asyncio.wait_for(started.wait(), 120)
        running = sum(not t.done() for t in tasks)
        # serve.run returns once the deployment has one replica: the other has drained and stopped meanwhile.
        await asyncio.to_thread(deployment.deploy, 1)
        return running, list(await asyncio.gather(*tasks))


def test_downscale_drains_in_flight_streams(deployment: Deployment) -> None:
    running, outcomes = asyncio.run(_streams_across_downscale(deployment))
    assert running == 8
    assert [o for o, _, _ in outcomes] == ["done"] * 8, outcomes
    assert all(retries == 0 for _, _, retries in outcomes), outcomes
    engine = serve.status().applications["ironlm"].deployments["IronlmEngine"]
    assert engine.replica_states.get("RUNNING", 0) == 1, engine


# ---- without Ray ------------------------------------------------------------------------------------------
def test_prefix_key_hashes_the_first_block_only() -> None:
    from ironlm.ray.routing import prefix_key

    base = "x" * BLOCK

    def key(body: dict[str, Any], path: str = "/v1/completions") -> str | None:
        return prefix_key(path, json.dumps(body).encode(), BLOCK)

    assert key({"prompt": base + "a"}) == key({"prompt": base + "b"}) is not None
    assert key({"prompt": base}) != key({"prompt": "y" + base})
    assert key({"prompt": base[:-1]}) is None  # shorter than a block: no affinity
    assert key({"prompt": base, "model": "a"}) != key({"prompt": base, "model": "b"})
    assert key({"prompt": list(range(BLOCK)) + [1]}) == key({"prompt": list(range(BLOCK)) + [2]}) is not None
    chat = {"messages": [{"role": "system", "content": base}, {"role": "user", "content": "hi"}]}
    chat2 = {"messages": [{"role": "system", "content": base}, {"role": "user", "content": "bye"}]}
    assert key(chat, "/v1/chat/completions") == key(chat2, "/v1/chat/completions") is not None
    assert key({"prompt": base}, "/tokenize") is None
    assert prefix_key("/v1/completions", b"not json", BLOCK) is None


def test_router_keeps_a_prefix_on_its_replica_within_the_margin() -> None:
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from ironlm.ray.routing import PrefixAffinityRouter, RouteHint

    dep = DeploymentID(name="IronlmEngine", app_name="ironlm")
    a, b = (SimpleNamespace(replica_id=ReplicaID(n, dep)) for n in ("a", "b"))

    async def scenario(routing: str) -> list[list[list[str]]]:
        router = PrefixAffinityRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(routing=routing, margin=2)
        seen = []
        ids = iter(range(100))

        def pending(key: str | None) -> PendingRequest:
            rid = str(next(ids))
            return PendingRequest(args=[], kwargs={"route": RouteHint(prefix_key=key)},
                                  metadata=RequestMetadata(request_id=rid, internal_request_id=rid))

        async def route(key: str | None, to: Any) -> PendingRequest:
            req = pending(key)
            ranks = await router.choose_replicas([a, b], req)
            seen.append([sorted(r.replica_id.unique_id for r in rank) for rank in ranks])
            router.on_request_routed(req, to.replica_id, None)
            return req

        first = await route("k", a)  # no owner yet: two choices; it went to a, which now owns "k"
        await route("k", a)  # a: owner first, the pair as fallback
        extra = [await route(None, a) for _ in range(2)]  # a: 4 in flight, b: 0 -> beyond the margin of 2
        await route("k", b)  # so "k" is routed by load
        for req in [first, *extra]:
            router.on_request_completed(a.replica_id, req.metadata.internal_request_id)
        await route("k", a)  # a: 1 in flight, b: 1 -> back to the owner
        return seen

    affinity = asyncio.run(scenario("prefix"))
    pair = [["a", "b"]]
    assert affinity == [pair, [["a"], ["a", "b"]], pair, pair, pair, [["a"], ["a", "b"]]]
    assert asyncio.run(scenario("pow2")) == [pair] * 6


def test_stream_head_waits_for_the_first_token() -> None:
    from ironlm.ray.replica import carries_token

    def sse(*events: object) -> bytes:
        return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
                        for e in events)

    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    token = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    assert not carries_token(sse(role))
    assert not carries_token(sse(role, role))  # n > 1: one role chunk per choice
    assert carries_token(sse(role, token))
    assert carries_token(sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}))
    assert carries_token(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    assert carries_token(sse({"error": {"message": "x"}}))
    assert carries_token(sse(b"[DONE]"))


def test_merge_metrics_labels_every_sample_with_its_replica() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ironlm.ray.ingress import merge_metrics

    texts = []
    for replica, hits in (("r1", 3), ("r2", 5)):
        reg = CollectorRegistry()
        Counter("ironlm:prefix_cache_hits", "Prompt tokens found.", ["model_name"], registry=reg) \
            .labels("tiny").inc(hits)
        texts.append((replica, generate_latest(reg).decode()))
    merged = list(text_string_to_metric_families(merge_metrics(texts)))
    samples = {(s.labels["replica"], s.name): s.value for f in merged for s in f.samples}
    assert samples[("r1", "ironlm:prefix_cache_hits_total")] == 3
    assert samples[("r2", "ironlm:prefix_cache_hits_total")] == 5
    assert {f.name: f.type for f in merged}["ironlm:prefix_cache_hits"] == "counter"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"num_replicas": 0}, "num_replicas"), ({"min_replicas": 1}, "max_replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"), ({"routing": "random"}, "routing"),
    ({"max_retries": -1}, "max_retries"), ({"replica_cpus": -1.0}, "replica_cpus"),
])
def test_ray_config_rejects_bad_values(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        RayConfig(**kwargs)
    assert err.value.param == param
