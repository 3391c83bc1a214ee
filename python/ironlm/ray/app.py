"""The Ray Serve application: an HTTP ingress in front of `num_replicas` (or autoscaled) engine replicas,
routed by PrefixAffinityRouter. `build_application(...)` returns it for `serve.run`."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from ironlm.config import EngineConfig, ServerConfig
from ironlm.ray.config import RayConfig
from ironlm.ray.ingress import Ingress
from ironlm.ray.replica import EngineReplica
from ironlm.ray.routing import PrefixAffinityRouter

ENGINE_DEPLOYMENT = "IronlmEngine"
INGRESS_DEPLOYMENT = "IronlmIngress"
APP_NAME = "ironlm"


def engine_deployment_options(ray_config: RayConfig, server_config: ServerConfig) -> dict[str, Any]:
    """Ray Serve options of the engine replicas: resources, scaling, health checks, drain and the router."""
    router: dict[str, Any] = {
        "request_router_class": f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__qualname__}",
        "request_router_kwargs": {"routing": ray_config.routing, "margin": ray_config.affinity_margin},
    }
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "max_ongoing_requests": ray_config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": ray_config.replica_cpus, "num_gpus": ray_config.replica_gpus},
        "health_check_period_s": ray_config.health_check_period,
        "health_check_timeout_s": ray_config.health_check_timeout,
        # Downscaling (and redeploys) stop routing to a replica, then give its requests this long to finish
        # before __del__ shuts the engine down: the same drain `ironlm serve` does on SIGTERM.
        "graceful_shutdown_timeout_s": server_config.drain_timeout,
        "graceful_shutdown_wait_loop_s": 1.0,
        "request_router_config": RequestRouterConfig(**router),
    }
    if ray_config.max_replicas is not None:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=1 if ray_config.min_replicas is None else ray_config.min_replicas,
            max_replicas=ray_config.max_replicas,
            target_ongoing_requests=ray_config.target_ongoing_requests)
    else:
        options["num_replicas"] = ray_config.num_replicas
    return options


def build_application(engine_config: EngineConfig, server_config: ServerConfig | None = None,
                      ray_config: RayConfig | None = None,
                      served_model_names: list[str] | None = None) -> serve.Application:
    server_config = server_config or ServerConfig()
    ray_config = ray_config or RayConfig()
    threads = max(1, round(ray_config.replica_cpus))
    engine = serve.deployment(**engine_deployment_options(ray_config, server_config))(EngineReplica)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
        # Streams may be long: the ingress holds each one while its engine replica generates.
        max_ongoing_requests=max(ray_config.max_ongoing_requests * 16, 1024),
        graceful_shutdown_timeout_s=server_config.drain_timeout)(Ingress)
    return ingress.bind(engine.bind(engine_config, server_config, threads, served_model_names),
                        ray_config.affinity_block, ray_config.max_retries)
