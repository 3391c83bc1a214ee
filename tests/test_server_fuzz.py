"""Schema-driven fuzzing of every HTTP route, from the server's own OpenAPI document (hypothesis-jsonschema).

Bodies that follow each POST route's declared request schema, arbitrary JSON that does not, and odd path values
for the GET routes, all against a real tiny-model server behind uvicorn with `ironlm serve`'s limits. Whatever
comes in: never a 5xx, every error (including an error event inside a stream) in OpenAI's shape, and afterwards
the server healthy with nothing running and every KV block back. Bounded to about half a minute (FUZZ_SECONDS;
IRONLM_FUZZ_SECONDS=600 for a longer hunt): derandomized, so a shorter budget runs the first part of the same
examples on every route.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from ironlm.config import ServerConfig
from ironlm.server.api import build_app
from server_utils import tiny_engine, wait_for
from test_server_hardening import Served

FUZZ_SECONDS = float(os.environ.get("IRONLM_FUZZ_SECONDS", "30"))
CONFIG = ServerConfig(max_request_bytes=1 << 20, timeout_request_header=5.0)
# Generate only: a failure's message carries the request already, and shrinking would run past the budget.
SETTINGS = settings(max_examples=2000, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))
_ERROR_KEYS = {"message", "type", "param", "code"}


class BudgetSpent(Exception):
    """Ends a hypothesis run once its time slice is over (the one way to stop `given` early)."""


class Budget:
    """The fuzz time shared by every route: each route gets its slice, so all are reached within the budget."""

    def __init__(self, seconds: float, parts: int) -> None:
        self.per_part, self.until = seconds / parts, 0.0
        self.requests = 0

    def run(self, fuzz: Any) -> None:
        self.until = time.monotonic() + self.per_part
        try:
            fuzz()
        except BudgetSpent:
            pass

    def take(self) -> None:
        if time.monotonic() > self.until:
            raise BudgetSpent
        self.requests += 1


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[Served, Any]]:
    engine = tiny_engine(tmp_path_factory, max_num_seqs=8, max_queue_len=8)
    served = Served(build_app(engine, served_model_name="tiny", config=CONFIG), CONFIG)
    yield served, engine
    served.stop()
    asyncio.run(engine.shutdown(drain_timeout=0))


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def doc(http: httpx.Client) -> dict[str, Any]:
    return http.get("/openapi.json").json()


def _local_refs(node: Any) -> Any:
    """components/schemas refs -> $defs refs, which hypothesis-jsonschema resolves inside one schema."""
    if isinstance(node, dict):
        return {k: (v.replace("#/components/schemas/", "#/$defs/") if k == "$ref" else _local_refs(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_local_refs(v) for v in node]
    return node


def request_schema(doc: dict[str, Any], path: str) -> dict[str, Any]:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    name = ref.rsplit("/", 1)[1]
    defs = _local_refs(doc["components"]["schemas"])
    return {**defs[name], "$defs": defs}


def check_typed_stream(resp: httpx.Response, what: str) -> None:
    """The Responses and Anthropic streams: `event: TYPE` + `data: {"type": TYPE, ...}` pairs, ending in their own
    last event (no [DONE]); an in-band error is a failure here, since only the engine failing makes one."""
    events = [dict(line.split(": ", 1) for line in e.split("\n")) for e in resp.text.split("\n\n") if e]
    types = [json.loads(e["data"])["type"] for e in events]
    assert types and types == [e["event"] for e in events], f"{what} -> {resp.text[-300:]}"
    assert types[-1] in ("response.completed", "response.incomplete", "message_stop"), f"{what} -> {types[-3:]}"


def check_response(resp: httpx.Response, what: str) -> None:
    # A request's own `timeout` (the fuzz draws values down to 1e-10 s) expiring before any token is a 503
    # `timeout`: the client's choice, not a server fault.
    # (Anthropic's error shape has no code: there the message tells.)
    err = resp.json().get("error", {}) if resp.status_code == 503 else {}
    own_timeout = err.get("code") == "timeout" or "timed out before any token" in str(err.get("message"))
    assert resp.status_code < 500 or own_timeout, f"{what} -> {resp.status_code} {resp.text[:500]}"
    typed = resp.request.url.path in ("/v1/responses", "/v1/messages")
    if resp.status_code >= 400 and resp.request.url.path.startswith("/v1/messages"):  # Anthropic's error shape
        body = resp.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, f"{what} -> {resp.text[:500]}"
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    elif typed and resp.headers.get("content-type", "").startswith("text/event-stream"):
        check_typed_stream(resp, what)
    elif resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == _ERROR_KEYS, f"{what} -> {resp.text[:500]}"
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e[len("data: "):] for e in resp.text.split("\n\n") if e]
        assert events and events[-1] == "[DONE]", f"{what} -> {resp.text[-300:]}"
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:
                assert set(chunk["error"]) == _ERROR_KEYS, event
                assert not (isinstance(chunk["error"]["code"], int) and chunk["error"]["code"] >= 500), \
                    f"{what} -> {event}"


def post_paths(doc: dict[str, Any]) -> list[str]:
    return sorted(p for p, ops in doc["paths"].items() if "post" in ops)


def get_paths(doc: dict[str, Any]) -> list[str]:
    return sorted(p for p, ops in doc["paths"].items() if "get" in ops)


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)


def fuzz_post(http: httpx.Client, budget: Budget, path: str, bodies: st.SearchStrategy[Any]) -> Any:
    @SETTINGS
    @given(body=bodies)
    def fuzz(body: Any) -> None:
        budget.take()
        check_response(http.post(path, json=body), f"POST {path} {json.dumps(body)[:300]}")

    return fuzz


def test_fuzz_every_route(http: httpx.Client, doc: dict[str, Any], server):
    _, engine = server
    posts, gets = post_paths(doc), get_paths(doc)
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(posts)
    budget = Budget(FUZZ_SECONDS, 2 * len(posts) + 1)

    for path in posts:
        schema = request_schema(doc, path)
        field_names = sorted(schema.get("properties", {}))
        budget.run(fuzz_post(http, budget, path, from_schema(schema)))
        # Anything at all where the schema has a field: wrong types, wrong shapes, unknown fields.
        budget.run(fuzz_post(http, budget, path, st.dictionaries(st.sampled_from(field_names) | st.text(max_size=8),
                                                                 _json_values(), max_size=6) | _json_values()))

    @SETTINGS
    @given(path=st.sampled_from(gets), name=st.text(min_size=1, max_size=40))
    def get_routes(path: str, name: str) -> None:
        budget.take()
        url = re.sub(r"\{[^}]+\}", lambda _: quote(name, safe=""), path)
        resp = http.get(url)
        if path == "/health":
            assert resp.status_code == 200, resp.text
        else:
            check_response(resp, f"GET {url}")

    budget.run(get_routes)

    print(f"fuzz: {budget.requests} requests over {len(posts)} POST and {len(gets)} GET routes")
    assert budget.requests >= 50, budget.requests  # the budget was spent on requests, not on generating them
    assert http.get("/health").status_code == 200
    assert wait_for(lambda: engine.num_inflight == 0 and engine.stats()["num_requests_running"] == 0
                    and engine.stats()["num_requests_waiting"] == 0 and engine.stats()["blocks_used"] == 0, 30), \
        engine.stats()
