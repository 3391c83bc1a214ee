"""Tensor parallelism (gloo, 2 ranks) for the dense families beyond Llama/Qwen: greedy outputs equal TP=1 with
prefix caching, chunked prefill and preemption in the same run (test_tensor_parallel's engine config and prompts).

One TP=2 engine per family (each spawns a worker, ~30 s on a busy 2-core machine), so only the families whose
features touch the sharding are here: Gemma 3 (per-head qk-norm, sliding windows shorter than the prompts with
their own RoPE base, post-norms, GELU, embedding scale, one KV head replicated on both ranks), Phi-3 (fused
qkv_proj / gate_up_proj split per rank, partial rotary with LongRoPE, a window), Granite (the four multipliers,
biases, a tied head) and OLMo 2 (a qk-norm over the whole q / k projection, which no rank holds: the ranks
all-reduce its sums of squares, k's only where the KV heads split; with two KV heads split across the ranks and with
one replicated on both).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ironlm import LLM
from ironlm.model import lean, load_model
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
    if name == "olmo2-mqa":  # one KV head, replicated on both ranks: k is whole on each and its norm local
        fam, over = FAMILY_VARIANTS["olmo2"]
        return make_family_model(root, fam, **over, num_key_value_heads=1)
    fam, over = FAMILY_VARIANTS[name]
    return make_family_model(root, fam, **over)


def _greedy(llm: LLM) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens and their logprobs: a tiny random model's argmax survives small errors (a q/k norm over half
    the width, say) that its logprobs show."""
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, dataclasses.replace(GREEDY, logprobs=0), use_tqdm=False)]
    return [list(c.token_ids) for c in outs], [d[t].logprob for c in outs for t, d in zip(c.token_ids, c.logprobs)]


@pytest.mark.parametrize("name", ["gemma3_text", "phi3", "granite", "olmo2", "olmo2-mqa"])
def test_tp2_greedy_equals_tp1(name, tmp_path, monkeypatch):
    path = str(_build(tmp_path, name))
    expected = _greedy(LLM(path, **ENGINE))
    lean_layers = []  # the layers rank 0 (this process) ran through the lean decode step
    real = lean.lean_layer

    def spy(layer, *args):
        lean_layers.append(layer)
        real(layer, *args)

    monkeypatch.setattr(lean, "lean_layer", spy)
    tp = LLM(path, tensor_parallel_size=2, distributed_timeout=120, **ENGINE)
    try:
        assert tp.engine.runner.shard_config.num_heads == tp.engine.model_config.num_heads // 2
        tokens, logprobs = _greedy(tp)
        assert tokens == expected[0]
        assert logprobs == pytest.approx(expected[1], abs=1e-4)
        stats = tp.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        assert tp.engine.step_breakdown()["tp_comm"] > 0
        if name.startswith("olmo2"):  # its decode steps take the lean step too, with the norm across ranks
            assert lean_layers and all(layer.qk_norm_ranks for layer in lean_layers)
            assert lean_layers[0].k_norm_split == (name == "olmo2")
    finally:
        tp.engine.runner.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_olmo2_full_width_qk_norm_weights_split_with_the_heads(rank, tmp_path):
    # rank `rank`'s loading, no processes: its q_norm / k_norm are the rows of its q / k heads
    path = _build(tmp_path, "olmo2")
    full = load_model(str(path), dtype="float32").model.layers[0]
    part = load_model(str(path), dtype="float32", tp=_rank(rank, 2)).model.layers[0]
    q, kv = part.q_size, part.kv_size
    assert (q, kv) == (full.q_size // 2, full.kv_size // 2) and part.k_norm_split
    assert torch.equal(part.q_norm, full.q_norm[rank * q : (rank + 1) * q])
    assert torch.equal(part.k_norm, full.k_norm[rank * kv : (rank + 1) * kv])
