"""ironlm._core.QuantMatrix: GGUF blocks against the gguf package's dequantizer, matmul on torch views."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from ironlm._core import QuantMatrix, quant_isas, quant_prefetch

# (type, weights per block, bytes per block, offsets of the f16 scales in a block)
FORMATS = [
    (Q.Q4_0, 32, 18, [0]),
    (Q.Q4_1, 32, 20, [0, 2]),
    (Q.Q8_0, 32, 34, [0]),
    (Q.Q4_K, 256, 144, [0, 2]),
    (Q.Q5_K, 256, 176, [0, 2]),
    (Q.Q6_K, 256, 210, [208]),
]


def random_raw(rng: np.random.Generator, per: int, nbytes: int, halves: list[int], n: int) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n // per, nbytes), dtype=np.uint8)
    for o in halves:
        # Finite halves of magnitude 2^-10 .. 2^2, like real block scales.
        bits = (rng.integers(0, 2, len(blocks)) << 15) | (rng.integers(5, 17, len(blocks)) << 10)
        bits |= rng.integers(0, 1024, len(blocks))
        blocks[:, o : o + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize(("ggml_type", "per", "nbytes", "halves"), FORMATS, ids=[f[0].name for f in FORMATS])
def test_ggml_blocks_match_gguf_dequantize(ggml_type: Q, per: int, nbytes: int, halves: list[int]) -> None:
    rows, cols = 21, 512
    raw = random_raw(np.random.default_rng(int(ggml_type)), per, nbytes, halves, rows * cols)
    m = QuantMatrix.from_ggml(raw, int(ggml_type), rows, cols)
    want = quants.dequantize(raw.reshape(rows, -1), ggml_type).astype(np.float64)
    got = m.dequantize().astype(np.float64)
    assert got.shape == (rows, cols)
    err = np.abs(got - want)
    # Exact up to the f32 rounding of scale * q + min (Q6_K: of (d * sc) * (q - 32), its own blocks kept).
    assert (err <= 2.5e-7 * np.abs(want).reshape(rows, -1, 32).max(axis=2).repeat(32, axis=1)).all()
    kinds = {Q.Q8_0: "q8", Q.Q5_K: "q8", Q.Q6_K: "q6k"}
    assert m.kind == kinds.get(ggml_type, "q4")


def test_default_model_tensors_stay_exact() -> None:
    from ironlm.model import default_model_path
    from ironlm.model.gguf import GGUFFile, dequantize

    gf = GGUFFile(default_model_path())
    try:
        for name in ["token_embd.weight", "blk.0.ffn_down.weight", "blk.3.attn_q.weight"]:
            info = gf.tensors[name]
            rows, cols = info.shape
            m = QuantMatrix.from_ggml(gf.raw(info), info.ggml_type, rows, cols)
            want = dequantize(gf.raw(info), info.ggml_type, info.shape).numpy()
            np.testing.assert_allclose(m.dequantize(), want, rtol=2.5e-7, atol=1e-30)
            # Packed: 4 or 8 bits a weight plus the f16 scale per 32 (exact f16s in these files), and the f16 min
            # unless it is implied (Q4_0's -8 d, Q8_0's -128 d).
            half_bits = {Q.Q4_0: 9, Q.Q4_1: 10, Q.Q8_0: 17}[Q(info.ggml_type)]
            assert m.nbytes == rows * cols * half_bits // 16
    finally:
        gf.close()


def bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The activation-rounding bound ``sum_b amax(x_b) / 254 * sum_b |w|`` of every output, plus f32 slack."""
    m, k = x.shape
    amax = np.abs(x.astype(np.float64)).reshape(m, k // 32, 32).max(axis=2)
    wsum = np.abs(w.astype(np.float64)).reshape(w.shape[0], k // 32, 32).sum(axis=2)
    return amax @ wsum.T / 254 * 1.001 + 1e-5 * (np.abs(x) @ np.abs(w).T + 1)


@pytest.mark.parametrize("isa", quant_isas()[1])
@pytest.mark.parametrize(("bits", "group"), [(8, 0), (8, 128), (4, 32), (4, 64)])
def test_matmul_on_torch_views(isa: str, bits: int, group: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + group)
    w = torch.randn(200, 256, generator=g)
    q = QuantMatrix.from_float(w.numpy(), bits, group)
    wq = q.dequantize()
    x = torch.randn(37, 256, generator=g)
    exact = x.double().numpy() @ wq.astype(np.float64).T
    tol = bound(wq, x.numpy())
    out = torch.full((37, 200), 7.0)
    res = q.matmul(x.numpy(), out=out.numpy(), threads=2, isa=isa)
    assert np.shares_memory(res, out.numpy())
    assert (np.abs(out.double().numpy() - exact) <= tol).all()
    # The residual add, fused: out += x @ W^T + bias.
    resid, bias = torch.randn(37, 200, generator=g), torch.randn(200, generator=g)
    out2 = resid.clone()
    q.matmul(x.numpy(), out=out2.numpy(), accumulate=True, bias=bias.numpy(), isa=isa)
    want = exact + resid.double().numpy() + bias.double().numpy()
    assert (np.abs(out2.double().numpy() - want) <= tol + 1e-5 * np.abs(want)).all()


def test_prefetch_knobs_set_the_distances_and_keep_the_bits() -> None:
    q = QuantMatrix.from_float(np.random.default_rng(3).standard_normal((64, 256), dtype=np.float32), 4, 32)
    saved = quant_prefetch()
    try:
        for m in (1, 6):  # a near and a far tile
            x = np.random.default_rng(4).standard_normal((m, 256), dtype=np.float32)
            assert quant_prefetch(0, 0) == (0, 0)
            off = q.matmul(x, threads=2)
            assert quant_prefetch(near=256) == (256, 0)
            assert quant_prefetch(far=8192) == (256, 8192) == quant_prefetch()
            assert np.array_equal(q.matmul(x, threads=2), off)
    finally:
        quant_prefetch(*saved)


def test_gather_is_the_embedding_lookup() -> None:
    w = torch.randn(50, 96, generator=torch.Generator().manual_seed(1))
    q = QuantMatrix.from_float(w.numpy(), 4, 32)
    ids = torch.tensor([7, 0, 49, 7])
    out = torch.empty(4, 96)
    q.gather(ids.numpy(), out=out.numpy())
    np.testing.assert_array_equal(out.numpy(), q.dequantize()[ids.numpy()])
    np.testing.assert_array_equal(q.gather([1, 2]), q.dequantize()[[1, 2]])
    with pytest.raises(ValueError, match="^ids"):
        q.gather([50])


def test_dequantize_into_a_bf16_tensor() -> None:
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    q = QuantMatrix.from_float(w.numpy(), 4, 32)
    ref = torch.from_numpy(q.dequantize())
    out = torch.empty(40, 64, dtype=torch.bfloat16)
    q.dequantize(out.view(torch.int16).numpy(), threads=2)
    assert torch.equal(out, ref.to(torch.bfloat16))  # both round to nearest even
    f = torch.empty(40, 64)
    q.dequantize(f.numpy(), threads=3)
    assert torch.equal(f, ref)
    for bad in [
        np.zeros((40, 64), np.float64),
        np.zeros((40, 63), np.float32),
        np.zeros((64, 40), np.int16).T,
    ]:
        with pytest.raises(ValueError, match="^out"):
            q.dequantize(bad)


def test_concat_stacks_rows() -> None:
    g = torch.Generator().manual_seed(3)
    a = QuantMatrix.from_float(torch.randn(20, 64, generator=g).numpy(), 4, 32)
    b = QuantMatrix.from_float(torch.randn(9, 64, generator=g).numpy(), 8, 0)
    qkv = QuantMatrix.concat([a, b])
    assert (qkv.rows, qkv.cols, qkv.kind) == (29, 64, "q8")
    np.testing.assert_array_equal(qkv.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="^parts"):
        QuantMatrix.concat([a, QuantMatrix.from_float(np.ones((2, 32), np.float32))])


def test_quantization_is_close_to_float() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 512, generator=g), torch.randn(5, 512, generator=g)
    ref = (x @ w.T).numpy()
    rel = {}
    for bits, group in [(8, 0), (4, 32)]:
        out = QuantMatrix.from_float(w.numpy(), bits, group).matmul(x.numpy())
        rel[bits] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    # Expected relative errors for Gaussian data: int8 weights+activations ~0.01, 4-bit groups of 32 ~0.1.
    assert rel[8] < 0.02 and rel[4] < 0.15, rel


def test_bad_arguments_raise_value_error_naming_them() -> None:
    w = np.ones((4, 64), np.float32)
    q = QuantMatrix.from_float(w)
    assert (q.rows, q.cols, q.kind) == (4, 64, "q8")
    cases = [
        ("x", lambda: q.matmul(np.ones((2, 32), np.float32))),
        ("x", lambda: q.matmul(np.ones((2, 64), np.float64))),
        ("x", lambda: q.matmul(np.ones((64, 2), np.float32).T)),
        ("out", lambda: q.matmul(np.ones((2, 64), np.float32), out=np.ones((2, 5), np.float32))),
        ("accumulate", lambda: q.matmul(np.ones((2, 64), np.float32), accumulate=True)),
        ("bias", lambda: q.matmul(np.ones((2, 64), np.float32), bias=np.ones(3, np.float32))),
        ("threads", lambda: q.matmul(np.ones((2, 64), np.float32), threads=0)),
        ("isa", lambda: q.matmul(np.ones((2, 64), np.float32), isa="neon")),
        ("cols", lambda: QuantMatrix.from_float(np.ones((4, 48), np.float32))),
        ("weight", lambda: QuantMatrix.from_float(np.ones(64, np.float32))),
        ("bits", lambda: QuantMatrix.from_float(w, bits=3)),
        ("group_size", lambda: QuantMatrix.from_float(w, group_size=48)),
        ("ggml_type", lambda: QuantMatrix.from_ggml(np.zeros(18, np.uint8), 1, 1, 32)),
        ("raw", lambda: QuantMatrix.from_ggml(np.zeros(17, np.uint8), 2, 1, 32)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=f"^{name}"):
            call()
