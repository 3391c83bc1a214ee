"""Tiny random-weight models for tests, built offline (no hub).

    make_tiny_model(tmp_path, arch="llama", **overrides) -> Path   # an HF folder: config, safetensors, tokenizer
    make_tiny_tokenizer() -> PreTrainedTokenizerFast               # byte-level BPE + ChatML chat template
    make_tiny_gguf(tmp_path, hf_dir, qtype="F32") -> Path          # the same model as a llama.cpp GGUF file
    build_metadata(...)                                            # AttentionMetadata for a flat token batch
    TINY_VARIANTS                                                  # named configs covering the model features

Archs: llama, mistral, qwen2 (q/k/v bias), qwen3 (q/k norm), gemma2, gemma3_text. Overrides are HF config fields
(hidden_size, num_attention_heads, num_key_value_heads, head_dim, tie_word_embeddings, rope_parameters, ...) plus:
    seed (0)                 torch seed for the random weights
    max_shard_size (None)    e.g. "100KB": save sharded safetensors with model.safetensors.index.json
    perturb (True)           random norm weights / biases (HF initialises them to 1 / 0, which hides loading bugs)
    add_bos (llama/mistral)  tokenizer prepends <s>
    eos_token_ids            generation_config eos ids (default [</s>, <|im_end|>])

The tokenizer is byte-level BPE (any text, multi-byte characters split across tokens) whose vocabulary is
exactly the model's vocab_size, so every id a random model samples decodes.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

# <|endoftext|> is in the vocabulary because transformers loads qwen2/qwen3 folders with Qwen2Tokenizer, which
# adds it (as unk) when missing: the tokenizer would then be one id larger than the model's vocab.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, ENDOFTEXT_ID = range(6)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MERGE_WORDS = ["the", "and", "ing", "ion", "hello", "world", "token", "model", "is", "of", "to", "in", "a",
                "er", "on", "at", "en", "or", "es", "re"]

# Named configurations covering the features the decoder must get right (used by the model tests; reusable).
TINY_VARIANTS: dict[str, dict[str, Any]] = {
    # GQA 2, head_dim 64, untied
    "llama": {"arch": "llama"},
    # GQA 4, head_dim 128 (q_size != hidden), tied, llama3 rope scaling, sharded safetensors
    "llama3_tied_hd128_sharded": {
        "arch": "llama", "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "tie_word_embeddings": True, "max_shard_size": "300KB",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
    # MQA (GQA 4 with one KV head), head_dim 64
    "mistral_mqa": {"arch": "mistral", "num_key_value_heads": 1},
    # q/k/v bias, tied, GQA 2
    "qwen2_bias_tied": {"arch": "qwen2", "tie_word_embeddings": True},
    # q/k norm, head_dim 128, GQA 2, untied
    "qwen3_hd128": {"arch": "qwen3"},
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def tiny_vocab() -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens in id order, merges): specials, the 256 byte symbols, then tokens built by a few merges."""
    b2u = _bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [b2u[b] for b in range(256)]
    have = set(tokens)
    merges: list[tuple[str, str]] = []
    space = b2u[ord(" ")]
    for word in _MERGE_WORDS:
        for prefix in ("", space):
            cur = prefix + word[0] if prefix else word[0]
            if prefix and cur not in have:
                merges.append((space, word[0]))
                tokens.append(cur)
                have.add(cur)
            for ch in word[1:]:
                nxt = cur + ch
                if nxt not in have:
                    merges.append((cur, ch))
                    tokens.append(nxt)
                    have.add(nxt)
                cur = nxt
    return tokens, merges


def make_tiny_tokenizer(add_bos: bool = True) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens, merges = tiny_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None},
    "qwen2": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen3": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128},
    "gemma2": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
               "tie_word_embeddings": True},
    "gemma3_text": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                    "tie_word_embeddings": True,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
}


def tiny_hf_config(arch: str = "llama", **overrides: Any) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
               "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig}
    if arch not in classes:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(classes)}")
    vocab_size = len(tiny_vocab()[0])
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size, "intermediate_size": 384, "num_hidden_layers": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "initializer_range": 0.08,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    kwargs.update(_ARCH_DEFAULTS[arch])
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def perturb_norms_and_biases(model: Any, seed: int) -> None:
    """Norm weights around 1 and biases around 0, drawn from `seed` (HF initialises them to exactly 1 and 0, which
    hides loading bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif pname.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def save_random_model(tmp_path: str | Path, name: str, config: Any, seed: int,
                      tweak: Any = None) -> Path:
    """Build `config`'s model with seed `seed`, perturb its norms and biases (seed + 1), let `tweak(model, g)`
    redraw what the family needs from a generator seeded seed + 2 (routers, sinks, buffers), and save it with the
    tiny tokenizer and greedy generation config as tmp_path / name."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model, seed + 1)
    if tweak is not None:
        with torch.no_grad():
            tweak(model, torch.Generator().manual_seed(seed + 2))
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID],
                                               pad_token_id=PAD_ID, do_sample=False)
    out = Path(tmp_path) / name
    model.save_pretrained(str(out))
    make_tiny_tokenizer(add_bos=False).save_pretrained(str(out))
    return out


def make_tiny_model(tmp_path: str | Path, arch: str = "llama", **overrides: Any) -> Path:
    """Build, randomise and save a tiny HF model folder (config.json, generation_config.json, safetensors,
    tokenizer with chat template). Returns the folder (tmp_path / name, name defaults to f"tiny-{arch}")."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    seed = overrides.pop("seed", 0)
    max_shard_size = overrides.pop("max_shard_size", None)
    perturb = overrides.pop("perturb", True)
    add_bos = overrides.pop("add_bos", arch in ("llama", "mistral"))
    eos_ids = overrides.pop("eos_token_ids", [EOS_ID, IM_END_ID])
    name = overrides.pop("name", f"tiny-{arch}")
    dtype = overrides.pop("dtype", torch.float32)
    config = tiny_hf_config(arch, **overrides)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if perturb:
        perturb_norms_and_biases(model, seed + 1)
    model = model.to(dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=eos_ids, pad_token_id=PAD_ID, do_sample=False
    )
    out = Path(tmp_path) / name
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **save_kwargs)
    make_tiny_tokenizer(add_bos=add_bos).save_pretrained(str(out))
    return out


def load_hf_reference(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


# ---- GGUF ---------------------------------------------------------------------------------------------------
def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def make_tiny_gguf(tmp_path: str | Path, hf_dir: str | Path, qtype: str = "F32", name: str | None = None) -> Path:
    """Write the HF model in `hf_dir` as a GGUF file, the way llama.cpp's converter does (Q/K permuted for
    llama/mistral). 2-D weights whose rows are a multiple of 32 get `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1);
    norms and biases stay F32. Includes the tokenizer metadata, so transformers can load config and tokenizer."""
    import gguf
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = cfg["model_type"]
    gguf_arch = "llama" if arch == "mistral" else arch
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    state: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))

    qt = gguf.GGMLQuantizationType[qtype]
    path = Path(tmp_path) / (name or f"{hf_dir.name}.{qtype}.gguf")
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name(f"{hf_dir.name}{' mistral' if arch == 'mistral' else ''}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if gguf_arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(int(qt) if qt != gguf.GGMLQuantizationType.F32 else 0)

    tokens, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(gguf_arch == "llama")
    w.add_chat_template(CHAT_TEMPLATE)

    def put(gname: str, t: torch.Tensor) -> None:
        a = t.float().numpy()
        if a.ndim == 2 and a.shape[1] % 32 == 0 and qt not in (gguf.GGMLQuantizationType.F32,):
            if qt == gguf.GGMLQuantizationType.F16:
                w.add_tensor(gname, a.astype(np.float16))
            else:
                w.add_tensor(gname, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, a.astype(np.float32))

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state and not cfg.get("tie_word_embeddings", False):
        put("output.weight", state["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf_suffix, g_suffix in _GGUF_NAMES.items():
            key = f"model.layers.{i}.{hf_suffix}"
            if key not in state:
                continue
            t = state[key]
            if gguf_arch == "llama" and hf_suffix.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                n = heads if "q_proj" in hf_suffix else kv_heads
                t = torch.from_numpy(_llama_cpp_permute(t.numpy(), n))
            put(f"blk.{i}.{g_suffix}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- attention metadata for hand-built steps ----------------------------------------------------------------
class PagedSequences:
    """Hand-rolled paged KV bookkeeping for tests: each sequence owns randomly chosen (shuffled) blocks.

    step(chunks) takes {seq_index: new_token_ids} and returns (input_ids, positions, meta, last_row_indices) for
    one flat batch, advancing each sequence's cached length.
    """

    def __init__(self, num_seqs: int, block_size: int, num_blocks: int, max_blocks_per_seq: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        ids = rng.permutation(np.arange(1, num_blocks))  # block 0 stays unused (a null block, as in vLLM)
        need = num_seqs * max_blocks_per_seq
        if need > len(ids):
            raise ValueError(f"need {need} blocks, only {len(ids)} available")
        self.block_size = block_size
        self.block_tables = ids[:need].reshape(num_seqs, max_blocks_per_seq).astype(np.int32)
        self.lens = np.zeros(num_seqs, dtype=np.int64)

    def step(self, chunks: dict[int, list[int]], device: str | torch.device = "cpu"):
        from ironlm.attention import AttentionMetadata

        seqs = list(chunks)
        qlens = np.array([len(chunks[s]) for s in seqs], dtype=np.int64)
        ctx = self.lens[seqs]
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, qlens)])
        owner = np.repeat(np.arange(len(seqs)), qlens)
        bt = self.block_tables[seqs]
        bs = self.block_size
        slots = bt[owner, positions // bs].astype(np.int64) * bs + positions % bs
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        meta = AttentionMetadata.from_numpy(
            slot_mapping=slots, query_start_loc=qsl, seq_lens=ctx + qlens, context_lens=ctx,
            block_tables=bt, device=device,
        )
        self.lens[seqs] += qlens
        input_ids = torch.tensor(np.concatenate([chunks[s] for s in seqs]), dtype=torch.long, device=device)
        pos = torch.from_numpy(positions).to(device)
        last = torch.from_numpy(qsl[1:] - 1).to(device)
        return input_ids, pos, meta, last


def make_kv_caches(config: Any, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = config.kv_cache_shape(num_blocks, block_size)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]


def load_hf_gguf_reference(gguf_path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own GGUF loading (`from_pretrained(dir, gguf_file=...)`), the oracle for GGUF models.

    The built-in default model's fp32 reference is loaded once per test process (~10 s on 2 cores, and three
    modules compare against it): callers only run it, never change it.
    """
    from ironlm.exceptions import DefaultModelNotInstalled
    from ironlm.model.default import default_model_path

    try:
        default = default_model_path().resolve()
    except DefaultModelNotInstalled:
        default = None
    if dtype == torch.float32 and Path(gguf_path).resolve() == default:
        return _default_hf_reference()
    return _load_hf_gguf(gguf_path, dtype)


@lru_cache(maxsize=1)
def _default_hf_reference() -> Any:
    from ironlm.model.default import default_model_path

    return _load_hf_gguf(default_model_path(), torch.float32)


def _load_hf_gguf(gguf_path: str | Path, dtype: torch.dtype) -> Any:
    """transformers' `from_pretrained(dir, gguf_file=...)`.

    Two test-only shims, neither of which changes the loaded weights: transformers refuses GGUF without the
    `accelerate` package (which it does not need for CPU loading, and which ironlm does not install), and it
    rebuilds gguf's tensor-name table once per module (~10 s for SmolLM2 on 2 cores): that pure function is
    memoised while loading.
    """
    import functools

    import gguf
    from transformers import AutoModelForCausalLM, modeling_utils

    gguf_path = Path(gguf_path)
    saved_check = modeling_utils.is_accelerate_available
    saved_map = gguf.get_tensor_name_map
    modeling_utils.is_accelerate_available = lambda *a, **k: True
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved_map)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
    finally:
        modeling_utils.is_accelerate_available = saved_check
        gguf.get_tensor_name_map = saved_map
    return model.eval()
