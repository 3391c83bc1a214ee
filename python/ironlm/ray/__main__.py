"""`python -m ironlm.ray [MODEL] [engine, server and Ray flags]`: ironlm as Ray Serve replicas behind one HTTP
endpoint (--host/--port), until SIGTERM/SIGINT, which drains every replica (--drain-timeout) and stops Serve."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import fields, replace

from ironlm.cli_args import (
    HelpFormatter,
    _add_fields,
    add_engine_args,
    add_server_args,
    config_from_args,
    model_from_args,
    server_config_from_args,
)
from ironlm.ray.config import RayConfig

logger = logging.getLogger("ironlm.ray")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ironlm.ray", formatter_class=HelpFormatter,
                                     description="ironlm replicas on Ray Serve with prefix-affinity routing")
    add_engine_args(parser)
    add_server_args(parser)
    _add_fields(parser.add_argument_group("ray"), RayConfig, ())
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server = server_config_from_args(args)
    server = replace(server, api_key=server.api_key or os.environ.get("IRONLM_API_KEY") or None)
    ray_config = RayConfig(**{f.name: getattr(args, f.name) for f in fields(RayConfig)})
    engine_config = config_from_args(args, model_from_args(args))
    logging.basicConfig(level=getattr(logging, server.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if server.host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
        logger.warning("binding %s without --api-key: anyone who can reach it can use the model", server.host)

    import ray
    from ray import serve

    from ironlm.ray.app import APP_NAME, build_application

    ray.init(address=ray_config.ray_address)
    serve.start(http_options={"host": server.host, "port": server.port})
    app = build_application(engine_config, server, ray_config, served_model_names=args.served_model_name)
    serve.run(app, name=APP_NAME, route_prefix="/")
    scale = (f"autoscaling {ray_config.min_replicas or 1}..{ray_config.max_replicas}" if ray_config.autoscaling
             else f"{ray_config.num_replicas} replicas")
    logger.info("ready: http://%s:%d, %s, routing %s", server.host, server.port, scale, ray_config.routing)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    logger.info("stopping: draining replicas for up to %.0f s", server.drain_timeout)
    serve.delete(APP_NAME)  # waits for each replica's graceful shutdown
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
