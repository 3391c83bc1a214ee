"""ironlm's decoder vs transformers on tiny random HF models of every supported architecture.

Each case runs mixed-length sequences as ONE flat token batch through a paged KV cache with shuffled block
tables: a prefill step (logits for every row), a mixed step (chunked-prefill extends with cached context + decode
rows, logits for a subset of rows), and a pure decode step (last rows only), and compares every logit row with
transformers' log-softmax over the full sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ironlm.model import load_model
from tiny_models import TINY_VARIANTS, PagedSequences, load_hf_reference, make_kv_caches, make_tiny_model

TOL = 1e-4  # fp32, on log-softmax


def _hf_logprobs(hf, seqs: list[list[int]]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for s in seqs:
            out.append(torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), dim=-1))
    return out


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max())


def _run_and_compare(lm, hf, block_size: int, seed: int = 0, diff=max_abs_diff) -> float:
    """Three steps over 4 sequences; returns the worst `diff(log-softmax, reference log-softmax)` of a row
    (default: the largest |difference| of any vocab entry)."""
    cfg = lm.config
    rng = np.random.default_rng(seed)
    # prefill lengths (1, non-multiples of the block size, > several blocks), then chunk sizes
    prefill = [1, 5, 17, 2 * block_size + 3]
    extend = [3, 1, 6, 1]  # seqs 0 and 2 extend by a chunk, 1 and 3 decode
    total = [p + e + 1 for p, e in zip(prefill, extend)]
    seqs = [rng.integers(6, cfg.vocab_size, size=n).tolist() for n in total]
    ref = _hf_logprobs(hf, seqs)

    max_len = max(total)
    num_blocks = 4 * (max_len // block_size + 2) + 1
    pager = PagedSequences(len(seqs), block_size, num_blocks, max_len // block_size + 2, seed=seed)
    kv = make_kv_caches(cfg, num_blocks, block_size)
    worst = 0.0

    def check(chunks: dict[int, tuple[int, int]], rows: str) -> None:
        nonlocal worst
        inp, pos, meta, last = pager.step({i: seqs[i][a:b] for i, (a, b) in chunks.items()})
        if rows == "all":
            idx = torch.arange(inp.shape[0])
        elif rows == "last":
            idx = last
        else:  # a subset in scrambled order, with the first row of every chunk and every last row
            firsts = torch.cat([torch.zeros(1, dtype=torch.long), last[:-1] + 1])
            sel = torch.unique(torch.cat([firsts, last]))
            idx = sel[torch.from_numpy(rng.permutation(len(sel)))]
        logits = lm.model(inp, pos, kv, meta, idx)
        assert logits.dtype == torch.float32 and logits.shape == (len(idx), cfg.vocab_size)
        got = torch.log_softmax(logits, dim=-1)
        owner = np.repeat(np.arange(len(chunks)), [b - a for a, b in chunks.values()])
        keys = list(chunks)
        for r, row in enumerate(idx.tolist()):
            seq = keys[owner[row]]
            want = ref[seq][int(pos[row])]
            worst = max(worst, diff(got[r], want))

    check({i: (0, p) for i, p in enumerate(prefill)}, "all")
    check({i: (p, p + e) for i, (p, e) in enumerate(zip(prefill, extend))}, "subset")
    check({i: (n - 1, n) for i, n in enumerate(total)}, "last")
    return worst


CASES = [
    ("llama", 4),
    ("llama3_tied_hd128_sharded", 16),
    ("mistral_mqa", 4),
    ("qwen2_bias_tied", 16),
    ("qwen3_hd128", 4),
]


@pytest.mark.parametrize("variant,block_size", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(tmp_path, variant, block_size):
    spec = dict(TINY_VARIANTS[variant])
    arch = spec.pop("arch")
    path = make_tiny_model(tmp_path, arch, **spec)
    lm = load_model(path, dtype=torch.float32, device="cpu")
    hf = load_hf_reference(path)
    cfg = lm.config
    assert cfg.architecture == arch
    assert cfg.num_heads // cfg.num_kv_heads > 1  # GQA in every case
    assert cfg.tie_word_embeddings == bool(spec.get("tie_word_embeddings", False))
    if cfg.tie_word_embeddings:
        assert lm.model.lm_head is lm.model.embed  # one tensor, not a copy
    worst = _run_and_compare(lm, hf, block_size)
    assert worst < TOL, f"{variant}: max |log-softmax diff| {worst:.3g}"


def test_variants_cover_required_features():
    """The cases above include head_dim 64 and 128, tied and untied, llama3 rope, sharded files, each arch."""
    from tiny_models import tiny_hf_config

    head_dims, ties, archs = set(), set(), set()
    for name, _ in CASES:
        spec = dict(TINY_VARIANTS[name])
        arch = spec.pop("arch")
        spec.pop("max_shard_size", None)
        cfg = tiny_hf_config(arch, **spec)
        head_dims.add(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        ties.add(cfg.tie_word_embeddings)
        archs.add(arch)
    assert head_dims >= {64, 128} and ties == {True, False}
    assert archs == {"llama", "mistral", "qwen2", "qwen3"}
    assert any("max_shard_size" in TINY_VARIANTS[n] for n, _ in CASES)
    assert any((TINY_VARIANTS[n].get("rope_parameters") or {}).get("rope_type") == "llama3" for n, _ in CASES)


def test_sharded_folder_is_sharded(tmp_path):
    spec = dict(TINY_VARIANTS["llama3_tied_hd128_sharded"])
    arch = spec.pop("arch")
    spec["num_hidden_layers"] = 1
    path = make_tiny_model(tmp_path, arch, **spec)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1


def test_linear_rope_scaling_and_bf16(tmp_path):
    """Linear rope scaling matches transformers; a bf16 load runs and stays close to fp32."""
    path = make_tiny_model(
        tmp_path, "llama", num_hidden_layers=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    )
    lm = load_model(path, dtype=torch.float32, device="cpu")
    hf = load_hf_reference(path)
    assert _run_and_compare(lm, hf, 4, seed=3) < TOL

    lm16 = load_model(path, dtype=torch.bfloat16, device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in lm16.model.parameters())
    seq = list(range(10, 40))
    pager = PagedSequences(1, 16, 8, 4)
    kv = make_kv_caches(lm16.config, 8, 16, dtype=torch.bfloat16)
    inp, pos, meta, _ = pager.step({0: seq})
    got = torch.log_softmax(lm16.model(inp, pos, kv, meta, torch.arange(len(seq))), -1)
    want = _hf_logprobs(hf, [seq])[0]
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.15
