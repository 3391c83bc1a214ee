"""Chat templates from outside the model (the operator's --chat-template, a trusted request's `chat_template`),
rendered in Jinja's immutable sandbox with a time and an output-size bound.

The sandbox alone stops attribute tricks, not a template that loops for an hour or builds a gigabyte string
(`{% for i in range(99999) %}{% for j in range(99999) %}`, `'x' * 10**10`, `'%0999999999d' | format(1)`). So:
- time: the render runs under a per-thread trace function that raises once the deadline passes, checked on every
  line the compiled template executes (its frames only: the tokenizer's own code runs untraced);
- size: output is streamed and counted; multiplication, powers, calls and filters refuse integer operands beyond
  the output budget, and printf-style widths beyond it, so no single operation allocates more than that.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ironlm.exceptions import InvalidArgumentError, TemplateLimitError

RENDER_TIMEOUT_S = 2.0
# The model's own template (through the tokenizer; a GGUF file brings its own) gets more room: it is the operator's
# choice, and only its time is bounded here, its output size by the prompt checks after it.
MODEL_RENDER_TIMEOUT_S = 5.0
T = TypeVar("T")
_TEMPLATE_FILE = "<template>"  # the file name jinja gives code compiled from a string
# A printf (`%9999999d`) or str.format (`{:>9999999}`) width of a million characters or more.
_WIDTH = re.compile(r"%[-+ #0]*(\d{7,})|\{[^{}]*:[^{}]*?(\d{7,})")


# chat_template_kwargs: a request's extra template variables (e.g. {"enable_thinking": false}) are small flags; the
# bounds keep them so, and keep them from renaming what the server passes the template itself.
MAX_KWARGS = 16
MAX_KWARGS_CHARS = 16 * 1024  # as JSON
MAX_KWARGS_DEPTH = 8
_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "bos_token", "eos_token", "raise_exception", "strftime_now", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs", "kwargs"})


def _depth(value: object) -> int:
    """Levels of dicts and lists in a JSON value, without recursion (a scalar is 0)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            depth += 1
            deepest = max(deepest, depth)
            if depth <= MAX_KWARGS_DEPTH:
                stack.extend((c, depth) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_template_kwargs(kwargs: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """`chat_template_kwargs` within bounds (keys, names, JSON size, depth), else InvalidArgumentError naming it.
    A key may not be one the server sets itself nor a parameter of the tokenizer's apply_chat_template."""
    param = "chat_template_kwargs"
    if len(kwargs) > MAX_KWARGS:
        raise InvalidArgumentError(f"{param}: at most {MAX_KWARGS} keys, got {len(kwargs)}", param=param)
    reserved = set(_RESERVED)
    method = getattr(tokenizer, "apply_chat_template", None)
    if method is not None:
        try:
            reserved |= set(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            pass
    for key in kwargs:
        if not _KWARG_NAME.fullmatch(key):
            raise InvalidArgumentError(f"{param}: key {key[:80]!r} is not a name (letters, digits, _; at most 64)",
                                       param=param)
        if key in reserved:
            raise InvalidArgumentError(f"{param}: {key!r} is set by the server, not by the request", param=param)
    if _depth(kwargs) > MAX_KWARGS_DEPTH:
        raise InvalidArgumentError(f"{param}: nested more than {MAX_KWARGS_DEPTH} levels deep", param=param)
    size = len(json.dumps(kwargs, ensure_ascii=False))
    if size > MAX_KWARGS_CHARS:
        raise InvalidArgumentError(f"{param}: {size} characters of JSON, over the limit of {MAX_KWARGS_CHARS}",
                                   param=param)
    return kwargs


def _too_large(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"chat_template: {what} exceeds the output bound", param="chat_template")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
        self.max_chars = max_chars
        self.filters = {name: self._bounded(f) for name, f in self.filters.items()}
        self.filters["format"] = self._bounded(self._format_checked(self.filters["format"]))
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def _check(self, values: Any) -> None:
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.max_chars:
                raise _too_large(f"the number {v}")

    def _check_format(self, fmt: Any) -> None:
        if isinstance(fmt, str) and any(int(w or v) > self.max_chars for w, v in _WIDTH.findall(fmt)):
            raise _too_large("a format width")

    def _format_checked(self, f: Any) -> Any:
        @functools.wraps(f)
        def checked(value: Any, *args: Any, **kwargs: Any) -> Any:
            self._check_format(value)
            return f(value, *args, **kwargs)
        return checked

    def _bounded(self, f: Any) -> Any:
        @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marker
        def checked(*args: Any, **kwargs: Any) -> Any:
            self._check(args)
            self._check(kwargs.values())
            return f(*args, **kwargs)
        return checked

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise _too_large(f"the power {right}")
        self._check((left, right))
        if operator == "%":
            self._check_format(left)
        if operator == "*" and isinstance(left, (str, list, tuple)) != isinstance(right, (str, list, tuple)):
            seq, count = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(count, int) and len(seq) * count > self.max_chars:
                raise _too_large("a repeated sequence")
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        self._check(args)
        self._check(kwargs.values())
        # str.format / format_map (the sandbox hands them out wrapped): the string's own text is the format
        owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
        if isinstance(owner, str):
            self._check_format(owner)
        return super().call(context, obj, *args, **kwargs)


def _raise(message: str) -> None:
    raise TemplateError(message)


class _Deadline:
    """A trace function for the rendering thread: raises in the template's frames once time is up."""

    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds
        self.seconds = seconds

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != _TEMPLATE_FILE:
            return None  # do not trace the tokenizer or jinja's runtime line by line
        self._check()
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        self._check()
        return self._line

    def _check(self) -> None:
        if time.monotonic() > self.until:
            raise TemplateLimitError(f"chat_template: rendering took longer than {self.seconds:g} s",
                                     param="chat_template")


def run_with_deadline(fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
    """Call `fn` (e.g. the tokenizer's apply_chat_template, whose jinja sandbox has no time bound) with the render
    deadline on this thread: a template that loops for long raises TemplateLimitError inside it."""
    previous = sys.gettrace()
    sys.settrace(_Deadline(MODEL_RENDER_TIMEOUT_S if timeout_s is None else timeout_s))
    try:
        return fn(*args)
    finally:
        sys.settrace(previous)


def render_bounded(source: str, context: dict[str, Any], max_chars: int,
                   timeout_s: float = RENDER_TIMEOUT_S) -> str:
    """Render `source` with `context` in the bounded sandbox; any failure is an InvalidArgumentError naming
    chat_template (a template error is the template's author's, a 400)."""
    env = _BoundedEnvironment(max_chars)
    previous = sys.gettrace()
    sys.settrace(_Deadline(timeout_s))
    try:
        template = env.from_string(source)
        chunks, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > max_chars:
                raise _too_large(f"the output ({size}+ characters)")
            chunks.append(chunk)
        return "".join(chunks)
    except InvalidArgumentError:
        raise
    except (TemplateError, RecursionError, MemoryError, TypeError, ValueError, AttributeError, IndexError,
            KeyError, OverflowError, ZeroDivisionError) as exc:
        raise InvalidArgumentError(f"chat_template: rendering failed: {type(exc).__name__}: {exc}",
                                   param="chat_template") from None
    finally:
        sys.settrace(previous)


def load_operator_template(value: str | None) -> str | None:
    """--chat-template: a path to a file, else the template text itself."""
    if value is None:
        return None
    if "{" not in value and "\n" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise InvalidArgumentError(f"chat_template: no such file: {value}", param="chat_template")
        return path.read_text(encoding="utf-8")
    return value


class TemplateRenderer:
    """Renders non-model chat templates for one tokenizer."""

    def __init__(self, tokenizer: Any, operator_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.operator_template = load_operator_template(operator_template)

    def token_ids(self, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                  kwargs: dict[str, Any], max_chars: int) -> list[int]:
        context = {**kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": _token(self.tokenizer, "bos_token"), "eos_token": _token(self.tokenizer, "eos_token")}
        text = render_bounded(template, context, max_chars)
        if not text:
            raise InvalidArgumentError("chat_template: rendered an empty prompt", param="chat_template")
        # The template writes the special tokens itself (bos_token above), as with HF chat templates.
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _token(tokenizer: Any, name: str) -> str:
    value = getattr(tokenizer, name, None)
    return value if isinstance(value, str) else ""
