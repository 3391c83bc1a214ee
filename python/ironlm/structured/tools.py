"""Tool calling: what `tool_choice` asks for, the grammar that forces a call, and calls read back from output.

`required` and a named function are forced with a JSON-schema constraint, so even a weak model produces a
well-formed call: a named function's output is its arguments object; `required` outputs a JSON array of
`{"name", "parameters"}` objects, one schema branch per tool. `auto` leaves the model free; a parser
(tool_parsers.py) finds the calls in its text afterwards.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from ironlm.exceptions import InvalidArgumentError
from ironlm.structured.params import StructuredOutputsParams

Mode = Literal["none", "auto", "required", "named"]
# OpenAI: a function without `parameters` takes none, so its forced call is exactly `{}`.
_NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments: str) -> ToolCall:
        return cls(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}  # stream deltas number the calls
        return out


@dataclass
class FunctionTool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None


@dataclass
class ToolChoice:
    mode: Mode
    name: str | None = None  # the function, when mode is "named"


def resolve_tool_choice(tools: list[FunctionTool], tool_choice: object) -> ToolChoice:
    """OpenAI's `tool_choice` against the request's tools; the default is auto with tools, none without."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise InvalidArgumentError(f"tool_choice: {tool_choice!r} needs tools", param="tool_choice")
        return ToolChoice(tool_choice)
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidArgumentError(
            'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice")
    if name not in {t.name for t in tools}:
        raise InvalidArgumentError(f"tool_choice: names function {name!r}, which is not in tools",
                                   param="tool_choice")
    return ToolChoice("named", name)


def forced_call_constraint(tools: list[FunctionTool], choice: ToolChoice,
                           parallel: bool = True) -> StructuredOutputsParams | None:
    """The constraint that makes the output a call (None for none/auto)."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.name == choice.name)
        return StructuredOutputsParams(json=tool.parameters or _NO_ARGS)
    if choice.mode != "required":
        return None
    branches = [{"type": "object",
                 "properties": {"name": {"const": t.name}, "parameters": t.parameters or _NO_ARGS},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def forced_calls(text: str, choice: ToolChoice) -> list[ToolCall] | None:
    """The calls in the output of a forced (named / required) request; None when the text is not a whole call
    (it was cut short by max_tokens or a stop string)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if choice.mode == "named":
        assert choice.name is not None
        return [ToolCall.new(choice.name, text.strip())] if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ToolCall.new(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls


def completed_calls(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The calls of a forced output cut short (max_tokens, a stop string): for `required`, each array item that
    was generated whole; for a named function, its call with the arguments as far as they got (what OpenAI
    answers, and what the stream already sent), none when no argument text was generated."""
    if choice.mode == "named":
        assert choice.name is not None
        return [ToolCall.new(choice.name, text.strip())] if text.strip() else []
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        return []
    pos += 1
    calls: list[ToolCall] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return calls  # the cut one, or the array's end
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return calls
        calls.append(ToolCall.new(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))


def template_tools(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    """The tools in the shape HF chat templates expect (OpenAI's request shape)."""
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.parameters or _NO_ARGS}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out
