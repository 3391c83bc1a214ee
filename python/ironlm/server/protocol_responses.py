"""The OpenAI Responses API's request (POST /v1/responses), and its translation into a chat conversation.

Input items become chat messages: `instructions` a system message first, message items by role, consecutive
`function_call` items one assistant turn with tool_calls, `function_call_output` items tool messages. Types are
strict and unknown fields ignored, as on the chat endpoint; features ironlm cannot honour (built-in tools,
images, background mode, server conversations) are refused with a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ironlm.exceptions import InvalidArgumentError

_I64_MAX = 2**63 - 1
# Fields of the Responses API that only OpenAI's hosted service can honour: a non-default value is a 400.
_UNSUPPORTED = {"background": "background mode", "conversation": "server-side conversations",
                "prompt": "stored prompt templates", "top_logprobs": "logprobs",
                "max_tool_calls": "max_tool_calls"}
# vLLM-style sampling extras passed on to the chat request underneath when present.
EXTRAS = ("ignore_eos", "min_tokens", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "stop", "stop_token_ids", "priority", "timeout", "cache_salt",
          "structured_outputs")


def _invalid(param: str, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{param}: {reason}", param=param)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class InputPart(_Strict):
    type: str
    text: str | None = None


class InputItem(_Strict):
    """One item of `input`: a message (`type` "message" or absent), a function call, or a call's output."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    # function_call / function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None

    @model_validator(mode="after")
    def _check(self) -> InputItem:
        # Plain ValueErrors in nested models: the 400 names the item by its path (input.2), message and all.
        if self.type == "message":
            if self.role is None or self.content is None:
                raise ValueError("a message item needs role and content")
        elif self.type == "function_call":
            if not self.call_id or not self.name or self.arguments is None:
                raise ValueError("a function_call item needs call_id, name and arguments")
        elif self.type == "function_call_output" and (not self.call_id or self.output is None):
            raise ValueError("a function_call_output item needs call_id and output")
        value = self.output if self.type == "function_call_output" else self.content
        for part in value if isinstance(value, list) else []:
            if part.type not in ("input_text", "output_text", "text") or part.text is None:
                raise ValueError(f"content part type {part.type!r} is not supported (text only)")
        return self

    def text(self) -> str:
        value = self.output if self.type == "function_call_output" else self.content
        if isinstance(value, str):
            return value
        return "".join(part.text or "" for part in value or [])


class ResponsesTool(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesTool:
        if self.type != "function":
            raise ValueError(f"tool type {self.type!r} is not supported (function tools only)")
        if not self.name:
            raise ValueError("a function tool needs a name")
        return self


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1, le=_I64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        extra = self.model_extra or {}
        for name, what in _UNSUPPORTED.items():
            if extra.get(name) not in (None, [], {}, "", False, 0):
                raise _invalid(name, f"{what} is not supported by this server")
        if self.input in ("", []):
            raise _invalid("input", "must not be empty")
        if self.metadata is not None and len(self.metadata) > 16:
            raise _invalid("metadata", "at most 16 keys")
        return self

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """Responses' `{"type": "function", "name": ...}` in chat's nesting; strings are the same in both."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise _invalid("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                               '"name": ...}')
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise _invalid("text.format", "type json_schema needs a schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_}}

    def messages(self) -> list[dict[str, Any]]:
        """This request's turns as chat messages (without `instructions` or a previous response's history)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if item.type == "reasoning":
                continue  # a reasoning model's summary from an earlier turn: no chat template renders it back
            if item.type == "message":
                assert item.role is not None
                out.append({"role": item.role, "content": item.text()})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text and calls
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The /v1/chat/completions body this request amounts to, after `history` (a stored conversation)."""
        messages = list(history)
        if self.instructions:
            messages = [{"role": "system", "content": self.instructions}] + messages
        messages += self.messages()
        body: dict[str, Any] = {"messages": messages, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                k: v for k, v in (("name", t.name), ("description", t.description), ("parameters", t.parameters))
                if v is not None}} for t in self.tools]
        for name, value in (("tool_choice", self.chat_tool_choice()), ("max_tokens", self.max_output_tokens),
                            ("temperature", self.temperature), ("top_p", self.top_p), ("user", self.user),
                            ("response_format", self.response_format())):
            if value is not None:
                body[name] = value
        extra = self.model_extra or {}
        body.update({k: extra[k] for k in EXTRAS if extra.get(k) is not None})
        return body


# The chat request's fields, as this API names them (a 400 from the chat model is reported under these).
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
