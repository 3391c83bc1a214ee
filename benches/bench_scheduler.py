"""Scheduler step: Rust core (through PyO3, numpy arrays included) vs a nano-vllm-style Python scheduler.

    .venv/bin/python benches/bench_scheduler.py [--quick] [--steps N] [--num-seqs 64 256 1024] [--json out.json]

The same comparison runs as `ironlm bench scheduler` (see ironlm.bench.scheduler).
"""

from __future__ import annotations

import argparse
import json
import sys

from ironlm.bench.scheduler import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps per run")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs per size; the best is reported")
    ap.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    result = run(tuple(args.num_seqs), steps=args.steps, quick=args.quick, prompt_len=args.prompt_len,
                 repeats=args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
