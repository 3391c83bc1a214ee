"""Paged prefill/extend attention for variable-length query chunks.

Sequence s contributes rows query_start_loc[s] .. query_start_loc[s+1] (its chunk) and has seq_lens[s] tokens in
the cache after this step's write, so the chunk's row j sits at absolute position context_len + j and attends
causally to positions 0 ..= context_len + j: the cached prefix (prefix-cache hits, earlier chunks of a chunked
prefill) and itself, all read through the block table; with a sliding window only positions
(context_len + j - window, context_len + j], and tiles wholly before the tile's first row's window are not read;
with soft-capping each scaled logit x becomes softcap * tanh(x / softcap) before the mask and the softmax; with
sinks (gpt-oss) each head's softmax denominator gains exp(sink) after the loop.
Grid: (query tiles, query heads, sequences); programs whose tile lies past their sequence's chunk exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ironlm.kernels.decode_attention import (
    NO_WINDOW,
    add_sink,
    capped_logits,
    default_compute_f32,
    load_kv_tile,
    sink_arg,
)


@triton.jit
def prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    seq_ids_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    sinks_ptr,  # [Hq] fp32 attention sinks (read when HAS_SINKS)
    scale,
    window,  # sliding window (NO_WINDOW = full causal)
    softcap,  # logit soft-cap (read when SOFTCAP)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + tl.program_id(2))
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n0 = tl.arange(0, BLOCK_N)
    mask_m = offs_m < q_len
    rows = q_start.to(tl.int64) + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=mask_m[:, None],
                other=0.0)
    if COMPUTE_F32:
        q = q.to(tl.float32)
    pos_m = ctx_len + offs_m  # absolute positions of this tile's query rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Causal bound of the whole tile: its last real row sees up to position ctx_len + min(q_len, tile end) - 1.
    kv_end = ctx_len + tl.minimum(q_len, (tile + 1) * BLOCK_M)
    # ... and its first row sees nothing before position ctx_len + tile * BLOCK_M - window + 1.
    kv_start = tl.maximum(ctx_len + tile * BLOCK_M - window + 1, 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + offs_n0
        mask_n = offs_n < kv_end
        k = load_kv_tile(k_cache_ptr, bt_row, offs_n, mask_n, kv_head, offs_d, stride_kb, stride_ks, stride_kh,
                          PAGE_SIZE)
        v = load_kv_tile(v_cache_ptr, bt_row, offs_n, mask_n, kv_head, offs_d, stride_vb, stride_vs, stride_vh,
                          PAGE_SIZE)
        if COMPUTE_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        visible = (offs_n[None, :] <= pos_m[:, None]) & (offs_n[None, :] > pos_m[:, None] - window) & mask_n[None, :]
        qk = tl.where(visible, capped_logits(qk, scale, softcap, SOFTCAP), float("-inf"))
        # A tile can hide every key from a row (the first tile, or under a window a padding row past q_len):
        # m_new is then -inf and the guard keeps exp2 finite; every real row sees at least itself.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS:
        acc, l_i = add_sink(acc, m_i, l_i, tl.load(sinks_ptr + head) * 1.4426950408889634)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    seq_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    block_m: int = 64,
    block_n: int = 64,
    compute_f32: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of each chunk in seq_ids (int32 [Bp]) over its paged context, written into out's rows;
    with `window` (sliding-window attention) row j of a chunk sees only positions (ctx + j - window, ctx + j];
    with `softcap` the logits are soft-capped; with `sinks` ([Hq]) head h's denominator gains exp(sinks[h]).

    `max_query_len` (a host int) sizes the tile dimension of the grid; the new K/V rows must already be in the
    cache (reshape_and_cache runs first).
    """
    num = seq_ids.shape[0]
    if num == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    hkv, page = k_cache.shape[2], k_cache.shape[1]
    if compute_f32 is None:
        compute_f32 = default_compute_f32(q.dtype)
    grid = (triton.cdiv(max_query_len, block_m), hq, num)
    extra = {}
    if num_warps is not None:
        extra["num_warps"] = num_warps
    if num_stages is not None:
        extra["num_stages"] = num_stages
    prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, seq_ids, query_start_loc, seq_lens, block_tables, sink_arg(sinks, q), scale,
        NO_WINDOW if window is None else window, 1.0 if softcap is None else float(softcap), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page, COMPUTE_F32=compute_f32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, **extra,
    )
