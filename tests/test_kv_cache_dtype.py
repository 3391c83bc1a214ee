"""A 16-bit KV cache under float32 activations (`kv_cache_dtype`, vLLM's flag; llama.cpp's default f16 cache).

The core's decode kernels read bf16/f16 cache rows under f32 queries (widened exactly, f32 math), the fused decode
step rounds each new K/V row once on the write, and every backend attends a chunk's own new rows rounded the same
way (`round_to_cache`), so a cached prefix, a recompute and a fresh prefill all see the same keys. The pool holds
twice the tokens for the same bytes.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

import kv_runs
from core_utils import spy_rows
from ironlm import LLM, InvalidArgumentError, _core
from ironlm.core_views import as_numpy
from ironlm.model.layers import cpu_has_fast_bf16
from tiny_models import make_tiny_model

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kvdtype"), arch="llama")


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
def test_the_kernel_reads_a_16_bit_cache_as_the_f32_kernel_reads_its_values(cache):
    # head dim 48: not a multiple of 32, so no `vdpbf16ps` logits (see the next test): the f32 kernel's own bits
    q, k, v, tables, lens = kv_runs.decode_case(d=48)
    kc, vc = k.to(HALF[cache]), v.to(HALF[cache])
    got, want = torch.empty_like(q), torch.empty_like(q)
    _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, lens, 0.17, as_numpy(got), 2,
                                 dtype="float32", cache_dtype=cache)
    _core.paged_decode_attention(as_numpy(q), kc.float().numpy(), vc.float().numpy(), tables, lens, 0.17,
                                 as_numpy(want), 2, dtype="float32")
    assert torch.equal(got, want)
    # and close to attending the unrounded f32 cache (the rounding is all that differs)
    exact = torch.empty_like(q)
    _core.paged_decode_attention(as_numpy(q), k.numpy(), v.numpy(), tables, lens, 0.17, as_numpy(exact), 2)
    assert (got - exact).abs().max().item() < (2e-2 if cache == "bfloat16" else 3e-3)


def test_a_bf16_cache_takes_bf16_dot_products_where_the_cpu_has_them():
    """Over a bf16 cache at head dims a multiple of 32, CPUs with AVX-512 BF16 take the logits by `vdpbf16ps` on the
    queries rounded to bf16 (as the prefill tiles do): within bf16 of the f32 kernel on the same cached values."""
    q, k, v, tables, lens = kv_runs.decode_case(d=64, seed=6)
    kc, vc = k.bfloat16(), v.bfloat16()
    got, want, rounded = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, lens, 0.125, as_numpy(got), 2,
                                 dtype="float32", cache_dtype="bfloat16")
    _core.paged_decode_attention(as_numpy(q), kc.float().numpy(), vc.float().numpy(), tables, lens, 0.125,
                                 as_numpy(want), 2)
    qr = q.bfloat16().float()
    _core.paged_decode_attention(as_numpy(qr), kc.float().numpy(), vc.float().numpy(), tables, lens, 0.125,
                                 as_numpy(rounded), 2)
    assert (got - want).abs().max().item() < 2e-2
    if cpu_has_fast_bf16():  # products of bf16 pairs are exact in f32: the rounded queries' logits, summed in pairs
        assert (got - rounded).abs().max().item() < 1e-5 < (got - want).abs().max().item()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
def test_new_rows_are_rounded_once_into_the_cache(cache):
    q, k, v, tables, lens = kv_runs.decode_case(seed=1)
    kc, vc = k.to(HALF[cache]), v.to(HALF[cache])
    g = torch.Generator().manual_seed(2)
    nk, nv = torch.randn(3, 2, 32, generator=g), torch.randn(3, 2, 32, generator=g)
    bs = 4
    slots = np.array([int(tables[i, (lens[i] - 1) // bs]) * bs + (lens[i] - 1) % bs for i in range(3)],
                     dtype=np.int64)
    out = torch.empty_like(q)
    _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, lens, 0.2, as_numpy(out), 1,
                                 dtype="float32", k=nk.numpy(), v=nv.numpy(), slot_mapping=slots, cache_dtype=cache)
    flat_k, flat_v = kc.view(-1, 2, 32), vc.view(-1, 2, 32)
    assert torch.equal(flat_k[torch.from_numpy(slots)], nk.to(HALF[cache]))
    assert torch.equal(flat_v[torch.from_numpy(slots)], nv.to(HALF[cache]))
    again = torch.empty_like(q)
    _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, lens, 0.2, as_numpy(again), 1,
                                 dtype="float32", cache_dtype=cache)
    assert torch.equal(out, again), "write-then-attend in one call equals attending what it wrote"


def test_unsupported_type_pairs_are_refused_by_name():
    q, k, v, tables, lens = kv_runs.decode_case()
    qb, kc, vc = q.to(torch.bfloat16), k.to(torch.float16), v.to(torch.float16)
    out = torch.empty_like(qb)
    with pytest.raises(InvalidArgumentError) as err:
        _core.paged_decode_attention(as_numpy(qb), as_numpy(kc), as_numpy(vc), tables, lens, 0.2, as_numpy(out),
                                     dtype="bfloat16", cache_dtype="float16")
    assert err.value.param == "cache_dtype"
    with pytest.raises(InvalidArgumentError) as err:
        _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, lens, 0.2,
                                     as_numpy(torch.empty_like(q)), dtype="float32", cache_dtype="fp8")
    assert err.value.param == "cache_dtype"
    with pytest.raises(InvalidArgumentError):  # f32 caches named 16-bit: the element size gives them away
        _core.paged_decode_attention(as_numpy(q), k.numpy(), v.numpy(), tables, lens, 0.2,
                                     as_numpy(torch.empty_like(q)), dtype="float32", cache_dtype="bfloat16")


def test_engine_config_refuses_what_it_cannot_run(hf_dir):
    with pytest.raises(InvalidArgumentError) as err:  # 8-bit caches: under float32 or bfloat16 only
        LLM(hf_dir, dtype="float16", kv_cache_dtype="fp8", num_kv_blocks=16)
    assert err.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidArgumentError) as err:
        LLM(hf_dir, kv_cache_dtype="fp4", num_kv_blocks=16)
    assert err.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidArgumentError) as err:
        LLM(hf_dir, dtype="bfloat16", kv_cache_dtype="float16", num_kv_blocks=16)
    assert err.value.param == "kv_cache_dtype"


def test_auto_is_16_bit_where_quantized_weights_alone_made_the_activations_f32(hf_dir):
    quantized = LLM(hf_dir, quantization="int8", num_kv_blocks=16)  # dtype auto: f32 activations over int8 blocks
    half = torch.bfloat16 if cpu_has_fast_bf16() else torch.float16  # bf16 where its prefill tiles run
    assert quantized.engine.dtype == torch.float32 and quantized.engine.runner.kv_dtype == half
    dense = LLM(hf_dir, dtype="float32", num_kv_blocks=16)
    assert dense.engine.runner.kv_dtype == torch.float32
    asked = LLM(hf_dir, dtype="float32", quantization="int8", num_kv_blocks=16)  # f32 asked for: an f32 cache
    assert asked.engine.runner.kv_dtype == torch.float32
    wide = LLM(hf_dir, quantization="int8", kv_cache_dtype="float32", num_kv_blocks=16)
    assert wide.engine.runner.kv_dtype == torch.float32


@pytest.fixture(scope="module")
def f32_reference(hf_dir):
    llm = LLM(hf_dir, dtype="float32", kv_cache_memory="4MiB", block_size=4, seed=0)
    prompts = kv_runs.prompts(llm.engine.model_config.vocab_size)
    return llm.engine.num_blocks, prompts, kv_runs.generate(llm, prompts, logprobs=1), llm.get_metrics()["kv_bytes_per_token"]


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
def test_a_16_bit_pool_holds_twice_the_tokens_and_decodes_close_to_f32(hf_dir, f32_reference, cache):
    blocks, prompts, ref, token_bytes = f32_reference
    llm = LLM(hf_dir, dtype="float32", kv_cache_dtype=cache, kv_cache_memory="4MiB", block_size=4, seed=0)
    assert llm.engine.runner.kv_dtype == HALF[cache]
    assert llm.engine.runner.kv_caches[0][0].dtype == HALF[cache]
    assert llm.engine.num_blocks == 2 * blocks
    assert 2 * llm.get_metrics()["kv_bytes_per_token"] == token_bytes  # what /metrics reports too
    got = kv_runs.generate(llm, prompts, logprobs=1)
    # Greedy over the same random tiny model: the first tokens agree; the chosen tokens' logprobs stay close while
    # the sequences agree. Measured on a Zen 4 (all 4 x 24 tokens agreeing): max |diff| 0.0235 for bf16 (8-bit
    # mantissa), 0.0026 for f16 (11-bit: 9x tighter, as the rounding); bounds 2.5-3x those.
    tol = 6e-2 if cache == "bfloat16" else 8e-3
    for a, b in zip(got, ref, strict=True):
        assert a.token_ids[:4] == b.token_ids[:4]
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                break
            assert a.logprobs[i][ta].logprob == pytest.approx(b.logprobs[i][tb].logprob, abs=tol)


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
def test_every_path_attends_the_same_rounded_keys(hf_dir, cache):
    """The cpu backend's kernels and lean step, the torch path, a prefix-cache hit and chunked prefill: one answer."""
    kw = {"dtype": "float32", "kv_cache_dtype": cache, "num_kv_blocks": 256, "block_size": 4, "seed": 0}
    cpu = LLM(hf_dir, attention_backend="cpu", **kw)
    prompts = kv_runs.prompts(cpu.engine.model_config.vocab_size)
    base = [o.token_ids for o in kv_runs.generate(cpu, prompts)]
    assert [o.token_ids for o in kv_runs.generate(cpu, prompts)] == base, "the second run hits the prefix cache"
    torch_path = LLM(hf_dir, attention_backend="torch", enable_prefix_caching=False, **kw)
    assert [o.token_ids for o in kv_runs.generate(torch_path, prompts)] == base
    chunked = LLM(hf_dir, attention_backend="cpu", max_num_batched_tokens=16, max_num_seqs=16, **kw)
    assert [o.token_ids for o in kv_runs.generate(chunked, prompts)] == base


def test_speculative_greedy_output_equals_plain_over_a_16_bit_cache(hf_dir):
    """Verification rows read the rounded cache through the same per-row kernel as plain decode."""
    kw = {"dtype": "float32", "kv_cache_dtype": "bfloat16", "quantization": "int8", "num_kv_blocks": 256,
          "block_size": 4, "seed": 0}
    plain = LLM(hf_dir, **kw)
    spec = LLM(hf_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                           "cost_model": False}, **kw)
    base = kv_runs.prompts(plain.engine.model_config.vocab_size)
    prompts = [p * 3 + p[: len(p) // 2] for p in base]  # a copy in progress: lookup proposes the rest
    want = [o.token_ids for o in kv_runs.generate(plain, prompts, n=40)]
    got = [o.token_ids for o in kv_runs.generate(spec, prompts, n=40)]
    assert got == want
    m = spec.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0, m


def test_f32_prefill_chunks_over_a_bf16_cache_take_the_bf16_tiles(monkeypatch):
    """A GGUF's f32 activations over its bf16 cache: plain causal prefill chunks (a fresh prompt, and one after a
    cached prefix) go to the core's bf16 tiles, their queries rounded to bf16, close to the f32 torch reference over
    the same cached values."""
    from ironlm.attention import AttentionMetadata, CpuAttention, TorchAttention

    bs, hq, hkv, d = 16, 9, 3, 64
    if not _core.prefill_attention_serves(d, d):
        pytest.skip("no AVX-512 BF16 tiles on this CPU")
    calls = spy_rows(monkeypatch, "prefill_attention")
    g = torch.Generator().manual_seed(3)
    ctx, lens = np.array([0, 48]), np.array([40, 33])
    n = int(lens.sum())
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    shape = (12, bs, hkv, d)
    caches = {}
    for name, backend in (("cpu", CpuAttention()), ("torch", TorchAttention())):
        kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        prefix = torch.Generator().manual_seed(4)  # sequence 1's cached 48 positions, the same in both caches
        kc[6:9] = torch.randn(3, bs, hkv, d, generator=prefix).bfloat16()
        vc[6:9] = torch.randn(3, bs, hkv, d, generator=prefix).bfloat16()
        meta = AttentionMetadata.from_lengths(context_lens=ctx, query_lens=lens, block_size=bs,
                                              block_tables=np.array([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]))
        caches[name] = (backend.forward(q, k, v, kc, vc, meta, d**-0.5), kc, vc)
    (got, kc, vc), (want, kt, vt) = caches["cpu"], caches["torch"]
    assert sorted(calls) == [33, 40]
    assert torch.equal(kc, kt) and torch.equal(vc, vt), "both wrote the same rounded rows"
    assert got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err < 2e-2, err  # bf16 queries and probabilities: measured 7.0e-3 on a Zen 4


def test_cpu_pool_planes_are_zeroed_separate_and_start_on_huge_pages():
    """A CPU pool's planes come from their own anonymous mappings, advised for transparent huge pages (decode reads
    blocks scattered over the pool), each starting on a 2 MiB boundary, zeroed and touched (resident) as
    torch.zeros made them; small planes as before."""
    from ironlm.engine.kv_cache import allocate_kv_caches
    from ironlm.model.config import ModelConfig

    cfg = ModelConfig(architecture="llama", vocab_size=10, hidden_size=64, intermediate_size=16, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=64)
    caches = allocate_kv_caches(cfg, 2048, 16, torch.bfloat16, torch.device("cpu"))  # 8 MiB a plane
    planes = [t for pair in caches for t in pair]
    assert len({t.data_ptr() for t in planes}) == 6
    for t in planes:
        assert t.shape == (2048, 16, 2, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert t.data_ptr() % (2 << 20) == 0 or not hasattr(mmap, "MADV_HUGEPAGE")  # Linux only
        assert not t.any()
        t[-1, -1, -1, -1] = 1.0  # writable to its last element
    assert sum(int(t.float().sum()) for t in planes) == 6
    small = allocate_kv_caches(cfg, 4, 16, torch.float32, torch.device("cpu"))
    assert all(not t.any() and t.shape == (4, 16, 2, 64) for pair in small for t in pair)
