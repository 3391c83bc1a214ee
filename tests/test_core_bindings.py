"""``ironlm._core`` bindings: error mapping, counters, and the small classes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from core_utils import make_scheduler
from ironlm import _core

# BlockAllocator, RadixCache and RequestQueue exist only for these tests (cargo feature test-bindings).
needs_test_bindings = pytest.mark.skipif(
    not hasattr(_core, "BlockAllocator"),
    reason="built without the cargo feature test-bindings (`make install` / `make develop` build it)")


def run_step(s: _core.Scheduler, token: int = 5, now: float | None = None) -> _core.SchedulerPlan:
    plan = s.schedule(now=now)
    s.update(np.full(plan.num_samples, token, dtype=np.int64))
    return plan


@contextmanager
def invalid_argument(param: str) -> Iterator[None]:
    """The core's bad-value error: an InvalidArgumentError (a ValueError, not a CoreError) naming `param`."""
    with pytest.raises(_core.InvalidArgumentError) as info:
        yield
    assert info.value.param == param, info.value
    assert str(info.value).startswith(f"{param}: ")
    assert isinstance(info.value, ValueError) and not isinstance(info.value, _core.CoreError)


def test_exception_hierarchy() -> None:
    assert issubclass(_core.QueueFullError, _core.CoreError)
    assert issubclass(_core.RequestTooLargeError, _core.CoreError)
    assert issubclass(_core.RequestTooLargeError, ValueError)
    assert issubclass(_core.DuplicateRequestError, _core.CoreError)
    assert issubclass(_core.DuplicateRequestError, ValueError)
    assert not issubclass(_core.QueueFullError, ValueError)
    assert issubclass(_core.InvalidArgumentError, ValueError)
    assert not issubclass(_core.InvalidArgumentError, _core.CoreError)
    for e in (_core.CoreError, _core.QueueFullError, _core.RequestTooLargeError, _core.DuplicateRequestError,
              _core.InvalidArgumentError):
        assert e.__module__ == "ironlm._core"


def test_scheduler_errors_map_to_specific_exceptions() -> None:
    s = make_scheduler(8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=40,
                        max_queue_len=2)
    with pytest.raises(_core.RequestTooLargeError, match="max_model_len"):
        s.add_request("big", [1] * 30, 11)
    with pytest.raises(ValueError, match="KV blocks"):  # 8 blocks of 4 = 32 tokens
        s.add_request("big", [1] * 30, 8)
    with pytest.raises(_core.RequestTooLargeError, match="max_num_seqs"):
        s.add_request("wide", [1], 1, n=3)
    s.add_request("a", [1, 2], 2)
    with pytest.raises(_core.DuplicateRequestError, match="'a'|\"a\""):
        s.add_request("a", [1, 2], 2)
    s.add_request("b", [1, 2], 2)
    with pytest.raises(_core.QueueFullError):
        s.add_request("c", [1, 2], 2)
    assert "c" not in s and "a" in s
    run_step(s)
    s.add_request("c", [1, 2], 2)  # room again once admitted


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"prompt_token_ids": [2**32]}, "prompt_token_ids"),
        ({"eos_token_ids": [-1]}, "eos_token_ids"),
        ({"queue_timeout": -1.0}, "queue_timeout"),
        ({"deadline": float("inf")}, "deadline"),
        ({"arrival_time": float("nan")}, "arrival_time"),
    ],
)
def test_add_request_bad_values_raise_invalid_argument(kwargs: dict, arg: str) -> None:
    s = make_scheduler(64, block_size=4)
    args = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "max_tokens": 4} | kwargs
    with invalid_argument(arg):
        s.add_request(**args)
    assert not s.has_unfinished()


def test_bad_types_raise_type_error() -> None:
    s = make_scheduler(64, block_size=4)
    with pytest.raises(TypeError, match="prompt_token_ids"):
        s.add_request("r", "hello", 4)
    with pytest.raises(TypeError):
        s.add_request("r", [1], "4")


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": -5}, "num_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"policy": "lifo"}, "policy"),
        ({"max_queue_len": -1}, "max_queue_len"),
    ],
)
def test_scheduler_bad_config(kwargs: dict, arg: str) -> None:
    args = {"num_blocks": 16} | kwargs
    with invalid_argument(arg):
        make_scheduler(**args)


def test_update_and_slot_errors() -> None:
    s = make_scheduler(64, block_size=4)
    assert s.update(np.zeros(0, dtype=np.int64)) == []  # nothing pending: a no-op
    with invalid_argument("sampled_token_ids"):
        s.update(np.array([1]))
    s.add_request("a", [1, 2, 3], 4)
    s.schedule()
    with invalid_argument("sampled_token_ids"):
        s.update(np.array([1, 2]))
    with invalid_argument("sampled_token_ids"):
        s.update(np.array([-1]))
    with invalid_argument("sampled_token_ids"):
        s.update(np.zeros((1, 1), dtype=np.int64))
    assert s.update(np.array([7])) == []
    assert s.output_token_ids(0) == [7]
    assert s.token_ids(0) == [1, 2, 3, 7]
    assert s.request_id(0) == "a" and s.request_id(5) is None
    with invalid_argument("slot"):
        s.output_token_ids(99)
    with invalid_argument("slot"):
        s.finish(-1)
    assert s.finish(99) is False
    with invalid_argument("now"):
        s.schedule(now=float("nan"))


def test_stats_counters_move() -> None:
    s = make_scheduler(6, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    st = s.stats()
    assert st == dict(st, num_waiting=0, num_running=0, num_preemptions=0, num_timeouts=0, prefix_queries=0,
                      prefix_hits=0, blocks_total=6, blocks_free=6, blocks_used=0, blocks_cached=0,
                      num_aborted=0, num_finished=0, num_steps=0, num_requests=0)
    s.add_request("a", list(range(9)), 8, arrival_time=0.0)
    s.add_request("b", list(range(100, 109)), 8, arrival_time=0.0)
    s.add_request("t", [1], 1, queue_timeout=0.5, arrival_time=0.0)
    assert s.stats()["num_waiting"] == 3 and s.num_waiting == 3
    for now in range(1, 7):
        run_step(s, now=float(now))
    st = s.stats()
    assert st["num_timeouts"] == 1  # expired (now 1.0 > 0.5) before the first admission
    assert st["num_preemptions"] >= 1
    assert st["prefix_queries"] > 0
    assert st["blocks_used"] + st["blocks_cached"] + st["blocks_free"] == 6
    assert s.abort("a") and not s.abort("a")
    assert s.stats()["num_aborted"] == 1
    while s.has_unfinished():
        run_step(s, now=10.0)
    st = s.stats()
    assert st["num_finished"] == 1 and st["num_running"] == 0 and st["blocks_used"] == 0
    assert st["blocks_cached"] > 0
    # Looked up once per request (a re-admission after preemption is not counted again);
    # t timed out before it was looked up.
    assert st["prefix_queries"] == 18 and st["prefix_hits"] == 0
    assert s.reset_prefix_cache()
    assert s.stats()["blocks_free"] == 6


def test_prefix_hit_counters_and_namespaces() -> None:
    s = make_scheduler(64, block_size=4)
    s.add_request("a", list(range(13)), 2)
    run_step(s)
    s.add_request("b", list(range(13)), 2)
    s.add_request("c", list(range(13)), 2, namespace="other")
    plan = s.schedule()
    assert plan.new_request_ids == ["b", "c"]
    # Per new request, in new_request_ids order: b reuses a's 3 full blocks, c (another namespace) nothing.
    assert plan.new_request_cached_tokens.dtype == np.int64
    assert plan.new_request_cached_tokens.tolist() == [12, 0]
    assert plan.num_cached_tokens == 12
    assert plan.context_lens.tolist() == [13, 12, 0]
    st = s.stats()
    assert st["prefix_queries"] == 39 and st["prefix_hits"] == 12


def test_config_properties_and_repr() -> None:
    s = make_scheduler(10, block_size=8, max_num_seqs=3, max_num_batched_tokens=30, max_model_len=50,
                        policy="priority", enable_prefix_caching=False)
    assert (s.num_blocks, s.block_size, s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len) == (
        10, 8, 3, 30, 50)
    assert s.policy == "priority" and s.enable_prefix_caching is False
    s.add_request("a", [1, 2], 2, n=2)
    assert s.num_slots == 2
    assert "Scheduler(" in repr(s)
    plan = s.schedule()
    assert "SchedulerPlan(" in repr(plan) and plan.num_samples == 2


def test_empty_plan_shapes() -> None:
    s = make_scheduler(4, block_size=4)
    plan = s.schedule()
    assert plan.is_empty and plan.num_tokens == 0 and plan.num_seqs == 0
    assert plan.block_tables.shape == (0, 0) and plan.cow_pairs.shape == (0, 2)
    assert plan.query_start_loc.tolist() == [0]
    assert plan.new_request_ids == [] and plan.finished == [] and plan.preempted_request_ids == []
    assert plan.new_request_cached_tokens.shape == (0,)


def test_large_batch_runs_with_gil_released() -> None:
    s = make_scheduler(4096, block_size=16, max_num_seqs=512, max_num_batched_tokens=8192)
    for i in range(300):
        s.add_request(f"r{i}", [i % 50, 1, 2, 3], 3)
    plan = run_step(s)
    assert plan.num_seqs == 300
    plan = s.schedule()
    assert plan.num_decode_tokens == 300
    assert s.update(list(range(300))) == []
    s.schedule()
    done = s.update(np.zeros(300, dtype=np.int64))
    assert len(done) == 300 and {(r, t) for _, _, r, t in done} == {("length", None)}


@needs_test_bindings
def test_request_queue() -> None:
    q = _core.RequestQueue("priority", max_len=3)
    assert q.policy == "priority" and q.max_len == 3
    q.push("a", priority=1, arrival_time=0.0)
    q.push("b", priority=0, arrival_time=1.0)
    q.push("c", priority=1, arrival_time=-1.0, queue_timeout=2.0)
    with pytest.raises(_core.QueueFullError):
        q.push("d")
    with pytest.raises(_core.DuplicateRequestError):
        q.push("a")
    assert len(q) == 3 and "c" in q and "d" not in q
    assert q.to_list() == ["b", "c", "a"]
    assert q.peek() == "b" and q.pop() == "b"
    assert q.expire(now=1.0) == [] and q.expire(now=1.5) == ["c"]
    assert q.remove("a") and not q.remove("a")
    assert q.pop() is None and len(q) == 0
    with invalid_argument("policy"):
        _core.RequestQueue("random")
    with invalid_argument("queue_timeout"):
        q.push("x", queue_timeout=-1.0)
    d = _core.RequestQueue("deadline")
    d.push("none", arrival_time=0.0)
    d.push("late", deadline=5.0, arrival_time=0.0)
    d.push("soon", deadline=1.0, arrival_time=2.0)
    assert d.to_list() == ["soon", "late", "none"]
    f = _core.RequestQueue()
    f.push("x")
    f.push("y")
    assert [f.pop(), f.pop()] == ["x", "y"]


@needs_test_bindings
def test_block_allocator() -> None:
    a = _core.BlockAllocator(3, block_size=2)
    assert (a.num_blocks, a.block_size, a.num_free) == (3, 2, 3)
    b0 = a.allocate()
    assert a.ref_count(b0) == 1 and a.num_used == 1
    assert a.fork([b0]) == [b0] and a.ref_count(b0) == 2
    # Token 1 lands in the shared, partly filled block 0: copy on write.
    blocks, pair = a.append_slot([b0], 1)
    assert pair is not None and pair[0] == b0 and blocks == [pair[1]]
    assert a.ref_count(b0) == 1
    blocks, pair = a.append_slot(blocks, 2)  # a new block
    assert pair is None and len(blocks) == 2
    assert a.num_free == 0
    with pytest.raises(_core.CoreError):
        a.allocate()
    with pytest.raises(_core.CoreError):
        a.append_slot(blocks, 4)
    with invalid_argument("num_tokens"):
        a.append_slot(blocks, 9)
    with invalid_argument("block"):
        a.incref(7)
    a.free_all(blocks)
    a.decref(b0)
    assert a.num_free == 3
    with invalid_argument("block"):
        a.decref(b0)
    with invalid_argument("blocks"):
        a.free_all([0])
    assert "BlockAllocator(" in repr(a)


@needs_test_bindings
def test_radix_cache() -> None:
    a = _core.BlockAllocator(8, block_size=2)
    r = _core.RadixCache(a)
    assert r.allocator is a
    blocks = [a.allocate() for _ in range(3)]
    assert r.insert([1, 2, 3, 4, 5, 6], blocks) == 0
    assert r.num_cached_blocks == 3
    a.free_all(blocks)
    assert a.num_cached == 3 and r.num_evictable_blocks == 3
    assert r.match_prefix([1, 2, 3, 4, 5, 6]) == blocks[:2]  # never the whole prompt
    assert r.match_prefix([1, 2, 3, 4, 5, 6], namespace="x") == []
    assert r.queries == 12 and r.hits == 4
    assert r.insert([1, 2, 3, 4], [5, 6]) == 4  # already cached
    assert r.evict(1) == 1 and r.num_cached_blocks == 2
    with invalid_argument("blocks"):
        r.insert([1, 2, 3, 4], [1])
    with invalid_argument("blocks"):
        r.insert([1, 2], [99])
    assert r.reset() is True
    assert a.num_free == 8


def test_monotonic() -> None:
    t0 = _core.monotonic()
    t1 = _core.monotonic()
    assert 0.0 <= t0 <= t1
