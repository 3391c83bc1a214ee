"""The unpackers of ironlm.model.prequant against the formats' reference code, and QuantMatrix.from_parts.

compressed-tensors' pack_to_int32 / unpack_from_int32 (the library's own) define the dense bit stream that its
pack-quantized checkpoints and GPTQ's words both use; tests/prequant_ckpt.py's GPTQ packer (AutoGPTQ's loops, the
3-bit one straddling words) must produce exactly those words, and ironlm's unpacker must read them back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from ironlm import _core
from ironlm.exceptions import InvalidArgumentError, UnsupportedModelError
from ironlm.model.prequant.bits import affine, unpack_bits
from prequant_ckpt import _i32, pack_gptq_rows


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpack_bits_reads_compressed_tensors_words(bits):
    g = torch.Generator().manual_seed(bits)
    signed = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (24, 160), generator=g, dtype=torch.int8)
    words = pack_to_int32(signed, bits)
    mine = unpack_bits(words, bits, 160)
    ref = unpack_from_int32(words, bits, signed.shape).to(torch.int16) + (1 << (bits - 1))
    assert np.array_equal(mine, ref.numpy().astype(np.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_packer_lays_out_compressed_tensors_bit_stream(bits):
    """AutoGPTQ's qweight (packed along the input dimension, [in b / 32, out]) is the same bit stream as
    compressed-tensors' packing along dim 0, 3 bits included (values straddling words)."""
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (128, 40), generator=g)
    gptq = _i32(pack_gptq_rows(q.numpy(), bits))
    ct = pack_to_int32((q - (1 << (bits - 1))).to(torch.int8), bits, packed_dim=0)
    assert torch.equal(gptq, ct)
    assert np.array_equal(unpack_bits(gptq.t().contiguous(), bits, 128), q.t().numpy())


def test_affine_blocks_are_exact_and_act_order_sorts_columns():
    g = torch.Generator().manual_seed(0)
    out, cols, group = 48, 256, 64
    q = torch.randint(0, 16, (out, cols), generator=g).numpy().astype(np.uint8)
    scale = (torch.rand(out, cols // group, generator=g) * 0.02).half()
    zero = torch.randint(0, 16, (out, cols // group), generator=g).numpy()
    g_idx = torch.arange(cols) // group
    g_idx = g_idx[torch.randperm(cols, generator=g)]
    u = affine("w", q, scale, zero, 4, g_idx=g_idx)
    want = scale.float()[:, g_idx] * (torch.from_numpy(q).float() - torch.from_numpy(zero)[:, g_idx].float())
    assert torch.equal(u.dense(), want)  # fp16 scale x small integers: exact in f32
    assert u.perm is not None and torch.equal(g_idx[u.perm], g_idx.sort(stable=True).values)
    m = u.matrix()
    w_sorted = torch.from_numpy(m.dequantize())
    assert torch.equal(w_sorted, want[:, u.perm])  # the core's blocks hold the same weights, columns sorted
    x = torch.randn(3, cols, generator=g)
    y = torch.from_numpy(m.matmul(x[:, u.perm].contiguous().numpy()))
    bound = (x.abs().reshape(3, -1, 32).amax(-1) / 254).repeat_interleave(32, 1) @ want.abs().t()  # act rounding
    assert ((y - x @ want.t()).abs() <= bound + 1e-4).all()
    with pytest.raises(UnsupportedModelError, match="32-weight block"):  # groups of 16 split the core's blocks
        affine("w", q, torch.ones(out, cols // 16).half(), np.zeros((out, cols // 16), dtype=np.int64), 4,
               group=16)


def test_from_parts_validates_its_arguments():
    q = np.zeros((4, 64), dtype=np.uint8)
    s = np.ones((4, 2), dtype=np.float32)
    assert _core.QuantMatrix.from_parts(q, s, -s, 4).kind == "q4"
    with pytest.raises(InvalidArgumentError) as err:
        _core.QuantMatrix.from_parts(q + 16, s, -s, 4)
    assert err.value.param == "q" and "16" in str(err.value)
    with pytest.raises(InvalidArgumentError) as err:
        _core.QuantMatrix.from_parts(q, s[:, :1].copy(), -s, 4)
    assert err.value.param == "scales"
    with pytest.raises(InvalidArgumentError) as err:
        _core.QuantMatrix.from_parts(q, s, -s, 3)
    assert err.value.param == "bits"
    with pytest.raises(InvalidArgumentError) as err:
        _core.QuantMatrix.from_parts(q, s, np.full_like(s, np.nan), 8)
    assert err.value.param == "mins"
