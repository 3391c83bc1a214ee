"""Request/response models in the OpenAI shape, plus vLLM's sampling extras.

Types are strict (a string where a number belongs is a 400, as with OpenAI), unknown fields are
accepted and ignored as vLLM does, but OpenAI features ironlm cannot honour (tools, structured output,
suffix, ...) are rejected instead of silently ignored: a client relying on them must find out.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ironlm.exceptions import InvalidArgumentError

# Fields that exist in OpenAI/vLLM requests but whose non-default values ironlm cannot honour.
_UNSUPPORTED = {
    "tools": "tool calling", "functions": "function calling", "function_call": "function calling",
    "suffix": "suffix (insertion)", "audio": "audio output", "prediction": "predicted outputs",
    "guided_json": "guided decoding", "guided_regex": "guided decoding", "guided_choice": "guided decoding",
    "guided_grammar": "guided decoding", "structured_outputs": "structured outputs",
    "prompt_logprobs": "prompt logprobs", "web_search_options": "web search",
}


def _invalid(param: str, reason: str) -> InvalidArgumentError:
    # pydantic keeps the exception a validator raised (the error's ctx["error"]), so the 400 body takes its
    # param from there: model-level validators have no field location of their own.
    return InvalidArgumentError(f"{param}: {reason}", param=param)


# The core takes counts and priorities as 64-bit ints: a larger JSON number is a 400 here, not an overflow later.
_I64_MAX = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=_I64_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int = Field(0, ge=0, le=_I64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-_I64_MAX - 1, le=_I64_MAX)
    timeout: float | None = Field(None, gt=0)  # seconds for the whole request
    deadline: float | None = Field(None, gt=0)  # TTFT target in seconds (scheduling policy "deadline")
    cache_salt: str | None = None
    request_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        extra = self.model_extra or {}
        for name, what in _UNSUPPORTED.items():
            if extra.get(name) not in (None, [], {}, "", False):
                raise _invalid(name, f"{what} is not supported by this server")
        fmt = extra.get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise _invalid("response_format", "only {'type': 'text'} is supported")
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options", "only allowed when stream is true")
        if self.logit_bias and not all(k.strip().isdigit() for k in self.logit_bias):
            raise _invalid("logit_bias", "keys must be token ids")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise _invalid("stop_token_ids", "token ids must be >= 0")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams kwargs; unset fields keep SamplingParams' defaults."""
        kw: dict[str, Any] = {
            "n": self.n, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seed", "stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.logit_bias:
            kw["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        p = self.prompt
        if p == "" or p == [] or (isinstance(p, list) and any(x in ("", []) for x in p)):
            raise _invalid("prompt", "must not be empty")
        if self.best_of is not None and self.best_of != self.n:
            raise _invalid("best_of", "only best_of == n is supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # one prompt given as token ids
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise _invalid("messages", f"a {self.role} message needs content")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise _invalid("messages", f"content part type {part.type!r} is not supported (text only)")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_I64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tool_choice: Any = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none", "auto"):
            raise _invalid("tool_choice", "tool calling is not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise _invalid("top_logprobs", "requires logprobs to be true")
        return self

    def message_dicts(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's new name for "system"; chat templates only know the latter.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _invalid("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- responses (non-streaming; stream chunks are plain dicts built in serving.py) ----------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ironlm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
