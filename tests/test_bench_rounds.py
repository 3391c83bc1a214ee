"""bench/serve_rounds.py's pure parts: the alternating order, the ratios, held-back requests, the CPU split."""

from __future__ import annotations

import os

import pytest

from ironlm.bench import report
from ironlm.bench import serve_rounds as sr
from ironlm.bench.serve import RequestResult


def _result(tokens: int, chunks: int, start: float, ttft: float, latency: float) -> RequestResult:
    r = RequestResult(prompt_len=8, expected_output_len=tokens, output_tokens=tokens, token_chunks=chunks,
                      ttft=ttft, latency=latency, start=start, end=start + latency)
    r.success = chunks > 0
    r.error = "" if r.success else "no tokens streamed"
    return r


def test_held_back_requests_count_in_throughput_not_in_latency():
    streamed = _result(10, 10, 0.0, 0.5, 2.0)
    held = _result(6, 0, 0.0, 0.0, 3.0)  # the server sent its text only as a usage count
    failed = _result(0, 0, 0.0, 0.0, 1.0)
    s = sr.summarize_run([streamed, held, failed], duration=4.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["held_back"] == 1
    assert s["output_tokens"] == 16 and s["output_token_throughput"] == pytest.approx(4.0)
    # latencies from the streamed request alone: the held one's TTFT (0) would drag the median down
    assert s["ttft_ms"]["median"] == pytest.approx(500.0) and s["e2el_ms"]["median"] == pytest.approx(2000.0)
    assert sr.summarize_run([_result(4, 4, 0.0, 0.1, 1.0)], 1.0)["held_back"] == 0


def test_rounds_alternate_and_ratios_pair_each_round(monkeypatch):
    order = []

    def fake_once(engine, config, ds, warm, label):
        order.append(engine.name)
        tok_s = {"a": 30.0, "b": 10.0}[engine.name] + len(order)
        return {"engine": engine.name, "summary": {"output_token_throughput": tok_s}}

    monkeypatch.setattr(sr, "run_once", fake_once)
    engines = [sr.Engine("a", lambda: None), sr.Engine("b", lambda: None)]
    report = sr.run_rounds(engines, None, None, None, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert report["median_output_tok_s"] == {"a": 34.0, "b": 13.0}  # a: 31, 34, 35; b: 12, 13, 16
    r = sr.ratios(report, "a", "b")
    assert r["per_round"] == pytest.approx([31 / 12, 34 / 13, 35 / 16])
    assert r["of_medians"] == pytest.approx(34 / 13)
    with pytest.raises(ValueError, match="rounds"):
        sr.run_rounds(engines, None, None, None, rounds=0)


def test_cpu_split_finds_a_child_process_in_the_server_tree():
    import subprocess
    import sys
    import time

    watch = report.CpuWatch()
    watch.start()
    # a parent whose child burns CPU: the child's time belongs to the parent's tree, not to "other processes"
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time\\nt=time.process_time()\\n" \
           "while time.process_time() - t < 0.3: pass\\nimport sys; sys.stdin.read()'])"
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        child = None
        for _ in range(400):  # wait (up to minutes on a loaded machine) for the child to have burnt its 0.3 s
            kids = [p for p, (_, ppid, _) in report.proc_ticks().items() if ppid == parent.pid]
            if kids and report.proc_ticks()[kids[0]][2] >= 0.3 * os.sysconf("SC_CLK_TCK") - 1:
                child = kids[0]
                break
            time.sleep(0.5)
        assert child is not None
        assert report.process_tree(parent.pid, report.proc_ticks()) >= {parent.pid, child}
        cpu = watch.stop(parent.pid)
    finally:
        parent.communicate(b"")
    assert cpu["server_cores"] * cpu["wall_s"] >= 0.25  # the child's 0.3 s, less tick rounding
    assert 0 <= cpu["other_cores"] and cpu["machine_busy_cores"] <= (cpu["cpus"] or 1) + 0.5
    assert all(o["pid"] not in (parent.pid, child) for o in cpu["top_others"])
