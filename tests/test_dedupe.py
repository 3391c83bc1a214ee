"""Request dedupe and the result cache (engine/dedupe.py) on the real engine with the tiny model.

Requests are held in flight by gating the model's forward (server_utils.ForwardFaults): the first request's step
blocks inside the forward, the others are submitted meanwhile and join when the loop applies its commands, so
sharing does not depend on timing. "One sequence in the engine" is read from the engine's own prompt-token counter:
every request the engine accepts adds its prompt tokens there.
"""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from fake_engine import FakeEngine
from ironlm import EngineConfig, LLMEngine
from ironlm.config import ServerConfig
from ironlm.engine import AsyncLLMEngine
from ironlm.engine.dedupe import request_key
from ironlm.exceptions import InvalidArgumentError
from ironlm.sampling_params import SamplingParams
from ironlm.server.api import build_app
from server_utils import TINY_ENGINE_KW, ForwardFaults, LiveServer, tiny_model_path, wait_for

CACHE_SIZE = 2
_prompts = itertools.count()


def fresh_prompt() -> str:
    """A prompt no earlier test sent: each test starts with an empty result cache for its own requests."""
    return f"the model said {next(_prompts)} words about"


def greedy(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = EngineConfig(model=str(tiny_model_path(tmp_path_factory)), device="cpu", **TINY_ENGINE_KW)
    ae = AsyncLLMEngine(LLMEngine(config), dedupe=True, result_cache_size=CACHE_SIZE)
    ae.faults = ForwardFaults(ae.engine)
    yield ae
    ae.faults.gate.set()
    asyncio.run(ae.shutdown(drain_timeout=1))


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def counter(ae: AsyncLLMEngine, key: str) -> int:
    return int(ae.stats()[key])


def idle(ae: AsyncLLMEngine) -> bool:
    s = ae.stats()
    return (ae.num_inflight == 0 and not ae.engine.has_unfinished_requests() and s["num_requests_running"] == 0
            and s["num_requests_waiting"] == 0 and s["blocks_used"] == 0 and s["dedupe_groups"] == 0)


async def collect(ae: AsyncLLMEngine, prompt, params, request_id: str, **kw) -> list:
    return [out async for out in ae.generate(prompt, params, request_id=request_id, **kw)]


async def held(ae: AsyncLLMEngine, first):
    """Start `first` (a coroutine) with the forward gate closed and wait until its step blocks in the forward."""
    ae.faults.gate.clear()
    calls = ae.faults.calls
    task = asyncio.ensure_future(first)
    while ae.faults.calls == calls:
        await asyncio.sleep(0.005)
    return task


def tokens(outs: list) -> list[int]:
    return list(outs[-1].outputs[0].token_ids)


def test_identical_greedy_requests_share_one_sequence_and_each_gets_a_full_stream(engine):
    prompt, params = fresh_prompt(), greedy(8)
    prompt_len = len(engine.tokenizer.encode(prompt))
    before_tokens, before_hits = counter(engine, "prompt_tokens_total"), counter(engine, "dedupe_hits_total")

    async def main():
        leader = await held(engine, collect(engine, prompt, params, "lead"))
        followers = [asyncio.ensure_future(collect(engine, prompt, params, f"follow-{i}")) for i in range(3)]
        await asyncio.sleep(0.05)  # the followers' add commands are queued behind the blocked step
        engine.faults.gate.set()
        return await asyncio.gather(leader, *followers)

    streams = run(main())
    assert counter(engine, "prompt_tokens_total") - before_tokens == prompt_len  # one sequence, not four
    assert counter(engine, "dedupe_hits_total") - before_hits == 3
    for rid, outs in zip(["lead", "follow-0", "follow-1", "follow-2"], streams):
        assert {o.request_id for o in outs} == {rid}  # each stream under its own id
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative: deltas rebuild it
        assert tokens(outs) == tokens(streams[0]) and len(tokens(outs)) == 8
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert wait_for(lambda: idle(engine))


def test_a_listener_leaving_keeps_the_others_and_the_last_one_leaving_aborts(engine):
    prompt, params = fresh_prompt(), greedy(24)

    async def leave_after_first_token(rid: str) -> int:
        agen = engine.generate(prompt, params, request_id=rid)
        async for out in agen:
            if out.outputs[0].token_ids:
                break
        await agen.aclose()  # what a disconnecting client's handler does
        return len(out.outputs[0].token_ids)

    async def main():
        engine.faults.delay = 0.01  # keeps the shared sequence running while listeners come and go
        leader = await held(engine, leave_after_first_token("leader-leaves"))
        stays = [asyncio.ensure_future(collect(engine, prompt, params, f"stays-{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        engine.faults.gate.set()
        return await leader, await asyncio.gather(*stays)

    try:
        seen, (a, b) = run(main())
    finally:
        engine.faults.delay = 0.0
    assert 1 <= seen < 24
    assert len(tokens(a)) == len(tokens(b)) == 24 and tokens(a) == tokens(b)
    assert a[-1].outputs[0].finish_reason == "length"
    assert wait_for(lambda: idle(engine))

    # Everyone leaves: the shared sequence is aborted and its blocks come back.
    prompt2 = fresh_prompt()

    async def all_leave():
        engine.faults.delay = 0.01
        first = await held(engine, leave_after_first_token_of(prompt2, "x0"))
        second = asyncio.ensure_future(leave_after_first_token_of(prompt2, "x1"))
        await asyncio.sleep(0.05)
        engine.faults.gate.set()
        return await asyncio.gather(first, second)

    async def leave_after_first_token_of(p: str, rid: str) -> int:
        agen = engine.generate(p, greedy(200), request_id=rid)
        async for out in agen:
            if out.outputs[0].token_ids:
                break
        await agen.aclose()
        return len(out.outputs[0].token_ids)

    generated = counter(engine, "generation_tokens_total")
    try:
        assert all(n < 200 for n in run(all_leave()))
        assert wait_for(lambda: idle(engine))
        # Aborted within a few steps, not left running its 200 tokens with nobody listening.
        assert counter(engine, "generation_tokens_total") - generated < 100
    finally:
        engine.faults.delay = 0.0


def test_different_seed_or_parameters_are_not_shared(engine):
    prompt = fresh_prompt()
    prompt_len = len(engine.tokenizer.encode(prompt))
    seeded = {"temperature": 0.8, "max_tokens": 6, "ignore_eos": True}
    requests = [
        ("base", greedy(6), {}),
        ("more-tokens", greedy(7), {}),  # another max_tokens
        ("logprobs", greedy(6, logprobs=2), {}),  # another logprobs
        ("salted", greedy(6), {"cache_salt": "tenant-b"}),  # another tenant
        ("priority", greedy(6), {"priority": 3}),  # same output, but it would be scheduled differently
        ("seed-1", SamplingParams(seed=1, **seeded), {}),
        ("seed-2", SamplingParams(seed=2, **seeded), {}),  # another seed
        ("seed-2-again", SamplingParams(seed=2, **seeded), {}),  # the only one that shares (with seed-2)
        ("random-a", SamplingParams(**seeded), {}),  # no seed: never shared
        ("random-b", SamplingParams(**seeded), {}),
    ]
    before_tokens, before_hits = counter(engine, "prompt_tokens_total"), counter(engine, "dedupe_hits_total")

    async def main():
        (rid0, p0, kw0), *rest = requests
        first = await held(engine, collect(engine, prompt, p0, rid0, **kw0))
        others = [asyncio.ensure_future(collect(engine, prompt, p, rid, **kw)) for rid, p, kw in rest]
        await asyncio.sleep(0.05)
        engine.faults.gate.set()
        return await asyncio.gather(first, *others)

    outs = dict(zip([r[0] for r in requests], run(main())))
    assert counter(engine, "dedupe_hits_total") - before_hits == 1
    assert counter(engine, "prompt_tokens_total") - before_tokens == prompt_len * (len(requests) - 1)
    assert tokens(outs["seed-2"]) == tokens(outs["seed-2-again"])
    assert outs["logprobs"][-1].outputs[0].logprobs and not outs["base"][-1].outputs[0].logprobs
    assert wait_for(lambda: idle(engine))


def test_result_cache_hit_miss_and_lru_eviction(engine):
    a, b, c = fresh_prompt(), fresh_prompt(), fresh_prompt()
    a_len = len(engine.tokenizer.encode(a))

    def one(prompt: str, rid: str) -> list:
        return run(collect(engine, prompt, greedy(5), rid))

    def figures() -> tuple[int, int, int]:
        return (counter(engine, "result_cache_hits_total"), counter(engine, "result_cache_misses_total"),
                counter(engine, "prompt_tokens_total"))

    hits0, misses0, tokens0 = figures()
    first = one(a, "a-1")
    assert figures() == (hits0, misses0 + 1, tokens0 + a_len)
    again = one(a, "a-2")  # answered from the cache: the engine never sees it
    assert figures() == (hits0 + 1, misses0 + 1, tokens0 + a_len)
    assert again[-1].request_id == "a-2" and again[-1].finished
    assert tokens(again) == tokens(first) and again[-1].outputs[0].text == first[-1].outputs[0].text
    assert again[-1].prompt_token_ids == first[-1].prompt_token_ids  # usage counts as for a computed answer
    assert again[-1].metrics.arrival_time > first[-1].metrics.finished_time  # its own timings

    evictions0 = counter(engine, "result_cache_evictions_total")
    one(b, "b-1")
    one(c, "c-1")  # the cache holds 2: a, the least recently used, goes
    assert counter(engine, "result_cache_size") == CACHE_SIZE
    assert counter(engine, "result_cache_evictions_total") >= evictions0 + 1
    hits1, misses1, tokens1 = figures()
    one(c, "c-2")
    assert figures()[0] == hits1 + 1  # c is still there
    one(a, "a-3")
    assert figures()[1:] == (misses1 + 1, tokens1 + a_len)  # a was evicted: computed again
    # A random request is never cached nor looked up.
    run(collect(engine, a, SamplingParams(temperature=0.8, max_tokens=3), "a-random"))
    run(collect(engine, a, SamplingParams(temperature=0.8, max_tokens=3), "a-random-2"))
    assert figures()[:2] == (hits1 + 1, misses1 + 1)
    assert wait_for(lambda: idle(engine))


def test_dedupe_and_cache_over_http_with_metrics(engine):
    server = LiveServer(build_app(engine, served_model_name="tiny"), engine)
    body = {"model": "tiny", "prompt": fresh_prompt(), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            engine.faults.gate.clear()
            calls = engine.faults.calls
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as first:
                assert wait_for(lambda: engine.faults.calls > calls)

                async def second_stream() -> httpx.Response:
                    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                        return await client.post("/v1/completions", json={**body, "stream": True})

                async def release_then_get():
                    task = asyncio.ensure_future(second_stream())
                    await asyncio.sleep(0.2)
                    engine.faults.gate.set()
                    return await task

                second = run(release_then_get())
                first_text = "".join(first.iter_text())
            assert first.status_code == second.status_code == 200

            def stream_text(sse: str) -> tuple[set[str], str]:
                import json

                chunks = [json.loads(line[6:]) for line in sse.splitlines()
                          if line.startswith("data: {")]
                return {c["id"] for c in chunks}, "".join(ch["text"] for c in chunks for ch in c["choices"])

            ids1, text1 = stream_text(first_text)
            ids2, text2 = stream_text(second.text)
            assert len(ids1) == len(ids2) == 1 and ids1 != ids2 and text1 == text2 and text1
            plain = http.post("/v1/completions", json=body).json()  # the finished result, from the cache
            assert plain["choices"][0]["text"] == text1 and plain["usage"]["completion_tokens"] == 6
            metrics = http.get("/metrics").text
        assert wait_for(lambda: idle(engine))
        lines = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("ironlm:") and "{" in line}
        assert lines["ironlm:dedupe_hits_total"] >= 1 and lines["ironlm:result_cache_hits_total"] >= 1
        assert 1 <= lines["ironlm:result_cache_size"] <= CACHE_SIZE
    finally:
        engine.faults.gate.set()
        server.stop()


def test_off_by_default():
    assert ServerConfig().dedupe_requests is False and ServerConfig().result_cache_size == 0
    with pytest.raises(InvalidArgumentError) as err:
        ServerConfig(result_cache_size=-1)
    assert err.value.param == "result_cache_size"
    fake = FakeEngine()
    fake.gate.clear()
    ae = AsyncLLMEngine(fake)

    async def main():
        tasks = [asyncio.ensure_future(collect(ae, "ab", greedy(4), f"r{i}")) for i in range(2)]
        await asyncio.sleep(0.1)
        fake.gate.set()
        return await asyncio.gather(*tasks)

    a, b = run(main(), 20)
    assert tokens(a) == tokens(b)
    assert fake.prompt_tokens_total == 4  # both prompts reached the engine
    assert "dedupe_hits_total" not in ae.stats() and "result_cache_size" not in ae.stats()


def test_request_key_covers_every_sampling_field_and_option():
    base = request_key("m", [1, 2, 3], greedy(4), {"arrival_time": 1.0, "priority": 0})
    assert base is not None
    assert base == request_key("m", (1, 2, 3), greedy(4), {"arrival_time": 2.0, "priority": 0})
    assert request_key("m", [1, 2, 3], SamplingParams(temperature=0.5), {}) is None  # random, no seed
    assert request_key("m", [1, 2, 3], None, {}) is None
    assert request_key("m", [1, 2, 3], SamplingParams(temperature=0.5, seed=0), {}) is not None
    other_priority = request_key("m", [1, 2, 3], greedy(4), {"arrival_time": 1.0, "priority": 2})
    assert other_priority is not None
    assert other_priority.content == base.content and other_priority.scheduling != base.scheduling
    for variant in (request_key("n", [1, 2, 3], greedy(4), {}), request_key("m", [1, 2, 4], greedy(4), {}),
                    request_key("m", [1, 2, 3], greedy(4, stop=["x"]), {}),
                    request_key("m", [1, 2, 3], greedy(4, logit_bias={5: 1.0}), {}),
                    request_key("m", [1, 2, 3], greedy(4), {"cache_salt": "t"})):
        assert variant is not None and variant.content != base.content
