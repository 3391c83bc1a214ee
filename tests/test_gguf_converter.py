"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py from the pinned llama-cpp-python sdist, see
gguf_convert.py) load in ironlm and generate what the HF folder they came from generates.

f32 is lossless: ironlm's greedy tokens equal the HF folder's. f16 and q8_0 round the weights, so their tokens
must equal those of transformers' own GGUF loader on the same file. Each run goes through prefix caching, chunked
prefill and preemption (family_parity.check_engine_greedy). The tokenizer ironlm rebuilds from the GGUF
metadata tokenizes as the HF folder's does.
"""

from __future__ import annotations

import pytest
import torch

from family_parity import check_engine_greedy, hf_greedy, shared_prefix_prompts
from gguf_convert import convert_many
from ironlm.model import load_model
from ironlm.model.gguf import GGUFFile
from tiny_models import load_hf_gguf_reference, make_tiny_model

MAX_NEW = 8
# (name, arch, overrides, outtype)
CASES = [
    ("llama", "llama", {}, "f32"),
    ("llama", "llama", {}, "q8_0"),
    ("qwen2", "qwen2", {"tie_word_embeddings": True}, "f16"),
    ("qwen3", "qwen3", {}, "f32"),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every case converted once, in one converter process: {(name, outtype): (hf_dir, gguf_path)}."""
    root = tmp_path_factory.mktemp("converter")
    dirs = {name: make_tiny_model(root, arch, **over) for name, arch, over, _ in CASES}
    paths = convert_many([(dirs[name], outtype) for name, _, _, outtype in CASES], root / "gguf")
    return {(name, outtype): (dirs[name], p) for (name, _, _, outtype), p in zip(CASES, paths)}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("IRONLM_CACHE_DIR", str(tmp_path / "cache"))  # the GGUF tokenizer cache, not the converter


def _prompts(hf_dir) -> list[list[int]]:
    import json

    return shared_prefix_prompts(json.loads((hf_dir / "config.json").read_text())["vocab_size"])


def _hf_gguf_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    model = load_hf_gguf_reference(path)
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(MAX_NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


@pytest.mark.parametrize("name,outtype", [(c[0], c[3]) for c in CASES], ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_converted_gguf_generates_like_its_source(converted, name, outtype):
    hf_dir, path = converted[(name, outtype)]
    gf = GGUFFile(path)
    want_type = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[outtype]
    assert gf.tensors["blk.0.attn_q.weight"].type_name == want_type  # the file really is what the case says
    assert gf.get("tokenizer.ggml.pre") == "gpt-2"
    gf.close()
    prompts = _prompts(hf_dir)
    if outtype == "f32":
        expected = [t for t, _ in hf_greedy(hf_dir, prompts, max_new=MAX_NEW)]
    else:
        expected = _hf_gguf_greedy(path, prompts)
    check_engine_greedy(path, prompts, expected, backend="cpu", max_new=MAX_NEW)


def test_converted_gguf_config_and_tokenizer(converted):
    from transformers import AutoTokenizer

    for (name, outtype), (hf_dir, path) in converted.items():
        lm = load_model(path, dtype=torch.float32, device="cpu")
        assert lm.config.source == "gguf" and lm.config.architecture == name
        assert lm.config.tie_word_embeddings == (name == "qwen2")
        ref = AutoTokenizer.from_pretrained(str(hf_dir))
        for text in ["hello world, the model", "héllo wörld 你好 <|im_start|>x"]:
            assert lm.tokenizer(text).input_ids == ref(text).input_ids, (name, text)
