"""The scheduler benchmark stays runnable, and its Python reference builds the Rust core's arrays."""

from __future__ import annotations

from ironlm.bench import scheduler


def test_python_reference_matches_rust_plans() -> None:
    scheduler.check_same_plan(num_seqs=6, prompt_len=37, steps=40)


def test_bench_smoke() -> None:
    result = scheduler.run(num_seqs_list=(8, 32), steps=5, repeats=1, verbose=False)
    rows = result["results"]
    assert [r["num_seqs"] for r in rows] == [8, 32]
    for r in rows:  # timings only: a loaded machine can make any of them look bad
        assert r["rust_us"] > 0 and r["python_us"] > 0 and r["speedup"] >= 0
