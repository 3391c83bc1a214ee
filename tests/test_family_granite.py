"""Granite against transformers: embedding_multiplier, residual_multiplier (both branches), attention_multiplier
as the softmax scale and logits_scaling, with biases and a tied head; greedy tokens equal on the torch and cpu
backends with prefix caching, chunked prefill and preemption in the same run, and the same from a GGUF made by
llama.cpp's converter (its attention.scale / embedding_scale / residual_scale / logit_scale keys)."""

from __future__ import annotations

import pytest
import torch

from family_parity import MAX_NEW, check_engine_greedy, hf_greedy, shared_prefix_prompts
from gguf_convert import convert
from ironlm.model import load_model
from tiny_families import FAMILY_VARIANTS, make_family_model
from tiny_models import tiny_vocab

SCALES = {"embed_scale": 12.0, "residual_scale": 0.22, "attn_scale": 0.0078125, "logit_scale": 8.0}


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    fam, over = FAMILY_VARIANTS["granite"]
    path = make_family_model(tmp_path_factory.mktemp("granite"), fam, **over)
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    return path, prompts, [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]


def test_config_has_every_feature(granite):
    path, _, _ = granite
    cfg = load_model(path, dtype=torch.float32, device="cpu").config
    assert {k: getattr(cfg, k) for k in SCALES} == pytest.approx(SCALES)
    assert cfg.attention_bias and cfg.tie_word_embeddings


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(granite, backend):
    path, prompts, expected = granite
    check_engine_greedy(path, prompts, expected, backend)


def test_gguf_from_llama_cpp_converter(granite, tmp_path, monkeypatch):
    monkeypatch.setenv("IRONLM_NO_TOKENIZER_CACHE", "1")  # files in tmp paths: keep the user cache clean
    path, prompts, expected = granite
    gguf_path = convert(path, tmp_path, "f32")
    cfg = load_model(gguf_path, dtype=torch.float32, device="cpu").config
    assert cfg.architecture == "granite" and {k: getattr(cfg, k) for k in SCALES} == pytest.approx(SCALES)
    check_engine_greedy(gguf_path, prompts, expected, "cpu")
