"""Pooling models (engine/pooling.py): embeddings and pair scores equal transformers' own computation (fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ironlm import LLM, EngineConfig
from ironlm.engine.pooling import QWEN3_RERANK_TEMPLATE
from ironlm.exceptions import InvalidArgumentError
from server_utils import tiny_model_path
from tiny_models import make_tiny_model

# A small token budget chunks the longer prompts over several steps (mean pooling adds chunk by chunk).
ENGINE_KW: dict[str, Any] = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 128, "block_size": 4,
                             "max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 24}
PROMPTS = ["hello world", "the model is a token model and the world is in the model of tokens " * 2,
           "a", "tokens of the world"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory)  # the serving tests' tiny llama, built once per process


@pytest.fixture(scope="module")
def hf_base(tiny: Path) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(tiny), dtype=torch.float32).eval()


def reference(hf: Any, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    vec = {"last": h[-1], "cls": h[0], "mean": h.mean(dim=0)}[pooling]
    if normalize:
        vec = torch.nn.functional.normalize(vec, dim=-1)
    return vec.numpy()


@pytest.mark.parametrize("pooling,normalize", [("last", True), ("mean", False), ("mean", True), ("cls", False),
                                               ("last", False)])
def test_embed_equals_transformers(tiny: Path, hf_base: Any, pooling: str, normalize: bool) -> None:
    llm = LLM(str(tiny), runner="pooling", pooling_type=pooling, normalize=normalize, **ENGINE_KW)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    for out in outs:
        ref = reference(hf_base, out.prompt_token_ids, pooling, normalize)
        np.testing.assert_allclose(np.array(out.outputs.embedding), ref, atol=1e-5, rtol=1e-5)
    # mean/cls bypass the prefix cache; last keeps it
    stats = llm.engine.stats()
    assert (stats["prefix_cache_queries"] > 0) == (pooling == "last")
    llm.shutdown()


def test_last_pooling_with_prefix_cache_hit(tiny: Path, hf_base: Any) -> None:
    llm = LLM(str(tiny), runner="pooling", **ENGINE_KW)
    long = PROMPTS[1]
    first = llm.embed([long], use_tqdm=False)[0]
    again = llm.embed([long, long + " and more"], use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits"] >= 32  # both reused the first's blocks
    for out in [first, *again]:
        ref = reference(hf_base, out.prompt_token_ids, "last", True)
        np.testing.assert_allclose(np.array(out.outputs.embedding), ref, atol=1e-5, rtol=1e-5)
    # Matryoshka: the first dimensions, re-normalised
    cut = llm.embed(long, use_tqdm=False, dimensions=16)[0].outputs.embedding
    full = np.array(first.outputs.embedding[:16])
    np.testing.assert_allclose(cut, full / np.linalg.norm(full), atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="dimensions"):
        llm.embed(long, use_tqdm=False, dimensions=10_000)
    with pytest.raises(InvalidArgumentError, match="pooling model"):
        llm.generate("hello", use_tqdm=False)
    # cosine scores from the embeddings (an embedding model's /v1/score)
    scores = llm.score("hello world", ["hello world", "tokens of the world"], use_tqdm=False)
    a, b = (np.array(o.outputs.embedding) for o in llm.embed(["hello world", "tokens of the world"], use_tqdm=False))
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    assert scores[1].outputs.score == pytest.approx(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), abs=1e-5)
    llm.shutdown()


def test_generate_engine_refuses_pooling(tiny: Path) -> None:
    llm = LLM(str(tiny), **ENGINE_KW)
    with pytest.raises(InvalidArgumentError, match="runner"):
        llm.embed("hello", use_tqdm=False)
    llm.shutdown()


def test_yes_no_rerank_equals_transformers(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    kw = {**ENGINE_KW, "max_model_len": 512, "num_kv_blocks": 512, "max_num_batched_tokens": 512}
    llm = LLM(str(tiny), runner="pooling", score_mode="yes_no", score_tokens="hello,world", **kw)
    tok = llm.get_tokenizer()
    yes, no = tok.encode("hello", add_special_tokens=False)[0], tok.encode("world", add_special_tokens=False)[0]
    docs = ["the world is a model", "tokens", "hello and the world"]
    outs = llm.score("what is the model?", docs, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    for doc, out in zip(docs, outs):
        text = QWEN3_RERANK_TEMPLATE.replace("{query}", "what is the model?").replace("{document}", doc)
        ids = tok.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        ref = torch.softmax(torch.stack([logits[yes], logits[no]]), dim=0)[0].item()
        assert out.outputs.score == pytest.approx(ref, abs=1e-5)
    llm.shutdown()


def make_classifier(base: Path, out: Path) -> Path:
    """A *ForSequenceClassification checkpoint (num_labels 1) over the tiny model's weights, random score head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = 0
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out


def test_classifier_head_rerank_equals_transformers(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    path = make_classifier(tiny, tmp_path / "cls")
    with pytest.raises(InvalidArgumentError, match="runner"):
        LLM(str(path), **ENGINE_KW)
    llm = LLM(str(path), runner="pooling", **ENGINE_KW)
    assert llm.engine.pooler is not None and llm.engine.pooler.score_mode == "classify"
    docs = ["the world is a model", "tokens", "hello and the world"]
    outs = llm.score(["what is the model?"] * 3, docs, use_tqdm=False)
    hf = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    for doc, out in zip(docs, outs):
        ids = tok("what is the model?", doc)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0]).item()
        assert out.outputs.score == pytest.approx(ref, abs=1e-5)
    with pytest.raises(InvalidArgumentError, match="text_2"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="does not embed"):
        llm.embed("a", use_tqdm=False)
    llm.shutdown()


def test_config_errors(tiny: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="pooling_type"):
        LLM(str(tiny), runner="pooling", pooling_type="max", **ENGINE_KW)
    with pytest.raises(InvalidArgumentError, match="score_template"):
        LLM(str(tiny), runner="pooling", score_template="no fields", **ENGINE_KW)
    with pytest.raises(InvalidArgumentError, match="score_mode"):
        LLM(str(tiny), runner="pooling", score_mode="classify", **ENGINE_KW)
    with pytest.raises(InvalidArgumentError, match="score_tokens"):
        LLM(str(tiny), runner="pooling", score_mode="yes_no", score_tokens="hello there,no", **ENGINE_KW)


def test_task_alias() -> None:
    assert EngineConfig(task="embed").runner == "pooling"
    assert EngineConfig(task="score").runner == "pooling"
    classify = EngineConfig(task="classify")
    assert (classify.runner, classify.score_mode) == ("pooling", "classify")
    assert EngineConfig(task="generate").runner == "generate"
    with pytest.raises(InvalidArgumentError, match="task"):
        EngineConfig(task="generate", runner="pooling")
    with pytest.raises(InvalidArgumentError, match="task"):
        EngineConfig(task="reward")


def test_qwen3_embedding_and_classifier(tmp_path: Path) -> None:
    """Qwen3-Embedding's and Qwen3ForSequenceClassification's architecture (q/k norm: not the lean CPU path)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    base = make_tiny_model(tmp_path, arch="qwen3")
    llm = LLM(str(base), runner="pooling", **ENGINE_KW)
    hf = AutoModel.from_pretrained(str(base), dtype=torch.float32).eval()
    for out in llm.embed(PROMPTS[:2], use_tqdm=False):
        np.testing.assert_allclose(out.outputs.embedding, reference(hf, out.prompt_token_ids, "last", True),
                                   atol=1e-5)
    llm.shutdown()
    path = make_classifier(base, tmp_path / "qwen3-cls")
    llm = LLM(str(path), task="classify", **ENGINE_KW)
    tok = llm.get_tokenizer()
    clf = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    docs = ["a document", "the model"]
    for doc, out in zip(docs, llm.score("the query", docs, use_tqdm=False)):
        ids = tok("the query", doc)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = torch.sigmoid(clf(torch.tensor([ids])).logits[0, 0]).item()
        assert out.outputs.score == pytest.approx(ref, abs=1e-5)
    llm.shutdown()
