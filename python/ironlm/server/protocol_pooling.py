"""Request models of the pooling endpoints: /v1/embeddings (OpenAI), /v1/score (vLLM), /v1/rerank (Jina/Cohere).

Same rules as server/protocol.py: strict types, unknown fields accepted and ignored; the scheduling extras
(priority, timeout, cache_salt) behave as on the generation endpoints.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ironlm.exceptions import InvalidArgumentError

_I64_MAX = 2**63 - 1
_MAX_SECONDS = 1e6
# One request's inputs: each is its own engine request (admitted all or none), so bound the fan-out.
MAX_INPUTS = 2048
_TokenId = Annotated[int, Field(ge=0, le=_I64_MAX)]


class _PoolingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    user: str | None = None
    priority: int = Field(0, ge=-_I64_MAX - 1, le=_I64_MAX)
    timeout: float | None = Field(None, gt=0, le=_MAX_SECONDS)  # seconds for the whole request
    deadline: float | None = Field(None, gt=0, le=_MAX_SECONDS)
    cache_salt: str | None = None


class EmbeddingRequest(_PoolingRequest):
    """OpenAI's embeddings body: `input` is a text, a list of texts, a token id list or a list of those."""

    input: str | list[str] | list[_TokenId] | list[list[_TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=_I64_MAX)

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        items = self.input
        if isinstance(items, str):
            return self
        if not items:
            raise InvalidArgumentError("input: must not be empty", param="input")
        if len(items) > MAX_INPUTS and not isinstance(items[0], int):
            raise InvalidArgumentError(f"input: at most {MAX_INPUTS} inputs per request, got {len(items)}",
                                       param="input")
        if isinstance(items[0], list) and not all(items_i for items_i in items):
            raise InvalidArgumentError("input: a token id list must not be empty", param="input")
        return self


class ScoreRequest(_PoolingRequest):
    """vLLM's /v1/score: `text_1` against each `text_2` (one text_1), or the two lists pairwise."""

    text_1: str | list[str]
    text_2: str | list[str]

    @model_validator(mode="after")
    def _check(self) -> ScoreRequest:
        for name in ("text_1", "text_2"):
            value = getattr(self, name)
            if isinstance(value, list) and not value:
                raise InvalidArgumentError(f"{name}: must not be empty", param=name)
            if isinstance(value, list) and len(value) > MAX_INPUTS:
                raise InvalidArgumentError(f"{name}: at most {MAX_INPUTS} texts per request", param=name)
        return self


class RerankDocument(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    text: str


class RerankRequest(_PoolingRequest):
    """Jina's / Cohere's rerank body: `documents` ordered by relevance to `query`, the best `top_n`."""

    query: str
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(None, ge=1, le=_I64_MAX)
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format base64)


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage
