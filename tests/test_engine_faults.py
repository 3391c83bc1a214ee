"""The real engine recovers from a failed step: the requests in it fail, everything they held comes back.

A forward that raises (a CUDA error, an out-of-memory) is injected into a real tiny-model LLMEngine. The
step must fail exactly the requests it ran, abort them in the core, release their KV blocks and sampler
slots, and leave the engine serving: the same requests afterwards give the same tokens as a fresh engine.
A leaked sampler slot would make the next request that reuses it fail ("slot ... already in use"), a
leaked KV block shows in the block counts, stale sampler state in the seeded outputs.
"""

from __future__ import annotations

import pytest

from ironlm import EngineConfig, LLMEngine, SamplingParams
from server_utils import ForwardFaults, tiny_model_path

PROMPTS = ["the model is", "hello world and the", "a token of", "in the world of the model"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Seeded sampling with a penalty: its output depends on the sampler slot's random stream and penalty rows.
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.3, seed=11, max_tokens=8, ignore_eos=True)
ENGINE_KW = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_model_len": 128}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_model_path(tmp_path_factory))


def make_engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, **{**ENGINE_KW, **kw}))


def add_all(engine: LLMEngine, tag: str, params=(GREEDY, GREEDY, SEEDED, GREEDY)) -> list[str]:
    return [engine.add_request(f"{tag}-{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))]


def run_to_end(engine: LLMEngine, max_steps: int = 500) -> dict:
    last = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return last
        for out in engine.step():
            last[out.request_id] = out
    raise AssertionError("the engine did not finish its requests")


def tokens(outputs: dict, tag: str) -> list[list[list[int]]]:
    return [[c.token_ids for c in outputs[f"{tag}-{i}"].outputs] for i in range(len(PROMPTS))]


def assert_all_blocks_back(engine: LLMEngine, initial: dict) -> None:
    s = engine.stats()
    assert s["num_requests_running"] == s["num_requests_waiting"] == 0 and not engine.has_unfinished_requests()
    assert s["blocks_used"] == 0, s
    # Full blocks of finished or aborted prompts may stay in the prefix cache; they are evictable, not leaked.
    assert s["blocks_free"] + s["blocks_cached"] == initial["blocks_free"] == s["blocks_total"], s


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[list[int]]]:
    engine = make_engine(model)
    add_all(engine, "ref")
    return tokens(run_to_end(engine), "ref")


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("fail_at_step", [0, 3])  # the first prefill, or mid-decode
def test_failed_step_fails_its_requests_and_releases_everything(model, reference, prefix_caching, fail_at_step):
    engine = make_engine(model, enable_prefix_caching=prefix_caching)
    initial = engine.stats()
    faults = ForwardFaults(engine)
    ids = add_all(engine, "a")
    for _ in range(fail_at_step):
        assert all(o.error is None for o in engine.step())
    faults.fail_next = 1
    outputs = {o.request_id: o for o in engine.step()}
    assert faults.failures == 1
    assert sorted(outputs) == sorted(ids)
    for out in outputs.values():
        assert out.finished and out.error == "RuntimeError: injected forward failure"
        assert [c.finish_reason for c in out.outputs] == ["error"]
        assert len(out.outputs[0].token_ids) == fail_at_step  # what it had before the failure, nothing more
    assert_all_blocks_back(engine, initial)
    if not prefix_caching:
        assert engine.stats()["blocks_free"] == initial["blocks_free"]

    add_all(engine, "b")  # reuses the freed scheduler and sampler slots
    assert tokens(run_to_end(engine), "b") == reference
    assert_all_blocks_back(engine, initial)


def test_requests_outside_the_failed_step_carry_on(model, reference):
    engine = make_engine(model, max_num_seqs=2)
    initial = engine.stats()
    faults = ForwardFaults(engine)
    add_all(engine, "a")
    faults.fail_next = 1
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["a-0", "a-1"]  # only the two admitted ones ran
    assert all(o.error and o.finished for o in failed)
    assert engine.stats()["num_requests_waiting"] == 2
    survivors = run_to_end(engine)
    assert sorted(survivors) == ["a-2", "a-3"] and all(o.error is None for o in survivors.values())
    assert [survivors["a-2"].outputs[0].token_ids, survivors["a-3"].outputs[0].token_ids] == \
        [reference[2][0], reference[3][0]]
    assert_all_blocks_back(engine, initial)


def test_chunked_prefill_failure_releases_the_partial_prompt(model, reference):
    engine = make_engine(model, max_num_batched_tokens=8, max_num_seqs=4)
    initial = engine.stats()
    faults = ForwardFaults(engine)
    long_prompt = " ".join(["the world of the model"] * 6)
    engine.add_request("long", long_prompt, GREEDY)
    assert engine.step() == []  # the first 8-token chunk samples nothing
    assert engine.stats()["blocks_used"] > 0
    faults.fail_next = 1
    (out,) = engine.step()
    assert out.request_id == "long" and out.finished and out.error and out.outputs[0].token_ids == []
    assert_all_blocks_back(engine, initial)
    add_all(engine, "b")
    assert tokens(run_to_end(engine), "b") == reference


def test_forked_sequences_fail_together(model):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    fresh = make_engine(model)
    fresh.add_request("ref", PROMPTS[1], params)
    expected = [c.token_ids for c in run_to_end(fresh)["ref"].outputs]

    engine = make_engine(model)
    initial = engine.stats()
    faults = ForwardFaults(engine)
    engine.add_request("n3", PROMPTS[1], params)
    engine.step()
    engine.step()  # the children have forked off the shared prompt by now
    faults.fail_next = 1
    (out,) = engine.step()
    assert out.finished and out.error and [c.finish_reason for c in out.outputs] == ["error"] * 3
    assert_all_blocks_back(engine, initial)
    engine.add_request("again", PROMPTS[1], params)
    assert [c.token_ids for c in run_to_end(engine)["again"].outputs] == expected
    assert_all_blocks_back(engine, initial)


def test_sampler_failure_fails_the_step_the_same_way(model, reference, monkeypatch):
    engine = make_engine(model)
    initial = engine.stats()
    add_all(engine, "a")
    engine.step()
    real_sample = engine.sampler.sample

    def failing_sample(*args, **kwargs):
        monkeypatch.setattr(engine.sampler, "sample", real_sample)  # once
        raise RuntimeError("injected sampler failure")

    monkeypatch.setattr(engine.sampler, "sample", failing_sample)
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == [f"a-{i}" for i in range(len(PROMPTS))]
    assert all(o.finished and o.error == "RuntimeError: injected sampler failure" for o in outputs)
    assert_all_blocks_back(engine, initial)
    add_all(engine, "b")
    assert tokens(run_to_end(engine), "b") == reference
