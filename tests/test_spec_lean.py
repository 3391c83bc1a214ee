"""Speculative verification rows through the lean CPU step (model/lean.py, CpuAttention.lean_plan).

A verification step gives a cached sequence its last token plus the proposals: several rows at consecutive
positions. The lean step runs each as a decode row at its own position, so with quantized linears (the CPU
default: GGUF blocks, load-time int8/int4) a row's logits and K/V are bit-for-bit those of the same row decoded
alone, and speculative greedy output equals plain greedy output exactly, in fp32 and bf16 activations.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from core_utils import spy_rows
from ironlm import LLM, SamplingParams
from ironlm.attention import AttentionMetadata, CpuAttention
from ironlm.model import lean, load_model
from tiny_models import make_tiny_gguf, make_tiny_model

BS = 4
TABLE = np.arange(16, dtype=np.int32).reshape(2, 8)
IDS = torch.tensor([3, 17, 42, 9, 11, 30, 5])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("speclean"), arch="llama")


def _load(hf_dir: Path, weights: str, dtype: torch.dtype):
    """`weights`: a GGUF block type kept by quantization auto (the default), or a load-time quantization."""
    if weights in ("Q4_0", "Q8_0", "Q4_1"):
        path = make_tiny_gguf(hf_dir.parent, hf_dir, weights)
        return load_model(path, dtype=dtype, device="cpu", quantization="auto", attn_backend=CpuAttention()).model
    return load_model(hf_dir, dtype=dtype, device="cpu", quantization=weights, attn_backend=CpuAttention()).model


def _caches(model, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg, g = model.config, torch.Generator().manual_seed(0)
    shape = (16, BS, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(cfg.num_layers)]


def _chunk_step(model, kv) -> torch.Tensor:
    """Sequence 0 verifies 6 rows from context 7 (its last token and 5 proposals), sequence 1 decodes one row
    at context 10: logits of all 7 rows."""
    meta = AttentionMetadata.from_lengths(context_lens=np.array([7, 10]), query_lens=np.array([6, 1]),
                                          block_tables=TABLE, block_size=BS)
    return model(IDS, torch.tensor([7, 8, 9, 10, 11, 12, 10]), kv, meta, torch.arange(7))


def _row_steps(model, kv) -> torch.Tensor:
    """The same rows as one-row decode steps, in order."""
    rows = [(0, 7 + j) for j in range(6)] + [(1, 10)]
    out = []
    for i, (seq, ctx) in enumerate(rows):
        meta = AttentionMetadata.from_lengths(context_lens=np.array([ctx]), query_lens=np.array([1]),
                                              block_tables=TABLE[seq : seq + 1], block_size=BS)
        out.append(model(IDS[i : i + 1], torch.tensor([ctx]), kv, meta, torch.arange(1)))
    return torch.cat(out)


@pytest.mark.parametrize(("weights", "dtype"), [("Q4_0", torch.float32), ("Q8_0", torch.float32),
                                                ("Q4_1", torch.bfloat16), ("int8", torch.float32),
                                                ("int4", torch.bfloat16)])
@pytest.mark.parametrize("fused", [True, False])
def test_lean_chunk_rows_are_bit_identical_to_one_row_steps(hf_dir, monkeypatch, weights, dtype, fused):
    """`fused`: float32 models run every layer in one core call (lean.stack), else layer by layer."""
    model = _load(hf_dir, weights, dtype)
    monkeypatch.setattr(lean, "FUSE_LAYERS", fused)
    calls = spy_rows(monkeypatch, "decode_attention_qkv")
    model._lean.clear()
    kv = _caches(model, dtype)
    got = _chunk_step(model, kv)
    assert 7 in model._lean, "the chunk step did not take the lean step"
    stacked = lean.stack(model) is not None
    assert stacked == (fused and dtype == torch.float32)
    assert calls == ([] if stacked else [7] * model.config.num_layers)
    kv1 = _caches(model, dtype)
    want = _row_steps(model, kv1)
    assert torch.equal(got, want)
    for (k, v), (k1, v1) in zip(kv, kv1):
        assert torch.equal(k, k1) and torch.equal(v, v1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_chunk_step_equals_the_ordinary_forward(hf_dir, monkeypatch, dtype):
    """The tolerance of test_cpu_ops' lean-vs-ordinary test: the ordinary forward attends a chunk with SDPA."""
    model = load_model(hf_dir, dtype=dtype, device="cpu", attn_backend=CpuAttention()).model
    model._lean.clear()
    kv = _caches(model, dtype)
    got = _chunk_step(model, kv)
    assert 7 in model._lean
    monkeypatch.setattr(lean, "LEAN_MAX_TOKENS", 0)
    kv2 = _caches(model, dtype)
    want = _chunk_step(model, kv2)
    atol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    for (k, v), (k2, v2) in zip(kv, kv2):
        torch.testing.assert_close(k.float(), k2.float(), atol=atol, rtol=atol)
        torch.testing.assert_close(v.float(), v2.float(), atol=atol, rtol=atol)


def test_prefill_padding_and_shared_prefixes_keep_the_ordinary_forward(hf_dir):
    model = load_model(hf_dir, dtype=torch.float32, device="cpu", attn_backend=CpuAttention()).model
    backend = model.attn_backend
    prefill = AttentionMetadata.from_lengths(context_lens=np.array([0, 10]), query_lens=np.array([3, 1]),
                                             block_tables=TABLE, block_size=BS)
    assert backend.lean_plan(prefill, BS, 4) is None  # a chunk that starts its sequence
    padded = AttentionMetadata.from_lengths(context_lens=np.array([7]), query_lens=np.array([3]),
                                            block_tables=TABLE[:1], block_size=BS)
    padded.slot_mapping[2] = -1
    assert backend.lean_plan(padded, BS, 3) is None
    forks = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 8, 9, 10, 11]], np.int32)  # n > 1: one prompt
    shared = AttentionMetadata.from_lengths(context_lens=np.array([17, 17]), query_lens=np.array([3, 2]),
                                            block_tables=forks, block_size=BS)
    assert backend.lean_plan(shared, BS, 5) is None  # cascaded on the torch path, as decode_plan does
    chunks = AttentionMetadata.from_lengths(context_lens=np.array([7, 10]), query_lens=np.array([3, 2]),
                                            block_tables=TABLE, block_size=BS)
    plan = backend.lean_plan(chunks, BS, 5)
    assert plan is not None and plan.seq_lens.tolist() == [8, 9, 10, 11, 12]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    out = []
    for n in (6, 11, 17):
        chunk = [int(x) for x in rng.integers(6, 300, n)]
        out.append(chunk * 3 + chunk[: n // 2])  # a copy in progress: lookup proposes the rest of the chunk
    return out


@pytest.mark.parametrize(("weights", "dtype"), [("Q4_0", "float32"), ("int8", "bfloat16")])
def test_speculative_greedy_is_plain_greedy_on_quantized_weights(hf_dir, monkeypatch, weights, dtype):
    """Default mode (not batch-invariant): every verification step takes the lean step, and the tokens equal."""
    if weights == "Q4_0":
        path, quant = make_tiny_gguf(hf_dir.parent, hf_dir, weights), "auto"
    else:
        path, quant = hf_dir, weights
    steps: Counter[tuple[int, bool]] = Counter()
    real = lean.lean_forward

    def spy(model, input_ids, positions, kv_caches, meta, logits_indices):
        rows = real(model, input_ids, positions, kv_caches, meta, logits_indices)
        if int(meta.context_lens_cpu.min()) > 0:  # not a prefill step
            steps[(int(meta.max_query_len), rows is not None)] += 1
        return rows

    monkeypatch.setattr(lean, "lean_forward", spy)
    kw = {"num_kv_blocks": 256, "block_size": 4, "seed": 0, "dtype": dtype, "quantization": quant}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:  # one stream at a time: every step within LEAN_MAX_TOKENS rows
        return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                for p in _prompts()]

    want = run(LLM(str(path), **kw))
    steps.clear()
    spec = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                              "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                                              "cost_model": False}, **kw)
    got = run(spec)
    assert got == want
    # a random model rarely copies its prompt: 2-6 accepted per run, depending on the kernels' rounding
    assert spec.get_metrics()["spec_decode_num_accepted_tokens"] >= 1
    assert sum(n for (q, _), n in steps.items() if q > 1) >= 5, steps  # verification steps ran
    assert all(taken for _, taken in steps), steps  # and every one took the lean step


@pytest.mark.parametrize(("weights", "dtype"), [("Q4_0", torch.float32), ("int8", torch.bfloat16)])
def test_ordinary_forward_attends_verification_rows_in_the_kernel(hf_dir, monkeypatch, weights, dtype):
    """A verification step past the lean step's rows (many sequences speculating) takes the ordinary forward:
    its chunks' rows go to the paged kernel as decode rows at their positions (one call per layer that writes the
    step's K/V and attends), no per-sequence prefill attention, and each row equals the same row decoded alone."""
    from ironlm.attention import cpu_backend

    model = _load(hf_dir, weights, dtype)
    monkeypatch.setattr(lean, "LEAN_MAX_TOKENS", 0)
    sdpa: list[int] = []  # chunks attended as prefill (SDPA or the prefill GEMMs)
    real = cpu_backend._prefill

    def spy(q, k, v, k_cache, v_cache, s, *args, **kwargs):
        sdpa.append(s.end - s.start)
        return real(q, k, v, k_cache, v_cache, s, *args, **kwargs)

    monkeypatch.setattr(cpu_backend, "_prefill", spy)
    kv = _caches(model, dtype)
    got = _chunk_step(model, kv)
    assert sdpa == []
    kv1 = _caches(model, dtype)
    want = _row_steps(model, kv1)
    assert torch.equal(got, want)
    for (k, v), (k1, v1) in zip(kv, kv1):
        assert torch.equal(k, k1) and torch.equal(v, v1)
    # A chunk that starts its sequence, or one longer than ROW_CHUNK_MAX, stays a prefill chunk.
    n = cpu_backend.ROW_CHUNK_MAX + 1
    table = np.arange(2 * 16, dtype=np.int32).reshape(2, 16)
    meta = AttentionMetadata.from_lengths(context_lens=np.array([0, 3, 5]), query_lens=np.array([4, n, 2]),
                                          block_tables=np.concatenate([TABLE[:1, :], table[:, :8]]), block_size=BS)
    plan = model.attn_backend.decode_plan(meta, BS, 6 + n)
    assert [(s.start, s.end) for s in plan.prefill] == [(0, 4), (4, 4 + n)]
    assert plan.seq_lens.tolist() == [6, 7] and plan.rows.tolist() == [4 + n, 5 + n]
