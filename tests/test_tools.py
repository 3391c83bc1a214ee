"""Tool calling: the parsers on fixed texts (finished and streamed), tool_choice, forced calls on the real tiny
engine (a random model still calls the tool correctly under the grammar), and round trips over HTTP with the
official openai client, streamed and not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from ironlm.config import TOOL_CALL_PARSERS, ServerConfig
from ironlm.exceptions import InvalidArgumentError
from ironlm.server.protocol import ChatCompletionRequest
from ironlm.server.serving_chat import ChatHandler
from ironlm.structured.tool_output import ToolOutput
from ironlm.structured.tool_parsers import PARSERS, HermesToolParser, Llama3JsonToolParser, get_tool_parser
from ironlm.structured.tools import (
    FunctionTool,
    ToolChoice,
    forced_call_constraint,
    forced_calls,
    resolve_tool_choice,
)
from server_utils import LiveServer, shared_server
from tiny_models import make_tiny_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HISTORY = [{"role": "user", "content": "weather in Paris?"}]


# ---- parsers on fixed text ----------------------------------------------------------------------------
HERMES_TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
LLAMA_TEXT = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}; ' \
             '{"name": "get_time", "parameters": {"tz": "UTC"}}'


def test_parsers_extract_calls_and_content():
    out = HermesToolParser().parse(HERMES_TEXT)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]
    assert all(c.id.startswith("call_") for c in out.tool_calls) and len({c.id for c in out.tool_calls}) == 2
    # the closing tag may be missing when the model stops right after the JSON
    assert HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {}}').tool_calls[0].name == "f"
    for text in ("no calls here", '<tool_call>{"name": "f", "arguments": {broken', '<tool_call>{"arguments": {}}'):
        out = HermesToolParser().parse(text)
        assert out.tool_calls == [] and out.content == text

    out = Llama3JsonToolParser().parse(LLAMA_TEXT)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 1}), ("get_time", {"tz": "UTC"})]
    assert Llama3JsonToolParser().parse(' {"name": "f", "arguments": "{\\"a\\": 1}"}').tool_calls[0].arguments \
        == '{"a": 1}'
    for text in ("The answer is {1}", '{"not": "a call"}'):
        assert Llama3JsonToolParser().parse(text) == type(out)(text, [])

    out = PARSERS["mistral"]().parse('ok [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]')
    assert out.content == "ok" and out.tool_calls[0].name == "f"


def stream_through(output: ToolOutput, text: str, finish: str = "stop") -> tuple[str, list[dict], str | None]:
    """Feed `text` one character per step as the engine would (cumulative text), collect what goes out."""
    content, calls, reason = "", [], None
    for i in range(1, len(text) + 1):
        deltas, reason = output.deltas(text[:i], finish if i == len(text) else None)
        for d in deltas:
            content += d.get("content", "")
            calls.extend(d.get("tool_calls", []))
    return content, calls, reason


@pytest.mark.parametrize(("parser", "text"), [(HermesToolParser(), HERMES_TEXT),
                                              (Llama3JsonToolParser(), LLAMA_TEXT)])
def test_streamed_calls_equal_the_finished_parse(parser, text):
    final = ToolOutput(ToolChoice("auto"), parser).final(text, "stop")
    content, calls, reason = stream_through(ToolOutput(ToolChoice("auto"), parser), text)
    assert reason == final.finish_reason == "tool_calls"
    assert "<tool" not in content and "{" not in content  # no part of a call leaks out as content
    assert content.strip() == (final.content or "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(c.name, json.loads(c.arguments)) for c in final.tool_calls]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    # plain text streams as content, character for character, and a text that only looks like a call
    # prefix at some point is released once it is clearly not one
    plain = "a <tool_cal b < c"
    content, calls, reason = stream_through(ToolOutput(ToolChoice("auto"), parser), plain)
    assert (content, calls, reason) == (plain, [], "stop")


def test_named_call_streams_its_arguments():
    choice = ToolChoice("named", "get_time")
    content, calls, reason = stream_through(ToolOutput(choice, None), '{"tz": "UTC"}')
    assert content == "" and reason == "tool_calls"
    assert calls[0]["function"] == {"name": "get_time", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == '{"tz": "UTC"}'
    # cut short by max_tokens: partial arguments, finish "length" (as OpenAI does)
    assert stream_through(ToolOutput(choice, None), '{"tz": "U', "length")[2] == "length"


def test_tool_choice_and_forced_constraints():
    tools = [FunctionTool("get_weather", WEATHER), FunctionTool("get_time", TIME)]
    assert resolve_tool_choice(tools, None).mode == "auto" and resolve_tool_choice([], None).mode == "none"
    assert resolve_tool_choice(tools, {"type": "function", "function": {"name": "get_time"}}) == \
        ToolChoice("named", "get_time")
    for bad in ({"type": "function", "function": {"name": "nope"}}, {"type": "function"}, "sometimes"):
        with pytest.raises(InvalidArgumentError) as exc:
            resolve_tool_choice(tools, bad)
        assert exc.value.param == "tool_choice"
    with pytest.raises(InvalidArgumentError):
        resolve_tool_choice([], "required")
    required = forced_call_constraint(tools, ToolChoice("required"), parallel=False)
    assert required is not None and isinstance(required.json, dict)
    schema = required.json
    jsonschema.validate([{"name": "get_time", "parameters": {"tz": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"tz": "UTC"}}] * 2, schema)  # maxItems 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Rome", "days": 1}}], schema)
    calls = forced_calls('[{"name": "get_time", "parameters": {"tz": "UTC"}}]', ToolChoice("required"))
    assert calls is not None and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"tz": "UTC"}
    assert forced_calls('[{"name": "get_ti', ToolChoice("required")) is None


def test_parser_names_and_auto_pick():
    assert TOOL_CALL_PARSERS == ("auto", *PARSERS)
    assert get_tool_parser("auto", "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert get_tool_parser("auto", "<|python_tag|>").name == "llama3_json"
    assert get_tool_parser("auto", None, "llama").name == "llama3_json"
    assert get_tool_parser("auto", None, "qwen2").name == "hermes"
    assert get_tool_parser("mistral").name == "mistral"
    with pytest.raises(InvalidArgumentError):
        ServerConfig(tool_call_parser="nope")


def test_history_and_tools_reach_the_chat_template():
    """Assistant tool_calls (arguments as objects, which templates iterate over) and tool results go to the
    template, and so do the tools."""
    seen: dict = {}

    class Engine:
        tokenizer = model_config = None

        def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
            seen.update(messages=messages, **kwargs)
            return [1, 2, 3]

    req = ChatCompletionRequest.model_validate({"messages": [
        *HISTORY, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], "tools": TOOLS})
    assert ChatHandler(Engine(), "m").prompt_ids(req) == [1, 2, 3]  # type: ignore[arg-type]
    assert seen["tools"] == TOOLS
    assert seen["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}
    assert seen["messages"][2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    seen.clear()
    ChatHandler(Engine(), "m").prompt_ids(ChatCompletionRequest.model_validate({"messages": HISTORY}))
    assert "tools" not in seen  # templates (and engines) that know no tools still work
    for bad in ({"role": "user", "content": "x", "tool_calls": []},
                {"role": "tool", "tool_call_id": "c"}):
        with pytest.raises(pydantic.ValidationError):
            ChatCompletionRequest.model_validate({"messages": [bad]})


# ---- the real engine over HTTP ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_forced_calls_are_valid_even_from_random_weights(client: openai.OpenAI):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, names in ((named, {"get_weather"}), ("required", {"get_weather", "get_time"})):
        r = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=200, n=8, temperature=1.0, seed=5,
                                           parallel_tool_calls=tool_choice == named)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None
            check_calls(choice.message.tool_calls or [], names)


def test_round_trip_streamed_and_not(client: openai.OpenAI):
    for stream in (False, True):
        kwargs = {"model": "tiny", "tools": TOOLS, "max_tokens": 200, "seed": 11,
                  "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
        if not stream:
            msg = client.chat.completions.create(messages=HISTORY, **kwargs).choices[0].message
            calls = msg.tool_calls or []
        else:
            pieces: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(messages=HISTORY, stream=True, **kwargs):
                for ch in chunk.choices:
                    finish = ch.finish_reason or finish
                    for d in ch.delta.tool_calls or []:
                        p = pieces.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                        p["id"] = d.id or p["id"]
                        if d.function is not None:
                            p["name"] = d.function.name or p["name"]
                            p["arguments"] += d.function.arguments or ""
            assert finish == "tool_calls"
            calls = [openai.types.chat.ChatCompletionMessageToolCall(
                id=p["id"], type="function", function={"name": p["name"], "arguments": p["arguments"]})
                for _, p in sorted(pieces.items())]
        check_calls(calls, {"get_time"})
        call = calls[0]
        history = [*HISTORY, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}]
        # The answer continues exactly the prompt the template renders from this history (the tool's result in
        # it): its prompt length, and its greedy text equals a plain completion of that prompt.
        rendered = [HISTORY[0], {"role": "assistant", "content": ""}, {"role": "tool", "content": '{"time": "12:00"}'}]
        prompt = make_tiny_tokenizer().apply_chat_template(rendered, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
        gen = {"model": "tiny", "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
        expected = client.completions.create(prompt=prompt, **gen).choices[0].text
        answer = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none", stream=stream,
                                                stream_options={"include_usage": True} if stream else None, **gen)
        if stream:
            chunks = list(answer)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            used = chunks[-1].usage
        else:
            text = answer.choices[0].message.content or ""
            assert answer.choices[0].finish_reason == "length" and not answer.choices[0].message.tool_calls
            used = answer.usage
        assert used is not None and (used.prompt_tokens, used.completion_tokens) == (len(prompt), 8)
        assert text and text == expected


def test_auto_parses_a_call_end_to_end(server: LiveServer):
    """With tool_choice auto the model is free; a regex makes the random model write a Hermes call, which the
    parser must find, streamed and not."""
    rx = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
    body = {"model": "tiny", "messages": HISTORY, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 120,
            "structured_outputs": {"regex": rx}, "seed": 3}
    c = httpx.Client(base_url=server.base_url, timeout=120)
    r = c.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    with c.stream("POST", "/chat/completions", json={**body, "stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [ch["choices"][0] for ch in chunks if ch.get("choices")]
    assert not "".join(d["delta"].get("content") or "" for d in deltas).strip()
    streamed = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
    assert len(streamed) == 1 and streamed[0]["function"]["name"] == "get_weather"
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400(server: LiveServer, extra: dict, param: str):
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": "tiny", "messages": HISTORY, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert httpx.get(server.url + "/health").status_code == 200


def test_special_markers_decide_skip_special_tokens():
    """Only a marker the tokenizer flags special needs special tokens kept: the tiny tokenizer's `<tool_call>` is
    plain text, and `<|im_end|>` is special but no marker."""
    from tokenizers import AddedToken

    tok = make_tiny_tokenizer()
    assert not any(p().keeps_special_tokens(tok) for p in PARSERS.values())
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.add_tokens([AddedToken("<|python_tag|>", special=False)])
    assert [n for n, p in PARSERS.items() if p().keeps_special_tokens(tok)] == ["mistral"]
    ids = tok.encode('[TOOL_CALLS][{"name": "f", "arguments": {}}]', add_special_tokens=False)
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)  # why: the default drops it


# ---- a call marker that is a special token (Mistral's [TOOL_CALLS]) ------------------------------------------
@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory) -> LiveServer:
    """A tiny Mistral whose tokenizer holds `[TOOL_CALLS]` as a special token (id 5), as Mistral's own do: the
    default skip_special_tokens=True would drop it from the text."""
    from ironlm import EngineConfig, LLMEngine
    from server_utils import TINY_ENGINE_KW, AsyncLLMEngine, build_app
    from tiny_models import ENDOFTEXT_ID, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("mistral-tools"), arch="mistral")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        f = path / name
        f.write_text(f.read_text().replace("<|endoftext|>", "[TOOL_CALLS]"))
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", **TINY_ENGINE_KW)))
    assert engine.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") == ENDOFTEXT_ID
    server = LiveServer(build_app(engine, served_model_name="tiny", config=ServerConfig(tool_call_parser="mistral")),
                        engine)
    yield server
    server.stop()


def test_mistral_special_marker_survives_skip_special_tokens(mistral_server: LiveServer):
    """The grammar makes the random model emit the special token itself, then the call's JSON; the request keeps
    the default skip_special_tokens=True, and the parser must still see the marker, streamed and not."""
    from tiny_models import ENDOFTEXT_ID

    call = '[{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]'
    grammar = f"start: <[{ENDOFTEXT_ID}]> CALL\nCALL: {json.dumps(call)}\n"
    body = {"model": "tiny", "messages": HISTORY, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 120,
            "structured_outputs": {"grammar": grammar}}
    c = httpx.Client(base_url=mistral_server.base_url, timeout=120)
    r = c.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (tc,) = choice["message"]["tool_calls"]
    assert (tc["function"]["name"], json.loads(tc["function"]["arguments"])) == ("get_weather", {"city": "Rome",
                                                                                                   "days": 3})
    with c.stream("POST", "/chat/completions", json={**body, "stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [ch["choices"][0] for ch in chunks if ch.get("choices")]
    assert not "".join(d["delta"].get("content") or "" for d in deltas)  # the marker never leaks as content
    streamed = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert [t["function"]["name"] for t in streamed] == ["get_weather"]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    # Without tools the request's own skip_special_tokens holds: the special token stays out of the text.
    plain = c.post("/chat/completions", json={"model": "tiny", "messages": HISTORY, "max_tokens": 120,
                                              "structured_outputs": {"grammar": grammar}}).json()
    assert plain["choices"][0]["message"]["content"] == call
