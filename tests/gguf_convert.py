"""llama.cpp's own HF -> GGUF converter, for tests: the check that files made the way users make them load.

    convert(hf_dir, out_dir, outtype="f32") -> Path    # runs convert_hf_to_gguf.py in a subprocess
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

import fcntl
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
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
    """Several (hf_dir, outtype) conversions in ONE converter process: the converter's imports (torch,
    transformers: ~5 s on 2 cores) are paid once. Same outputs as one convert() per job."""
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
    conv = converter_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(conv / "gguf-py"), str(conv)]))
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, str(Path(__file__).resolve()), str(conv), pre_tokenizer or "", json.dumps(argvs)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=timeout)
    missing = [str(p) for p in out_paths if not p.is_file()]
    if proc.returncode != 0 or missing:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc {proc.returncode}, missing {missing}):\n"
                           f"{proc.stderr[-4000:]}")
    return out_paths


def _run_converter(conv: Path, pre_tokenizer: str, argvs: list[list[str]]) -> None:
    """In the subprocess: the converter's own main() once per argv, with the unknown-pre-tokenizer fallback."""
    import runpy

    sys.path[:0] = [str(conv), str(conv / "gguf-py")]
    if pre_tokenizer:
        from conversion import base  # the converter's package, found through sys.path above

        known = base.TextModel.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer) -> str:  # type: ignore[no-untyped-def]
            try:
                return known(self, tokenizer)
            except NotImplementedError:
                base.logger.warning("unknown BPE pre-tokenizer: using %r as the caller asked", pre_tokenizer)
                return pre_tokenizer

        base.TextModel.get_vocab_base_pre = get_vocab_base_pre  # type: ignore[method-assign]
    script = conv / "convert_hf_to_gguf.py"
    main = runpy.run_path(str(script), run_name="convert_hf_to_gguf")["main"]
    for argv in argvs:
        sys.argv = [str(script), *argv]
        main()


if __name__ == "__main__":
    _run_converter(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
