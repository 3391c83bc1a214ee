"""SmolLM3 against transformers: NoPE layers (no rotary where `no_rope_layers` is 0) with a sliding window on the
NoPE layer, a tied head; greedy tokens equal on the torch and cpu backends with prefix caching, chunked prefill
and preemption in the same run. GGUF files carry no NoPE pattern (llama.cpp hard-codes every 4th layer), so the
converter's file is checked on a 4-layer model with transformers' default pattern."""

from __future__ import annotations

import pytest
import torch

from family_parity import MAX_NEW, check_engine_greedy, hf_greedy, shared_prefix_prompts
from gguf_convert import convert
from ironlm.model import load_model
from tiny_families import FAMILY_VARIANTS, make_family_model
from tiny_models import tiny_vocab


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    fam, over = FAMILY_VARIANTS["smollm3"]
    path = make_family_model(tmp_path_factory.mktemp("smollm3"), fam, **over)
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    return path, prompts, [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]


def test_config_has_every_feature(smollm3):
    path, _, _ = smollm3
    lm = load_model(path, dtype=torch.float32, device="cpu")
    cfg = lm.config
    assert cfg.rope_layers == [True, False] and cfg.layer_windows == [None, 16] and cfg.tie_word_embeddings
    assert lm.model.layers[1].rotary is None and lm.model.layers[0].rotary is not None


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(smollm3, backend):
    path, prompts, expected = smollm3
    check_engine_greedy(path, prompts, expected, backend)


def test_gguf_from_llama_cpp_converter(tmp_path, monkeypatch):
    monkeypatch.setenv("IRONLM_NO_TOKENIZER_CACHE", "1")  # files in tmp paths: keep the user cache clean
    path = make_family_model(tmp_path, "smollm3", num_hidden_layers=4)  # layer 3 is NoPE, as llama.cpp assumes
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]), seed=2)
    expected = [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]
    gguf_path = convert(path, tmp_path / "gguf", "f32")
    cfg = load_model(gguf_path, dtype=torch.float32, device="cpu").config
    assert cfg.architecture == "smollm3" and cfg.rope_layers == [True, True, True, False]
    check_engine_greedy(gguf_path, prompts, expected, "cpu")
