"""The KV tier with a sliding-window family: Gemma 3 (8-token windows on its local layers, far shorter than the
48-token prompts, qk-norm, its own local RoPE base) through a host-memory tier under the prefix cache and through
swap. Blocks are demoted, promoted and swapped both ways, and the greedy outputs equal the same engine's without a
tier: the tier only changes where KV comes from (test_kv_offload's rounds and pools, there on Llama)."""

from __future__ import annotations

import random

import pytest

from ironlm import LLM
from test_kv_offload import (
    SMALL_POOL,
    SWAP_PARAMS,
    SWAP_POOL,
    _generate,
    _shared_prefix_rounds,
    _texts,
    _tokens,
)
from tiny_models import make_tiny_model

GEMMA3 = {"sliding_window": 8, "query_pre_attn_scalar": 32, "final_logit_softcapping": 10.0,
          "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 100.0}}}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("gemma3"), arch="gemma3_text", **GEMMA3))


def test_memory_tier_keeps_gemma_greedy_output(gemma):
    rounds = _shared_prefix_rounds()
    plain = LLM(gemma, **SMALL_POOL)
    assert plain.engine.model_config.layer_windows == [8, None]
    expected = [_texts(_generate(plain, prompts)) for prompts in rounds]
    tiered = LLM(gemma, kv_offload_memory="1MiB", **SMALL_POOL)
    assert [_texts(_generate(tiered, prompts)) for prompts in rounds] == expected
    s = tiered.engine.stats()
    assert s["kv_tier"] == "memory" and s["kv_demotions"] > 0 and s["kv_promotions"] > 0
    assert s["prefix_hits_tier"] > 0
    assert s["prefix_cache_hits"] > plain.engine.stats()["prefix_cache_hits"]


def test_swap_keeps_gemma_greedy_output(gemma):
    rng = random.Random(3)
    prompts = [_tokens(rng, 20) for _ in range(4)]
    plain = LLM(gemma, **SWAP_POOL)
    expected = _texts(_generate(plain, prompts, SWAP_PARAMS))
    assert plain.engine.stats()["num_preemptions"] > 0
    swapped = LLM(gemma, swap_space=0.001, **SWAP_POOL)
    assert _texts(_generate(swapped, prompts, SWAP_PARAMS)) == expected
    s = swapped.engine.stats()
    assert s["num_preemptions"] > 0 and s["swap_out_blocks"] > 0 and s["swap_in_blocks"] > 0
