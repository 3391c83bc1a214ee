"""Same-step prefix sharing: requests admitted together compute their common prefix once.

The core caches a full block as soon as a forward is planned to write it, so the next request admitted in the
same step hits it; its context is read after the same forward wrote it (every attention backend writes the
step's KV before attending). A plan that never runs takes those blocks back out of the cache.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ironlm import LLM, SamplingParams
from tiny_models import make_tiny_model

PREFIX, SUFFIX, N, MAX_NEW = 512, 8, 16, 6


class CountingScheduler:
    """The engine's core scheduler, counting the prefill tokens of every plan it hands out."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.prefill_tokens = 0
        self.cached_tokens = 0
        self.first_hits: dict[str, int] = {}

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.inner.schedule(*args, **kwargs)
        self.prefill_tokens += plan.num_prefill_tokens
        self.cached_tokens += plan.num_cached_tokens
        self.first_hits.update(zip(plan.new_request_ids, plan.new_request_cached_tokens.tolist()))
        return plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("share"), arch="llama", max_position_embeddings=1024)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 200) for _ in range(PREFIX)]
    prompts = [prefix + [rng.randrange(3, 200) for _ in range(SUFFIX)] for _ in range(N)]
    return path, prompts


def _run(path, prompts, **kwargs) -> tuple[list[list[int]], CountingScheduler, dict]:
    llm = LLM(str(path), **{"dtype": "float32", "block_size": 16, "num_kv_blocks": 256, "max_num_seqs": N,
                            "max_num_batched_tokens": 2048, **kwargs})
    counting = CountingScheduler(llm.engine.scheduler)
    llm.engine.scheduler = counting
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], counting, llm.engine.stats()


def test_requests_submitted_together_compute_the_shared_prefix_once(setup):
    path, prompts = setup
    got, counting, stats = _run(path, prompts)
    # One request computes prefix + suffix; the 15 others hit all 32 prefix blocks in the same step.
    assert counting.prefill_tokens == PREFIX + N * SUFFIX
    assert counting.cached_tokens == (N - 1) * PREFIX
    assert stats["prefix_cache_hits"] == (N - 1) * PREFIX
    assert stats["blocks_used"] == 0
    expected, plain, _ = _run(path, prompts, enable_prefix_caching=False)
    assert plain.prefill_tokens == N * (PREFIX + SUFFIX)
    assert got == expected


def test_shared_prefix_across_chunks_and_a_failed_step(setup, monkeypatch):
    """A small token budget splits the first prompt into chunks; the others join as its blocks are planned.
    Then a forward fails once: the blocks it would have written are uncached and recomputed, outputs unchanged."""
    path, prompts = setup
    expected, _, _ = _run(path, prompts[:4], enable_prefix_caching=False)
    got, counting, _ = _run(path, prompts[:4], max_num_batched_tokens=128)
    assert got == expected
    assert counting.prefill_tokens == PREFIX + 4 * SUFFIX

    llm = LLM(str(path), dtype="float32", block_size=16, num_kv_blocks=256, max_num_seqs=N,
              max_num_batched_tokens=2048)
    runner = llm.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(plan, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(plan, *args)

    monkeypatch.setattr(runner, "execute", flaky)
    counting = CountingScheduler(llm.engine.scheduler)
    llm.engine.scheduler = counting
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)[0]
    assert first.outputs[0].finish_reason == "error"
    hits_before = set(counting.first_hits)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    # The blocks the failed forward never wrote were uncached: the same prompt again found nothing to hit,
    # and the three others hit what it computed this time.
    retry = [rid for rid in counting.first_hits if rid not in hits_before]
    assert [counting.first_hits[r] for r in retry] == [0, PREFIX, PREFIX, PREFIX]
    assert llm.engine.stats()["blocks_used"] == 0
