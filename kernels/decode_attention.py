"""Paged decode attention: one query token per sequence, GQA heads grouped per program, split-K for long contexts.

Stage 1 runs one program per (sequence, KV head, split). The G query heads that share a KV head are the rows of
one [BLOCK_G, D] tile, so every K/V tile is loaded once for the whole group (tl.dot when G > 1, a broadcast
multiply for MHA). A split covers a contiguous slice of the sequence's context with an online softmax; with
one split it writes the final output, otherwise (flash-decoding) it writes the normalised partial output and its
log-sum-exp, and stage 2 merges the splits. With a sliding window only the last `window` positions are split and
read. With soft-capping (Gemma 2) each scaled logit x becomes softcap * tanh(x / softcap) before the softmax.
With sinks (gpt-oss) each query head's softmax denominator gains exp(sink): with one split the kernel adds it after
its loop, with several stage 2 adds it once when merging.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    cache_ptr, bt_row_ptr, offs_n, mask_n, kv_head, offs_d, stride_b, stride_s, stride_h,
    PAGE_SIZE: tl.constexpr,
):
    """Rows offs_n (token positions) of one sequence's paged K or V for one head: [BLOCK_N, D]."""
    blk = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    row = blk * stride_b + (offs_n % PAGE_SIZE) * stride_s + kv_head * stride_h
    return tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)


@triton.jit
def capped_logits(qk, scale, softcap, SOFTCAP: tl.constexpr):
    """Scaled logits in log2 units (exp2 softmax): qk * scale, soft-capped first when SOFTCAP."""
    if SOFTCAP:
        # tanh(y) = 2 sigmoid(2y) - 1: in every Triton version, saturating cleanly for large |y|
        x = qk * (scale / softcap)
        return (2.0 * tl.sigmoid(2.0 * x) - 1.0) * (softcap * 1.4426950408889634)
    return qk * (scale * 1.4426950408889634)  # exp2 instead of exp: log2(e) folded into the scale


@triton.jit
def add_sink(acc, m_i, l_i, sink):
    """Fold a sink logit (log2 units) into an online softmax's state: one more denominator term, no value row.
    Returns (acc, l_i) rescaled to the new max; rows that saw no key (m_i = -inf) get l_i = 1, acc = 0."""
    m_f = tl.maximum(m_i, sink)
    r = tl.exp2(m_i - m_f)
    return acc * r[:, None], l_i * r + tl.exp2(sink - m_f)


@triton.jit
def decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    seq_ids_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    sinks_ptr,  # [Hq] fp32 attention sinks (read when HAS_SINKS and not WRITE_PARTIAL)
    scale,
    num_splits,
    window,  # sliding window: keys in (seq_len - 1 - window, seq_len - 1]; NO_WINDOW = the whole context
    softcap,  # logit soft-cap (read when SOFTCAP)
    stride_qt, stride_qh,
    stride_ot, stride_oh, stride_os,  # out: [T, Hq, D] rows (final) or partials [Bd, Hq, S, D]
    stride_lb, stride_lh,  # lse partials [Bd, Hq, S]
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two (and to 16 when USE_DOT: tl.dot's minimum M)
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,  # context tokens per loop iteration
    PAGE_SIZE: tl.constexpr,
    USE_DOT: tl.constexpr,
    COMPUTE_F32: tl.constexpr,  # upcast after load: fp32 dots (interpreter, where bf16 arithmetic is wrong)
    DOT_PRECISION: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # True: write (normalised acc, lse) per split for stage 2
    SOFTCAP: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    pid_b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + pid_b)
    q_row = tl.load(query_start_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    # Each sequence splits its own attended context [lo, seq_len) evenly, in whole BLOCK_N tiles.
    lo = tl.maximum(seq_len - window, 0)
    tiles = (seq_len - lo + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (tiles + num_splits - 1) // num_splits
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n0 = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None],
                other=0.0)
    if COMPUTE_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        mask_n = offs_n < end
        k = load_kv_tile(k_cache_ptr, bt_row, offs_n, mask_n, kv_head, offs_d, stride_kb, stride_ks, stride_kh,
                          PAGE_SIZE)
        v = load_kv_tile(v_cache_ptr, bt_row, offs_n, mask_n, kv_head, offs_d, stride_vb, stride_vs, stride_vh,
                          PAGE_SIZE)
        if COMPUTE_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if USE_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        else:
            qk = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        qk = tl.where(mask_n[None, :], capped_logits(qk, scale, softcap, SOFTCAP), float("-inf"))
        # Every tile holds at least one real token (start < end), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new

    if HAS_SINKS and not WRITE_PARTIAL:  # split partials stay sink-free: stage 2 adds the sink once
        sink = tl.load(sinks_ptr + heads, mask=mask_g, other=0.0) * 1.4426950408889634
        acc, l_i = add_sink(acc, m_i, l_i, sink)
    # An empty split (short sequence, many splits) has l_i == 0: output 0 with lse -inf, ignored by stage 2.
    nonempty = l_i > 0
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if WRITE_PARTIAL:
        base = pid_b.to(tl.int64) * stride_ot + heads * stride_oh + split * stride_os
        tl.store(out_ptr + base[:, None] + offs_d[None, :], acc, mask=mask_g[:, None])
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))  # base-2 lse
        tl.store(lse_ptr + pid_b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=mask_g)
    else:
        base = q_row * stride_ot + heads * stride_oh
        tl.store(out_ptr + base[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])


@triton.jit
def decode_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, seq_ids_ptr, query_start_ptr,
    sinks_ptr,  # [Hq] fp32 attention sinks (read when HAS_SINKS)
    num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    HAS_SINKS: tl.constexpr = False,
):
    """Stage 2: merge the splits of one (sequence, query head) by their log-sum-exp weights (and the head's sink,
    a split with lse = sink and no value)."""
    pid_b = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + pid_b)
    q_row = tl.load(query_start_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < num_splits
    lse = tl.load(lse_ptr + pid_b.to(tl.int64) * stride_lb + head * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))
    top = tl.max(lse, axis=0)  # split 0 is never empty, so the max is finite
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        top = tl.maximum(top, sink)
    w = tl.exp2(lse - top)
    denom = tl.sum(w, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - top)
    part = tl.load(part_ptr + pid_b.to(tl.int64) * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                   + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / denom
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


# The `window` a full-attention layer passes: larger than any context, so `seq_len - window` clamps to 0.
NO_WINDOW = 1 << 30


def interpreted() -> bool:
    """Whether these kernels were built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(decode_attention_kernel, InterpretedFunction)


def default_compute_f32(dtype: torch.dtype) -> bool:
    """bf16 arithmetic (dots included) is wrong in the interpreter: upcast right after loading there. On the
    GPU, and for fp16 (exact in the interpreter), dots stay in the storage dtype with fp32 accumulation."""
    return dtype == torch.bfloat16 and interpreted()


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                  num_sms: int = 132, max_splits: int = 32, min_tokens_per_split: int = 256) -> int:
    """Flash-decoding only pays when (sequences x KV heads) can't fill the GPU: aim for ~2 waves of programs,
    but keep every split at least `min_tokens_per_split` long so the partial writes and stage 2 stay cheap."""
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * num_sms, max(programs, 1))
    by_len = max(1, max_seq_len // max(min_tokens_per_split, block_n))
    return int(max(1, min(want, by_len, max_splits)))


def sink_arg(sinks: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The kernels' sinks pointer: fp32 [Hq] contiguous, or any tensor (never read) when there are none."""
    return like if sinks is None else sinks.to(device=like.device, dtype=torch.float32).contiguous()


def decode_block_g(group: int) -> tuple[int, bool]:
    """(BLOCK_G, USE_DOT): tl.dot needs M >= 16 on the GPU, MHA uses the broadcast-multiply path."""
    use_dot = group > 1
    block_g = triton.next_power_of_2(group)
    return (max(16, block_g) if use_dot else block_g), use_dot


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    seq_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    *,
    num_splits: int | None = None,
    block_n: int = 64,
    compute_f32: bool | None = None,
    num_sms: int = 132,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """out[query_start_loc[s]] = attention of that query row over sequence s's paged context, for s in seq_ids.

    q/out [T, Hq, D]; caches [num_blocks, page, Hkv, D]; seq_ids int32 [Bd] (the sequences to decode, each
    with one query row). `max_seq_len` (a host int: no device sync) only sizes the split count. With `window`
    (sliding-window attention) only each sequence's last `window` positions are attended; with `softcap` the
    logits are soft-capped; with `sinks` ([Hq], any float dtype) head h's denominator gains exp(sinks[h]).
    """
    num = seq_ids.shape[0]
    if num == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    hkv, page = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    block_g, use_dot = decode_block_g(group)
    if compute_f32 is None:
        compute_f32 = default_compute_f32(q.dtype)
    if num_splits is None:
        span = max_seq_len if window is None else min(max_seq_len, window)
        num_splits = num_kv_splits(num, hkv, span, block_n, num_sms)
    win = NO_WINDOW if window is None else window
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = {"GROUP": group, "BLOCK_G": block_g, "HEAD_DIM": d, "BLOCK_N": block_n, "PAGE_SIZE": page,
              "USE_DOT": use_dot, "COMPUTE_F32": compute_f32, "DOT_PRECISION": precision,
              "SOFTCAP": softcap is not None, "HAS_SINKS": sinks is not None}
    cap = 1.0 if softcap is None else float(softcap)
    sk = sink_arg(sinks, q)
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    if num_splits == 1:
        decode_attention_kernel[(num, hkv, 1)](
            q, k_cache, v_cache, out, out, seq_ids, query_start_loc, seq_lens, block_tables, sk, scale, 1, win, cap,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), 0, 0, 0, *kv_strides,
            WRITE_PARTIAL=False, **common,
        )
        return
    part = torch.empty(num, hq, num_splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(num, hq, num_splits, dtype=torch.float32, device=q.device)
    decode_attention_kernel[(num, hkv, num_splits)](
        q, k_cache, v_cache, part, lse, seq_ids, query_start_loc, seq_lens, block_tables, sk, scale, num_splits, win,
        cap,
        q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        *kv_strides, WRITE_PARTIAL=True, **common,
    )
    decode_reduce_kernel[(num, hq)](
        part, lse, out, seq_ids, query_start_loc, sk, num_splits,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_S=triton.next_power_of_2(num_splits), HAS_SINKS=sinks is not None,
    )
