"""The wheel: maturin builds it, it carries the Triton kernels, and a fresh venv can import it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


KERNELS = ("cache_write.py", "decode_attention.py", "prefill_attention.py")


def test_a_source_checkout_imports_the_top_level_kernels_in_place():
    """No symlinks or tracked copies in python/ironlm/kernels: the package reads kernels/ itself."""
    package = ROOT / "python" / "ironlm" / "kernels"
    assert not any(p.is_symlink() for p in package.iterdir())
    tracked = subprocess.run(["git", "ls-files", str(package)], cwd=ROOT, capture_output=True, text=True,
                             check=False)
    if tracked.returncode == 0:  # in a git checkout: the package's only tracked file is its __init__
        assert tracked.stdout.split() == ["python/ironlm/kernels/__init__.py"]
    for name in KERNELS:
        spec = importlib.util.find_spec(f"ironlm.kernels.{name[:-3]}")
        assert spec is not None and Path(spec.origin).resolve() == (ROOT / "kernels" / name).resolve()


@pytest.mark.skipif(shutil.which("cargo") is None, reason="needs the Rust toolchain")
def test_wheel_installs_into_a_fresh_venv_and_imports(tmp_path):
    maturin = Path(sys.executable).with_name("maturin")
    dist = tmp_path / "dist"
    env = {**os.environ, "PYO3_PYTHON": sys.executable}
    # The features `make install` built the extension with: cargo finds that build fresh and maturin only packs
    # the wheel (seconds, where the release wheel's own features recompile the crate: ~60 s on 2 cores). What is
    # checked is the packing (kernels, stubs, module name) and a fresh venv importing it; the feature set
    # without the test bindings compiles in `make lint-rust` (clippy --features python).
    subprocess.run([str(maturin), "build", "--release", "--features", "test-bindings", "-q", "-o", str(dist)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=900)
    (wheel,) = dist.glob("ironlm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("ironlm/_core.pyi", "ironlm/py.typed", "ironlm/kernels/__init__.py",
                     "ironlm/grpc/ironlm.proto"):
        assert expected in names
    with zipfile.ZipFile(wheel) as zf:  # the kernels are staged by the build, byte for byte
        for name in KERNELS:
            assert zf.read(f"ironlm/kernels/{name}") == (ROOT / "kernels" / name).read_bytes()
    assert not any(n.startswith("kernels/") for n in names)  # no top-level package named `kernels`
    assert any(n.startswith("ironlm/_core") and n.endswith(".so") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    uv = Path(sys.executable).with_name("uv")
    # A real install of the wheel (numpy is the one dependency `_core` needs); offline, from uv's cache.
    subprocess.run([str(uv), "pip", "install", "--offline", "--python", str(py), "--no-deps", str(wheel), "numpy"],
                   check=True, capture_output=True, timeout=300)
    site = next((venv / "lib").glob("python3*/site-packages"))
    code = ("import ironlm, ironlm._core as c; from ironlm.config import EngineConfig; "
            "s = c.Scheduler(EngineConfig(block_size=4, max_num_seqs=2).scheduler_config(num_blocks=8, "
            "max_num_batched_tokens=8, max_model_len=32, tier_blocks=0, sliding_window=None)); "
            "s.add_request('r', [1, 2, 3], 4); "
            "import importlib.util as u; kernel = u.find_spec('ironlm.kernels.decode_attention').origin; "
            "print(ironlm.__version__, s.schedule().num_tokens, ironlm.__file__, kernel)")
    out = subprocess.run([str(py), "-c", code], check=False, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    version, tokens, where, kernel = out.stdout.split()
    assert version == "0.1.0" and tokens == "3" and str(site) in where
    assert kernel == str(site / "ironlm" / "kernels" / "decode_attention.py")
