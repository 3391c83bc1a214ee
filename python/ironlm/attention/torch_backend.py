"""Paged attention in plain torch: the CPU production path and the reference for the Triton kernels.

Planning (which rows decode, gather indices, masks) depends only on the step's metadata, so it is built once
from the host arrays by the first layer and memoised in ``meta.plan_cache``; every later layer only gathers
and multiplies. No ``.item()`` / ``.cpu()`` on device tensors: the plan comes from ``*_cpu`` arrays.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ironlm.attention.metadata import AttentionMetadata
from ironlm.core_views import indexable, widen

# Decode sequences are sorted by length and cut into chunks of about this many padded context tokens: padding
# stays small (no batch-wide pad to the longest context) and the gather buffers stay a few MiB. Measured on the
# 2-core dev box (B=64, contexts 32-768, Hq=9, Hkv=3, D=64): 2048-16384 all within noise; one chunk for the
# whole batch ~2x slower, 1024 slower again (per-chunk op overhead).
DECODE_CHUNK_TOKENS = 4096
# Cascade attention: when every decode sequence starts with the same cached blocks (a shared system prompt,
# n > 1 forks), those blocks are gathered once and attended by all queries in one call, then merged with each
# sequence's own tail by log-sum-exp. Below this many shared blocks the extra call costs more than it saves.
MIN_SHARED_BLOCKS = 4


@dataclass
class _DecodeChunk:
    """Query-length-1 sequences of similar length, attended in one batched SDPA call."""

    rows: torch.Tensor  # [n] token rows of these sequences in q / out
    blocks: torch.Tensor  # [n * nb] int64 block ids, nb blocks per sequence (padded with block 0)
    bias: torch.Tensor  # [n, 1, L] fp32, 0 for real positions and -inf for padding (L = nb * block_size)
    num_blocks: int  # nb
    offset: int  # position of this chunk's first sequence in the decode order (rows of the shared prefix)


@dataclass
class _SharedPrefix:
    """Leading blocks common to every decode sequence of the step (cascade attention)."""

    rows: torch.Tensor  # [N] token rows of all decode sequences, in chunk order
    blocks: torch.Tensor  # [S] int64 shared block ids


@dataclass
class _PrefillSeq:
    start: int
    end: int
    seq_len: int
    context_len: int
    blocks: torch.Tensor  # [nb] int64 block ids covering seq_len (unused when context_len == 0)
    mask: torch.Tensor | None  # [n, seq_len] bool, True = attend; None = plain causal (no cached prefix)


@dataclass
class _Plan:
    decode: list[_DecodeChunk]
    shared: _SharedPrefix | None
    prefill: list[_PrefillSeq]
    num_tokens: int  # real query rows (q may carry padding rows after them)
    has_padding_slots: bool | None  # any slot -1; None = unknown (device metadata: checked per write)


class _Workspace(threading.local):
    """CPU gather buffers reused across layers and steps: a fresh multi-MiB tensor per gather costs more in page
    faults than the copy itself (measured 11.6 ms vs 1.7 ms for a 37 MB gather). Thread-local, so concurrent
    engines in one process don't share one. (On CUDA the caching allocator already reuses memory.)"""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.buffers.get((key, dtype, device))
        if buf is None or buf.numel() < numel:
            # a normal tensor even when first asked for under inference_mode: a later forward outside it (tests,
            # tools) writes into it in place, which an inference tensor refuses
            with torch.inference_mode(False):
                buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[(key, dtype, device)] = buf
        return buf[:numel]


_WS = _Workspace()


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, key: str) -> torch.Tensor:
    """cache [N, bs, Hkv, D] rows `blocks` -> [len(blocks) * bs, Hkv, D] in a reused buffer."""
    n, bs, hkv, d = blocks.shape[0], *cache.shape[1:]
    flat = cache.view(cache.shape[0], -1)
    if cache.device.type != "cpu":
        return flat.index_select(0, blocks).view(n * bs, hkv, d)
    out = _WS.get(key, n * bs * hkv * d, cache.dtype, cache.device).view(n, bs * hkv * d)
    torch.index_select(flat, 0, blocks, out=out)
    return out.view(n * bs, hkv, d)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    skip_negative: bool | None = None,
) -> None:
    """Scatter new K/V rows into their cache slots; slot -1 marks a padding row that is not written.

    skip_negative=None checks for -1 slots (free on CPU, a device sync elsewhere); callers that know the answer
    from host metadata pass it."""
    n = slot_mapping.shape[0]
    k, v = k[:n], v[:n]
    if skip_negative is None:
        skip_negative = n > 0 and bool((slot_mapping < 0).any())
    if skip_negative:
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    kc = k_cache.view(-1, *k_cache.shape[2:])
    _scatter(kc, slot_mapping, k)
    if v_cache is not k_cache:  # one latent cache (see AttentionBackend.forward): its rows are written once
        _scatter(v_cache.view(-1, *v_cache.shape[2:]), slot_mapping, v)


def _scatter(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slots] = rows in the cache's type (an 8-bit cache as its codes: `indexable`). torch's casts round to
    nearest even; to e4m3fn they saturate at +-448 (the core's F8E4M3::store agrees, tested)."""
    indexable(cache).index_copy_(0, slots, indexable(rows.to(cache.dtype)))


def round_to_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the cache will hold them: rounded to a narrower cache's type (EngineConfig.kv_cache_dtype), so
    a chunk attending its own new rows sees the values every later step reads back (a prefix-cache hit, a
    recompute, a chunked prefill then all attend the same keys); unchanged when the types agree."""
    if k_cache.dtype == k.dtype:
        return k, v
    return widen(k.to(k_cache.dtype), k.dtype), widen(v.to(k_cache.dtype), v.dtype)


class TorchAttention:
    """AttentionBackend built from gathers, batched matmuls and ``scaled_dot_product_attention`` (explicit
    matmul + softmax where the logits are soft-capped or the softmax has sinks, which SDPA cannot express)."""

    name = "torch"
    fused_decode_qkv = False  # see AttentionBackend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # One plan per window size: sliding and full layers of one step mask differently. Soft-capped logits
        # and sinks take the explicit softmax, which is not split into log-sum-exp partitions: no cascade.
        k, v = round_to_cache(k, v, k_cache)
        eager = softcap is not None or sinks is not None
        key = "torch" if window is None else f"torch:{window}"
        key += ":eager" if eager else ""
        plan = meta.plan_cache.get(key)
        if plan is None:
            plan = _make_plan(meta, k_cache.shape[1], q.device, window, cascade=not eager)
            meta.plan_cache[key] = plan
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, plan.has_padding_slots)

        out = torch.zeros_like(q) if plan.num_tokens < q.shape[0] else torch.empty_like(q)
        shared = None
        if plan.shared is not None:
            shared = _shared_prefix(q.index_select(0, plan.shared.rows), k_cache, v_cache, plan.shared, scale)
        for chunk in plan.decode:
            o = _decode_chunk(q.index_select(0, chunk.rows), k_cache, v_cache, chunk, scale, shared, softcap, sinks)
            out.index_copy_(0, chunk.rows, o)
        for s in plan.prefill:
            out[s.start : s.end] = _prefill_one(q, k, v, k_cache, v_cache, s, scale, softcap, sinks)
        return out


def _make_plan(meta: AttentionMetadata, block_size: int, device: torch.device, window: int | None = None,
               cascade: bool = True) -> _Plan:
    qsl = meta.query_start_loc_cpu.astype(np.int64)
    seq_lens = meta.seq_lens_cpu.astype(np.int64)
    qlens = np.diff(qsl)
    is_dec = qlens == 1
    # On CPU the block table is sliced in numpy; on a device it is indexed there (no copy back, no sync).
    bt_host = meta.block_tables.numpy() if meta.block_tables.device.type == "cpu" else None

    decode = []
    dec_idx = np.nonzero(is_dec)[0]
    dec_idx = dec_idx[np.argsort(seq_lens[dec_idx], kind="stable")]
    nbs = -(-seq_lens // block_size)
    # A window hides the shared prefix from some queries; the bias below masks it per sequence instead.
    skip = 0 if window is not None or not cascade else _shared_blocks(bt_host, dec_idx, seq_lens, block_size)
    shared = None
    if skip:
        assert bt_host is not None  # _shared_blocks finds no shared prefix without the host block table
        shared = _SharedPrefix(rows=torch.from_numpy(qsl[dec_idx]).to(device),
                               blocks=torch.from_numpy(bt_host[dec_idx[0], :skip].astype(np.int64)).to(device))
    i = 0
    while i < len(dec_idx):
        # Sorted ascending, so the chunk's last sequence sets its padded length.
        j = i + 1
        while j < len(dec_idx) and (j + 1 - i) * (nbs[dec_idx[j]] - skip) * block_size <= DECODE_CHUNK_TOKENS:
            j += 1
        idx = dec_idx[i:j]
        nb = int(nbs[idx[-1]])
        lead = skip  # leading blocks not gathered: the shared prefix, or those before every sequence's window
        if window is not None:
            lead = max(0, int(seq_lens[idx[0]]) - window) // block_size
        if bt_host is not None:
            blocks = torch.from_numpy(np.ascontiguousarray(bt_host[idx, lead:nb], dtype=np.int64).reshape(-1))
        else:
            blocks = meta.block_tables[torch.from_numpy(idx).to(device), lead:nb].long().reshape(-1)
        length = (nb - lead) * block_size
        positions = lead * block_size + np.arange(length)
        visible = positions[None, :] < seq_lens[idx][:, None]
        if window is not None:  # the query sits at seq_len - 1 and sees keys in (seq_len - 1 - window, seq_len - 1]
            visible &= positions[None, :] >= (seq_lens[idx] - window)[:, None]
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)
        decode.append(
            _DecodeChunk(
                rows=torch.from_numpy(qsl[idx]).to(device),
                blocks=blocks.to(device),
                bias=torch.from_numpy(bias).to(device).view(len(idx), 1, length),
                num_blocks=nb - lead,
                offset=i,
            )
        )
        i = j

    return _Plan(decode, shared, plan_prefill(meta, block_size, device, window), int(qsl[-1]), has_padding_slots(meta))


def has_padding_slots(meta: AttentionMetadata) -> bool | None:
    sm = meta.slot_mapping
    return bool((sm < 0).any()) if sm.device.type == "cpu" and sm.numel() else None


def plan_prefill(
    meta: AttentionMetadata, block_size: int, device: torch.device, window: int | None = None,
    seqs: np.ndarray | None = None,
) -> list[_PrefillSeq]:
    """The sequences with more than one query row this step (prefill chunks), one entry each, or only the
    sequences `seqs` (each with more than one row); with a `window`, query j (absolute ctx + j) sees only keys in
    (ctx + j - window, ctx + j]."""
    qsl = meta.query_start_loc_cpu.astype(np.int64)
    seq_lens = meta.seq_lens_cpu.astype(np.int64)
    qlens = np.diff(qsl)
    prefill = []
    for i in np.nonzero(qlens > 1)[0] if seqs is None else seqs:
        n, sl = int(qlens[i]), int(seq_lens[i])
        ctx = sl - n
        mask = None
        if ctx > 0 or (window is not None and window < sl):
            # Bottom-right aligned causal mask: query j (absolute ctx + j) sees keys 0..ctx + j.
            keys = torch.arange(sl, device=device)[None, :]
            query = torch.arange(n, device=device)[:, None] + ctx
            mask = keys <= query
            if window is not None:
                mask &= keys > query - window
        blocks = meta.block_tables[i, : -(-sl // block_size)].long()
        prefill.append(_PrefillSeq(int(qsl[i]), int(qsl[i + 1]), sl, ctx, blocks, mask))
    return prefill


def _shared_blocks(bt_host: np.ndarray | None, dec_idx: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """How many leading blocks all decode sequences share (0 when cascading would not pay off)."""
    if bt_host is None or len(dec_idx) < 2:
        return 0
    # Only blocks wholly before every sequence's newest token: that token's own block is never shared.
    width = min(int(((seq_lens[dec_idx] - 1) // block_size).min()), bt_host.shape[1])
    if width < MIN_SHARED_BLOCKS:
        return 0
    rows = bt_host[dec_idx, :width]
    same = (rows == rows[:1]).all(axis=0)
    common = width if same.all() else int(np.argmin(same))
    return common if common >= MIN_SHARED_BLOCKS else 0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs are attended in fp32: this backend is also the kernels' reference.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _shared_prefix(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shared: _SharedPrefix, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """All decode queries [N, Hq, D] against the shared blocks at once -> (out [N, Hkv, G, D], lse [N, Hkv, G])."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    ct = _compute_dtype(q.dtype)
    length = shared.blocks.shape[0] * k_cache.shape[1]
    # Every query row of a KV head (N sequences x G heads) sees the same keys: one [N*G, L] problem per head.
    qs = q.view(n, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, n * g, d).to(ct)
    ks = _gather_blocks(k_cache, shared.blocks, "ks").view(1, length, hkv, d).transpose(1, 2).to(ct)
    vs = ks if v_cache is k_cache else _gather_blocks(v_cache, shared.blocks, "vs").view(
        1, length, hkv, d).transpose(1, 2).to(ct)
    out, lse = _sdpa_with_lse(qs, ks, vs, None, scale)
    out = out.view(hkv, n, g, d).permute(1, 0, 2, 3)
    return out, lse.view(hkv, n, g).permute(1, 0, 2)


def _sdpa_with_lse(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits + mask
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.exp(logits - lse.unsqueeze(-1)), v), lse


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) + mask) v, the matmuls spelled out. Gemma 2's soft-capped logits
    (applied before the mask, as transformers does); gpt-oss's `sinks`, one logit per query row broadcast to
    [..., n, 1], join each row's softmax denominator with no value row (the max includes them, so a sink far
    above the logits cannot overflow). q [..., n, D], k / v [..., L, D]; mask additive float or bool
    (True = attend)."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    if sinks is None:
        return torch.matmul(torch.softmax(logits, dim=-1), v)
    sink = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(logits - top)
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - top)
    return torch.matmul(p, v) / denom


def _decode_chunk(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: _DecodeChunk, scale: float,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] (one token per sequence) against each sequence's whole paged context."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    length = chunk.num_blocks * k_cache.shape[1]
    ct = _compute_dtype(q.dtype)
    # GQA without repeating K/V: the G query heads of a KV head act as G query rows of that head.
    qg = q.view(n, hkv, g, d).to(ct)
    bias = chunk.bias.to(ct)
    # [n, Hkv, L, D] as a strided view of the gathered blocks; SDPA's CPU kernel reads it in place.
    kg = _gather_blocks(k_cache, chunk.blocks, "k").view(n, length, hkv, d).transpose(1, 2).to(ct)
    vg = kg if v_cache is k_cache else _gather_blocks(v_cache, chunk.blocks, "v").view(
        n, length, hkv, d).transpose(1, 2).to(ct)
    if softcap is not None or sinks is not None:  # never cascaded (see TorchAttention.forward)
        sink = None if sinks is None else sinks.view(1, hkv, g, 1)
        out = eager_attention(qg, kg, vg, bias.view(n, 1, 1, length), scale, softcap, sink)
        return out.reshape(n, hq, d).to(q.dtype)
    if shared is None:
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias.view(n, 1, 1, length), scale=scale)
        return out.reshape(n, hq, d).to(q.dtype)
    out, lse = _sdpa_with_lse(qg, kg, vg, bias.view(n, 1, 1, length), scale)
    s_out, s_lse = (t[chunk.offset : chunk.offset + n] for t in shared)
    # Merge two softmax partitions of the same query: weights exp(lse_part - lse_total).
    total = torch.logaddexp(lse, s_lse)
    w_own, w_shared = torch.exp(lse - total).unsqueeze(-1), torch.exp(s_lse - total).unsqueeze(-1)
    return (out * w_own + s_out * w_shared).reshape(n, hq, d).to(q.dtype)


def _prefill_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    s: _PrefillSeq,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    half: bool = False,
) -> torch.Tensor:
    """One sequence's prefill chunk against its context. `half`: a bf16 chunk goes to SDPA in bf16 (the CPU
    backend's production path: torch's CPU flash kernel accumulates in fp32 itself, and is 2.5-3x faster than on
    fp32 copies at 256-1024 tokens); False keeps the fp32 upcast of the reference path."""
    if s.context_len == 0:
        # Nothing cached before this chunk: its keys are exactly the new rows, no gather needed.
        ks, vs = k[s.start : s.end], v[s.start : s.end]
    else:
        ks = _gather_blocks(k_cache, s.blocks, "k")[: s.seq_len]
        vs = ks if v_cache is k_cache else _gather_blocks(v_cache, s.blocks, "v")[: s.seq_len]
    eager = softcap is not None or sinks is not None
    compute = q.dtype if half and not eager and q.dtype == torch.bfloat16 else _compute_dtype(q.dtype)
    qs = q[s.start : s.end].transpose(0, 1).to(compute)  # [Hq, n, D]
    if eager:
        group = qs.shape[0] // ks.shape[1]
        kt = ks.transpose(0, 1).to(compute).repeat_interleave(group, dim=0)
        vt = vs.transpose(0, 1).to(compute).repeat_interleave(group, dim=0)
        mask = s.mask
        if mask is None:
            mask = torch.ones(qs.shape[1], s.seq_len, dtype=torch.bool, device=q.device).tril()
        sink = None if sinks is None else sinks.view(-1, 1, 1)
        return eager_attention(qs, kt, vt, mask, scale, softcap, sink).transpose(0, 1).to(q.dtype)
    out = F.scaled_dot_product_attention(
        qs,
        ks.transpose(0, 1).to(compute),
        vs.transpose(0, 1).to(compute),
        attn_mask=s.mask,
        is_causal=s.mask is None,
        scale=scale,
        enable_gqa=qs.shape[0] != ks.shape[1],
    )
    return out.transpose(0, 1).to(q.dtype)
