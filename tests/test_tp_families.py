"""Tensor parallelism (gloo, 2 ranks) for the dense families beyond Llama/Qwen: greedy outputs equal TP=1 with
prefix caching, chunked prefill and preemption in the same run (test_tensor_parallel's engine config and prompts).

One TP=2 engine per family (each spawns a worker, ~30 s on a busy 2-core machine), so only the families whose
features touch the sharding are here: Gemma 3 (per-head qk-norm, sliding windows shorter than the prompts with
their own RoPE base, post-norms, GELU, embedding scale, one KV head replicated on both ranks), Phi-3 (fused
qkv_proj / gate_up_proj split per rank, partial rotary with LongRoPE, a window) and Granite (the four multipliers,
biases, a tied head). OLMo 2's qk-norm spans the whole q / k projection, which no rank holds: it is refused under TP
with an error that says so.
"""

from __future__ import annotations

import pytest

from ironlm import LLM
from ironlm.exceptions import UnsupportedModelError
from ironlm.model import load_model
from test_tensor_parallel import ENGINE, GREEDY, PROMPTS, _rank
from tiny_families import FAMILY_VARIANTS, make_family_model
from tiny_models import make_tiny_model

GEMMA3 = {"sliding_window": 8, "query_pre_attn_scalar": 32, "final_logit_softcapping": 10.0,
          "layer_types": ["sliding_attention", "full_attention"], "num_key_value_heads": 1,
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 100.0}}}


def _build(root, name: str):
    if name == "gemma3_text":
        return make_tiny_model(root, arch=name, **GEMMA3)
    fam, over = FAMILY_VARIANTS[name]
    return make_family_model(root, fam, **over)


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ["gemma3_text", "phi3", "granite"])
def test_tp2_greedy_equals_tp1(name, tmp_path):
    path = str(_build(tmp_path, name))
    expected = _greedy(LLM(path, **ENGINE))
    tp = LLM(path, tensor_parallel_size=2, distributed_timeout=30, **ENGINE)
    try:
        assert tp.engine.runner.shard_config.num_heads == tp.engine.model_config.num_heads // 2
        assert _greedy(tp) == expected
        stats = tp.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        assert tp.engine.step_breakdown()["tp_comm"] > 0
    finally:
        tp.engine.runner.shutdown()


def test_olmo2_full_width_qk_norm_is_refused_under_tp(tmp_path):
    # rank 0's loading, no processes (an `LLM(..., tensor_parallel_size=2)` raises the same from its worker)
    path = str(_build(tmp_path, "olmo2"))
    with pytest.raises(UnsupportedModelError, match="qk-norm over the whole"):
        load_model(path, dtype="float32", tp=_rank(0, 2))
