"""Phi-3 / Phi-4 against transformers: fused qkv_proj / gate_up_proj split at load, LongRoPE (long factors past
the original context, short ones within it), Phi-4-mini's partial rotary, a sliding window shorter than the
prompts; greedy tokens equal on the torch and cpu backends with prefix caching, chunked prefill and preemption in
the same run, and the same from a GGUF made by llama.cpp's converter (fused attn_qkv / ffn_up, rope factor
tensors)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from family_parity import MAX_NEW, check_engine_greedy, hf_greedy, shared_prefix_prompts
from gguf_convert import convert_many
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


@pytest.fixture(scope="module")
def phi3_gguf(phi3, tmp_path_factory):
    """The converter's f32 and q8_0 files (one converter process)."""
    f32, q8 = convert_many([(phi3[0], "f32"), (phi3[0], "q8_0")], tmp_path_factory.mktemp("phi3-gguf"))
    return f32, q8


def test_gguf_from_llama_cpp_converter(phi3, phi3_gguf):
    _, prompts, expected = phi3
    gguf_path = phi3_gguf[0]
    gf = GGUFFile(gguf_path)
    assert "blk.0.attn_qkv.weight" in gf.tensors and "rope_factors_long.weight" in gf.tensors
    gf.close()
    lm = load_model(gguf_path, dtype=torch.float32, device="cpu")
    cfg = lm.config
    assert (cfg.architecture, cfg.rotary_dim, cfg.sliding_window) == ("phi3", 48, 20)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    check_engine_greedy(gguf_path, prompts, expected, "cpu")


def _fused_reference(path, name: str) -> torch.Tensor:
    gf = GGUFFile(path)
    info = gf.tensors[name]
    w = gguf.quants.dequantize(np.asarray(gf.raw(info)), gguf.GGMLQuantizationType(info.ggml_type))
    gf.close()
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(info.shape)


def _dequantized_hf_folder(hf_dir, gguf_path, out):
    """The HF folder with every weight replaced by the GGUF file's (dequantized by gguf's reference code): the
    transformers oracle for a quantized file."""
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    names = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    top = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
    params = dict(model.named_parameters())
    gf = GGUFFile(gguf_path)
    with torch.no_grad():
        for gname in gf.tensors:
            stem = gname.removesuffix(".weight")
            if stem in top:
                hf = top[stem]
            elif stem.startswith("blk."):
                _, i, kind = stem.split(".", 2)
                hf = f"model.layers.{i}.{names[kind]}"
            else:
                continue  # rope factor tensors: config, not weights
            params[hf + ".weight"].copy_(_fused_reference(gguf_path, gname))
    gf.close()
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(hf_dir) / f, Path(out) / f)
    return out


def test_q8_0_gguf_keeps_split_blocks(phi3, phi3_gguf, tmp_path):
    """q8_0: the fused attn_qkv / ffn_up are cut into row slices that keep their blocks; dequantized or kept
    quantized, the weights are the file's exactly, and the dequantized load's greedy tokens equal transformers
    running the file's dequantized weights. (The kept blocks' kernels quantize activations to int8, as
    llama.cpp's do, so their tokens may part from the fp32 oracle at a near tie: their weights are checked.)"""
    path, prompts, _ = phi3
    q8 = phi3_gguf[1]
    qkv, gate_up = _fused_reference(q8, "blk.1.attn_qkv.weight"), _fused_reference(q8, "blk.1.ffn_up.weight")
    dense = load_model(q8, dtype=torch.float32, device="cpu", quantization="none").model.layers[1]
    assert torch.equal(dense.qkv_weight.t(), qkv) and torch.equal(dense.gate_up_weight.t(), gate_up)
    kept = load_model(q8, dtype=torch.float32, device="cpu", quantization="auto").model.layers[1]
    assert kept.qkv.matrix.kind == "q8"  # the core's name for Q8_0 blocks
    assert torch.equal(torch.from_numpy(np.asarray(kept.qkv.matrix.dequantize())).reshape(qkv.shape), qkv)
    assert torch.equal(torch.from_numpy(np.asarray(kept.gate_up.matrix.dequantize())).reshape(gate_up.shape), gate_up)
    oracle = _dequantized_hf_folder(path, q8, tmp_path / "dequantized")
    expected = [t for t, _ in hf_greedy(oracle, prompts, max_new=MAX_NEW)]
    check_engine_greedy(q8, prompts, expected, "cpu", quantization="none")
