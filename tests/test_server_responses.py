"""POST /v1/responses (OpenAI's Responses API) through the official `openai` client against a live tiny-model
server: plain and instructed input, function tools, streaming events, previous_response_id on the bounded store.
Every body and event is validated against the SDK's own pydantic models; greedy text equals what
/v1/chat/completions returns for the same conversation (one generation path underneath)."""

from __future__ import annotations

import argparse
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ironlm.cli_args import add_server_args, server_config_from_args
from ironlm.config import ServerConfig
from ironlm.server.api import build_app
from ironlm.server.response_store import ResponseStore, StoredResponse
from server_utils import LiveServer, shared_server

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content or "", r.usage.prompt_tokens


def create_raw(server: LiveServer, body: dict) -> Response:
    """POST the body, validate the answer strictly with the SDK's model (the client itself skips validation)."""
    r = httpx.post(server.base_url + "/responses", json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return Response.model_validate(r.json())


def stream_events(server: LiveServer, body: dict) -> list:
    with httpx.stream("POST", server.base_url + "/responses", json={"model": "tiny", "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [EVENTS.validate_python(json.loads(line[6:])) for line in lines if line.startswith("data: ")]
    assert names == [e.type for e in events]  # each SSE `event:` names its data's type
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_input_and_instructions_equal_chat(client: openai.OpenAI, server: LiveServer):
    for instructions in (None, "answer briefly"):
        extra = {"instructions": instructions} if instructions else {}
        r = client.responses.create(model="tiny", input="hello world", max_output_tokens=6, **extra, **GREEDY)
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
            {"role": "user", "content": "hello world"}]
        text, prompt_tokens = chat_text(client, messages, 6)
        assert r.output_text == text and text
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt_tokens, 6)
        assert r.usage.total_tokens == prompt_tokens + 6 and r.instructions == instructions
        raw = create_raw(server, {"input": "hello world", "max_output_tokens": 6, "temperature": 0,
                                  "ignore_eos": True, **extra})
        assert raw.output_text == text and raw.output[0].type == "message" and raw.id.startswith("resp_")


def test_message_items_equal_chat(client: openai.OpenAI):
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi "},
                                                             {"type": "input_text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
             {"role": "user", "content": "and then?"}]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=5, **GREEDY)
    expected, _ = chat_text(client, [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "hi there"},
                                     {"role": "assistant", "content": "hello"},
                                     {"role": "user", "content": "and then?"}], 5)
    assert r.output_text == expected


def test_stream_events_fold_into_the_response(client: openai.OpenAI, server: LiveServer):
    body = {"input": "hello world", "max_output_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = create_raw(server, body)
    events = stream_events(server, body)
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == full.output_text and final.usage.output_tokens == 6
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # The SDK's own stream helper folds the events into a Response (it checks indices as it goes); it needs
    # response.completed, so here a stop string (a vLLM extra) ends the text before max_output_tokens does.
    text = full.output_text
    stop = next(ch for i, ch in enumerate(text) if 0 < i < len(text) - 1 and text.find(ch) == i)
    cut = text[:text.find(stop)]
    with client.responses.stream(model="tiny", input="hello world", max_output_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True, "stop": [stop]}) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        folded = stream.get_final_response()
    assert "".join(texts) == folded.output_text == cut and folded.status == "completed"
    # Through the client's stream=True iterator as well, ending in response.completed when nothing cut it short.
    events = list(client.responses.create(model="tiny", input="hello world", max_output_tokens=6, stream=True,
                                          temperature=0))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                         "response.incomplete")


def test_forced_function_call_and_its_output_round_trip(client: openai.OpenAI, server: LiveServer):
    forced = {"input": "weather in Paris?", "tools": [TOOL], "max_output_tokens": 60, "temperature": 0,
              "tool_choice": {"type": "function", "name": "get_weather"}}
    r = create_raw(server, forced)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"
    # Streamed: the arguments arrive as deltas of one function_call item, equal to the non-streamed call.
    events = stream_events(server, forced)
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments
    with client.responses.stream(model="tiny", **forced) as stream:
        folded = stream.get_final_response()
    assert folded.output[0].type == "function_call" and folded.output[0].arguments == call.arguments
    # The call's output goes back as an input item; the answer is the chat answer to the same history.
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}]
    answer = client.responses.create(model="tiny", input=items, tools=[TOOL], tool_choice="none",
                                     max_output_tokens=6, **GREEDY)
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]
    expected, _ = chat_text(client, history, 6)
    assert answer.output_text == expected and expected
    # The agent loop on the store: only the call's output is sent, after previous_response_id.
    first = client.responses.create(model="tiny", **forced)
    stored_call = first.output[0]
    assert stored_call.arguments == call.arguments
    follow = client.responses.create(model="tiny", previous_response_id=first.id, tools=[TOOL], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": stored_call.call_id,
                                             "output": '{"temp": 21}'}], max_output_tokens=6, **GREEDY)
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = stored_call.call_id
    history[0]["content"] = "weather in Paris?"
    assert follow.output_text == chat_text(client, history, 6)[0]


def test_required_tool_choice_streams_whole_calls(client: openai.OpenAI):
    """tool_choice "required" (a grammar over every tool) with one call allowed: the call arrives whole at the end
    of the stream, as one function_call item the SDK's helper folds."""
    with client.responses.stream(model="tiny", input="weather?", tools=[TOOL], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, temperature=0) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[-1] == "response.completed" and "response.function_call_arguments.done" in types
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_previous_response_id_continues_and_store_is_honoured(client: openai.OpenAI):
    first = client.responses.create(model="tiny", input="hello", max_output_tokens=4, **GREEDY)
    second = client.responses.create(model="tiny", input="tell me more", previous_response_id=first.id,
                                     max_output_tokens=4, **GREEDY)
    expected, prompt_tokens = chat_text(client, [{"role": "user", "content": "hello"},
                                                 {"role": "assistant", "content": first.output_text},
                                                 {"role": "user", "content": "tell me more"}], 4)
    assert second.output_text == expected and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="tiny", input="hello", max_output_tokens=2, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model="tiny", input="x", previous_response_id=unstored.id, max_output_tokens=2)
    assert exc.value.body["param"] == "previous_response_id"
    # A streamed response is stored too, once complete.
    events = list(client.responses.create(model="tiny", input="hello", max_output_tokens=3, stream=True,
                                          **GREEDY))
    streamed_id = events[-1].response.id
    assert client.responses.retrieve(streamed_id).output_text == events[-1].response.output_text


def test_store_off_refuses_previous_response_id(tmp_path_factory, server: LiveServer):
    app = build_app(server.engine, served_model_name="tiny", config=ServerConfig(response_store_size=0))
    live = LiveServer(app, server.engine)
    try:
        c = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)
        r = c.responses.create(model="tiny", input="hello", max_output_tokens=2, **GREEDY)
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as exc:
            c.responses.create(model="tiny", input="x", previous_response_id=r.id, max_output_tokens=2)
        assert exc.value.body["param"] == "previous_response_id"
    finally:
        live.stop()


def test_store_is_bounded_lru():
    def entry(text: str) -> StoredResponse:
        return StoredResponse({"id": text}, [{"role": "user", "content": text}])

    store = ResponseStore(max_entries=2, max_chars=10_000)
    for rid in ("a", "b"):
        assert store.put(rid, entry(rid))
    store.get("a")  # a is now the most recently used: b goes first
    store.put("c", entry("c"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    size = entry("x" * 100).size()
    by_chars = ResponseStore(max_entries=100, max_chars=2 * size + 1)
    for rid in ("p", "q", "r"):
        assert by_chars.put(rid, entry("x" * 100))
    assert by_chars.get("p") is None and len(by_chars) == 2 and by_chars.chars <= 2 * size + 1
    assert not by_chars.put("huge", entry("x" * 10_000))  # alone over the bound: not kept, nothing evicted
    assert len(by_chars) == 2 and by_chars.delete("q") and not by_chars.delete("q")
    off = ResponseStore(max_entries=0, max_chars=10)
    assert not off.enabled and not off.put("a", entry("a"))
    with pytest.raises(ValueError, match="response_store_size"):
        ServerConfig(response_store_size=-1)
    parser = argparse.ArgumentParser()
    add_server_args(parser)  # `ironlm serve`'s flags
    config = server_config_from_args(parser.parse_args(["--response-store-size", "0",
                                                        "--response-store-max-chars", "5000"]))
    assert (config.response_store_size, config.response_store_max_chars) == (0, 5000)


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [{**TOOL, "parameters": {"type": "bogus"}}], "tool_choice": "required"}, "tools"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format"),
])
def test_bad_requests_are_openai_shaped_400(server: LiveServer, body: dict, param: str):
    r = httpx.post(server.base_url + "/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and err["type"] == "invalid_request_error" and err["message"], err
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_model_text_format_and_guards(client: openai.OpenAI, server: LiveServer):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x", max_output_tokens=2)
    r = client.responses.create(model="tiny", input="give json", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema"
    r415 = httpx.post(server.base_url + "/responses", content=b'{"input": "x"}',
                      headers={"content-type": "text/plain"})
    assert r415.status_code == 415 and r415.json()["error"]["code"] == "unsupported_media_type"
    doc = httpx.get(server.url + "/openapi.json").json()
    for name in ("ResponsesRequest", "MessagesRequest", "CountTokensRequest"):
        assert name in doc["components"]["schemas"]
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ResponsesRequest")
    assert {"/v1/messages", "/v1/messages/count_tokens", "/v1/responses/{response_id}"} <= set(doc["paths"])
