"""FP8 e4m3 weights (`quant_method: fp8` and compressed-tensors' `float-quantized`): `weight` float8_e4m3fn with a
per-tensor, per-channel (`weight_scale`) or per-128x128-block (`weight_scale_inv`) scale.

e4m3 is not an affine integer grid, so the core's blocks cannot hold it. On the CPU the weights become dense f32
`e4m3 * scale`: every e4m3 value is exact in f32 and so is its product with a bf16 / fp16 scale (4 by at most 11
significant bits); an f32 scale rounds the product once, exactly as the reference fp32 dequantization does. Dense
f32 is 4 bytes a weight (the file's 1 plus scales), and the model runs in float32 (dtype auto). On a GPU with FP8
tensor cores the e4m3 weights stay as they are in `Fp8Linear` (per-tensor / per-channel scales: one per row)."""

from __future__ import annotations

import torch

from ironlm.exceptions import UnsupportedModelError

LEAVES = ("weight_scale", "weight_scale_inv", "input_scale")


def dense(name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`weight * scale` in f32, `scale` a scalar, `[out]` / `[out, 1]`, or `[ceil(out/bo), ceil(in/bi)]` blocks."""
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedModelError(f"{name}: FP8 weight of dtype {weight.dtype}, ironlm reads float8_e4m3fn")
    w = weight.float()
    out, cols = w.shape
    s = scale.float()
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == out:
        return w * s.reshape(out, 1)
    if s.dim() == 2:
        bo, bi = -(-out // s.shape[0]), -(-cols // s.shape[1])
        full = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]
        return w * full
    raise UnsupportedModelError(f"{name}: FP8 scale of shape {tuple(scale.shape)} for a {out}x{cols} weight")


def row_scales(name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The f32 scale of every output row (what the GPU's Fp8Linear takes, `w[n] = e4m3[n] * s[n]`): a per-tensor
    scale repeated, a per-channel one as is; 128-block scales are not per row."""
    out = weight.shape[0]
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(out).contiguous()
    if s.numel() == out and (scale.dim() < 2 or scale.shape[-1] == 1):
        return s.contiguous()
    raise UnsupportedModelError(f"{name}: FP8 block scales {tuple(scale.shape)} on the GPU's Fp8Linear, which "
                                "takes one scale per output row")


def scale_of(name: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    scale = t.get("weight_scale_inv", t.get("weight_scale"))
    if scale is None:
        raise UnsupportedModelError(f"{name}: FP8 weight without weight_scale / weight_scale_inv")
    return scale


def unpack(name: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    return dense(name, t["weight"], scale_of(name, t))
