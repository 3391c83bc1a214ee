"""The offline `LLM` API surface: inputs, outputs, stops, errors, metrics."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

import ironlm.llm
from ironlm import LLM, EngineConfig, SamplingParams
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = make_tiny_model(tmp_path_factory.mktemp("api"), arch="llama")
    # enable_metrics as vLLM examples pass it: accepted, metrics are always on
    return LLM(str(path), num_kv_blocks=128, block_size=4, max_model_len=256, enable_metrics=True)


def test_every_engine_config_field_is_an_llm_keyword(monkeypatch):
    """LLM(**kwargs) is EngineConfig's fields: the signature lists each with its default, and each reaches the
    engine's config, so a field added to EngineConfig needs no edit in llm.py."""
    params = inspect.signature(LLM).parameters
    for f in fields(EngineConfig):
        assert f.name in params and params[f.name].default == f.default, f.name
    assert params["enable_metrics"].default is True
    seen: list[EngineConfig] = []
    monkeypatch.setattr(ironlm.llm, "LLMEngine", seen.append)
    flipped = {"block_size": 8, "queue_timeout": 1.5, "enable_prefix_caching": False, "warmup": False,
               "served_model_name": "m", "scheduling_policy": "priority"}
    LLM("some/model", enable_metrics=False, **flipped)
    assert seen[-1] == EngineConfig(model="some/model", **flipped)
    with pytest.raises(TypeError, match="'queue_timout'.*did you mean 'queue_timeout'"):
        LLM(queue_timout=1.0)
    with pytest.raises(ValueError, match="block_size") as exc:
        LLM(block_size=3)
    assert exc.value.param == "block_size"


def test_string_prompts_in_order_with_timing(llm: LLM):
    prompts = ["hello world", "the quick brown fox", "a"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert len(c.token_ids) == 5 and c.finish_reason == "length"
        # the final text is flushed: it equals a one-shot decode of the tokens
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == llm.get_tokenizer().encode(o.prompt)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_eos_and_stop_token_ids_finish_with_stop(llm: LLM):
    base = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_at = base.token_ids[3]
    first = base.token_ids.index(stop_at)
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string_truncates_text(llm: LLM):
    base = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(base.text) > 4
    stop = base.text[2:4]
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert llm.engine.stats()["blocks_used"] == 0


def test_bad_inputs_raise_value_error_naming_the_field(llm: LLM):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("hi", SamplingParams(max_tokens=10_000), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    # the engine keeps serving after bad requests, and nothing leaked
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    assert llm.engine.stats()["blocks_used"] == 0 and not llm.engine.has_unfinished_requests()


def test_chat_and_metrics(llm: LLM):
    outs = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "fox"}]],
                    SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 4 for o in outs)
    m = llm.get_metrics()
    for key in ("output_tokens_per_s", "ttft_s", "tpot_s", "prefix_cache_hit_rate", "kv_cache_usage_perc",
                "num_preemptions", "step_breakdown_s"):
        assert key in m
    assert m["output_tokens"] >= 8 and m["ttft_s"]["median"] > 0
    assert m["throughput"] == m["output_tokens"] / m["elapsed_s"] == m["output_tokens_per_s"] > 0
    assert {"schedule", "forward", "sample"} <= set(m["step_breakdown_s"])
    assert m["model_weight_bytes"] == llm.engine.runner.model.weight_bytes() > 0
