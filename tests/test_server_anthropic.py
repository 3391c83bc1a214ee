"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the official `anthropic`
client against a live tiny-model server: system prompts, stop sequences, streaming, a tool use round trip, token
counts, errors in Anthropic's shape and its x-api-key header. Bodies and events are validated against the SDK's own
pydantic models; greedy text equals what /v1/chat/completions returns for the same conversation."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from ironlm.server.api import build_app
from server_utils import LiveServer, shared_server

IGNORE_EOS = {"ignore_eos": True}
# This SDK's create() has no sampling arguments (temperature, top_p, top_k): they go in the body as extras.
GREEDY = {"extra_body": {"temperature": 0, "ignore_eos": True}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "weather", "input_schema": WEATHER}
USER = [{"role": "user", "content": "hello world"}]
EVENTS = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(oai: openai.OpenAI, messages: list[dict], max_tokens: int, **kw) -> tuple[str, int, str]:
    r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                    extra_body=IGNORE_EOS, **kw)
    return r.choices[0].message.content or "", r.usage.prompt_tokens, r.choices[0].finish_reason


def post(server: LiveServer, body: dict, path: str = "/v1/messages", **kw) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=120, **kw)


def text_of(message: Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_and_system_equal_chat(client: anthropic.Anthropic, oai: openai.OpenAI, server: LiveServer):
    for system in (None, "be brief", [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]):
        extra = {"system": system} if system is not None else {}
        m = client.messages.create(model="tiny", messages=USER, max_tokens=6, **GREEDY, **extra)
        prefix = [{"role": "system", "content": "be brief"}] if system else []
        expected, prompt_tokens, _ = chat(oai, prefix + USER, 6)
        assert text_of(m) == expected and expected
        assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.role == "assistant"
        assert (m.usage.input_tokens, m.usage.output_tokens) == (prompt_tokens, 6)
        raw = post(server, {"messages": USER, "max_tokens": 6, "temperature": 0, **IGNORE_EOS, **extra})
        assert raw.status_code == 200
        assert text_of(Message.model_validate(raw.json())) == expected


def test_stop_sequences(client: anthropic.Anthropic, oai: openai.OpenAI):
    full, _, _ = chat(oai, USER, 8)
    stop = next(ch for i, ch in enumerate(full) if 0 < i < len(full) - 1 and full.find(ch) == i)
    m = client.messages.create(model="tiny", messages=USER, max_tokens=8, stop_sequences=[stop], **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text_of(m) == full[:full.find(stop)] == chat(oai, USER, 8, stop=[stop])[0]
    with client.messages.stream(model="tiny", messages=USER, max_tokens=8, stop_sequences=[stop], **GREEDY) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", stop, text_of(m))


def test_stream_events(client: anthropic.Anthropic, server: LiveServer):
    body = {"messages": USER, "max_tokens": 6, "temperature": 0, **IGNORE_EOS}
    full = Message.model_validate(post(server, body).json())
    with httpx.stream("POST", server.url + "/v1/messages", json={"model": "tiny", "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [EVENTS.validate_python(json.loads(line[6:])) for line in lines if line.startswith("data: ")]
    assert names == [e.type for e in events]
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6
    assert events[0].message.usage.input_tokens == full.usage.input_tokens
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text_of(full)
    # The SDK's stream helper folds the events into the message.
    with client.messages.stream(model="tiny", messages=USER, max_tokens=6, **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(full) and final.stop_reason == "max_tokens"
    raw_events = list(client.messages.create(model="tiny", messages=USER, max_tokens=6, stream=True, **GREEDY))
    assert raw_events[0].type == "message_start" and raw_events[-1].type == "message_stop"


def test_tool_use_round_trip(client: anthropic.Anthropic, oai: openai.OpenAI, server: LiveServer):
    ask = [{"role": "user", "content": "weather in Paris?"}]
    kw = {"model": "tiny", "messages": ask, "tools": [TOOL], "max_tokens": 60, "extra_body": {"temperature": 0},
          "tool_choice": {"type": "tool", "name": "get_weather"}}
    m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    raw = post(server, {"messages": ask, "tools": [TOOL], "max_tokens": 60, "temperature": 0,
                        "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert Message.model_validate(raw.json()).content[0].input == use.input
    # Streamed: one tool_use block whose input_json_delta pieces are the same input.
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert final.content[0].input == use.input
    # `any` forces some call too.
    anyone = client.messages.create(**{**kw, "tool_choice": {"type": "any"}, "max_tokens": 200})
    assert anyone.stop_reason == "tool_use" and anyone.content[-1].type == "tool_use"
    # The result goes back in a user turn; the answer is chat's answer to the same history.
    history = [*ask, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                         "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": '{"temp": 21}'}]}]}]
    answer = client.messages.create(model="tiny", messages=history, tools=[TOOL], tool_choice={"type": "none"},
                                    max_tokens=6, **GREEDY)
    chat_history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": '{"temp": 21}'}]
    expected, _, _ = chat(oai, chat_history, 6)
    assert text_of(answer) == expected and expected


def test_count_tokens(client: anthropic.Anthropic, oai: openai.OpenAI):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "how are you?"}]}]
    counted = client.messages.count_tokens(model="tiny", system="be brief", messages=messages)
    _, prompt_tokens, _ = chat(oai, [{"role": "system", "content": "be brief"}, *messages[:2],
                                     {"role": "user", "content": "how are you?"}], 1)
    assert counted.input_tokens == prompt_tokens


@pytest.mark.parametrize(("body", "what"), [
    ({"messages": USER}, "max_tokens"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": USER, "max_tokens": 4, "temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
      "max_tokens": 4}, "tool_use"),
    ({"messages": USER, "max_tokens": 4, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]},
     "tool_choice"),
    ({"messages": USER, "max_tokens": 4, "tools": [{"name": "f"}]}, "input_schema"),
    ({"messages": USER, "max_tokens": 4, "stop_sequences": "x"}, "stop_sequences"),
])
def test_bad_requests_are_anthropic_shaped_400(server: LiveServer, body: dict, what: str):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert what in err["error"]["message"], err
    assert httpx.get(server.url + "/health").status_code == 200


def test_error_shapes_through_the_client(client: anthropic.Anthropic, server: LiveServer):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", messages=USER, max_tokens=0)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", messages=USER, max_tokens=2)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/messages/count_tokens", content=b"{bad",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_x_api_key_and_bearer(server: LiveServer):
    live = LiveServer(build_app(server.engine, served_model_name="tiny", api_key="sekrit"), server.engine)
    try:
        good = anthropic.Anthropic(base_url=live.url, api_key="sekrit", max_retries=0, timeout=120)
        m = good.messages.create(model="tiny", messages=USER, max_tokens=2)
        assert m.usage.output_tokens <= 2
        assert good.messages.count_tokens(model="tiny", messages=USER).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as exc:
            anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", messages=USER, max_tokens=2)
        assert exc.value.body["error"]["type"] == "authentication_error"
        bearer = anthropic.Anthropic(base_url=live.url, auth_token="sekrit", max_retries=0, timeout=120)
        assert bearer.messages.create(model="tiny", messages=USER, max_tokens=2).type == "message"
        oai = openai.OpenAI(base_url=live.base_url, api_key="sekrit", max_retries=0, timeout=120)
        assert oai.responses.create(model="tiny", input="hi", max_output_tokens=2).object == "response"
        assert httpx.get(live.base_url + "/models", headers={"x-api-key": "sekrit"}).status_code == 200
        assert httpx.get(live.base_url + "/models", headers={"x-api-key": "nope"}).status_code == 401
    finally:
        live.stop()


def test_engine_failure_is_each_apis_error(tmp_path_factory):
    """A failed forward, streamed and not: Anthropic's `error` event / api_error body, OpenAI's `error` event then
    response.failed / error body; the engine gives every block back."""
    from openai.types.responses import ResponseStreamEvent

    from server_utils import RealServer, wait_for

    real = RealServer(tmp_path_factory)
    try:
        body = {"model": "tiny", "max_tokens": 4, "messages": USER}
        real.faults.fail_next = 1
        r = httpx.post(real.url + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        real.faults.fail_next = 1
        c = anthropic.Anthropic(base_url=real.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(anthropic.APIError) as exc:
            list(c.messages.create(model="tiny", messages=USER, max_tokens=4, stream=True))
        assert exc.value.body["error"]["type"] == "api_error"
        real.faults.fail_next = 1
        with httpx.stream("POST", real.base_url + "/responses", timeout=60,
                          json={"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": True}) as s:
            datas = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        events = [TypeAdapter(ResponseStreamEvent).validate_python(d) for d in datas]
        assert [e.type for e in events][-2:] == ["error", "response.failed"]
        assert events[-1].response.status == "failed" and "injected" in events[-2].message
        real.faults.fail_next = 1
        r = httpx.post(real.base_url + "/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 4})
        assert r.status_code == 500 and set(r.json()) == {"error"}
        assert wait_for(real.idle, 10), real.kv_blocks()
        ok = c.messages.create(model="tiny", messages=USER, max_tokens=2)  # and it serves again
        assert ok.type == "message"
    finally:
        real.stop()
