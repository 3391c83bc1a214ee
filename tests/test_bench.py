"""`ironlm bench`: datasets, accounting, reports and plots, on tiny random models.

The throughput tests run the real comparison (ironlm vs transformers in one process) on a few short requests;
the serve test drives a live HTTP server over real streaming.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from ironlm.bench import serve as sv
from ironlm.bench import throughput as tp
from ironlm.bench.datasets import PrefixSpec, RandomSpec, make_dataset, token_floor

TINY_ENGINE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256, "block_size": 4, "max_model_len": 256,
               "max_num_seqs": 64}
TINY_RANDOM = RandomSpec(num_requests=6, input_len=(4, 16), output_len=(3, 8), seed=1)


# ---- datasets ---------------------------------------------------------------------------------
def test_random_dataset_is_seeded_and_in_range():
    spec = RandomSpec(num_requests=50, input_len=(32, 512), output_len=(16, 256), seed=0)
    a, b = make_dataset("random", 49152, random=spec), make_dataset("random", 49152, random=spec)
    assert a.requests == b.requests
    other = make_dataset("random", 49152, random=RandomSpec(50, (32, 512), (16, 256), seed=1))
    assert other.requests != a.requests
    low = token_floor(49152)
    for r in a.requests:
        assert 32 <= r.prompt_len <= 512 and 16 <= r.output_len <= 256
        assert all(low <= t < 49152 for t in r.prompt_token_ids)
    s = a.summary()
    assert s["num_requests"] == 50 and s["output_tokens"] == sum(r.output_len for r in a.requests)
    assert s["config"]["seed"] == 0 and s["config"]["vocab_size"] == 49152


def test_workload_w_defaults():
    ds = make_dataset("random", 49152)
    assert len(ds.requests) == 64 and ds.config["input_len"] == (32, 512) and ds.config["output_len"] == (16, 256)
    assert ds.requests == make_dataset("random", 49152).requests


def test_prefix_dataset_shares_exactly_the_prefix():
    ds = make_dataset("prefix", 1000, prefix=PrefixSpec(num_requests=8, prefix_len=64, suffix_len=8, output_len=4))
    prefix = ds.requests[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == prefix and r.prompt_len == 72 and r.output_len == 4 for r in ds.requests)
    suffixes = {tuple(r.prompt_token_ids[64:]) for r in ds.requests}
    assert len(suffixes) == 8
    assert ds.requests == make_dataset("prefix", 1000, prefix=PrefixSpec(8, 64, 8, 4)).requests


def test_bad_ranges_are_rejected():
    with pytest.raises(ValueError, match="input_len"):
        make_dataset("random", 100, random=RandomSpec(4, (10, 5), (1, 2)))
    with pytest.raises(ValueError, match="unknown dataset"):
        make_dataset("sonnet", 100)


# ---- serving arithmetic (no server) ------------------------------------------------------------
def test_arrivals_poisson_rate_and_inf():
    assert sv.arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    offs = sv.arrival_offsets(4000, 20.0, 1.0, 0)
    assert offs == sorted(offs) and offs == sv.arrival_offsets(4000, 20.0, 1.0, 0)
    assert abs(offs[-1] / (len(offs) - 1) - 1 / 20.0) < 0.005
    poisson_gaps = np.diff(offs)
    bursty_gaps = np.diff(sv.arrival_offsets(4000, 20.0, 0.25, 0))
    assert abs(bursty_gaps.mean() - 1 / 20.0) < 0.01  # same mean rate...
    assert bursty_gaps.std() > 1.5 * poisson_gaps.std()  # ...burstier gaps
    with pytest.raises(ValueError):
        sv.arrival_offsets(3, 0.0, 1.0, 0)


def test_summary_percentiles_goodput_and_busy_fraction():
    results = []
    for i in range(10):
        r = sv.RequestResult(prompt_len=10, expected_output_len=5, success=True, output_tokens=5, token_chunks=5,
                             ttft=0.1 * (i + 1), latency=0.1 * (i + 1) + 0.4, itl=[0.1] * 4,
                             start=float(i), end=float(i) + 0.5)
        results.append(r)
    results.append(sv.RequestResult(prompt_len=10, expected_output_len=5, error="HTTP 500", start=0.0, end=0.1))
    s = sv.summarize(results, duration=10.0, slo={"ttft": 500.0, "tpot": 150.0})
    assert s["completed"] == 10 and s["failed"] == 1 and s["output_tokens"] == 50
    assert s["request_throughput"] == pytest.approx(1.0) and s["output_token_throughput"] == pytest.approx(5.0)
    assert s["ttft_ms"]["median"] == pytest.approx(550.0) and s["ttft_ms"]["mean"] == pytest.approx(550.0)
    assert s["ttft_ms"]["median"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] <= s["ttft_ms"]["max"]
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0) and s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["goodput"]["good_requests"] == 5  # ttft 100..500 ms
    assert s["busy_fraction"] == pytest.approx(0.5)  # ten disjoint half-second requests in 10 s
    assert s["errors"] == ["HTTP 500"]


# ---- throughput on a tiny model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("bench"), arch="llama"))


def _config(model: str, **kw) -> tp.ThroughputConfig:
    base = {"model": model, "random": TINY_RANDOM, "baseline": "transformers", "baseline_batch_sizes": (2, 4),
            "progress": False, "engine_args": dict(TINY_ENGINE)}
    return tp.ThroughputConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def normal_report(tiny_model):
    from ironlm.llm import LLM

    generated: list[int] = []
    original = LLM.generate

    def counting(self, *args, **kwargs):
        outs = original(self, *args, **kwargs)
        generated.append(sum(len(c.token_ids) for o in outs for c in o.outputs))
        return outs

    mp = pytest.MonkeyPatch()
    mp.setattr(LLM, "generate", counting)
    try:
        report = tp.run(_config(tiny_model, repeats=2))  # alternating, medians: as the real bench runs
    finally:
        mp.undo()
    return report, generated


def test_token_counts_match_what_was_generated(normal_report):
    report, generated = normal_report
    expected = report["dataset"]["output_tokens"]
    ironlm = report["results"][0]
    assert ironlm["engine"] == "ironlm"
    assert generated[1:] == [expected] * 2  # the timed generate calls (after one warm-up), EOS ignored
    assert ironlm["output_tokens"] == expected and len(ironlm["samples_s"]) == 2
    assert ironlm["requests_short"] == 0 and ironlm["num_requests"] == 6
    labels = [r["label"] for r in report["results"][1:]]
    assert labels == ["transformers 1-at-a-time", "transformers static bs=2", "transformers static bs=4"]
    for r in report["results"][1:]:
        assert r["output_tokens"] == expected  # only each request's own tokens
        assert r["generated_tokens"] >= expected
        assert r["output_tokens_per_s"] == pytest.approx(expected / r["elapsed_s"])
        assert r["first_token_agreement"] == 1.0  # same fp32 weights, same prompts, greedy
    assert report["results"][1]["generated_tokens"] == expected  # one at a time: no padding rows
    best = max(report["results"][1:], key=lambda r: r["output_tokens_per_s"])
    assert report["best_baseline"] == best["label"]
    assert report["ratio_vs_best_baseline"] == pytest.approx(ironlm["output_tokens_per_s"] / best["output_tokens_per_s"])
    ov = report["step_overhead"]
    assert set(ov["phases_s"]) >= {"schedule", "forward", "sample"}
    assert sum(ov["phases_pct"].values()) == pytest.approx(100.0)
    assert 0 < ov["model_pct"] <= 100.0


SLOW_S = 0.5  # per forward: large against the noise of a busy 2-core machine


def test_slowed_engine_shows_a_lower_ratio(tiny_model, normal_report, monkeypatch):
    from ironlm.model import DecoderLM

    original = DecoderLM.forward

    def slow_forward(self, *args, **kwargs):
        time.sleep(SLOW_S)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLM, "forward", slow_forward)
    slowed = tp.run(_config(tiny_model, baseline_batch_sizes=(4,), baseline_single=False))
    report, _ = normal_report
    assert slowed["results"][0]["output_tokens"] == report["results"][0]["output_tokens"]
    assert slowed["results"][0]["elapsed_s"] >= SLOW_S * slowed["results"][0]["num_steps"]
    assert slowed["ratio_vs_best_baseline"] < 0.7 * report["ratio_vs_best_baseline"], (
        [r["samples_s"] for r in report["results"]], [r["samples_s"] for r in slowed["results"]])
    # the sleep is attributed to the forward phase
    assert slowed["step_overhead"]["phases_pct"]["forward"] > report["step_overhead"]["phases_pct"]["forward"]


def test_cli_writes_json_with_config_and_machine_and_a_plot(tiny_model, tmp_path, capsys):
    from ironlm.bench.cli import main

    out_json, out_png = tmp_path / "tp.json", tmp_path / "tp.png"
    rc = main(["throughput", tiny_model, "--dataset", "prefix", "--num-requests", "4", "--prefix-len", "32",
               "--suffix-len", "4", "--prefix-output-len", "3", "--device", "cpu", "--num-kv-blocks", "256",
               "--block-size", "4", "--max-model-len", "256", "--max-num-batched-tokens", "32",
               "--max-num-seqs", "8", "--no-progress",
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert data["config"]["dataset"] == "prefix" and data["config"]["prefix"]["prefix_len"] == 32
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["torch"] and data["machine"]["cpu_model"]
    on, off = data["results"]
    assert on["prefix_caching"] is True and off["prefix_caching"] is False
    assert on["output_tokens"] == off["output_tokens"] == 12
    assert on["prefix_cache_hit_rate"] > 0 and off["prefix_cache_hits"] == 0
    assert data["prefix_caching_speedup"] == pytest.approx(off["elapsed_s"] / on["elapsed_s"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "prefix caching:" in capsys.readouterr().out


# ---- serve against a live server ---------------------------------------------------------------
def test_serve_bench_against_a_live_server(tiny_model, tmp_path):
    """`ironlm bench serve` starts `ironlm serve` on a free port, streams over HTTP, then stops it; a speculative
    server's counters from /metrics land in the summary."""
    from ironlm.bench.cli import main

    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = main(["serve", tiny_model, "--num-prompts", "8", "--input-len", "4", "16", "--output-len", "2", "6",
               "--seed", "3", "--request-rate", "50", "--max-concurrency", "4", "--goodput", "ttft:60000",
               "--server-arg=--device=cpu", "--server-arg=--num-kv-blocks=64", "--server-arg=--block-size=4",
               '--server-arg=--speculative-config={"method": "ngram", "num_speculative_tokens": 3}',
               "--no-progress", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert report["config"]["started_server"] is True and report["config"]["url"].startswith("http://127.0.0.1:")
    assert report["machine"]["cpu_cores"] >= 1
    s = report["summary"]
    assert s["completed"] == 8 and s["failed"] == 0, s["errors"]
    assert s["output_tokens"] == s["expected_output_tokens"] == report["dataset"]["output_tokens"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        st = s[key]
        # Token events that arrive in one read share its arrival time: an inter-token gap may be 0.
        low = 0 <= st["min"] if key == "itl_ms" else 0 < st["min"]
        assert low and st["min"] <= st["median"] <= st["p90"] <= st["p99"] <= st["max"], key
    assert s["ttft_ms"]["median"] <= s["e2el_ms"]["median"]
    cpu = s["cpu"]  # the timed pass's CPU time, split
    assert cpu["server_cores"] > 0 and cpu["client_cores"] >= 0 and cpu["other_cores"] >= 0 and cpu["wall_s"] > 0
    for r in report["requests"]:
        assert r["success"] and 0 < r["ttft"] <= r["latency"]
        assert len(r["itl"]) == r["token_chunks"] - 1 and r["token_chunks"] <= r["output_tokens"]
    assert s["goodput"]["good_requests"] == 8
    assert 0 < s["busy_fraction"] <= 1.0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sd = s["spec_decode"]
    assert sd["spec_decode_num_draft_tokens_total"] >= sd["spec_decode_num_accepted_tokens_total"] >= 0
    assert sd["spec_decode_budget"] >= 0 and "spec_decode_paused_steps_total" in sd  # the cost model is on


def test_decode_attention_bench_times_both_backends_on_one_live_batch(tiny_model, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benches" / "bench_decode_attention.py"
    spec = importlib.util.spec_from_file_location("bench_decode_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "dec.json"
    assert mod.main([tiny_model, "--num-seqs", "10", "--steps", "2", "--repeats", "2", "--input-len", "4", "12",
                     "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["num_seqs"] == 10 and 4 <= r["mean_context"] <= 12
    for name in ("cpu", "torch"):
        assert len(r[name]["step_ms"]) == 2 and r[name]["attention_ms_per_step"] > 0
        # Attention is part of the step, so it can never take longer than the whole step.
        assert r[name]["attention_ms_per_step"] < max(r[name]["step_ms"])
    assert "cpu / torch" in capsys.readouterr().out
