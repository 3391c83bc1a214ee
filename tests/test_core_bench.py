"""The scheduler benchmark stays runnable, and its Python reference builds the Rust core's arrays."""

from __future__ import annotations

import pytest

from ironlm.bench import scheduler


def test_python_reference_matches_rust_plans() -> None:
    scheduler.check_same_plan(num_seqs=6, prompt_len=37, steps=40)


def test_bench_smoke() -> None:
    result = scheduler.run(num_seqs_list=(8, 32), steps=5, repeats=1, verbose=False)
    rows = result["results"]
    assert [r["num_seqs"] for r in rows] == [8, 32]
    for r in rows:
        assert r["rust_us"] > 0 and r["python_us"] > 0
        # The reported speed-ups are the ratios of the reported timings (to their rounding).
        assert r["speedup"] == pytest.approx(r["python_us"] / r["rust_us"], rel=0.01, abs=0.06)
        assert r["speedup_cpu"] == pytest.approx(r["python_cpu_us"] / r["rust_cpu_us"], rel=0.01, abs=0.06)
    # Thread CPU time ignores other processes on a loaded machine (wall time does not): at 32 sequences the
    # Python reference does far more work per step than the core.
    assert rows[1]["speedup_cpu"] > 1.0, rows[1]
