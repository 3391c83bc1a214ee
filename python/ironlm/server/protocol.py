"""Request/response models in the OpenAI shape, plus vLLM's sampling extras.

Types are strict (a string where a number belongs is a 400, as with OpenAI), unknown fields are
accepted and ignored as vLLM does, but OpenAI features ironlm cannot honour (legacy functions, suffix, ...)
are rejected instead of silently ignored: a client relying on them must find out.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ironlm.exceptions import InvalidArgumentError
from ironlm.structured import json_depth
from ironlm.structured.params import StructuredOutputsParams
from ironlm.structured.tools import FunctionTool, ToolChoice, resolve_tool_choice

# Fields that exist in OpenAI/vLLM requests but whose non-default values ironlm cannot honour.
_UNSUPPORTED = {
    "functions": "legacy function calling (use tools)", "function_call": "legacy function calling (use tools)",
    "suffix": "suffix (insertion)", "audio": "audio output", "prediction": "predicted outputs",
    "web_search_options": "web search",
}
# vLLM's older request fields for structured outputs -> StructuredOutputsParams fields.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _invalid(param: str, reason: str) -> InvalidArgumentError:
    # pydantic keeps the exception a validator raised (the error's ctx["error"]), so the 400 body takes its
    # param from there: model-level validators have no field location of their own.
    return InvalidArgumentError(f"{param}: {reason}", param=param)


# The core takes counts and priorities as 64-bit ints: a larger JSON number is a 400 here, not an overflow later.
_I64_MAX = 2**63 - 1
# Seconds: a bound far above any real request keeps event-loop timers and the core's f64 deadlines finite.
_MAX_SECONDS = 1e6
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value, [-100, 100]
_TokenId = Annotated[int, Field(ge=0, le=_I64_MAX)]


class _Strict(BaseModel):
    # No NaN/Infinity: JSON has neither, and a non-finite number in a sampling field is never meant.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise _invalid("response_format", "type json_schema needs a json_schema object")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` body field: exactly one of json / regex / choice / grammar / json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None


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
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = Field(None, ge=-1, le=_I64_MAX)  # and <= the vocabulary: checked with the model
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int = Field(0, ge=0, le=_I64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[_TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-_I64_MAX - 1, le=_I64_MAX)
    timeout: float | None = Field(None, gt=0, le=_MAX_SECONDS)  # seconds for the whole request
    deadline: float | None = Field(None, gt=0, le=_MAX_SECONDS)  # TTFT target in seconds (policy "deadline")
    cache_salt: str | None = None
    request_id: str | None = Field(None, max_length=256)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: per prompt token, the token's and the top-N
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's beam search extension (server/serving_beam.py): the n best beams (of best_of on completions)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = "never"  # or false / "never"; checked with the beam search's other parameters

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        extra = self.model_extra or {}
        for name, what in _UNSUPPORTED.items():
            if extra.get(name) not in (None, [], {}, "", False):
                raise _invalid(name, f"{what} is not supported by this server")
        self.structured()  # a malformed constraint is a 400 here, before anything is queued
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
                     "frequency_penalty", "seed", "stop", "stop_token_ids", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.logit_bias:
            kw["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        kw["structured_outputs"] = self.structured()[0]
        return kw

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint, and the body field that set it (compile errors are reported under it)."""
        extra = self.model_extra or {}
        guided = {k: v for k, v in extra.items() if k in _GUIDED and v is not None}
        given = [name for name, on in (("response_format", self.response_format is not None
                                        and self.response_format.type != "text"),
                                       ("structured_outputs", self.structured_outputs is not None),
                                       *((k, True) for k in guided)) if on]
        if len(given) > 1:
            raise _invalid(given[1], f"cannot be combined with {given[0]}")
        if not given:
            return None, None
        source = given[0]
        try:
            if source == "response_format":
                fmt = self.response_format
                assert fmt is not None
                if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    return StructuredOutputsParams(json_object=True), source
                return StructuredOutputsParams(json=fmt.json_schema.schema_), source
            if source == "structured_outputs":
                so = self.structured_outputs
                assert so is not None
                kw = so.model_dump(by_alias=True, exclude={"disable_any_whitespace", "whitespace_pattern"})
                return StructuredOutputsParams(**kw, disable_any_whitespace=so.disable_any_whitespace,
                                               whitespace_pattern=so.whitespace_pattern), None
            return StructuredOutputsParams(**{_GUIDED[source]: guided[source]}), source
        except InvalidArgumentError as exc:
            # Over HTTP the field is the body's: structured_outputs.json stays, response_format replaces it.
            param = str(exc.param) if source == "structured_outputs" else source
            reason = str(exc).removeprefix(str(exc.param)).lstrip(" :")
            raise _invalid(param, reason) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=_I64_MAX)  # 0: only with echo (the prompt alone comes back)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        p = self.prompt
        if p == "" or p == [] or (isinstance(p, list) and any(x in ("", []) for x in p)):
            raise _invalid("prompt", "must not be empty")
        if self.best_of is not None and self.best_of < self.n:
            raise _invalid("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise _invalid("best_of", "only best_of == n is supported without use_beam_search")
        if self.max_tokens == 0 and not self.echo:
            raise _invalid("max_tokens", "0 is only allowed with echo (which returns the prompt alone)")
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


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """An earlier assistant turn's tool call, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise _invalid("messages", "only assistant messages carry tool_calls")
        if self.role == "tool" and self.content is None:
            raise _invalid("messages", "a tool message needs content (the tool's result)")
        for call in self.tool_calls or ():
            _arguments_object(call.function.arguments)  # too deep: a 400 here, on every path that renders it
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as HF chat templates take it: "developer" is OpenAI's new name for "system", which is all
        templates know; a call's arguments go in as an object, which is what templates iterate over."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments_object(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out

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


def _arguments_object(arguments: str) -> Any:
    """A call's arguments as the template takes them; InvalidArgumentError (messages) when nested too deep."""
    try:
        return json_depth.loads(arguments, "messages")
    except json.JSONDecodeError:
        return arguments  # not JSON: the template gets the text as it came


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_I64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked by resolve_tool_choice (param tool_choice)
    parallel_tool_calls: bool = True
    # Refused unless the server trusts request templates (--trust-request-chat-template), as in vLLM.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise _invalid("top_logprobs", "requires logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise _invalid("tools", "function names must be unique")
        choice = self.tool_choice_resolved()
        if choice.mode in ("required", "named") and self.structured()[0] is not None:
            raise _invalid("tool_choice", f"{self.tool_choice!r} cannot be combined with another output constraint")
        return self

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool(t.function.name, t.function.parameters or {}, t.function.description)
                for t in self.tools or []]

    def tool_choice_resolved(self) -> ToolChoice:
        return resolve_tool_choice(self.function_tools(), self.tool_choice)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


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
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's shape (server/logprobs.py)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    # With a reasoning parser (--reasoning-parser): the <think> text, under vLLM's older and newer names.
    reasoning_content: str | None = None
    reasoning: str | None = None


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
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's shape (server/logprobs.py)


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
