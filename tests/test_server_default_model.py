"""What a new user does after `make serve`: stream a chat completion from SmolLM2 (the built-in default)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ironlm.config import EngineConfig
from ironlm.engine import AsyncLLMEngine
from ironlm.server.api import build_app
from server_utils import LiveServer

NAME = "SmolLM2-135M-Instruct"  # the name the Makefile's curl example uses


@pytest.fixture(scope="module")
def server() -> LiveServer:
    engine = AsyncLLMEngine.from_config(EngineConfig(kv_cache_memory="128MiB", max_model_len=1024))
    assert engine.model_name == NAME
    server = LiveServer(build_app(engine), engine)  # no served name given: the engine's own name
    yield server
    server.stop()


def test_openai_client_streams_a_chat_completion(server: LiveServer):
    # The default serving path: the GGUF's Q4_1 blocks stay quantized (int8 activations, like llama.cpp). On this
    # prompt it answers as the dequantized model does; on some others its first token flips where the fp32 model's
    # top two are within 0.1 nats (test_quant_model.py bounds the difference).
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [NAME]
    kw = {"model": NAME, "messages": [{"role": "user", "content": "Name the capital city of France."}],
          "max_tokens": 24, "temperature": 0}
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "Paris" in streamed
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert client.chat.completions.create(**kw).choices[0].message.content == streamed


def test_curl_example_from_the_makefile(server: LiveServer):
    # Exactly the body and header `make serve` prints. curl -d without -H sends form encoding, which a browser page
    # can also send cross-origin without a preflight: refused (415), as OpenAI does.
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "Hello!"}], "stream": True,
                       "max_tokens": 8})
    texts = []
    form = httpx.post(f"{server.base_url}/chat/completions", content=body, timeout=120,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    for headers in ({"Content-Type": "application/json"}, {"Content-Type": "application/json; charset=utf-8"}):
        resp = httpx.post(f"{server.base_url}/chat/completions", content=body, headers=headers, timeout=120)
        assert resp.status_code == 200
        events = [e for e in resp.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        texts.append("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks))
    assert all(texts)  # the body sets no temperature: sampled, so the two replies need not be equal
