"""OLMo 2 against transformers: norms on the attention and MLP outputs instead of before them, a qk-norm over the
whole q / k projection width (not per head), biases; greedy tokens equal on the torch and cpu backends with prefix
caching, chunked prefill and preemption in the same run, and the same from a GGUF made by llama.cpp's converter."""

from __future__ import annotations

import pytest
import torch

from family_parity import MAX_NEW, check_engine_greedy, hf_greedy, shared_prefix_prompts
from gguf_convert import convert
from ironlm.model import load_model
from tiny_families import FAMILY_VARIANTS, make_family_model
from tiny_models import tiny_vocab


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    fam, over = FAMILY_VARIANTS["olmo2"]
    path = make_family_model(tmp_path_factory.mktemp("olmo2"), fam, **over)
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    return path, prompts, [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]


def test_config_has_every_feature(olmo2):
    path, _, _ = olmo2
    lm = load_model(path, dtype=torch.float32, device="cpu")
    cfg = lm.config
    assert (cfg.pre_attn_norm, cfg.pre_mlp_norm, cfg.post_attn_norm, cfg.post_mlp_norm) == (False, False, True, True)
    assert cfg.qk_norm and cfg.qk_norm_full and cfg.attention_bias
    layer = lm.model.layers[0]
    assert layer.q_norm.shape == (cfg.q_size,) and layer.k_norm.shape == (cfg.kv_size,)
    assert layer.input_norm is None and layer.post_norm is None


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(olmo2, backend):
    path, prompts, expected = olmo2
    check_engine_greedy(path, prompts, expected, backend)


def test_gguf_from_llama_cpp_converter(olmo2, tmp_path, monkeypatch):
    monkeypatch.setenv("IRONLM_NO_TOKENIZER_CACHE", "1")  # files in tmp paths: keep the user cache clean
    path, prompts, expected = olmo2
    gguf_path = convert(path, tmp_path, "f32")
    cfg = load_model(gguf_path, dtype=torch.float32, device="cpu").config
    assert cfg.architecture == "olmo2" and cfg.qk_norm_full and cfg.post_mlp_norm and not cfg.pre_attn_norm
    check_engine_greedy(gguf_path, prompts, expected, "cpu")

