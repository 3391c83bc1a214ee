"""DeepSeek-V2 / V3 against transformers: multi-head latent attention over a latent KV cache (absorbed
up-projections), a dense first layer, then routed + shared experts (V2: softmax, group-limited greedy; V3: sigmoid
with the score-correction bias over the best groups, renormalised), routed_scaling_factor; q through a low-rank pair
(V2) or one q_proj (V3). Greedy tokens equal on the torch and cpu backends with prefix caching, chunked prefill and
preemption in one run, and again with preemption by swap through the KV tier. The cache holds one
kv_lora_rank + rope row per token per layer: the test checks that in the pool's real tensors and that a long context
fits in a pool where per-head K/V would not."""

from __future__ import annotations

import math
import random

import pytest
import torch

from family_parity import MAX_NEW, check_engine_greedy, hf_greedy, shared_prefix_prompts
from ironlm import LLM, SamplingParams
from ironlm.model import load_model
from tiny_deepseek import DEEPSEEK_VARIANTS, make_deepseek_model
from tiny_models import tiny_vocab

FAMILIES = list(DEEPSEEK_VARIANTS)


@pytest.fixture(scope="module", params=FAMILIES)
def deepseek(request, tmp_path_factory):
    fam, over = DEEPSEEK_VARIANTS[request.param]
    path = make_deepseek_model(tmp_path_factory.mktemp(request.param), fam, **over)
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    return request.param, path, prompts, [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]


def test_config_has_every_feature(deepseek):
    name, path, _, _ = deepseek
    lm = load_model(path, dtype=torch.float32, device="cpu")
    cfg = lm.config
    assert cfg.mla and cfg.kv_lora_rank == 48 and cfg.qk_rope_head_dim == 16
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 48 + 16)  # the cache's one latent row
    assert cfg.scale == pytest.approx((32 + 16) ** -0.5)
    assert (cfg.q_lora_rank is not None) == (name == "deepseek_v2")
    moe = cfg.moe
    assert moe is not None and moe.sparse_layers == (False, True)  # first_k_dense_replace = 1
    assert moe.num_experts == 8 and moe.route.top_k == 2 and moe.route.n_group == 4 and moe.route.topk_group == 2
    assert moe.shared_intermediate_size == 48 * (2 if name == "deepseek_v2" else 1)
    assert moe.route.scoring == ("softmax" if name == "deepseek_v2" else "sigmoid")
    assert moe.correction_bias == (name == "deepseek_v3") and moe.route.renormalize == (name == "deepseek_v3")
    first, second = lm.model.layers
    assert first.moe is None and second.moe is not None and first.mla is not None
    if name == "deepseek_v3":  # the checkpoint's nonzero correction bias arrived
        assert second.moe.correction is not None and second.moe.correction.abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(deepseek, backend):
    _, path, prompts, expected = deepseek
    check_engine_greedy(path, prompts, expected, backend)


def test_swap_through_the_tier_keeps_greedy_output(deepseek):
    """Preempted sequences' latent blocks go to the host tier and come back (one plane per layer)."""
    _, path, prompts, expected = deepseek
    llm = check_engine_greedy(path, prompts, expected, "cpu", swap_space=0.001)
    s = llm.engine.stats()
    assert s["swap_out_blocks"] > 0 and s["swap_in_blocks"] > 0
    tier = llm.engine.runner.tier
    assert tier is not None and tier.geometry.planes == 1


def test_kv_cache_holds_one_latent_row_per_token(deepseek):
    """KV bytes per token: 2 layers x (48 + 16) x 4 bytes = 512, against 2 layers x 4 heads x (32 + 16 + 24) x 4 =
    2304 with per-head K and V; the pool's tensors (K and V one tensor per layer) hold exactly that."""
    _, path, _, _ = deepseek
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=10, block_size=4, warmup=False)
    m = llm.get_metrics()
    assert (m["kv_bytes_per_token"], m["kv_bytes_per_token_mha"]) == (512, 2304)
    caches = llm.engine.runner.kv_caches
    assert all(k is v for k, v in caches)
    pool = sum(k.numel() * k.element_size() for k, _ in caches)
    assert pool == 10 * 4 * 512


def test_long_context_fits_where_per_head_kv_would_not(tmp_path):
    """A 9k-token pool budget in bytes: latent rows hold an 8k-token prompt, per-head K/V would hold under 2k."""
    fam, over = DEEPSEEK_VARIANTS["deepseek_v3"]
    path = make_deepseek_model(tmp_path, fam, **{**over, "max_position_embeddings": 9216})
    tokens, bs = 8192 + 64, 16
    pool = tokens * 512  # bytes: exactly the latent rows of `tokens` tokens
    assert pool // (2304 * bs) * bs < 2048  # what the same bytes hold as per-head K/V
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=pool, block_size=bs,
              max_model_len=tokens, max_num_batched_tokens=2048, warmup=False)
    assert llm.engine.stats()["blocks_total"] * bs == tokens
    rng = random.Random(5)
    prompt = [rng.randrange(6, len(tiny_vocab()[0])) for _ in range(8192)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.stats()["num_preemptions"] == 0
    # the same prompt as per-head K/V: more than the pool's bytes
    assert len(prompt) * 2304 > pool


def test_tensor_parallel_2_equals_1(tmp_path):
    """TP=2 (gloo): each rank holds half the heads of q_b_proj, kv_b_proj and o_proj and the whole latent
    projection, and caches the whole latent row; greedy tokens equal TP=1's through prefix hits, chunks and
    preemption. Dense layers only: MoE layers do not run tensor parallel."""
    from ironlm.distributed.sharding import ShardSpec

    fam, over = DEEPSEEK_VARIANTS["deepseek_v2"]
    path = make_deepseek_model(tmp_path, fam, **{**over, "first_k_dense_replace": 2})
    cfg = load_model(path, dtype=torch.float32, device="cpu").config
    spec = ShardSpec(1, 2, cfg)
    local = spec.local_config()
    assert (local.num_heads, local.num_kv_heads, local.head_dim) == (2, 1, 64)
    assert spec.cut("model.layers.0.self_attn.q_b_proj.weight") == spec.cut("model.layers.0.self_attn.q_proj.weight")
    assert spec.cut("model.layers.0.self_attn.q_b_proj.weight").start == 2 * (32 + 16)
    assert spec.cut("model.layers.0.self_attn.kv_b_proj.weight").start == 2 * (32 + 24)
    assert spec.cut("model.layers.0.self_attn.o_proj.weight").start == 2 * 24
    assert spec.cut("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") is None
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine = {"dtype": "float32", "device": "cpu", "seed": 0, "block_size": 4, "num_kv_blocks": 24,
              "max_num_batched_tokens": 16, "max_num_seqs": 4}
    requests = [{"prompt_token_ids": p} for p in prompts]
    one = [list(o.outputs[0].token_ids) for o in LLM(str(path), **engine).generate(requests, sp, use_tqdm=False)]
    llm = LLM(str(path), tensor_parallel_size=2, distributed_timeout=60, **engine)
    try:
        two = [list(o.outputs[0].token_ids) for o in llm.generate(requests, sp, use_tqdm=False)]
        s = llm.engine.stats()
    finally:
        llm.shutdown()
    assert two == one
    assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0


def test_logits_match_transformers(deepseek):
    """Every row's log-softmax over three paged steps (prefill, mixed chunk/decode, decode) against transformers."""
    from test_model_hf import _run_and_compare
    from tiny_models import load_hf_reference

    _, path, _, _ = deepseek
    assert _run_and_compare(load_model(path, dtype="float32", device="cpu"), load_hf_reference(path), 4) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_latent_projections_stay_close(tmp_path, family):
    """int8 (the core's blocks) for q / q_a / q_b / kv_a, o and the MLPs, kv_b dense: within test_quant_model's
    int8 bound of transformers fp32. Dense layers only: int8 noise in a router's input flips near-tied expert
    choices (a sigmoid router measured 1.95 with one MoE layer, 0.16 without)."""
    from ironlm.model.linear import QuantLinear
    from test_model_hf import _run_and_compare
    from tiny_models import load_hf_reference

    fam, over = DEEPSEEK_VARIANTS[family]
    path = make_deepseek_model(tmp_path, fam, **{**over, "first_k_dense_replace": 2})
    lm = load_model(path, dtype="float32", device="cpu", quantization="int8")
    mla = lm.model.layers[0].mla
    assert mla.linears() and all(isinstance(lin, QuantLinear) for lin in mla.linears())
    assert mla.kv_a_weight.numel() == 0  # the dense copy is gone
    assert _run_and_compare(lm, load_hf_reference(path), 4) < 0.6


def test_yarn_scaling_matches_transformers(tmp_path):
    """DeepSeek-V3's YaRN: the rotary's attention factor from mscale / mscale_all_dim, and the softmax scale times
    mscale_all_dim's mscale squared; logits equal transformers' over the paged steps."""
    from test_model_hf import _run_and_compare
    from tiny_models import load_hf_reference

    fam, over = DEEPSEEK_VARIANTS["deepseek_v3"]
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
    path = make_deepseek_model(tmp_path, fam, **{**over, "rope_parameters": yarn})
    lm = load_model(path, dtype="float32", device="cpu")
    assert lm.config.scale == pytest.approx((32 + 16) ** -0.5 * (0.1 * 1.0 * math.log(8.0) + 1.0) ** 2)
    assert _run_and_compare(lm, load_hf_reference(path), 4) < 1e-4
