"""The torch and cpu attention backends against a dense per-sequence reference that never touches the paged
cache."""

from __future__ import annotations

import sys
import zlib

import numpy as np
import pytest
import torch

from ironlm.attention import AttentionMetadata, get_backend


def make_case(
    ctx_lens: list[int],
    q_lens: list[int],
    *,
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    pad_rows: int = 0,
    block_seed: int | None = None,
) -> dict:
    """Random K/V histories, a shuffled block pool with the cached prefixes already written, new rows."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed if block_seed is None else block_seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    nbs = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nbs) + 3
    perm = rng.permutation(num_blocks)  # shuffled: logical order never matches physical order
    bt = np.zeros((len(seq_lens), max(nbs) + 1), dtype=np.int32)  # an extra padding column (0s)
    used = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = perm[used : used + nb]
        used += nb
    hist_k = [torch.randn(s, hkv, d, generator=g).to(dtype) for s in seq_lens]
    hist_v = [torch.randn(s, hkv, d, generator=g).to(dtype) for s in seq_lens]
    # Garbage in unused slots makes a missing padding mask visible.
    k_cache = (torch.randn(num_blocks, block_size, hkv, d, generator=g) * 50).to(dtype)
    v_cache = (torch.randn(num_blocks, block_size, hkv, d, generator=g) * 50).to(dtype)
    for i, c in enumerate(ctx_lens):
        for p in range(c):
            k_cache[bt[i, p // block_size], p % block_size] = hist_k[i][p]
            v_cache[bt[i, p // block_size], p % block_size] = hist_v[i][p]
    meta = AttentionMetadata.from_lengths(
        context_lens=np.array(ctx_lens), query_lens=np.array(q_lens), block_tables=bt, block_size=block_size
    )
    t = sum(q_lens)
    q = torch.randn(t + pad_rows, hq, d, generator=g).to(dtype)
    k = torch.cat([h[c:] for h, c in zip(hist_k, ctx_lens)] + [torch.zeros(pad_rows, hkv, d, dtype=dtype)])
    v = torch.cat([h[c:] for h, c in zip(hist_v, ctx_lens)] + [torch.zeros(pad_rows, hkv, d, dtype=dtype)])
    if pad_rows:
        meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad_rows,), -1, dtype=torch.int64)])
    return {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "meta": meta, "hist_k": hist_k,
            "hist_v": hist_v, "ctx_lens": ctx_lens, "q_lens": q_lens, "block_tables": bt, "scale": d**-0.5}


def reference(case: dict) -> torch.Tensor:
    """Dense fp64 attention over each sequence's own history, causal with the context offset."""
    q = case["q"].double()
    hq = q.shape[1]
    out = torch.zeros_like(q)
    start = 0
    for hk, hv, c, n in zip(case["hist_k"], case["hist_v"], case["ctx_lens"], case["q_lens"]):
        grp = hq // hk.shape[1]
        kk = hk.double().repeat_interleave(grp, dim=1)  # [S, Hq, D]
        vv = hv.double().repeat_interleave(grp, dim=1)
        for j in range(n):
            visible = c + j + 1
            s = torch.einsum("hd,shd->hs", q[start + j], kk[:visible]) * case["scale"]
            out[start + j] = torch.einsum("hs,shd->hd", torch.softmax(s, -1), vv[:visible])
        start += n
    return out


def check_cache(case: dict, block_size: int) -> None:
    for i, (hk, hv) in enumerate(zip(case["hist_k"], case["hist_v"])):
        for p in range(hk.shape[0]):
            b = case["block_tables"][i, p // block_size]
            assert torch.equal(case["k_cache"][b, p % block_size], hk[p])
            assert torch.equal(case["v_cache"][b, p % block_size], hv[p])


def run_backend(case: dict, backend_name: str = "torch") -> torch.Tensor:
    backend = get_backend(backend_name)
    return backend.forward(case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["meta"],
                           case["scale"])


CASES = {
    "decode_only": ([0, 5, 16, 17, 40], [1, 1, 1, 1, 1]),
    "prefill_only": ([0, 0, 0], [1, 7, 33]),
    "extend_with_prefix": ([16, 3, 21], [5, 16, 2]),
    "mixed": ([12, 0, 31, 4, 0, 47], [1, 9, 1, 6, 1, 1]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (6, 2, 64), (8, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_backend_matches_dense_reference(
    backend: str, name: str, hq: int, hkv: int, d: int, dtype: torch.dtype
) -> None:
    ctx, ql = CASES[name]
    bs = 16 if d == 128 else 8
    seed = zlib.crc32(f"{name}/{hq}/{d}".encode()) % 1000  # not hash(): str hashes change per process
    case = make_case(ctx, ql, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype, seed=seed)
    out = run_backend(case, backend)
    assert out.shape == case["q"].shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference(case), atol=tol, rtol=tol)
    check_cache(case, bs)


def test_cpu_backend_attends_bf16_prefill_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the core's bf16 prefill kernel (a CPU without AVX-512 BF16; test_cpu_prefill.py covers the
    kernel) the CPU backend's prefill chunks go to SDPA in bf16 (torch's CPU flash kernel accumulates in fp32
    itself; fp32 copies cost it 2.5-3x at 256-1024 tokens), the torch backend, the kernels' reference, on fp32
    copies; both within the bf16 tolerance of the dense reference."""
    import torch.nn.functional as F

    from ironlm.attention import cpu_backend

    monkeypatch.setattr(cpu_backend._core, "prefill_attention_serves", lambda d, dv: False)
    case = make_case([0, 0], [40, 17], hq=6, hkv=2, d=64, block_size=8, dtype=torch.bfloat16, seed=5)
    out = run_backend(case, "cpu")
    start = 0
    for n in case["q_lens"]:
        q, k, v = (case[x][start : start + n].transpose(0, 1) for x in ("q", "k", "v"))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case["scale"], enable_gqa=True)
        assert torch.equal(out[start : start + n], want.transpose(0, 1))
        start += n
    ref = run_backend(case, "torch")
    assert not torch.equal(out, ref)  # the reference's fp32 path rounds differently
    for got in (out, ref):
        torch.testing.assert_close(got.double(), reference(case), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_padding_rows_are_skipped_and_zero(backend: str) -> None:
    case = make_case([3, 9], [1, 1], hq=4, hkv=2, d=64, block_size=4, dtype=torch.float32, seed=1, pad_rows=3)
    before = case["k_cache"].clone()
    out = run_backend(case, backend)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    torch.testing.assert_close(out[:2].double(), reference(case)[:2], atol=1e-5, rtol=1e-5)
    # Only the two real slots changed: -1 must not wrap around to the last slot.
    changed = (case["k_cache"] != before).any(dim=(2, 3)).nonzero().tolist()
    assert len(changed) == 2


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_plan_is_reused_across_layers(name: str) -> None:
    case = make_case([4, 0, 9], [1, 5, 1], hq=4, hkv=2, d=64, block_size=4, dtype=torch.float32, seed=2)
    meta = case["meta"]
    backend = get_backend(name)
    outs = []
    for _ in range(2):  # two "layers" with different caches and inputs share one metadata object
        c2 = make_case([4, 0, 9], [1, 5, 1], hq=4, hkv=2, d=64, block_size=4, dtype=torch.float32,
                       seed=len(outs) + 10, block_seed=2)
        c2["meta"] = meta
        outs.append((backend.forward(c2["q"], c2["k"], c2["v"], c2["k_cache"], c2["v_cache"], meta,
                                     c2["scale"]), reference(c2)))
    assert name in meta.plan_cache
    for out, ref in outs:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_metadata_fields() -> None:
    meta = AttentionMetadata.from_lengths(context_lens=np.array([0, 5]), query_lens=np.array([3, 1]),
                                          block_tables=np.array([[2, 0], [1, 3]]), block_size=4)
    assert meta.slot_mapping.tolist() == [8, 9, 10, 4 * 3 + 1]
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [3, 6] and meta.context_lens.tolist() == [0, 5]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len) == (3, 6)
    assert not meta.decode_only
    dec = AttentionMetadata.from_lengths(context_lens=np.array([2, 7]), query_lens=np.array([1, 1]),
                                         block_tables=np.array([[0, 0], [1, 2]]), block_size=4)
    assert dec.decode_only


def test_get_backend_selection() -> None:
    assert get_backend("auto", "cpu").name == "cpu"
    assert get_backend().name == "cpu"
    assert get_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra_decode_seq_shares", [True, False])
def test_decode_with_a_shared_prefix_cascades_and_matches(dtype: torch.dtype, extra_decode_seq_shares: bool) -> None:
    """Decode rows whose block tables start with the same blocks (one system prompt, n > 1 forks) take the
    cascade path: shared blocks attended once for all queries, merged with each tail by log-sum-exp."""
    from ironlm.attention import torch_backend

    bs, shared = 4, torch_backend.MIN_SHARED_BLOCKS + 1
    ctx = [shared * bs + t for t in (0, 3, 4, 9, 17)]
    case = make_case(ctx, [1] * len(ctx), hq=6, hkv=2, d=64, block_size=bs, dtype=dtype, seed=11)
    bt = case["block_tables"]
    if extra_decode_seq_shares:
        # Every sequence now points its first `shared` blocks at sequence 0's, holding sequence 0's history.
        for i in range(1, len(ctx)):
            bt[i, :shared] = bt[0, :shared]
            for name in ("hist_k", "hist_v"):
                case[name][i][: shared * bs] = case[name][0][: shared * bs]
        case["meta"] = AttentionMetadata.from_lengths(context_lens=np.array(ctx), query_lens=np.ones(len(ctx), int),
                                                      block_tables=bt, block_size=bs)
    plan = torch_backend._make_plan(case["meta"], bs, torch.device("cpu"))
    assert (plan.shared is not None) == extra_decode_seq_shares
    if plan.shared is not None:
        assert plan.shared.blocks.tolist() == bt[0, :shared].tolist()
    out = run_backend(case)
    torch.testing.assert_close(out.double(), reference(case), atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_cpu_decode_kernel_matches_torch_on_long_shuffled_contexts() -> None:
    """Many decode sequences of uneven length (thread split by length), MQA and GQA, against the torch path."""
    ctx = [int(c) for c in np.random.default_rng(5).integers(1, 300, size=23)]
    for hq, hkv in [(9, 3), (8, 1)]:
        case = make_case(ctx, [1] * len(ctx), hq=hq, hkv=hkv, d=64, block_size=16, dtype=torch.float32, seed=hq)
        cpu = run_backend(case, "cpu")
        ref = run_backend(case, "torch")
        torch.testing.assert_close(cpu, ref, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_threads_run_on_torchs_openmp_pool() -> None:
    """Own threads would be time-sliced against torch's spinning OpenMP workers (no faster than one thread)."""
    from ironlm import _core

    if "OpenMP" not in torch.__config__.parallel_info() or not sys.platform.startswith("linux"):
        pytest.skip("torch is not built on OpenMP here")
    assert _core.parallel_runtime() == "openmp"


def test_cpu_decode_kernel_rejects_bad_arguments() -> None:
    from ironlm import _core

    q = np.zeros((2, 4, 8), np.float32)
    cache = np.zeros((3, 4, 2, 8), np.float32)
    tables = np.array([[0, 1], [2, 0]], np.int32)
    out = np.empty_like(q)
    _core.paged_decode_attention(q, cache, cache, tables, np.array([5, 1], np.int32), 0.5, out)
    assert np.allclose(out, 0.0)  # all-zero V: any softmax weights give zeros
    bad = [
        ({"seq_lens": np.array([9, 1], np.int32)}, "seq_lens"),  # beyond 2 blocks of 4
        ({"seq_lens": np.array([0, 1], np.int32)}, "seq_lens"),
        ({"block_tables": np.array([[0, 3], [2, 0]], np.int32)}, "block_tables"),  # block 3 of 3
        ({"q": np.zeros((2, 3, 8), np.float32)}, "q"),  # 3 query heads over 2 KV heads
        ({"out": np.empty((2, 4, 4), np.float32)}, "out"),
        ({"v_cache": np.zeros((3, 4, 2, 4), np.float32)}, "v_cache"),
        ({"q": np.zeros((2, 4, 16), np.float32)[:, :, ::2]}, "q: must be C-contiguous"),
    ]
    for change, field in bad:
        args = {"q": q, "k_cache": cache, "v_cache": cache, "block_tables": tables,
                "seq_lens": np.array([5, 1], np.int32), "scale": 0.5, "out": out, **change}
        with pytest.raises(ValueError, match=field):
            _core.paged_decode_attention(**args)


def test_cpu_backend_hands_shared_prefix_steps_to_cascade_attention() -> None:
    """Every decode sequence starting with the same 5 blocks: the cpu backend takes the torch path's cascade
    (shared blocks attended once for all sequences) and the result is the same attention."""
    g = torch.Generator().manual_seed(3)
    bs, hq, hkv, d = 4, 6, 2, 32
    seq_lens = np.array([23, 26, 31])
    shared = np.arange(5)
    tails = [np.array([5, 6]), np.array([7, 8]), np.array([9, 10, 11])]
    bt = np.zeros((3, 8), np.int32)
    for i, t in enumerate(tails):
        bt[i, : 5 + len(t)] = np.concatenate([shared, t])
    k_cache = torch.randn(12, bs, hkv, d, generator=g)
    v_cache = torch.randn(12, bs, hkv, d, generator=g)
    meta = AttentionMetadata.from_lengths(context_lens=seq_lens - 1, query_lens=np.ones(3, np.int64),
                                          block_tables=bt, block_size=bs)
    q = torch.randn(3, hq, d, generator=g)
    k = torch.randn(3, hkv, d, generator=g)
    v = torch.randn(3, hkv, d, generator=g)
    ref = get_backend("torch").forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, d**-0.5)
    meta.plan_cache.clear()
    out = get_backend("cpu").forward(q, k, v, k_cache, v_cache, meta, d**-0.5)
    assert meta.plan_cache["cpu"] is None and meta.plan_cache["torch"].shared is not None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
