"""gRPC `Generation` service (Generate, StreamGenerate) on the same AsyncLLMEngine as the HTTP API.

Requests are validated by converting them into the HTTP `CompletionRequest` model, so both transports
accept and reject exactly the same inputs.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pydantic import ValidationError

from ironlm.config import ServerConfig
from ironlm.engine import EngineClient
from ironlm.engine.outputs import CompletionOutput, RequestOutput
from ironlm.grpc import ironlm_pb2 as pb
from ironlm.grpc import ironlm_pb2_grpc as pb_grpc
from ironlm.server.auth import KeyChecker
from ironlm.server.breaker import CircuitBreaker, Permit, is_failure
from ironlm.server.errors import APIError, validation_error
from ironlm.server.prompt_limits import encoded_prompts
from ironlm.server.protocol import CompletionRequest
from ironlm.server.serving_common import (
    check_failed,
    check_logprobs_budget,
    clamp_logprob,
    constraint_error,
    decode,
    engine_error,
    sampling_params,
    start_streams,
)
from ironlm.server.shedding import Shedder

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED, 503: grpc.StatusCode.UNAVAILABLE}
_OPTIONAL = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "include_stop_str_in_output", "ignore_eos",
             "min_tokens", "logprobs", "skip_special_tokens")


def to_completion_request(msg: pb.GenerateRequest) -> CompletionRequest:
    """Proto -> the HTTP request model (same validation, same defaults)."""
    s = msg.sampling
    body: dict[str, Any] = {name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)}
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
    kind = msg.WhichOneof("prompt")
    body["prompt"] = msg.text if kind == "text" else list(msg.token_ids.ids) if kind == "token_ids" else ""
    body["priority"] = msg.priority
    for name in ("timeout", "deadline"):
        if msg.HasField(name):
            body[name] = getattr(msg, name)
    if msg.cache_salt:
        body["cache_salt"] = msg.cache_salt
    if msg.request_id:  # bounded like HTTP's: the engine keeps ids while requests run (a 1 MB one was taken)
        body["request_id"] = msg.request_id
    if msg.HasField("structured_outputs"):
        body["structured_outputs"] = _structured_outputs(msg.structured_outputs)
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _structured_outputs(so: pb.StructuredOutputs) -> dict[str, Any]:
    """Proto -> HTTP's `structured_outputs` object; no kind set reaches validation as none (a 400)."""
    out: dict[str, Any] = {}
    kind = so.WhichOneof("kind")
    if kind == "choice":
        out["choice"] = list(so.choice.values)
    elif kind is not None:
        out[kind] = getattr(so, kind)
    for name in ("disable_any_whitespace", "whitespace_pattern"):
        if so.HasField(name):
            out[name] = getattr(so, name)
    return out


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, engine: EngineClient, model_names: list[str], api_key: str | None = None,
                 shedder: Shedder | None = None, breaker: CircuitBreaker | None = None,
                 max_logprobs: int = ServerConfig.max_request_logprobs) -> None:
        """`shedder`, `breaker`: the HTTP app's (app.state), so both front ends share one view of the engine;
        `max_logprobs`: ServerConfig.max_request_logprobs (see check_logprobs_budget)."""
        self.engine, self.model_names = engine, model_names
        self.checker = KeyChecker(api_key) if api_key else None
        self.shedder, self.breaker, self.max_logprobs = shedder, breaker, max_logprobs

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        permit, failed = None, None
        try:
            permit = self._permit()
            rid, stream = await self._start(request, context)
            last: RequestOutput | None = None
            async with stream:
                async for last in stream:
                    pass
            assert last is not None
            check_failed(last)
            failed = False
            return pb.GenerateResponse(
                request_id=rid, finished=True, usage=_usage(last),
                completions=[self._completion(c, 0, 0) for c in sorted(last.outputs, key=lambda c: c.index)])
        except Exception as exc:  # noqa: BLE001 - mapped to a gRPC status like HTTP maps it
            err = exc if isinstance(exc, APIError) else engine_error(exc)
            failed = is_failure(err.status)
            await _abort(context, err)
        finally:
            if permit is not None and self.breaker is not None:
                self.breaker.record(permit, failed)
        raise AssertionError("unreachable")  # context.abort raises

    async def StreamGenerate(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        permit, failed = None, None
        try:
            permit = self._permit()
            rid, stream = await self._start(request, context)
            sent_text: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            done: set[int] = set()
            async with stream:
                async for out in stream:
                    if out.error:
                        raise APIError(500, f"the engine failed this request: {out.error}")
                    progressed = []
                    for c in out.outputs:
                        if c.index in done:
                            continue
                        t0, k0 = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                        if len(c.token_ids) > k0 or len(c.text) > t0 or c.finish_reason:
                            progressed.append(self._completion(c, t0, k0))
                        sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                        if c.finish_reason:
                            done.add(c.index)
                    if progressed or out.finished:
                        yield pb.GenerateResponse(request_id=rid, completions=progressed, finished=out.finished,
                                                  usage=_usage(out) if out.finished else None)
            failed = False
        except Exception as exc:  # noqa: BLE001 - mapped to a gRPC status like HTTP maps it
            err = exc if isinstance(exc, APIError) else engine_error(exc)
            failed = is_failure(err.status)
            await _abort(context, err)
        finally:  # a cancelled call records nothing
            if permit is not None and self.breaker is not None:
                self.breaker.record(permit, failed)

    def _permit(self) -> Permit | None:
        if self.breaker is None:
            return None
        permit = self.breaker.allow()
        if permit is None:
            retry = self.breaker.retry_after()
            raise APIError(503, f"the server is failing too many requests (circuit breaker open); retry in {retry} s",
                           code="circuit_open", headers={"Retry-After": str(retry)})
        return permit

    async def _start(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> tuple[str, Any]:
        if self.checker is not None:
            auth = dict(context.invocation_metadata() or ()).get("authorization")
            if not self.checker.check(auth):
                raise APIError(401, "missing or incorrect API key")
        if request.model and request.model not in self.model_names:
            raise APIError(404, f"The model `{request.model}` does not exist.")
        req = to_completion_request(request)
        params = sampling_params({**req.sampling_kwargs(), "max_tokens": req.max_tokens or 16,
                                  "logprobs": req.logprobs})
        check_logprobs_budget(self.max_logprobs, prompts=1, n=req.n, max_tokens=req.max_tokens or 16,
                              top=req.logprobs, param="logprobs")
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            tenant = dict(context.invocation_metadata() or ()).get("x-tenant")
            prompts = await encoded_prompts(self.engine, req.prompts()[:1])
            (stream,) = await start_streams(self.engine, rid, prompts, params, req, shedder=self.shedder,
                                            tenant_header=tenant if isinstance(tenant, str) else None)
        except APIError as err:
            raise constraint_error(err, None) from None
        return rid, stream

    def _completion(self, c: CompletionOutput, text_from: int, tokens_from: int) -> pb.Completion:
        tokenizer = self.engine.tokenizer
        logprobs = []
        entries = c.logprobs or []
        for j in range(tokens_from, min(len(c.token_ids), len(entries))):
            tid, entry = c.token_ids[j], entries[j]
            chosen = entry.get(tid)
            top = [pb.TopLogprob(token_id=t, token=lp.decoded_token or decode(tokenizer, [t]),
                                 logprob=clamp_logprob(lp.logprob))
                   for t, lp in sorted(entry.items(), key=lambda kv: -kv[1].logprob)]
            logprobs.append(pb.TokenLogprob(
                token_id=tid, token=(chosen.decoded_token if chosen else None) or decode(tokenizer, [tid]),
                logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0, top=top))
        return pb.Completion(index=c.index, text=c.text[text_from:], token_ids=c.token_ids[tokens_from:],
                             finish_reason=c.finish_reason or "",
                             stop_reason="" if c.stop_reason is None else str(c.stop_reason), logprobs=logprobs)


async def _abort(context: grpc.aio.ServicerContext, err: APIError) -> None:
    """End the call with the gRPC status of `err`, a 503's Retry-After as `retry-after` trailing metadata
    (context.abort raises)."""
    if err.headers and "Retry-After" in err.headers:
        context.set_trailing_metadata((("retry-after", err.headers["Retry-After"]),))
    await context.abort(_CODES.get(err.status, grpc.StatusCode.INTERNAL), err.message)


def _usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                    completion_tokens=sum(len(c.token_ids) for c in out.outputs),
                    cached_tokens=out.num_cached_tokens)


async def start_grpc_server(engine: EngineClient, host: str, port: int, model_names: list[str],
                            api_key: str | None = None, shedder: Shedder | None = None,
                            breaker: CircuitBreaker | None = None,
                            max_logprobs: int = ServerConfig.max_request_logprobs) -> tuple[grpc.aio.Server, int]:
    """Start the service on the running event loop; returns the server and the bound port."""
    server = grpc.aio.server()
    service = GenerationService(engine, model_names, api_key, shedder, breaker, max_logprobs)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: cannot bind {host}:{port}")
    await server.start()
    return server, bound
