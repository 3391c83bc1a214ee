"""Perplexity per weight mode: the accuracy gate for quantized and bf16 execution (`ironlm bench perplexity`).

Token logprobs are teacher-forced through the real model and the paged KV cache, chunk by chunk: each chunk's
tokens attend to every earlier token through the cache, as a long prefill split by the scheduler does, so the
figure measures the code path that serves requests. perplexity = exp(-mean logprob).

Two protocols, both on the same token ids:
- `full`: one sequence over the whole text, every token after the first scored (the main figure).
- `windows`: llama.cpp's `llama-perplexity` protocol (non-overlapping windows of `ctx` tokens, the first token
  of each replaced by BOS, only the second half of each window scored), so its figure on the same text and GGUF
  compares directly.

The text (benches/data/ppl_text.txt) was generated once by the fp32 model from fixed prompts (`generate_text`) and
is committed, so the gate needs nothing online and no re-generation.
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ironlm.bench.report import format_table, machine_info
from ironlm.engine.kv_cache import allocate_kv_caches, quantized_auto, resolve_kv_dtype
from ironlm.exceptions import PerplexityArgumentError

if TYPE_CHECKING:
    from ironlm.model import LoadedModel

TEXT_PATH = Path(__file__).resolve().parents[3] / "benches" / "data" / "ppl_text.txt"
# mode name -> (load_model quantization, dtype, group size); `none` is the fp32 reference every mode is
# measured against, `bf16` is the same dense weights in bfloat16.
MODES: dict[str, tuple[str, str, int | None]] = {
    "none": ("none", "float32", None),
    "auto": ("auto", "auto", None),
    "int8": ("int8", "auto", None),
    "int4": ("int4", "auto", 32),
    "bf16": ("none", "bfloat16", None),
}
DEFAULT_MODES = tuple(MODES)
BASELINES = ("llama.cpp",)

GEN_PROMPTS = (
    "Write a long essay about the history of lighthouses and the people who kept them.",
    "Explain in detail how bread is made, from growing wheat to baking the loaf.",
    "Tell a long story about a young astronomer who discovers a new comet.",
    "Describe the water cycle and how rivers shape the land over thousands of years.",
    "Write a detailed guide to planning a vegetable garden for a small family.",
    "Explain how a steam engine works and why it changed the world.",
)


def parse_modes(value: str | Sequence[str]) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in (value.split(",") if isinstance(value, str) else value) if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise PerplexityArgumentError(f"modes: expected a comma list of {', '.join(MODES)}, got {value!r}", "modes")
    return modes


def load(model: str | Path | None, mode: str) -> LoadedModel:
    """The model in one mode, on the CPU with the CPU attention backend (the paged path the engine runs)."""
    from ironlm.attention import get_backend
    from ironlm.model import load_model

    quantization, dtype, group = MODES[parse_modes([mode])[0]]
    return load_model(model, dtype=dtype, device="cpu", attn_backend=get_backend("auto", "cpu"),
                      quantization=quantization, quantization_group_size=group)


def text_token_ids(tokenizer: Any, text: str | None = None) -> list[int]:
    """The text's token ids without special tokens (the scorers add BOS where their protocol wants one)."""
    if text is None:
        text = TEXT_PATH.read_text(encoding="utf-8")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def added_bos(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer puts in front of a text, None when it adds none (SmolLM2's GGUF says
    add_bos_token = false): llama-perplexity replaces a window's first token with BOS under the same rule."""
    with_special = list(tokenizer("a")["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if bos is not None and len(with_special) > len(plain) and with_special[0] == bos else None


def served_kv_dtype(loaded: LoadedModel) -> torch.dtype:
    """The KV cache type the engine serves a mode's model with under kv_cache_dtype auto (the quantized modes load
    with dtype auto, the others keep their dtype's cache; see engine.kv_cache.resolve_kv_dtype)."""
    model = loaded.model
    return resolve_kv_dtype("auto", model.dtype, torch.device("cpu"), quantized_auto("auto", model))


def token_logprobs(loaded: LoadedModel, tokens: Sequence[int], *, chunk_size: int = 512,
                   block_size: int = 16, kv_dtype: torch.dtype | None = None) -> np.ndarray:
    """logprob of tokens[i] given tokens[:i], for i = 1..n-1 (float64 [n-1]), through the paged KV cache.

    The sequence owns blocks 0.. of its own cache; chunk k writes its KV rows and attends to the cached rows of
    chunks 0..k-1, logits for every position of the chunk. The cache's type is `kv_dtype`, by default the one the
    engine gives this model under kv_cache_dtype auto (a 16-bit cache over quantized weights: see
    engine.kv_cache.resolve_kv_dtype), so a mode's perplexity is what it serves.
    """
    from ironlm.attention import AttentionMetadata

    n = len(tokens)
    if n < 2:
        raise PerplexityArgumentError(f"tokens: need at least 2 tokens, got {n}", "tokens")
    if chunk_size < 1:
        raise PerplexityArgumentError(f"chunk_size must be >= 1, got {chunk_size}", "chunk_size")
    model = loaded.model
    nblocks = -(-n // block_size)
    if kv_dtype is None:
        kv_dtype = served_kv_dtype(loaded)
    caches = allocate_kv_caches(loaded.config, nblocks, block_size, kv_dtype, torch.device("cpu"))
    block_table = np.arange(nblocks, dtype=np.int32)[None, :]
    ids = torch.tensor(list(tokens), dtype=torch.long)
    out = np.empty(n - 1, dtype=np.float64)
    with torch.inference_mode():
        for start in range(0, n - 1, chunk_size):  # the last token is only ever a target
            end = min(start + chunk_size, n - 1)
            q = end - start
            meta = AttentionMetadata.from_numpy(
                slot_mapping=np.arange(start, end, dtype=np.int64), query_start_loc=np.array([0, q]),
                seq_lens=np.array([end]), context_lens=np.array([start]), block_tables=block_table,
                max_query_len=q, max_seq_len=end)
            logits = model(ids[start:end], torch.arange(start, end), caches, meta, torch.arange(q))
            logp = torch.log_softmax(logits.double(), dim=-1)
            out[start:end] = logp.gather(1, ids[start + 1:end + 1, None]).squeeze(1).numpy()
    return out


def hf_token_logprobs(hf_model: Any, tokens: Sequence[int]) -> np.ndarray:
    """The same logprobs through a transformers model (one forward over the whole sequence)."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, :-1]
        logp = torch.log_softmax(logits.double(), dim=-1)
        return logp.gather(1, ids[0, 1:, None]).squeeze(1).numpy()


def perplexity(logprobs: np.ndarray) -> float:
    return float(math.exp(-float(np.mean(logprobs))))


def window_logprobs(score: Callable[[Sequence[int]], np.ndarray], tokens: Sequence[int], ctx: int,
                    bos: int | None) -> np.ndarray:
    """llama-perplexity's protocol: windows tokens[k*ctx:(k+1)*ctx] (whole windows only), the first token set
    to `bos` unless None (see added_bos), the targets of positions ctx/2 .. ctx-1 scored. `score` is a full-sequence
    scorer (token_logprobs / hf_token_logprobs bound to a model)."""
    windows = len(tokens) // ctx
    if windows < 1 or ctx < 2:
        raise PerplexityArgumentError(f"ctx: {len(tokens)} tokens hold no window of {ctx} tokens", "ctx")
    first = ctx // 2
    parts = []
    for k in range(windows):
        window = list(tokens[k * ctx:(k + 1) * ctx])
        if bos is not None:
            window[0] = bos
        # logprobs[i] scores window[i + 1] from window[:i + 1]; llama.cpp scores logits first..ctx-2
        parts.append(score(window)[first:ctx - 1])
    return np.concatenate(parts)


@dataclass
class PerplexityConfig:
    model: str | None = None
    modes: tuple[str, ...] = DEFAULT_MODES
    max_tokens: int | None = None  # a prefix of the text; None = all of it
    chunk_size: int = 512
    window: int = 512  # llama-perplexity's -c
    threads: int | None = None
    baseline: str | None = None
    text_path: Path = field(default_factory=lambda: TEXT_PATH)


def run(config: PerplexityConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every mode's perplexity (both protocols) and weight bytes, relative to `none`; + llama.cpp's figure."""
    modes = parse_modes(config.modes)
    if config.baseline not in (None, *BASELINES):
        raise PerplexityArgumentError(f"baseline: expected one of {', '.join(BASELINES)}, got {config.baseline!r}",
                                      "baseline")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    say = log or (lambda s: print(s, file=sys.stderr))
    text = Path(config.text_path).read_text(encoding="utf-8")
    results: list[dict[str, Any]] = []
    tokens: list[int] = []
    model_info: dict[str, Any] = {}
    for mode in ("none", *[m for m in modes if m != "none"]):  # the reference first
        t0 = time.perf_counter()
        loaded = load(config.model, mode)
        if not tokens:
            tokens = text_token_ids(loaded.tokenizer, text)[:config.max_tokens]
            model_info = {"name": loaded.name, "path": loaded.path, "windows_bos": added_bos(loaded.tokenizer)}
        full = token_logprobs(loaded, tokens, chunk_size=config.chunk_size)
        win = window_logprobs(functools.partial(token_logprobs, loaded, chunk_size=config.chunk_size), tokens,
                              config.window, added_bos(loaded.tokenizer))
        results.append({"mode": mode, "dtype": str(loaded.model.dtype).removeprefix("torch."),
                        "kv_cache_dtype": str(served_kv_dtype(loaded)).removeprefix("torch."),
                        "quantization": MODES[mode][0], "group_size": MODES[mode][2],
                        "ppl": perplexity(full), "ppl_windows": perplexity(win), "scored_tokens": len(full),
                        "scored_tokens_windows": len(win), "weight_bytes": int(loaded.model.weight_bytes()),
                        "seconds": time.perf_counter() - t0})
        say(f"{mode}: ppl {results[-1]['ppl']:.4f} (windows {results[-1]['ppl_windows']:.4f})")
        del loaded
    ref = results[0]
    for r in results:
        r["ppl_rel"] = r["ppl"] / ref["ppl"] - 1.0
        r["ppl_windows_rel"] = r["ppl_windows"] / ref["ppl_windows"] - 1.0
        r["weight_bytes_rel"] = r["weight_bytes"] / ref["weight_bytes"]
    results = [r for r in results if r["mode"] in modes]
    baseline = None
    if config.baseline == "llama.cpp":
        baseline = llama_cpp_perplexity(config.model, text, ctx=config.window, threads=config.threads)
        baseline["ppl_windows_rel"] = baseline["ppl_windows"] / ref["ppl_windows"] - 1.0
        say(f"llama.cpp: ppl {baseline['ppl_windows']:.4f}")
    return {"benchmark": "perplexity", "machine": machine_info("cpu"), "model": model_info,
            "config": {"modes": list(modes), "text": str(config.text_path), "text_tokens": len(tokens),
                       "chunk_size": config.chunk_size, "window": config.window, "threads": torch.get_num_threads(),
                       "reference": "none (fp32, dequantized weights)"},
            "results": results, "baseline": baseline}


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llama_cpp_command(binary: str | Path, gguf: str | Path, text_file: str | Path, *, ctx: int,
                      threads: int, chunks: int | None = None) -> list[str]:
    """`chunks`: score only the first N windows (llama-perplexity's --chunks), e.g. to match a token slice."""
    cmd = [str(binary), "--model", str(gguf), "--file", str(text_file), "--ctx-size", str(ctx),
           "--batch-size", str(ctx), "--threads", str(threads), "--threads-batch", str(threads)]
    return cmd + (["--chunks", str(chunks)] if chunks is not None else [])


def parse_llama_cpp_output(output: str) -> tuple[float, float]:
    """(ppl, its +/-) from llama-perplexity's log; raises RuntimeError when it printed no final estimate."""
    m = _FINAL.search(output)
    if m is None:
        raise RuntimeError("llama-perplexity printed no 'Final estimate'; its output ended with:\n" + output[-2000:])
    return float(m.group(1)), float(m.group(2))


def llama_cpp_perplexity(model: str | Path | None, text: str, *, ctx: int, threads: int | None,
                         chunks: int | None = None) -> dict[str, Any]:
    """llama.cpp's `llama-perplexity` on the same text and GGUF (its own tokenizer, its windows protocol)."""
    import tempfile

    from ironlm.bench.llama_cpp import binary_version, find_binary, gguf_path

    binary = find_binary("llama-perplexity")
    gguf = gguf_path(model)
    threads = threads or torch.get_num_threads()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        cmd = llama_cpp_command(binary, gguf, f.name, ctx=ctx, threads=threads, chunks=chunks)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"llama-perplexity exited with {proc.returncode}:\n{output[-2000:]}")
    ppl, err = parse_llama_cpp_output(output)
    windows = re.search(r"calculating perplexity over (\d+) chunks", output)
    return {"engine": "llama.cpp", "ppl_windows": ppl, "ppl_windows_err": err, "binary": str(binary),
            "version": binary_version(binary), "gguf": str(gguf), "command": cmd[1:],
            "windows": int(windows.group(1)) if windows else None,
            "seconds": time.perf_counter() - t0}


def summary_text(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows = [[r["mode"], r["dtype"], r["quantization"] + (f" g{r['group_size']}" if r["group_size"] else ""),
             f"{r['ppl']:.4f}", f"{100 * r['ppl_rel']:+.2f}%", f"{r['ppl_windows']:.4f}",
             f"{100 * r['ppl_windows_rel']:+.2f}%", f"{r['weight_bytes'] / 1e6:.1f}"] for r in report["results"]]
    b = report.get("baseline")
    if b:
        rows.append(["llama.cpp", "-", "file's own", "-", "-", f"{b['ppl_windows']:.4f}",
                     f"{100 * b['ppl_windows_rel']:+.2f}%", "-"])
    head = (f"perplexity of {report['model'].get('name')} on {cfg['text_tokens']} tokens "
            f"(full: chunks of {cfg['chunk_size']} through the KV cache; windows: llama-perplexity's protocol, "
            f"-c {cfg['window']}); relative to none (fp32)")
    return head + "\n" + format_table(
        ["mode", "dtype", "weights", "ppl", "vs fp32", "ppl windows", "vs fp32", "weight MB"], rows)


def generate_text(model: str | None = None, *, max_tokens: int = 520, seed: int = 0) -> str:
    """How benches/data/ppl_text.txt was made: the fp32 model answers GEN_PROMPTS, sampled (temperature 0.7,
    top-p 0.95, fixed seeds) so the text is fluent but not the greedy loop a small model falls into."""
    from ironlm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", quantization="none", seed=seed)
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(GEN_PROMPTS))]
    outs = llm.chat([[{"role": "user", "content": p}] for p in GEN_PROMPTS], params, use_tqdm=False)
    return "\n\n".join(o.outputs[0].text.strip() for o in outs) + "\n"
