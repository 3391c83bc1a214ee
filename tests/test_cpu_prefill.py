"""CPU prefill attention through GEMMs (attention/cpu_prefill.py) against the torch path it replaces: SDPA for
plain causal chunks, the explicit softmax for windows, soft-capped logits and sinks; and the CPU backend's
routing between the two."""

from __future__ import annotations

import itertools

import pytest
import torch

from ironlm import _core
from ironlm.attention import cpu_backend, cpu_prefill, get_backend
from ironlm.attention.torch_backend import _prefill_one, _PrefillSeq, eager_attention
from ironlm.core_views import as_numpy
from ironlm.exceptions import InvalidArgumentError
from test_attention_torch import make_case, reference, run_backend


def _dense(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, ctx: int, scale: float, window: int | None,
           softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """fp64 attention of q [n, Hq, D] at positions ctx.. over ks / vs [S, Hkv, D]."""
    n, hq, _ = q.shape
    seq_len, hkv = ks.shape[:2]
    keys, pos = torch.arange(seq_len)[None, :], torch.arange(n)[:, None] + ctx
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    kt, vt = (x.double().transpose(0, 1).repeat_interleave(hq // hkv, 0) for x in (ks, vs))
    sink = None if sinks is None else sinks.double().view(-1, 1, 1)
    return eager_attention(q.double().transpose(0, 1), kt, vt, mask, scale, softcap, sink).transpose(0, 1)


def _torch_path(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, ctx: int, scale: float, window: int | None,
                softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The same chunk through _prefill_one as the CPU backend called it before (bf16 SDPA in bf16), its keys
    in a paged cache of 8-token blocks (reversed block order) when there is a cached prefix."""
    n, _, d = q.shape
    seq_len, hkv = ks.shape[:2]
    nb = -(-seq_len // 8)
    k_cache = torch.zeros(nb, 8, hkv, d, dtype=ks.dtype)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.arange(nb - 1, -1, -1)
    k_cache.view(-1, hkv, d)[(blocks[:, None] * 8 + torch.arange(8)).reshape(-1)[:seq_len]] = ks
    v_cache.view(-1, hkv, d)[(blocks[:, None] * 8 + torch.arange(8)).reshape(-1)[:seq_len]] = vs
    mask = None
    if ctx or (window is not None and window < seq_len):
        keys, pos = torch.arange(seq_len)[None, :], torch.arange(n)[:, None] + ctx
        mask = keys <= pos
        if window is not None:
            mask &= keys > pos - window
    s = _PrefillSeq(0, n, seq_len, ctx, blocks, mask)
    return _prefill_one(q, ks[ctx:], vs[ctx:], k_cache, v_cache, s, scale, softcap, sinks, half=True)


def _inputs(n: int, ctx: int, hq: int, hkv: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, 64, generator=g).to(dtype)
    ks = (torch.randn(ctx + n, hkv, 64, generator=g) * 2).to(dtype)  # logits up to ~10: a peaked softmax
    vs = torch.randn(ctx + n, hkv, 64, generator=g).to(dtype)
    return q, ks, vs


SHAPES = list(itertools.product([2, 37, 130], [0, 21, 70], [(4, 4), (6, 2), (9, 3), (8, 1)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_sdpa_over_shapes_groups_and_prefixes(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """f32: the torch path's result to f32 rounding. bf16: no further from the fp64 truth than SDPA's own bf16
    kernel is (the two round P and the output alike; measured over SHAPES: at most 2.06x SDPA's error where that
    is a fraction of a bf16 step, max |new - SDPA| 0.0156 = one bf16 step at 2-4), and within bf16 rounding of
    SDPA's result."""
    monkeypatch.setattr(cpu_prefill, "TILE_ROWS", 16)  # several tiles per chunk, a tile cut inside a group row
    for i, (n, ctx, (hq, hkv)) in enumerate(SHAPES):
        q, ks, vs = _inputs(n, ctx, hq, hkv, dtype, i)
        got = cpu_prefill.attend(q, ks, vs, ctx, 0.125)
        old = _torch_path(q, ks, vs, ctx, 0.125, None, None, None)
        assert got.dtype == dtype and got.shape == q.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, old, atol=2e-6, rtol=2e-6)
            continue
        truth = _dense(q, ks, vs, ctx, 0.125, None, None, None)
        err_new, err_old = ((x.double() - truth).abs().max().item() for x in (got, old))
        assert err_new <= 2 * err_old + 1e-3, (n, ctx, hq, hkv, err_new, err_old)
        torch.testing.assert_close(got.double(), old.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap,sinks", [(16, None, False), (1, None, False), (None, 30.0, False),
                                                  (None, None, True), (40, 20.0, True)])
def test_window_softcap_and_sinks_match_the_torch_path(dtype: torch.dtype, window: int | None,
                                                       softcap: float | None, sinks: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_prefill, "TILE_ROWS", 16)
    for i, (n, ctx) in enumerate([(37, 0), (130, 21), (50, 70)]):
        q, ks, vs = _inputs(n, ctx, 9, 3, dtype, 100 + i)
        sk = torch.randn(9, generator=torch.Generator().manual_seed(i)) * 3 if sinks else None
        got = cpu_prefill.attend(q, ks, vs, ctx, 0.125, window, softcap, sk)
        truth = _dense(q, ks, vs, ctx, 0.125, window, softcap, sk)
        if window is not None:  # _prefill_one sees the window through the plan's mask
            old = _torch_path(q, ks, vs, ctx, 0.125, window, softcap, sk)
            tol = 2e-6 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.double(), old.double(), atol=tol, rtol=tol)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), truth, atol=tol, rtol=tol)


def test_score_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long context shrinks the tile: no tile's scores exceed SCORE_ELEMS (here a 4-position tile)."""
    monkeypatch.setattr(cpu_prefill, "SCORE_ELEMS", 9 * 300 * 4)
    seen: list[int] = []
    real = torch.bmm

    def bmm(a: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:
        if b.shape[-1] != 64:  # the Q·Kᵀ GEMM
            seen.append(a.shape[0] * a.shape[1] * b.shape[2])
        return real(a, b, **kw)

    q, ks, vs = _inputs(30, 270, 9, 3, torch.float32, 7)
    monkeypatch.setattr(cpu_prefill.torch, "bmm", bmm)
    got = cpu_prefill.attend(q, ks, vs, 270, 0.125)
    monkeypatch.undo()
    assert len(seen) == 8 and max(seen) <= 9 * 300 * 4
    torch.testing.assert_close(got.double(), _dense(q, ks, vs, 270, 0.125, None, None, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap,window", [(None, None), (30.0, None), (None, 4), (None, 16), (30.0, 64)])
def test_backend_routes_softcap_and_narrow_windows_here(softcap: float | None, window: int | None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with a 50-row chunk after a 19-token cached prefix (read through the paged cache), a fresh 40-row
    one and a decode row: plain causal chunks stay on SDPA, soft-capped ones come here, and windowed ones when
    their keys span WINDOW_SPAN windows (a 4-token window over 69 keys, not over 40; a 16-token one over
    neither); the result matches the torch backend (fp32 explicit softmax / SDPA) within bf16 rounding."""
    case = make_case([19, 0, 12], [50, 40, 1], hq=9, hkv=3, d=64, block_size=8, dtype=torch.bfloat16, seed=3)
    calls: list[int] = []
    real = cpu_prefill.attend

    def spy(q: torch.Tensor, *args, **kw) -> torch.Tensor:
        calls.append(q.shape[0])
        return real(q, *args, **kw)

    monkeypatch.setattr(cpu_backend, "attend", spy)
    args = (case[x] for x in ("q", "k", "v", "k_cache", "v_cache", "meta"))
    out = get_backend("cpu").forward(*args, case["scale"], window=window, softcap=softcap)
    assert cpu_prefill.WINDOW_SPAN == 16
    assert calls == ([50, 40] if softcap is not None else [50] if window == 4 else [])
    args = (case[x] for x in ("q", "k", "v", "k_cache", "v_cache", "meta"))
    want = get_backend("torch").forward(*args, case["scale"], window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), want.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_chunked_prefill_matches_dense_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt prefilled in chunks (each later chunk after the cached earlier ones) and a fresh one, in one
    step, through the CPU backend with every chunk routed here."""
    monkeypatch.setattr(cpu_backend, "serves", lambda *a: True)
    monkeypatch.setattr(cpu_prefill, "TILE_ROWS", 24)
    for ctx in ([0, 0], [40, 0], [80, 33]):
        case = make_case(ctx, [40, 57], hq=6, hkv=2, d=64, block_size=16, dtype=dtype, seed=sum(ctx))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(run_backend(case, "cpu").double(), reference(case), atol=tol, rtol=tol)


def _core_tiles(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape[0], q.shape[1], vs.shape[2], dtype=torch.bfloat16)
    _core.prefill_attention(as_numpy(q), as_numpy(ks), as_numpy(vs), ctx, scale, as_numpy(out), 2)
    return out


def test_core_kernel_matches_sdpa_over_shapes_groups_and_prefixes() -> None:
    """The core's bf16 prefill kernel (`_core.prefill_attention`; its AVX-512 BF16 tiles where this CPU has
    them, else its generic body) is no further from the fp64 truth than SDPA's own bf16 kernel (measured on a
    Zen 4 over SHAPES: 0.0031-0.0082, never above SDPA's; |new - SDPA| at most 0.0156, one bf16 step at 2-4)
    plus half a bf16 step at 1, and within bf16 rounding of SDPA's result; q, k and v are strided views into
    one fused row."""
    for i, (n, ctx, (hq, hkv)) in enumerate(SHAPES):
        q, ks, vs = _inputs(n, ctx, hq, hkv, torch.bfloat16, i)
        fused = torch.zeros(ctx + n, hq + 2 * hkv + 1, 64, dtype=torch.bfloat16)
        fused[ctx:, :hq], fused[:, hq : hq + hkv], fused[:, hq + hkv : -1] = q, ks, vs
        qv, kv, vv = fused[ctx:, :hq], fused[:, hq : hq + hkv], fused[:, hq + hkv : -1]
        got = _core_tiles(qv, kv, vv, ctx, 0.125)
        old = _torch_path(q, ks, vs, ctx, 0.125, None, None, None)
        truth = _dense(q, ks, vs, ctx, 0.125, None, None, None)
        err_new, err_old = ((x.double() - truth).abs().max().item() for x in (got, old))
        assert err_new <= err_old + 4e-3, (n, ctx, hq, hkv, err_new, err_old)
        torch.testing.assert_close(got.double(), old.double(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.double(), truth, atol=2e-2, rtol=2e-2)


def test_core_kernel_rejects_shapes_naming_the_argument() -> None:
    q, ks, vs = _inputs(8, 4, 6, 2, torch.bfloat16, 0)
    out = torch.empty(8, 6, 64, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError) as e:  # keys for a 5-token context, not 4
        _core.prefill_attention(as_numpy(q), as_numpy(ks), as_numpy(vs), 5, 0.125, as_numpy(out), 1)
    assert e.value.param == "k"
    with pytest.raises(InvalidArgumentError) as e:
        _core.prefill_attention(as_numpy(q), as_numpy(ks), as_numpy(vs), 4, 0.125, as_numpy(out[:7]), 1)
    assert e.value.param == "out"
    with pytest.raises(InvalidArgumentError) as e:  # float32 bits are not bf16
        _core.prefill_attention(q.float().numpy(), as_numpy(ks), as_numpy(vs), 4, 0.125, as_numpy(out), 1)
    assert e.value.param == "q"


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_core_kernel_takes_f32_rows_as_their_bf16_rounding(kv_dtype: str) -> None:
    """f32 q (and k, v) are rounded to bf16 as the kernel reads them and an f32 out holds the bf16 result: the bits
    of the bf16 call on the rounded rows (what the backend cast around the call before), on whatever path this
    CPU runs. The f32 rows are not bf16 values, so the rounding is exercised."""
    for n, ctx, (hq, hkv) in [(37, 0, (9, 3)), (130, 21, (6, 2)), (2, 70, (4, 4))]:
        q, ks, vs = _inputs(n, ctx, hq, hkv, torch.float32, n + ctx)
        kv = (ks, vs) if kv_dtype == "float32" else (ks.bfloat16(), vs.bfloat16())
        want = torch.empty(n, hq, 64, dtype=torch.bfloat16)
        _core.prefill_attention(as_numpy(q.bfloat16()), as_numpy(ks.bfloat16()), as_numpy(vs.bfloat16()), ctx, 0.125,
                                as_numpy(want), 2)
        got = torch.full((n, hq, 64), float("nan"))
        _core.prefill_attention(as_numpy(q), as_numpy(kv[0]), as_numpy(kv[1]), ctx, 0.125, as_numpy(got), 2,
                                dtype="float32", kv_dtype=kv_dtype)
        assert torch.equal(got, want.float())
    out = torch.empty(2, 4, 64)
    with pytest.raises(InvalidArgumentError) as e:
        _core.prefill_attention(as_numpy(q), as_numpy(ks), as_numpy(vs), 70, 0.125, as_numpy(out), 1, dtype="float16")
    assert e.value.param == "dtype"
    with pytest.raises(InvalidArgumentError) as e:
        _core.prefill_attention(as_numpy(q), as_numpy(ks), as_numpy(vs), 70, 0.125, as_numpy(out), 1, dtype="float32",
                                kv_dtype="int8")
    assert e.value.param == "kv_dtype"
    with pytest.raises(InvalidArgumentError) as e:  # bf16 bits where kv_dtype says float32
        _core.prefill_attention(as_numpy(q), as_numpy(ks.bfloat16()), as_numpy(vs.bfloat16()), 70, 0.125,
                                as_numpy(out), 1, dtype="float32", kv_dtype="float32")
    assert e.value.param == "k"


def test_backend_routes_plain_causal_bf16_chunks_to_the_core_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step of the routing test above, plain causal, bf16: both chunks (the one after a cached prefix read
    through the paged cache, and the fresh one) go to the core kernel where this CPU runs its tiles, and the
    result matches the torch backend within bf16 rounding; f32 chunks never do."""
    calls: list[tuple[int, int]] = []
    real = _core.prefill_attention

    def spy(q, k, v, ctx, *args) -> None:
        calls.append((q.shape[0], ctx))
        real(q, k, v, ctx, *args)

    monkeypatch.setattr(cpu_backend._core, "prefill_attention", spy)
    for dtype in (torch.bfloat16, torch.float32):
        case = make_case([19, 0, 12], [50, 40, 1], hq=9, hkv=3, d=64, block_size=8, dtype=dtype, seed=3)
        calls.clear()
        out = run_backend(case, "cpu")
        tiles = dtype == torch.bfloat16 and _core.prefill_attention_serves(64, 64)
        assert calls == ([(50, 19), (40, 0)] if tiles else [])
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.double(), reference(case), atol=tol, rtol=tol)
