"""The wheel: maturin builds it, it carries the Triton kernels, and a fresh venv can import it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_file_is_linked_into_the_package():
    kernels = sorted(p.name for p in (ROOT / "kernels").glob("*.py"))
    linked = ROOT / "python" / "ironlm" / "kernels"
    assert "decode_attention.py" in kernels and "prefill_attention.py" in kernels
    for name in kernels:
        link = linked / name
        assert link.is_symlink(), f"{link} must be a symlink to kernels/{name} (so the wheel ships it)"
        assert link.resolve() == (ROOT / "kernels" / name).resolve()


@pytest.mark.skipif(shutil.which("cargo") is None, reason="needs the Rust toolchain")
def test_wheel_installs_into_a_fresh_venv_and_imports(tmp_path):
    maturin = Path(sys.executable).with_name("maturin")
    dist = tmp_path / "dist"
    env = {**os.environ, "PYO3_PYTHON": sys.executable}
    subprocess.run([str(maturin), "build", "--release", "-q", "-o", str(dist)], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=900)
    (wheel,) = dist.glob("ironlm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("ironlm/_core.pyi", "ironlm/py.typed", "ironlm/kernels/decode_attention.py",
                     "ironlm/kernels/prefill_attention.py", "ironlm/kernels/cache_write.py",
                     "ironlm/grpc/ironlm.proto"):
        assert expected in names
    assert any(n.startswith("ironlm/_core") and n.endswith(".so") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    uv = Path(sys.executable).with_name("uv")
    # A real install of the wheel (numpy is the one dependency `_core` needs); offline, from uv's cache.
    subprocess.run([str(uv), "pip", "install", "--offline", "--python", str(py), "--no-deps", str(wheel), "numpy"],
                   check=True, capture_output=True, timeout=300)
    site = next((venv / "lib").glob("python3*/site-packages"))
    code = ("import ironlm, ironlm._core as c; s = c.Scheduler(num_blocks=8, block_size=4, max_num_seqs=2, "
            "max_num_batched_tokens=8, max_model_len=32); s.add_request('r', [1, 2, 3], 4); "
            "print(ironlm.__version__, s.schedule().num_tokens, ironlm.__file__)")
    out = subprocess.run([str(py), "-c", code], check=False, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    version, tokens, where = out.stdout.split()
    assert version == "0.1.0" and tokens == "3" and str(site) in where
