"""llama.cpp itself on each new dense family's GGUF (its own converter's f32 file, every feature of the family on):
llama-server's greedy first tokens equal ironlm's on the same file and token-id prompts. Skipped, with the reason,
where llama.cpp is not built (`make llama-cpp`; CI does not build it)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from gguf_convert import convert_many
from ironlm import LLM, SamplingParams
from ironlm.bench import llama_cpp as lc
from test_family_gemma import _sentencepiece_folder
from tiny_families import FAMILY_VARIANTS, make_family_model
from tiny_models import make_tiny_model, tiny_vocab


def _server_binary():
    try:
        return lc.find_binary("llama-server")
    except FileNotFoundError as exc:
        pytest.skip(f"llama.cpp not built: {exc}")


# Gemma's converter drops lm_head (Gemma ties it) and reads Gemma 2's vocabulary from a tokenizer.model only
GEMMA = {"sliding_window": 8, "final_logit_softcapping": 10.0, "layer_types": ["sliding_attention", "full_attention"],
         "tie_word_embeddings": True}
GEMMA2_VOCAB = 320
FAMILIES = {
    "gemma2": ("tiny", "gemma2", {**GEMMA, "attn_logit_softcapping": 1.5, "vocab_size": GEMMA2_VOCAB}),
    "gemma3_text": ("tiny", "gemma3_text", {**GEMMA, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    # llama.cpp reads a model named like "phi3" as Phi-3's own vocabulary (it looks up </s>, <s>, <unk> and
    # <|endoftext|>, which the tiny tokenizer has not): the folder gets another name. llama.cpp also ignores a
    # Phi-3 window ("Phi SWA is currently disabled", it logs: it attends past it and its tokens part from
    # transformers' and ironlm's once a context outgrows the window), so this variant has none.
    "phi3": ("family", "phi3", {**FAMILY_VARIANTS["phi3"][1], "name": "tiny-fused-qkv", "sliding_window": None}),
    # llama.cpp's OLMo 2 has no attention biases (nor has any OLMo 2 checkpoint): the variant without them
    "olmo2": ("family", "olmo2", {**FAMILY_VARIANTS["olmo2"][1], "attention_bias": False}),
    **{name: ("family", *FAMILY_VARIANTS[name]) for name in ("smollm3", "granite")},
}
NEW = 6


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    vocab = min(len(tiny_vocab()[0]), GEMMA2_VOCAB)
    return [rng.integers(10, vocab, size=n).tolist() for n in (7, 21)]  # the second past every window


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, str]:
    _server_binary()
    root = tmp_path_factory.mktemp("llama_cpp_families")
    folders = {}
    for name, (kind, arch, over) in FAMILIES.items():
        folders[name] = (make_tiny_model(root, arch=arch, **over) if kind == "tiny"
                         else make_family_model(root, arch, **over))
    _sentencepiece_folder(folders["gemma2"], GEMMA2_VOCAB)
    paths = convert_many([(folders[n], "f32") for n in FAMILIES], root / "gguf")
    return {n: str(p) for n, p in zip(FAMILIES, paths)}


def _llama_cpp_greedy(binary, gguf: str, prompts: list[list[int]]) -> list[list[int]]:
    server = lc.LlamaServer(gguf, threads=2, parallel=1, ctx_per_slot=256, binary=binary)
    server.start(120)
    try:
        out = []
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": NEW, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}
            req = urllib.request.Request(f"{server.url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                out.append(list(json.loads(resp.read())["tokens"]))
        return out
    finally:
        server.stop()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_llama_cpp_first_tokens_equal_ironlm(name, ggufs, monkeypatch):
    monkeypatch.setenv("IRONLM_NO_TOKENIZER_CACHE", "1")  # files in tmp paths: keep the user cache clean
    binary = _server_binary()
    prompts = _prompts()
    llm = LLM(ggufs[name], dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert _llama_cpp_greedy(binary, ggufs[name], prompts) == ours
