"""The HTTP API through the official `openai` client, against a live server on a tiny model."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_utils import LiveServer, shared_server

IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def n_tokens(server: LiveServer, text: str) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["count"]


def test_models(client: openai.OpenAI, server: LiveServer):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completion_usage_and_stream_equal_non_stream(client: openai.OpenAI, server: LiveServer):
    kw = {"model": "tiny", "prompt": "hello world", "max_tokens": 6, "temperature": 0, "extra_body": IGNORE_EOS}
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.object == "text_completion"
    assert full.usage.completion_tokens == 6
    assert full.usage.prompt_tokens == n_tokens(server, "hello world")
    assert full.usage.total_tokens == full.usage.prompt_tokens + 6
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_prompt_forms_and_echo(client: openai.OpenAI, server: LiveServer):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello"}).json()["tokens"]
    kw = {"model": "tiny", "max_tokens": 3, "temperature": 0, "extra_body": IGNORE_EOS}
    by_text = client.completions.create(prompt="hello", **kw).choices[0].text
    by_ids = client.completions.create(prompt=ids, **kw).choices[0].text
    assert by_text == by_ids
    many = client.completions.create(prompt=["hello", "other prompt"], n=2, **kw)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert [c.text for c in many.choices if c.index in (0, 1)] == [by_text, by_text]  # greedy n=2
    echoed = client.completions.create(prompt="hello", echo=True, **kw).choices[0].text
    assert echoed == "hello" + by_text


def test_chat_stream_matches_non_stream_with_usage(client: openai.OpenAI):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    kw = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "extra_body": IGNORE_EOS}
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == msg.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens_and_n(client: openai.OpenAI):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                         max_completion_tokens=4, n=2, temperature=1.0, seed=5,
                                         extra_body=IGNORE_EOS)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 8


def test_stop_strings(client: openai.OpenAI):
    kw = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "extra_body": IGNORE_EOS}
    base = client.completions.create(**kw).choices[0].text
    assert len(base) >= 4
    stop = base[2:4]
    out = client.completions.create(stop=[stop], **kw).choices[0]
    assert out.finish_reason == "stop" and out.text == base[: base.index(stop)]
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == out.text


def test_logprobs(client: openai.OpenAI):
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, logprobs=3,
                                    extra_body=IGNORE_EOS).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # (tokens are decoded one by one, so a character split across tokens is not rebuilt: no join check)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)  # string keys: tokens decoding alike merge
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body=IGNORE_EOS).choices[0]
    content = chat.logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(bytes(t.bytes) == t.token.encode() for t in content)


def test_seed_reproducible(client: openai.OpenAI):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt="once upon", max_tokens=10, temperature=1.0,
                                         seed=seed, extra_body=IGNORE_EOS).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_errors(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    assert exc.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="hi " * 300, max_tokens=2)
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       temperature=-1)
    assert exc.value.body["param"] == "temperature"
