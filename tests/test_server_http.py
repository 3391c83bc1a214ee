"""Raw HTTP: SSE framing, the bad-input battery, health, metrics, tokenize, version."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import ironlm
from server_utils import TINY_ENGINE_KW, LiveServer, shared_server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def http(server: LiveServer) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def sse_events(http: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, list[str]]:
    with http.stream("POST", path, json=body) as resp:
        raw = resp.read().decode()
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    return resp, [e[len("data: "):] for e in events]


def test_chat_sse_framing(http: httpx.Client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    resp, events = sse_events(http, "/v1/chat/completions", body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(m["delta"]) == {"content"} for m in mine[1:-1])
        assert all(m["finish_reason"] is None for m in mine[:-1])
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_sse_framing(http: httpx.Client):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True}
    _, events = sse_events(http, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    full = http.post("/v1/completions", json={**body, "stream": False}).json()
    assert text == full["choices"][0]["text"]


BAD_INPUTS = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi"', None),
    ("/v1/completions", b"not json at all", None),
    ("/v1/completions", b"", None),
    ("/v1/completions", b'["a", "list"]', None),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**12}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 10**6}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 9}, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi " * 400, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "suffix": "tail"}, "suffix"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "x"}]}, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x " * 400}]},
     "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_INPUTS, ids=[f"{i}" for i in range(len(BAD_INPUTS))])
def test_bad_input_is_a_400_with_an_openai_error_body(http: httpx.Client, path, body, param):
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err


def test_unknown_fields_are_ignored_and_server_stays_healthy(http: httpx.Client):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "some_client_extra": {"x": 1}, "user": "u1"}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert http.get("/health").status_code == 200


def test_unknown_model_route_and_method(http: httpx.Client):
    resp = http.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    resp = http.get("/v1/nothing-here")
    assert resp.status_code == 404 and "error" in resp.json()
    resp = http.get("/v1/completions")
    assert resp.status_code == 405 and "error" in resp.json()


def test_health_version_tokenize(http: httpx.Client, server: LiveServer):
    health = http.get("/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["model"] == "tiny"
    assert body["device_memory"]["free_bytes"] > 0
    assert body["kv_cache"]["blocks_total"] == TINY_ENGINE_KW["num_kv_blocks"]
    assert http.get("/version").json()["version"] == ironlm.__version__
    tok = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tok["tokens"] == server.engine.tokenizer.encode("hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == TINY_ENGINE_KW["max_model_len"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("hello world")
    messages = [{"role": "user", "content": "hello"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == server.engine.apply_chat_template(messages) and chat["count"] == len(chat["tokens"])


def metric_values(http: httpx.Client) -> dict[str, float]:
    resp = http.get("/metrics")
    assert resp.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            key = s.name + ("" if "finished_reason" not in s.labels else f"{{{s.labels['finished_reason']}}}")
            values[key] = values.get(key, 0.0) + s.value
    return values


def test_metrics_parse_and_move(http: httpx.Client):
    before = metric_values(http)
    for name in ("ironlm:num_requests_running", "ironlm:num_requests_waiting", "ironlm:kv_cache_usage_perc",
                 "ironlm:prefix_cache_queries_total", "ironlm:prefix_cache_hits_total",
                 "ironlm:prompt_tokens_total", "ironlm:generation_tokens_total", "ironlm:num_preemptions_total",
                 "ironlm:time_to_first_token_seconds_count", "ironlm:inter_token_latency_seconds_count",
                 "ironlm:e2e_request_latency_seconds_count", "ironlm:request_queue_time_seconds_count"):
        assert name in before, name
    assert before["ironlm:model_weight_bytes"] > 0  # the tiny model's dense fp32 weights
    body = {"model": "tiny", "prompt": "count me", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    http.post("/v1/completions", json=body).raise_for_status()
    after = metric_values(http)
    assert after["ironlm:generation_tokens_total"] >= before["ironlm:generation_tokens_total"] + 5
    assert after["ironlm:prompt_tokens_total"] > before["ironlm:prompt_tokens_total"]
    assert after["ironlm:request_success_total{length}"] == before.get("ironlm:request_success_total{length}",
                                                                       0) + 1
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        key = f"ironlm:{h}_seconds_count"
        assert after[key] == before[key] + 1
    assert after["ironlm:inter_token_latency_seconds_count"] >= before["ironlm:inter_token_latency_seconds_count"] + 4


def test_grafana_dashboard_uses_only_exported_metrics(http: httpx.Client):
    dashboard = json.loads((Path(__file__).parents[1] / "grafana" / "ironlm-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"ironlm:[a-z0-9_]+", e)}
    exported = {s.name for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples}
    assert used and used <= exported, used - exported
