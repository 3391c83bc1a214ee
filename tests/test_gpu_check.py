"""benches/gpu_check.sh --dry-run: the GPU script runs end to end on CPU (interpreter kernels, tiny W)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_exercises_every_step(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(["bash", str(ROOT / "benches" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "-- kernels: ok" in out.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    text = json.dumps(report)
    for kernel in ("cache_write", "decode", "prefill"):
        assert kernel in text
    assert "ironlm / best" in out.stdout
