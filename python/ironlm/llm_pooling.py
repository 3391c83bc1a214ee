"""`LLM.embed` and `LLM.score` (vLLM's offline pooling API) over a `runner="pooling"` engine (engine/pooling.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from ironlm.engine.pooling import PoolingParams, cosine, truncate
from ironlm.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from ironlm.engine.llm_engine import LLMEngine
    from ironlm.engine.outputs import RequestOutput
    from ironlm.engine.pooling import Pooler
    from ironlm.engine.prompts import PromptType


class OfflineLLM(Protocol):
    """What these functions use of ironlm.LLM (a protocol: ironlm.llm imports this module)."""

    engine: LLMEngine

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]: ...


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # the scored pair's prompt (a scoring model) or the two texts' (cosine)
    outputs: ScoringOutput
    finished: bool = True


def pooler_of(llm: OfflineLLM) -> Pooler:
    pooler = llm.engine.pooler
    if pooler is None:
        raise InvalidArgumentError("this model generates text: create it with LLM(..., runner='pooling') to embed "
                                   "or score", param="runner")
    return pooler


def pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one text_1 against every text_2, or the two lists pairwise (equal lengths)."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right:
        raise InvalidArgumentError("text_1 and text_2 must each hold at least one text", param="text_2")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise InvalidArgumentError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1 or as "
                                   "many as text_2", param="text_2")
    return list(zip(left, right))


def _run(llm: OfflineLLM, prompts: list[PromptType], use_tqdm: bool) -> list[tuple[str, list[int], np.ndarray]]:
    engine, ids = llm.engine, []
    try:
        for i, prompt in enumerate(prompts):
            rid = f"llm-{id(llm)}-{time.monotonic_ns()}-{i}"
            engine.add_request(rid, prompt, PoolingParams())
            ids.append(rid)
    except Exception:
        engine.abort_request(ids)
        raise
    out = []
    for o in llm._run(ids, use_tqdm):
        if o.error or o.pooled is None:
            raise RuntimeError(f"request {o.request_id} failed: {o.error}")
        out.append((o.request_id, o.prompt_token_ids, o.pooled))
    return out


def embed(llm: OfflineLLM, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
          dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
    pooler = pooler_of(llm)
    if pooler.task != "embed":
        raise InvalidArgumentError("this model scores pairs (score_mode classify / yes_no); it does not embed",
                                   param="score_mode")
    if dimensions is not None and not 0 < dimensions <= pooler.hidden_size:
        raise InvalidArgumentError(f"dimensions must be in [1, {pooler.hidden_size}], got {dimensions}",
                                   param="dimensions")
    one = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                               and isinstance(prompts[0], int))
    batch = cast("list[PromptType]", [prompts] if one else list(prompts))
    results = _run(llm, batch, use_tqdm)
    return [EmbeddingRequestOutput(rid, ids, EmbeddingOutput(truncate(vec, dimensions, pooler.normalize).tolist()))
            for rid, ids, vec in results]


def score(llm: OfflineLLM, text_1: str | Sequence[str], text_2: str | Sequence[str],
          use_tqdm: bool = True) -> list[ScoringRequestOutput]:
    pooler = pooler_of(llm)
    todo = pairs(text_1, text_2)
    if pooler.task == "score":
        results = _run(llm, [pooler.pair_prompt(q, d) for q, d in todo], use_tqdm)
        return [ScoringRequestOutput(rid, ids, ScoringOutput(float(vec[0]))) for rid, ids, vec in results]
    texts = list(dict.fromkeys(t for pair in todo for t in pair))
    vecs = {t: r for t, r in zip(texts, _run(llm, list(texts), use_tqdm))}
    return [ScoringRequestOutput(vecs[q][0], vecs[q][1] + vecs[d][1], ScoringOutput(cosine(vecs[q][2], vecs[d][2])))
            for q, d in todo]
