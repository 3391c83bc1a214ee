"""Pre-quantized linears into a loaded `DecoderLM`: q|k|v and gate|up fused as the decoder runs them, the dense
parameters they replace dropped. A linear the checkpoint left dense (the LM head, usually) stays dense; a fused
projection with only some parts quantized is refused rather than re-quantized."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ironlm import _core
from ironlm.exceptions import UnsupportedModelError
from ironlm.model.linear import QuantizedLinear, QuantLinear
from ironlm.model.prequant.actorder import ActOrderLinear
from ironlm.model.prequant.bits import Unpacked

if TYPE_CHECKING:
    from ironlm.model.llama import DecoderLayer, DecoderLM


def _triton(parts: list[Unpacked], what: str, bits: int, bias: torch.Tensor | None,
            device: torch.device) -> QuantizedLinear:
    """The GPU's symmetric dequant-GEMM (`(q - 8) s` int4 nibbles, or int8 `q s`, one scale per group): exact for
    blocks whose min is `-s 2^(b-1)`, the zero point of every symmetric b-bit scheme."""
    from ironlm.model.linear_gpu import TritonQuantLinear

    z0 = 1 << (bits - 1)
    signed, scales = [], []
    for u in parts:
        if u.perm is not None:
            raise UnsupportedModelError(f"{what}: act-order (desc_act / g_idx) on the GPU's dequant-GEMM")
        if not np.array_equal(u.min, -u.scale * np.float32(z0)):
            raise UnsupportedModelError(f"{what}: zero points other than {z0} on the GPU's symmetric dequant-GEMM")
        signed.append(u.q.astype(np.int16) - z0)
        scales.append(u.scale)
    q, s = np.concatenate(signed), np.concatenate(scales)
    # the widest group of 32-blocks whose scales agree (the kernel takes 32/64/128 or one per row)
    group = next((g for g in (0, 128, 64) if _uniform(s, g)), 32)
    step = (s.shape[1] if group == 0 else group // 32)
    s = np.ascontiguousarray(s[:, ::step])
    if parts[0].bits == 4:
        nib = (q + 8).astype(np.uint8)
        packed = torch.from_numpy(np.ascontiguousarray(nib[:, 0::2] | (nib[:, 1::2] << 4)))
        kbits = 4
    else:
        packed, kbits = torch.from_numpy(np.ascontiguousarray(q.astype(np.int8))), 8
    return TritonQuantLinear(packed.to(device), torch.from_numpy(s).to(device), kbits, group, bias)


def _uniform(s: np.ndarray, group: int) -> bool:
    width = s.shape[1] if group == 0 else group // 32
    if s.shape[1] % width:
        return False
    g = s.reshape(s.shape[0], -1, width)
    return bool((g == g[:, :, :1]).all())


def _linear(parts: list[Unpacked], what: str, bias: torch.Tensor | None = None) -> QuantLinear:
    perm = parts[0].perm
    if any((p.perm is None) != (perm is None) or (perm is not None and p.perm is not None and
                                                 not torch.equal(p.perm, perm)) for p in parts):
        raise UnsupportedModelError(f"{what}: the fused parts have different act-order g_idx permutations")
    mats = [p.matrix() for p in parts]
    m = mats[0] if len(mats) == 1 else _core.QuantMatrix.concat(mats)
    return QuantLinear(m, bias) if perm is None else ActOrderLinear(m, perm, bias)


def _fused(parts: dict[str, Unpacked], names: list[str], what: str) -> list[Unpacked] | None:
    have = [n in parts for n in names]
    if not any(have):
        return None
    if not all(have):
        missing = [n for n, h in zip(names, have) if not h]
        raise UnsupportedModelError(f"{what}: {', '.join(missing)} not quantized while the rest is (ironlm fuses them)")
    return [parts[n] for n in names]


def install(model: DecoderLM, parts: dict[str, Unpacked], backend: str = "core", bits: int = 4) -> None:
    """`bits`: the checkpoint's width (the Triton path's zero point is `2^(bits-1)`)."""
    def empty() -> nn.Parameter:
        return nn.Parameter(torch.empty((0,), dtype=model.dtype, device=model.device), requires_grad=False)

    def make(ps: list[Unpacked], what: str, bias: torch.Tensor | None = None) -> QuantizedLinear:
        if backend == "triton":
            return _triton(ps, what, bits, bias, model.device)
        return _linear(ps, what, bias)

    for i, module in enumerate(model.layers):
        layer: DecoderLayer = module  # type: ignore[assignment]
        p = f"model.layers.{i}."
        qkv = _fused(parts, [p + f"self_attn.{x}_proj.weight" for x in "qkv"], p + "self_attn.qkv")
        if qkv is not None:
            layer.qkv = make(qkv, p + "self_attn.qkv", layer.qkv_bias)
            layer.qkv_weight = empty()
        o = parts.get(p + "self_attn.o_proj.weight")
        if o is not None:
            layer.o = make([o], p + "self_attn.o_proj", layer.o_bias)
            layer.o_weight = empty()
        gate_up = _fused(parts, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "mlp.gate_up")
        down = parts.get(p + "mlp.down_proj.weight")
        if down is not None and down.perm is not None and gate_up is not None:
            # act-order of down folded into gate/up's output rows (see actorder.py)
            gate_up = [g.take_rows(down.perm) for g in gate_up]
            down = Unpacked(down.q, down.scale, down.min, down.bits)
        if gate_up is not None:
            layer.gate_up = make(gate_up, p + "mlp.gate_up")
            layer.gate_up_weight = empty()
        if down is not None:
            layer.down = make([down], p + "mlp.down_proj")
            layer.down_weight = empty()
    head = parts.get("lm_head.weight")
    if head is not None:
        if head.perm is not None:
            raise UnsupportedModelError("lm_head: act-order (g_idx) on the LM head")
        model.head = make([head], "lm_head")
        model.lm_head = empty()


def install_fp8(model: DecoderLM, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """e4m3 weights with one f32 scale per row into `Fp8Linear`s (q|k|v and gate|up concatenated by rows: their
    scales are per row, so nothing is rescaled)."""
    from ironlm.model.linear_gpu import Fp8Linear

    dev = model.device

    def make(names: list[str], what: str, bias: torch.Tensor | None = None) -> Fp8Linear | None:
        have = [n in parts for n in names]
        if not any(have):
            return None
        if not all(have):
            raise UnsupportedModelError(f"{what}: only some of {', '.join(names)} are FP8 (ironlm fuses them)")
        w = torch.cat([parts[n][0] for n in names]).to(dev).contiguous()
        s = torch.cat([parts[n][1] for n in names]).to(dev)
        return Fp8Linear(w, s, bias)

    def empty() -> nn.Parameter:
        return nn.Parameter(torch.empty((0,), dtype=model.dtype, device=dev), requires_grad=False)

    for i, module in enumerate(model.layers):
        layer: DecoderLayer = module  # type: ignore[assignment]
        p = f"model.layers.{i}."
        for attr, names, bias in (
                ("qkv", [p + f"self_attn.{x}_proj.weight" for x in "qkv"], layer.qkv_bias),
                ("o", [p + "self_attn.o_proj.weight"], layer.o_bias),
                ("gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], None),
                ("down", [p + "mlp.down_proj.weight"], None)):
            lin = make(names, p + attr, bias)
            if lin is not None:
                setattr(layer, attr, lin)
                setattr(layer, attr + "_weight", empty())
    head = make(["lm_head.weight"], "lm_head")
    if head is not None:
        model.head = head
        model.lm_head = empty()
