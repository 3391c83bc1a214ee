"""llama.cpp's own HF -> GGUF converter, for tests: the check that files made the way users make them load.

    convert(hf_dir, out_dir, outtype="f32") -> Path    # runs convert_hf_to_gguf.py in one converter process per session
    converter_dir() -> Path                            # the extracted converter (fetched once, cached)

The converter ships in the PyPI sdist of llama-cpp-python (vendor/llama.cpp/convert_hf_to_gguf.py, its
`conversion` package and gguf-py). The version is the one benches/build_llama_cpp.sh pins, so the converter and
the llama.cpp binaries of the baseline come from the same tree. The sdist (~75 MB) is fetched with pip once, only
the converter's Python files (~2 MB) are kept, under $IRONLM_CACHE_DIR (default ~/.cache/ironlm)
/llama-cpp-converter/<version>/; IRONLM_LLAMA_CPP_CONVERTER=<dir holding convert_hf_to_gguf.py> uses a checkout.

Output types are the converter's own: f32, f16, bf16, q8_0 (and auto, tq1_0, tq2_0). Q4_0 and the K-quants are not
made by the converter but by llama-quantize, a C++ binary; tests that need Q4_0 use make_tiny_gguf's writer.

Tokenizer: the converter names the BPE pre-tokenizer (`tokenizer.ggml.pre`) by hashing the token ids of a fixed
text, and refuses a hash outside its table. The tests' tiny tokenizer is GPT-2's byte-level BPE (GPT-2 split regex)
over its own vocabulary, so no table entry can match it. convert(pre_tokenizer="gpt-2") runs the unmodified
converter with that one fallback registered in its process: a hash the table knows keeps the table's name, an
unknown one gets `pre_tokenizer` (what an entry added by llama.cpp's convert_hf_to_gguf_update.py would say).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
_ROOT = Path(__file__).resolve().parents[1]
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")


def pinned_version() -> str:
    """llama-cpp-python version: $LLAMA_CPP_PYTHON_VERSION, else the pin in benches/build_llama_cpp.sh."""
    env = os.environ.get("LLAMA_CPP_PYTHON_VERSION")
    if env:
        return env
    text = (_ROOT / "benches" / "build_llama_cpp.sh").read_text()
    m = re.search(r'VERSION="\$\{LLAMA_CPP_PYTHON_VERSION:-([0-9][^}"]*)\}"', text)
    if m is None:
        raise RuntimeError("benches/build_llama_cpp.sh has no VERSION pin for llama-cpp-python")
    return m.group(1)


def _cache_root() -> Path:
    root = os.environ.get("IRONLM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ironlm"


def converter_dir() -> Path:
    """The folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/; fetched on first use."""
    override = os.environ.get("IRONLM_LLAMA_CPP_CONVERTER")
    if override:
        return Path(override)
    version = pinned_version()
    dest = _cache_root() / "llama-cpp-converter" / version
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # One fetch at a time across processes (several test runs share the cache).
    with open(dest.parent / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "convert_hf_to_gguf.py").is_file():
            _fetch(version, dest)
    return dest


def _sdist(version: str, into: Path) -> Path:
    """The sdist: one already fetched by benches/build_llama_cpp.sh, else pip download (3 tries)."""
    name = f"llama_cpp_python-{version}.tar.gz"
    local = Path(os.environ.get("LLAMA_CPP_DIR", _ROOT / ".llama.cpp")) / "sdist" / name
    if local.is_file():
        return local
    # --no-binary for this package only: with :all: pip would also build the sdist's build backend from source.
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "-q",
           "--no-binary", "llama-cpp-python", f"llama-cpp-python=={version}", "-d", str(into)]
    err = ""
    for attempt in range(3):
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if proc.returncode == 0 and (into / name).is_file():
            return into / name
        err = (proc.stderr or proc.stdout)[-2000:]
        time.sleep(2 * (attempt + 1))
    raise RuntimeError(f"could not download llama-cpp-python=={version} sdist from PyPI:\n{err}")


def _fetch(version: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        sdist = _sdist(version, Path(tmp))
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        staged = Path(tmp) / "converter"
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if rel and (m.isfile() or m.isdir()) and any(rel == k or rel.startswith(k) for k in _KEEP):
                    m.name = rel
                    members.append(m)
            tar.extractall(staged, members=members, filter="data")
        if not (staged / "convert_hf_to_gguf.py").is_file() or not (staged / "gguf-py" / "gguf").is_dir():
            raise RuntimeError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py with gguf-py")
        os.replace(staged, dest)  # atomic: a half-extracted folder is never seen as the cache


def convert(hf_dir: str | Path, out_dir: str | Path, outtype: str = "f32", pre_tokenizer: str | None = "gpt-2",
            name: str | None = None, timeout: float = 300.0) -> Path:
    """Convert an HF model folder with llama.cpp's converter; returns the .gguf path in `out_dir`.

    `pre_tokenizer`: the `tokenizer.ggml.pre` name for a tokenizer the converter's hash table does not know
    (None: refuse it, as the converter does)."""
    return convert_many([(hf_dir, outtype)], out_dir, pre_tokenizer, [name], timeout)[0]


def convert_many(jobs: list[tuple[str | Path, str]], out_dir: str | Path, pre_tokenizer: str | None = "gpt-2",
                 names: list[str | None] | None = None, timeout: float = 600.0) -> list[Path]:
    """Several (hf_dir, outtype) conversions in one call. Every call of the process goes to ONE converter process
    (started on first use, kept until exit): its imports (torch, transformers: ~5-10 s on 2 cores) are paid once
    per test session instead of once per test module. Same outputs as one fresh converter process per job."""
    out_paths: list[Path] = []
    argvs: list[list[str]] = []
    for i, (hf_dir, outtype) in enumerate(jobs):
        if outtype not in OUTTYPES:
            raise ValueError(f"outtype {outtype!r}: the converter writes {OUTTYPES} (Q4_0 needs llama-quantize)")
        hf_dir = Path(hf_dir)
        name = names[i] if names else None
        out = Path(out_dir) / (name or f"{hf_dir.name}.{outtype.upper()}.gguf")
        out.parent.mkdir(parents=True, exist_ok=True)
        out_paths.append(out)
        argvs.append([str(hf_dir), "--outtype", outtype, "--outfile", str(out)])
    with _LOCK:
        worker = _WORKERS.get(str(converter_dir()))
        if worker is None or not worker.alive():
            worker = _WORKERS[str(converter_dir())] = _Worker(converter_dir())
        error = worker.run(pre_tokenizer or "", argvs, timeout)
    missing = [str(p) for p in out_paths if not p.is_file()]
    if error is not None or missing:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (missing {missing}):\n{(error or '')[-4000:]}")
    return out_paths


class _Worker:
    """This file run as the converter process: one JSON job per stdin line, one JSON reply per job on stdout
    (the converter's own output goes to a log file, read back when a job fails)."""

    def __init__(self, conv: Path) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(conv / "gguf-py"), str(conv)]))
        env.pop("NO_LOCAL_GGUF", None)
        fd, name = tempfile.mkstemp(prefix="gguf-convert-", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        with open(self.log, "ab") as log:  # append mode: the child's writes never land where we read
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(conv)], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, pre_tokenizer: str, argvs: list[list[str]], timeout: float) -> str | None:
        """None when every job converted, else what went wrong (the converter's log of this call)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        start = self.log.stat().st_size
        try:
            self.proc.stdin.write(json.dumps({"pre": pre_tokenizer, "argvs": argvs}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died since the last call: the reply below reads as "exited"
            pass
        reply: list[str] = []
        reader = threading.Thread(target=lambda: reply.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not reply or not reply[0]:
            why = f"timed out after {timeout} s" if not reply else f"exited with {self.proc.poll()}"
            log = self._log_since(start)
            self.close()  # a hung or dead converter is never reused
            return f"converter process {why}:\n{log}"
        answer = json.loads(reply[0])
        return None if answer["ok"] else f"{answer['error']}\n{self._log_since(start)}"

    def _log_since(self, offset: int) -> str:
        with open(self.log, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")[-6000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.unlink(missing_ok=True)


_WORKERS: dict[str, _Worker] = {}
_LOCK = threading.Lock()


def _serve(conv: Path) -> None:
    """In the converter process: the converter's main() once per argv of each job, with the unknown-pre-tokenizer
    fallback of that job (none: the converter's own refusal)."""
    import runpy
    import traceback

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the converter prints goes to the log, never into a reply
    sys.stdout = sys.stderr
    sys.path[:0] = [str(conv), str(conv / "gguf-py")]
    from conversion import base  # the converter's package, found through sys.path above

    known = base.TextModel.get_vocab_base_pre
    fallback = {"pre": ""}

    def get_vocab_base_pre(self, tokenizer) -> str:  # type: ignore[no-untyped-def]
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if not fallback["pre"]:
                raise
            base.logger.warning("unknown BPE pre-tokenizer: using %r as the caller asked", fallback["pre"])
            return fallback["pre"]

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre  # type: ignore[method-assign]
    script = conv / "convert_hf_to_gguf.py"
    main = runpy.run_path(str(script), run_name="convert_hf_to_gguf")["main"]
    for line in sys.stdin:
        job = json.loads(line)
        fallback["pre"] = job["pre"]
        try:
            for argv in job["argvs"]:
                sys.argv = [str(script), *argv]
                main()
            answer = {"ok": True}
        except BaseException:  # noqa: BLE001 - SystemExit from argparse or the converter included: report it
            answer = {"ok": False, "error": traceback.format_exc()}
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
