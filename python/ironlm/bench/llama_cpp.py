"""llama.cpp as a baseline: its binaries, `llama-server` as a managed subprocess, and `llama-bench`.

The binaries come from `make llama-cpp` (benches/build_llama_cpp.sh), which builds the llama.cpp that the
`llama-cpp-python` sdist vendors into `.llama.cpp/build/bin`. They are looked up in `$IRONLM_LLAMA_CPP_DIR`
(the folder holding them, or a build folder with `bin/`), then in this checkout's `.llama.cpp/`, then on PATH.

Both engines get the same GGUF file, greedy sampling, EOS ignored and the same thread count. One
difference cannot be removed and is reported: llama.cpp computes with the weights as the file stores them
(Q4_1 for the default model), ironlm dequantizes them at load.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ironlm.bench.datasets import BenchRequest
from ironlm.bench.server_process import ServerProcess
from ironlm.exceptions import LlamaCppNotBuilt

DIR_ENV = "IRONLM_LLAMA_CPP_DIR"
BUILD_HINT = ("build it once with `make llama-cpp` (benches/build_llama_cpp.sh: llama.cpp from the llama-cpp-python "
              f"sdist, about 10 minutes on 2 cores), or point ${DIR_ENV} at a folder holding the binary")
# The repository checkout this package runs from (editable install): <root>/python/ironlm/bench/llama_cpp.py.
_CHECKOUT_BIN = Path(__file__).resolve().parents[3] / ".llama.cpp" / "build" / "bin"
# Slot contexts are whole multiples of this, with room to spare past prompt + output.
_CTX_ROUND = 256


def search_dirs() -> list[Path]:
    dirs: list[Path] = []
    custom = os.environ.get(DIR_ENV)
    if custom:
        root = Path(custom).expanduser()
        dirs += [root, root / "bin", root / "build" / "bin"]
    dirs.append(_CHECKOUT_BIN)
    return dirs


def find_binary(name: str, dirs: Sequence[Path] | None = None) -> Path:
    """The path of `llama-server` / `llama-bench`; raises LlamaCppNotBuilt saying how to build it."""
    candidates = list(search_dirs() if dirs is None else dirs)
    for d in candidates:
        path = Path(d) / name
        if path.is_file() and os.access(path, os.X_OK):
            return path
    on_path = shutil.which(name) if dirs is None else None
    if on_path:
        return Path(on_path)
    looked = ", ".join(str(d) for d in candidates)
    raise LlamaCppNotBuilt(f"llama.cpp's {name} is not built (looked in {looked} and PATH); {BUILD_HINT}")


def gguf_path(model: str | Path | None) -> Path:
    """The GGUF file llama.cpp loads for `model` (None: the built-in default model's file)."""
    from ironlm.model import default_model_path
    from ironlm.model import gguf as gguf_mod

    path = default_model_path() if model is None else Path(model).expanduser()
    found = gguf_mod.resolve_gguf(path)
    if found is None:
        raise ValueError(f"model: the llama.cpp baseline needs a .gguf file, got {str(path)!r}")
    return Path(found)


def slot_context(requests: Sequence[BenchRequest]) -> int:
    """Tokens of KV per llama-server slot: the longest prompt + output, rounded up with room to spare.

    A slot whose context fills stops its request early (llama-server shifts no context by default), which
    would make llama.cpp look faster on fewer tokens."""
    longest = max((r.prompt_len + r.output_len for r in requests), default=1)
    return (longest // _CTX_ROUND + 1) * _CTX_ROUND


def server_command(binary: str | Path, model: str | Path, *, host: str, port: int, threads: int,
                   parallel: int, ctx_per_slot: int) -> list[str]:
    """llama-server's command line: `parallel` slots of `ctx_per_slot` tokens each, `threads` for both
    decode and prompt processing, continuous batching (its default) and no web UI."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return [str(binary), "--model", str(model), "--host", host, "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads),
            # Without a per-slot KV split (no --kv-unified), -c is shared out evenly among the slots.
            "--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot), "--no-kv-unified",
            "--cont-batching", "--no-webui"]


class LlamaServer(ServerProcess):
    """llama-server on a free loopback port; ready when /health answers 200 (it answers 503 while loading)."""

    name = "llama-server"

    def __init__(self, model: str | Path, *, threads: int, parallel: int, ctx_per_slot: int,
                 binary: str | Path | None = None, host: str = "127.0.0.1") -> None:
        self.binary = Path(binary) if binary is not None else find_binary("llama-server")
        super().__init__(str(model), host=host)
        self.threads = threads
        self.parallel = parallel
        self.ctx_per_slot = ctx_per_slot

    def command(self) -> list[str]:
        assert self.model is not None  # always given: llama-server has no default model
        return [*server_command(self.binary, self.model, host=self.host, port=self.port, threads=self.threads,
                                parallel=self.parallel, ctx_per_slot=self.ctx_per_slot), *self.extra_args]

    def describe(self) -> dict[str, Any]:
        return {"binary": str(self.binary), "version": binary_version(self.binary), "threads": self.threads,
                "parallel": self.parallel, "ctx_per_slot": self.ctx_per_slot,
                "command": self.command()[1:]}


def binary_version(binary: str | Path) -> str:
    """`--version` of a llama.cpp binary (it prints to stderr), or "" when it cannot tell."""
    try:
        out = subprocess.run([str(binary), "--version"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else ""


def bench_command(binary: str | Path, model: str | Path, *, prompt_len: int, gen_len: int, threads: int,
                  repetitions: int = 1) -> list[str]:
    """llama-bench: one prefill test (pp`prompt_len`) and one decode test (tg`gen_len`), JSON on stdout."""
    return [str(binary), "-m", str(model), "-p", str(prompt_len), "-n", str(gen_len), "-t", str(threads),
            "-r", str(repetitions), "-o", "json"]


def parse_bench_json(text: str) -> dict[str, float]:
    """llama-bench's JSON rows → {"prefill_tok_s", "decode_tok_s"} (mean over its repetitions)."""
    rows = json.loads(text)
    out: dict[str, float] = {}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            out["prefill_tok_s"] = float(row["avg_ts"])
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            out["decode_tok_s"] = float(row["avg_ts"])
    missing = {"prefill_tok_s", "decode_tok_s"} - out.keys()
    if missing:
        raise RuntimeError(f"llama-bench output has no {sorted(missing)} row: {text[:500]}")
    return out


def run_bench(model: str | Path, *, prompt_len: int, gen_len: int, threads: int,
              binary: str | Path | None = None, timeout_s: float = 1800.0) -> dict[str, float]:
    """One llama-bench run (it loads the model and runs its own untimed warm-up pass first)."""
    exe = Path(binary) if binary is not None else find_binary("llama-bench")
    cmd = bench_command(exe, model, prompt_len=prompt_len, gen_len=gen_len, threads=threads)
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {out.returncode}:\n{out.stderr[-3000:]}")
    return parse_bench_json(out.stdout)
