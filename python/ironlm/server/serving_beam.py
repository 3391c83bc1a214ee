"""`use_beam_search: true` (vLLM's extension) on /v1/completions, the `n` best of `best_of` (default n) beams, and on
/v1/chat/completions, the `n` best of `n` (split into reasoning and content as any answer; tools are refused).

The beam search of engine/beam_search.py, each step one engine request per live beam (all or none admitted), so a
beam step queues and is scheduled like any request, and its prompt's full KV blocks are prefix-cache hits on its
parent's. Beam search is deterministic: temperature must be 0 (or unset), and the sampling fields that would
change which token a step picks, logprobs, stop strings, structured outputs and streaming are refused with a 400
naming the field rather than ignored. `length_penalty` and `early_stopping` (true, false, "never") are as in
transformers. A choice's text is its generated tokens' without the final EOS, as vLLM's; `finish_reason` is
"stop" for an EOS, "length" otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from fastapi import Request
from fastapi.responses import JSONResponse

from ironlm.engine.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    EarlyStopping,
    advance_all,
    capped_max_tokens,
    finish,
    pending_prompts,
    step_params,
)
from ironlm.exceptions import InvalidArgumentError
from ironlm.server.errors import APIError
from ironlm.server.prompt_limits import chat_prompt_ids, completion_prompts
from ironlm.server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
)
from ironlm.server.serving_common import decode, final_outputs, start_streams

if TYPE_CHECKING:
    from ironlm.engine import EngineClient
    from ironlm.server.protocol import ChatCompletionRequest, CompletionRequest
    from ironlm.server.reasoning import ReasoningSplitter
    from ironlm.server.shedding import Shedder

# Body fields beam search cannot honour, with the values that mean "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "logprobs": (None, False), "prompt_logprobs": (None,), "stop": (None, []),
    "stop_token_ids": (None, []), "top_p": (None, 1.0), "top_k": (None, -1, 0), "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}), "min_tokens": (0,),
}


class ChatHandler(Protocol):
    """What beam_chat uses of serving_chat.ChatHandler (which imports this module)."""

    engine: EngineClient
    model_name: str
    shedder: Shedder | None

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]: ...

    def splitter(self, req: ChatCompletionRequest, prompt: list[int]) -> ReasoningSplitter | None: ...


def beam_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, num_eos: int) -> BeamSearchParams:
    """The request's BeamSearchParams; a 400 naming the body field for anything beam search cannot do."""
    for name, neutral in _NEUTRAL.items():
        if getattr(req, name, None) not in neutral:
            raise APIError(400, f"{name}: not supported with use_beam_search", param=name)
    constraint, source = req.structured()
    if constraint is not None:
        param = source or "structured_outputs"
        raise APIError(400, f"{param}: not supported with use_beam_search", param=param)
    best_of = getattr(req, "best_of", None)
    width = best_of if best_of is not None else req.n
    try:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                  temperature=0.0 if req.temperature is None else req.temperature,
                                  length_penalty=req.length_penalty,
                                  early_stopping=cast(EarlyStopping, req.early_stopping))
        params.top_logprobs(num_eos)  # within the logprobs a step may read
        return params
    except InvalidArgumentError as exc:
        param = str(exc.param)
        if param == "beam_width":
            param = "best_of" if best_of is not None else "n"
        reason = str(exc).removeprefix(str(exc.param)).lstrip(" :")
        raise APIError(400, f"{param}: {reason}", param=param) from None


async def run_beam_search(engine: EngineClient, base_id: str, prompts: Sequence[list[int]],
                          params: BeamSearchParams, req: Any, request: Request,
                          shedder: Shedder | None = None) -> list[BeamSearchOutput]:
    """Step the beams of every prompt together until each search is done; the client going away, a timeout or an
    engine failure ends it as for any request (`req.timeout` bounds the whole search, not each step)."""
    eos = eos_ids(engine)
    sp = step_params(params, len(eos))
    instances = [BeamSearchInstance(list(ids), params, eos, capped_max_tokens(params, len(ids), engine.max_model_len))
                 for ids in prompts]
    start, step = time.monotonic(), 0
    while batch := pending_prompts(instances):
        step_req = req
        if req.timeout is not None:
            left = req.timeout - (time.monotonic() - start)
            if left <= 0:
                raise APIError(503, "the request timed out during beam search", code="timeout")
            step_req = req.model_copy(update={"timeout": left})
        streams = await start_streams(engine, f"{base_id}-beam{step}", batch, sp, step_req,
                                      shedder=shedder if step == 0 else None,
                                      tenant_header=request.headers.get("x-tenant"))
        advance_all(instances, await final_outputs(streams, request))
        step += 1
    return [finish(inst, engine.tokenizer, _generated) for inst in instances]


def eos_ids(engine: EngineClient) -> list[int]:
    config = engine.model_config
    if config is not None and config.eos_token_ids:
        return list(config.eos_token_ids)
    return [t for t in [engine.tokenizer.eos_token_id] if t is not None]


def _generated(seq: BeamSearchSequence) -> list[int]:
    """The ids a choice's text is decoded from: the generated ones, without the EOS that ended them."""
    out = seq.output_tokens
    return out[:-1] if seq.finish_reason == "stop" else out


async def beam_completions(engine: EngineClient, model_name: str, req: CompletionRequest, request: Request,
                           rid: str, shedder: Shedder | None) -> JSONResponse:
    params = beam_params(req, 16 if req.max_tokens is None else req.max_tokens, len(eos_ids(engine)))
    prompts = await completion_prompts(engine, req, request)
    # completion_prompts tokenized the texts: {"prompt", "prompt_token_ids"} for those, token ids for the rest
    ids: list[list[int]] = [list(p["prompt_token_ids"]) if isinstance(p, dict) else cast("list[int]", p)
                            for p in prompts]
    texts: list[str | None] = [p.get("prompt") if isinstance(p, dict) else None for p in prompts]
    results = await run_beam_search(engine, rid, ids, params, req, request, shedder)
    choices, completion_tokens = [], 0
    for i, (res, prompt_ids, text) in enumerate(zip(results, ids, texts)):
        prefix = ""
        if req.echo:
            prefix = text if text is not None else decode(engine.tokenizer, prompt_ids)
        for j, seq in enumerate(res.sequences[:req.n]):
            completion_tokens += len(seq.output_tokens)
            choices.append(CompletionChoice(index=i * req.n + j, text=prefix + (seq.text or ""),
                                            finish_reason=seq.finish_reason))
    prompt_tokens = sum(len(p) for p in ids)
    cached = sum(r.num_cached_tokens for r in results)
    body = CompletionResponse(id=rid, model=model_name, choices=choices, usage=UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details={"cached_tokens": cached}))
    return JSONResponse(body.model_dump())


async def beam_chat(handler: ChatHandler, req: ChatCompletionRequest, request: Request, rid: str) -> JSONResponse:
    engine = handler.engine
    if req.tools and req.tool_choice_resolved().mode != "none":
        raise APIError(400, "tools: not supported with use_beam_search (unless tool_choice is \"none\")",
                       param="tools")
    prompt = await chat_prompt_ids(engine, req, request, handler.prompt_ids)
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, engine.max_model_len - len(prompt))
    params = beam_params(req, max_tokens, len(eos_ids(engine)))
    (res,) = await run_beam_search(engine, rid, [prompt], params, req, request, handler.shedder)
    plain = True
    choices = []
    for i, seq in enumerate(res.sequences[:req.n]):
        text = seq.text or ""
        splitter = handler.splitter(req, prompt)  # a fresh one per beam: each is an answer of its own
        message = ChatResponseMessage(content=text)
        if splitter is not None:
            plain = False
            part = splitter.split(text, done=True)
            message = ChatResponseMessage(content=part.content if part.content or part.reasoning is None else None,
                                          reasoning_content=part.reasoning, reasoning=part.reasoning)
        choices.append(ChatChoice(index=i, message=message, finish_reason=seq.finish_reason))
    completion_tokens = sum(len(s.output_tokens) for s in res.sequences[:req.n])
    body = ChatCompletionResponse(id=rid, model=handler.model_name, choices=choices, usage=UsageInfo(
        prompt_tokens=len(prompt), completion_tokens=completion_tokens, total_tokens=len(prompt) + completion_tokens,
        prompt_tokens_details={"cached_tokens": res.num_cached_tokens}))
    dumped = body.model_dump()
    if plain:  # without a reasoning parser the message keeps OpenAI's own fields only
        for choice in dumped["choices"]:
            for key in ("reasoning_content", "reasoning"):
                choice["message"].pop(key, None)
    return JSONResponse(dumped)
