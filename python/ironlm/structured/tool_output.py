"""A chat choice's output as OpenAI message fields when tools are in play: content, tool_calls, finish_reason.

`ToolOutput.final` turns a finished text into the message; `ToolOutput.deltas` turns a growing text into stream
deltas: content goes out as soon as the parser knows it cannot be part of a call, a named call's arguments
stream as they are generated (the output *is* the arguments), other calls go out whole once the text is done.

A forced call cut short (max_tokens) still answers with the calls it holds (`completed_calls`), finish_reason
`length`; `parallel` false (parallel_tool_calls) keeps only the first call an `auto` answer makes, as the
forced grammar allows only one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ironlm.structured.tool_parsers import ToolParser
from ironlm.structured.tools import ToolCall, ToolChoice, completed_calls, forced_calls


@dataclass
class Message:
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


def _finish(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason is not None else reason


@dataclass
class ToolOutput:
    choice: ToolChoice
    parser: ToolParser | None  # for "auto"
    parallel: bool = True  # parallel_tool_calls: false keeps one call
    sent: int = 0  # characters of the text already sent (as content or as a named call's arguments)
    named_id: str | None = None

    def final(self, text: str, finish_reason: str | None) -> Message:
        mode = self.choice.mode
        if mode in ("named", "required"):
            calls = forced_calls(text, self.choice)
            if calls is None:  # cut short (max_tokens, a stop string): the calls it holds, the reason kept
                return Message(None, completed_calls(text, self.choice), finish_reason)
            return Message(None, calls, _finish(finish_reason, calls))
        if mode == "auto" and self.parser is not None:
            parsed = self.parser.parse(text)
            calls = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
            return Message(parsed.content, calls, _finish(finish_reason, calls))
        return Message(text, [], finish_reason)

    def deltas(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The stream deltas for `text` (all output so far), and the finish reason once it is finished."""
        mode, done = self.choice.mode, finish_reason is not None
        out: list[dict[str, Any]] = []
        if mode == "named":
            assert self.choice.name is not None
            if self.named_id is None:
                call = ToolCall.new(self.choice.name, "")
                self.named_id = call.id
                out.append({"tool_calls": [call.to_openai(0)]})
            if len(text) > self.sent:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self.sent:]}}]})
                self.sent = len(text)
            if done:
                calls = forced_calls(text, self.choice)  # None: cut short, the reason (length) kept
                return out, _finish(finish_reason, calls or [])
            return out, None
        if mode == "required":
            if not done:
                return out, None
            msg = self.final(text, finish_reason)
            if msg.tool_calls:  # the forced JSON is never content, even cut short
                out.append({"tool_calls": [c.to_openai(i) for i, c in enumerate(msg.tool_calls)]})
            return out, msg.finish_reason
        if mode == "auto" and self.parser is not None:
            if not done:
                safe = self.parser.safe_content_len(text)
                if safe > self.sent:
                    out.append({"content": text[self.sent:safe]})
                    self.sent = safe
                return out, None
            msg = self.final(text, finish_reason)
            if msg.tool_calls:
                if self.sent == 0 and msg.content:
                    out.append({"content": msg.content})
                out.append({"tool_calls": [c.to_openai(i) for i, c in enumerate(msg.tool_calls)]})
            elif len(text) > self.sent:
                out.append({"content": text[self.sent:]})
            self.sent = len(text)
            return out, msg.finish_reason
        if len(text) > self.sent:
            out.append({"content": text[self.sent:]})
            self.sent = len(text)
        return out, finish_reason
