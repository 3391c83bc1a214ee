"""Bearer API key: on every route but /health and /metrics; off when no key is configured."""

from __future__ import annotations

import hmac

import httpx
import openai
import pytest

from ironlm.server import auth
from ironlm.server.api import build_app
from server_utils import LiveServer, shared_server

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def open_server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def locked(open_server: LiveServer) -> LiveServer:
    # Same engine, a second app with a key: auth is an app concern.
    server = LiveServer(build_app(open_server.engine, served_model_name="tiny", api_key=KEY), open_server.engine)
    yield server
    server.stop()


ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
          ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/version", None)]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_protected_routes(locked: LiveServer, method, path, body):
    with httpx.Client(base_url=locked.url, timeout=30) as http:
        missing = http.request(method, path, json=body)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        err = missing.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        wrong = http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}x"})
        assert wrong.status_code == 401
        basic = http.request(method, path, json=body, headers={"Authorization": f"Basic {KEY}"})
        assert basic.status_code == 401
        ok = http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text


def test_health_and_metrics_stay_open(locked: LiveServer):
    assert httpx.get(f"{locked.url}/health").status_code == 200
    assert httpx.get(f"{locked.url}/metrics").status_code == 200


def test_openai_client_with_and_without_key(locked: LiveServer, open_server: LiveServer):
    good = openai.OpenAI(base_url=locked.base_url, api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=locked.base_url, api_key="wrong", max_retries=0).models.list()
    # no key configured: any (or no) key is accepted
    assert openai.OpenAI(base_url=open_server.base_url, api_key="anything", max_retries=0).models.list().data
    assert httpx.get(f"{open_server.base_url}/models").status_code == 200


def test_digest_comparison_is_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    checker = auth.KeyChecker(["k1", "k2"])
    assert checker.check("Bearer k2") and not checker.check("Bearer k3") and not checker.check(None)
    assert len(calls) == 4 and all(len(a) == len(b) == 32 for a, b in calls)  # SHA-256 digests, every key
    with pytest.raises(ValueError):
        auth.KeyChecker("")
