"""Prompts on their way in: refused early when they cannot fit, and tokenized off the event loop.

Tokenizing a long text takes seconds and the GIL in bursts; done on the event loop (or the engine thread, which
an engine-side `encode` would be) it stalls every other request. So the server tokenizes in a worker thread and
hands the engine token ids, and first refuses any text that cannot fit in `max_model_len` tokens whatever the
tokenizer does with it: no token is longer than the vocabulary's longest entry (in characters), so a text longer
than `max_model_len x that x _NORMALIZER_SLACK` is too long without being tokenized at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Request

from ironlm.config import ServerConfig
from ironlm.engine import EngineClient
from ironlm.exceptions import InvalidArgumentError
from ironlm.server.chat_template import TemplateRenderer, check_template_kwargs, run_with_deadline
from ironlm.server.errors import APIError
from ironlm.server.protocol import ChatCompletionRequest, CompletionRequest

# A tokenizer's normalizer may drop characters (control characters, combining marks folded into one), so the
# character bound gets a margin; a 20 MB text is still refused at once against any real context length.
_NORMALIZER_SLACK = 4
_max_token_chars: dict[int, int] = {}


def max_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (added/special ones included), at least 1; cached."""
    key = id(tokenizer)
    if key not in _max_token_chars:
        try:
            vocab = tokenizer.get_vocab()
            longest = max((len(t) for t in vocab), default=1)
        except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: assume a generous bound
            longest = 64
        _max_token_chars[key] = max(1, longest)
    return _max_token_chars[key]


def char_limit(engine: EngineClient) -> int:
    return engine.max_model_len * max_token_chars(engine.tokenizer) * _NORMALIZER_SLACK


def check_text_length(engine: EngineClient, chars: int, param: str) -> None:
    limit = char_limit(engine)
    if chars > limit:
        raise APIError(400, f"{param}: {chars} characters cannot fit in max_model_len ({engine.max_model_len}) "
                       "tokens", param=param, code="context_length_exceeded")


def vocab_size(engine: EngineClient) -> int:
    size = getattr(engine.model_config, "vocab_size", None)
    return int(size) if size else len(engine.tokenizer)


def check_model_bounds(engine: EngineClient, req: CompletionRequest | ChatCompletionRequest) -> None:
    """The bounds that depend on the model: top_k and token ids within the vocabulary."""
    vocab = vocab_size(engine)
    if req.top_k is not None and req.top_k > vocab:
        raise APIError(400, f"top_k: must be <= the vocabulary size ({vocab}), got {req.top_k}", param="top_k")
    for name, ids in (("stop_token_ids", req.stop_token_ids or []),
                      ("logit_bias", [int(k) for k in req.logit_bias or {}])):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise APIError(400, f"{name}: token ids must be < the vocabulary size ({vocab}), got {bad[0]}",
                           param=name)


def _settings(request: Request, engine: EngineClient) -> tuple[ServerConfig, TemplateRenderer]:
    """build_app keeps both on app.state; an app built otherwise gets the defaults."""
    state = request.app.state
    config = getattr(state, "config", None) or ServerConfig()
    renderer = getattr(state, "chat_templates", None) or TemplateRenderer(engine.tokenizer)
    return config, renderer


async def completion_prompts(engine: EngineClient, req: CompletionRequest,
                             request: Request) -> list[str | list[int] | dict[str, Any]]:
    """The request's prompts for the engine: token-id prompts as given, texts as {"prompt", "prompt_token_ids"}
    tokenized in a worker thread (the engine keeps the text for echo)."""
    config, _ = _settings(request, engine)
    check_model_bounds(engine, req)
    prompts = req.prompts()
    if len(prompts) > config.max_prompts_per_request:
        raise APIError(400, f"prompt: at most {config.max_prompts_per_request} prompts per request, got "
                       f"{len(prompts)}", param="prompt")
    return await encoded_prompts(engine, prompts)


async def encoded_prompts(engine: EngineClient, prompts: Sequence[str | list[int]]
                          ) -> list[str | list[int] | dict[str, Any]]:
    """Bounded prompts for the engine (HTTP and gRPC): over-long texts refused before tokenizing, the rest
    tokenized in a worker thread, never on the event loop or the engine thread."""
    for p in prompts:
        if isinstance(p, str):
            check_text_length(engine, len(p), "prompt")
        elif len(p) > engine.max_model_len:
            raise APIError(400, f"prompt: {len(p)} tokens exceed max_model_len ({engine.max_model_len})",
                           param="prompt", code="context_length_exceeded")
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return list(prompts)
    encoded = iter(await asyncio.to_thread(_encode_all, engine.tokenizer, texts))
    return [{"prompt": p, "prompt_token_ids": next(encoded)} if isinstance(p, str) else p for p in prompts]


def _encode_all(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(tokenizer.encode(t)) for t in texts]


async def chat_prompt_ids(engine: EngineClient, req: ChatCompletionRequest, request: Request,
                          default: Callable[[ChatCompletionRequest], list[int]]) -> list[int]:
    """The chat prompt's token ids, rendered and tokenized in a worker thread. A request's own `chat_template`
    needs --trust-request-chat-template; it, or the operator's --chat-template, is rendered by the bounded
    sandbox; otherwise `default()` (the model's template through the engine, sandboxed by transformers and
    time-bounded here) runs in the thread. `chat_template_kwargs` reach either template once within the bounds
    of check_template_kwargs."""
    config, renderer = _settings(request, engine)
    check_model_bounds(engine, req)
    chars = sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or [])
                for m in req.messages)
    check_text_length(engine, chars, "messages")
    if req.chat_template is not None and not config.trust_request_chat_template:
        raise APIError(400, "chat_template: this server does not accept request chat templates (start it with "
                       "--trust-request-chat-template)", param="chat_template")
    if req.chat_template_kwargs:
        try:
            check_template_kwargs(req.chat_template_kwargs, engine.tokenizer)
        except InvalidArgumentError as exc:
            raise APIError(400, str(exc), param="chat_template_kwargs") from None
    template = req.chat_template if req.chat_template is not None else renderer.operator_template
    if template is None:
        return list(await asyncio.to_thread(run_with_deadline, default, req))
    messages = req.message_dicts()
    try:
        return await asyncio.to_thread(renderer.token_ids, template, messages, req.add_generation_prompt,
                                       req.chat_template_kwargs or {}, char_limit(engine))
    except InvalidArgumentError as exc:
        raise APIError(400, str(exc), param=exc.param or "chat_template") from None
