"""MoE families from GGUF files made by llama.cpp's own converter: the same greedy tokens as the HF folder, with
prefix caching, chunked prefill and preemption in the run; llama.cpp's stacked experts (``ffn_*_exps``) split per
expert. Q8_0 (the converter's) and Q4_0 (llama-quantize's) files keep every expert's blocks: the expert matrices
are the file's exactly, the dequantized load equals transformers on the file's dequantized weights token for
token, and the kept blocks (int8 activations, as llama.cpp) stay within a measured bound of it."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from family_parity import MAX_NEW, check_engine_greedy, hf_greedy, shared_prefix_prompts
from gguf_convert import convert_many
from ironlm.model import load_model, weights
from ironlm.model.gguf import GGUFFile
from ironlm.model.moe.gguf import split_experts
from test_model_hf import _run_and_compare
from tiny_models import load_hf_reference, tiny_vocab
from tiny_moe import MOE_VARIANTS, make_moe_model

FAMILIES = sorted(MOE_VARIANTS)
# llama.cpp's graphs have no dense layers in these architectures: the GGUF models are MoE throughout
ALL_SPARSE = {"qwen2_moe": {"mlp_only_layers": []}, "qwen3_moe": {"decoder_sparse_step": 1}}
# worst |log-softmax diff| of the kept blocks vs transformers on the file's dequantized weights (measured worst)
KEPT_BOUNDS = {"q8_0": 0.8, "q4_0": 0.8}  # measured 0.49, 0.47: routing flips at near ties


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-gguf")
    paths = {f: make_moe_model(root, f, **ALL_SPARSE.get(f, {})) for f in FAMILIES}
    jobs = [(paths[f], "f32") for f in FAMILIES] + [(paths["qwen2_moe"], "q8_0")]
    files = convert_many(jobs, root)
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    expected = {f: [t for t, _ in hf_greedy(paths[f], prompts, max_new=MAX_NEW)] for f in FAMILIES}
    return paths, dict(zip(FAMILIES, files)), files[-1], prompts, expected


@pytest.fixture(autouse=True)
def _no_tokenizer_cache(monkeypatch):
    monkeypatch.setenv("IRONLM_NO_TOKENIZER_CACHE", "1")  # files in tmp paths: keep the user cache clean


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_matches_the_hf_folder(models, family):
    paths, f32, _, prompts, expected = models
    hf_cfg = load_model(paths[family], dtype=torch.float32, device="cpu").config
    cfg = load_model(f32[family], dtype=torch.float32, device="cpu").config
    assert cfg.source == "gguf" and cfg.moe == hf_cfg.moe
    check_engine_greedy(f32[family], prompts, expected[family], "cpu")


def _reference_folder(hf_dir, dense_lm, out):
    """transformers' model of `hf_dir` with every weight replaced by `dense_lm`'s (a GGUF loaded dequantized)."""
    hf = load_hf_reference(hf_dir)
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # transformers' stacked [E, out, in]
                block = dense_lm.model.layers[int(layer)].moe
                src = (block.gate_up_weight if rest.endswith("gate_up_proj") else block.down_weight).transpose(1, 2)
            else:
                src = dense_lm.model.weight_target(weights.canonical(dense_lm.config, name))
            assert src is not None, name
            p.copy_(src)
    hf.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / f).write_bytes((hf_dir / f).read_bytes())
    return out


def _check_kept_blocks(gguf_path, hf_dir, kind, qtype, prompts, tmp_path):
    kept = load_model(gguf_path, dtype=torch.float32, device="cpu", quantization="auto")
    layer = kept.model.layers[1].moe
    assert layer is not None and layer.gate_up_weight.numel() == 0
    assert layer.core is not None  # the kept blocks run on the core's MoE kernel
    gf = GGUFFile(gguf_path)
    split_experts(gf, lambda t: GGML_QUANT_SIZES[GGMLQuantizationType(t)])
    assert gf.tensors["blk.1.ffn_down_exps.3.weight"].type_name == qtype
    inter = kept.config.moe.intermediate_size
    for e in (0, 5):
        mlp = layer.experts[e]
        assert mlp.gate_up.matrix.kind == kind and mlp.down.matrix.kind == kind
        gate_up = torch.from_numpy(np.asarray(mlp.gate_up.matrix.dequantize())).reshape(2 * inter, -1)
        assert torch.equal(gate_up[:inter], gf.dequantize(f"blk.1.ffn_gate_exps.{e}.weight"))
        assert torch.equal(gate_up[inter:], gf.dequantize(f"blk.1.ffn_up_exps.{e}.weight"))
    gf.close()
    dense = load_model(gguf_path, dtype=torch.float32, device="cpu", quantization="none")
    oracle = _reference_folder(hf_dir, dense, tmp_path / "dequantized")
    expected = [t for t, _ in hf_greedy(oracle, prompts, max_new=MAX_NEW)]
    check_engine_greedy(gguf_path, prompts, expected, "cpu", quantization="none")
    worst = _run_and_compare(kept, load_hf_reference(oracle), 4)
    assert worst < KEPT_BOUNDS[qtype.lower()], f"{qtype}: {worst:.3g}"


def test_q8_0_experts_keep_their_blocks(models, tmp_path):
    paths, _, q8, prompts, _ = models
    _check_kept_blocks(q8, paths["qwen2_moe"], "q8", "Q8_0", prompts, tmp_path)


def test_q4_0_experts_keep_their_blocks(models, tmp_path):
    """Q4_0 as users make it: llama.cpp's llama-quantize over the converter's f32 file."""
    from ironlm.bench.llama_cpp import find_binary
    from ironlm.exceptions import LlamaCppNotBuilt

    try:
        quantize = find_binary("llama-quantize")
    except LlamaCppNotBuilt as exc:
        pytest.skip(str(exc))
    paths, f32, _, prompts, _ = models
    q4 = tmp_path / "tiny-qwen2_moe.Q4_0.gguf"
    subprocess.run([str(quantize), str(f32["qwen2_moe"]), str(q4), "Q4_0"], check=True, capture_output=True,
                   timeout=120)
    _check_kept_blocks(q4, paths["qwen2_moe"], "q4", "Q4_0", prompts, tmp_path)
