"""POST /v1/responses (OpenAI's Responses API) on the chat path: the request becomes a chat request, ChatHandler
renders and queues it, and its output (content and tool calls, as chat's tool parsing reads them) becomes output
items: one `message` item for the text, one `function_call` item per call.

Streaming sends the events the official client folds into a Response: response.created, response.in_progress,
then per item output_item.added, content_part.added / output_text.delta... / output_text.done / content_part.done
(or function_call_arguments.delta... / .done), output_item.done, and last response.completed (response.incomplete
when max_output_tokens cut it). Every event carries its sequence_number.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ironlm.engine import RequestStream
from ironlm.exceptions import InvalidArgumentError
from ironlm.server import reasoning
from ironlm.server.breaker import note_stream_error
from ironlm.server.errors import APIError, validation_error
from ironlm.server.protocol import ChatCompletionRequest
from ironlm.server.protocol_responses import CHAT_PARAMS, ResponsesRequest
from ironlm.server.response_store import ResponseStore, StoredResponse
from ironlm.server.serving_chat import ChatHandler
from ironlm.server.serving_common import EngineStreamingResponse, engine_error, final_outputs, usage
from ironlm.structured.tool_output import Message, ToolOutput


def chat_request(body: Callable[[], dict[str, Any]], params: dict[str, str]) -> ChatCompletionRequest:
    """The chat request `body()` builds, validated as it would be over HTTP; a 400 names the field as the calling
    API calls it (`params`: chat's top-level field -> that API's)."""
    try:
        return ChatCompletionRequest.model_validate_json(json.dumps(body()))
    except InvalidArgumentError as exc:  # the translation found a bad value
        raise APIError(400, str(exc), param=exc.param) from None
    except ValidationError as exc:
        err = validation_error(exc)
        head = (err.param or "").split(".")[0]
        if head in params:
            err.param = params[head]
            err.message = f"{params[head]}: {err.message.split(': ', 1)[-1]}"
        raise err from None


class ChoiceDeltas:
    """One streamed choice as chat would stream it: per engine output, the new reasoning text and the content /
    tool-call deltas; `finish` is set once the choice is done (later outputs are to be skipped). Shared by the
    Responses and Messages streams, which only dress these up as their own events."""

    def __init__(self, tools: ToolOutput | None, splitter: reasoning.ReasoningSplitter | None) -> None:
        self.tools = tools
        self.thinking = reasoning.ReasoningStream(splitter) if splitter is not None else None
        self.sent = 0  # content characters sent (without a tool parser)
        self.finish: str | None = None

    def feed(self, text: str, finish_reason: str | None) -> tuple[str, list[dict[str, Any]]]:
        thought = ""
        if self.thinking is not None:
            thought, text = self.thinking.feed(text, finish_reason is not None)
        if self.tools is not None:
            deltas, self.finish = self.tools.deltas(text, finish_reason)
        else:
            deltas = [{"content": text[self.sent:]}] if len(text) > self.sent else []
            self.sent, self.finish = len(text), finish_reason
        return thought, deltas


def split(splitter: reasoning.ReasoningSplitter | None, text: str) -> reasoning.Split:
    """A finished output's reasoning part (None without a reasoning parser) and content, as chat splits them."""
    return splitter.split(text, done=True) if splitter is not None else reasoning.Split(None, text)


def finished(tools: ToolOutput | None, text: str, finish_reason: str | None) -> Message:
    """A choice's final content, tool calls and finish reason, as chat reads them."""
    return tools.final(text, finish_reason) if tools is not None else Message(text, [], finish_reason)


class ResponsesHandler:
    def __init__(self, chat: ChatHandler, store: ResponseStore) -> None:
        self.chat, self.store = chat, store

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        history = self._history(req)
        chat_req = chat_request(lambda: req.chat_body(history), CHAT_PARAMS)
        rid = f"resp_{uuid.uuid4().hex}"
        chat_req.request_id = rid
        _, prompt, streams = await self.chat.start(chat_req, request)
        tools = self._tools(chat_req)
        splitter = self.chat.splitter(chat_req, prompt)
        if req.stream:
            return EngineStreamingResponse(self._stream(req, chat_req, rid, streams[0], history, tools, splitter),
                                           streams)
        (out,) = await final_outputs(streams, request)
        c = out.outputs[0]
        part = split(splitter, c.text)
        msg = finished(tools, part.content, c.finish_reason)
        items = _output_items(msg)
        if part.reasoning:
            items.insert(0, _reasoning_item(part.reasoning, "completed"))
        body = self._body(req, rid, _status(msg.finish_reason), items, usage([out]))
        self._keep(req, rid, body, history, msg)
        return JSONResponse(body)

    def get(self, rid: str) -> dict[str, Any]:
        entry = self.store.get(rid)
        if entry is None:
            raise APIError(404, f"No response found with id '{rid}'.", param="response_id", code="not_found")
        return entry.body

    def delete(self, rid: str) -> dict[str, Any]:
        if not self.store.delete(rid):
            raise APIError(404, f"No response found with id '{rid}'.", param="response_id", code="not_found")
        return {"id": rid, "object": "response", "deleted": True}

    def _history(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        if not self.store.enabled:
            raise APIError(400, "previous_response_id: this server keeps no responses (--response-store-size 0)",
                           param="previous_response_id")
        prev = self.store.get(req.previous_response_id)
        if prev is None:
            raise APIError(404, f"previous_response_id: no stored response with id '{req.previous_response_id}' "
                           "(never stored, stored with store: false, deleted or evicted)",
                           param="previous_response_id", code="previous_response_not_found")
        return prev.messages

    def _tools(self, chat_req: ChatCompletionRequest) -> ToolOutput | None:
        outputs = self.chat.tool_outputs(chat_req)
        return outputs[0] if outputs else None

    def _keep(self, req: ResponsesRequest, rid: str, body: dict[str, Any], history: list[dict[str, Any]],
              msg: Message) -> None:
        if not req.store or not self.store.enabled:
            return
        turn: dict[str, Any] = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            turn["tool_calls"] = [c.to_openai() for c in msg.tool_calls]
        self.store.put(rid, StoredResponse(body, history + req.messages() + [turn]))

    def _body(self, req: ResponsesRequest, rid: str, status: str, output: list[dict[str, Any]],
              counts: dict[str, Any] | None) -> dict[str, Any]:
        now = time.time()
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        body: dict[str, Any] = {
            "id": rid, "object": "response", "created_at": int(now), "status": status,
            "completed_at": int(now) if status in ("completed", "incomplete") else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.chat.model_name, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "store": req.store and self.store.enabled,
            "temperature": req.temperature, "top_p": req.top_p, "text": {"format": text_format},
            "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": req.truncation or "disabled", "metadata": req.metadata or {}, "user": req.user,
            "usage": None,
        }
        if counts is not None:
            cached = (counts.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            body["usage"] = {"input_tokens": counts["prompt_tokens"],
                             "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                             "output_tokens": counts["completion_tokens"],
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": counts["total_tokens"]}
        return body

    async def _stream(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, rid: str,
                      stream: RequestStream, history: list[dict[str, Any]], tools: ToolOutput | None,
                      splitter: reasoning.ReasoningSplitter | None) -> AsyncIterator[str]:
        events = _Events()
        choice = ChoiceDeltas(tools, splitter)
        yield events.emit("response.created", response=self._body(req, rid, "in_progress", [], None))
        yield events.emit("response.in_progress", response=self._body(req, rid, "in_progress", [], None))
        last = None
        try:
            async for out in stream:
                last = out
                if out.error:
                    raise APIError(500, f"the engine failed this request: {out.error}", code="engine_error")
                c = out.outputs[0]
                if choice.finish is not None:
                    continue
                thought, deltas = choice.feed(c.text, c.finish_reason)
                if thought:
                    for ev in events.reasoning(thought):
                        yield ev
                for d in deltas:
                    for ev in events.delta(d):
                        yield ev
            status = _status(choice.finish)
            for ev in events.close(status):
                yield ev
            body = self._body(req, rid, status, events.items, usage([last]))
            yield events.emit("response.incomplete" if status == "incomplete" else "response.completed",
                              response=body)
            if last is not None:
                c = last.outputs[0]
                content = split(splitter, c.text).content
                self._keep(req, rid, body, history, finished(self._tools(chat_req), content, c.finish_reason))
        except Exception as exc:  # noqa: BLE001 - engine failure mid-stream: in-band error, then a clean end
            err = exc if isinstance(exc, APIError) else engine_error(exc)
            note_stream_error(err.status)
            code = str(err.code)
            yield events.emit("error", code=code, message=err.message, param=err.param)
            failed = self._body(req, rid, "failed", events.items, None)
            failed["error"] = {"code": "server_error", "message": err.message}
            yield events.emit("response.failed", response=failed)
        finally:
            stream.close()


def _status(finish_reason: str | None) -> str:
    return "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)] if text else []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _output_items(msg: Message) -> list[dict[str, Any]]:
    status = "completed" if _status(msg.finish_reason) == "completed" else "incomplete"
    items = []
    if msg.content:
        items.append(_message_item(msg.content, status))
    items += [_call_item(c.id, c.name, c.arguments, status) for c in msg.tool_calls]
    return items


class _Events:
    """The stream's output items as they grow, and its SSE events (numbered in order)."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being generated
        self.calls: dict[int, dict[str, Any]] = {}  # chat's tool call index -> its function_call item

    def emit(self, type: str, **fields: Any) -> str:
        obj = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type}\ndata: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def _added(self, item: dict[str, Any]) -> str:
        self.items.append(item)
        self.open = item
        return self.emit("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def delta(self, d: dict[str, Any]) -> list[str]:
        """The events of one chat stream delta: {"content": ...} or {"tool_calls": [...]}."""
        out = []
        text = d.get("content")
        if text:
            if self.open is None or self.open["type"] != "message":
                out += self.close("completed")
                item = _message_item("", "in_progress")
                out.append(self._added(item))
                item["content"] = [_text_part("")]
                out.append(self.emit("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=_text_part("")))
            assert self.open is not None
            self.open["content"][0]["text"] += text
            out.append(self.emit("response.output_text.delta", item_id=self.open["id"],
                                 output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[]))
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call
                out += self.close("completed")
                item = _call_item(call["id"], fn.get("name", ""), "", "in_progress")
                self.calls[call["index"]] = item
                out.append(self._added(item))
            item = self.calls[call["index"]]
            args = fn.get("arguments") or ""
            if args:
                item["arguments"] += args
                out.append(self.emit("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.items.index(item), delta=args))
        return out

    def reasoning(self, text: str) -> list[str]:
        """The events of a reasoning delta (a reasoning item opens first when another item is open or none is)."""
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self.close("completed")
            item = _reasoning_item("", "in_progress")
            out.append(self._added(item))
            part = {"type": "reasoning_text", "text": ""}
            item["content"] = [part]
            out.append(self.emit("response.content_part.added", item_id=item["id"],
                                 output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        assert self.open is not None
        self.open["content"][0]["text"] += text
        out.append(self.emit("response.reasoning_text.delta", item_id=self.open["id"],
                             output_index=len(self.items) - 1, content_index=0, delta=text))
        return out

    def close(self, status: str) -> list[str]:
        """The events that finish the open item, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed" if status == "completed" else "incomplete"
        out = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                out.append(self.emit("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=[]))
            else:
                out.append(self.emit("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"]))
            out.append(self.emit("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
        else:
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 arguments=item["arguments"]))
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        return out
