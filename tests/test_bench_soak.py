"""`ironlm bench soak` on the tiny model: a few seconds at 2x capacity against a server with a small batch and queue
(so it has to shed), then the leak check; plus the request classification and the metrics parsing on their own.

The server runs in this process (server_utils.LiveServer): starting `ironlm serve` as a subprocess costs more than
the soak itself, and test_bench covers that path for `bench serve` (the same ServerProcess)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import pytest

from ironlm import EngineConfig, LLMEngine
from ironlm.bench import soak
from ironlm.engine import AsyncLLMEngine
from ironlm.server.api import build_app
from server_utils import TINY_ENGINE_KW, LiveServer, tiny_model_path, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    kw = {**TINY_ENGINE_KW, "max_num_seqs": 8, "max_queue_len": 8}
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tiny_model_path(tmp_path_factory)), device="cpu", **kw)),
                            dedupe=True, result_cache_size=4)
    live = LiveServer(build_app(engine, served_model_name="tiny"), engine)
    yield live
    live.stop()
    asyncio.run(engine.shutdown(drain_timeout=1))


def test_soak_at_twice_capacity_sheds_and_leaks_nothing(server):
    config = soak.quick(soak.SoakConfig(url=server.url, server_pid=os.getpid(), minutes=0.1, capacity_seconds=2,
                                        load=2.0, request_timeout=5, seed=1, progress=False,
                                        vocab_size=server.engine.model_config.vocab_size))
    report = soak.run(config)
    s, cap, rss = report["summary"], report["capacity"], report["rss"]
    assert cap["requests_per_s"] > 0 and cap["outcomes"].get("failed", 0) == 0
    assert s["offered_rate"] == pytest.approx(2 * cap["requests_per_s"])
    assert s["sent"] == sum(s[k] for k in soak.OUTCOMES) > 0
    assert s["completed"] > 0 and s["disconnected"] > 0
    assert s["shed"] > 0  # 2x on a batch of 8 and a queue of 8: the server must refuse some at once
    # Valid traffic never fails; a bad request is either refused with a 4xx or reported with what came back.
    for kind, outcomes in s["by_kind"].items():
        if kind != "bad":
            assert outcomes["failed"] == 0, (kind, s["failures"])
    bad = s["by_kind"]["bad"]
    assert s["bad_sent"] > 0 and bad["rejected"] + bad["failed"] + bad["shed"] == s["bad_sent"]
    assert all(k.startswith("bad:") for k in s["failures"])
    # The leak check: the engine empty after the drain, the server healthy.
    assert s["leaked"] == 0 and s["kv_blocks_used_after"] == 0 and report["leak"]["empty"]
    assert s["health_after"] == 200
    assert wait_for(lambda: server.engine.num_inflight == 0)
    assert rss["pid"] == os.getpid() and rss["warm_bytes"] > 0 and rss["end_bytes"] > 0 and rss["samples"]
    assert report["server_metrics"]["request_success_total"].get("length", 0) > 0
    assert "leaked requests" in soak.summary_text(report)


def test_cli_flags():
    from ironlm.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "soak", "--minutes", "10", "--load", "2x", "--server-arg=--dedupe-requests"])
    assert args.minutes == 10 and args.load == 2.0 and args.server_arg == ["--dedupe-requests"]
    assert parser.parse_args(["bench", "soak", "--load", "1.5"]).load == 1.5
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "soak", "--load", "0x"])


def test_classification_of_answers():
    valid = soak.Planned("completion", "/v1/completions", {"prompt": "x"}, stream=False)
    bad = soak.Planned("bad:negative_max_tokens", "/v1/completions", {"max_tokens": -1}, stream=False)

    def outcome(planned: soak.Planned, status: int, body: dict) -> str:
        res = soak.Result(planned.kind, "failed")
        soak._classify(res, planned, status, json.dumps(body))
        return res.outcome

    done = {"choices": [{"finish_reason": "length"}]}
    assert outcome(valid, 200, done) == "completed"
    assert outcome(valid, 200, {"choices": [{"finish_reason": "timeout"}]}) == "timed_out"
    assert outcome(valid, 503, {"error": {"code": "timeout"}}) == "timed_out"
    assert outcome(valid, 503, {"error": {"code": "queue_full"}}) == "shed"
    assert outcome(valid, 500, {"error": {"code": "engine_error"}}) == "failed"
    assert outcome(valid, 400, {"error": {}}) == "failed"  # a valid request refused is a failure
    assert outcome(bad, 400, {"error": {}}) == "rejected"
    assert outcome(bad, 200, done) == "failed"  # a bad request accepted is a failure too
    assert outcome(bad, 500, {"error": {}}) == "failed"


def test_metrics_parsing_and_config_checks():
    text = ('# HELP x\nironlm:kv_cache_blocks{model_name="m",state="used"} 3.0\n'
            'ironlm:kv_cache_blocks{model_name="m",state="free"} 5.0\nironlm:num_requests_running{model_name="m"} 2\n')
    samples = soak.parse_metrics(text)
    assert soak.metric(samples, "ironlm:kv_cache_blocks", state="used") == 3.0
    assert soak.metric(samples, "ironlm:kv_cache_blocks") == 8.0
    assert soak.metric(samples, "ironlm:num_requests_running") == 2.0
    assert soak.metric(samples, "ironlm:absent") == 0.0
    for bad in ({"load": 0}, {"minutes": float("inf")}, {"bad_share": 1.5}, {"input_len": (5, 2)}):
        with pytest.raises(ValueError):
            soak.SoakConfig(**bad)
