"""Speculative decoding, single stream: the input-grounded prompts (bench/spec_prompts.py) one at a time,
greedy, plain decode vs speculation in one process, decode tok/s (output tokens after the first over the
time after the first token) and the acceptance figures. Both engines stay loaded and take turns prompt by prompt
over --rounds passes (with --baseline, llama.cpp's two runs join the rotation), so a drift in the machine's
memory bandwidth lands on every engine alike; each round's own ratio is reported beside the totals.

    python -m ironlm.bench.spec [--prompts copy|tasks] [--max-tokens 256] [--k 5] [--batch-invariant] [--json PATH]
    python -m ironlm.bench.spec --draft-pair truncated|random [--tiny] [--k 4]   # draft model (spec_pair.py)
    python -m ironlm.bench.spec --model TARGET --draft DRAFT                     # draft model, your own pair

n-gram by default; `--draft` / `--draft-pair` speculate with a draft model instead. `--baseline llama.cpp` adds
llama.cpp on the same prompts: its plain decode (`llama_cpp_plain`, llama-lookup drafting nothing) and its own
speculative mode (`llama_cpp`: llama-lookup, or llama-speculative with a draft), and our speed-up over its plain
decode. The report also says what the plain outputs are made of (`output_copied_frac`: tokens ending an
8-gram of the prompt; `output_repeated_frac`: of the answer's own earlier text; `outputs_at_max_tokens`): the
default model loops once it runs long, and a speed-up earned on a loop is not one earned on copying.
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
from ironlm.bench.spec_prompts import SETS, chat_prompt, load_prompts


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_one(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], int, float]:
    """One prompt, greedy: its output ids, the decoded tokens after the first and the seconds they took."""
    o = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens),
                     use_tqdm=False)[0]
    m = o.metrics
    assert m.first_token_time is not None and m.finished_time is not None
    return list(o.outputs[0].token_ids), len(o.outputs[0].token_ids) - 1, m.finished_time - m.first_token_time


def summarize(runs: list[tuple[int, float]]) -> dict[str, Any]:
    """Decode tok/s over (tokens, seconds) runs."""
    tokens, secs = sum(r[0] for r in runs), sum(r[1] for r in runs)
    return {"decode_tok_s": tokens / secs if secs else 0.0, "decode_tokens": tokens}


def rate(runs: list[tuple[list[int], int, float]]) -> float:
    """Decode tok/s over `run_one` results."""
    return summarize([(r[1], r[2]) for r in runs])["decode_tok_s"]


# n-gram length for `sources`: long enough that a match is a copy, not a common phrase.
SOURCE_N = 8


def sources(prompt: list[int], output: list[int], n: int = SOURCE_N) -> tuple[int, int]:
    """Output tokens that end an `n`-gram of the prompt (copied input), and of the rest those that end an `n`-gram
    found earlier in the output itself (the answer repeating itself). Prompt lookup predicts both; only the first
    is the input-grounded work the benchmark stands for: a small model that runs to max_tokens often loops, and a
    loop is the easiest text there is to propose."""
    in_prompt = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    earlier: set[tuple[int, ...]] = set()
    copied = repeated = 0
    for j in range(n - 1, len(output)):
        gram = tuple(output[j - n + 1:j + 1])
        if gram in in_prompt:
            copied += 1
        elif gram in earlier:
            repeated += 1
        earlier.add(gram)
    return copied, repeated


def interleave(engines: dict[str, Any], n_prompts: int, rounds: int) -> dict[str, list[list[Any]]]:
    """`engines[name](i)` for every prompt i, round after round, the engines' order rotated from prompt to prompt:
    this machine's memory bandwidth drifts by up to 2x within minutes, and running one engine over every prompt
    and then the other put that drift into their ratio (the same code measured 1.49x-2.12x that way). Returns
    each engine's results by round, in prompt order."""
    names = list(engines)
    got: dict[str, list[list[Any]]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names:
            got[n].append([None] * n_prompts)
        for i in range(n_prompts):
            k = (r * n_prompts + i) % len(names)
            for n in names[k:] + names[:k]:
                got[n][r][i] = engines[n](i)
    return got


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
    ap.add_argument("--prompts", choices=tuple(SETS), default="copy",
                    help="copy: random passages to copy word for word; tasks: hand-written repeat/fix/rewrite tasks "
                         "(bench/spec_prompts.py)")
    ap.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--baseline", choices=("none", "llama.cpp"), default="none",
                    help="then llama.cpp on the same prompts: its plain decode (llama-lookup drafting nothing) and "
                         "its own mode, llama-lookup (n-gram) or llama-speculative (--draft, GGUF files); build: "
                         "make llama-cpp")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (--baseline)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="passes over the prompts; within each, the engines alternate prompt by prompt")
    a = ap.parse_args(argv)
    draft = a.draft
    if a.draft_pair is not None:
        target, pair_draft = build_pair(Path(a.pair_dir), a.draft_pair, a.tiny, a.draft_layers)
        a.model, draft = str(target), str(pair_draft)
    kw: dict[str, Any] = {"model": a.model, "kv_cache_memory": "512MiB", "max_model_len": 4096, "seed": 0,
                          "batch_invariant": a.batch_invariant}
    b0 = cpu_jiffies()
    plain = LLM(**kw)
    texts = load_prompts(a.prompts)[:a.num_prompts]
    prompts = [chat_prompt(plain.engine.tokenizer, t) for t in texts]
    rendered = [str(plain.engine.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                              add_generation_prompt=True, tokenize=False))
                for t in texts]
    cfg: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": a.lookup_max,
                           "prompt_lookup_min": 1}
    if draft is not None:
        cfg = {"model": draft, "num_speculative_tokens": a.k}
    spec = LLM(speculative_config=cfg, **kw)
    for llm in (plain, spec):  # warm-up
        run_one(llm, prompts[0], 8)
    spec_before = {k: v for k, v in spec.get_metrics().items() if k.startswith("spec_decode_")}
    engines: dict[str, Any] = {"plain": lambda i: run_one(plain, prompts[i], a.max_tokens),
                               "spec": lambda i: run_one(spec, prompts[i], a.max_tokens)}
    if a.baseline == "llama.cpp":
        from ironlm.bench import llama_spec
        from ironlm.bench.llama_cpp import gguf_path

        binary = "llama-lookup" if draft is None else "llama-speculative"
        gguf = gguf_path(a.model)
        draft_gguf = None if draft is None else Path(draft)
        engines["llama_cpp_plain"] = lambda i: llama_spec.run_one("llama-lookup", gguf, rendered[i], a.max_tokens,
                                                                 0, a.threads)
        engines["llama_cpp"] = lambda i: llama_spec.run_one(binary, gguf, rendered[i], a.max_tokens, a.k,
                                                           a.threads, draft_gguf)
    got = interleave(engines, len(prompts), a.rounds)
    b1 = cpu_jiffies()
    ours = {n: summarize([(r[1], r[2]) for rnd in got[n] for r in rnd]) for n in ("plain", "spec")}
    per_round = [rate(s_) / rate(p_) for p_, s_ in zip(got["plain"], got["spec"])]
    same = sum(x[0] == y[0] for x, y in zip(got["plain"][0], got["spec"][0]))
    metrics = {k: v for k, v in spec.get_metrics().items() if k.startswith("spec_decode_")}
    for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        metrics[k] = metrics[k] - spec_before.get(k, 0)  # the warm-up's proposals left out
    # Every accepted proposal saves one decode step: were verification free, speculation would be this many times
    # faster than plain decode (the bound the proposals' accuracy on these outputs sets, whatever the kernels).
    spec_tokens = ours["spec"]["decode_tokens"]
    ceiling = spec_tokens / max(1, spec_tokens - metrics["spec_decode_num_accepted_tokens"])
    outs = [r[0] for r in got["plain"][0]]
    shares = [sources(p, o) for p, o in zip(prompts, outs)]
    copied, repeated = map(sum, zip(*shares))
    out_tokens = sum(len(o) for o in outs)
    # Each prompt's own speed-up over all rounds beside what its answer is made of, so a reader can tell the
    # speed-up earned on copying from the one earned on an answer that loops.
    per_prompt = [{"output_tokens": len(o), "copied": c, "repeated": r,
                   "speedup": rate([rnd[i] for rnd in got["spec"]]) / rate([rnd[i] for rnd in got["plain"]])}
                  for i, (o, (c, r)) in enumerate(zip(outs, shares))]
    copying = [i for i, p in enumerate(per_prompt) if 2 * p["copied"] >= p["output_tokens"]]
    llama = llama_plain = None
    llama_rounds: list[float] = []
    if a.baseline == "llama.cpp":
        llama, llama_plain = (llama_spec.summarize([r for rnd in got[n] for r in rnd], n_binary)
                              for n, n_binary in (("llama_cpp", binary), ("llama_cpp_plain", "llama-lookup")))
        llama_rounds = [rate(s_) / llama_spec.summarize(p_, "llama-lookup")["decode_tok_s"]
                        for p_, s_ in zip(got["llama_cpp_plain"], got["spec"])]
    report = {
        "cpu": _cpu_model(), "model": a.model, "prompts": a.prompts, "draft_pair": a.draft_pair,
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": a.max_tokens, "rounds": a.rounds,
        "speculative_config": cfg, "plain_decode_tok_s": ours["plain"]["decode_tok_s"],
        "spec_decode_tok_s": ours["spec"]["decode_tok_s"],
        "speedup": ours["spec"]["decode_tok_s"] / ours["plain"]["decode_tok_s"],
        "speedup_per_round": per_round, "free_verification_ceiling": ceiling,
        "identical_outputs": f"{same}/{len(prompts)}",
        # What the plain outputs are made of (first round): their lengths, how many ran to max_tokens, and the
        # shares of output tokens ending an 8-gram of the prompt (copying) or only of the output (repeating).
        "output_tokens": [len(o) for o in outs], "outputs_at_max_tokens": sum(len(o) >= a.max_tokens for o in outs),
        "output_copied_frac": copied / max(1, out_tokens), "output_repeated_frac": repeated / max(1, out_tokens),
        "per_prompt": per_prompt,
        # The speed-up over only the prompts whose answers copy the input for at least half their tokens.
        "copying_prompts": len(copying),
        "speedup_copying": None if not copying else (rate([rnd[i] for rnd in got["spec"] for i in copying])
                                                     / rate([rnd[i] for rnd in got["plain"] for i in copying])),
        **metrics, "llama_cpp": llama,
        "llama_cpp_plain": llama_plain,
        "speedup_vs_llama_cpp_plain": None if not llama_plain or not llama_plain["decode_tok_s"]
        else ours["spec"]["decode_tok_s"] / llama_plain["decode_tok_s"],
        "speedup_vs_llama_cpp_plain_per_round": llama_rounds,
        # Busy share of all CPUs over the whole run (ours included): what else ran shows above ~1/ncpu.
        "machine_busy_frac": (b1[0] - b0[0]) / max(1, b1[1] - b0[1]),
    }
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
