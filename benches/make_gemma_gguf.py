"""A random-weight Gemma-3-270M-shaped GGUF, made by llama.cpp's own converter, for the llama.cpp baseline bench.

    python benches/make_gemma_gguf.py [--out bench_out/gemma3-270m-random] [--outtype q8_0] [--layers 18]

Geometry is google/gemma-3-270m's config.json: hidden 640, intermediate 2048, 18 layers, 4 heads, 1 KV head,
head_dim 256, vocab 262144, sliding_window 512 with five local layers per global one, query_pre_attn_scalar 256,
rope_theta 1e6 (global) / 1e4 (local), rms_norm_eps 1e-6, GELU-tanh, tied embeddings, no soft-capping.
The weights are random (no hub here): the speed of a decode step does not depend on their values.

The converter trims token_embd to the tokenizer's size, so the tokenizer must really hold 262144 ids: a byte-level
BPE over the 256 byte symbols, all 65536 two-byte merges and three-byte merges up to the vocabulary size.
Q4_0 is made by llama-quantize (a C++ binary of the llama.cpp build) when it is there; the converter writes
f32/f16/bf16/q8_0 only.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 262144
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's ids 0..3


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what ByteLevel pre-tokenization emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def make_tokenizer(out: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    syms = _byte_symbols()
    tokens = [*SPECIALS, *syms]
    merges: list[tuple[str, str]] = []
    pairs = itertools.chain(itertools.product(syms, syms),
                            ((a + b, c) for a, b, c in itertools.product(syms, syms, syms)))
    for left, right in pairs:
        if len(tokens) >= vocab_size:
            break
        tokens.append(left + right)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(out))


def make_hf(out: Path, layers: int, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=640, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        tie_word_embeddings=True, final_logit_softcapping=None, attn_logit_softcapping=None,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


def quantize(src: Path, dst: Path, qtype: str = "Q4_0") -> Path | None:
    """llama-quantize src -> dst, or None when the build has no llama-quantize."""
    from ironlm.bench.llama_cpp import find_binary
    from ironlm.exceptions import LlamaCppNotBuilt

    try:
        binary = find_binary("llama-quantize")
    except LlamaCppNotBuilt:
        return None
    subprocess.run([str(binary), str(src), str(dst), qtype, "2"], check=True)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "gemma3-270m-random")
    ap.add_argument("--outtype", default="q8_0", help="the converter's type: f32, f16, bf16, q8_0")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--q4", action="store_true", help="also llama-quantize the file to Q4_0 (needs the binary)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_convert import convert_many  # type: ignore[import-not-found]  # tests/ is not a package

    hf = args.out / "hf"
    if not (hf / "model.safetensors").is_file():
        make_hf(hf, args.layers)
    types = [args.outtype, *(["bf16"] if args.q4 and args.outtype != "bf16" else [])]
    files = convert_many([(hf, t) for t in types], args.out, "gpt-2", [f"gemma3-270m.{t.upper()}.gguf" for t in types])
    print(*files, sep="\n")
    if args.q4:  # from bf16: llama-quantize refuses to requantize Q8_0 without --allow-requantize
        q4 = quantize(files[-1], args.out / "gemma3-270m.Q4_0.gguf")
        print(q4 if q4 else "no llama-quantize binary: Q4_0 not made")


if __name__ == "__main__":
    main()
