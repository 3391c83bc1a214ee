"""`ironlm bench restart`: first-request TTFT on a long prefix computed before a restart, with vs without a disk tier.

Engine A, with a disk tier in a fresh folder, prefills a long prompt and shuts down (the tier writes its index).
Engine B starts on the same folder, and engine C starts with no tier; each one's first request is the same
prompt plus a new suffix: B finds the prompt's blocks in the restored tier and promotes them, C computes them.
Every engine is a fresh one (fresh pool, empty device prefix cache) and gets the engine's own startup warm-up
only, so the request timed is truly the first. With `repeats > 1`, B and C alternate, each a new engine (B on
the folder A left), and the medians are reported.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ironlm.bench.datasets import token_floor
from ironlm.bench.kv import FreshTierDir, block_bytes, close_llm, core_counters, counter_delta, without_tier
from ironlm.bench.report import format_table, machine_info


@dataclass
class RestartConfig:
    model: str | None = None
    prompt_len: int = 2048
    suffix_len: int = 32
    repeats: int = 3
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)
    tier_dir: str | None = None  # parent of the fresh tier folder (default: the system's temporary folder)
    tier_size: int | str | None = None  # bytes or e.g. '1GiB'; default: twice what the prompt takes
    threads: int | None = None
    progress: bool = True


def quick(config: RestartConfig) -> RestartConfig:
    return RestartConfig(**{**asdict(config), "prompt_len": 256, "suffix_len": 8, "repeats": 1})


def _first_request(llm, prompt: list[int]) -> dict[str, Any]:
    """TTFT of one request, the engine's first, and what the prefix cache and the tier gave it."""
    from ironlm.sampling_params import SamplingParams

    before = core_counters(llm.engine)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, ignore_eos=True, temperature=0),
                       use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    if out.error is not None:
        raise RuntimeError(f"restart bench request failed: {out.error}")
    c = counter_delta(before, core_counters(llm.engine))
    ttft = out.metrics.ttft
    return {"ttft_s": ttft if ttft is not None else wall, "wall_s": wall, "cached_tokens": out.num_cached_tokens,
            "prefix_hits": c["prefix_hits"], "prefix_hits_tier": c["prefix_hits_tier"],
            "kv_promotions": c["kv_promotions"], "first_token": out.outputs[0].token_ids[0]}


def _say(config: RestartConfig, text: str) -> None:
    if config.progress:
        print(text, flush=True)


def _fresh(config: RestartConfig, args: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    from ironlm.llm import LLM

    llm = LLM(config.model, **args)
    try:
        return _first_request(llm, prompt)
    finally:
        close_llm(llm)


def run(config: RestartConfig) -> dict[str, Any]:
    from ironlm.llm import LLM

    if config.prompt_len < 1 or config.suffix_len < 1 or config.repeats < 1:
        raise ValueError("prompt_len, suffix_len and repeats must be >= 1")
    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    base = without_tier(config.engine_args)
    with_tier: list[dict[str, Any]] = []
    without: list[dict[str, Any]] = []
    with FreshTierDir(config.tier_dir) as folder:
        # C's first run comes first: its engine tells the vocabulary and the block size the tier is sized by.
        c = LLM(config.model, **base)
        engine = c.engine
        vocab = engine.model_config.vocab_size
        rng = np.random.default_rng(config.seed)
        low = token_floor(vocab)
        prompt = rng.integers(low, vocab, size=config.prompt_len).tolist()
        suffixes = [rng.integers(low, vocab, size=config.suffix_len).tolist() for _ in range(config.repeats)]
        size = config.tier_size
        if size is None:
            size = 2 * math.ceil((config.prompt_len + config.suffix_len) / engine.config.block_size) * block_bytes(engine)
        model = {"name": engine.model_name, "path": str(engine.model_path), "dtype": str(engine.dtype),
                 "quantization": engine.config.quantization, "device": str(engine.device),
                 "block_size": engine.config.block_size}
        _say(config, f"[1/{config.repeats}] engine C (no tier): first request")
        try:
            without.append(_first_request(c, prompt + suffixes[0]))
        finally:
            close_llm(c)
        del c, engine
        tier = {**base, "kv_offload_dir": folder, "kv_offload_size": size}
        _say(config, f"engine A (disk tier): prefilling {config.prompt_len} tokens, then shutting down")
        cold = _fresh(config, tier, prompt)
        for rep in range(config.repeats):
            if rep:
                _say(config, f"[{rep + 1}/{config.repeats}] engine C (no tier): first request")
                without.append(_fresh(config, base, prompt + suffixes[rep]))
            _say(config, f"[{rep + 1}/{config.repeats}] engine B (restarted on the disk tier): first request")
            with_tier.append(_fresh(config, tier, prompt + suffixes[rep]))
    ttft_b = statistics.median(r["ttft_s"] for r in with_tier)
    ttft_c = statistics.median(r["ttft_s"] for r in without)
    return {
        "bench": "restart", "config": asdict(config), "machine": machine_info(str(model["device"])), "model": model,
        "tier_size": size, "engine_a": cold, "with_tier": with_tier, "without_tier": without,
        "ttft_with_tier_s": ttft_b, "ttft_without_tier_s": ttft_c, "ttft_ratio": ttft_c / ttft_b,
        "same_first_token": all(b["first_token"] == c["first_token"] for b, c in zip(with_tier, without)),
    }


def summary_text(report: dict[str, Any]) -> str:
    cfg = report["config"]
    a = report["engine_a"]
    rows = [["A: before the restart (tier empty)", a["ttft_s"], a["cached_tokens"], a["prefix_hits_tier"], 0]]
    for label, key in (("B: restarted on the disk tier", "with_tier"), ("C: restarted, no tier", "without_tier")):
        runs = report[key]
        rows.append([label, statistics.median(r["ttft_s"] for r in runs),
                     statistics.median(r["cached_tokens"] for r in runs),
                     statistics.median(r["prefix_hits_tier"] for r in runs),
                     statistics.median(r["kv_promotions"] for r in runs)])
    return "\n".join([
        (f"restart TTFT: prompt {cfg['prompt_len']} tokens + new suffix {cfg['suffix_len']}, "
         f"{cfg['repeats']} restart(s) each, model: {report['model']['name']}"),
        format_table(["engine", "TTFT s", "cached tokens", "tier hit tokens", "promoted blocks"], rows),
        (f"TTFT without / with the disk tier: {report['ttft_ratio']:.2f}x"
         + ("" if report["same_first_token"] else "  (warning: first tokens differ)")),
    ])


def plot(report: dict[str, Any], path: str) -> None:
    from ironlm.bench.report import plot_bars

    bars = [("restarted, disk tier", report["ttft_with_tier_s"]), ("restarted, no tier", report["ttft_without_tier_s"])]
    plot_bars(path, bars, title=f"{report['model']['name']}: first-request TTFT, {report['config']['prompt_len']}-token "
              "prefix", ylabel="TTFT s (lower is better)", highlight="restarted, disk")
