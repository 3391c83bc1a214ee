"""An engine and its app wired from the configs: what `ironlm serve` and each Ray Serve replica run."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI

from ironlm.config import EngineConfig, ServerConfig
from ironlm.engine.async_engine import AsyncLLMEngine
from ironlm.engine.llm_engine import LLMEngine
from ironlm.server.api import build_app

logger = logging.getLogger("ironlm.serve")


@dataclass(frozen=True)
class Assembled:
    engine: AsyncLLMEngine  # its loop already running
    app: FastAPI
    names: list[str]  # the served model names; the first is the one responses carry


def _load_off_main(config: EngineConfig) -> LLMEngine:
    """`LLMEngine(config)` (load and warm-up) in a thread of its own that then exits.

    The engine's steps run on its loop's thread. Had the main thread run torch's (or the core's) OpenMP regions
    too, libgomp would hold a second pool of workers for it, count more managed threads than cores and throttle
    every worker's spin-wait (~100 spins), so each of a step's ~150 parallel regions would wake a sleeping
    worker: measured on a 2-core Zen 4, a 1-row bf16 matmul 42 -> 90 us, one HF bf16 stream 61 -> 43 tok/s over
    HTTP. A thread that exits frees its pool, so the main thread here never makes one."""
    box: dict[str, LLMEngine | BaseException] = {}

    def load() -> None:
        try:
            box["engine"] = LLMEngine(config)
        except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread, whatever it is)
            box["error"] = e

    thread = threading.Thread(target=load, name="ironlm-load", daemon=True)  # Ctrl-C during a load exits
    thread.start()
    thread.join()
    error, engine = box.get("error"), box.get("engine")
    if isinstance(error, BaseException):
        raise error
    assert isinstance(engine, LLMEngine)
    return engine


def assemble(engine_config: EngineConfig, server_config: ServerConfig,
             served_model_names: list[str] | None = None, *, api_key: str | None = None) -> Assembled:
    """Load the model (LLMEngine), start its loop with the server's fault policy (AsyncLLMEngine) and build the
    app. `served_model_names` default to the model's own name; `api_key` wins over `server_config.api_key`.
    Logs each startup phase."""
    step_engine = _load_off_main(engine_config)
    for phase, seconds in step_engine.startup_timings.items():
        logger.info("phase %s: %.2fs", phase, seconds)
    t0 = time.perf_counter()
    s = server_config
    engine = AsyncLLMEngine(step_engine, stall_timeout_s=s.health_stall_timeout,
                            max_step_failures=s.engine_restart_after_failures, max_restarts=s.engine_max_restarts,
                            dedupe=s.dedupe_requests, result_cache_size=s.result_cache_size)
    names = list(served_model_names or [step_engine.model_name])
    app = build_app(engine, served_model_name=names, api_key=api_key, config=s)
    logger.info("phase engine loop + app: %.2fs (model %s, max_model_len %d)", time.perf_counter() - t0,
                names[0], step_engine.max_model_len)
    return Assembled(engine, app, names)
