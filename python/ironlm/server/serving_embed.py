"""POST /v1/embeddings (OpenAI's shape) over a pooling engine (engine/pooling.py), and what the pooling handlers
share: finding the engine's pooler, running prompts as pooling requests."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import Request

from ironlm.engine import EngineClient
from ironlm.engine.pooling import PoolingParams, truncate
from ironlm.server.errors import APIError
from ironlm.server.prompt_limits import check_text_length
from ironlm.server.protocol_pooling import EmbeddingData, EmbeddingRequest, EmbeddingResponse, PoolingUsage
from ironlm.server.serving_common import final_outputs, start_streams

if TYPE_CHECKING:
    from ironlm.engine.outputs import RequestOutput
    from ironlm.engine.pooling import Pooler
    from ironlm.engine.prompts import PromptType
    from ironlm.server.shedding import Shedder


def require_pooler(engine: EngineClient, what: str) -> Pooler:
    """The engine's pooler, or a 400 naming `model` when this server's model cannot do `what`."""
    pooler: Pooler | None = getattr(getattr(engine, "engine", None), "pooler", None)
    if pooler is None:
        raise APIError(400, f"the model does not support {what}: start the server with --runner pooling",
                       param="model")
    if what == "embeddings" and pooler.task != "embed":
        raise APIError(400, f"the model scores pairs (score_mode {pooler.score_mode}); it has no embeddings: use "
                       "/v1/score or /v1/rerank", param="model")
    return pooler


async def encode_texts(engine: EngineClient, texts: Sequence[str], param: str) -> list[list[int]]:
    """Token ids of each text as the engine would encode it (special tokens added), off the event loop."""
    for text in texts:
        check_text_length(engine, len(text), param)
        if not text:
            raise APIError(400, f"{param}: a text must not be empty", param=param)
    encoded = await asyncio.to_thread(engine.tokenizer, list(texts))
    return [list(ids) for ids in encoded["input_ids"]]


async def run_pooled(engine: EngineClient, base_id: str, prompts: Sequence[PromptType], req: Any, request: Request,
                     shedder: Shedder | None, param: str) -> list[RequestOutput]:
    """One pooling request per prompt (admitted all or none); their final outputs, each with `pooled` set."""
    streams = await start_streams(engine, base_id, prompts, PoolingParams(), req, prompt_param=param,
                                  shedder=shedder, tenant_header=request.headers.get("x-tenant"))
    outputs = await final_outputs(streams, request)
    for out in outputs:
        if out.pooled is None:
            raise APIError(500, f"the engine returned no pooled result for {out.request_id}", code="engine_error")
    return outputs


def _wire(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":  # OpenAI's: the raw little-endian float32 bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


class EmbeddingHandler:
    def __init__(self, engine: EngineClient, model_name: str, shedder: Shedder | None = None) -> None:
        self.engine, self.model_name, self.shedder = engine, model_name, shedder

    async def __call__(self, req: EmbeddingRequest, request: Request) -> dict[str, Any]:
        pooler = require_pooler(self.engine, "embeddings")
        if req.dimensions is not None and req.dimensions > pooler.hidden_size:
            raise APIError(400, f"dimensions: at most the model's hidden size ({pooler.hidden_size}), got "
                           f"{req.dimensions}", param="dimensions")
        items = req.input
        prompts: list[PromptType]
        if isinstance(items, str):
            prompts = list(await encode_texts(self.engine, [items], "input"))
        elif isinstance(items[0], str):
            prompts = list(await encode_texts(self.engine, items, "input"))
        elif isinstance(items[0], int):
            prompts = [list(items)]
        else:
            prompts = [list(ids) for ids in items]
        outputs = await run_pooled(self.engine, f"embd-{uuid.uuid4().hex}", prompts, req, request, self.shedder,
                                   "input")
        data = []
        for i, out in enumerate(outputs):
            assert out.pooled is not None
            vector = truncate(out.pooled, req.dimensions, pooler.normalize)
            data.append(EmbeddingData(index=i, embedding=_wire(vector, req.encoding_format)))
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
                                 data=data, usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)).model_dump()
