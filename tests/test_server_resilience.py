"""Overload and faults: IRONLM_FAULT injection, the engine loop's restart, the circuit breaker, load shedding,
and the bench client's retries.

The server-level tests run the real tiny-model engine behind uvicorn; faults come from the `IRONLM_FAULT`
variable (set before the engine is built, which is when it is read) or, for slowing steps down, from
server_utils.ForwardFaults. Requests are sequential where the tests count steps, so the counts are exact.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import httpx
import pytest

from ironlm.bench import serve as bench_serve
from ironlm.bench.datasets import BenchRequest
from ironlm.config import ServerConfig
from ironlm.engine import faults
from ironlm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ironlm.exceptions import EngineDeadError, EngineRestartedError, EngineStepError, InvalidArgumentError
from ironlm.grpc import ironlm_pb2 as pb
from ironlm.grpc import ironlm_pb2_grpc as pb_grpc
from ironlm.sampling_params import SamplingParams
from ironlm.server.api import build_app
from ironlm.server.breaker import CircuitBreaker
from ironlm.server.grpc_service import start_grpc_server
from ironlm.server.shedding import LoadTracker, Shedder
from server_utils import ForwardFaults, LiveServer, tiny_engine, wait_for

# max_tokens 2: a prefill step and one decode step, so each request is exactly two forwards (two steps).
COMPLETION = {"prompt": "abc", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---- IRONLM_FAULT ----------------------------------------------------------------------------------------
def test_fault_rules_fire_on_the_calls_they_name():
    rules = faults.parse("step:raise:every=3;forward:raise:after=2,times=2")
    fired = []
    for call in range(1, 10):
        for site in ("step", "forward"):
            try:
                rules.check(site)
            except faults.InjectedFault as exc:
                assert f"{site} call {call}" in str(exc)
                fired.append((site, call))
    assert fired == [("step", 3), ("forward", 3), ("forward", 4), ("step", 6), ("step", 9)]
    assert rules.fired("step") == 3 and rules.fired("forward") == 2
    rules.check("restart")  # no rule for it: never raises


@pytest.mark.parametrize("spec", ["step", "step:explode", "gpu:raise", "step:raise:every=0", "step:raise:every=x",
                                  "step:raise:often=2", " ; "])
def test_bad_fault_specs_are_refused_naming_the_variable(spec):
    with pytest.raises(InvalidArgumentError) as exc:
        faults.from_env({"IRONLM_FAULT": spec})
    assert exc.value.param == "IRONLM_FAULT"


def test_no_fault_variable_means_no_faults():
    assert faults.from_env({}) is None and faults.from_env({"IRONLM_FAULT": "  "}) is None


# ---- the circuit breaker's state machine (a fake clock) -------------------------------------------------
def test_breaker_trips_above_the_threshold_cools_down_and_probes():
    clock = Clock()
    breaker = CircuitBreaker(window=20, threshold=0.05, min_requests=20, cooldown_s=10, probes=2, clock=clock)
    for i in range(20):
        permit = breaker.allow()
        assert permit is not None
        breaker.record(permit, i == 5)  # 1 failure in 20 = 5%: not above the threshold
        breaker.record(breaker.allow(), None)  # 4xx / 503 / client gone: not counted
    assert breaker.state == "closed" and breaker.error_rate() == 0.05
    breaker.record(breaker.allow(), True)  # the window slides: 2 failures in 20
    assert breaker.state == "open" and breaker.trips == 1
    assert breaker.allow() is None and breaker.retry_after() == 10
    clock.t += 9.5
    assert breaker.allow() is None and breaker.retry_after() == 1
    clock.t += 0.5
    assert breaker.state == "half_open"
    first, second = breaker.allow(), breaker.allow()
    assert first is not None and first.probe and second is not None and breaker.allow() is None  # 2 probes only
    breaker.record(first, False)
    assert breaker.state == "half_open" and breaker.allow() is None
    breaker.record(second, True)  # a probe failed: open again, a new cool-down
    assert breaker.state == "open" and breaker.trips == 2
    clock.t += 10
    probes = [breaker.allow(), breaker.allow()]
    breaker.record(probes[0], None)  # a probe that said nothing frees its place for another
    probes.append(breaker.allow())
    assert all(p is not None and p.probe for p in probes)
    breaker.record(probes[1], False)
    breaker.record(probes[2], False)
    assert breaker.state == "closed" and breaker.error_rate() == 0.0  # closed with an empty window
    stale = probes[0]
    breaker.record(stale, True)  # a probe of an earlier half-open period changes nothing
    assert breaker.state == "closed"


# ---- the shedder's estimate (a stub engine, a fake clock) ----------------------------------------------------
class StubEngine:
    def __init__(self) -> None:
        self.waiting = 0
        self.running = 0

    def stats(self) -> dict:
        return {"num_requests_waiting": self.waiting, "num_requests_running": self.running}


def finished(rid: str) -> RequestOutput:
    return RequestOutput(rid, "p", [1], [CompletionOutput(0, "x", [5], finish_reason="length")], True,
                         RequestMetrics(arrival_time=0.0))


def test_shedder_refuses_what_would_time_out_in_the_queue_and_worse_priorities_first():
    clock, engine = Clock(), StubEngine()
    tracker = LoadTracker(clock)
    shedder = Shedder(engine, tracker, max_wait_s=None, priority_waiting=3, priority_policy=True)  # type: ignore[arg-type]
    for i in range(5):  # 5 finishes in 2 s: 2.5 requests/s
        tracker.admitted(f"done-{i}", 0)
        tracker.on_outputs([finished(f"done-{i}")], 0.0)
        clock.t += 0.5
    assert tracker.num_pending() == 0 and tracker.completion_rate() == pytest.approx(5 / 2.5)
    for i, priority in enumerate([0, 0, 5]):
        tracker.admitted(f"q-{i}", priority)
    assert shedder.decide(1, 0, timeout=0.5) is None  # the engine reports nobody waiting: no wait at all
    engine.waiting = 3
    assert shedder.decide(1, 0, timeout=None) is None  # no timeout, no server limit: not shed by estimate
    assert shedder.decide(1, 0, timeout=1.5) is None  # admitted at the 3rd finish (2 ahead at priority <= 0): 1.5 s
    decision = shedder.decide(1, 0, timeout=1.0)
    assert decision is not None and decision.reason == "wait" and decision.retry_after == 1
    assert shedder.decide(2, -1, timeout=0.9) is not None  # nobody ahead of priority -1, but two prompts: 1 s
    assert shedder.decide(1, -1, timeout=0.5) is None
    with pytest.raises(Exception) as exc:
        shedder.check(1, 5, timeout=1.0)  # 3 ahead (priorities 0, 0, 5) + itself = 2 s
    assert exc.value.status == 503 and exc.value.code == "overloaded" and exc.value.headers == {"Retry-After": "1"}
    assert shedder.shed == {"wait": 1, "priority": 0, "service": 0}
    tracker.admitted("q-3", -2)  # 3 waiting requests better than priority 5, the threshold: 5 goes first
    decision = shedder.decide(1, 5, timeout=None)
    assert decision is not None and decision.reason == "priority"
    assert shedder.decide(1, 0, timeout=None) is None  # only one better than 0
    tracker.on_aborted(["q-3"])
    assert shedder.decide(1, 5, timeout=None) is None
    clock.t += 31  # the measured finishes are stale: no rate, no estimate
    assert tracker.completion_rate() is None and shedder.decide(1, 0, timeout=0.01) is None


def test_shedder_adds_the_requests_own_service_time_to_its_wait():
    clock, engine = Clock(), StubEngine()
    tracker = LoadTracker(clock)
    shedder = Shedder(engine, tracker, max_wait_s=10.0)  # type: ignore[arg-type]
    for i in range(4):  # 4 finishes over 2 s: 2 per s; each: 0.2 s of prefill, then 0.1 s per token
        out = finished(f"r{i}")
        out.outputs[0].token_ids = [5] * 11
        out.metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=1.0, first_token_time=1.2,
                                     last_token_time=2.2)
        tracker.on_outputs([out], 0.0)
        clock.t += 0.5
    assert tracker.service_time(1) == pytest.approx(0.2) and tracker.service_time(21) == pytest.approx(2.2)
    engine.waiting = 1  # admitted at the 2nd finish: 1 s of waiting
    assert shedder.decide(1, 0, timeout=3.2, max_tokens=21) is None  # 1 + 2.2 s
    decision = shedder.decide(1, 0, timeout=3.0, max_tokens=21)
    assert decision is not None and "+ 2.2 s for 21 tokens" in decision.message and decision.retry_after == 1
    assert shedder.decide(1, 0, timeout=None, max_tokens=1000) is None  # no timeout: only the wait (1 s <= 10 s)
    engine.waiting = 0
    assert shedder.decide(1, 0, timeout=0.5, max_tokens=1000) is None  # idle: its timeout is the client's choice
    # Nothing waits but a batch runs (room left in a big batch): its own tokens at the batch's pace still count.
    engine.running = 70
    assert shedder.decide(1, 0, timeout=2.5, max_tokens=21) is None  # 2.2 s
    decision = shedder.decide(1, 0, timeout=1.0, max_tokens=21)
    assert decision is not None and decision.reason == "service" and decision.retry_after == 2
    assert shedder.decide(1, 0, timeout=None, max_tokens=1000) is None  # no timeout: admitted


# ---- one request's output processing fails: that request only ------------------------------------------------
@pytest.mark.parametrize("where", ["append", "finish"])
def test_a_failure_in_one_requests_output_fails_that_request_only(tmp_path_factory, monkeypatch, where):
    from ironlm import EngineConfig, LLMEngine
    from ironlm.engine.sequence_table import EngineSequence
    from server_utils import tiny_model_path

    engine = LLMEngine(EngineConfig(model=str(tiny_model_path(tmp_path_factory)), device="cpu", dtype="float32",
                                    num_kv_blocks=64, block_size=4, max_model_len=128))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run() -> dict:
        last = {}
        while engine.has_unfinished_requests():
            last.update({o.request_id: o for o in engine.step()})
        return last

    engine.add_request("ref", "hello world and the", greedy)
    expected = run()["ref"].outputs[0].token_ids
    real = getattr(EngineSequence, where)

    def broken(self, *args, **kwargs):
        """The detokenizer of request "bad" fails: adding its 3rd token, or flushing its text at the end."""
        failing = len(self.token_ids) == 2 if where == "append" else self.detok is not None
        if self.request.request_id == "bad" and failing:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EngineSequence, where, broken)
    engine.add_request("bad", "the model is", greedy)
    engine.add_request("good", "hello world and the", greedy)
    outputs = run()
    assert outputs["bad"].finished and "injected detokenizer failure" in outputs["bad"].error
    assert [c.finish_reason for c in outputs["bad"].outputs] == ["error"]
    assert outputs["good"].error is None and outputs["good"].outputs[0].token_ids == expected
    s = engine.stats()
    assert s["blocks_used"] == 0 and s["num_requests_running"] == s["num_requests_waiting"] == 0


# ---- servers with their own engine and settings -------------------------------------------------------------
@pytest.fixture
def make_server(tmp_path_factory, monkeypatch):
    """A private tiny-model server built under the given IRONLM_FAULT, engine settings and ServerConfig."""
    servers: list[LiveServer] = []

    def make(fault: str | None = None, config: ServerConfig | None = None, **engine_kw) -> LiveServer:
        if fault is None:
            monkeypatch.delenv("IRONLM_FAULT", raising=False)
        else:
            monkeypatch.setenv("IRONLM_FAULT", fault)
        engine = tiny_engine(tmp_path_factory, **engine_kw)
        monkeypatch.delenv("IRONLM_FAULT", raising=False)  # read once, when the engine was built
        servers.append(LiveServer(build_app(engine, served_model_name="tiny", config=config), engine))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def post(server: LiveServer, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", json=body or COMPLETION, timeout=30, **kw)


def idle(server: LiveServer) -> bool:
    s = server.engine.stats()
    return server.engine.num_inflight == 0 and s["num_requests_running"] == s["num_requests_waiting"] == 0 \
        and s["blocks_used"] == 0


def metric(server: LiveServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_repeated_step_failures_restart_the_engine_loop_and_it_serves_on(make_server):
    # Steps 1-2 serve a request; steps 3, 4, 5 raise: two requests fail, the third failure restarts the loop.
    server = make_server("step:raise:after=2,times=3")
    expected = post(server).json()["choices"][0]["text"]
    for _ in range(2):
        bad = post(server)
        assert bad.status_code == 500 and "engine step failed" in bad.json()["error"]["message"]
    restarted = post(server)
    assert restarted.status_code == 500
    assert "engine loop restarted after 3 failed steps in a row" in restarted.json()["error"]["message"]
    assert "injected fault: step call 5" in restarted.json()["error"]["message"]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["engine_restarts"] == 1
    assert metric(server, "ironlm:engine_restarts_total") == 1
    again = post(server)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected  # a working fresh state
    s = server.engine.stats()
    assert s["blocks_used"] == 0 and s["blocks_free"] + s["blocks_cached"] == s["blocks_total"]
    assert wait_for(lambda: idle(server))


def test_a_restart_that_fails_leaves_the_engine_dead_and_health_503(make_server):
    server = make_server("step:raise;restart:raise")
    for _ in range(2):
        assert post(server).status_code == 500
    last = post(server)  # the third failure: the restart raises, the loop dies
    assert last.status_code == 500 and "restarted" in last.json()["error"]["message"]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "engine_dead"
    assert "injected fault: restart" in health.json()["error"]
    assert post(server).status_code == 503


def test_restarts_that_do_not_help_kill_the_engine(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("IRONLM_FAULT", "step:raise")  # every step: restarting cannot fix this
    ae = tiny_engine(tmp_path_factory)
    monkeypatch.delenv("IRONLM_FAULT")
    ae.max_step_failures, ae.max_restarts = 2, 1

    async def one() -> type[BaseException]:
        try:
            async for _ in ae.generate("abc", SamplingParams(max_tokens=2)):
                pass
        except (EngineStepError, EngineDeadError) as exc:
            return type(exc)
        raise AssertionError("the request succeeded")

    async def main() -> list[type[BaseException]]:
        return [await one() for _ in range(4)]

    assert asyncio.run(asyncio.wait_for(main(), 30)) == [EngineStepError, EngineRestartedError, EngineStepError,
                                                          EngineDeadError]
    assert ae.num_restarts == 1 and not ae.is_healthy


def test_circuit_breaker_opens_on_engine_failures_and_closes_after_good_probes(make_server):
    config = ServerConfig(circuit_breaker_window=10, circuit_breaker_min_requests=5, circuit_breaker_cooldown=30,
                          circuit_breaker_probes=2)
    # Two forwards per request: requests 1-3 succeed, the forwards of requests 4 and 5 fail (those requests
    # only: a forward failure is per request), then every forward works again.
    server = make_server("forward:raise:after=6,times=2", config)
    clock = server.app.state.breaker.clock = Clock()  # the cool-down ends when the test says so
    for _ in range(3):
        assert post(server).status_code == 200
        bad_request = post(server, {**COMPLETION, "max_tokens": -1})  # 4xx: the client's fault, not counted
        assert bad_request.status_code == 400
    assert post(server).status_code == 500
    assert httpx.get(f"{server.url}/health").json()["circuit_breaker"]["window_requests"] == 4
    assert post(server).status_code == 500  # 2 of 5 failed: above 5%
    refused = post(server)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "circuit_open"
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    assert int(refused.headers["Retry-After"]) >= 1
    streamed = httpx.post(f"{server.base_url}/completions", json={**COMPLETION, "stream": True}, timeout=30)
    assert streamed.status_code == 503  # refused before any stream starts
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"  # the engine is fine: not a 503
    assert health.json()["circuit_breaker"]["state"] == "open" and health.json()["circuit_breaker"]["trips"] == 1
    assert metric(server, "ironlm:circuit_breaker_trips_total") == 1
    assert metric(server, "ironlm:circuit_breaker_state") == 2
    assert httpx.get(f"{server.base_url}/models").status_code == 200  # only generation is gated
    clock.t += 29.5
    assert post(server).json()["error"]["code"] == "circuit_open"
    clock.t += 0.5
    assert httpx.get(f"{server.url}/health").json()["circuit_breaker"]["state"] == "half_open"
    for _ in range(2):  # the probes
        assert post(server).status_code == 200
    assert httpx.get(f"{server.url}/health").json()["circuit_breaker"]["state"] == "closed"
    assert metric(server, "ironlm:circuit_breaker_state") == 0
    assert post(server).status_code == 200
    assert wait_for(lambda: idle(server))


def test_grpc_shares_the_breaker_and_its_failures_count(make_server):
    config = ServerConfig(circuit_breaker_window=4, circuit_breaker_min_requests=4, circuit_breaker_cooldown=30)
    server = make_server("forward:raise:after=4,times=1", config)  # request 3's first forward fails
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    state = server.app.state
    start = start_grpc_server(server.engine, "127.0.0.1", 0, ["tiny"], shedder=state.shedder, breaker=state.breaker)
    grpc_server, port = asyncio.run_coroutine_threadsafe(start, loop).result(20)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.GenerationStub(channel)
    rpc = pb.GenerateRequest(text="abc", sampling=pb.SamplingParameters(max_tokens=2, temperature=0, ignore_eos=True))
    try:
        assert stub.Generate(rpc, timeout=30).usage.completion_tokens == 2
        assert post(server).status_code == 200
        with pytest.raises(grpc.RpcError) as failed:
            stub.Generate(rpc, timeout=30)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert post(server).status_code == 200  # 1 failure in 4 (gRPC and HTTP together): open
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.StreamGenerate(rpc, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "circuit breaker" in refused.value.details()
        assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1
        assert post(server).json()["error"]["code"] == "circuit_open"
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(grpc_server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_an_error_inside_a_stream_counts_as_a_failure(make_server):
    config = ServerConfig(circuit_breaker_window=2, circuit_breaker_min_requests=2, circuit_breaker_cooldown=30)
    server = make_server("forward:raise:after=1,times=1", config)  # the 2nd forward: mid-stream of request 1
    stream = httpx.post(f"{server.base_url}/completions", json={**COMPLETION, "stream": True}, timeout=30)
    assert stream.status_code == 200 and "injected fault: forward" in stream.text
    assert httpx.get(f"{server.url}/health").json()["circuit_breaker"]["error_rate"] == 1.0
    assert post(server).status_code == 200
    assert httpx.get(f"{server.url}/health").json()["circuit_breaker"]["state"] == "open"  # 1 of 2 > 5%


def test_breaker_can_be_turned_off(make_server):
    server = make_server("forward:raise", ServerConfig(circuit_breaker=False))
    # Every forward fails: 9 requests fail with it (the engine restarts twice), then it is dead (503), never
    # refused as circuit_open.
    codes = [post(server, {**COMPLETION, "max_tokens": 1}) for _ in range(12)]
    assert [r.status_code for r in codes] == [500] * 9 + [503] * 3
    assert all(r.json()["error"].get("code") != "circuit_open" for r in codes)
    assert "circuit_breaker" not in httpx.get(f"{server.url}/health").json()


# ---- shedding on a real engine ----------------------------------------------------------------------------
def hold_batch(server: LiveServer, queued: list[dict]) -> tuple[httpx.Client, httpx.Response, list[threading.Thread]]:
    """One long stream running (max_num_seqs 1) and `queued` requests waiting behind it."""
    http = httpx.Client(base_url=server.url, timeout=60)
    long = http.send(http.build_request("POST", "/v1/completions",
                                        json={**COMPLETION, "max_tokens": 200, "stream": True}), stream=True)
    assert long.status_code == 200
    threads = [threading.Thread(target=post, args=(server, body)) for body in queued]
    for t in threads:
        t.start()
    assert wait_for(lambda: server.engine.stats()["num_requests_waiting"] == len(queued))
    return http, long, threads


def release(server: LiveServer, http: httpx.Client, long: httpx.Response, threads: list[threading.Thread]) -> None:
    long.close()  # the client leaves: the long request is aborted and the queue runs
    http.close()
    for t in threads:
        t.join(30)
    assert wait_for(lambda: idle(server))


def test_a_request_that_would_time_out_in_the_queue_is_shed_at_once(make_server):
    server = make_server(max_num_seqs=1)
    slow = ForwardFaults(server.engine.engine)
    slow.delay = 0.05  # at most 10 forwards a second: 5 requests finish per second at most
    for _ in range(5):  # measure the completion rate
        assert post(server).status_code == 200
    http, long, threads = hold_batch(server, [COMPLETION] * 4)
    try:
        t0 = time.monotonic()
        shed = post(server, {**COMPLETION, "timeout": 0.1})  # 4 ahead at <= 5/s: at least 0.8 s of waiting
        assert time.monotonic() - t0 < 5.0  # not left to wait in the queue (a loose bound: a shared machine)
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "overloaded", shed.text
        assert "estimated queue wait" in shed.json()["error"]["message"]
        assert int(shed.headers["Retry-After"]) >= 1
        with http.stream("POST", "/v1/completions", json={**COMPLETION, "timeout": 120, "stream": True}) as ok:
            assert ok.status_code == 200  # time enough: accepted
        text = httpx.get(f"{server.url}/metrics").text
        assert 'ironlm:requests_shed_total{model_name="tiny",reason="wait"} 1.0' in text
    finally:
        release(server, http, long, threads)
    assert httpx.get(f"{server.url}/health").json()["circuit_breaker"]["error_rate"] == 0.0  # 503s not counted


def test_worse_priorities_are_shed_first(make_server):
    server = make_server(max_num_seqs=1, max_queue_len=4, scheduling_policy="priority")  # shed at 2 better waiting
    ForwardFaults(server.engine.engine).delay = 0.02
    http, long, threads = hold_batch(server, [{**COMPLETION, "priority": 0}] * 2)
    try:
        shed = post(server, {**COMPLETION, "priority": 1})
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "overloaded"
        assert "2 requests of a better priority than 1 are waiting" in shed.json()["error"]["message"]
        assert int(shed.headers["Retry-After"]) >= 1
        for priority in (0, -5):  # nobody better waiting: accepted
            with http.stream("POST", "/v1/completions",
                             json={**COMPLETION, "priority": priority, "stream": True}) as ok:
                assert ok.status_code == 200
        assert 'reason="priority"} 1.0' in httpx.get(f"{server.url}/metrics").text
    finally:
        release(server, http, long, threads)


# ---- the bench client retries ---------------------------------------------------------------------------
SSE_OK = ('data: {"choices":[{"text":"a","finish_reason":null}]}\n\n'
          'data: {"choices":[{"text":"","finish_reason":"length"}],"usage":{"completion_tokens":1}}\n\n'
          "data: [DONE]\n\n")


def run_bench_request(answers: list, max_retries: int = 3) -> tuple[bench_serve.RequestResult, int]:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        answer = answers[min(len(calls), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def main() -> bench_serve.RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            req = BenchRequest(prompt_token_ids=[1, 2], output_len=1)
            return await bench_serve._one_request(client, "http://test/v1/completions", None, req, 10, max_retries)

    return asyncio.run(main()), len(calls)


def test_bench_client_retries_503_honouring_retry_after(monkeypatch):
    monkeypatch.setattr(bench_serve, "RETRY_BACKOFF_S", 0.001)
    busy = httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}})
    ok = httpx.Response(200, text=SSE_OK, headers={"content-type": "text/event-stream"})
    res, calls = run_bench_request([busy, httpx.ConnectError("refused"), ok])
    assert res.success and res.retries == 2 and calls == 3 and res.error == "" and res.output_tokens == 1
    summary = bench_serve.summarize([res], 1.0, {})
    assert summary["retries"] == 2 and summary["retried_requests"] == 1

    res, calls = run_bench_request([httpx.ConnectError("refused")])  # gives up after 3 retries
    assert not res.success and res.retries == 3 and calls == 4 and "ConnectError" in res.error
    res, calls = run_bench_request([httpx.Response(500, json={})])  # a 500 is not retried
    assert not res.success and res.retries == 0 and calls == 1 and res.error.startswith("HTTP 500")


def test_retry_delay_prefers_retry_after_then_backs_off():
    assert bench_serve.retry_delay(0, "2") == 2.0
    assert bench_serve.retry_delay(0, "3600") == bench_serve.RETRY_AFTER_CAP_S
    assert [bench_serve.retry_delay(i, None) for i in range(3)] == [0.5, 1.0, 2.0]
    assert bench_serve.retry_delay(1, "Wed, 21 Oct 2015 07:28:00 GMT") == 1.0
