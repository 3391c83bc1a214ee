"""llama.cpp as a benchmark baseline: command lines, payloads, llama-bench parsing, the missing-binary error,
fair warm-up, `bench latency` for ironlm alone; end to end against llama-server only where it is built
(`make llama-cpp`)."""

from __future__ import annotations

import json
import stat

import pytest

from ironlm.bench import latency as lt
from ironlm.bench import llama_cpp as lc
from ironlm.bench import serve as sv
from ironlm.bench.datasets import BenchRequest, PrefixSpec, RandomSpec, make_dataset, warmup_dataset


# ---- pure parts ----------------------------------------------------------------------------------
def test_server_command_gives_one_slot_per_request_and_the_same_threads():
    cmd = lc.server_command("/x/llama-server", "/m/model.gguf", host="127.0.0.1", port=5123, threads=3,
                            parallel=64, ctx_per_slot=1024)
    assert cmd[0] == "/x/llama-server"

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--model") == "/m/model.gguf" and value("--host") == "127.0.0.1" and value("--port") == "5123"
    assert value("--threads") == value("--threads-batch") == "3"
    assert value("--parallel") == "64"
    # -c is split evenly over the slots when the KV cache is not unified: each slot gets ctx_per_slot.
    assert value("--ctx-size") == str(64 * 1024) and "--no-kv-unified" in cmd
    with pytest.raises(ValueError, match="parallel"):
        lc.server_command("b", "m", host="h", port=1, threads=1, parallel=0, ctx_per_slot=256)
    with pytest.raises(ValueError, match="threads"):
        lc.server_command("b", "m", host="h", port=1, threads=0, parallel=1, ctx_per_slot=256)


def test_baseline_args_end_the_baseline_servers_command(tmp_path, monkeypatch):
    """`bench serve --baseline-arg ARG` (repeatable): appended to the baseline's own command, after its defaults
    (llama-server and vllm serve both let a later flag override an earlier one)."""
    gguf, binary = tmp_path / "m.gguf", tmp_path / "llama-server"
    gguf.write_bytes(b"GGUF")
    binary.write_text("")
    monkeypatch.setattr(lc, "find_binary", lambda name: binary)
    config = sv.ServeConfig(model=str(gguf), baseline="llama.cpp", baseline_args=["--cache-type-k", "q8_0"])
    ds = make_dataset("random", 50, random=RandomSpec(num_requests=2, input_len=(8, 8), output_len=(4, 4)))
    server = sv._baseline_server(config, ds, None, threads=2)
    assert server is not None and server.command()[-2:] == ["--cache-type-k", "q8_0"]
    assert server.command()[0] == str(binary)
    assert sv._baseline_server(sv.ServeConfig(), ds, None, threads=2) is None


def test_slot_context_fits_the_longest_request_with_room():
    assert lc.slot_context([BenchRequest([1] * 512, 256), BenchRequest([1] * 32, 16)]) == 1024
    assert lc.slot_context([BenchRequest([1] * 100, 10)]) == 256
    assert lc.slot_context([BenchRequest([1] * 200, 56)]) == 512  # exactly 256 tokens: never a full slot
    ds = make_dataset("random", 49152)  # workload W
    longest = max(r.prompt_len + r.output_len for r in ds.requests)
    assert longest < lc.slot_context(ds.requests) <= longest + 256


def test_completion_payload_is_the_same_greedy_token_id_request_for_every_server():
    req = BenchRequest([5, 6, 7], 9)
    p = sv.completion_payload(req)
    assert p == {"prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0.0, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}
    assert sv.completion_payload(req, "m")["model"] == "m"
    p["prompt"].append(8)
    assert req.prompt_token_ids == [5, 6, 7]  # the payload owns its list


LLAMA_BENCH_JSON = json.dumps([
    {"model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": 512, "n_gen": 0, "avg_ns": 1875000000,
     "avg_ts": 273.1, "stddev_ts": 1.5, "samples_ts": [273.1]},
    {"model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": 0, "n_gen": 128, "avg_ns": 1075000000,
     "avg_ts": 119.0, "stddev_ts": 0.5, "samples_ts": [119.0]},
])


def test_llama_bench_command_and_output_parsing():
    cmd = lc.bench_command("/b/llama-bench", "/m.gguf", prompt_len=512, gen_len=128, threads=2)
    assert cmd == ["/b/llama-bench", "-m", "/m.gguf", "-p", "512", "-n", "128", "-t", "2", "-r", "1", "-o", "json"]
    assert lc.parse_bench_json(LLAMA_BENCH_JSON) == {"prefill_tok_s": 273.1, "decode_tok_s": 119.0}
    with pytest.raises(RuntimeError, match="decode_tok_s"):
        lc.parse_bench_json(json.dumps(json.loads(LLAMA_BENCH_JSON)[:1]))


def _summary(ttft: float, tokens_per_request: int, duration: float) -> dict:
    results = [sv.RequestResult(prompt_len=10, expected_output_len=tokens_per_request, success=True,
                                output_tokens=tokens_per_request, token_chunks=tokens_per_request, ttft=ttft,
                                latency=ttft + 0.01 * (tokens_per_request - 1), start=0.0, end=1.0)
               for _ in range(4)]
    return sv.summarize(results, duration, {})


def test_serve_comparison_reads_higher_is_better_both_ways():
    ours, theirs = _summary(0.5, 10, 2.0), _summary(2.0, 10, 4.0)
    c = sv.compare(ours, theirs)
    assert c["output_throughput_ratio"] == pytest.approx(2.0)  # 20 vs 10 output tok/s
    assert c["ttft_median_speedup"] == pytest.approx(4.0) and c["ttft_p99_speedup"] == pytest.approx(4.0)
    assert c["tpot_median_speedup"] == pytest.approx(1.0)
    report = {"config": {"started_server": True, "url": "u", "request_rate": "inf", "burstiness": 1.0,
                         "max_concurrency": None},
              "summary": ours, "comparison": c,
              "baseline": {"name": "llama.cpp", "server": {"version": "version: 1 (abc)"}, "summary": theirs}}
    text = sv.summary_text(report)
    assert "ironlm vs llama.cpp: output tok/s 2.00x" in text and "version: 1 (abc)" in text


# ---- the missing binary --------------------------------------------------------------------------
@pytest.fixture
def no_llama_cpp(tmp_path, monkeypatch):
    """Nothing built: no $IRONLM_LLAMA_CPP_DIR, an empty checkout folder, nothing on PATH."""
    monkeypatch.delenv(lc.DIR_ENV, raising=False)
    monkeypatch.setattr(lc, "_CHECKOUT_BIN", tmp_path / "nothing")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return tmp_path


def test_missing_binary_says_how_to_build_it(no_llama_cpp):
    with pytest.raises(lc.LlamaCppNotBuilt, match="make llama-cpp") as err:
        lc.find_binary("llama-server")
    assert isinstance(err.value, FileNotFoundError) and lc.DIR_ENV in str(err.value)


def test_binary_found_through_the_environment_variable(no_llama_cpp, monkeypatch):
    bin_dir = no_llama_cpp / "build" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "llama-bench"
    exe.write_text("#!/bin/sh\n")
    monkeypatch.setenv(lc.DIR_ENV, str(no_llama_cpp))
    with pytest.raises(lc.LlamaCppNotBuilt):  # not executable: not a binary
        lc.find_binary("llama-bench")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert lc.find_binary("llama-bench") == exe


def test_benches_fail_fast_and_clearly_without_the_binary(no_llama_cpp, capsys):
    """The error comes before any model is loaded, and the CLI prints it without a traceback."""
    from ironlm.bench import throughput as tp
    from ironlm.bench.cli import main

    with pytest.raises(lc.LlamaCppNotBuilt, match="llama-bench"):
        lt.run(lt.LatencyConfig(model="/does/not/exist", baseline="llama.cpp"))
    with pytest.raises(lc.LlamaCppNotBuilt, match="llama-server"):
        tp.run(tp.ThroughputConfig(model="/does/not/exist", baseline="llama.cpp"))
    assert main(["latency", "/does/not/exist", "--baseline", "llama.cpp", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "make llama-cpp" in err and "Traceback" not in err


def test_llama_cpp_baseline_needs_a_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="model"):
        lc.gguf_path(tmp_path)


# ---- the same warm-up for everyone -----------------------------------------------------------------
def test_warmup_dataset_has_the_workload_shape_but_other_prompts():
    spec = RandomSpec(16, (32, 512), (16, 256), seed=0)
    timed = make_dataset("random", 49152, random=spec)
    full = warmup_dataset("random", 49152, "full", random=spec)
    assert len(full.requests) == len(timed.requests) and full.config["seed"] == 1
    assert {tuple(r.prompt_token_ids) for r in full.requests}.isdisjoint(
        tuple(r.prompt_token_ids) for r in timed.requests)
    pfx = PrefixSpec(4, 64, 8, 4, seed=0)
    warm_prefix = warmup_dataset("prefix", 1000, "full", prefix=pfx).requests[0].prompt_token_ids[:64]
    assert warm_prefix != make_dataset("prefix", 1000, prefix=pfx).requests[0].prompt_token_ids[:64]
    short = warmup_dataset("random", 49152, "short", random=spec)
    assert [(r.prompt_len, r.output_len) for r in short.requests] == [(8, 2), (8, 2)]
    assert warmup_dataset("random", 49152, "none", random=spec) is None
    with pytest.raises(ValueError, match="warmup"):
        warmup_dataset("random", 49152, "half", random=spec)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("bench_lc"), arch="llama"))


TINY_ENGINE = {"device": "cpu", "num_kv_blocks": 256, "block_size": 4, "max_model_len": 256, "max_num_seqs": 64}


def test_throughput_gives_every_configuration_one_untimed_warmup_pass(tiny_model, monkeypatch):
    from ironlm.bench import throughput as tp
    from ironlm.bench.baseline import TransformersBaseline

    calls: list[tuple[str, int, tuple[int, ...]]] = []
    original_ironlm, original_tf = tp._ironlm_once, TransformersBaseline.run

    def ironlm_once(llm, ds, progress):
        calls.append(("ironlm", len(ds.requests), tuple(ds.requests[0].prompt_token_ids)))
        return original_ironlm(llm, ds, progress)

    def tf_run(self, reqs, batch_size, progress=None):
        calls.append((f"tf{batch_size}", len(reqs), tuple(reqs[0].prompt_token_ids)))
        return original_tf(self, reqs, batch_size, progress)

    monkeypatch.setattr(tp, "_ironlm_once", ironlm_once)
    monkeypatch.setattr(TransformersBaseline, "run", tf_run)
    spec = RandomSpec(4, (4, 12), (2, 4), seed=5)
    report = tp.run(tp.ThroughputConfig(model=tiny_model, random=spec, baseline="transformers",
                                        baseline_batch_sizes=(2,), baseline_single_limit=2, progress=False,
                                        engine_args=dict(TINY_ENGINE)))
    vocab = report["dataset"]["config"]["vocab_size"]
    warm = tuple(warmup_dataset("random", vocab, "full", random=spec).requests[0].prompt_token_ids)
    timed = tuple(make_dataset("random", vocab, random=spec).requests[0].prompt_token_ids)
    assert warm != timed
    # Each configuration's first pass is the untimed warm-up, the next one the timed pass.
    for name, n in (("ironlm", 4), ("tf1", 2), ("tf2", 4)):
        mine = [c for c in calls if c[0] == name]
        assert mine == [(name, n, warm), (name, n, timed)], calls
    assert report["warmup_dataset"]["num_requests"] == 4


# ---- bench latency, ironlm alone -------------------------------------------------------------------
def test_latency_quick_for_ironlm_alone(tiny_model, tmp_path, capsys):
    from ironlm.bench.cli import main

    out = tmp_path / "lat.json"
    assert main(["latency", tiny_model, "--quick", "--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4",
                 "--max-model-len", "256", "--threads", "1", "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["config"]["prompt_len"] == 64 and r["config"]["gen_len"] == 16 and r["threads"] == 1
    assert r["machine"]["cpu_model"] and isinstance(r["machine"]["cpu_flags"], list)
    (ours,) = r["results"]
    assert ours["engine"] == "ironlm" and ours["prefill_tok_s"] > 0 and ours["decode_tok_s"] > 0
    assert ours["decode_ms_per_token"] == pytest.approx(1000 / ours["decode_tok_s"])
    assert "ironlm_over_llama_cpp" not in r
    assert "prefill 64 tok/s" in capsys.readouterr().out
    with pytest.raises(ValueError, match="gen_len"):
        lt.run(lt.LatencyConfig(model=tiny_model, gen_len=0))


def test_latency_decode_rate_counts_only_the_decode_steps(tiny_model):
    """A forward slowed by a fixed time shows up as ~that time per decode token."""
    import time

    from ironlm.llm import LLM
    from ironlm.model import DecoderLM

    llm = LLM(tiny_model, **TINY_ENGINE)
    original = DecoderLM.forward

    def slow_forward(self, *args, **kwargs):
        time.sleep(0.05)
        return original(self, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(DecoderLM, "forward", slow_forward)
    try:
        rate = lt.ironlm_decode(llm, 200, 4)
    finally:
        mp.undo()
    assert 1 / rate >= 0.05  # every one of the 4 timed tokens paid one slowed forward
    assert 1 / rate < 0.25  # per token, not the whole generation


# ---- end to end, only where llama.cpp is built ----------------------------------------------------
def _built() -> bool:
    try:
        lc.find_binary("llama-server")
        lc.find_binary("llama-bench")
        lc.gguf_path(None)
    except (FileNotFoundError, ValueError, ImportError):
        return False
    return True


needs_llama_cpp = pytest.mark.skipif(not _built(), reason="llama.cpp not built (make llama-cpp) or no default model")


@needs_llama_cpp
def test_serve_and_throughput_against_llama_server(tmp_path):
    from ironlm.bench.cli import main

    out = tmp_path / "serve.json"
    assert main(["serve", "--quick", "--baseline", "llama.cpp", "--warmup", "short", "--max-concurrency", "4",
                 "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    ours, theirs = r["summary"], r["baseline"]["summary"]
    assert ours["failed"] == theirs["failed"] == 0, (ours["errors"], theirs["errors"])
    # EOS ignored: llama-server generated exactly the requested tokens, as ironlm did.
    assert theirs["output_tokens"] == ours["output_tokens"] == r["dataset"]["output_tokens"]
    assert r["baseline"]["server"]["parallel"] == 4 and "--parallel" in r["baseline"]["server"]["command"]
    assert r["comparison"]["output_throughput_ratio"] == pytest.approx(
        ours["output_token_throughput"] / theirs["output_token_throughput"])

    out = tmp_path / "tp.json"
    assert main(["throughput", "--quick", "--baseline", "llama.cpp", "--warmup", "short", "--no-progress",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    ironlm, llama = r["results"]
    assert llama["engine"] == "llama.cpp" and llama["output_tokens"] == ironlm["output_tokens"]
    assert r["llama_cpp_server"]["parallel"] == r["dataset"]["num_requests"]


@needs_llama_cpp
def test_latency_against_llama_bench(tmp_path):
    from ironlm.bench.cli import main

    out = tmp_path / "lat.json"
    assert main(["latency", "--quick", "--baseline", "llama.cpp", "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    ours, theirs = r["results"]
    assert theirs["engine"] == "llama.cpp" and theirs["prefill_tok_s"] > 0 and theirs["decode_tok_s"] > 0
    assert r["ironlm_over_llama_cpp"]["decode_tok_s"] == pytest.approx(ours["decode_tok_s"] / theirs["decode_tok_s"])
    assert r["llama_bench"]["command"][r["llama_bench"]["command"].index("-t") + 1] == str(r["threads"])


@needs_llama_cpp
def test_latency_streamed_against_llama_server(tmp_path, capsys):
    """`--baseline llama.cpp --streamed`: llama-bench in process, then ironlm serve and llama-server (one slot)
    over HTTP on the same GGUF, each with its streamed decode and TTFT, and the ratios."""
    from ironlm.bench.cli import main

    out = tmp_path / "lat.json"
    assert main(["latency", "--quick", "--baseline", "llama.cpp", "--streamed", "--no-progress",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    engines = [(x["engine"], x["transport"]) for x in r["results"]]
    assert engines == [("ironlm", "in process"), ("llama.cpp", "in process"), ("ironlm", "HTTP"),
                       ("llama-server", "HTTP")]
    ours, theirs = r["results"][2:]
    assert theirs["decode_tok_s"] > 0 and theirs["ttft_s"] > 0
    assert r["ironlm_over_llama_server"]["streamed_decode_tok_s"] == pytest.approx(
        ours["decode_tok_s"] / theirs["decode_tok_s"])
    cmd = r["servers"]["llama-server"]["command"]
    assert cmd[cmd.index("--parallel") + 1] == "1" and cmd[cmd.index("--threads") + 1] == str(r["threads"])
    assert "ironlm / llama-server over HTTP" in capsys.readouterr().out


def _bench_moe_module():
    import importlib.util
    import sys
    from pathlib import Path

    benches = Path(__file__).resolve().parents[1] / "benches"
    sys.path.insert(0, str(benches))
    try:
        spec = importlib.util.spec_from_file_location("bench_moe", benches / "bench_moe.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(benches))
    return mod


@needs_llama_cpp
def test_moe_bench_single_stream_alternates_rounds(tmp_path, capsys):
    """The single-stream mode loads ironlm once and alternates it with llama-bench over --rounds: a row per round
    for both engines, medians, and each round's decode ratio from that round's own pair."""
    mod = _bench_moe_module()
    out = tmp_path / "moe.json"
    gguf = lc.gguf_path(None)  # any GGUF both load: the mode does not depend on the model being MoE
    assert mod.main(["--gguf", str(gguf), "--rounds", "2", "--reps", "1", "--prompt", "8", "--gen", "4",
                     "--json", str(out)]) == 0
    (row,) = [v for k, v in json.loads(out.read_text()).items() if k not in ("args", "cpu")]
    assert len(row["rounds"]) == 2
    for r in row["rounds"]:
        assert r["ironlm"]["decode_tok_s"] > 0 and r["llama.cpp"]["decode_tok_s"] > 0
    assert row["decode_ratio_per_round"] == pytest.approx(
        [r["ironlm"]["decode_tok_s"] / r["llama.cpp"]["decode_tok_s"] for r in row["rounds"]])
    assert row["ironlm"]["decode_tok_s"] == pytest.approx(
        sum(r["ironlm"]["decode_tok_s"] for r in row["rounds"]) / 2)  # the median of two
    # The machine's read bandwidth beside each round, and what it allows over llama.cpp's own rate.
    for r, ceiling in zip(row["rounds"], row["decode_ratio_ceiling_per_round"], strict=True):
        assert r["machine_read_gb_s"] > 1
        assert r["llama.cpp"]["read_gb_s"] == pytest.approx(
            r["ironlm"]["active_bytes"] * r["llama.cpp"]["decode_tok_s"] / 1e9)
        assert ceiling == pytest.approx(r["machine_read_gb_s"] / r["llama.cpp"]["read_gb_s"])
    assert "CPU: " in capsys.readouterr().out


@needs_llama_cpp
def test_moe_bench_http_mode_alternates_servers_on_the_same_requests(tmp_path, capsys):
    mod = _bench_moe_module()
    out = tmp_path / "moe_http.json"
    gguf = lc.gguf_path(None)  # any GGUF both servers load: the mode does not depend on the model being MoE
    assert mod.main(["--http", "--gguf", str(gguf), "--num-requests", "3", "--input-len", "8", "16",
                     "--output-len", "3", "5", "--concurrency", "2", "--rounds", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["types"].values()
    # one round (each server start costs seconds): the alternation over rounds is test_bench_rounds.py's
    assert [r["engine"] for r in row["runs"]] == ["ironlm", "llama.cpp"]
    for run in row["runs"]:
        s = run["summary"]
        assert s["failed"] == 0 and s["output_tokens"] == row["dataset"]["output_tokens"], s["errors"]
        assert 0 <= s["cpu"]["other_cores"] and s["cpu"]["server_cores"] > 0
    llama = next(r for r in row["runs"] if r["engine"] == "llama.cpp")
    assert llama["server"]["parallel"] == row["settings"]["parallel"] == 2
    cmd = llama["command"]
    assert cmd[cmd.index("--threads") + 1] == cmd[cmd.index("--threads-batch") + 1] == "2"
    ironlm = next(r for r in row["runs"] if r["engine"] == "ironlm")["command"]
    assert ironlm[ironlm.index("--max-num-seqs") + 1] == "2"
    # ironlm's KV pool holds what llama-server's slots do: parallel x slot context tokens
    assert int(ironlm[ironlm.index("--num-kv-blocks") + 1]) * 16 == int(cmd[cmd.index("--ctx-size") + 1])
    by_round = {}
    for run in row["runs"]:
        by_round.setdefault(run["round"], {})[run["engine"]] = run["summary"]["output_token_throughput"]
    assert row["ironlm_over_llama_cpp"]["per_round"] == pytest.approx(
        [by_round[0]["ironlm"] / by_round[0]["llama.cpp"]])
    text = capsys.readouterr().out
    assert "CPU: " in text and "llama.cpp server: " in text and "ironlm / llama-server output tok/s" in text
