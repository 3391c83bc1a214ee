"""`ironlm` command line: serve, generate, chat, bench. Flags are named like `vllm serve`'s.

Heavy imports (torch, transformers, fastapi) happen inside the commands, so `ironlm --help` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ironlm.config import ATTENTION_BACKENDS

logger = logging.getLogger("ironlm.serve")


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    if positional_model:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="HF model folder or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_opt", default=None, help="same as MODEL")
    g = p.add_argument_group("engine")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model; the first is reported in responses")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two)")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size: bytes or e.g. '2GiB'")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--max-model-len", type=int, default=None, help="max prompt + output tokens per request")
    g.add_argument("--max-num-seqs", type=int, default=256, help="max sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "deadline"])
    g.add_argument("--max-queue-len", type=int, default=None, help="waiting requests beyond this get 503")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may wait in the queue before it times out")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    g.add_argument("--seed", type=int, default=0)


def engine_config(args: argparse.Namespace, model: str | None) -> Any:
    from ironlm.config import EngineConfig

    names = args.served_model_name
    return EngineConfig(
        model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
        max_queue_len=args.max_queue_len, request_timeout=args.request_timeout,
        attention_backend=args.attention_backend, seed=args.seed, served_model_name=names[0] if names else None)


def _model(args: argparse.Namespace) -> str | None:
    return getattr(args, "model_opt", None) or getattr(args, "model_pos", None)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    t_start = time.perf_counter()
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("IRONLM_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("binding %s without --api-key: anyone who can reach it can use the model", args.host)
    t0 = time.perf_counter()
    from ironlm.engine import AsyncLLMEngine, LLMEngine
    from ironlm.server.api import build_app
    from ironlm.server.launcher import serve_app

    config = engine_config(args, _model(args))
    logger.info("phase imports: %.2fs", time.perf_counter() - t0)
    logger.info("loading model %s", config.model or "(built-in default: SmolLM2-135M-Instruct)")
    engine = LLMEngine(config)
    for phase, seconds in getattr(engine, "startup_timings", {}).items():
        logger.info("phase %s: %.2fs", phase, seconds)
    t0 = time.perf_counter()
    aengine = AsyncLLMEngine(engine, stall_timeout_s=args.health_stall_timeout)
    names = args.served_model_name or [engine.model_name]
    app = build_app(aengine, served_model_name=names, api_key=api_key)
    logger.info("phase engine loop + app: %.2fs (model %s, max_model_len %d)", time.perf_counter() - t0,
                names[0], engine.max_model_len)

    def ready() -> None:
        logger.info("ready: serving %s on http://%s:%d after %.2fs", names[0], args.host, args.port,
                    time.perf_counter() - t_start)

    asyncio.run(serve_app(aengine, app, host=args.host, port=args.port, grpc_port=args.grpc_port,
                          model_names=names, api_key=api_key, drain_timeout=args.drain_timeout,
                          log_level=args.log_level, on_ready=ready))
    return 0


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    from ironlm import __version__

    parser = argparse.ArgumentParser(prog="ironlm", description="ironlm: LLM inference and serving engine")
    parser.add_argument("--version", action="version", version=f"ironlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP (and gRPC) server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                       "(default: $IRONLM_API_KEY)")
    serve.add_argument("--grpc-port", type=int, default=None, help="also serve gRPC on this port")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM")
    serve.add_argument("--health-stall-timeout", type=float, default=300.0, metavar="S",
                       help="/health answers 503 once one engine step has run this many seconds")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    from ironlm.cli_run import add_chat_parser, add_generate_parser

    add_generate_parser(sub, add_engine_args)
    add_chat_parser(sub, add_engine_args)
    _add_bench(sub, load=bool(argv) and argv[0] == "bench")
    return parser


def _add_bench(sub: Any, load: bool) -> None:
    """`ironlm bench ...` lives in ironlm.bench.cli; import it only when it is the command run."""
    if load:
        try:
            from ironlm.bench.cli import add_bench_parser
        except ImportError as exc:
            missing = str(exc)
        else:
            add_bench_parser(sub)
            return
    else:
        missing = ""
    stub = sub.add_parser("bench", help="benchmarks: throughput, serve, scheduler (ironlm bench --help)",
                          add_help=False)
    stub.add_argument("rest", nargs=argparse.REMAINDER)

    def unavailable(_: argparse.Namespace) -> int:
        print(f"ironlm bench is not available in this install ({missing or 'ironlm.bench.cli missing'})",
              file=sys.stderr)
        return 2

    stub.set_defaults(func=unavailable)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # bad configuration (EngineConfig / model loading): no traceback needed
        print(f"ironlm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
