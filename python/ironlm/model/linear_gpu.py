"""Quantized linears for GPUs: int8 / int4 weight-only through a Triton dequant-GEMM, FP8 through `torch._scaled_mm`.

Both quantize a dense `[out, in]` weight at load (round to nearest, symmetric) and keep the interface of the CPU
`QuantLinear` (`__call__(x, residual)`, `into`, `accumulate`, `embed`, `nbytes`), so the decoder does not care which
one it holds.

- `TritonQuantLinear`: int8 with one scale per output row (or per group), int4 with one scale per group of 32/64/128
  columns (two weights a byte); kernels/quant_matmul.py dequantizes in registers. Half (int8) or a quarter (int4) of
  bf16's weight bytes cross the memory bus per decode step.
- `Fp8Linear`: e4m3 weights with one scale per output row, activations quantized per row at run time (dynamic), a
  scaled GEMM on the FP8 tensor cores of Hopper / Ada (sm_89+). torch also runs `_scaled_mm` on the CPU, slowly:
  that is how the tests check the arithmetic here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ironlm.model.quantize import fit_group

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_rows(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`[N, K]` float → (int8 `[N, K]` or packed uint8 `[N, K/2]`, fp32 scales `[N, K/group or 1]`, group used)."""
    w = weight.detach().float()
    n, k = w.shape
    if bits == 4 and k % 2:
        raise ValueError(f"int4 needs an even number of input columns, got {k}")
    group = fit_group(k, group)
    width = k if group == 0 else group
    wg = w.reshape(n, k // width, width)
    qmax = 127 if bits == 8 else 7
    scale = wg.abs().amax(dim=-1, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wg / scale).clamp_(-qmax - 1, qmax).to(torch.int8).reshape(n, k)
    if bits == 4:
        u = (q + 8).to(torch.uint8)
        q = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
    return q.contiguous(), scale.reshape(n, k // width).contiguous(), group


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The inverse of `quantize_rows` (fp32), for embedding lookups and references."""
    if bits == 4:
        lo = (q & 0xF).to(torch.int16) - 8
        hi = (q >> 4).to(torch.int16) - 8
        values = torch.stack((lo, hi), dim=-1).reshape(q.shape[0], -1).float()
    else:
        values = q.float()
    width = values.shape[1] if group == 0 else group
    return (values.reshape(values.shape[0], -1, width) * scales.float().unsqueeze(-1)).reshape(values.shape)


class _Quantized(ABC):
    """`into` / `accumulate` from `__call__` (the lean CPU step calls them; on a GPU the decoder never does, but a
    model built on the CPU for the Triton interpreter or FP8 checks may)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...

    def into(self, x: torch.Tensor, out: torch.Tensor, x_np: object = None, out_np: object = None) -> torch.Tensor:
        return self(x)

    def accumulate(self, x: torch.Tensor, out: torch.Tensor, x_np: object = None,
                   out_np: object = None) -> torch.Tensor:
        return out + self(x)


class TritonQuantLinear(_Quantized):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
                 bias: torch.Tensor | None = None) -> None:
        self.qweight, self.scales, self.bits, self.group = qweight, scales, bits, group
        self.bias = None if bias is None else bias.detach()
        self.rows = qweight.shape[0]
        self.cols = qweight.shape[1] * (2 if bits == 4 else 1)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int, group: int,
                   bias: torch.Tensor | None = None) -> TritonQuantLinear:
        q, scales, group = quantize_rows(weight, bits, group)
        return cls(q, scales, bits, group, bias)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        from ironlm.kernels.quant_matmul import quant_matmul

        return quant_matmul(x, self.qweight, self.scales, self.bits, self.group, self.bias, residual)

    def embed(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = dequantize_rows(self.qweight[ids], self.scales[ids], self.bits, self.group)
        if out is None:
            return rows
        out.copy_(rows)
        return out


class Fp8Linear(_Quantized):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`weight` float8_e4m3fn `[N, K]`, `scale` fp32 `[N]` (the dequantized row is `weight[n] * scale[n]`)."""
        self.weight = weight
        self.weight_t = weight.t()  # column-major `[K, N]`: the layout `_scaled_mm` wants for its second operand
        self.scale = scale.float()
        self.scale_row = self.scale.reshape(1, -1).contiguous()
        self.bias = None if bias is None else bias.detach()
        self.rows, self.cols = weight.shape

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
        q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(q.contiguous(), scale, bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        x_scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        xq = (xf / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        # Row-wise scaling on CUDA wants a bf16 output; the CPU implementation takes any.
        out_dtype = torch.bfloat16 if x.is_cuda else dtype
        out = torch._scaled_mm(xq, self.weight_t, scale_a=x_scale, scale_b=self.scale_row, out_dtype=out_dtype)
        out = out.to(dtype)
        if self.bias is not None:
            out += self.bias.to(dtype)
        if residual is not None:
            out += residual
        return out

    def embed(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.weight[ids].float() * self.scale[ids, None]
        if out is None:
            return rows
        out.copy_(rows)
        return out
