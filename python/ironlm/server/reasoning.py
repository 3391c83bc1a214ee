"""Reasoning models' `<think>…</think>` text, split from a chat answer's content (`--reasoning-parser`).

Two formats, which differ only in where the reasoning begins when nothing says so:
- `deepseek_r1`: the output is reasoning from its first token until `</think>` (R1's template opens `<think>`
  in the prompt, older R1 builds write it themselves); an output that never closes it is all reasoning.
- `qwen3`: the output is reasoning only when it opens with `<think>` itself; otherwise it is all content.

The prompt decides first: a prompt whose rendered end is an open `<think>` (a template that starts the thinking
for the model) puts the output inside the reasoning; one that ends with a closed, empty block (Qwen3's
`enable_thinking: false`) makes the whole output content. A constrained output (response_format,
structured_outputs, guided_*) is the grammar's, not the model's: one whose grammar cannot write `</think>` (a JSON
schema, a choice) is all content whatever the prompt opened; one that can is reasoning only where it writes
`<think>` itself or the prompt opened one, never from its first token by default.

`split` is a pure function of the text so far, so streaming is the difference of two calls: while the output
is unfinished, an end that could still grow into a tag (`</thi`), leading whitespace and the reasoning's trailing
whitespace are held back, so what was sent is always a prefix of the final answer, however the tags are cut
across tokens.

`auto` (the default) reads the chat template (`detect`): one that writes `<think>` is a reasoning model's,
`deepseek_r1` when it is DeepSeek's (its `<｜Assistant｜>` marker), else `qwen3`; no `<think>`: off (`none`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from ironlm.exceptions import InvalidArgumentError

START, END = "<think>", "</think>"
# --reasoning-parser's choices (config.py keeps its own copy so the CLI imports nothing; a test checks they agree)
PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
PromptState = Literal["open", "closed", "none"]
_DEEPSEEK_MARK = "<｜Assistant｜>"
_PROMPT_TAIL_TOKENS = 8  # a template's generation prompt ends with `<think>\n` (or the closed block) at most


def detect(chat_template: str | None) -> str:
    """The parser `auto` means for this chat template: deepseek_r1, qwen3 or none."""
    if not chat_template or START not in chat_template:
        return "none"
    return "deepseek_r1" if _DEEPSEEK_MARK in chat_template else "qwen3"


def resolve(name: str, chat_template: str | None) -> str:
    if name not in PARSERS:
        raise InvalidArgumentError(f"reasoning_parser must be one of {', '.join(PARSERS)}, got {name!r}",
                                   param="reasoning_parser")
    return detect(chat_template) if name == "auto" else name


def can_close(constraint: Any) -> bool:
    """Whether an output constraint (StructuredOutputsParams) can write `</think>`: its text mentions it (also
    escaped, `<\\/think>`)."""
    texts = [v if isinstance(v, str) else json.dumps(v) for v in (constraint.json, constraint.regex,
                                                                  constraint.choice, constraint.grammar)
             if v is not None]
    return any("/think>" in t for t in texts)


def prompt_state(tokenizer: Any, prompt_ids: list[int]) -> PromptState:
    """Whether the prompt's end leaves a think block open ("open"), closes one ("closed"), or neither."""
    tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    opened, closed = tail.rfind(START), tail.rfind(END)
    if opened > closed and not tail[opened + len(START):].strip():
        return "open"
    if closed > opened and not tail[closed + len(END):].strip():
        return "closed"
    return "none"


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: this output has no reasoning part
    content: str


def _held(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could still grow into `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningSplitter:
    """How one request's outputs split: `mode` deepseek_r1 or qwen3, the prompt's state, and whether an output
    constraint shapes the text."""

    mode: str
    state: PromptState = "none"
    constrained: bool = False

    def split(self, text: str, done: bool) -> Split:
        """Reasoning and content of `text` (a choice's output so far; `done`: it is finished). Unfinished, the
        parts that may still change meaning are held back (see the module doc)."""
        if self.state == "closed":
            return Split(None, text)
        inside = self.state == "open" or (self.mode == "deepseek_r1" and not self.constrained)
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        if not done and len(rest) < len(START) and START.startswith(rest):
            return Split(None if not inside else "", "")  # `<thi` or only whitespace yet: undecided
        if rest.startswith(START):
            body = lead + len(START)
        elif inside:
            body = 0
        else:
            return Split(None, text)
        end = text.find(END, body)
        if end < 0:
            reasoning = text[body:]
            if not done:
                reasoning = reasoning[:len(reasoning) - _held(reasoning, END)].rstrip()
            return Split((reasoning.strip() or None) if done else reasoning.lstrip(), "")
        reasoning = text[body:end].strip()
        return Split(reasoning or None, text[end + len(END):].lstrip())


@dataclass
class ReasoningStream:
    """One streamed choice: the reasoning delta of each new output, and its content so far."""

    splitter: ReasoningSplitter
    sent: int = 0  # characters of reasoning already sent

    def feed(self, text: str, done: bool) -> tuple[str, str]:
        part = self.splitter.split(text, done)
        reasoning = part.reasoning or ""
        delta = reasoning[self.sent:]
        self.sent = max(self.sent, len(reasoning))
        return delta, part.content
