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

from ironlm.cli_args import (
    HelpFormatter,
    add_engine_args,
    add_server_args,
    apply_config_file,
    config_from_args,
    model_from_args,
    server_config_from_args,
)
from ironlm.cli_run import add_chat_parser, add_generate_parser

logger = logging.getLogger("ironlm.serve")


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    t_start = time.perf_counter()
    server = server_config_from_args(args)
    logging.basicConfig(level=getattr(logging, server.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = server.api_key or os.environ.get("IRONLM_API_KEY") or None
    if server.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("binding %s without --api-key: anyone who can reach it can use the model", server.host)
    t0 = time.perf_counter()
    from ironlm.server.assemble import assemble
    from ironlm.server.launcher import serve_app

    config = config_from_args(args, model_from_args(args))
    logger.info("phase imports: %.2fs", time.perf_counter() - t0)
    logger.info("loading model %s", config.model or "(built-in default: SmolLM2-135M-Instruct)")
    served = assemble(config, server, args.served_model_name, api_key=api_key)
    names = served.names

    def ready() -> None:
        logger.info("ready: serving %s on http://%s:%d after %.2fs", names[0], server.host, server.port,
                    time.perf_counter() - t_start)

    asyncio.run(serve_app(served.engine, served.app, host=server.host, port=server.port,
                          grpc_port=server.grpc_port, model_names=names, api_key=api_key,
                          drain_timeout=server.drain_timeout, log_level=server.log_level, on_ready=ready))
    return 0


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    from ironlm import __version__

    parser = argparse.ArgumentParser(prog="ironlm", description="ironlm: LLM inference and serving engine")
    parser.add_argument("--version", action="version", version=f"ironlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP (and gRPC) server",
                           formatter_class=HelpFormatter)
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    add_generate_parser(sub)
    add_chat_parser(sub)
    models = sub.add_parser("models", help="the model architectures ironlm runs, with each family's features")
    models.set_defaults(func=cmd_models)
    _add_bench(sub, load=bool(argv) and argv[0] == "bench")
    return parser


def cmd_models(_: argparse.Namespace) -> int:
    from ironlm.model import registry

    for f in registry.families():
        gguf = ", ".join(f.gguf_archs) or "-"
        print(f"{'/'.join(f.hf_classes)}  (model_type {', '.join(f.model_types)}; GGUF {gguf})")
        if f.features:
            print(f"    {', '.join(f.features)}")
    return 0


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
    args = apply_config_file(parser, argv, parser.parse_args(argv))
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
