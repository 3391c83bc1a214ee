"""GET /health body: readiness, engine liveness (dead thread or a step stuck past its limit), KV headroom and
device memory headroom."""

from __future__ import annotations

import time
from typing import Any

from ironlm.engine import EngineClient
from ironlm.server.breaker import CircuitBreaker


def device_memory(device: Any) -> dict[str, Any]:
    """Free/total bytes of the device the model runs on (host RAM on CPU)."""
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return {"device": str(device), "free_bytes": int(free), "total_bytes": int(total)}
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    info[key] = int(rest.split()[0]) * 1024
    except OSError:  # not Linux: report what we know
        pass
    return {"device": str(device), "free_bytes": info.get("MemAvailable"), "total_bytes": info.get("MemTotal")}


def health_report(engine: EngineClient, model_name: str, started_at: float,
                  breaker: CircuitBreaker | None = None) -> tuple[bool, dict[str, Any]]:
    stats = engine.stats()
    if engine.dead_error is not None:
        status = "engine_dead"
    elif not engine.is_healthy:
        status = "engine_stopped"
    elif (stalled := engine.stalled_for) is not None:
        status = "engine_stalled"
    elif not engine.is_ready:
        status = "draining"
    else:
        status = "ok"
    body: dict[str, Any] = {
        "status": status,
        "model": model_name,
        "uptime_s": round(time.monotonic() - started_at, 3),
        "requests_in_flight": engine.num_inflight,
        "num_requests_running": stats.get("num_requests_running", 0),
        "num_requests_waiting": stats.get("num_requests_waiting", 0),
        "kv_cache": {"blocks_total": stats.get("blocks_total"), "blocks_free": stats.get("blocks_free"),
                     "blocks_cached": stats.get("blocks_cached"),
                     "usage_perc": stats.get("kv_cache_usage_perc")},
    }
    if breaker is not None:
        # Reported, never a 503: an open breaker means the engine is alive and being protected from load; a 503
        # here would make the orchestrator restart (or stop routing to) a pod that only needs the cool-down.
        body["circuit_breaker"] = breaker.snapshot()
    body["engine_restarts"] = stats.get("num_engine_restarts", 0)
    body["engine_step_failures_in_a_row"] = stats.get("engine_step_failures_in_a_row", 0)
    if engine.dead_error is not None:
        body["error"] = repr(engine.dead_error)
    if status == "engine_stalled":
        body["error"] = f"the current engine step has run for {stalled:.0f} s (limit {engine.stall_timeout_s:g} s)"
    try:
        body["device_memory"] = device_memory(engine.device)
    except Exception as exc:  # noqa: BLE001 - a probe must answer even if the driver query fails
        body["device_memory"] = {"error": repr(exc)}
    return status == "ok", body
