"""gpt-oss's MXFP4 experts kept at 4 bits (the core's mxfp4 blocks, `quantization auto`) against the same GGUF
dequantized at load (`quantization none`: dense f32 torch, what `auto` did with such a file before) and against
`quantization int8` (the dequantized weights re-quantized to int8 per channel: the same core kernels, so the
experts' 4.25 vs 8 bits is the only difference besides int8 vs int8-per-32 attention): single-stream decode tok/s,
alternated in one process, and the expert bytes a decode token reads.

    python benches/bench_mxfp4.py [--layers 4] [--hidden 1024] [--experts 32] [--top-k 4] [--rounds 3] [--gen 32]

The model: a random HF gpt-oss (transformers' GptOssConfig; gpt-oss-20b's shape scaled down: head_dim 64, 4 kv
heads, 32 experts top-4, 128-token windows on every other layer), its experts written as a released checkpoint
stores them (`*_blocks` / `*_scales`, quantization_config mxfp4), converted by llama.cpp's own converter (f32
outtype: the experts stay MXFP4, the rest f32). Files go to --out, made once. Printed: decode tok/s of each variant
per round, the median ratio, the expert bytes a decode token reads (top_k experts a layer), the resident expert
bytes, and the machine's busy fraction over each timed run (/proc/stat: other processes' load shows there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ironlm.bench.report import cpu_jiffies

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_gemma_gguf import make_tokenizer  # benches/ is not a package: found through sys.path

_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] floats -> blocks [E, out, in/32, 16] (element 2j in byte j's low nibble), E8M0 scales."""
    b = w.reshape(*w.shape[:-1], -1, 32)
    e = (torch.floor(torch.log2(b.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100))) - 2).clamp(-127, 127)
    codes = torch.empty(b.shape, dtype=torch.uint8)
    for i in range(b.shape[0]):  # one expert at a time: the [.., 16] distance tensor of all would not fit
        codes[i] = (b[i] / 2.0 ** e[i]).unsqueeze(-1).sub(_FP4).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e.squeeze(-1) + 127).to(torch.uint8)


def make_hf(out: Path, args: argparse.Namespace) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=4, head_dim=64, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, sliding_window=128, max_position_embeddings=4096,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)],
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(str(out))
    sd = load_file(str(out / "model.safetensors"))
    new = {}
    for k, v in sd.items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            new[k + "_blocks"], new[k + "_scales"] = to_mxfp4(v.transpose(1, 2).float())
        else:
            new[k] = v
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((out / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(c))
    make_tokenizer(out, args.vocab)
    return out


def expert_bytes(llm: Any) -> tuple[int, int]:
    """(bytes of one layer's one expert, as resident; all experts' resident bytes)."""
    per, total = 0, 0
    for layer in llm.engine.runner.model.layers:
        moe = layer.moe
        if moe.gate_up_weight.numel():  # dense: [E, hidden, 2I] and [E, I, hidden] tensors
            e = moe.gate_up_weight.shape[0]
            size = (moe.gate_up_weight.nbytes + moe.down_weight.nbytes)
            per, total = size // e, total + size
        else:
            sizes = [m.gate_up.nbytes + m.down.nbytes for m in moe.experts]
            per, total = sizes[0], total + sum(sizes)
    return per, total


def decode_tok_s(llm: Any, rng: torch.Generator, args: argparse.Namespace) -> tuple[float, float]:
    """Decode tok/s from two generations on fresh random prompts (1 and 1 + gen tokens), and the busy fraction."""
    from ironlm import SamplingParams

    def run(n: int) -> float:
        prompt = torch.randint(10, args.vocab, (args.prompt,), generator=rng).tolist()
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        return time.perf_counter() - t0

    b0, t0 = cpu_jiffies()
    one, full = run(1), run(1 + args.gen)
    b1, t1 = cpu_jiffies()
    return args.gen / max(full - one, 1e-9), (b1 - b0) / max(1, t1 - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "gpt-oss-mxfp4-random")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="auto,none,int8", help="quantization values; the first is the kept one")
    args = ap.parse_args(argv)
    from ironlm import LLM
    from ironlm.bench.report import cpu_model

    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_convert import convert_many  # type: ignore[import-not-found]  # tests/ is not a package

    gguf = args.out / "gpt-oss-random.MXFP4.gguf"
    if not gguf.is_file():
        hf = args.out / "hf"
        if hf.exists():
            shutil.rmtree(hf)
        make_hf(hf, args)
        convert_many([(hf, "f32")], args.out, "gpt-2", [gguf.name])
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    llms = {q: LLM(str(gguf), dtype="float32", device="cpu", quantization=q, seed=0) for q in variants}
    rng = torch.Generator().manual_seed(0)
    rows: dict[str, list[tuple[float, float]]] = {q: [] for q in llms}
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for q in order:
            rows[q].append(decode_tok_s(llms[q], rng, args))
            print(f"round {r} {q}: {rows[q][-1][0]:.2f} tok/s (machine busy {rows[q][-1][1]:.0%})", flush=True)
    med = {q: statistics.median(v for v, _ in rows[q]) for q in rows}
    sizes = {q: expert_bytes(llms[q]) for q in llms}
    print(f"CPU: {cpu_model()}")
    for q in llms:
        per, total = sizes[q]
        print(f"{q}: decode {med[q]:.2f} tok/s (median of {args.rounds}); experts read a token: "
              f"{args.layers * args.top_k * per / 1e6:.1f} MB; resident expert bytes {total / 1e6:.1f} MB")
    kept = variants[0]
    for q in variants[1:]:
        ratios = [a[0] / b[0] for a, b in zip(rows[kept], rows[q])]
        print(f"{kept} / {q} decode: {statistics.median(ratios):.2f}x (per round: "
              f"{', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
