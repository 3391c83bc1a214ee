"""Weight-only int8 / int4 GEMM for GPUs: `out = x @ dequant(W)^T (+ bias) (+ residual)`.

W is `[N, K]` (output rows, input columns), symmetric round-to-nearest:
- int8: `qweight` int8 `[N, K]`;
- int4: `qweight` uint8 `[N, K / 2]`, column `2j` in the low nibble of byte `j` and `2j + 1` in the high one, each
  nibble holding `q + 8` for q in [-8, 7];
- `scales` `[N, K / group]` (one column when per channel), any float dtype.

The kernel streams the packed weights once per M tile and dequantizes each K tile in registers before a `tl.dot`
in the activation dtype with fp32 accumulation: decode batches (M <= 16) are one M tile, so the weights cross the
memory bus once per step, at a half (int8) or a quarter (int4) of bf16's bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def quant_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_rm,
    stride_om,
    BITS: tl.constexpr,  # 8 or 4
    GROUP: tl.constexpr,  # columns per scale; 0 = one scale per output row
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP, so one scale per (row, K tile)
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    s_rows = s_ptr + rn.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        if BITS == 8:
            q = tl.load(w_rows + kk[:, None], mask=w_mask, other=0).to(tl.float32)
        else:
            packed = tl.load(w_rows + kk[:, None] // 2, mask=w_mask, other=0x88).to(tl.int32)
            q = ((packed >> ((kk[:, None] % 2) * 4)) & 0xF).to(tl.float32) - 8.0
        if GROUP == 0:
            scale = tl.load(s_rows, mask=n_ok, other=0.0).to(tl.float32)
        else:
            scale = tl.load(s_rows + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
        w = (q * scale[None, :]).to(a.dtype)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + rm.to(tl.int64)[:, None] * stride_rm + rn[None, :], mask=out_mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)


def tiles(m: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for `m` rows: one 16-row tile for decode batches, 64 for prefill; BLOCK_K
    divides the group (the groups the quantizer makes are multiples of 32)."""
    block_m = 16 if m <= 16 else 64
    block_k = 64 if group == 0 or group % 64 == 0 else 32
    return block_m, 64, block_k


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 products (torch's own fp32 matmul does not use tf32 by default either).
    return "ieee" if dtype == torch.float32 else "tf32"


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
                 bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """`x` [M, K] (rows contiguous) → [M, N] in x's dtype (or into `out`); see the module docstring for W."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] * (2 if bits == 4 else 1) != k:
        raise ValueError(f"x has {k} columns but the {bits}-bit weight is {tuple(qweight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    block_m, block_n, block_k = tiles(m, group)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    quant_matmul_kernel[grid](
        x,
        qweight,
        scales,
        bias if bias is not None else x,
        residual if residual is not None else x,
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        BITS=bits,
        GROUP=group,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return out
