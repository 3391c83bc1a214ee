"""The core's small-batch dense kernels (`_core.dense_matmul`, the decode path of DenseLinear) against torch and an
exact reference, their row invariance, and where DenseLinear sends a call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ironlm import _core, invariant
from ironlm.core_views import CORE_DTYPES, as_numpy
from ironlm.exceptions import InvalidArgumentError
from ironlm.model import linear
from ironlm.model.layers import cpu_has_fast_bf16
from ironlm.model.linear import CORE_MAX_COLS, CORE_MAX_ROWS, DenseLinear

DTYPES = list(CORE_DTYPES)
ISAS = _core.dense_isas()[1]
# Half an ulp of the storage type, relative: the kernels round once, on the store.
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def weight(k: int, n: int, dtype: torch.dtype, layout: str, g: torch.Generator) -> torch.Tensor:
    """`[k, n]` as x @ W takes it: C-contiguous ("kn", ironlm's [in, out] parameters) or the transpose of a
    C-contiguous [n, k] ("nk", the LM head over the embedding table)."""
    if layout == "kn":
        return torch.randn(k, n, generator=g).to(dtype)
    return torch.randn(n, k, generator=g).to(dtype).t()


def run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
        bias: torch.Tensor | None = None, isa: str | None = None, threads: int = 2) -> torch.Tensor:
    b = None if bias is None else bias.float().numpy()
    _core.dense_matmul(as_numpy(x), as_numpy(w), as_numpy(out), accumulate, b, CORE_DTYPES[x.dtype], threads, isa)
    return out


def bound(x: torch.Tensor, w: torch.Tensor, extra: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The exact result (f64) and the error bound of an f32 accumulation of k exact products (bf16 and fp16
    products are exact in f32: 8 + 8 and 11 + 11 significant bits), each addition off by at most half an f32 ulp
    of the running magnitude (k + 2 of them with the bias and residual), then one rounding to `dtype`."""
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64 + extra
    mag = x64.abs() @ w64.abs() + extra.abs()
    k = x.shape[1]
    return exact, (k + 2) * 2.0**-24 * mag * (1 + HALF_ULP[dtype]) + HALF_ULP[dtype] * exact.abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("isa", ISAS)
def test_matches_torch_within_the_f32_accumulation_bound(dtype: torch.dtype, layout: str, isa: str) -> None:
    g = torch.Generator().manual_seed(3)
    k, n = 200, 100  # neither a multiple of 16 nor of 32: every tail path runs
    w = weight(k, n, dtype, layout, g)
    bias = torch.randn(n, generator=g)
    for m in range(1, 9):
        x = torch.randn(m, k, generator=g).to(dtype)
        resid = torch.randn(m, n, generator=g).to(dtype)
        got = run(x, w, resid.clone(), True, bias, isa)
        exact, tol = bound(x, w, bias.double() + resid.double(), dtype)
        assert ((got.double() - exact).abs() <= tol).all(), (m, (got.double() - exact).abs().max())
        plain = run(x, w, torch.empty(m, n, dtype=dtype), isa=isa)
        want = torch.mm(x, w)
        # torch rounds its own result too: the two differ by at most both bounds
        exact, tol = bound(x, w, torch.zeros(()), dtype)
        assert ((plain.double() - want.double()).abs() <= 2 * tol + HALF_ULP[dtype] * want.double().abs()).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_rows_are_invariant_to_the_batch(dtype: torch.dtype, layout: str) -> None:
    """A row's bits do not depend on how many rows share the call, nor on the thread count."""
    g = torch.Generator().manual_seed(5)
    k, n = 576, 330
    w = weight(k, n, dtype, layout, g)
    x = torch.randn(8, k, generator=g).to(dtype)
    for isa in ISAS:
        batch = run(x, w, torch.empty(8, n, dtype=dtype), isa=isa, threads=2)
        for r in range(8):
            alone = run(x[r:r + 1].clone(), w, torch.empty(1, n, dtype=dtype), isa=isa, threads=1)
            assert torch.equal(alone[0].view(torch.int16) if dtype != torch.float32 else alone[0],
                               batch[r].view(torch.int16) if dtype != torch.float32 else batch[r]), (isa, r)


def test_dense_linear_routes_small_batches_to_the_core() -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    lin = DenseLinear(w, bias)
    small = torch.randn(CORE_MAX_ROWS, 64, generator=g).bfloat16()
    want = run(small, w, torch.empty(CORE_MAX_ROWS, 96, dtype=torch.bfloat16), bias=bias, threads=1)
    assert torch.equal(lin(small).view(torch.int16), want.view(torch.int16))
    resid = torch.randn(CORE_MAX_ROWS, 96, generator=g).bfloat16()
    want = run(small, w, resid.clone(), True, bias, threads=1)
    assert torch.equal(lin(small, resid).view(torch.int16), want.view(torch.int16))
    out = torch.empty(CORE_MAX_ROWS, 96, dtype=torch.bfloat16)
    assert lin.accumulate(small, out.copy_(resid)) is out  # the core adds in place
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    big = torch.randn(CORE_MAX_ROWS + 1, 64, generator=g).bfloat16()
    f32 = DenseLinear(w.float(), bias.float())  # f32 beyond its packed rows: torch's GEMM (bf16: test below)
    beyond = torch.randn(linear.packed_f32_rows() + 1, 64, generator=g)
    assert torch.equal(f32(beyond), torch.addmm(bias.float(), beyond, w.float()))
    assert f32._packed is None
    wide = torch.randn(64, CORE_MAX_COLS + 1, generator=g).bfloat16()
    head = DenseLinear(wide)
    if _core.PackedBf16.available():  # bf16 on AVX-512 BF16: the pair-packed tiles at any width, the kernel's bits
        want = run(small, wide, torch.empty(CORE_MAX_ROWS, CORE_MAX_COLS + 1, dtype=torch.bfloat16), threads=1)
        assert torch.equal(head(small).view(torch.int16), want.view(torch.int16))
        assert head._pairs is not None and head._pairs[1] is not None
    else:  # torch's GEMM for wide outputs (the head)
        assert torch.equal(head(small), torch.mm(small, wide))
    with invariant.scope(True):  # batch-invariant mode: torch in fixed tiles at every size, the same bits per row
        inv = lin(big)
        assert torch.equal(inv[:1].view(torch.int16), lin(big[:1]).view(torch.int16))
        assert torch.equal(inv[:1].view(torch.int16), lin._tiled(big[:1], None).view(torch.int16))


@pytest.mark.skipif(not cpu_has_fast_bf16() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"),
                    reason="oneDNN's packed bf16 GEMM needs native bf16 and torch's mkldnn ops")
def test_bf16_batches_beyond_the_core_run_on_the_prepacked_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry point (call, call with residual, into, accumulate) of a bf16 batch over CORE_MAX_ROWS rows takes
    the core's pair-packed tiles (up to PACKED_MAX_ROWS, on AVX-512 BF16) or oneDNN's packed GEMM (beyond) and is
    within the f32-accumulation bound of the exact result, the residual rounded once with the product; past the
    PACK_MAX_BYTES budget a layer keeps torch's GEMM."""
    g = torch.Generator().manual_seed(11)
    k, n = 200, 96
    w = torch.randn(k, n, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    lin = DenseLinear(w, bias)
    for m in (CORE_MAX_ROWS + 1, 8, 64, 130):
        x = torch.randn(m, k, generator=g).bfloat16()
        resid = torch.randn(m, n, generator=g).bfloat16()
        outs = {"call": lin(x), "residual": lin(x, resid)}
        # oneDNN writes fresh tensors: into / accumulate may return them instead of the buffer
        outs.update(into=lin.into(x, torch.empty(m, n, dtype=torch.bfloat16)),
                    accumulate=lin.accumulate(x, resid.clone()))
        for name, got in outs.items():
            extra = bias.double() + (resid.double() if name in ("residual", "accumulate") else 0)
            exact, tol = bound(x, w, extra, torch.bfloat16)
            assert ((got.double() - exact).abs() <= tol).all(), (m, name, (got.double() - exact).abs().max())
    assert lin._packed is not None and lin._packed[1] is not None  # 130 rows went to oneDNN
    monkeypatch.setattr(linear, "PACK_MAX_BYTES", 0)  # both copies' budgets spent: torch's GEMM
    late = DenseLinear(w, bias)
    x = torch.randn(CORE_MAX_ROWS + 1, k, generator=g).bfloat16()
    assert torch.equal(late(x), torch.addmm(bias, x, w))
    assert late._packed is not None and late._packed[1] is None
    assert late._pairs is None or late._pairs[1] is None
    buf = torch.empty(CORE_MAX_ROWS + 1, n, dtype=torch.bfloat16)
    assert late.into(x, buf) is buf and torch.equal(buf, torch.addmm(bias, x, w))  # torch writes in place


@pytest.mark.skipif(not _core.PackedBf16.available(), reason="the pair-packed tiles need AVX-512 BF16")
def test_pair_packed_tiles_give_every_row_its_one_row_bits() -> None:
    """bf16 batches of CORE_MAX_ROWS + 1 to PACKED_MAX_ROWS rows run on `_core.PackedBf16`, whose sums are the
    one-row kernel's: each row of a 3- to 64-row call (plain, with residual, into, accumulate: the last two in the
    caller's buffer) has the bits that row gets alone, and `PackedBf16.matmul` equals `dense_matmul`'s avx512_bf16
    path on odd k and n off the 16-column groups, with bias and accumulate, on 1 and 3 threads."""
    g = torch.Generator().manual_seed(5)
    k, n = 131, 75
    w = torch.randn(k, n, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    lin = DenseLinear(w, bias)
    for m in (CORE_MAX_ROWS + 1, 9, 40, linear.PACKED_MAX_ROWS):
        x = torch.randn(m, k, generator=g).bfloat16()
        resid = torch.randn(m, n, generator=g).bfloat16()
        got = {"call": lin(x), "residual": lin(x, resid)}
        buf, acc = torch.empty(m, n, dtype=torch.bfloat16), resid.clone()
        assert lin.into(x, buf) is buf and lin.accumulate(x, acc) is acc
        got.update(into=buf, accumulate=acc)
        for i in range(m):
            alone = {"call": lin(x[i:i + 1]), "residual": lin(x[i:i + 1], resid[i:i + 1])}
            alone.update(into=alone["call"], accumulate=alone["residual"])
            for name, rows in got.items():
                assert torch.equal(rows[i].view(torch.int16), alone[name][0].view(torch.int16)), (m, i, name)
        assert lin._pairs is not None and lin._pairs[1] is not None
    packed = _core.PackedBf16(as_numpy(w))
    assert (packed.k, packed.n) == (k, n) and packed.nbytes == 66 * 80 * 2 * 2
    for m, accumulate, threads in ((5, False, 1), (17, True, 3)):
        x = torch.randn(m, k, generator=g).bfloat16()
        start = torch.randn(m, n, generator=g).bfloat16()
        want = run(x, w, start.clone(), accumulate, bias, isa="avx512_bf16", threads=1)
        out = start.clone()
        packed.matmul(as_numpy(x), as_numpy(out), accumulate, bias.float().numpy(), threads)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    x16, out16 = np.zeros((2, k), np.int16), np.zeros((2, n), np.int16)
    with pytest.raises(InvalidArgumentError, match="^x") as e:
        packed.matmul(np.zeros((2, k - 1), np.int16), out16)
    assert e.value.param == "x"
    with pytest.raises(ValueError, match="^out"):
        packed.matmul(x16, np.zeros((2, n + 1), np.int16))
    with pytest.raises(ValueError, match="^bias"):
        packed.matmul(x16, out16, bias=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="^weight"):
        _core.PackedBf16(as_numpy(w.t()))  # not C-contiguous [in, out]


@pytest.mark.skipif(not _core.PackedF32.available(), reason="the packed f32 tiles need AVX2 and FMA")
@pytest.mark.parametrize("limit", [CORE_MAX_ROWS, linear.PACKED_F32_MAX_ROWS])
def test_f32_rows_up_to_the_limit_run_on_the_packed_copy_with_the_kernel_bits(
        limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """f32 calls of 1 to `packed_f32_rows()` rows (CORE_MAX_ROWS on AVX-512 CPUs, PACKED_F32_MAX_ROWS on AVX2 ones: both
    limits here) run on `_core.PackedF32` (narrow layers and the wide LM head alike), with the bits of
    `dense_matmul`'s f32 path (call, residual, into, accumulate; every row its one-row bits); a row more keeps
    torch's GEMM."""
    monkeypatch.setattr(linear, "packed_f32_rows", lambda: limit)
    g = torch.Generator().manual_seed(9)
    for k, n in ((131, 75), (64, CORE_MAX_COLS + 1)):
        w = torch.randn(k, n, generator=g)
        bias = torch.randn(n, generator=g)
        lin = DenseLinear(w, bias)
        for m in sorted({1, CORE_MAX_ROWS, 7, limit} - set(range(limit + 1, 8))):
            x = torch.randn(m, k, generator=g)
            resid = torch.randn(m, n, generator=g)
            want = run(x, w, torch.empty(m, n), bias=bias, threads=1)
            want_res = run(x, w, resid.clone(), True, bias, threads=1)
            assert torch.equal(lin(x), want) and torch.equal(lin(x, resid), want_res)
            buf, acc = torch.empty(m, n), resid.clone()
            assert lin.into(x, buf) is buf and torch.equal(buf, want)
            assert lin.accumulate(x, acc) is acc and torch.equal(acc, want_res)
            assert torch.equal(want[-1:], run(x[-1:], w, torch.empty(1, n), bias=bias, threads=1))
        assert lin._pairs is not None and isinstance(lin._pairs[1], _core.PackedF32)
        past = torch.randn(limit + 1, k, generator=g)
        assert torch.equal(lin(past), torch.addmm(bias, past, w))
    packed = _core.PackedF32(w.numpy())
    assert (packed.k, packed.n, packed.nbytes) == (64, CORE_MAX_COLS + 1, 64 * 4112 * 4)
    with pytest.raises(InvalidArgumentError, match="^out") as e:
        packed.matmul(np.zeros((1, 64), np.float32), np.zeros((1, 3), np.float32))
    assert e.value.param == "out"
    with pytest.raises(ValueError, match="^x"):
        packed.matmul(np.zeros((1, 63), np.float32), np.zeros((1, CORE_MAX_COLS + 1), np.float32))


def test_bad_arguments_name_the_parameter() -> None:
    x, out = np.zeros((2, 8), np.float32), np.zeros((2, 4), np.float32)
    w = np.zeros((8, 4), np.float32)
    with pytest.raises(InvalidArgumentError, match="^weight") as e:
        _core.dense_matmul(x, np.zeros((8, 8), np.float32)[:, ::2], out)
    assert e.value.param == "weight"
    with pytest.raises(ValueError, match="^out"):
        _core.dense_matmul(x, w, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="^x"):
        _core.dense_matmul(np.zeros((2, 7), np.float32), w, out)
    with pytest.raises(ValueError, match="^bias"):
        _core.dense_matmul(x, w, out, bias=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="^isa"):
        _core.dense_matmul(x, w, out, isa="sse9")
    with pytest.raises(ValueError, match="^x"):  # a bf16 call needs the bits as int16
        _core.dense_matmul(x, w, out, dtype="bfloat16")
