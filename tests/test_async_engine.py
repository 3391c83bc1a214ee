"""AsyncLLMEngine: one engine thread, continuous batching, aborts, failures, draining.

Fault injection needs an engine that misbehaves on demand, so these use FakeEngine (same contract as
LLMEngine); the real engine behind the same class is exercised by the server tests.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from fake_engine import FakeEngine
from ironlm import _core
from ironlm.engine import AsyncLLMEngine
from ironlm.exceptions import EngineDeadError, EngineOverloadedError, EngineStepError
from ironlm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def collect(ae: AsyncLLMEngine, prompt: str, params=GREEDY, **kw):
    outs = [o async for o in ae.generate(prompt, params, **kw)]
    return outs


def test_generate_streams_cumulative_outputs_from_one_engine_thread():
    fake = FakeEngine()
    ae = AsyncLLMEngine(fake)
    outs = run(collect(ae, "ab"))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == "cdefghij"
    assert fake.thread_ids == {ae._thread.ident} and ae._thread.ident != threading.get_ident()
    assert ae.num_inflight == 0 and ae.stats()["blocks_used"] == 0


def test_new_requests_join_the_running_batch():
    fake = FakeEngine(step_delay=0.01)
    ae = AsyncLLMEngine(fake)

    async def main():
        long = asyncio.ensure_future(collect(ae, "a", SamplingParams(temperature=0, max_tokens=40)))
        await asyncio.sleep(0.05)
        short = await collect(ae, "b", SamplingParams(temperature=0, max_tokens=3))
        assert not long.done()  # the short one finished while the long one was still running
        return await long, short

    long, short = run(main())
    assert len(long[-1].outputs[0].token_ids) == 40 and len(short[-1].outputs[0].token_ids) == 3


def test_closing_the_iterator_aborts_and_frees_blocks():
    fake = FakeEngine(step_delay=0.005)
    ae = AsyncLLMEngine(fake)

    async def main():
        agen = ae.generate("abc", SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await agen.aclose()

    run(main())
    deadline = time.monotonic() + 5
    while fake.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fake.requests and ae.num_inflight == 0
    time.sleep(0.05)
    assert ae.stats()["blocks_used"] == 0


def test_cancelled_task_aborts_its_request():
    fake = FakeEngine()
    fake.gate.clear()  # steps block: the request stays in flight
    ae = AsyncLLMEngine(fake)

    async def main():
        task = asyncio.ensure_future(collect(ae, "abc", SamplingParams(max_tokens=50)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    fake.gate.set()
    deadline = time.monotonic() + 5
    while fake.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fake.requests


def test_add_errors_reach_the_caller():
    ae = AsyncLLMEngine(FakeEngine(max_model_len=64, max_queue_len=1, max_num_seqs=1, step_delay=0.02))
    with pytest.raises(ValueError, match="empty"):
        run(collect(ae, ""))
    with pytest.raises(ValueError, match="max_model_len"):
        run(collect(ae, "abc", SamplingParams(max_tokens=100)))

    async def overflow():
        first = await ae.add_request("one", "abc", SamplingParams(max_tokens=50))  # running after a step
        second = await ae.add_request("two", "abc", SamplingParams(max_tokens=5))  # the one waiting request
        with pytest.raises(_core.QueueFullError):
            await ae.add_request("three", "abc", SamplingParams(max_tokens=5))
        first.close()
        second.close()

    run(overflow())
    assert ae.is_healthy


def test_step_exception_fails_its_requests_and_the_engine_goes_on():
    fake = FakeEngine()
    fake.gate.clear()
    ae = AsyncLLMEngine(fake)

    async def main():
        stream = await ae.add_request("x", "abc", SamplingParams(max_tokens=5))
        fake.raise_in_step = RuntimeError("boom")
        fake.gate.set()
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in stream:
                pass
        fake.raise_in_step = None
        return await collect(ae, "abc")

    outs = run(main())
    assert outs[-1].finished and ae.is_healthy and not fake.requests


def test_forward_failure_reported_per_request():
    fake = FakeEngine()
    ae = AsyncLLMEngine(fake)
    fake.fail_forward_once = True
    outs = run(collect(ae, "abc"))
    assert outs[-1].error and outs[-1].outputs[0].finish_reason == "error"
    assert run(collect(ae, "abc"))[-1].outputs[0].finish_reason == "length"


class Fatal(BaseException):
    """Not an Exception: the loop cannot recover from it."""


def test_dead_engine_fails_in_flight_fast_and_refuses_new_requests():
    fake = FakeEngine(step_delay=0.02)
    ae = AsyncLLMEngine(fake)

    async def main():
        streams = [await ae.add_request(f"r{i}", "abc", SamplingParams(max_tokens=200)) for i in range(3)]
        fake.raise_in_step = Fatal("engine state corrupt")
        t0 = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            await ae.add_request("late", "abc", SamplingParams(max_tokens=5))

    run(main())
    assert not ae.is_healthy and isinstance(ae.dead_error, Fatal)


def test_repeated_step_failures_kill_the_engine():
    fake = FakeEngine()
    fake.raise_in_step = RuntimeError("scheduler bug")
    ae = AsyncLLMEngine(fake)

    async def main():
        errors = []
        for _ in range(3):
            try:
                await collect(ae, "abc")
            except (EngineStepError, EngineDeadError) as exc:
                errors.append(type(exc))
        return errors

    assert run(main()) == [EngineStepError, EngineStepError, EngineDeadError]
    assert not ae.is_healthy


def test_idle_loop_sleeps():
    fake = FakeEngine()
    calls = []
    original = fake.has_unfinished_requests
    fake.has_unfinished_requests = lambda: calls.append(1) or original()  # type: ignore[method-assign]
    AsyncLLMEngine(fake)
    time.sleep(0.3)
    assert len(calls) < 5  # a busy loop would call it thousands of times


def test_request_timeout_ends_with_timeout_reason():
    fake = FakeEngine()
    fake.gate.clear()
    ae = AsyncLLMEngine(fake)
    outs = run(collect(ae, "abc", SamplingParams(max_tokens=50), timeout=0.2))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "timeout"
    fake.gate.set()
    deadline = time.monotonic() + 5
    while fake.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fake.requests


def test_shutdown_drains_in_flight_then_refuses():
    fake = FakeEngine(step_delay=0.01)
    ae = AsyncLLMEngine(fake)

    async def main():
        task = asyncio.ensure_future(collect(ae, "abc", SamplingParams(temperature=0, max_tokens=20)))
        await asyncio.sleep(0.05)
        shutdown = asyncio.ensure_future(ae.shutdown(drain_timeout=10))
        await asyncio.sleep(0.01)
        assert not ae.is_ready
        with pytest.raises(EngineOverloadedError):
            await ae.add_request(None, "abc", GREEDY)
        outs = await task
        await shutdown
        return outs

    outs = run(main())
    assert outs[-1].outputs[0].finish_reason == "length"
    assert not ae._thread.is_alive()
