"""Shared pieces of the KV cache type tests (test_kv_cache_dtype.py, test_kv_cache_fp8.py): a random paged decode
case for the kernel, the same four random prompts and one call that returns each prompt's first completion."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ironlm import LLM, SamplingParams


def decode_case(seed: int = 0, n: int = 3, hq: int = 4, hkv: int = 2, d: int = 32, bs: int = 4, blocks: int = 12
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """paged_decode_attention's f32 inputs: q [n, Hq, D], caches [blocks, bs, Hkv, D], n shuffled 4-block tables
    and context lengths 5, 16, 9 (the first n)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(blocks, bs, hkv, d, generator=g)
    v = torch.randn(blocks, bs, hkv, d, generator=g)
    tables = torch.randperm(blocks, generator=g)[: n * 4].reshape(n, 4).to(torch.int32).numpy()
    return q, k, v, np.ascontiguousarray(tables), np.array([5, 16, 9], dtype=np.int32)[:n]


def prompts(vocab: int) -> list[list[int]]:
    """Four prompts of 7-50 random token ids (seed 5), from id 6 up (clear of the special tokens)."""
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(6, vocab, size=n)] for n in (7, 19, 33, 50)]


def generate(llm: LLM, prompts: list[list[int]], n: int = 24, logprobs: int | None = None) -> list[Any]:
    """Each prompt's greedy completion of `n` tokens (EOS ignored), with `logprobs` top logprobs a step."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]
