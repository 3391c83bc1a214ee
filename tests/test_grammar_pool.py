"""Issue 21's grammar memory, over the real llguidance and a real (in-process) server: the compiled-grammar cache
counts bytes, not entries, and grammars over a size are refused (400 naming the field)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ironlm import GrammarError
from ironlm.structured import StructuredOutputsParams
from ironlm.structured.compiler import GrammarCache
from server_utils import RealServer
from tiny_models import EOS_ID, make_tiny_tokenizer


def big_regex(n: int, tag: int = 0) -> str:
    return "(" + "|".join(f"w{i:05d}x{tag}" for i in range(n)) + ")"


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}


# ---- grammar memory -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tiny_tokenizer()


def _cache(tok: Any, **kw: Any) -> GrammarCache:
    return GrammarCache(tok, len(tok.get_vocab()) + 8, [EOS_ID], cache_size=kw.pop("cache_size", 256),
                        timeout=kw.pop("timeout", 30.0), **kw)


def test_compiled_size_estimate_grows_with_the_grammar(tok: Any) -> None:
    cache = _cache(tok)
    small = cache.compile_params(StructuredOutputsParams(json={"type": "object"}))
    big = cache.compile_params(StructuredOutputsParams(regex=big_regex(20_000)))
    assert 0 < small.size_bytes < 1 << 20
    assert big.size_bytes > 10 * small.size_bytes
    assert big.size_bytes > 20_000 * 8 * 4  # at least 4 bytes per byte of its text


def test_cache_is_bounded_by_bytes_not_count(tok: Any) -> None:
    probe = _cache(tok).compile_params(StructuredOutputsParams(regex=big_regex(5000, 99))).size_bytes
    budget = int(probe * 3.5)
    cache = _cache(tok, cache_bytes=budget)
    texts = [StructuredOutputsParams(regex=big_regex(5000, i)) for i in range(6)]
    for p in texts:
        cache.compile_params(p)
        assert cache.cached_bytes <= budget
    assert 1 <= len(cache._cache) <= 3
    misses = cache.misses
    cache.compile_params(texts[0])  # evicted first: compiled again
    assert cache.misses == misses + 1
    cache.compile_params(texts[0])
    assert cache.misses == misses + 1


def test_grammar_over_the_size_limit_is_refused(tok: Any) -> None:
    cache = _cache(tok, max_grammar_bytes=1 << 20)
    with pytest.raises(GrammarError, match="MB of memory") as info:
        cache.compile_params(StructuredOutputsParams(regex=big_regex(20_000)))
    assert info.value.param == "structured_outputs.regex"
    cache.compile_params(StructuredOutputsParams(json={"type": "object"}))


# ---- an in-process server with small grammar limits ---------------------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    server = RealServer(tmp_path_factory)
    engine = server.engine.engine
    engine.grammars = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, [EOS_ID], cache_size=256,
                                   timeout=1.0, max_grammar_bytes=1 << 20)
    yield server
    server.stop()


def test_http_grammar_over_the_size_limit_is_a_400(limited: RealServer) -> None:
    r = httpx.post(f"{limited.base_url}/completions", timeout=60,
                   json=_completion(structured_outputs={"regex": big_regex(8000)}))
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "structured_outputs.regex"
    assert "MB of memory" in r.json()["error"]["message"]
