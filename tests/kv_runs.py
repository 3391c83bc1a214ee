"""Greedy runs for the KV cache type tests (test_kv_cache_dtype.py, test_kv_cache_fp8.py): the same four random
prompts and one call that returns each prompt's first completion."""

from __future__ import annotations

from typing import Any

import numpy as np

from ironlm import LLM, SamplingParams


def prompts(vocab: int) -> list[list[int]]:
    """Four prompts of 7-50 random token ids (seed 5), from id 6 up (clear of the special tokens)."""
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(6, vocab, size=n)] for n in (7, 19, 33, 50)]


def generate(llm: LLM, prompts: list[list[int]], n: int = 24, logprobs: int | None = None) -> list[Any]:
    """Each prompt's greedy completion of `n` tokens (EOS ignored), with `logprobs` top logprobs a step."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]
