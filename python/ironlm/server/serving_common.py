"""Pieces shared by the completions and chat handlers: parsing, starting requests, gathering outputs."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from ironlm.engine import EngineClient, RequestStream
from ironlm.engine.outputs import RequestOutput
from ironlm.engine.prompts import PromptType
from ironlm.exceptions import (
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    GrammarBusyError,
    InvalidArgumentError,
    QueueFullError,
    RequestTooLargeError,
)
from ironlm.server.breaker import note_engine_reached, note_stream_error
from ironlm.server.errors import APIError, error_body, validation_error

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm.server.shedding import Shedder

M = TypeVar("M", bound=BaseModel)
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM uses the same floor


async def parse_body(request: Request, model: type[M]) -> M:
    """JSON body -> model. The size cap and the content type were enforced on the way in (server/guards.py)."""
    body = await request.body()
    if not body.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def sampling_params(kwargs: dict[str, Any]) -> Any:
    from ironlm.sampling_params import SamplingParams

    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        param = exc.param if isinstance(exc, InvalidArgumentError) else None
        raise APIError(400, str(exc), param=param) from None


def check_logprobs_budget(limit: int, *, prompts: int, n: int, max_tokens: int, top: int | None,
                          param: str) -> None:
    """A request's logprob entries (prompts × n × max_tokens × top, `top` counted as 1 when only the sampled
    token's logprob is asked for) must stay within `limit`: each is tens of bytes streamed out, so `n=128,
    logprobs=20` turns a 150-byte request into megabytes. `top` None: no logprobs asked for."""
    if top is None:
        return
    entries = prompts * n * max_tokens * max(1, top)
    if entries > limit:
        many = f"{prompts} prompts × " if prompts > 1 else ""
        raise APIError(400, f"{param}: {many}n ({n}) × max_tokens ({max_tokens}) × {param} ({top}) asks for "
                       f"{entries} logprob entries, over this server's limit of {limit} (--max-request-logprobs); "
                       "ask for fewer choices, tokens or logprobs", param=param)


def check_prompt_logprobs_budget(limit: int, *, prompt_tokens: int, top: int | None, copies: int, generated: int,
                                 param: str) -> None:
    """The same budget with prompt logprobs: each prompt token's entries (`top`, counted as 1 when 0) once per
    copy sent (`copies`: echo sends them with each of the n choices), plus the `generated` entries."""
    if top is None:
        return
    entries = prompt_tokens * max(1, top) * copies + generated
    if entries > limit:
        raise APIError(400, f"{param}: {prompt_tokens} prompt tokens × {param} ({top})"
                       f"{f' × {copies} choices' if copies > 1 else ''}{f' + {generated} generated' if generated else ''}"
                       f" asks for {entries} logprob entries, over this server's limit of {limit} "
                       "(--max-request-logprobs); ask for fewer tokens or logprobs", param=param)


def logprob_entries(*, prompts: int, n: int, max_tokens: int, top: int | None) -> int:
    """What check_logprobs_budget counts for the generated tokens (0 without logprobs)."""
    return 0 if top is None else prompts * n * max_tokens * max(1, top)


def engine_error(exc: BaseException, prompt_param: str = "prompt") -> APIError:
    """Map what AsyncLLMEngine.add_request raises to an HTTP error, by type and `param`, never by message.

    `prompt_param` is the body field holding the prompt (`prompt`, or `messages` for chat): errors about the
    prompt, and bad values that name no parameter, point there.
    """
    if isinstance(exc, GrammarBusyError):  # this client's compiles are capped: its doing, not the server's
        return APIError(429, str(exc), code="grammar_compiles_busy", headers={"Retry-After": "1"})
    if isinstance(exc, QueueFullError):
        return APIError(503, f"the server is overloaded: {exc}", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, (EngineDeadError, EngineOverloadedError)):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, RequestTooLargeError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, DuplicateRequestError):
        return APIError(400, str(exc), param="request_id")
    if isinstance(exc, ValueError):
        param = exc.param if isinstance(exc, InvalidArgumentError) else None
        return APIError(400, str(exc), param=prompt_param if param in (None, "prompt") else param)
    return APIError(500, f"the engine failed this request: {exc!r}")


def constraint_error(err: APIError, source: str | None) -> APIError:
    """A grammar that does not compile is reported as structured_outputs.<kind>; when the constraint came from
    another body field (`source`: response_format, tools, guided_json) the 400 names that field instead."""
    if err.param is not None and err.param.startswith("structured_outputs"):
        err.param = source or err.param
        if not err.message.startswith(err.param):
            err.message = f"{err.param}: {err.message}"  # gRPC clients get only the message
    return err


# Tenant names are kept by the core for as long as it runs: bound what one client can make it hold per name.
MAX_TENANT_CHARS = 256


def request_tenant(header: str | None, req: Any) -> str | None:
    """Who a request is served for under `--scheduling-policy fair`: the `X-Tenant` header (set by a gateway the
    operator controls) when present, else the OpenAI `user` field, else None (the default tenant)."""
    tenant = header or getattr(req, "user", None)
    return tenant[:MAX_TENANT_CHARS] if tenant else None


async def start_streams(engine: EngineClient, base_id: str, prompts: Sequence[PromptType], params: Any,
                        req: Any, prompt_param: str = "prompt", shedder: Shedder | None = None,
                        tenant_header: str | None = None) -> list[RequestStream]:
    """Add one engine request per prompt, all or none (on a failure no prompt holds a place). `shedder` may refuse the
    whole request first (503 + Retry-After) and learns each admitted prompt's priority. `tenant_header`: the
    request's X-Tenant header (see `request_tenant`)."""
    tenant = request_tenant(tenant_header, req)
    note_engine_reached()
    if shedder is not None:
        shedder.check(len(prompts), req.priority, req.timeout, getattr(params, "max_tokens", None))
    rids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
    if shedder is not None:
        for rid in rids:
            shedder.tracker.admitted(rid, req.priority)
    try:
        # All the prompts or none (engine.add_requests): lists arriving together must not each take part of the
        # queue and then all fail on it.
        streams = await engine.add_requests(
            rids, prompts, params, priority=req.priority, timeout=req.timeout, deadline=req.deadline,
            cache_salt=req.cache_salt, tenant=tenant)
    except BaseException as exc:
        if shedder is not None:
            for rid in rids:
                shedder.tracker.forget(rid)
        if isinstance(exc, Exception):
            err = engine_error(exc, prompt_param)
            rate = shedder.tracker.completion_rate() if shedder is not None else None
            if isinstance(exc, QueueFullError) and rate:  # the queue drains at the measured finish rate
                waiting = int(engine.stats().get("num_requests_waiting", 0))
                err.headers = {"Retry-After": str(max(1, math.ceil(waiting / rate)))}
            raise err from None
        raise
    return streams


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Done callback: mark a task's exception as seen. Tasks left behind when a request is cancelled or fails
    (the other prompts' of a list) would otherwise log "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for task in pending:  # those not consumed yet, done ones included
            task.add_done_callback(_retrieve)
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def final_outputs(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Last output of each stream; aborts everything if the client goes away first."""
    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        assert out is not None
        return out

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    gathered = asyncio.gather(*tasks)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    either: set[asyncio.Future[Any]] = {gathered, watcher}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            raise APIError(499, "client disconnected")  # nobody reads this; it unwinds the handler
        try:
            outputs = gathered.result()
        except Exception as exc:  # noqa: BLE001 - any engine-side failure becomes an HTTP error
            raise engine_error(exc) from None
    finally:
        watcher.cancel()
        if not gathered.done():
            gathered.cancel()
        for task in tasks:
            task.add_done_callback(_retrieve)
            task.cancel()
        gathered.add_done_callback(_retrieve)
        for s in streams:
            s.close()
    for out in outputs:
        check_failed(out)
    return outputs


def check_failed(out: RequestOutput) -> None:
    if out.error:
        raise APIError(500, f"the engine failed this request: {out.error}", code="engine_error")
    if all(c.finish_reason == "timeout" and not c.token_ids for c in out.outputs):
        raise APIError(503, "the request timed out before any token was generated", code="timeout")


def usage(outputs: Sequence[RequestOutput | None]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def continuous_usage(req: Any) -> bool:
    """stream_options.continuous_usage_stats, which (as in vLLM) only counts with include_usage."""
    return bool(req.include_usage and req.stream_options.continuous_usage_stats)


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage a streamed chunk carries under continuous usage stats: its choice's tokens so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """The text of one token id list (`decode` is typed for batches too, which return a list)."""
    text = tokenizer.decode(list(token_ids))
    assert isinstance(text, str)
    return text


def clamp_logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) or value < LOGPROB_FLOOR else value


# One encoder for every SSE chunk: json.dumps with options builds a new JSONEncoder per call, which is a
# measurable share of a streamed token's time on the event loop.
compact_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def sse(obj: Any) -> str:
    return f"data: {compact_json(obj)}\n\n"


class SSEChunks:
    """A stream's token chunks from a template: the fields that never change in one response (id, object,
    created, model) are serialised once, only the choice's values per token. The bytes are exactly what
    `sse` writes for the same dict (`{...head, "choices": [{"index", <fields>...}], "usage"?}`)."""

    def __init__(self, head: dict[str, Any], fields: Sequence[str], usage: bool) -> None:
        self._open = 'data: ' + compact_json(head)[:-1] + ',"choices":[{"index":'
        self._keys = [f',"{name}":' for name in fields]
        self._usage = usage

    def chunk(self, index: int, values: Sequence[Any], usage: Any = None) -> str:
        parts = [self._open, str(index)]
        for key, value in zip(self._keys, values):
            parts += (key, compact_json(value))
        parts.append('}],"usage":' + compact_json(usage) + "}\n\n" if self._usage else "}]}\n\n")
        return "".join(parts)


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EngineStreamingResponse(StreamingResponse):
    """SSE response that always releases its engine requests when the response ends, however it ends.

    The body generator's own `finally` does not run if the client vanishes before the generator was
    first entered; this does.
    """

    def __init__(self, content: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()


def sse_error(exc: BaseException) -> str:
    err = exc if isinstance(exc, APIError) else engine_error(exc)
    note_stream_error(err.status)
    return sse(error_body(err.status, err.message, code=err.code, type=err.type))
