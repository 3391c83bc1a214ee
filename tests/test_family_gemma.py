"""Gemma 2 and Gemma 3 (text) against transformers in fp32, every feature of each switched on and made to matter:
soft-capping with small caps (Gemma 2's attention logits, both families' final logits), windows shorter than the
prompts, query_pre_attn_scalar != head_dim, 1 + w norms (random w), post-norms, GeGLU, embedding scale, Gemma 3's
qk-norm and its own RoPE base for the local layers. The reference runs transformers' eager attention (the one that
soft-caps). Gemma 3's attention ignores `attn_logit_softcapping` in transformers, and so does ironlm.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ironlm import LLM, SamplingParams, _core
from ironlm.model import load_model
from ironlm.model.config import ModelConfig
from ironlm.model.gguf import load_gguf_tokenizer
from lean_batch import assert_same_step, decode_batch
from test_model_hf import TOL, _run_and_compare
from tiny_models import BOS_ID, EOS_ID, PAD_ID, make_tiny_model, tiny_hf_config

WINDOW = 8
MAX_NEW = 8
# Caps small enough to bend the logits the random weights give (|attention logit| reaches ~5, final ~8)
FEATURES = {
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 1.5,
               "final_logit_softcapping": 10.0, "layer_types": ["sliding_attention", "full_attention"],
               "tie_word_embeddings": False},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 32, "final_logit_softcapping": 10.0,
                    "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 100.0}}},
}


def _reference(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=list(FEATURES))
def family(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, **FEATURES[arch])
    return arch, path, _reference(path)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(6, vocab, size=13).tolist()  # > the window, so cached blocks hold slid-out keys
    prompts = [shared + rng.integers(6, vocab, size=n).tolist() for n in (3, 11, 6, 19)]
    return [*prompts, rng.integers(6, vocab, size=2).tolist()]


@pytest.fixture(scope="module")
def greedy(family):
    """The prompts and transformers' greedy tokens for them (once per family, shared by both backends)."""
    _, _, hf = family
    prompts = _prompts(hf.config.vocab_size)
    return prompts, [_hf_greedy(hf, p) for p in prompts]


def test_config_reads_every_feature():
    g2 = ModelConfig.from_hf(tiny_hf_config("gemma2", **FEATURES["gemma2"]))
    assert (g2.norm_offset, g2.activation, g2.attn_softcap, g2.final_softcap) == (1.0, "gelu_tanh", 1.5, 10.0)
    assert g2.attn_scale == pytest.approx(32**-0.5) and g2.scale == pytest.approx(32**-0.5)
    assert g2.embed_scale == pytest.approx(16.0) and g2.post_attn_norm and g2.post_mlp_norm
    assert g2.layer_windows == [WINDOW, None] and g2.lean_supported
    g3 = ModelConfig.from_hf(tiny_hf_config("gemma3_text", **FEATURES["gemma3_text"]))
    assert g3.qk_norm and g3.attn_softcap is None and g3.final_softcap == 10.0
    assert g3.rope_theta == 100.0 and g3.local_rope == {"rope_type": "default", "rope_theta": 10000.0}
    assert g3.rotary_config(0).rope_theta == 10000.0 and g3.rotary_config(1).rope_theta == 100.0
    # transformers' own default: five local layers, then a global one
    assert ModelConfig.from_hf(tiny_hf_config("gemma3_text", num_hidden_layers=12)).layer_windows == \
        [4096] * 5 + [None] + [4096] * 5 + [None]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_paged_steps_match_transformers(family, backend):
    """Prefill, extend over cached context and decode rows in one step, windows shorter than the sequences."""
    from ironlm.attention import get_backend

    arch, path, hf = family
    lm = load_model(path, dtype=torch.float32, device="cpu", attn_backend=get_backend(backend))
    assert lm.config.architecture == arch
    assert len(lm.model.rotaries) == (2 if arch == "gemma3_text" else 1)
    assert _run_and_compare(lm, hf, block_size=4) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_decode_step_equals_the_ordinary_forward(family, dtype, monkeypatch):
    """Gemma's blocks take the lean CPU decode step (post-norms, qk-norm, GELU-tanh, embedding scale, the local
    RoPE base, query_pre_attn_scalar, Gemma 2's soft-cap, windows shorter than the contexts): its logits and the
    K/V rows it writes equal the ordinary forward's bit for bit, in fp32 and bf16 (the same core kernels and the
    same matmul shapes; every residual add comes after a post-norm, so none is fused into a GEMM on one path
    only)."""
    from ironlm.attention import CpuAttention

    arch, path, _ = family
    model = load_model(path, dtype=dtype, device="cpu", attn_backend=CpuAttention()).model
    cfg = model.config
    assert cfg.lean_supported
    calls: list[dict] = []
    real = _core.decode_attention_qkv

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(_core, "decode_attention_qkv", spy)
    model._lean.clear()
    got = decode_batch(model, dtype, True, monkeypatch)
    assert 3 in model._lean and len(calls) == cfg.num_layers, "the lean step was not taken"
    assert all(c["q_norm"] is not None for c in calls) == (arch == "gemma3_text")
    assert {c["softcap"] for c in calls} == ({1.5} if arch == "gemma2" else {None})
    want = decode_batch(model, dtype, False, monkeypatch)
    assert len(calls) == cfg.num_layers, "the ordinary forward took the lean step"
    assert_same_step(got, want)


def test_soft_capping_and_local_rope_change_the_result(family):
    """The features are really exercised: switched off, the same weights stop matching transformers."""
    arch, path, hf = family
    lm = load_model(path, dtype=torch.float32, device="cpu")
    lm.model.config.final_softcap = None
    assert _run_and_compare(lm, hf, block_size=4) > 1e-2
    lm = load_model(path, dtype=torch.float32, device="cpu")
    if arch == "gemma2":
        for layer in lm.model.layers:
            layer.softcap = None
    else:  # every layer on the global rotary
        for layer in lm.model.layers:
            layer.rotary = 0 if layer.window is None else 1 - layer.rotary
    assert _run_and_compare(lm, hf, block_size=4) > 1e-2


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(MAX_NEW):
            tok = int(out.logits[0, -1].argmax())
            tokens.append(tok)
            out = hf(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_with_prefix_cache_chunked_prefill_and_preemption(family, greedy, backend, monkeypatch):
    arch, path, _ = family
    prompts, expected = greedy

    seen: list[object] = []

    def spy_on(name: str) -> None:  # the ordinary forward's decode kernel, and the lean step's fused one
        real = getattr(_core, name)

        def spy(*args, **kwargs):
            seen.append(kwargs.get("softcap"))
            return real(*args, **kwargs)

        monkeypatch.setattr(_core, name, spy)

    spy_on("paged_decode_attention")
    spy_on("decode_attention_qkv")
    # 15 blocks of 4 for five sequences of up to 40 tokens: preemption; batches of 8 tokens: chunked prefill
    llm = LLM(str(path), attention_backend=backend, dtype="float32", num_kv_blocks=15, block_size=4,
              max_num_batched_tokens=8, max_num_seqs=4, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    stats = llm.get_metrics()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert llm.engine.stats()["blocks_used"] == 0
    if backend == "cpu":  # decode rows went through the core's kernel, capped where the family caps
        assert set(seen) == ({1.5} if arch == "gemma2" else {None})  # Gemma 2 caps every layer
    else:
        assert not seen


def test_gguf_from_llama_cpp_converter(tmp_path, monkeypatch):
    """Gemma 3 through llama.cpp's own converter (f32): the file's norms hold 1 + w already, its local layers
    name their RoPE base (rope.freq_base_swa), the 5:1 pattern is llama.cpp's; ironlm's greedy tokens equal the HF
    folder's through prefix caching + chunked prefill + preemption. The GGUF keeps no query_pre_attn_scalar
    (llama.cpp scales by head_dim ** -0.5), so the source model uses head_dim."""
    from family_parity import check_engine_greedy, hf_greedy, shared_prefix_prompts
    from gguf_convert import convert

    monkeypatch.setenv("IRONLM_CACHE_DIR", str(tmp_path / "cache"))  # the GGUF tokenizer cache
    hf_dir = make_tiny_model(tmp_path, arch="gemma3_text", num_hidden_layers=6, sliding_window=WINDOW,
                             query_pre_attn_scalar=64, tie_word_embeddings=True)
    path = convert(hf_dir, tmp_path / "gguf", "f32")
    cfg = load_model(path, dtype=torch.float32, device="cpu").config
    assert (cfg.architecture, cfg.source, cfg.norm_offset, cfg.qk_norm) == ("gemma3_text", "gguf", 0.0, True)
    assert cfg.layer_windows == [WINDOW] * 5 + [None]
    assert cfg.local_rope is not None and cfg.local_rope["rope_theta"] == 10000.0 and cfg.rope_theta == 1e6
    prompts = shared_prefix_prompts(cfg.vocab_size)
    expected = [t for t, _ in hf_greedy(hf_dir, prompts, max_new=8)]
    check_engine_greedy(path, prompts, expected, backend="cpu", max_new=8)


def _sentencepiece_folder(hf_dir: Path, vocab_size: int) -> None:
    """Swap the folder's byte-level BPE for a SentencePiece BPE tokenizer.model shaped like Gemma's (byte fallback,
    identity normalizer, no dummy prefix, <pad> <bos> <eos> <unk> <mask> first), trained in memory on a small text
    (tens of ms), plus the GemmaTokenizer transformers builds from it."""
    import sentencepiece as spm
    from transformers import GemmaTokenizer

    rng = np.random.default_rng(0)
    words = ["gemma", "local", "global", "window", "token", "cache", "block", "prefix", "layer", "norm", "soft",
             "cap", "rotary", "head", "the", "of", "a", "to", "in"]
    text = (" ".join(rng.choice(words, size=12)) for _ in range(200))
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=text, model_writer=proto, vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=3, pad_piece="<pad>", bos_piece="<bos>",
        eos_piece="<eos>", unk_piece="<unk>", user_defined_symbols=["<mask>"], minloglevel=2)
    for f in hf_dir.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    (hf_dir / "tokenizer.model").write_bytes(proto.getvalue())
    tok = GemmaTokenizer.from_pretrained(str(hf_dir), add_bos_token=True)  # as Gemma's own tokenizer_config
    assert len(tok) == vocab_size and (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    tok.save_pretrained(str(hf_dir))


def test_gemma2_gguf_from_llama_cpp_converter(tmp_path, monkeypatch):
    """Gemma 2 through llama.cpp's converter (f32), from a tiny SentencePiece tokenizer.model (its converter reads
    no other tokenizer): norms stored as 1 + w, both soft-caps and the window read from the file, every other layer
    local as llama.cpp's swa pattern; greedy tokens equal the HF folder's (eager, the attention that soft-caps)
    through prefix caching + chunked prefill + preemption. The converter drops lm_head: Gemma 2 ties it."""
    from family_parity import check_engine_greedy, shared_prefix_prompts
    from gguf_convert import convert

    monkeypatch.setenv("IRONLM_CACHE_DIR", str(tmp_path / "cache"))  # the GGUF tokenizer cache
    vocab = 320
    feats = {**FEATURES["gemma2"], "query_pre_attn_scalar": 64, "tie_word_embeddings": True}
    feats.pop("layer_types")  # transformers' own alternation, local first
    hf_dir = make_tiny_model(tmp_path, arch="gemma2", num_hidden_layers=4, vocab_size=vocab, **feats)
    _sentencepiece_folder(hf_dir, vocab)
    path = convert(hf_dir, tmp_path / "gguf", "f32")
    cfg = load_model(path, dtype=torch.float32, device="cpu").config
    assert (cfg.architecture, cfg.source, cfg.norm_offset, cfg.vocab_size) == ("gemma2", "gguf", 0.0, vocab)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.layer_windows) == (1.5, 10.0, [WINDOW, None] * 2)
    text = "the soft cap of a local window: é, 漢"  # pieces, spaces kept, byte fallback for unseen characters
    assert load_gguf_tokenizer(path)(text).input_ids == AutoTokenizer.from_pretrained(str(hf_dir))(text).input_ids
    prompts = shared_prefix_prompts(vocab)
    hf = _reference(hf_dir)
    check_engine_greedy(path, prompts, [_hf_greedy(hf, p) for p in prompts], backend="cpu", max_new=MAX_NEW)
