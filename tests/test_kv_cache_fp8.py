"""8-bit KV caches (`kv_cache_dtype` fp8 / fp8_e4m3 / fp8_e5m2, vLLM's flag): the cache holds OCP 8-bit floats and
the core's decode kernels widen them exactly as they read (f32 math after that), so a pool holds twice the tokens of
a 16-bit one. No scales (vLLM's default 1.0): e4m3 saturates at +-448 as torch's cast does.

Every writer must round alike: torch's cast on the Python paths and the core's `F8E4M3::store` / `F8E5M2::store`
when the fused decode step writes its rows; every reader (the decode kernel, the lean step, the prefill tiles, the
torch path, a prefix-cache hit, the KV tier) must see the same values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import kv_runs
from core_utils import spy_rows
from ironlm import LLM, _core
from ironlm.core_views import as_numpy, widen
from ironlm.model.layers import cpu_has_fast_bf16
from tiny_models import make_tiny_model

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
FLAG = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kvfp8"), arch="llama")


def _awkward_values(count: int) -> torch.Tensor:
    """Values over every binade the formats have, their ties, the saturation edge and infinities."""
    g = torch.Generator().manual_seed(9)
    scaled = torch.randn(count, generator=g) * torch.pow(2.0, torch.randint(-20, 18, (count,), generator=g).float())
    codes = torch.arange(256, dtype=torch.uint8)
    ties = []
    for dt in FP8.values():
        exact = codes.view(dt).float()
        exact = exact[exact.isfinite()].sort().values
        ties.append((exact[1:] + exact[:-1]) / 2)  # halfway between neighbours: round to the even code
    edges = torch.tensor([448.0, 464.0, 480.0, 500.0, 57344.0, 61440.0, 1e6, float("inf"), 2**-10, 2**-17])
    return torch.cat([scaled, *ties, edges, -edges])


@pytest.mark.parametrize("cache", sorted(FP8))
def test_the_fused_write_rounds_as_torch_casts(cache):
    """The kernel's own store of new rows gives torch's codes for every value (ties to even, e4m3 saturating,
    e5m2 overflowing to infinity), so the Python and the core writers fill the cache alike."""
    x = _awkward_values(4000)
    rows = x[: x.numel() // 64 * 64].view(-1, 2, 32)
    n = rows.shape[0]
    kc = torch.zeros(n, 1, 2, 32, dtype=FP8[cache])
    vc = torch.zeros_like(kc)
    q = torch.zeros(n, 2, 32)
    out = torch.empty_like(q)
    tables = np.arange(n, dtype=np.int32).reshape(n, 1)
    _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, np.ones(n, dtype=np.int32), 1.0,
                                 as_numpy(out), 2, dtype="float32", k=rows.numpy(), v=(-rows).numpy(),
                                 slot_mapping=np.arange(n, dtype=np.int64), cache_dtype=cache)
    want_k, want_v = rows.to(FP8[cache]), (-rows).to(FP8[cache])
    assert torch.equal(kc.view(n, 2, 32).view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(n, 2, 32).view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("cache", sorted(FP8))
@pytest.mark.parametrize("d", [32, 48, 64, 20])
def test_the_kernel_reads_an_8_bit_cache_as_the_f32_kernel_reads_its_values(cache, d):
    """d = 32/48/64 take the AVX-512 passes (or AVX2's), 20 the generic body: the same bits as the f32 kernel over
    the widened values, for f32 and bf16 queries."""
    q, k, v, tables, lens = kv_runs.decode_case(seed=d, d=d)
    kc, vc = k.to(FP8[cache]), v.to(FP8[cache])
    got, want = torch.empty_like(q), torch.empty_like(q)
    _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, lens, 0.17, as_numpy(got), 2,
                                 dtype="float32", cache_dtype=cache)
    # Where prompts take the bf16 tiles (AVX-512 BF16, head dims a multiple of 32) f32 queries over an 8-bit cache
    # are rounded to bf16 as the tiles round a chunk's, so a prefix hit's rows see what the fresh prompt's saw.
    qr = q.bfloat16().float() if cpu_has_fast_bf16() and d % 32 == 0 else q
    _core.paged_decode_attention(as_numpy(qr), kc.float().numpy(), vc.float().numpy(), tables, lens, 0.17,
                                 as_numpy(want), 2, dtype="float32")
    assert torch.equal(got, want)
    qb = q.bfloat16()
    got_b, want_b = torch.empty_like(qb), torch.empty_like(q)
    _core.paged_decode_attention(as_numpy(qb), as_numpy(kc), as_numpy(vc), tables, lens, 0.17, as_numpy(got_b), 2,
                                 dtype="bfloat16", cache_dtype=cache)
    _core.paged_decode_attention(as_numpy(qb.float()), kc.float().numpy(), vc.float().numpy(), tables, lens, 0.17,
                                 as_numpy(want_b), 2, dtype="float32")
    assert torch.equal(got_b, want_b.bfloat16()), "bf16 rows: f32 math, one rounding of the output"


@pytest.mark.parametrize("cache", sorted(FP8))
def test_widen_reads_every_code_as_torch_and_the_kernels_do(cache):
    """core_views.widen (the Python paths' fast fp8 read): torch's value for every code, but e4m3's two NaN codes,
    read as +-480 as the kernels' vector loads read them."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8[cache])
    got, want = widen(codes, torch.float32), codes.to(torch.float32)
    nan = want.isnan()
    assert torch.equal(got[~nan], want[~nan])
    if cache == "float8_e4m3fn":
        assert got[nan].abs().eq(480).all() and int(nan.sum()) == 2
    else:
        assert got[nan].isnan().all()
    assert torch.equal(widen(codes, torch.bfloat16)[~nan], want[~nan].bfloat16())


def test_8_bit_caches_are_refused_under_half_activations():
    q, k, v, tables, lens = kv_runs.decode_case(seed=1)
    qh = q.half()
    with pytest.raises(ValueError, match="cache_dtype"):
        _core.paged_decode_attention(as_numpy(qh), as_numpy(k.to(torch.float8_e5m2)),
                                     as_numpy(v.to(torch.float8_e5m2)), tables, lens, 0.2,
                                     as_numpy(torch.empty_like(qh)), dtype="float16", cache_dtype="float8_e5m2")


@pytest.fixture(scope="module")
def bf16_reference(hf_dir):
    llm = LLM(hf_dir, dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory="4MiB", block_size=4, seed=0)
    prompts = kv_runs.prompts(llm.engine.model_config.vocab_size)
    return llm.engine.num_blocks, prompts, kv_runs.generate(llm, prompts), llm.get_metrics()["kv_bytes_per_token"]


@pytest.mark.parametrize("flag", ["fp8", "fp8_e5m2"])
def test_an_8_bit_pool_holds_twice_the_tokens_of_a_16_bit_one(hf_dir, bf16_reference, flag):
    blocks, prompts, ref, token_bytes = bf16_reference
    llm = LLM(hf_dir, dtype="float32", kv_cache_dtype=flag, kv_cache_memory="4MiB", block_size=4, seed=0)
    assert llm.engine.runner.kv_caches[0][0].dtype == FLAG[flag]
    assert llm.engine.num_blocks == 2 * blocks
    assert 2 * llm.get_metrics()["kv_bytes_per_token"] == token_bytes  # what /metrics reports too
    got = kv_runs.generate(llm, prompts)
    assert [len(o.token_ids) for o in got] == [24] * len(prompts)
    if flag == "fp8":  # e4m3 keeps the random tiny model's first tokens (measured: 3-10 agree); e5m2 did not
        assert [o.token_ids[0] for o in got] == [o.token_ids[0] for o in ref]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_teacher_forced_logprobs_over_8_bit_caches(hf_dir, dtype):
    """bench.perplexity's scorer over the paged cache: one token a step (every key read by the decode kernel) and
    chunks of 16 (prefill tiles over the cache) agree to the tiles' bf16 queries, and both sit as far from the
    16/32-bit cache as each format's mantissa says. Measured on the random tiny model (Zen 4): mean |dlogprob|
    against the wide cache 0.090 (e4m3) and 0.143 (e5m2) under f32, 0.091 / 0.141 under bf16; decode against
    chunks 0.004 (f32) and 0.009 (bf16). (SmolLM2-135M's perplexity: BENCHMARKS.md, benches/bench_kv_fp8.py.)"""
    from ironlm.attention import get_backend
    from ironlm.bench.perplexity import token_logprobs
    from ironlm.model import load_model

    loaded = load_model(hf_dir, dtype=dtype, device="cpu", attn_backend=get_backend("cpu", "cpu"))
    rng = np.random.default_rng(5)
    toks = [int(t) for t in rng.integers(6, loaded.config.vocab_size, size=96)]
    ref = token_logprobs(loaded, toks, chunk_size=16, kv_dtype=getattr(torch, dtype))
    err = {}
    for kv in FP8.values():
        decode = token_logprobs(loaded, toks, chunk_size=1, kv_dtype=kv)
        chunks = token_logprobs(loaded, toks, chunk_size=16, kv_dtype=kv)
        assert np.abs(decode - chunks).mean() < 0.02
        err[kv] = np.abs(chunks - ref).mean()
    assert 0.02 < err[torch.float8_e4m3fn] < 0.2 and err[torch.float8_e4m3fn] < err[torch.float8_e5m2] < 0.3, err


def _agree(got, want, what: str, tol: float = 0.05) -> None:
    """Greedy runs that read the same cached values through different arithmetic (the tiles' bf16 queries and
    probabilities, the kernel's f32, SDPA's): the chosen tokens' logprobs stay within `tol` while the runs agree, and
    a run may only part where the top two tokens were within `tol` of each other in one of them (a near-tie the
    rounding decides; the random tiny model has them, and bf16 logits tie exactly). Parting at a clear margin fails."""
    for g, w in zip(got, want, strict=True):
        for i, (tg, tw) in enumerate(zip(g.token_ids, w.token_ids, strict=True)):
            if tg != tw:
                gaps = [lp[0] - lp[1] for lp in (sorted((x.logprob for x in o.logprobs[i].values()), reverse=True)
                                                 for o in (g, w))]
                assert min(gaps) < tol, f"{what}: parted at step {i} with margins {gaps}"
                break
            assert g.logprobs[i][tg].logprob == pytest.approx(w.logprobs[i][tw].logprob, abs=tol), (what, i)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_path_attends_the_same_8_bit_keys(hf_dir, dtype, monkeypatch):
    """The cpu backend's kernels, lean step and prefill tiles, the torch path, a prefix-cache hit, chunked prefill
    and a speculative run over an e4m3 cache: one greedy answer up to near-ties (`_agree`)."""
    kw = {"dtype": dtype, "kv_cache_dtype": "fp8", "num_kv_blocks": 256, "block_size": 4, "seed": 0}
    cpu = LLM(hf_dir, attention_backend="cpu", **kw)
    prompts = kv_runs.prompts(cpu.engine.model_config.vocab_size)
    tiles = spy_rows(monkeypatch, "prefill_attention")
    base = kv_runs.generate(cpu, prompts, logprobs=2)
    assert cpu.engine.runner.model._lean, "decode steps took the lean step"
    assert tiles or not _core.prefill_attention_serves(64, 64), "prompts took the bf16 tiles where they run"
    _agree(kv_runs.generate(cpu, prompts, logprobs=2), base, "prefix-cache hit")
    assert cpu.get_metrics()["prefix_cache_hits"] > 0
    torch_path = LLM(hf_dir, attention_backend="torch", enable_prefix_caching=False, **kw)
    _agree(kv_runs.generate(torch_path, prompts, logprobs=2), base, "torch path")
    chunked = LLM(hf_dir, attention_backend="cpu", max_num_batched_tokens=16, max_num_seqs=16, **kw)
    _agree(kv_runs.generate(chunked, prompts, logprobs=2), base, "chunked prefill")
    spec = LLM(hf_dir, attention_backend="cpu", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "cost_model": False}, **kw)
    _agree(kv_runs.generate(spec, prompts, logprobs=2), base, "speculative")


def test_an_8_bit_cache_survives_the_kv_tier(hf_dir):
    """Prefix blocks evicted to the host tier and promoted back keep their codes: rounds of prompts over shared
    prefixes, too many for the pool, answer as the same engine without a tier does (which recomputes them)."""
    kw = {"dtype": "float32", "kv_cache_dtype": "fp8_e5m2", "block_size": 4, "seed": 0, "num_kv_blocks": 48,
          "max_num_seqs": 2, "max_model_len": 128}
    rng = np.random.default_rng(11)
    prefixes = [[int(t) for t in rng.integers(10, 250, size=40)] for _ in range(6)]
    rounds = [[p + [int(t) for t in rng.integers(10, 250, size=8)] for p in prefixes] for _ in range(3)]
    plain, tiered = LLM(hf_dir, **kw), LLM(hf_dir, kv_offload_memory="1MiB", **kw)
    for prompts in rounds:
        _agree(kv_runs.generate(tiered, prompts, n=4, logprobs=2), kv_runs.generate(plain, prompts, n=4, logprobs=2), "tier")
    s = tiered.engine.stats()
    assert s["kv_promotions"] > 0 and s["prefix_hits_tier"] > 0, s
