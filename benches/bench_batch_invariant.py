"""The cost of `batch_invariant`: workload W offline (64 random requests, prompts 32-512, outputs 16-256, greedy,
ignore_eos) and single-stream decode, off vs on, two engines in one process, alternating, `--rounds` rounds.

    python benches/bench_batch_invariant.py [--rounds 2] [--model PATH] [--json PATH]

Prints each round with the machine's busy fraction during it (other processes' load shows there) and the medians.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from ironlm import LLM, SamplingParams
from ironlm.bench.report import cpu_jiffies
from ironlm.model.default import default_model_path


def _timed(fn: object) -> tuple[float, float]:
    b0, t0 = cpu_jiffies()
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    dt = time.perf_counter() - start
    b1, t1 = cpu_jiffies()
    return dt, (b1 - b0) / max(1, t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    reqs = [([rng.randrange(300, 40000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
            for _ in range(64)]
    model = args.model or str(default_model_path())
    llms = {mode: LLM(model, device="cpu", batch_invariant=mode) for mode in (False, True)}
    one = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    w_params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    w_tokens = sum(o for _, o in reqs)
    res: dict[bool, dict[str, list[float]]] = {m: {"w_s": [], "w_out_tok_s": [], "decode_tok_s": []}
                                               for m in llms}
    for llm in llms.values():  # warm-up
        llm.generate([p for p, _ in reqs[:4]], w_params[:4], use_tqdm=False)
    for rnd in range(args.rounds):
        for mode, llm in llms.items():
            dt, busy = _timed(lambda llm=llm: llm.generate([p for p, _ in reqs], w_params, use_tqdm=False))
            dt1, busy1 = _timed(lambda llm=llm: llm.generate([[5, 6, 7, 8] * 8], one, use_tqdm=False))
            res[mode]["w_s"].append(dt)
            res[mode]["w_out_tok_s"].append(w_tokens / dt)
            res[mode]["decode_tok_s"].append(128 / dt1)
            print(f"round {rnd} batch_invariant={mode}: W {dt:.1f} s ({w_tokens / dt:.1f} output tok/s, machine busy "
                  f"{busy:.0%}), one stream {128 / dt1:.1f} tok/s (busy {busy1:.0%})", flush=True)
    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in res.items()}
    ratio = {"w": med[True]["w_out_tok_s"] / med[False]["w_out_tok_s"],
             "decode": med[True]["decode_tok_s"] / med[False]["decode_tok_s"]}
    print(json.dumps({"median": {str(m): v for m, v in med.items()}, "invariant_over_default": ratio}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": {str(m): v for m, v in res.items()}, "median": {str(m): v for m, v in med.items()},
                       "invariant_over_default": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
