"""benches/gpu_check.sh, the GPU gate: its rules (benches/gpu_gate.py), a dry run of every check on the CPU (the
Triton interpreter, the CUDA-graph path without capture, a real `ironlm serve`), and a real mismatch failing the
run with a non-zero exit."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))
import gpu_gate as gate


@dataclass
class GateRun:
    proc: subprocess.CompletedProcess[str]
    report: dict


def _start_gate(out: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OUT": str(out)}
    env.pop("TRITON_INTERPRET", None)
    # Output to files: a full pipe would stall one run while the other is waited on.
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        return subprocess.Popen(["bash", str(ROOT / "benches" / "gpu_check.sh"), "--dry-run", *args], cwd=ROOT,
                                env=env, stdout=stdout, stderr=stderr, text=True)


def _finish_gate(proc: subprocess.Popen[str], out: Path) -> GateRun:
    proc.wait(timeout=900)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, (out / "stdout").read_text(),
                                       (out / "stderr").read_text())
    path = out / "gpu_check.json"
    return GateRun(done, json.loads(path.read_text()) if path.exists() else {})


@pytest.fixture(scope="module")
def gate_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GateRun]:
    """Both gate runs at once, each in its own process: most of either is single-threaded Python, so on CI's two
    cores the pair takes about as long as the longer one alone."""
    root = tmp_path_factory.mktemp("gate")
    tiny = make_tiny_model(root, arch="llama")
    # transformers loads another model (same shapes, other weights): ironlm's greedy tokens cannot all agree.
    other = make_tiny_model(root / "other", arch="llama", seed=7)
    outs = {name: root / name for name in ("dry", "mismatch")}
    for out in outs.values():
        out.mkdir()
    # gpu_check.sh copies a missing kernel into python/ironlm/kernels: done here first, so two runs never
    # write one file at once.
    for kernel in (ROOT / "kernels").glob("*.py"):
        if not (ROOT / "python" / "ironlm" / "kernels" / kernel.name).is_file():
            shutil.copy(kernel, ROOT / "python" / "ironlm" / "kernels" / kernel.name)
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        procs["dry"] = _start_gate(outs["dry"], "--model", str(tiny))
        procs["mismatch"] = _start_gate(outs["mismatch"], "--model", str(tiny), "--reference-model", str(other),
                                        "--only", "parity")
        return {name: _finish_gate(proc, outs[name]) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_rules_a_mismatch_an_error_or_nan_fails_skips_pass() -> None:
    ok = gate.judged("quant", "int8", 0.93, 0.8, higher_is_better=True)
    assert ok.status == "ok" and gate.verdict([ok]) == 0
    assert gate.judged("quant", "int8", 0.79, 0.8, higher_is_better=True).status == "FAIL"
    assert gate.judged("parity", "bf16 gap", 0.6, 0.5).status == "FAIL"
    assert gate.judged("parity", "bf16 gap", math.nan, 0.5).status == "FAIL"  # NaN never passes
    diff = gate.equal("graphs", "batch 3", [[1, 2]], [[1, 3]])
    assert diff.status == "FAIL" and diff.detail == {"got": [[1, 2]], "want": [[1, 3]]}
    assert gate.equal("kv_tier", "pinned", False, True, "yes").value == "no"
    raised = gate.error("serve", RuntimeError("server exited with 1"))
    skip = gate.skipped("quant", "fp8", "needs sm_89+")
    assert gate.verdict([ok, skip]) == 0
    assert gate.verdict([ok, skip, diff]) == 1 and gate.verdict([ok, raised]) == 1
    assert gate.verdict([]) == 1  # nothing ran: not a pass
    text = gate.table([ok, diff, raised, skip])
    lines = text.splitlines()
    assert lines[0].split() == list(gate.COLUMNS) and len(lines) == 5
    assert "FAIL" in lines[2] and "ERROR" in lines[3] and "RuntimeError: server exited" in lines[3]


def test_ties_and_first_difference() -> None:
    t = gate.ties([0.0, 0.0, 0.3, 0.0, 1.2], tol=0.5)
    assert (t.steps, t.top1, t.max_gap, t.first_off) == (5, 3, 1.2, 4)
    assert t.top1_rate == pytest.approx(0.6)
    assert gate.ties([0.0, 0.4], tol=0.5).first_off is None
    assert gate.ties([math.nan], tol=10).first_off == 0
    assert gate.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert gate.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert gate.first_difference([1, 2], [1, 2, 3]) == 2


def test_dry_run_runs_every_check_and_passes(gate_runs: dict[str, GateRun]) -> None:
    proc, report = gate_runs["dry"].proc, gate_runs["dry"].report
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = report["rows"]
    assert report["exit"] == 0 and all(r["status"] in ("ok", "skip") for r in rows)
    by_check = {c: [r for r in rows if r["check"] == c] for c in
                ("parity", "graphs", "quant", "kv_tier", "grammar", "serve", "kernels", "e2e")}
    assert all(by_check.values()), {c: len(v) for c, v in by_check.items()}
    cases = {r["case"] for r in rows}
    # The graph path ran (without capture, through the interpreter) and matched eager at padded sizes.
    assert "fp32 batch 3 (padded to 4) = eager" in cases and "cpu engine runs eager (no graphs)" in cases
    replayed = [r for r in by_check["graphs"] if "replayed" in r["case"]]
    assert replayed and all(int(r["value"]) > 0 for r in replayed)
    assert {"cache_write", "decode", "prefill", "fused_moe"} <= {r["case"].split()[0] for r in by_check["kernels"]}
    assert "completion text = offline engine's" in cases and "server alive at the end" in cases
    # One table, printed last: a header and one line per row.
    table = proc.stdout[proc.stdout.index("===== gpu_check"):].splitlines()[1:]
    assert table[0].split() == list(gate.COLUMNS) and len([ln for ln in table if ln.startswith(
        tuple(by_check))]) == len(rows)


def test_a_mismatch_fails_the_run(gate_runs: dict[str, GateRun]) -> None:
    proc, report = gate_runs["mismatch"].proc, gate_runs["mismatch"].report
    assert proc.returncode == 1, proc.stdout[-3000:]
    fp32 = next(r for r in report["rows"] if r["case"].startswith("fp32"))
    assert fp32["status"] == "FAIL" and fp32["detail"]["first_differences"]
    assert report["exit"] == 1 and "FAILED parity" in proc.stdout
