"""Start a server (`ironlm serve`, or a baseline's) as a subprocess on 127.0.0.1 with a free port, wait for
/health, stop it; read its /metrics text."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_LAUNCH = "import sys; from ironlm.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_vocab_size(model: str | None) -> int:
    """The vocabulary size of a local model (None: the built-in default), read from its metadata only."""
    from ironlm.model import default_model_path, loader
    from ironlm.model import gguf as gguf_mod

    path = default_model_path() if model is None else Path(model).expanduser()
    gguf_path = gguf_mod.resolve_gguf(path)
    if gguf_path is not None:
        gf = gguf_mod.GGUFFile(gguf_path)
        try:
            return int(gguf_mod.gguf_config(gf).vocab_size)
        finally:
            gf.close()
    if loader.is_hf_folder(path):
        return int(loader.load_hf_config(path).vocab_size)
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def model_tokenizer(model: str | None) -> Any:
    """The tokenizer of a local model (None: the built-in default), as the server loads it."""
    from ironlm.model import default_model_path, loader
    from ironlm.model import gguf as gguf_mod

    path = default_model_path() if model is None else Path(model).expanduser()
    gguf_path = gguf_mod.resolve_gguf(path)
    if gguf_path is not None:
        return gguf_mod.load_gguf_tokenizer(gguf_path)
    return loader.load_hf_tokenizer(path)


class ServerProcess:
    """`ironlm serve`; subclasses start another server by overriding `name` and `command()`."""

    name = "ironlm serve"

    def __init__(self, model: str | None, extra_args: list[str] | None = None, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None) -> None:
        self.model = model
        self.extra_args = list(extra_args or [])
        self.host = host
        self.env = dict(env or {})
        self.port = 0
        self.proc: subprocess.Popen | None = None
        # Lives as long as the server process, closed in stop(): no `with` block fits that lifetime.
        self._log = tempfile.NamedTemporaryFile(prefix="ironlm-serve-", suffix=".log", delete=False)  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        model = [] if self.model is None else ["--model", self.model]
        return [sys.executable, "-c", _LAUNCH, "serve", *model, "--host", self.host, "--port", str(self.port),
                "--drain-timeout", "5", *self.extra_args]

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def start(self, timeout_s: float = 600.0) -> None:
        import httpx

        self.port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc, tail = self.proc.returncode, self.log_tail()
                self.stop()
                raise RuntimeError(f"{self.name} exited with {rc}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"{self.name} was not healthy after {timeout_s:.0f} s:\n{tail}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            terminate(self.proc)
        self.proc = None
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)  # errors already carry its tail


def terminate(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if `proc` has not exited within `grace_s`; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format -> (name, labels, value) samples."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, label_text = head.partition("{")
        labels = {}
        for part in label_text.rstrip("}").split(","):
            key, sep, val = part.partition("=")
            if sep:
                labels[key.strip()] = val.strip().strip('"')
        try:
            samples.append((name, labels, float(value)))
        except ValueError:
            continue
    return samples
