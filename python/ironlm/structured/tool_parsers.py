"""Tool calls out of free model text (tool_choice "auto"): one parser per model family's call format.

A parser answers two questions: for the finished text, which part is content and which are tool calls; and while
streaming, how much of the text so far is surely content (it cannot be the start of a call), so it can be sent.

A call marker may be a special token of the model's tokenizer (Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>`): decoding with skip_special_tokens=True, every request's default, drops it from the text, and
the parser would never see the call. `keeps_special_tokens` tells the server to decode such requests with special
tokens kept (what vLLM's parsers do too); tokens that end the sequence (EOS) never reach the text either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from ironlm.exceptions import InvalidArgumentError
from ironlm.structured.tools import ToolCall

_DECODER = json.JSONDecoder()


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def _call_from_json(obj: object, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        # Some models put the arguments in as a JSON string already; keep it if it parses, else it is no call.
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall.new(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could still grow into `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def special_token_texts(tokenizer: Any) -> set[str]:
    """The texts of the tokens `tokenizer` (transformers or a bare `tokenizers.Tokenizer`) flags special: the ones
    skip_special_tokens drops when decoding."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added is None and hasattr(tokenizer, "get_added_tokens_decoder"):
        added = tokenizer.get_added_tokens_decoder()
    return {t.content for t in (added or {}).values() if getattr(t, "special", False)}


class ToolParser:
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # the texts that introduce a call

    def __init__(self) -> None:
        self._keeps: dict[int, bool] = {}

    def keeps_special_tokens(self, tokenizer: Any) -> bool:
        """Whether a request parsed for calls must be decoded with skip_special_tokens=False: one of this format's
        markers is a special token of `tokenizer`."""
        key = id(tokenizer)
        if key not in self._keeps:
            self._keeps[key] = bool(set(self.markers) & special_token_texts(tokenizer))
        return self._keeps[key]

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def safe_content_len(self, text: str) -> int:
        """How many leading characters of `text` (the output so far) are content whatever comes next."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them,
    after optional content. The closing tag may be missing at the end (the model stopped right after the JSON)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START,)

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(self.START)
        if first < 0:
            return ParsedOutput(text, [])
        calls: list[ToolCall] = []
        pos = first
        while pos >= 0:
            body = pos + len(self.START)
            try:
                obj, end = _DECODER.raw_decode(text, body + (len(text[body:]) - len(text[body:].lstrip())))
            except json.JSONDecodeError:
                return ParsedOutput(text, [])  # a malformed call: show the model's text rather than guess
            call = _call_from_json(obj, ("arguments", "parameters"))
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            pos = text.find(self.START, end)
        content = text[:first].strip()
        return ParsedOutput(content or None, calls)

    def safe_content_len(self, text: str) -> int:
        at = text.find(self.START)
        if at >= 0:
            return at
        return len(text) - _held_suffix(text, self.START)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+ JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several joined by `;`. A reply that starts with anything else is plain content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    def parse(self, text: str) -> ParsedOutput:
        rest = text.lstrip()
        rest = rest.removeprefix(self.TAG).lstrip()
        if not rest.startswith("{"):
            return ParsedOutput(text, [])
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(rest) and rest[pos] == "{":
            try:
                obj, pos = _DECODER.raw_decode(rest, pos)
            except json.JSONDecodeError:
                break
            call = _call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            while pos < len(rest) and rest[pos] in " \t\r\n;":
                pos += 1
        if not calls:
            return ParsedOutput(text, [])
        tail = rest[pos:].strip()
        return ParsedOutput(tail or None, calls)

    def safe_content_len(self, text: str) -> int:
        rest = text.lstrip()
        if not rest or rest.startswith("{") or self.TAG.startswith(rest[:len(self.TAG)]):
            return 0  # undecided, or a call: hold it all
        return len(text)


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional content."""

    name = "mistral"
    START = "[TOOL_CALLS]"
    markers = (START,)

    def parse(self, text: str) -> ParsedOutput:
        at = text.find(self.START)
        if at < 0:
            return ParsedOutput(text, [])
        body = text[at + len(self.START):].lstrip()
        try:
            obj, _ = _DECODER.raw_decode(body)
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from_json(o, ("arguments", "parameters")) for o in items]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        return ParsedOutput(text[:at].strip() or None, [c for c in calls if c is not None])

    def safe_content_len(self, text: str) -> int:
        at = text.find(self.START)
        if at >= 0:
            return at
        return len(text) - _held_suffix(text, self.START)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
# Chat template fragments that give a model's call format away, checked in this order.
_TEMPLATE_HINTS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                   ('"parameters"', "llama3_json"))
_MODEL_TYPE_HINTS = {"qwen2": "hermes", "qwen3": "hermes", "llama": "llama3_json", "mistral": "mistral"}


def get_tool_parser(name: str, chat_template: str | None = None, model_type: str | None = None) -> ToolParser:
    """The parser called `name`; "auto" picks it from the chat template's text, then the model type, then
    Hermes (the format most open models are tuned on)."""
    if name != "auto":
        if name not in PARSERS:
            raise InvalidArgumentError(
                f"tool_call_parser must be auto or one of {', '.join(PARSERS)}, got {name!r}", param="tool_call_parser")
        return PARSERS[name]()
    template = chat_template or ""
    for hint, parser in _TEMPLATE_HINTS:
        if hint in template:
            return PARSERS[parser]()
    return PARSERS[_MODEL_TYPE_HINTS.get(model_type or "", "hermes")]()
