"""The core's fused CPU kernels (RMSNorm, RoPE in place, SiLU-and-mul, paged decode attention over half caches)
against their torch references, and the CPU dtype default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ironlm import _core
from ironlm.model import cpu_has_fast_bf16, resolve_dtype
from ironlm.model.layers import CORE_DTYPES, CoreRope, apply_rotary, as_numpy, rms_norm, silu_and_mul
from test_attention_torch import make_case, run_backend

# f32: the kernels compute in f32 like torch, only the summation order differs. Half types: one rounding of the
# output (bf16 keeps 8 significant bits, fp16 11), where torch's op chains round after every op.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = list(CORE_DTYPES)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_torch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=g)).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    want = F.rms_norm(x.float(), (576,), w.float(), 1e-5)
    close(rms_norm(x, w, 1e-5), want, dtype)
    close(rms_norm(x, None, 1e-6), F.rms_norm(x.float(), (576,), None, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rope_in_place_matches_torch(dtype: torch.dtype, rows: int) -> None:
    """q and k heads of a fused q|k|v row rotated in place; the v columns are left as they were."""
    hq, hkv, d = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 100, (rows,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(128).float()[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
    cos, sin = table.index_select(0, positions).unsqueeze(1).float().chunk(2, dim=-1)
    qk = qkv[:, : (hq + hkv) * d].float().view(rows, hq + hkv, d)
    want = apply_rotary(qk, cos, sin).view(rows, -1)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    CoreRope(positions.numpy(), as_numpy(table), CORE_DTYPES[dtype]).apply_(qkv, hq + hkv, d)
    close(qkv[:, : (hq + hkv) * d], want, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)


def test_rope_rejects_positions_beyond_the_table() -> None:
    table = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="positions"):
        CoreRope(np.array([8]), table.numpy(), "float32").apply_(torch.zeros(1, 8), 2, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=g)).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(silu_and_mul(gate_up), F.silu(gate) * up, dtype)


def test_kernels_name_the_bad_argument() -> None:
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="out"):
        _core.rms_norm(x, None, 1e-5, np.zeros((2, 7), np.float32))
    with pytest.raises(ValueError, match="weight"):
        _core.rms_norm(x, np.ones(7, np.float32), 1e-5, np.zeros_like(x))
    with pytest.raises(ValueError, match="dtype"):
        _core.rms_norm(x, None, 1e-5, np.zeros_like(x), "float64")
    with pytest.raises(ValueError, match="x"):  # f32 data announced as bf16
        _core.rms_norm(x, None, 1e-5, np.zeros_like(x), "bfloat16")
    with pytest.raises(ValueError, match="gate_up"):
        _core.silu_and_mul(np.zeros((2, 7), np.float32), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="out"):  # read-only output
        _core.silu_and_mul(x, np.broadcast_to(np.zeros(4, np.float32), (2, 4)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_reads_half_caches(dtype: torch.dtype) -> None:
    """The fused kernel on bf16/fp16 caches (accumulating in f32) against the torch path on the same inputs."""
    ctx = [int(c) for c in np.random.default_rng(3).integers(1, 200, size=9)]
    case = make_case(ctx, [1] * len(ctx), hq=9, hkv=3, d=64, block_size=16, dtype=dtype, seed=4)
    got, want = run_backend(case, "cpu"), run_backend(case, "torch")
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_writes_new_rows_from_strided_views(dtype: torch.dtype) -> None:
    """k/v/q as views into a fused q|k|v row: the call writes k/v at their slots (skipping -1) and attends."""
    hq, hkv, d, bs = 4, 2, 16, 4
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.view(3, hq + 2 * hkv, d).split((hq, hkv, hkv), dim=1)
    kc = torch.randn(6, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(6, bs, hkv, d, generator=g).to(dtype)
    tables = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    lens = np.array([6, 1, 8], np.int32)
    slots = np.array([5, -1, 4 * bs + 3], np.int64)  # sequence 1's row is padding: not written
    kc_ref, vc_ref = kc.clone(), vc.clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            kc_ref.view(-1, hkv, d)[slot], vc_ref.view(-1, hkv, d)[slot] = k[row], v[row]
    out = torch.empty(q.shape, dtype=dtype)
    _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, lens, 0.25, as_numpy(out), 2,
                                 dtype=CORE_DTYPES[dtype], k=as_numpy(k), v=as_numpy(v), slot_mapping=slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    want = torch.empty(q.shape, dtype=torch.float32)
    for i, n in enumerate(lens):
        pos = np.arange(n)
        rows = tables[i, pos // bs] * bs + pos % bs
        ks = kc_ref.view(-1, hkv, d)[rows].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vs = vc_ref.view(-1, hkv, d)[rows].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        p = torch.softmax(q[i].float()[:, None, :] @ ks.transpose(1, 2) * 0.25, dim=-1)
        want[i] = (p @ vs)[:, 0]
    close(out, want, dtype)
    with pytest.raises(ValueError, match="slot_mapping"):
        _core.paged_decode_attention(as_numpy(q), as_numpy(kc), as_numpy(vc), tables, lens, 0.25, as_numpy(out),
                                     dtype=CORE_DTYPES[dtype], k=as_numpy(k), v=as_numpy(v))


def test_auto_dtype_follows_the_cpu() -> None:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        pass
    assert set(_core.cpu_features()) <= flags or not flags
    assert cpu_has_fast_bf16() == bool({"avx512_bf16", "amx_bf16"} & set(_core.cpu_features()))
    expected = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize(("arch", "dtype"), [("llama", torch.float32), ("qwen2", torch.float32),
                                             ("llama", torch.bfloat16)])
def test_lean_decode_step_matches_the_layer_by_layer_path(tmp_path, monkeypatch, arch: str,
                                                          dtype: torch.dtype) -> None:
    """Small CPU decode batches run through preallocated buffers and one core call per fused op; the logits
    equal the general path's (f32: same kernels and matmuls, only the attention's summation grouping differs)."""
    from ironlm.attention import AttentionMetadata
    from ironlm.model import lean as lean_mod
    from ironlm.model import load_model
    from tiny_models import make_tiny_model

    model = load_model(make_tiny_model(tmp_path, arch=arch), dtype=dtype, device="cpu").model
    cfg, bs = model.config, 4
    shape = (16, bs, cfg.num_kv_heads, cfg.head_dim)
    ctx = np.array([5, 9, 2])
    table = np.arange(15, dtype=np.int32).reshape(3, 5)

    def run(lean: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(lean_mod, "LEAN_MAX_TOKENS", 8 if lean else 0)
        gen = torch.Generator().manual_seed(0)
        caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
                  for _ in range(cfg.num_layers)]
        meta = AttentionMetadata.from_lengths(context_lens=ctx, query_lens=np.ones(3, np.int64), block_tables=table,
                                              block_size=bs)
        ids, pos = torch.tensor([3, 17, 42]), torch.from_numpy(ctx)
        return model(ids, pos, caches, meta, torch.tensor([2, 0])), [k for k, _ in caches]

    model._lean.clear()
    got, got_k = run(lean=True)
    assert 3 in model._lean, "the lean path was not taken"
    want, want_k = run(lean=False)
    atol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    for a, b in zip(got_k, want_k):  # the new K rows are written (rotated) at the same slots
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=atol)
