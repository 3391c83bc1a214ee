"""Issue 21's grammar memory and compile storms, over the real llguidance and a real (in-process) server: the
compiled-grammar cache counts bytes, not entries, and grammars over a size are refused (400 naming the field);
compiles run on their own bounded pool with per-tenant caps (429), so a storm of slow grammars leaves neighbours
fast and the process quiet soon after."""

from __future__ import annotations

import asyncio
import json
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ironlm import GrammarBusyError, GrammarError, _core
from ironlm.structured import StructuredOutputsParams
from ironlm.structured.compiler import CompileLimits, GrammarCache
from server_utils import RealServer, wait_for
from tiny_models import EOS_ID, make_tiny_tokenizer


def slow_schema(tag: int) -> dict[str, Any]:
    """Within every shape limit, but ~4 s of llguidance's (uninterruptible) parser construction in a release build."""
    return {"type": "object", "properties": {f"p{i}_{tag}": {"type": "string", "pattern": f"^[a-z]{{3,{40 + i % 200}}}$"}
                                             for i in range(5000)}}


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


# ---- compile storms: an in-process server with small compile limits ---------------------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    server = RealServer(tmp_path_factory)
    engine = server.engine.engine
    engine.grammars = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, [EOS_ID], cache_size=256,
                                   timeout=1.0, max_grammar_bytes=1 << 20,
                                   limits=CompileLimits(workers=1, per_tenant=4, max_inflight=8))
    yield server
    engine.grammars.close()
    server.stop()


def test_http_grammar_over_the_size_limit_is_a_400(limited: RealServer) -> None:
    r = httpx.post(f"{limited.base_url}/completions", timeout=60,
                   json=_completion(structured_outputs={"regex": big_regex(8000)}))
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "structured_outputs.regex"
    assert "MB of memory" in r.json()["error"]["message"]


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def test_compile_storm_leaves_neighbours_fast_and_ends_quietly(limited: RealServer) -> None:
    grammars = limited.engine.engine.grammars
    url = limited.base_url
    # Warm: the first forward, and the token trie (built by the first compile), are not what is measured.
    for warm in (_completion(), _completion(structured_outputs={"json": {"type": "object"}})):
        assert httpx.post(f"{url}/completions", json=warm, timeout=60).status_code == 200
    # Encoded up front: the clients share this process (and its GIL) with the server.
    bodies = [json.dumps(_completion(structured_outputs={"json": slow_schema(i)})).encode() for i in range(20)]
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def storm(body: bytes) -> None:
        r = httpx.post(f"{url}/completions", content=body, headers={"content-type": "application/json"},
                       timeout=120)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=storm, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    # Measured once the burst is parsed and compiles run: parsing 20 bodies of ~300 KB takes the loop ~1-2 s here,
    # which is request parsing (any large body costs it), not compiling.
    assert wait_for(lambda: grammars.compiler.live_threads > 0 and grammars.refused >= 12, timeout=30)
    neighbour: list[float] = []
    with httpx.Client(timeout=30) as client:
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            ok = client.post(f"{url}/completions", json=_completion(max_tokens=1))
            tk = client.post(f"{limited.url}/tokenize", json={"model": "tiny", "prompt": "hello there"})
            neighbour.append(time.monotonic() - t0)
            assert ok.status_code == 200 and tk.status_code == 200, (ok.text, tk.text)
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    busy = [r for r in results if r.status_code == 429]
    assert set(statuses) <= {400, 429}, statuses
    assert len(busy) >= 12, statuses  # 4 of the tenant's 20 admitted at most, in waves
    assert all(r.json()["error"]["code"] == "grammar_compiles_busy" for r in busy)
    assert neighbour and max(neighbour) < 2.0, neighbour
    # Abandoned compiles end (the core keeps at most 2 alive), then the process goes quiet.
    assert wait_for(lambda: grammars.compiler.live_threads == 0, timeout=30)
    c0 = _cpu()
    time.sleep(1.0)
    assert _cpu() - c0 < 0.3
    # And compiling works again.
    r = httpx.post(f"{url}/completions", json=_completion(structured_outputs={"json": {"type": "string"}}), timeout=60)
    assert r.status_code == 200, r.text[:300]


def test_per_tenant_cap_in_the_library(tok: Any) -> None:
    cache = _cache(tok, timeout=1.0, limits=CompileLimits(workers=1, per_tenant=1, max_inflight=2))

    async def main() -> list[BaseException | _core.CompiledGrammar]:
        slow = [cache.compile_async(StructuredOutputsParams(json=slow_schema(100 + i)), tenant="a") for i in range(2)]
        other = cache.compile_async(StructuredOutputsParams(json={"type": "object"}), tenant="b")
        return await asyncio.gather(*slow, other, return_exceptions=True)

    first, second, other = asyncio.run(main())
    assert isinstance(first, GrammarError) and "longer than" in str(first)  # ran, timed out
    assert isinstance(second, GrammarBusyError) and "this tenant" in str(second)
    assert isinstance(other, _core.CompiledGrammar)  # another tenant is not held up by the cap
    cache.close()
