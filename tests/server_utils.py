"""Live servers for the serving tests: uvicorn on 127.0.0.1 in a background thread.

The socket is bound before uvicorn starts (port 0, handed over with `sockets=`), so there is no
free-port race. One tiny-model engine + server is shared by every serving test module in the process:
loading even a tiny model costs more than the tests that use it.
"""

from __future__ import annotations

import atexit
import socket
import threading
import time
from typing import Any

import uvicorn

from ironlm.async_engine import AsyncLLMEngine
from ironlm.server.api import build_app

TINY_ENGINE_KW = {"num_kv_blocks": 256, "block_size": 4, "max_model_len": 256, "max_num_seqs": 64}


class LiveServer:
    def __init__(self, app: Any, engine: AsyncLLMEngine | None = None) -> None:
        self.app, self.engine = app, engine
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
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


def tiny_engine(tmp_dir: Any, **overrides: Any) -> AsyncLLMEngine:
    from ironlm.config import EngineConfig
    from ironlm.engine import LLMEngine
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_dir, arch="llama")
    kw = {**TINY_ENGINE_KW, **overrides}
    return AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", **kw)))


_SHARED: dict[str, LiveServer] = {}


def shared_server(tmp_path_factory: Any) -> LiveServer:
    """The tiny-model server every serving module uses (created on first use, stopped at exit)."""
    if "server" not in _SHARED:
        engine = tiny_engine(tmp_path_factory.mktemp("tiny-serve"))
        server = LiveServer(build_app(engine, served_model_name="tiny"), engine)
        _SHARED["server"] = server
        atexit.register(server.stop)
    return _SHARED["server"]


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
