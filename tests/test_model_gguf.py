"""GGUF loading: dequantization vs gguf's reference, Q/K un-permutation, config from metadata, tokenizer, and
logits vs transformers loading the same file. Tiny GGUF files are written with gguf.GGUFWriter from tiny HF
models (see tiny_models.make_tiny_gguf)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ironlm.model import UnsupportedModelError, load_model
from ironlm.model.gguf import GGUFFile, dequantize, gguf_model_name
from tiny_models import (
    EOS_ID,
    PagedSequences,
    load_hf_gguf_reference,
    load_hf_reference,
    make_kv_caches,
    make_tiny_gguf,
    make_tiny_model,
)

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("IRONLM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    path = make_tiny_model(d, "llama")  # GQA 2, head_dim 64, untied; rows multiples of 32
    return d, path, load_hf_reference(path)


def _logprobs_ironlm(lm, seq: list[int], block_size: int = 4) -> torch.Tensor:
    pager = PagedSequences(1, block_size, 32, 16, seed=5)
    kv = make_kv_caches(lm.config, 32, block_size)
    inp, pos, meta, _ = pager.step({0: seq})
    return torch.log_softmax(lm.model(inp, pos, kv, meta, torch.arange(len(seq))), -1)


def _logprobs_hf(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q6_K"])
def test_dequantize_bit_identical_to_gguf_reference(qtype):
    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    cols = 256  # multiple of every block size (K-quants: 256)
    data = (rng.standard_normal((6, cols)) * rng.uniform(0.01, 3.0, (6, 1))).astype(np.float32)
    if qt == gguf.GGMLQuantizationType.F16:
        raw = data.astype(np.float16).view(np.uint8)
        want = data.astype(np.float16).astype(np.float32)
    elif qt == gguf.GGMLQuantizationType.Q6_K:  # gguf cannot quantize K-quants: random blocks (fallback path)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=6 * cols // block * size, dtype=np.uint8)
        want = gguf.quants.dequantize(raw, qt)
    else:
        raw = gguf.quants.quantize(data, qt)
        want = gguf.quants.dequantize(raw, qt)
    got = dequantize(np.ascontiguousarray(raw).reshape(-1), int(qt), (6, cols)).float()
    want_t = torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)).reshape(6, cols)
    torch.testing.assert_close(got, want_t, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_weights_and_logits(tiny_llama, tmp_path, qtype):
    """Weights = HF weights through gguf's own quantize/dequantize (so the Q/K permutation is undone exactly);
    logits = transformers loading the same GGUF file."""
    _, hf_dir, hf_orig = tiny_llama
    path = make_tiny_gguf(tmp_path, hf_dir, qtype)
    lm = load_model(path, dtype=torch.float32, device="cpu")
    cfg = lm.config
    assert cfg.architecture == "llama" and cfg.source == "gguf"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.vocab_size == hf_orig.config.vocab_size and not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == [EOS_ID]

    qt = gguf.GGMLQuantizationType[qtype]
    sd = hf_orig.state_dict()

    def through_gguf(w: torch.Tensor) -> torch.Tensor:
        a = w.float().numpy()
        if qt == gguf.GGMLQuantizationType.F32:
            return w.float()
        if qt == gguf.GGMLQuantizationType.F16:
            return torch.from_numpy(a.astype(np.float16).astype(np.float32))
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qt), qt).astype(np.float32))

    layer = lm.model.layers[1]
    q, kv = cfg.q_size, cfg.kv_size
    expect = {  # ironlm stores projections fused and transposed ([in, out])
        "self_attn.q_proj.weight": layer.qkv_weight[:, :q].t(),
        "self_attn.k_proj.weight": layer.qkv_weight[:, q : q + kv].t(),
        "self_attn.v_proj.weight": layer.qkv_weight[:, q + kv :].t(),
        "mlp.gate_proj.weight": layer.gate_up_weight[:, : cfg.intermediate_size].t(),
        "mlp.down_proj.weight": layer.down_weight.t(),
        "input_layernorm.weight": layer.input_norm,
    }
    for name, got in expect.items():
        w = sd[f"model.layers.1.{name}"]
        want = w.float() if w.dim() == 1 else through_gguf(w)
        assert torch.equal(got, want), name
    assert torch.equal(lm.model.embed, through_gguf(sd["model.embed_tokens.weight"]))

    seq = [1, 40, 41, 300, 7, 9, 120, 250, 251, 33, 34, 35, 36, 100, 200, 17, 18]
    got = _logprobs_ironlm(lm, seq)
    hf_gguf = load_hf_gguf_reference(path)
    assert float((got - _logprobs_hf(hf_gguf, seq)).abs().max()) < 1e-4
    if qtype == "F32":  # lossless: identical to the original HF model too
        assert float((got - _logprobs_hf(hf_orig, seq)).abs().max()) < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_gguf_other_archs_match_hf(tmp_path, arch):
    """qwen2 (biases) / qwen3 (q/k norm) GGUFs are not permuted by llama.cpp; mistral ones are (llama arch)."""
    hf_dir = make_tiny_model(tmp_path, arch, num_hidden_layers=1)
    path = make_tiny_gguf(tmp_path, hf_dir, "F32")
    lm = load_model(path, dtype=torch.float32, device="cpu")
    assert lm.config.architecture == arch
    assert lm.config.attention_bias == (arch == "qwen2")
    assert lm.config.qk_norm == (arch == "qwen3")
    seq = list(range(20, 45))
    got = _logprobs_ironlm(lm, seq, block_size=16)
    assert float((got - _logprobs_hf(load_hf_reference(hf_dir), seq)).abs().max()) < 1e-4


def test_gguf_tokenizer_and_metadata(tiny_llama, tmp_path):
    _, hf_dir, _ = tiny_llama
    path = make_tiny_gguf(tmp_path, hf_dir, "Q8_0", name="Tiny-Model-7B-Instruct.Q8_0.gguf")
    lm = load_model(path, dtype=torch.float32, device="cpu")
    assert lm.name == "Tiny-Model-7B-Instruct"
    assert lm.path == str(path)
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_dir))
    for text in ["hello world, the model", "héllo wörld 你好"]:
        assert lm.tokenizer(text).input_ids == ref(text).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert lm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # second load comes from the tokenizer cache and behaves the same
    lm2 = load_model(path, dtype=torch.float32, device="cpu")
    assert lm2.tokenizer("hello world").input_ids == lm.tokenizer("hello world").input_ids
    assert any((tmp_path / "cache" / "tokenizers").iterdir())

    gf = GGUFFile(path)
    assert gf.get("general.architecture") == "llama"
    assert gf.tensors["blk.0.attn_q.weight"].type_name == "Q8_0"
    assert gf.tensors["blk.0.attn_norm.weight"].type_name == "F32"
    gf.close()


def test_gguf_model_names():
    from pathlib import Path

    assert gguf_model_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert gguf_model_name(Path("llama-3.2-1b-instruct-q4_k_m.gguf")) == "llama-3.2-1b-instruct"
    assert gguf_model_name(Path("model-F16.gguf")) == "model"
    assert gguf_model_name(Path("qwen2.5-0.5b.gguf")) == "qwen2.5-0.5b"


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(path, dtype=torch.float32, device="cpu")
