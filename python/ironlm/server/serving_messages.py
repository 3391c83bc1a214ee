"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) on the chat path: the request
becomes a chat request, ChatHandler renders and queues it, and its output (content and tool calls as chat's tool
parsing reads them) becomes content blocks: a `text` block, then one `tool_use` block per call.

Streaming sends Anthropic's events: message_start, per block content_block_start / content_block_delta
(text_delta or input_json_delta) / content_block_stop, message_delta (stop_reason, stop_sequence, usage) and
message_stop. Errors, the middleware's included, go out in Anthropic's shape on these paths
(`AnthropicErrorMiddleware`): `{"type": "error", "error": {"type": ..., "message": ...}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ironlm.engine import RequestStream
from ironlm.server import reasoning
from ironlm.server.breaker import note_stream_error
from ironlm.server.errors import APIError
from ironlm.server.prompt_limits import chat_prompt_ids
from ironlm.server.protocol_anthropic import CHAT_PARAMS, CountTokensRequest, MessagesRequest
from ironlm.server.serving_chat import ChatHandler
from ironlm.server.serving_common import EngineStreamingResponse, engine_error, final_outputs
from ironlm.server.serving_responses import ChoiceDeltas, chat_request, finished, split
from ironlm.structured.tool_output import ToolOutput
from ironlm.structured.tools import ToolCall

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": _input(call.arguments)}


def stop_of(finish_reason: str | None, stop_reason: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from chat's finish reason and the engine's stop reason (the matched stop string,
    or a stop token id)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


class MessagesHandler:
    def __init__(self, chat: ChatHandler) -> None:
        self.chat = chat

    async def count_tokens(self, req: CountTokensRequest, request: Request) -> dict[str, int]:
        chat_req = chat_request(req.chat_body, CHAT_PARAMS)
        prompt = await chat_prompt_ids(self.chat.engine, chat_req, request, self.chat.prompt_ids)
        return {"input_tokens": len(prompt)}

    async def create(self, req: MessagesRequest, request: Request) -> Response:
        chat_req = chat_request(req.chat_body, CHAT_PARAMS)
        mid = f"msg_{uuid.uuid4().hex}"
        chat_req.request_id = mid
        _, prompt, streams = await self.chat.start(chat_req, request)
        outputs = self.chat.tool_outputs(chat_req)
        tools = outputs[0] if outputs else None
        splitter = self.chat.splitter(chat_req, prompt)
        if req.stream:
            return EngineStreamingResponse(self._stream(mid, streams[0], len(prompt), tools, splitter), streams)
        (out,) = await final_outputs(streams, request)
        c = out.outputs[0]
        part = split(splitter, c.text)
        msg = finished(tools, part.content, c.finish_reason)
        content: list[dict[str, Any]] = []
        if part.reasoning:
            content.append({"type": "thinking", "thinking": part.reasoning, "signature": ""})
        if msg.content:
            content.append({"type": "text", "text": msg.content})
        content += [_tool_use(call) for call in msg.tool_calls]
        stop, sequence = stop_of(msg.finish_reason, c.stop_reason)
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": self.chat.model_name,
                             "content": content, "stop_reason": stop, "stop_sequence": sequence,
                             "usage": self._usage(len(out.prompt_token_ids), len(c.token_ids),
                                                  out.num_cached_tokens)})

    @staticmethod
    def _usage(prompt: int, generated: int, cached: int) -> dict[str, int]:
        return {"input_tokens": prompt, "output_tokens": generated, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0}

    async def _stream(self, mid: str, stream: RequestStream, prompt_tokens: int, tools: ToolOutput | None,
                      splitter: reasoning.ReasoningSplitter | None) -> AsyncIterator[str]:
        blocks = _Blocks()
        choice = ChoiceDeltas(tools, splitter)
        start: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "model": self.chat.model_name,
                                 "content": [], "stop_reason": None, "stop_sequence": None,
                                 "usage": self._usage(prompt_tokens, 0, 0)}
        yield _event("message_start", message=start)
        generated = 0
        stop_reason: int | str | None = None
        try:
            async for out in stream:
                if out.error:
                    raise APIError(500, f"the engine failed this request: {out.error}", code="engine_error")
                c = out.outputs[0]
                if choice.finish is not None:
                    continue
                generated, stop_reason = len(c.token_ids), c.stop_reason
                thought, deltas = choice.feed(c.text, c.finish_reason)
                if thought:
                    for ev in blocks.thinking(thought):
                        yield ev
                for d in deltas:
                    for ev in blocks.delta(d):
                        yield ev
            for ev in blocks.close():
                yield ev
            stop, sequence = stop_of(choice.finish, stop_reason)
            yield _event("message_delta", delta={"stop_reason": stop, "stop_sequence": sequence},
                         usage={"output_tokens": generated})
            yield _event("message_stop")
        except Exception as exc:  # noqa: BLE001 - engine failure mid-stream: an in-band error event ends it
            err = exc if isinstance(exc, APIError) else engine_error(exc)
            note_stream_error(err.status)
            yield _event("error", **{k: v for k, v in anthropic_error(err.status, err.message).items()
                                     if k != "type"})
        finally:
            stream.close()


def _event(type: str, **fields: Any) -> str:
    obj = {"type": type, **fields}
    return f"event: {type}\ndata: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _Blocks:
    """The streamed message's content blocks: which one is open (thinking, text, tool_use), and chat's tool call
    index -> block index."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "text" or "tool_use"
        self.calls: dict[int, int] = {}

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open = block["type"]
        out.append(_event("content_block_start", index=self.count, content_block=block))
        return out

    def thinking(self, text: str) -> list[str]:
        out = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        out.append(_event("content_block_delta", index=self.count, delta={"type": "thinking_delta", "thinking": text}))
        return out

    def delta(self, d: dict[str, Any]) -> list[str]:
        out = []
        text = d.get("content")
        if text:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(_event("content_block_delta", index=self.count, delta={"type": "text_delta", "text": text}))
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:
                block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                         "name": fn.get("name", ""), "input": {}}
                out += self._start(block)
                self.calls[call["index"]] = self.count
            args = fn.get("arguments") or ""
            if args:
                out.append(_event("content_block_delta", index=self.calls[call["index"]],
                                  delta={"type": "input_json_delta", "partial_json": args}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # the SDK folds a block's signature in; ironlm signs nothing
            out.append(_event("content_block_delta", index=self.count, delta={"type": "signature_delta",
                                                                              "signature": ""}))
        self.open = None
        self.count += 1
        return out + [_event("content_block_stop", index=self.count - 1)]


class AnthropicErrorMiddleware:
    """Rewrites the OpenAI-shaped error bodies every other layer produces (key check, body guards, handlers) into
    Anthropic's shape on the Messages paths, so the anthropic client reads the right type and message. Only JSON
    answers with an error status are buffered; everything else, streams included, passes through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].rstrip("/") not in PATHS:
            await self.app(scope, receive, send)
            return
        start: Message | None = None  # an error answer's head, held until its body is rewritten
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] >= 400 and _is_json(message):
                    start = message
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _converted(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def _is_json(start: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json") for k, v in start.get("headers", []))


def _converted(status: int, body: bytes) -> bytes:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return json.dumps(anthropic_error(status, str(message))).encode()
