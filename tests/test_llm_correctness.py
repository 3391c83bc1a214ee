"""End to end: ironlm's greedy tokens and logprobs against transformers as the oracle.

Every scheduling path (prefix caching, chunked prefill, preemption, batching, n > 1) must give
the very same tokens as a plain transformers greedy loop over the same weights.

The engine runs in float32 explicitly (the oracle's dtype), on whatever device "auto" picks: on a GPU the
tokens must still be identical, and the logprobs agree to a tolerance that allows for a different
reduction order (cuBLAS, the Triton kernels in IEEE fp32), not for a lower precision.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from devices import logprob_atol
from ironlm import LLM, SamplingParams
from tiny_models import make_tiny_model

MAX_NEW = 12
DTYPE = "float32"

ARCHS = {
    "llama-gqa": ("llama", {}),
    "llama-mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm-hd128": ("qwen3", {"head_dim": 128}),
}


def _prompts(vocab: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    lengths = [1, 5, 17, 33, 8, 40]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(path, prompts: list[list[int]], max_new: int = MAX_NEW):
    """Greedy tokens and chosen-token logprobs from a plain transformers loop (no generate())."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model(ids, use_cache=True)
            tokens, logprobs = [], []
            for _ in range(max_new):
                lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                tok = int(lp.argmax())
                tokens.append(tok)
                logprobs.append(float(lp[tok]))
                out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
            results.append((tokens, logprobs))
    return results


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_model(request, tmp_path_factory):
    arch, overrides = ARCHS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, **overrides)
    prompts = _prompts(_vocab(path))
    return path, prompts, hf_greedy(path, prompts)


def _vocab(path) -> int:
    import json

    return json.loads((path / "config.json").read_text())["vocab_size"]


def _generate(llm: LLM, prompts, **params):
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                                      for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def engine_atol(llm: LLM) -> float:
    return logprob_atol(llm.engine.device, llm.engine.runner.dtype)


def test_greedy_matches_transformers(arch_model):
    path, prompts, expected = arch_model
    llm = LLM(str(path), num_kv_blocks=256, block_size=16, seed=0, dtype=DTYPE)
    got = _generate(llm, prompts)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, expected):
        assert tokens == ref_tokens
        assert lps == pytest.approx(ref_lps, abs=engine_atol(llm))


@pytest.mark.parametrize("variant", ["no_prefix_cache", "chunked_prefill", "preemption", "one_at_a_time"])
def test_scheduling_paths_keep_greedy_identical(variant, tmp_path):
    path = make_tiny_model(tmp_path, arch="llama")
    vocab = _vocab(path)
    prompts = _prompts(vocab, seed=1, shared_prefix=24)  # repeated prefixes → prefix-cache hits
    expected = [t for t, _ in hf_greedy(path, prompts)]
    kwargs = {"num_kv_blocks": 128, "block_size": 4, "dtype": DTYPE}
    if variant == "no_prefix_cache":
        kwargs["enable_prefix_caching"] = False
    if variant == "chunked_prefill":
        kwargs["max_num_batched_tokens"] = 8
        kwargs["max_num_seqs"] = 4
    if variant == "preemption":
        kwargs["num_kv_blocks"] = 20  # 80 token slots for 6 sequences of up to 76 tokens
    llm = LLM(str(path), **kwargs)
    if variant == "one_at_a_time":
        got = [_generate(llm, [p])[0][0] for p in prompts]
    else:
        got = [t for t, _ in _generate(llm, prompts)]
    assert got == expected
    stats = llm.get_metrics()
    if variant == "preemption":
        assert stats["num_preemptions"] > 0
    if variant in ("chunked_prefill", "one_at_a_time"):
        assert stats["prefix_cache_hits"] > 0
    if variant == "no_prefix_cache":
        assert stats["prefix_cache_hits"] == 0
    assert llm.engine.stats()["blocks_used"] == 0  # nothing leaked


def test_n_greater_than_one_forks_share_the_prompt(tmp_path):
    path = make_tiny_model(tmp_path, arch="qwen2")
    prompt = {"prompt_token_ids": _prompts(_vocab(path))[3]}
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, dtype=DTYPE)
    group = llm.generate(prompt, SamplingParams(n=3, seed=7, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in group.outputs] == [0, 1, 2]
    # Child i draws from seed 7 + i: it must equal a lone request with that seed, which proves the
    # forked KV blocks (shared prompt, copy-on-write tail) hold exactly the right context.
    for i, child in enumerate(group.outputs):
        alone = llm.generate(prompt, SamplingParams(seed=7 + i, max_tokens=10, ignore_eos=True), use_tqdm=False)
        assert child.token_ids == alone[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1
    assert llm.engine.stats()["blocks_used"] == 0


def test_seeded_sampling_is_reproducible_in_any_batch(tmp_path):
    path = make_tiny_model(tmp_path, arch="llama")
    prompts = [{"prompt_token_ids": p} for p in _prompts(_vocab(path), seed=3)]
    llm = LLM(str(path), num_kv_blocks=128, dtype=DTYPE)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate(prompts[2], sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batch = llm.generate(prompts, [other, other, sp, other, other, other], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    greedy = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    top1 = llm.generate(prompts[2], SamplingParams(top_k=1, seed=5, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert top1 == greedy
