"""Speculative decoding, single stream: the input-grounded prompts (bench/spec_prompts.json) one at a time,
greedy, plain decode vs speculation in one process, decode tok/s (output tokens after the first over the
time after the first token) and the acceptance figures.

    python -m ironlm.bench.spec [--max-tokens 256] [--k 5] [--batch-invariant] [--json PATH]
    python -m ironlm.bench.spec --draft-pair truncated|random [--tiny] [--k 4]   # draft model (spec_pair.py)
    python -m ironlm.bench.spec --model TARGET --draft DRAFT                     # draft model, your own pair

n-gram by default; `--draft` / `--draft-pair` speculate with a draft model instead. `--baseline llama.cpp` adds
llama.cpp on the same prompts: its plain decode (`llama_cpp_plain`, llama-lookup drafting nothing) and its own
speculative mode (`llama_cpp`: llama-lookup, or llama-speculative with a draft), and our speed-up over its plain
decode.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from ironlm import LLM, SamplingParams
from ironlm.bench.report import cpu_jiffies
from ironlm.bench.spec_pair import build_pair
from ironlm.bench.spec_prompts import chat_prompt, load_prompts


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    decode_tokens, decode_s, outs = 0, 0.0, []
    for p in prompts:
        o = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        m, n = o.metrics, len(o.outputs[0].token_ids)
        assert m.first_token_time is not None and m.finished_time is not None
        decode_tokens += n - 1
        decode_s += m.finished_time - m.first_token_time
        outs.append(o.outputs[0].token_ids)
    return {"decode_tok_s": decode_tokens / decode_s, "decode_tokens": decode_tokens, "outputs": outs,
            "metrics": {k: v for k, v in llm.get_metrics().items() if k.startswith("spec_decode_")}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch-invariant", action="store_true",
                    help="both engines batch-invariant: speculative greedy output then equals plain bit for bit")
    ap.add_argument("--draft", default=None, help="a draft model (shares --model's tokenizer)")
    ap.add_argument("--draft-pair", choices=("truncated", "random"), default=None,
                    help="build a random-weight target / draft pair (bench/spec_pair.py) and race it")
    ap.add_argument("--draft-layers", type=int, default=4, help="--draft-pair truncated: the draft's layers")
    ap.add_argument("--tiny", action="store_true", help="--draft-pair at toy size (checks the bench, no figures)")
    ap.add_argument("--pair-dir", default="/tmp/ironlm-spec-pair", help="where --draft-pair models are kept")
    ap.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--baseline", choices=("none", "llama.cpp"), default="none",
                    help="then llama.cpp on the same prompts: its plain decode (llama-lookup drafting nothing) and "
                         "its own mode, llama-lookup (n-gram) or llama-speculative (--draft, GGUF files); build: "
                         "make llama-cpp")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (--baseline)")
    a = ap.parse_args(argv)
    draft = a.draft
    if a.draft_pair is not None:
        target, pair_draft = build_pair(Path(a.pair_dir), a.draft_pair, a.tiny, a.draft_layers)
        a.model, draft = str(target), str(pair_draft)
    kw: dict[str, Any] = {"model": a.model, "kv_cache_memory": "512MiB", "max_model_len": 4096, "seed": 0,
                          "batch_invariant": a.batch_invariant}
    b0 = cpu_jiffies()
    plain = LLM(**kw)
    texts = load_prompts()[:a.num_prompts]
    prompts = [chat_prompt(plain.engine.tokenizer, t) for t in texts]
    rendered = [str(plain.engine.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                              add_generation_prompt=True, tokenize=False))
                for t in texts]
    base = run(plain, prompts, a.max_tokens)
    del plain
    cfg: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": a.lookup_max,
                           "prompt_lookup_min": 1}
    if draft is not None:
        cfg = {"model": draft, "num_speculative_tokens": a.k}
    spec = run(LLM(speculative_config=cfg, **kw), prompts, a.max_tokens)
    llama = llama_plain = None
    if a.baseline == "llama.cpp":
        from ironlm.bench import llama_spec
        from ironlm.bench.llama_cpp import gguf_path

        binary = "llama-lookup" if draft is None else "llama-speculative"
        gguf = gguf_path(a.model)
        llama_plain = llama_spec.run("llama-lookup", gguf, rendered, a.max_tokens, 0, a.threads)
        llama = llama_spec.run(binary, gguf, rendered, a.max_tokens, a.k, a.threads,
                               None if draft is None else Path(draft))
    b1 = cpu_jiffies()
    same = sum(x == y for x, y in zip(base["outputs"], spec["outputs"]))
    report = {
        "cpu": _cpu_model(), "model": a.model, "draft_pair": a.draft_pair, "prompt_tokens": [len(p) for p in prompts], "max_tokens": a.max_tokens,
        "speculative_config": cfg, "plain_decode_tok_s": base["decode_tok_s"],
        "spec_decode_tok_s": spec["decode_tok_s"], "speedup": spec["decode_tok_s"] / base["decode_tok_s"],
        "identical_outputs": f"{same}/{len(prompts)}", **spec["metrics"], "llama_cpp": llama,
        "llama_cpp_plain": llama_plain,
        "speedup_vs_llama_cpp_plain": None if not llama_plain or not llama_plain["decode_tok_s"]
        else spec["decode_tok_s"] / llama_plain["decode_tok_s"],
        # Busy share of all CPUs over the whole run (ours included): what else ran shows above ~1/ncpu.
        "machine_busy_frac": (b1[0] - b0[0]) / max(1, b1[1] - b0[1]),
    }
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
