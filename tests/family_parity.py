"""Greedy parity of one model folder or GGUF against transformers, through every scheduling path in ONE run.

    expected = hf_greedy(hf_dir, prompts)                    # plain transformers loop, fp32 (test_llm_correctness)
    check_engine_greedy(model, prompts, expected, backend)  # prefix caching + chunked prefill + preemption

The engine gets a pool too small for all sequences at once (preemption), a token budget smaller than the prompts
(chunked prefill, mixed prefill/decode steps) and prompts sharing a prefix longer than a block (prefix-cache hits);
the test asserts each of the three actually happened, so a change in the scheduler cannot make the run trivial.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from ironlm import LLM, SamplingParams
from test_llm_correctness import hf_greedy

MAX_NEW = 10
__all__ = ["MAX_NEW", "check_engine_greedy", "hf_greedy", "shared_prefix_prompts"]


def shared_prefix_prompts(vocab: int, seed: int = 1, prefix: int = 24) -> list[list[int]]:
    """Six prompts of 25..64 tokens, all starting with the same `prefix` tokens (ids >= 6: no special tokens)."""
    rng = random.Random(seed)
    head = [rng.randrange(6, vocab) for _ in range(prefix)]
    return [head + [rng.randrange(6, vocab) for _ in range(n)] for n in (1, 5, 17, 33, 8, 40)]


def check_engine_greedy(model: str | Path, prompts: list[list[int]], expected: list[list[int]],
                        backend: str = "torch", max_new: int = MAX_NEW, **engine: Any) -> LLM:
    """ironlm's greedy tokens == `expected` with prefix caching, chunked prefill and preemption in one run
    (`engine`: more LLM arguments, e.g. quantization)."""
    llm = LLM(str(model), dtype="float32", device="cpu", attention_backend=backend, seed=0,
              block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, **engine)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    for i, (g, want) in enumerate(zip(got, expected)):
        assert g == list(want)[:max_new], f"prompt {i} ({len(prompts[i])} tokens): {g} != {list(want)[:max_new]}"
    stats = llm.get_metrics()
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    assert llm.engine.stats()["blocks_used"] == 0  # nothing leaked
    return llm
