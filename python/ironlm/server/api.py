"""The OpenAI-compatible HTTP app: `build_app(engine, served_model_name=..., api_key=..., config=...)`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ironlm import __version__
from ironlm.config import ServerConfig
from ironlm.engine import EngineClient
from ironlm.server.auth import APIKeyMiddleware
from ironlm.server.breaker import BreakerCollector, BreakerMiddleware, CircuitBreaker
from ironlm.server.chat_template import TemplateRenderer, run_with_deadline
from ironlm.server.errors import APIError, install_exception_handlers
from ironlm.server.guards import install_cors, install_guards
from ironlm.server.health import health_report
from ironlm.server.metrics import ObserverGroup, ServerMetrics
from ironlm.server.openapi import METRICS_DOCS, body_docs, get_docs, install_openapi
from ironlm.server.prompt_limits import check_text_length
from ironlm.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from ironlm.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from ironlm.server.protocol_responses import ResponsesRequest
from ironlm.server.response_store import ResponseStore
from ironlm.server.serving_chat import ChatHandler
from ironlm.server.serving_common import parse_body
from ironlm.server.serving_completions import CompletionHandler
from ironlm.server.serving_messages import AnthropicErrorMiddleware, MessagesHandler
from ironlm.server.serving_responses import ResponsesHandler
from ironlm.server.serving_score import POOLING_PATHS, POOLING_REQUESTS, install_pooling_routes
from ironlm.server.shedding import LoadTracker, ShedCollector, Shedder, engine_setting


def build_app(engine: EngineClient, *, served_model_name: str | list[str] | None = None,
              api_key: str | list[str] | None = None, metrics: ServerMetrics | None = None,
              config: ServerConfig | None = None) -> FastAPI:
    """`config`: the front end's settings (ServerConfig's defaults when None); `api_key` wins over its key."""
    config = config or ServerConfig()
    api_key = api_key if api_key is not None else config.api_key
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [engine.model_name]
    model = names[0]  # the name responses carry
    if metrics is None:
        metrics = ServerMetrics(engine.stats, lambda: engine.is_healthy, model)
    shedder = _shedder(engine, config) if config.load_shedding else None
    if shedder is not None:
        metrics.registry.register(ShedCollector(shedder, model))
    if engine.observer is None:
        engine.observer = metrics if shedder is None else ObserverGroup(metrics, shedder.tracker)
    breaker = None
    if config.circuit_breaker:
        breaker = CircuitBreaker(window=config.circuit_breaker_window, threshold=config.circuit_breaker_threshold,
                                 min_requests=config.circuit_breaker_min_requests,
                                 cooldown_s=config.circuit_breaker_cooldown, probes=config.circuit_breaker_probes)
        metrics.registry.register(BreakerCollector(breaker, model))
    started_at = time.monotonic()
    app = FastAPI(title="ironlm", version=__version__)
    app.state.engine, app.state.metrics, app.state.served_model_names = engine, metrics, names
    app.state.config, app.state.breaker, app.state.shedder = config, breaker, shedder
    install_exception_handlers(app)
    app.state.chat_templates = TemplateRenderer(engine.tokenizer, config.chat_template)
    # The guard runs inside the key check (a stranger gets 401, not a hint about bodies), CORS outside it all.
    install_guards(app, config, frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                         *POOLING_PATHS,
                                         "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}))
    if breaker is not None:  # added before the key check, so it runs inside it: refusals need a valid key
        app.add_middleware(BreakerMiddleware, breaker=breaker)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_keys=api_key)
    install_cors(app, config)
    app.add_middleware(AnthropicErrorMiddleware)  # outermost: every error on the Messages paths in their shape
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                          *POOLING_REQUESTS,
                          ResponsesRequest, MessagesRequest, CountTokensRequest])
    completions = CompletionHandler(engine, model, shedder, max_logprobs=config.max_request_logprobs)
    chat = ChatHandler(engine, model, shedder, tool_call_parser=config.tool_call_parser,
                       max_logprobs=config.max_request_logprobs, reasoning_parser=config.reasoning_parser,
                       operator_template=app.state.chat_templates.operator_template)

    responses = ResponsesHandler(chat, ResponseStore(config.response_store_size, config.response_store_max_chars))
    messages = MessagesHandler(chat)

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    @app.post("/v1/completions", **body_docs(CompletionRequest, CompletionResponse, streams=True))
    async def create_completion(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        check_model(req.model)
        return await completions(req, request)

    @app.post("/v1/chat/completions", **body_docs(ChatCompletionRequest, ChatCompletionResponse, streams=True))
    async def create_chat_completion(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        check_model(req.model)
        return await chat(req, request)

    @app.post("/v1/responses", **body_docs(ResponsesRequest, streams=True))
    async def create_response(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest)
        check_model(req.model)
        return await responses.create(req, request)

    @app.get("/v1/responses/{response_id}", **get_docs())
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}", **get_docs())
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @app.post("/v1/messages", **body_docs(MessagesRequest, streams=True))
    async def create_message(request: Request) -> Response:
        req = await parse_body(request, MessagesRequest)
        check_model(req.model)
        return await messages.create(req, request)

    @app.post("/v1/messages/count_tokens", **body_docs(CountTokensRequest))
    async def count_message_tokens(request: Request) -> dict[str, int]:
        req = await parse_body(request, CountTokensRequest)
        check_model(req.model)
        return await messages.count_tokens(req, request)

    install_pooling_routes(app, engine, model, check_model, shedder)  # /v1/embeddings, /v1/score, /v1/rerank

    @app.get("/v1/models", **get_docs())
    async def list_models() -> dict[str, Any]:
        cards = [ModelCard(id=n, root=model, max_model_len=engine.max_model_len) for n in names]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{name:path}", **get_docs())
    async def get_model(name: str) -> dict[str, Any]:
        check_model(name)
        return ModelCard(id=name, root=model, max_model_len=engine.max_model_len).model_dump()

    @app.post("/tokenize", **body_docs(TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, TokenizeRequest)
        check_model(req.model)
        if req.messages is not None:
            try:
                # As chat renders them (tool calls and tool results too); a message without content is a 400.
                messages = [m.template_dict() for m in req.messages]
                check_text_length(engine, sum(len(m["content"]) for m in messages), "messages")
                tokens = await asyncio.to_thread(run_with_deadline, engine.apply_chat_template, messages,
                                                 req.add_generation_prompt)
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
        else:
            prompt = req.prompt or ""  # the model validator made sure one of prompt / messages is there
            check_text_length(engine, len(prompt), "prompt")
            tokens = list(await asyncio.to_thread(engine.tokenizer.encode, prompt,
                                                  add_special_tokens=req.add_special_tokens))
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize", **body_docs(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, DetokenizeRequest)
        check_model(req.model)
        vocab = _vocab_size(engine)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = health_report(engine, model, started_at, breaker)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse, **METRICS_DOCS)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _shedder(engine: EngineClient, config: ServerConfig) -> Shedder:
    priority_waiting = config.shed_priority_waiting
    max_queue_len = engine_setting(engine, "max_queue_len")
    if priority_waiting is None and max_queue_len:
        priority_waiting = max(1, max_queue_len // 2)
    return Shedder(engine, LoadTracker(), max_wait_s=config.shed_max_wait, priority_waiting=priority_waiting,
                   priority_policy=engine_setting(engine, "scheduling_policy") == "priority")


def _vocab_size(engine: EngineClient) -> int:
    config = engine.model_config
    size = getattr(config, "vocab_size", None)
    return int(size) if size else len(engine.tokenizer)
