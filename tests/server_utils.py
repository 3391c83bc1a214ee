"""Live servers for the serving tests: uvicorn on 127.0.0.1 in a background thread, gRPC likewise.

The socket is bound before uvicorn starts (port 0, handed over with `sockets=`), so there is no
free-port race. One tiny-model engine + server is shared by every serving test module in the process:
loading even a tiny model costs more than the tests that use it. Tests that need their own engine
(other limits, fault injection) build it from the same tiny model folder (`real_server`).

Fault injection happens on the real engine: `ForwardFaults` wraps the model's forward so a test can make
it raise (as a CUDA error or an out-of-memory would), block, or slow down, on the engine's own thread.
"""

from __future__ import annotations

import asyncio
import atexit
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import uvicorn

from ironlm.config import ServerConfig
from ironlm.engine import AsyncLLMEngine  # re-exported for the tests: one import site to update
from ironlm.grpc import ironlm_pb2_grpc as pb_grpc
from ironlm.server.api import build_app
from ironlm.server.grpc_service import start_grpc_server
from ironlm.server.http_limits import uvicorn_options

# float32 explicitly: the serving tests compare greedy text exactly, whatever "auto" resolves to.
TINY_ENGINE_KW = {"num_kv_blocks": 256, "block_size": 4, "max_model_len": 256, "max_num_seqs": 64,
                  "dtype": "float32"}


class LiveServer:
    def __init__(self, app: Any, engine: AsyncLLMEngine | None = None, limits: ServerConfig | None = None) -> None:
        """`limits`: also apply `ironlm serve`'s connection limits (server/http_limits.py) from this config."""
        self.app, self.engine = app, engine
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        options = uvicorn_options(limits) if limits is not None else {}
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class GrpcServer:
    """grpc.aio needs an event loop: give it its own, in a thread."""

    def __init__(self, engine: AsyncLLMEngine, api_key: str | None = None, model_names: tuple[str, ...] = ("tiny",)):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        start = start_grpc_server(engine, "127.0.0.1", 0, list(model_names), api_key)
        self.server, port = asyncio.run_coroutine_threadsafe(start, self.loop).result(20)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.GenerationStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


_SHARED: dict[str, Any] = {}


def tiny_model_path(tmp_path_factory: Any) -> Path:
    """One tiny llama folder per test process (building it costs more than loading it)."""
    if "model" not in _SHARED:
        from tiny_models import make_tiny_model

        _SHARED["model"] = make_tiny_model(tmp_path_factory.mktemp("tiny-model"), arch="llama")
    return _SHARED["model"]


def tiny_engine(tmp_path_factory: Any, **overrides: Any) -> AsyncLLMEngine:
    from ironlm import EngineConfig, LLMEngine

    kw = {**TINY_ENGINE_KW, **overrides}
    return AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tiny_model_path(tmp_path_factory)), device="cpu", **kw)))


def shared_server(tmp_path_factory: Any) -> LiveServer:
    """The tiny-model server every serving module uses (created on first use, stopped at exit)."""
    if "server" not in _SHARED:
        engine = tiny_engine(tmp_path_factory)
        server = LiveServer(build_app(engine, served_model_name="tiny"), engine)
        _SHARED["server"] = server
        atexit.register(server.stop)
    return _SHARED["server"]


class RealServer:
    """A private tiny-model engine behind HTTP (and gRPC on demand), with its forward open to fault injection."""

    def __init__(self, tmp_path_factory: Any, *, grpc_server: bool = False, **engine_kw: Any) -> None:
        self.engine = tiny_engine(tmp_path_factory, **engine_kw)
        self.faults = ForwardFaults(self.engine.engine)
        self.http = LiveServer(build_app(self.engine, served_model_name="tiny"), self.engine)
        self.url, self.base_url = self.http.url, self.http.base_url
        self.rpc = GrpcServer(self.engine) if grpc_server else None
        self.initial = self.engine.stats()

    def kv_blocks(self) -> dict[str, int]:
        s = self.engine.stats()
        return {k: s[k] for k in ("blocks_used", "blocks_free", "blocks_cached", "num_requests_running",
                                  "num_requests_waiting")}

    def idle(self) -> bool:
        """Nothing in flight and every KV block back: free again, or held only by the prefix cache."""
        s = self.engine.stats()
        return (self.engine.num_inflight == 0 and s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0
                and s["blocks_used"] == 0 and s["blocks_free"] + s["blocks_cached"] == self.initial["blocks_free"])

    def stop(self) -> None:
        self.faults.gate.set()
        self.faults.delay = 0.0
        if self.rpc is not None:
            self.rpc.stop()
        self.http.stop()


def model_of(engine: Any) -> Any:
    """The torch module a real LLMEngine runs (on the engine itself or on its model runner)."""
    for owner in (engine, getattr(engine, "model_runner", None), getattr(engine, "runner", None)):
        model = getattr(owner, "model", None)
        if model is not None and callable(getattr(model, "forward", None)):
            return model
    raise AttributeError(f"cannot find the model of {type(engine).__name__}: update tests/server_utils.model_of")


class ForwardFaults:
    """Wraps a real engine's model forward (an instance attribute shadows the class's `forward`, and
    `nn.Module.__call__` looks it up on the instance), so it runs on the engine thread like the real one.

    fail_next   the next N forwards raise `error` (a RuntimeError by default; a BaseException kills the loop)
    gate        cleared: forwards block until it is set (holds a step in flight)
    delay       seconds each forward sleeps first (keeps requests running long enough to observe)
    """

    def __init__(self, engine: Any) -> None:
        self.model = model_of(engine)
        self.fail_next = 0
        self.error: BaseException = RuntimeError("injected forward failure")
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.0
        self.calls = self.failures = 0
        self._forward = self.model.forward
        self.model.forward = self._forward_with_faults
        # A CUDA-graph replay runs the recorded kernels without calling forward: every step must come through here.
        runner = getattr(engine, "runner", None)
        if runner is not None and hasattr(runner, "disable_cuda_graphs"):
            runner.disable_cuda_graphs()

    def _forward_with_faults(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.gate.wait(30)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_next > 0:
            self.fail_next -= 1
            self.failures += 1
            raise self.error
        return self._forward(*args, **kwargs)

    def remove(self) -> None:
        del self.model.forward


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
