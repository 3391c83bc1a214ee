"""Batch-invariant numerics (`batch_invariant=True`, ironlm.invariant): a greedy request gets the very same
token ids AND logprob bits alone, in a batch of 64, under chunked prefill at several budgets, after a preemption
(recomputed), with its prefix from the cache, from the memory KV tier and from the disk tier after a restart, on
tiny random models in fp32, bf16, load-time int8/int4 and GGUF Q4_0/Q8_0, and on the default model.

Equality is bitwise (each logprob's float32 bits), never closeness: without the switch these same checks fail
(a 128-row step took a dense bf16 GEMM, prefill chunks SDPA, decode rows the paged kernel, a lone row's logsumexp
another summation order).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from ironlm.llm import LLM
from ironlm.sampling_params import SamplingParams

TOKENS = 8
PROMPTS = [[1 + (11 * i + 3 * j) % 150 for j in range(5 + 7 * i)] for i in range(4)]  # 5, 12, 19, 26 tokens
FILL = [[(7 * i + j) % 200 + 5 for j in range(3 + i % 17)] for i in range(64 - len(PROMPTS))]
BASE: dict[str, Any] = {"device": "cpu", "max_model_len": 64, "block_size": 4, "batch_invariant": True}
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)

# name -> (dtype, quantization or a GGUF type)
MODELS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("bfloat16", "int8"),
          "int4": ("bfloat16", "int4"), "q4_0": ("bfloat16", "Q4_0"), "q8_0": ("bfloat16", "Q8_0")}

Result = tuple[tuple[int, ...], tuple[bytes, ...]]


def key(out: Any) -> Result:
    """Token ids and the chosen tokens' logprobs as float32 bits."""
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.token_ids) == TOKENS
    return tuple(c.token_ids), tuple(struct.pack("<f", d[t].logprob) for t, d in zip(c.token_ids, c.logprobs))


def each(llm: LLM, prompts: list[list[int]]) -> list[Result]:
    return [key(llm.generate([p], GREEDY, use_tqdm=False)[0]) for p in prompts]


def together(llm: LLM, prompts: list[list[int]]) -> list[Result]:
    return [key(o) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bi"), arch="llama")


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, hf_dir, tmp_path_factory) -> tuple[str, dict[str, Any], list[Result]]:
    """(model, engine kwargs, each prompt's result alone on a fresh engine)."""
    dtype, quant = MODELS[request.param]
    model, kw = str(hf_dir), {**BASE, "dtype": dtype}
    if quant in ("Q4_0", "Q8_0"):
        from tiny_models import make_tiny_gguf

        model = str(make_tiny_gguf(tmp_path_factory.mktemp("gguf"), hf_dir, qtype=quant))
    elif quant is not None:
        kw["quantization"] = quant
    llm = LLM(model, **{**kw, "enable_prefix_caching": False})
    alone = each(llm, PROMPTS)
    llm.shutdown()
    return model, kw, alone


def test_alone_equals_batch_of_64_and_prefix_hit(case):
    model, kw, alone = case
    llm = LLM(model, **kw)
    assert together(llm, PROMPTS + FILL)[: len(PROMPTS)] == alone
    hits = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]  # the batch cached every prompt
    assert all(o.num_cached_tokens > 0 for o in hits[1:])
    assert [key(o) for o in hits] == alone
    llm.shutdown()


@pytest.mark.parametrize("budget", [8, 20])
def test_alone_equals_chunked_prefill(case, budget):
    model, kw, alone = case
    llm = LLM(model, **{**kw, "max_num_batched_tokens": budget, "max_num_seqs": 8, "enable_prefix_caching": False})
    assert together(llm, PROMPTS + FILL[:4])[: len(PROMPTS)] == alone
    llm.shutdown()


def test_alone_equals_after_preemption_and_from_the_memory_tier(case):
    model, kw, alone = case
    llm = LLM(model, **{**kw, "num_kv_blocks": 12, "max_model_len": 40, "enable_prefix_caching": False})
    assert together(llm, PROMPTS) == alone
    assert llm.engine.stats()["num_preemptions"] > 0
    llm.shutdown()
    llm = LLM(model, **{**kw, "num_kv_blocks": 24, "max_model_len": 40, "kv_offload_memory": "4MiB"})
    each(llm, PROMPTS)
    together(llm, FILL[:20])  # evicts the prompts' blocks into the tier
    assert each(llm, PROMPTS) == alone
    assert llm.engine.stats()["prefix_hits_tier"] > 0
    llm.shutdown()


def test_alone_equals_from_the_disk_tier_after_a_restart(case, tmp_path):
    model, kw, alone = case
    if kw["dtype"] != "bfloat16" or "quantization" in kw:
        pytest.skip("one model (GGUF Q4_0, bf16) is enough for the disk round trip")
    disk = {**kw, "num_kv_blocks": 24, "max_model_len": 40, "kv_offload_dir": str(tmp_path), "kv_offload_size": "4MiB"}
    llm = LLM(model, **disk)
    each(llm, PROMPTS)
    llm.shutdown()
    llm = LLM(model, **disk)
    assert each(llm, PROMPTS) == alone
    assert llm.engine.stats()["prefix_hits_tier"] > 0
    llm.shutdown()


def test_the_default_model_alone_equals_batch_and_chunked():
    from ironlm.model.default import default_model_path

    model = str(default_model_path())
    kw = {**BASE, "max_model_len": 128}
    llm = LLM(model, **{**kw, "enable_prefix_caching": False})
    alone = each(llm, PROMPTS[:3])
    assert together(llm, PROMPTS + FILL[:20])[:3] == alone
    llm.shutdown()
    llm = LLM(model, **{**kw, "max_num_batched_tokens": 12, "max_num_seqs": 8})
    assert together(llm, PROMPTS[:3] + FILL[:3])[:3] == alone
    assert each(llm, PROMPTS[:3]) == alone  # prefix hits
    llm.shutdown()
