"""POST /v1/score (vLLM's text_1 / text_2) and /v1/rerank (Jina / Cohere: query, documents, top_n) over a pooling
engine, and the routes of all the pooling endpoints (`install_pooling_routes`, called by server/api.py).

A scoring model (a classifier head, or yes/no logits: engine/pooling.py) reads each (query, document) pair as one
prompt; an embedding model scores a pair by the cosine of the two texts' embeddings (each distinct text embedded
once per request)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from ironlm.engine import EngineClient
from ironlm.engine.pooling import cosine
from ironlm.exceptions import InvalidArgumentError
from ironlm.llm_pooling import pairs
from ironlm.server.errors import APIError
from ironlm.server.openapi import body_docs
from ironlm.server.prompt_limits import check_text_length
from ironlm.server.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from ironlm.server.serving_common import parse_body
from ironlm.server.serving_embed import EmbeddingHandler, encode_texts, require_pooler, run_pooled

if TYPE_CHECKING:
    from ironlm.server.shedding import Shedder

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
# The body guard (size, content type) covers these; the OpenAPI document declares their bodies.
POOLING_PATHS = frozenset({"/v1/embeddings", "/v1/score", *RERANK_PATHS})
POOLING_REQUESTS: list[type[BaseModel]] = [EmbeddingRequest, ScoreRequest, RerankRequest]


class ScoreHandler:
    def __init__(self, engine: EngineClient, model_name: str, shedder: Shedder | None = None) -> None:
        self.engine, self.model_name, self.shedder = engine, model_name, shedder

    async def scores(self, todo: list[tuple[str, str]], req: Any, request: Request,
                     param: str) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens the request took."""
        pooler = require_pooler(self.engine, "scoring")
        rid = f"score-{uuid.uuid4().hex}"
        if pooler.task == "score":
            for q, d in todo:
                check_text_length(self.engine, len(q) + len(d), param)
            prompts = await asyncio.to_thread(lambda: [pooler.pair_prompt(q, d) for q, d in todo])
            outputs = await run_pooled(self.engine, rid, prompts, req, request, self.shedder, param)
            return ([float(o.pooled[0]) for o in outputs if o.pooled is not None],
                    sum(len(o.prompt_token_ids) for o in outputs))
        texts = list(dict.fromkeys(t for pair in todo for t in pair))
        ids = await encode_texts(self.engine, texts, param)
        outputs = await run_pooled(self.engine, rid, list(ids), req, request, self.shedder, param)
        vectors = {t: o.pooled for t, o in zip(texts, outputs)}
        scores = [cosine(vectors[q], vectors[d]) for q, d in todo]  # type: ignore[arg-type]
        return scores, sum(len(o.prompt_token_ids) for o in outputs)

    async def score(self, req: ScoreRequest, request: Request) -> dict[str, Any]:
        try:
            todo = pairs(req.text_1, req.text_2)
        except InvalidArgumentError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        scores, tokens = await self.scores(todo, req, request, "text_2")
        return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)).model_dump()

    async def rerank(self, req: RerankRequest, request: Request) -> dict[str, Any]:
        docs = req.texts()
        scores, tokens = await self.scores([(req.query, d) for d in docs], req, request, "documents")
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i]) if req.return_documents else None)
                   for i in order]
        body = RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=self.model_name, results=results,
                              usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)).model_dump()
        if not req.return_documents:
            for result in body["results"]:
                result.pop("document")
        return body


def install_pooling_routes(app: FastAPI, engine: EngineClient, model: str, check_model: Callable[[str | None], None],
                           shedder: Shedder | None) -> None:
    embed = EmbeddingHandler(engine, model, shedder)
    score = ScoreHandler(engine, model, shedder)

    @app.post("/v1/embeddings", **body_docs(EmbeddingRequest, EmbeddingResponse))
    async def create_embeddings(request: Request) -> dict[str, Any]:
        req = await parse_body(request, EmbeddingRequest)
        check_model(req.model)
        return await embed(req, request)

    @app.post("/v1/score", **body_docs(ScoreRequest, ScoreResponse))
    async def create_score(request: Request) -> dict[str, Any]:
        req = await parse_body(request, ScoreRequest)
        check_model(req.model)
        return await score.score(req, request)

    async def create_rerank(request: Request) -> dict[str, Any]:
        req = await parse_body(request, RerankRequest)
        check_model(req.model)
        return await score.rerank(req, request)

    for path in RERANK_PATHS:
        app.post(path, **body_docs(RerankRequest, RerankResponse))(create_rerank)
