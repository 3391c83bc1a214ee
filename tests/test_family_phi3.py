"""Phi-3 / Phi-4 against transformers: fused qkv_proj / gate_up_proj split at load, LongRoPE (long factors past
the original context, short ones within it), Phi-4-mini's partial rotary, a sliding window shorter than the
prompts; greedy tokens equal on the torch and cpu backends with prefix caching, chunked prefill and preemption in
the same run, and the same from a GGUF made by llama.cpp's converter (fused attn_qkv / ffn_up, rope factor
tensors)."""

from __future__ import annotations

import pytest
import torch

from family_parity import MAX_NEW, check_engine_greedy, hf_greedy, shared_prefix_prompts
from gguf_convert import convert
from ironlm.model import load_model
from ironlm.model.gguf import GGUFFile
from tiny_families import FAMILY_VARIANTS, longrope, make_family_model
from tiny_models import tiny_vocab


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    fam, over = FAMILY_VARIANTS["phi3"]
    path = make_family_model(tmp_path_factory.mktemp("phi3"), fam, **over)
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    return path, prompts, [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]


def test_config_has_every_feature(phi3):
    path, _, _ = phi3
    cfg = load_model(path, dtype=torch.float32, device="cpu").config
    assert cfg.architecture == "phi3" and cfg.rotary_dim == 48 and cfg.head_dim == 64
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.sliding_window == 20
    assert cfg.max_position_embeddings > cfg.rope_scaling["original_max_position_embeddings"]  # long factors


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(phi3, backend):
    path, prompts, expected = phi3
    check_engine_greedy(path, prompts, expected, backend)


def test_short_factors_full_rotary(tmp_path):
    """Within the original context: the short factors, and full rotary (the core's fused RoPE and the lean CPU
    decode step take it)."""
    path = make_family_model(tmp_path, "phi3", rope_parameters=longrope(64, 512), original_max_position_embeddings=512)
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]), seed=4)
    expected = [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]
    check_engine_greedy(path, prompts, expected, "cpu")


def test_gguf_from_llama_cpp_converter(phi3, tmp_path):
    path, prompts, expected = phi3
    gguf_path = convert(path, tmp_path, "f32")
    gf = GGUFFile(gguf_path)
    assert "blk.0.attn_qkv.weight" in gf.tensors and "rope_factors_long.weight" in gf.tensors
    gf.close()
    lm = load_model(gguf_path, dtype=torch.float32, device="cpu")
    cfg = lm.config
    assert (cfg.architecture, cfg.rotary_dim, cfg.sliding_window) == ("phi3", 48, 20)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    check_engine_greedy(gguf_path, prompts, expected, "cpu")
