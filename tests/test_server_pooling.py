"""/v1/embeddings, /v1/score and /v1/rerank over HTTP (real uvicorn, the real `openai` client), checked against
transformers' own computation on the tiny fp32 model."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from ironlm import EngineConfig, LLMEngine
from ironlm.engine import AsyncLLMEngine
from ironlm.server.api import build_app
from server_utils import TINY_ENGINE_KW, LiveServer, shared_server, tiny_model_path

TEMPLATE = "Query: {query}\nDocument: {document}\nRelevant:"
TEXTS = ["hello world", "the model of the world", "tokens", "and the token is in the model", "a"]


def pooling_server(tmp_path_factory: Any, **kw: Any) -> LiveServer:
    config = EngineConfig(model=str(tiny_model_path(tmp_path_factory)), device="cpu", runner="pooling",
                          **{**TINY_ENGINE_KW, **kw})
    engine = AsyncLLMEngine(LLMEngine(config))
    return LiveServer(build_app(engine, served_model_name="tiny"), engine)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = pooling_server(tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = pooling_server(tmp_path_factory, score_mode="yes_no", score_template=TEMPLATE,
                            score_tokens="hello,world")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_model_path(tmp_path_factory))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def ref_embedding(hf: Any, text: str | list[int]) -> np.ndarray:
    model, tok = hf
    ids = tok.encode(text) if isinstance(text, str) else text
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h, dim=-1).numpy()


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_openai_embeddings_float_base64_dimensions(embed_server: LiveServer, hf: Any) -> None:
    c = client(embed_server)
    for fmt in ("float", None):  # None: the client asks for base64 and decodes it itself
        kwargs = {} if fmt is None else {"encoding_format": fmt}
        res = c.embeddings.create(model="tiny", input=TEXTS, **kwargs)  # type: ignore[arg-type]
        assert [d.index for d in res.data] == list(range(len(TEXTS)))
        for text, d in zip(TEXTS, res.data):
            np.testing.assert_allclose(d.embedding, ref_embedding(hf, text), atol=1e-5)
        assert res.usage.prompt_tokens == sum(len(hf[1].encode(t)) for t in TEXTS) == res.usage.total_tokens
    raw = c.embeddings.create(model="tiny", input="hello world", encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")  # type: ignore[arg-type]
    np.testing.assert_allclose(vec, ref_embedding(hf, "hello world"), atol=1e-5)
    cut = c.embeddings.create(model="tiny", input="hello world", dimensions=8).data[0].embedding
    full = ref_embedding(hf, "hello world")[:8]
    np.testing.assert_allclose(cut, full / np.linalg.norm(full), atol=1e-5)
    assert len(cut) == 8
    ids = hf[1].encode("tokens of the model")
    both = c.embeddings.create(model="tiny", input=[ids, ids[:3]])
    np.testing.assert_allclose(both.data[0].embedding, ref_embedding(hf, ids), atol=1e-5)
    np.testing.assert_allclose(both.data[1].embedding, ref_embedding(hf, ids[:3]), atol=1e-5)
    one = c.embeddings.create(model="tiny", input=ids)
    np.testing.assert_allclose(one.data[0].embedding, both.data[0].embedding, atol=1e-6)


def test_many_prompts_and_prefix_cache_hit(embed_server: LiveServer, hf: Any) -> None:
    c = client(embed_server)
    base = "the model is the world of the token and the world is the model " * 2
    texts = [f"{base}{i}" for i in range(40)]
    hits = embed_server.engine.stats()["prefix_cache_hits"]
    res = c.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert embed_server.engine.stats()["prefix_cache_hits"] > hits  # the shared start was reused
    for text, d in zip(texts, res.data):
        np.testing.assert_allclose(d.embedding, ref_embedding(hf, text), atol=1e-5)


def test_cosine_score_and_rerank_of_an_embedding_model(embed_server: LiveServer, hf: Any) -> None:
    r = httpx.post(f"{embed_server.base_url}/score", json={"text_1": "hello world", "text_2": TEXTS[:3]})
    assert r.status_code == 200, r.text
    q = ref_embedding(hf, "hello world")
    want = [float(q @ ref_embedding(hf, t)) for t in TEXTS[:3]]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)
    r = httpx.post(f"{embed_server.url}/rerank", json={"query": "hello world", "documents": TEXTS[:3], "top_n": 2})
    assert r.status_code == 200, r.text
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in r.json()["results"]] == order


def yes_no_ref(hf: Any, query: str, doc: str) -> float:
    model, tok = hf
    ids = tok.encode(TEMPLATE.replace("{query}", query).replace("{document}", doc), add_special_tokens=False)
    yes, no = tok.encode("hello", add_special_tokens=False)[0], tok.encode("world", add_special_tokens=False)[0]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(torch.stack([logits[yes], logits[no]]), dim=0)[0].item()


def test_rerank_and_score_yes_no(rerank_server: LiveServer, hf: Any) -> None:
    query, docs = "what is the model?", TEXTS
    want = [yes_no_ref(hf, query, d) for d in docs]
    r = httpx.post(f"{rerank_server.base_url}/rerank",
                   json={"model": "tiny", "query": query, "documents": [docs[0], {"text": docs[1]}, *docs[2:]],
                         "top_n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    order = sorted(range(len(docs)), key=lambda i: -want[i])[:3]
    assert [x["index"] for x in body["results"]] == order
    assert [x["relevance_score"] for x in body["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
    assert [x["document"]["text"] for x in body["results"]] == [docs[i] for i in order]
    assert body["usage"]["total_tokens"] > 0
    r = httpx.post(f"{rerank_server.url}/v2/rerank", json={"query": query, "documents": docs,
                                                          "return_documents": False})
    assert r.status_code == 200 and all("document" not in x for x in r.json()["results"])
    assert len(r.json()["results"]) == len(docs)
    r = httpx.post(f"{rerank_server.base_url}/score", json={"text_1": [query, "tokens"], "text_2": docs[:2]})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(
        [yes_no_ref(hf, query, docs[0]), yes_no_ref(hf, "tokens", docs[1])], abs=1e-5)
    r = httpx.post(f"{rerank_server.base_url}/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 10_000}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input"),
    ("/v1/embeddings", {"input": [10**9]}, "input"),
    ("/v1/embeddings", {"input": "hi", "model": "other"}, "model"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "runner"),
])
def test_errors_name_the_field(embed_server: LiveServer, path: str, body: dict, param: str) -> None:
    r = httpx.post(embed_server.url + path, json=body)
    assert 400 <= r.status_code < 500 and r.status_code != 422, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_generate_server_refuses_pooling(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = shared_server(tmp_path_factory)
    for path, body in (("/v1/embeddings", {"input": "hello"}), ("/v1/rerank", {"query": "q", "documents": ["a"]}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"})):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model" and "--runner pooling" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="runner pooling"):
        client(server).embeddings.create(model="tiny", input="hello")


def test_openapi_declares_the_bodies(embed_server: LiveServer) -> None:
    doc = httpx.get(embed_server.url + "/openapi.json").json()
    for name in ("EmbeddingRequest", "ScoreRequest", "RerankRequest"):
        assert name in doc["components"]["schemas"]
    ref = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/EmbeddingRequest")
    assert "/v1/rerank" in doc["paths"] and "/v1/score" in doc["paths"]
    r = httpx.post(embed_server.url + "/v1/embeddings", content=b"x" * 10, headers={"content-type": "text/plain"})
    assert r.status_code == 415  # the body guard covers the pooling paths
