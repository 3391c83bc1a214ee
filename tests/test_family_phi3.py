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
from ironlm.distributed.group import TPGroup
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


def test_gguf_from_llama_cpp_converter(phi3, phi3_gguf, monkeypatch):
    monkeypatch.setenv("IRONLM_NO_TOKENIZER_CACHE", "1")  # files in tmp paths: keep the user cache clean
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


def test_q8_0_gguf_keeps_split_blocks(phi3, phi3_gguf, tmp_path, monkeypatch):
    """q8_0: the fused attn_qkv / ffn_up are cut into row slices that keep their blocks; dequantized or kept
    quantized, the weights are the file's exactly, and the dequantized load's greedy tokens equal transformers
    running the file's dequantized weights. (The kept blocks' kernels quantize activations to int8, as
    llama.cpp's do, so their tokens may part from the fp32 oracle at a near tie: their weights are checked.)"""
    monkeypatch.setenv("IRONLM_NO_TOKENIZER_CACHE", "1")  # files in tmp paths: keep the user cache clean
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


def _rank(rank: int, world: int) -> TPGroup:
    """A TPGroup that only shards (loading reads `bind` / `shard`; no collective runs), as test_tensor_parallel."""
    group = TPGroup.__new__(TPGroup)
    group.rank, group.world, group._shard, group.device = rank, world, None, torch.device("cpu")
    return group


@pytest.mark.parametrize("source", ["safetensors", "gguf-f32", "gguf-q8_0"])
def test_tensor_parallel_ranks_get_slices_of_the_fused_tensors(phi3, phi3_gguf, source):
    """Under TP=2 each rank takes its heads of q, k, v and its half of gate and up out of the fused checkpoint
    tensors (HF: split then sharded; GGUF: row slices of the fused tensor, q8_0 blocks kept)."""
    path = {"safetensors": phi3[0], "gguf-f32": phi3_gguf[0], "gguf-q8_0": phi3_gguf[1]}[source]
    full = load_model(str(path), dtype="float32", quantization="none").model.layers[0]
    ranks = [load_model(str(path), dtype="float32", quantization="auto", tp=_rank(r, 2)).model.layers[0]
             for r in (0, 1)]

    def dense(lin) -> torch.Tensor:  # [in, out]
        return torch.from_numpy(lin.matrix.dequantize()).t() if hasattr(lin, "matrix") else lin.weight

    q, kv, inter = 128, 64, 192  # per rank: 2 of 4 query heads, 1 of 2 KV heads (head_dim 64), half the MLP
    qkv, gate_up = dense(full.qkv), dense(full.gate_up)
    for r, layer in enumerate(ranks):
        want_qkv = torch.cat([qkv[:, r * q:(r + 1) * q], qkv[:, 256 + r * kv:256 + (r + 1) * kv],
                              qkv[:, 384 + r * kv:384 + (r + 1) * kv]], dim=1)
        want_gu = torch.cat([gate_up[:, r * inter:(r + 1) * inter], gate_up[:, 384 + r * inter:384 + (r + 1) * inter]],
                            dim=1)
        assert torch.equal(dense(layer.qkv), want_qkv) and torch.equal(dense(layer.gate_up), want_gu)
