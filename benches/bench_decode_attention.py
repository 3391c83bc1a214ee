"""Decode step: the ``cpu`` attention backend (fused paged kernel in the core) vs the ``torch`` path, side by side.

    .venv/bin/python benches/bench_decode_attention.py [MODEL] [--num-seqs 64] [--steps 5] [--repeats 6] [--json F]

Admits workload W's prompts (lengths 32-512, seed 0), runs until every sequence is decoding, then times blocks of
decode steps, alternating the two backends on the same live batch (the noisy-neighbour drift of a shared machine
hits both alike). Reports the median step time and the time inside attention per step for each. (That the two
backends agree is tested in tests/test_attention_torch.py and end to end against transformers.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from ironlm.attention import get_backend
from ironlm.bench.datasets import RandomSpec, random_dataset
from ironlm.llm import LLM
from ironlm.sampling_params import SamplingParams

BACKENDS = ("cpu", "torch")


def _timed(name: str, spent: dict[str, float]) -> Any:
    backend = get_backend(name, "cpu")
    inner = backend.forward

    def forward(*args: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args)
        spent[name] += time.perf_counter() - t0
        return out

    backend.forward = forward
    return backend


def run(model: str | None, num_seqs: int, steps: int, repeats: int, input_len: tuple[int, int]) -> dict[str, Any]:
    llm = LLM(model, max_num_seqs=num_seqs)
    engine = llm.engine
    ds = random_dataset(RandomSpec(num_requests=num_seqs, input_len=input_len, output_len=(1, 1), seed=0),
                        engine.model_config.vocab_size)
    # Long enough to outlast the warm-up (early requests decode while later ones still prefill) and every timed
    # step: nobody finishes and the batch stays whole.
    params = SamplingParams(max_tokens=2 * steps * repeats + 256, ignore_eos=True, temperature=0.0)
    for i, r in enumerate(ds.requests):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params)
    started: set[str] = set()  # requests whose prefill is done (they have sampled a token)
    while len(started) < num_seqs:
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    if engine.stats()["num_requests_running"] != num_seqs:
        raise RuntimeError("the KV cache cannot hold every sequence at once: lower --num-seqs")

    spent = dict.fromkeys(BACKENDS, 0.0)
    backends = {name: _timed(name, spent) for name in BACKENDS}
    step_ms: dict[str, list[float]] = {name: [] for name in BACKENDS}
    for _ in range(repeats):
        for name in BACKENDS:
            engine.runner.model.set_attention_backend(backends[name])
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            step_ms[name].append((time.perf_counter() - t0) / steps * 1e3)
    context = int(sum(r.prompt_len for r in ds.requests) / num_seqs)
    result: dict[str, Any] = {"num_seqs": num_seqs, "mean_context": context, "steps": steps, "repeats": repeats}
    for name in BACKENDS:
        result[name] = {"step_ms_median": statistics.median(step_ms[name]), "step_ms": step_ms[name],
                        "attention_ms_per_step": spent[name] / (steps * repeats) * 1e3}
    result["speedup_step"] = result["torch"]["step_ms_median"] / result["cpu"]["step_ms_median"]
    result["speedup_attention"] = result["torch"]["attention_ms_per_step"] / result["cpu"]["attention_ms_per_step"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: the built-in model)")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="decode steps per timed block")
    ap.add_argument("--repeats", type=int, default=6, help="timed blocks per backend, alternating")
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    r = run(args.model, args.num_seqs, args.steps, args.repeats, tuple(args.input_len))
    print(f"decode step, {r['num_seqs']} sequences, mean context {r['mean_context']} tokens "
          f"({r['repeats']} alternating blocks of {r['steps']} steps, medians)")
    for name in BACKENDS:
        print(f"  {name:5s}  step {r[name]['step_ms_median']:8.1f} ms   attention {r[name]['attention_ms_per_step']:8.1f} ms")
    print(f"  cpu / torch: step {r['speedup_step']:.2f}x faster, attention {r['speedup_attention']:.2f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
