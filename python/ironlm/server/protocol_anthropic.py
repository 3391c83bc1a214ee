"""Anthropic's Messages API requests (POST /v1/messages, /v1/messages/count_tokens) and their translation into a
chat conversation: `system` a system message first, text blocks a turn's content, an assistant's `tool_use`
blocks its tool_calls, a user's `tool_result` blocks tool messages (in the order they came). Images, documents
and thinking blocks are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ironlm.exceptions import InvalidArgumentError

_I64_MAX = 2**63 - 1
# vLLM-style sampling extras passed on to the chat request underneath when present.
EXTRAS = ("ignore_eos", "min_tokens", "seed", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "priority", "timeout", "cache_salt", "structured_outputs")


def _invalid(param: str, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{param}: {reason}", param=param)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class Block(_Strict):
    """A content block: text, tool_use (assistant) or tool_result (user)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def problem(self) -> str | None:
        """What is wrong with this block, if anything (checked by the message: inside the content union a
        block's own error would come out as the union's, 'Input should be a valid string')."""
        need = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                "thinking": (), "redacted_thinking": ()}
        if self.type not in need:
            return (f"content block type {self.type!r} is not supported (text, tool_use, tool_result and thinking "
                    "only)")
        missing = [f for f in need[self.type] if getattr(self, f) is None]
        return f"a {self.type} block needs {', '.join(missing)}" if missing else None

    def result_text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _check(self) -> AnthropicMessage:
        # Plain ValueErrors in nested models: the 400 names the message by its path (messages.0).
        for block in self.content if isinstance(self.content, list) else []:
            problem = block.problem()
            if problem is not None:
                raise ValueError(problem)
            if block.type == "tool_use" and self.role != "assistant":
                raise ValueError("tool_use blocks belong in assistant messages")
            if block.type == "tool_result" and self.role != "user":
                raise ValueError("tool_result blocks belong in user messages")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        out: list[dict[str, Any]] = []
        text: list[str] = []
        calls = []
        for block in self.content:
            if block.type in ("thinking", "redacted_thinking"):
                continue  # an earlier turn's reasoning: chat templates drop it from the history too
            if block.type == "text":
                text.append(block.text or "")
            elif block.type == "tool_use":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            else:
                if text:  # text before a result stays before it
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = block.result_text()
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
        if self.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        elif text or not out:
            out.append({"role": "user", "content": "".join(text)})
        return out


class AnthropicTool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None

    @model_validator(mode="after")
    def _check(self) -> AnthropicTool:
        if self.type not in (None, "custom"):
            raise ValueError(f"tool type {self.type!r} is not supported (custom tools only)")
        return self


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _check(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('type "tool" needs a name')
        return self


class Thinking(_Strict):
    """Extended thinking: a reasoning model (--reasoning-parser) thinks unless told not to; `disabled` renders the
    prompt with `enable_thinking: false` (Qwen3's switch; templates without it ignore it). The budget is not
    enforced: max_tokens bounds thinking and answer together."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, le=_I64_MAX)


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: what the prompt of a /v1/messages request would take."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    thinking: Thinking | None = None

    def chat_body(self) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        if system:
            messages.append({"role": "system", "content": system})
        for m in self.messages:
            messages += m.chat_messages()
        body: dict[str, Any] = {"messages": messages}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None and self.thinking.type == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return body


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=_I64_MAX)  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, le=_I64_MAX)
    stream: bool = False
    metadata: Metadata | None = None

    def chat_body(self) -> dict[str, Any]:
        body = super().chat_body()
        body["max_tokens"] = self.max_tokens
        for name, value in (("stop", self.stop_sequences), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("top_k", self.top_k),
                            ("user", self.metadata.user_id if self.metadata else None)):
            if value is not None:
                body[name] = value
        extra = self.model_extra or {}
        body.update({k: extra[k] for k in EXTRAS if extra.get(k) is not None})
        return body


CHAT_PARAMS = {"stop": "stop_sequences", "user": "metadata.user_id"}
