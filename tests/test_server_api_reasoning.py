"""A reasoning model behind /v1/responses and /v1/messages: the `<think>` part is a `reasoning` output item
(response.reasoning_text.delta when streamed) and an Anthropic `thinking` block (thinking_delta), the rest the
answer, exactly as /v1/chat/completions splits the same output into reasoning_content and content. The tiny random
thinking Qwen3 writes no tags by itself, so a regex (vLLM's structured_outputs extra) fixes the output's shape."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response

from ironlm.server.api import build_app
from server_utils import TINY_ENGINE_KW, AsyncLLMEngine, LiveServer
from test_reasoning import THINK_THEN_ANSWER, USER
from tiny_thinking import make_thinking_model

REGEX = {"structured_outputs": {"regex": THINK_THEN_ANSWER}, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from ironlm import EngineConfig, LLMEngine

    path = make_thinking_model(tmp_path_factory.mktemp("thinking"))
    kw = {**TINY_ENGINE_KW, "max_model_len": 512, "num_kv_blocks": 256}
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", **kw)))
    live = LiveServer(build_app(engine, served_model_name="tiny"), engine)  # --reasoning-parser auto: qwen3
    yield live
    live.stop()


@pytest.fixture(scope="module")
def split(server: LiveServer) -> tuple[str, str]:
    """(reasoning, answer) as chat splits the regex-shaped greedy output."""
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "tiny", "messages": USER, **REGEX},
                   timeout=120)
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"]
    return msg["reasoning_content"], msg["content"]


def test_responses_reasoning_item(server: LiveServer, split: tuple[str, str]):
    thought, answer = split
    r = httpx.post(server.base_url + "/responses", json={"model": "tiny", "input": "hello world", **REGEX},
                   timeout=120)
    body = Response.model_validate(r.json())
    assert [o.type for o in body.output] == ["reasoning", "message"]
    assert body.output[0].content[0].text == thought and body.output_text == answer
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    with c.responses.stream(model="tiny", input="hello world", temperature=0,
                            extra_body={"structured_outputs": REGEX["structured_outputs"]}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == thought and final.output_text == answer
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == thought


def test_messages_thinking_block(server: LiveServer, split: tuple[str, str]):
    thought, answer = split
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "messages": USER, "max_tokens": 200,
                                                       **REGEX}, timeout=120)
    m = Message.model_validate(r.json())
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == thought and m.content[1].text == answer
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    with c.messages.stream(model="tiny", messages=USER, max_tokens=200, extra_body=REGEX) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == thought and final.content[1].text == answer
    # An earlier turn's thinking block is accepted back in the history; `thinking: disabled` closes the block in
    # the prompt (Qwen3's enable_thinking false), which the token count shows.
    history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": "more"}]
    on = c.messages.count_tokens(model="tiny", messages=history).input_tokens
    off = c.messages.count_tokens(model="tiny", messages=history, thinking={"type": "disabled"}).input_tokens
    assert off > on
