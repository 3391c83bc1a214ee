"""`ironlm bench throughput --dataset multiturn`: multi-turn conversations through the offline engine.

Every conversation's turn 0 is queued at the start; turn k+1 is queued when turn k finishes, its prompt being
turn k's prompt, the tokens the engine really generated for it, and the next user message, so a prefix cache can
serve the whole history. Finished turns requeue behind everyone else's, so the conversations interleave and
between two turns of one conversation the engine serves every other live one: once the live histories outgrow
the device pool, a conversation's history is evicted before its next turn, unless a tier below keeps it.

`compare_tier` runs the same conversations without a tier, then with one (the flags given, or a disk tier in a
fresh temporary folder sized to the working set, on GPU host memory), each in a fresh engine; `repeats`
alternates the two that many times (machine drift hits both alike) and compares medians.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

from ironlm.bench.baseline import sync
from ironlm.bench.datasets import MultiturnDataset, MultiturnSpec, multiturn_dataset, token_floor
from ironlm.bench.kv import (
    TIER_FIELDS,
    FreshTierDir,
    StepTap,
    block_bytes,
    close_llm,
    core_counters,
    counter_delta,
    has_tier,
    without_tier,
)
from ironlm.bench.report import format_table, machine_info

# Below this working set / pool ratio the workload would fit (or nearly) in the device pool: the 4x.
TARGET_RATIO = 4.0


@dataclass
class MultiturnConfig:
    model: str | None = None
    spec: MultiturnSpec = field(default_factory=MultiturnSpec)
    compare_tier: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)  # may carry the kv_offload_* / swap_space fields
    tier_slack: float = 1.25  # an automatic tier holds this multiple of the working set
    repeats: int = 1  # rounds of (no tier, tier), each run a fresh engine; the ratios are of the medians
    threads: int | None = None
    progress: bool = True


def quick_spec(seed: int = 0) -> MultiturnSpec:
    return MultiturnSpec(num_conversations=8, turns=(4, 5), system_len=64, user_len=(16, 32), reply_len=8,
                         seed=seed)


@dataclass
class _Live:
    conversation: int
    turn: int
    prompt: list[int]


def drive(llm, ds: MultiturnDataset, progress: bool = False) -> dict[str, Any]:
    """Runs every conversation to its end through `llm.engine`; the per-run figures."""
    from ironlm.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=ds.reply_len, ignore_eos=True, temperature=0.0)
    live: dict[str, _Live] = {}
    replies: dict[tuple[int, int], list[int]] = {}
    short = 0
    ttfts: list[float] = []
    cached: list[int] = []

    def submit(conversation: int, turn: int, history: list[int]) -> None:
        prompt = ds.prompt(history, conversation, turn)
        rid = engine.add_request(f"mt-{conversation}-{turn}", {"prompt_token_ids": prompt}, params)
        live[rid] = _Live(conversation, turn, prompt)

    bar = tqdm(total=ds.num_requests, unit="turn", desc="multiturn", disable=not progress)
    before = core_counters(engine)
    tap = StepTap().attach(engine)
    sync(engine.device)
    t0 = time.perf_counter()
    try:
        for i in range(len(ds.conversations)):
            submit(i, 0, [])
        while live:
            for out in engine.step():
                if not out.finished or out.request_id not in live:
                    continue
                turn = live.pop(out.request_id)
                if out.error is not None:
                    raise RuntimeError(f"turn {turn.turn} of conversation {turn.conversation} failed: {out.error}")
                reply = list(out.outputs[0].token_ids)
                replies[turn.conversation, turn.turn] = reply
                short += len(reply) != ds.reply_len
                if out.metrics.ttft is not None:
                    ttfts.append(out.metrics.ttft)
                cached.append(out.num_cached_tokens)
                bar.update(1)
                if turn.turn + 1 < ds.conversations[turn.conversation].num_turns:
                    submit(turn.conversation, turn.turn + 1, turn.prompt + reply)
            if live and not engine.has_unfinished_requests():
                raise RuntimeError(f"engine lost {len(live)} turns")  # a bug, never a hang
    except BaseException:
        engine.abort_request(list(live))
        raise
    finally:
        tap.detach()
        bar.close()
    sync(engine.device)
    elapsed = time.perf_counter() - t0
    counters = counter_delta(before, core_counters(engine))
    queries = counters["prefix_queries"]
    steps = tap.summary()
    return {
        "elapsed_s": elapsed,
        "turns": ds.num_requests, "turns_short": short,
        "prompt_tokens": ds.prompt_tokens, "output_tokens": ds.output_tokens,
        "output_tokens_per_s": ds.output_tokens / elapsed,
        "total_tokens_per_s": (ds.output_tokens + ds.prompt_tokens) / elapsed,
        "prefill_tokens": steps["prefill_tokens"],
        "prefix_hit_rate": counters["prefix_hits"] / queries if queries else 0.0,
        "prefix_hit_rate_tier": counters["prefix_hits_tier"] / queries if queries else 0.0,
        "kv_waste": steps["kv_waste"],
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "cached_tokens_at_admission": sum(cached),
        # Greedy replies, in conversation and turn order: equal digests = the tier changed no output.
        "replies_digest": hashlib.sha256(json.dumps(sorted(replies.items())).encode()).hexdigest()[:16],
        "replies": [replies[key] for key in sorted(replies)],
        "counters": counters, "steps": steps,
        "step_breakdown_s": engine.step_breakdown(),
    }


def _warm(llm, vocab: int) -> None:
    """Kernels and allocators once, on tokens the workload never uses (ids below its floor)."""
    from ironlm.sampling_params import SamplingParams

    low = token_floor(vocab)
    ids = [[(7 * i + j) % max(1, low - 1) + 1 for j in range(24)] for i in range(2)]
    llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    llm.engine.timer.reset()


def _auto_tier(first: dict[str, Any], slack: float, folder: str) -> dict[str, Any]:
    """A tier that holds the working set: host memory next to a GPU pool, a disk file next to a CPU pool."""
    size = math.ceil(slack * first["working_set_tokens"] / first["block_size"]) * first["block_bytes"]
    if first["device"].startswith("cuda"):
        return {"kv_offload_memory": size}
    return {"kv_offload_dir": folder, "kv_offload_size": size}


def _one(config: MultiturnConfig, engine_args: dict[str, Any], label: str) -> tuple[dict, MultiturnDataset, dict]:
    """A fresh engine, one warm-up, the whole workload, then the engine's shutdown."""
    from ironlm.llm import LLM

    llm = LLM(config.model, **engine_args)
    engine = llm.engine
    try:
        ds = multiturn_dataset(config.spec, engine.model_config.vocab_size)
        longest = max(ds.prompt_len(i, c.num_turns - 1) for i, c in enumerate(ds.conversations)) + ds.reply_len
        if longest > engine.max_model_len:
            raise ValueError(f"the longest conversation needs {longest} tokens, more than max_model_len "
                             f"({engine.max_model_len}): fewer --turns or shorter --user-len/--reply-len/--system-len")
        _warm(llm, engine.model_config.vocab_size)
        if config.progress:
            tqdm.write(f"{label}: {ds.num_requests} turns in {len(ds.conversations)} conversations")
        result = drive(llm, ds, config.progress)
    finally:
        close_llm(llm)
    pool = engine.num_blocks * engine.config.block_size
    info = {"label": label, "tier": has_tier(engine_args),
            "tier_args": {k: engine_args[k] for k in TIER_FIELDS if k in engine_args},
            "num_kv_blocks": engine.num_blocks, "block_size": engine.config.block_size, "pool_tokens": pool,
            "block_bytes": block_bytes(engine), "device": str(engine.device),
            "working_set_tokens": ds.working_set_tokens(), "working_set_ratio": ds.working_set_tokens() / pool}
    model = {"name": engine.model_name, "path": str(engine.model_path), "dtype": str(engine.dtype),
             "quantization": engine.config.quantization, "device": str(engine.device)}
    return {**info, **result}, ds, model


def run(config: MultiturnConfig) -> dict[str, Any]:
    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    if config.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {config.repeats}")
    given = has_tier(config.engine_args)
    labels = ["no tier", "tier"] if config.compare_tier else ["tier" if given else "no tier"]
    results: list[dict[str, Any]] = []
    for rnd in range(config.repeats):
        for label in labels:
            # A fresh folder for every tiered run: the last run's engine saved its tier at shutdown, and a run
            # must not start with the previous run's KV (see FreshTierDir).
            with FreshTierDir(config.engine_args.get("kv_offload_dir")) as folder:
                args = without_tier(config.engine_args) if label == "no tier" else dict(config.engine_args)
                if label == "tier" and not given:
                    args.update(_auto_tier(results[0], config.tier_slack, folder))
                elif args.get("kv_offload_dir") is not None:
                    args["kv_offload_dir"] = folder
                result, ds, model = _one(config, args, label if config.repeats == 1 else f"{label} #{rnd + 1}")
            results.append({**result, "config_label": label, "round": rnd + 1})
    report: dict[str, Any] = {
        "bench": "throughput", "dataset_kind": "multiturn",
        "config": asdict(config),
        "machine": machine_info(model["device"]),
        "model": model,
        "dataset": ds.summary(),
        "results": results,
    }
    if config.compare_tier:
        off = [r for r in results if r["config_label"] == "no tier"]
        on = [r for r in results if r["config_label"] == "tier"]
        prefill_on = statistics.median(r["prefill_tokens"] for r in on)
        report["tier_comparison"] = {
            "prefill_tokens_ratio": statistics.median(r["prefill_tokens"] for r in off) / prefill_on
            if prefill_on else None,
            "time_ratio": statistics.median(r["elapsed_s"] for r in off) / statistics.median(r["elapsed_s"] for r in on),
            "same_replies": off[0]["replies_digest"] == on[0]["replies_digest"],
            "turns_with_other_replies": sum(a != b for a, b in zip(off[0]["replies"], on[0]["replies"])),
        }
    return report


def summary_text(report: dict[str, Any]) -> str:
    ds = report["dataset"]
    cfg = ds["config"]
    lines = [(f"dataset: multiturn  conversations: {ds['num_conversations']}  turns: {ds['num_requests']} "
              f"({ds['turns_min']}-{ds['turns_max']} each)  system {cfg['system_len']}, user {cfg['user_len'][0]}-"
              f"{cfg['user_len'][1]}, reply {cfg['reply_len']} tokens  model: {report['model']['name']}")]
    rows = []
    for r in report["results"]:
        rows.append([r["label"], r["elapsed_s"], r["output_tokens_per_s"], r["total_tokens_per_s"],
                     r["prefill_tokens"], f"{100 * r['prefix_hit_rate']:.1f}%",
                     f"{100 * r['prefix_hit_rate_tier']:.1f}%", f"{100 * r['kv_waste']:.2f}%",
                     r["counters"]["num_preemptions"], r["counters"]["kv_promotions"],
                     r["counters"]["kv_demotions"]])
    lines.append(format_table(["config", "elapsed s", "out tok/s", "total tok/s", "prefill tokens", "hit rate",
                               "from tier", "KV waste", "preempt", "promoted", "demoted"], rows))
    r0 = report["results"][0]
    ratio = r0["working_set_ratio"]
    lines.append(f"working set {r0['working_set_tokens']} tokens / device pool {r0['pool_tokens']} tokens "
                 f"({r0['num_kv_blocks']} blocks of {r0['block_size']}) = {ratio:.2f}x"
                 + ("" if ratio >= TARGET_RATIO else f"  (below {TARGET_RATIO:.0f}x: shrink --num-kv-blocks)"))
    if "tier_comparison" in report:
        c = report["tier_comparison"]
        pre = "n/a" if c["prefill_tokens_ratio"] is None else f"{c['prefill_tokens_ratio']:.2f}x"
        medians = "" if report["config"]["repeats"] == 1 else " (medians)"
        lines.append(f"without / with tier{medians}: prefill tokens {pre}, time {c['time_ratio']:.2f}x; greedy replies "
                     + ("identical" if c["same_replies"] else f"differ in {c['turns_with_other_replies']} of "
                        f"{len(report['results'][0]['replies'])} turns"))
    for r in report["results"]:
        st = r["steps"]
        lines.append(f"{r['label']}: runner time in steps with prefill {st['prefill_steps_s']:.1f} s, in "
                     f"{st['decode_only_steps']} decode-only steps {st['decode_only_steps_s']:.1f} s")
    short = sum(r["turns_short"] for r in report["results"])
    if short:
        lines.append(f"warning: {short} turns ended before reply_len tokens")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    from ironlm.bench.report import plot_bars

    ds = report["dataset"]
    plot_bars(path, [(r["label"], r["elapsed_s"]) for r in report["results"]],
              title=f"{report['model']['name']}: {ds['num_conversations']} conversations, {ds['num_requests']} turns",
              ylabel="seconds (lower is better)", highlight="tier")
