"""reshape_and_cache: scatter this step's new K/V rows into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_tok,
    stride_v_tok,
    stride_kc_slot,
    stride_vc_slot,
    ROW: tl.constexpr,  # Hkv * D elements per token, contiguous in both k/v rows and cache slots
    BLOCK: tl.constexpr,  # next power of two >= ROW (tl.arange needs a power of two)
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)  # int64: slot * row size overflows int32 on big caches
    offs = tl.arange(0, BLOCK)
    # slot -1 marks a padding row: masking the store (rather than an early return) keeps one code path.
    # (A scalar-limit compare: the interpreter rejects a scalar bool broadcast into a tensor mask.)
    mask = offs < tl.where(slot >= 0, ROW, 0)
    # A pure copy, no arithmetic: safe for bf16 in the interpreter too.
    k = tl.load(k_ptr + tok.to(tl.int64) * stride_k_tok + offs, mask=mask)
    v = tl.load(v_ptr + tok.to(tl.int64) * stride_v_tok + offs, mask=mask)
    tl.store(k_cache_ptr + slot * stride_kc_slot + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc_slot + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] with each token's Hkv*D elements contiguous (a strided view of a fused QKV output is fine)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k/v [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T] (-1 = skip)."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "paged caches must be contiguous"
    k, v = _rows(k), _rows(v)
    row = k.shape[1] * k.shape[2]
    reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        row,
        row,
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )
