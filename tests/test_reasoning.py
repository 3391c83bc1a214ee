"""Reasoning models: `<think>` text in reasoning_content / reasoning apart from content (--reasoning-parser),
chat_template_kwargs reaching the model's own template, and the forced tool-call fixes (parallel_tool_calls,
calls cut by max_tokens).

The real openai client against live servers on a tiny random Qwen3 whose tokenizer and template think. Random
weights write no tags by themselves, so a regex constraint (or the template) puts them there: the grammar fixes
the shape and greedy decoding the words, so every answer is deterministic and the server with the parser off
shows the raw text each split is checked against. Response bodies are validated against the openai SDK's models.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ironlm.cli_args import add_server_args, server_config_from_args
from ironlm.config import REASONING_PARSERS, ServerConfig
from ironlm.server import reasoning
from ironlm.server.api import build_app
from ironlm.server.reasoning import ReasoningSplitter, detect, prompt_state
from ironlm.structured.tools import ToolChoice, completed_calls, forced_calls
from server_utils import TINY_ENGINE_KW, AsyncLLMEngine, LiveServer
from tiny_thinking import DEEPSEEK_TEMPLATE, make_thinking_model

USER = [{"role": "user", "content": "hello world"}]
WORDS = "[a-z]{2,8}( [a-z]{2,8}){1,3}"
THINK_THEN_ANSWER = f"<think>\n{WORDS}\n</think>\n\n{WORDS}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}}}
CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}"\}\}</tool_call>'


# ---- the splitter alone: every cut of the text, streamed character by character, adds up to the final split ----
CASES = [
    # (mode, prompt state, constrained, text, reasoning, content)
    ("qwen3", "none", False, "<think>\nab cd\n</think>\n\nthe end", "ab cd", "the end"),
    ("qwen3", "none", False, "  plain <think> answer", None, "  plain <think> answer"),
    ("qwen3", "none", False, "<think>never closed", "never closed", ""),
    ("qwen3", "open", False, "inside </think>\nout", "inside", "out"),
    ("qwen3", "closed", False, "<think>x</think>y", None, "<think>x</think>y"),
    ("deepseek_r1", "none", False, "no tags at all", "no tags at all", ""),
    ("deepseek_r1", "none", False, "<think>\nr1 writes it</think>ok", "r1 writes it", "ok"),
    ("deepseek_r1", "none", True, "{\"json\": 1}", None, "{\"json\": 1}"),
    ("deepseek_r1", "open", True, "thought</think>{\"a\": 1}", "thought", "{\"a\": 1}"),
    ("deepseek_r1", "open", False, "<think>\n\n</think>\n\nempty thought", None, "empty thought"),
    ("deepseek_r1", "open", False, "a</thin", "a</thin", ""),
]


def test_can_close() -> None:
    from ironlm.structured.params import StructuredOutputsParams as P

    assert reasoning.can_close(P(regex="[a-z]+</think>[a-z]+")) and reasoning.can_close(P(regex=r"x<\/think>"))
    assert not reasoning.can_close(P(json={"type": "object"})) and not reasoning.can_close(P(choice=["a", "b"]))
    assert reasoning.can_close(P(choice=["a</think>b"]))


@pytest.mark.parametrize("mode,state,constrained,text,want_reasoning,want_content", CASES)
def test_split_streams_to_the_final_answer(mode: str, state: Any, constrained: bool, text: str,
                                           want_reasoning: str | None, want_content: str) -> None:
    splitter = ReasoningSplitter(mode, state, constrained)
    final = splitter.split(text, done=True)
    assert (final.reasoning, final.content) == (want_reasoning, want_content)
    stream = reasoning.ReasoningStream(splitter)
    got_reasoning, content = "", ""
    for n in range(len(text) + 1):  # every token boundary a tag could be cut at
        delta, content_so_far = stream.feed(text[:n], done=n == len(text))
        assert content_so_far.startswith(content), (n, content_so_far, content)  # content only ever grows
        got_reasoning += delta
        content = content_so_far
    assert got_reasoning == (want_reasoning or "") and content == want_content


def test_detect_and_prompt_state() -> None:
    assert detect(None) == detect("{{ messages }}") == "none"
    assert detect("{% if x %}<think>{% endif %}") == "qwen3"
    assert detect(DEEPSEEK_TEMPLATE) == "deepseek_r1"
    assert REASONING_PARSERS == reasoning.PARSERS
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="o1")
    parser = argparse.ArgumentParser()
    add_server_args(parser)  # the flag comes from the ServerConfig field
    assert server_config_from_args(parser.parse_args(["--reasoning-parser", "qwen3"])).reasoning_parser == "qwen3"
    assert server_config_from_args(parser.parse_args([])).reasoning_parser == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "o1"])
    from tiny_thinking import make_thinking_tokenizer

    tok = make_thinking_tokenizer()
    for kwargs, state in (({}, "none"), ({"enable_thinking": False}, "closed")):
        ids = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, **kwargs)
        assert prompt_state(tok, list(ids["input_ids"] if hasattr(ids, "keys") else ids)) == state
    ids = tok.encode("<｜User｜>hi<｜Assistant｜><think>\n")
    assert prompt_state(tok, ids) == "open"


def test_completed_calls_of_a_cut_forced_output() -> None:
    required = ToolChoice("required")
    calls = completed_calls('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "param', required)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1})]
    assert completed_calls('[{"name": "a", "par', required) == []
    (named,) = completed_calls('{"city": "Pa', ToolChoice("named", "get_weather"))
    assert named.name == "get_weather" and named.arguments == '{"city": "Pa'


# ---- live servers ----------------------------------------------------------------------------------------
class Servers:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

        def serve(**config: Any) -> LiveServer:
            return LiveServer(build_app(engine, served_model_name="tiny", config=ServerConfig(**config)), engine)

        self.qwen3 = serve()  # auto: the model's template writes <think>, DeepSeek's marker absent
        self.raw = serve(reasoning_parser="none")
        self.r1 = serve(chat_template=DEEPSEEK_TEMPLATE)  # auto from the operator's template: deepseek_r1
        self.r1_raw = serve(chat_template=DEEPSEEK_TEMPLATE, reasoning_parser="none")
        self.r1_forced = serve(reasoning_parser="deepseek_r1")  # on the model's own (Qwen3) template
        self.all = [self.qwen3, self.raw, self.r1, self.r1_raw, self.r1_forced]

    def client(self, server: LiveServer) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    from ironlm import EngineConfig, LLMEngine

    path = make_thinking_model(tmp_path_factory.mktemp("thinking"))
    kw = {**TINY_ENGINE_KW, "max_model_len": 1024, "num_kv_blocks": 512}  # the tools block takes ~400 tokens
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", **kw)))
    s = Servers(engine)
    yield s
    for server in s.all:
        server.stop()


def chat(server: LiveServer, **body: Any) -> dict[str, Any]:
    """A raw chat completion body, validated against the openai SDK's ChatCompletion model and JSON schema."""
    r = httpx.post(f"{server.base_url}/chat/completions", json={"model": "tiny", "temperature": 0, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    jsonschema.validate(data, ChatCompletion.model_json_schema())
    ChatCompletion.model_validate(data)
    return data


def streamed(client: openai.OpenAI, **body: Any) -> dict[str, Any]:
    """A streamed answer put back together from its deltas (each chunk checked against the SDK's schema)."""
    got: dict[str, Any] = {"reasoning_content": "", "reasoning": "", "content": "", "finish": None, "chunks": 0,
                           "calls": {}}
    schema = ChatCompletionChunk.model_json_schema()
    for chunk in client.chat.completions.create(**{"model": "tiny", "temperature": 0, "stream": True, **body}):
        jsonschema.validate(chunk.model_dump(mode="json", exclude_unset=True), schema)
        for ch in chunk.choices:
            d = ch.delta.model_dump()
            for key in ("reasoning_content", "reasoning", "content"):
                got[key] += d.get(key) or ""
            got["chunks"] += bool(d.get("reasoning_content"))
            assert (d.get("reasoning_content") or None) == (d.get("reasoning") or None)
            for call in ch.delta.tool_calls or []:
                p = got["calls"].setdefault(call.index, {"name": None, "arguments": ""})
                if call.function is not None:
                    p["name"] = call.function.name or p["name"]
                    p["arguments"] += call.function.arguments or ""
            got["finish"] = ch.finish_reason or got["finish"]
    return got


def regex(pattern: str) -> dict[str, Any]:
    return {"extra_body": {"structured_outputs": {"regex": pattern}}}


def test_qwen3_think_block_split_non_streamed_and_streamed(servers: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = chat(servers.raw, messages=USER, structured_outputs={"regex": THINK_THEN_ANSWER})
    raw_msg = raw["choices"][0]["message"]
    assert "reasoning_content" not in raw_msg and raw_msg["content"].startswith("<think>\n")  # parser off
    body = chat(servers.qwen3, messages=USER, structured_outputs={"regex": THINK_THEN_ANSWER})
    msg = body["choices"][0]["message"]
    thought, answer = raw_msg["content"].removeprefix("<think>\n").split("\n</think>\n\n")
    assert msg["reasoning_content"] == msg["reasoning"] == thought and msg["content"] == answer
    assert body["usage"] == {**raw["usage"], "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}
    c = servers.client(servers.qwen3)
    r = c.chat.completions.create(model="tiny", messages=USER, temperature=0, **regex(THINK_THEN_ANSWER))
    assert r.choices[0].message.reasoning_content == thought  # type: ignore[attr-defined]
    assert r.choices[0].message.content == answer
    # A stream hands a slow consumer only the newest output (RequestStream coalesces), and this tiny model steps
    # in about a millisecond: on a loaded machine the whole thought could reach the client as one delta. 20 ms
    # steps give the client time to take each token as it comes.
    step = servers.engine.engine.step

    def slow_step() -> Any:
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(servers.engine.engine, "step", slow_step)
    s = streamed(c, messages=USER, **regex(THINK_THEN_ANSWER))
    monkeypatch.undo()
    assert (s["reasoning_content"], s["reasoning"], s["content"], s["finish"]) == (thought, thought, answer, "stop")
    assert s["chunks"] >= 2  # the reasoning went out as it was generated, not in one piece at the end
    # every generated token's logprob goes out exactly once, whichever part its text landed in
    tokens = []
    for chunk in c.chat.completions.create(model="tiny", messages=USER, temperature=0, stream=True, logprobs=True,
                                           stream_options={"include_usage": True}, **regex(THINK_THEN_ANSWER)):
        tokens += [t.token for ch in chunk.choices for t in (ch.logprobs.content or [] if ch.logprobs else [])]
        usage = chunk.usage or None
    assert usage is not None and len(tokens) == usage.completion_tokens == body["usage"]["completion_tokens"]
    assert "".join(tokens) == raw_msg["content"]


def test_deepseek_r1_prompt_opens_the_think_block(servers: Servers) -> None:
    pattern = f"{WORDS}\n</think>\n\n{WORDS}"
    raw = chat(servers.r1_raw, messages=USER, structured_outputs={"regex": pattern})["choices"][0]["message"]
    thought, answer = raw["content"].split("\n</think>\n\n")
    body = chat(servers.r1, messages=USER, structured_outputs={"regex": pattern})
    msg = body["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == (thought, thought, answer)
    s = streamed(servers.client(servers.r1), messages=USER, **regex(pattern))
    assert (s["reasoning_content"], s["content"]) == (thought, answer)
    # max_tokens counts both parts: cut inside the reasoning, there is no content yet
    cut = chat(servers.r1, messages=USER, structured_outputs={"regex": pattern}, max_tokens=3)
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 3
    assert choice["message"]["content"] is None and thought.startswith(choice["message"]["reasoning_content"])
    # a grammar that cannot close the block (a JSON schema) writes the answer even though the prompt opened it
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    msg = chat(servers.r1, messages=USER, response_format=fmt)["choices"][0]["message"]
    assert msg["reasoning_content"] is None and set(json.loads(msg["content"])) == {"a"}


def test_deepseek_r1_unconstrained_output_is_reasoning_until_closed(servers: Servers) -> None:
    body = {"messages": USER, "max_tokens": 12}
    raw = chat(servers.raw, **body)["choices"][0]["message"]["content"]
    msg = chat(servers.r1_forced, **body)["choices"][0]["message"]
    want = ReasoningSplitter("deepseek_r1").split(raw, done=True)
    assert "</think>" in raw or want.reasoning == raw.strip()
    assert (msg["reasoning_content"], msg["content"] or "") == (want.reasoning, want.content)
    assert msg["reasoning_content"]


def test_enable_thinking_false_via_chat_template_kwargs(servers: Servers) -> None:
    plain = chat(servers.qwen3, messages=USER, max_tokens=1)
    off = chat(servers.qwen3, messages=USER, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    tok = servers.engine.tokenizer
    closed = len(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + closed
    # the prompt closed the block: even text that looks like a think block is content
    pattern = f"<think>{WORDS}</think>"
    raw = chat(servers.raw, messages=USER, structured_outputs={"regex": pattern},
               chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]["content"]
    for server in (servers.qwen3, servers.r1_forced):
        msg = chat(server, messages=USER, structured_outputs={"regex": pattern},
                   chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
        assert msg["content"] == raw and msg["reasoning_content"] is None


def test_chat_template_kwargs_bounds(servers: Servers) -> None:
    url = f"{servers.qwen3.base_url}/chat/completions"
    for kwargs in ({"tokenize": True}, {"messages": []}, {"add_generation_prompt": False}, {"bad-name": 1},
                   {f"k{i}": i for i in range(17)}, {"deep": [[[[[[[[[1]]]]]]]]]}, {"big": "x" * 20000}):
        r = httpx.post(url, json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": kwargs}, timeout=30)
        assert r.status_code == 400, (kwargs, r.text)
        assert r.json()["error"]["param"] == "chat_template_kwargs", r.text
    ok = httpx.post(url, json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": {"x": {"y": [1]}}},
                    timeout=30)
    assert ok.status_code == 200, ok.text


def test_tool_calls_are_parsed_from_the_content_only(servers: Servers) -> None:
    decoy = CALL.replace("get_weather", "ping")
    pattern = f"<think>\nmaybe {decoy}\n</think>\n\n{CALL}"
    body = chat(servers.qwen3, messages=USER, tools=[WEATHER, PING], structured_outputs={"regex": pattern})
    choice = body["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] is None
    assert '"name": "ping"' in msg["reasoning_content"]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    s = streamed(servers.client(servers.qwen3), messages=USER, tools=[WEATHER, PING], **regex(pattern))
    assert s["reasoning_content"] == msg["reasoning_content"] and s["finish"] == "tool_calls"
    assert [(p["name"], p["arguments"]) for p in s["calls"].values()] == [
        ("get_weather", call["function"]["arguments"])]
    # without the parser the decoy in the think block is the first call the tool parser finds
    raw = chat(servers.raw, messages=USER, tools=[WEATHER, PING], structured_outputs={"regex": pattern})
    assert raw["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "ping"


def test_parallel_tool_calls_false_keeps_one_call(servers: Servers) -> None:
    pattern = f"{CALL}\n{CALL}"
    for parallel, count in ((True, 2), (False, 1)):
        msg = chat(servers.raw, messages=USER, tools=[WEATHER], structured_outputs={"regex": pattern},
                   parallel_tool_calls=parallel)["choices"][0]["message"]
        assert len(msg["tool_calls"]) == count
        s = streamed(servers.client(servers.raw), messages=USER, tools=[WEATHER], parallel_tool_calls=parallel,
                     **regex(pattern))
        assert len(s["calls"]) == count


def test_forced_call_cut_by_max_tokens_returns_the_completed_calls(servers: Servers) -> None:
    # Random weights greedily keep adding calls to the array, so max_tokens cuts it: after two whole calls here.
    body = {"messages": USER, "tools": [PING], "tool_choice": "required", "temperature": 0, "max_tokens": 80}
    full = chat(servers.raw, **body, logprobs=True)
    text = "".join(t["token"] for t in full["choices"][0]["logprobs"]["content"])
    assert forced_calls(text, ToolChoice("required")) is None  # the JSON is cut
    want = [(c.name, json.loads(c.arguments)) for c in completed_calls(text, ToolChoice("required"))]
    assert len(want) >= 2, text
    for server in (servers.raw, servers.qwen3):  # the reasoning parser leaves forced calls alone
        choice = chat(server, **body)["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
    s = streamed(servers.client(servers.raw), **body)
    assert s["finish"] == "length" and s["content"] == ""
    assert [(p["name"], json.loads(p["arguments"])) for p in s["calls"].values()] == want
    # a named call cut short keeps the arguments it has, as the stream already sent them
    named = {**body, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
             "max_tokens": 3}
    choice = chat(servers.raw, **named)["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "length" and call["function"]["arguments"].startswith("{")
    s = streamed(servers.client(servers.raw), **named)
    assert s["finish"] == "length" and s["calls"][0]["arguments"] == call["function"]["arguments"]
