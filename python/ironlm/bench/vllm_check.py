"""`python -m ironlm.bench.vllm_check`: where the vLLM-CPU baseline is, the environment it runs with, and with
`--check` whether `LLM.generate` and `vllm serve` each answer a tiny greedy request (the end of `make vllm-cpu`'s
instructions; several minutes, vLLM compiles the model at each start)."""

from __future__ import annotations

import json
import os
from typing import Any

from ironlm.bench.datasets import BenchRequest
from ironlm.bench.vllm_cpu import VllmCpuNotBuilt, VllmOffline, VllmServer, environment, find_install


def check(threads: int = 2) -> dict[str, Any]:
    """Smoke check of an install: `LLM.generate` and `vllm serve` each answer one tiny greedy request."""
    from ironlm.bench.stream import stream_once

    req = BenchRequest([1, 2, 3, 400, 500], 8)
    offline = VllmOffline(None, threads=threads)
    offline.start()
    try:
        out = offline.generate([req])
    finally:
        offline.stop()
    server = VllmServer(None, threads=threads)
    server.start(1200.0)
    try:
        res = stream_once(server.url, req.prompt_token_ids, req.output_len)
    finally:
        server.stop()
    return {"offline_tokens": out["output_tokens"][0], "offline_first_token": out["first_tokens"][0],
            "served_tokens": res.output_tokens, "served_chunks": res.token_chunks, "ttft_s": res.ttft,
            "version": offline.install.version(), "load_s": offline.info.get("load_s")}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m ironlm.bench.vllm_check", description="the vLLM-CPU baseline")
    p.add_argument("--check", action="store_true", help="LLM.generate and vllm serve answer a tiny request")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)
    try:
        inst = find_install()
    except VllmCpuNotBuilt as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"venv": str(inst.root), "version": inst.version(), "hf_folder": str(inst.hf_folder),
                      "env": environment(inst, args.threads)}, indent=1))
    if args.check:
        print(json.dumps(check(args.threads), indent=1))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
