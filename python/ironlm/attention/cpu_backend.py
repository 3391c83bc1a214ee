"""CPU attention: decode rows through the core's fused paged kernel, prefill chunks through the torch path.

At decode each sequence contributes one query row per head, so attention is all memory traffic. The torch
path gathers every sequence's pages into a padded buffer before SDPA (the cache is read, written and read
again); ``ironlm._core.paged_decode_attention`` reads each page once, in place, with the GIL released and
the sequences split across torch's thread count. It reads f32, bf16, fp16 and 8-bit (e4m3, e5m2) caches
(accumulating in f32); when every row of the step is a decode row it also writes the step's K/V into the cache in
the same call, so a decode step's attention is one call per layer. Short chunks that extend a cached sequence
(speculative verification rows) go to the kernel row by row too (`ROW_CHUNK_MAX`). Prefill chunks are matmul-shaped: plain causal bf16 ones go to
the core's tiled prefill kernel where the CPU has AVX-512 BF16 (`_core.prefill_attention`), the rest to SDPA, bf16
ones in bf16 (the torch backend, the kernels' reference, upcasts them to fp32). Steps where every
decode sequence starts with the same cached blocks (a shared system prompt, n > 1 forks) go to the torch path
whole: its cascade attention reads the shared blocks once for all sequences, where the kernel would read them
once each.

Under batch-invariant numerics (ironlm.invariant) every query row goes through the paged kernel, a prefill
row at position p as a decode row whose context ends at p: its softmax and weighted sum then run over exactly its
own keys in one fixed order, whether the row came alone, in a batch, in a chunk of any length, after a cached
prefix or in a recompute; and no step cascades.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ironlm import _core, invariant
from ironlm.attention.cpu_prefill import attend, serves
from ironlm.attention.metadata import AttentionMetadata
from ironlm.attention.torch_backend import (
    TorchAttention,
    _gather_blocks,
    _prefill_one,
    _PrefillSeq,
    _shared_blocks,
    has_padding_slots,
    plan_prefill,
    round_to_cache,
    write_kv_cache,
)
from ironlm.core_views import CACHE_DTYPES, CORE_DTYPES, FP8_DTYPES, as_numpy, widen

# Chunks of up to this many rows that extend a cached sequence (a speculative verification: the last token and its
# proposals; a short prefill tail) are attended row by row in the kernel, each row as a decode row at its own
# position: per sequence the torch path gathers its pages and runs SDPA, a fixed cost per sequence and layer that a
# step where 64 sequences verify pays 64 times (a plain decode step pays none). The kernel reads a chunk's cache
# rows once for all its rows, and a row gets the bits it would get decoding alone.
ROW_CHUNK_MAX = 16


@dataclass
class _CpuPlan:
    rows: torch.Tensor | None  # [n] kernel rows of q, None when every row of q is one, in order
    slots: np.ndarray | None  # [n] int64 cache slots of q's rows when every row is a decode row (else None)
    block_tables: np.ndarray  # [n, max_blocks] int32
    seq_lens: np.ndarray  # [n] int32
    prefill: list[_PrefillSeq]
    num_tokens: int
    has_padding_slots: bool | None


class CpuAttention(TorchAttention):
    name = "cpu"
    fused_decode_qkv = True  # decode_plan + _core.decode_attention_qkv: the model's lean decode step (model/lean.py)

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
        dtype, cache_dtype = CORE_DTYPES.get(q.dtype), CACHE_DTYPES.get(k_cache.dtype)
        fp8 = k_cache.dtype in FP8_DTYPES
        if q.device.type != "cpu" or dtype is None or cache_dtype is None or (
                q.dtype != k_cache.dtype and q.dtype != torch.float32 and not (fp8 and q.dtype == torch.bfloat16)):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks)
        route = _tiles(q, v, k_cache, window, softcap, sinks)  # once a layer: every chunk of the step alike
        codes = None
        if fp8:  # as the cache will hold them; the codes are what a prompt's write then copies
            codes = (k.to(k_cache.dtype), v.to(v_cache.dtype))
            k, v = widen(codes[0], k.dtype), widen(codes[1], v.dtype)
        elif not route[1]:
            # As the cache will hold them. Not needed where f32 chunks take the tiles over a bf16 cache: the cache
            # writes round them, and so does the tile kernel as it reads them.
            k, v = round_to_cache(k, v, k_cache)
        sk = None if sinks is None else _sink_view(sinks)
        if invariant.enabled():
            return self._per_row(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sk, dtype, cache_dtype)
        plan = self.decode_plan(meta, k_cache.shape[1], q.shape[0], window, cascade=sinks is None)
        if plan is None:
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, softcap=softcap)
        threads = torch.get_num_threads()
        kc, vc = as_numpy(k_cache), as_numpy(v_cache)
        # One latent cache (v_cache is k_cache) cannot be borrowed writable twice by the fused write: written first
        if plan.slots is not None and v_cache is not k_cache:  # all decode: write this step's K/V, attend, one call
            out = torch.empty(q.shape, dtype=q.dtype)
            _core.paged_decode_attention(
                as_numpy(q), kc, vc, plan.block_tables, plan.seq_lens, scale, as_numpy(out), threads,
                dtype=dtype, k=as_numpy(k), v=as_numpy(v), slot_mapping=plan.slots, window=window, softcap=softcap,
                sinks=sk, cache_dtype=cache_dtype)
            return out
        write_kv_cache(*(codes or (k, v)), k_cache, v_cache, meta.slot_mapping, plan.has_padding_slots)
        out = torch.zeros(q.shape, dtype=q.dtype) if plan.num_tokens < q.shape[0] else torch.empty(q.shape, dtype=q.dtype)
        if len(plan.seq_lens):
            qd = q if plan.rows is None else q.index_select(0, plan.rows)
            od = out if plan.rows is None else torch.empty(qd.shape, dtype=q.dtype)
            _core.paged_decode_attention(
                as_numpy(qd), kc, vc, plan.block_tables, plan.seq_lens, scale, as_numpy(od), threads, dtype=dtype,
                cache_dtype=cache_dtype, window=window, softcap=softcap, sinks=sk)
            if plan.rows is not None:
                out.index_copy_(0, plan.rows, od)
        for s in plan.prefill:
            _prefill(q, k, v, k_cache, v_cache, s, scale, window, softcap, sinks, out[s.start : s.end], route)
        return out

    def _per_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
                 softcap: float | None, sinks: np.ndarray | None, dtype: str, cache_dtype: str) -> torch.Tensor:
        """Every row of q through the paged kernel, each against its own causal context (see the module doc)."""
        if "cpu:rows" not in meta.plan_cache:
            meta.plan_cache["cpu:rows"] = _row_plan(meta, k_cache.shape[1], q.shape[0])
        plan: _RowPlan = meta.plan_cache["cpu:rows"]
        threads = torch.get_num_threads()
        kc, vc = as_numpy(k_cache), as_numpy(v_cache)
        if plan.slots is not None and v_cache is not k_cache:  # no padding rows: write K/V and attend, one call
            out = torch.empty(q.shape, dtype=q.dtype)
            _core.paged_decode_attention(
                as_numpy(q), kc, vc, plan.block_tables, plan.seq_lens, scale, as_numpy(out), threads, dtype=dtype,
                cache_dtype=cache_dtype, k=as_numpy(k), v=as_numpy(v), slot_mapping=plan.slots, window=window,
                softcap=softcap, sinks=sinks)
            return out
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, has_padding_slots(meta))
        out = torch.zeros(q.shape, dtype=q.dtype)
        n = len(plan.seq_lens)
        if n:
            _core.paged_decode_attention(
                as_numpy(q[:n]), kc, vc, plan.block_tables, plan.seq_lens, scale, as_numpy(out[:n]), threads,
                dtype=dtype, cache_dtype=cache_dtype, window=window, softcap=softcap, sinks=sinks)
        return out

    def lean_plan(self, meta: AttentionMetadata, block_size: int, num_rows: int) -> _CpuPlan | _RowPlan | None:
        """The lean step's attention (model/lean.py): one kernel row per query row, its K/V written first, or None
        where the step is not one it serves. A decode step is `decode_plan`'s; a step of short chunks that extend
        cached sequences (speculative verification: a sequence's last token and its proposals) runs each row as
        a decode row at its own position, so a row gets the same bits in a chunk as alone. Steps with a chunk
        that starts a sequence (prefill), padding rows, or prefixes the torch path would cascade over are not."""
        if meta.decode_only:
            plan = self.decode_plan(meta, block_size, num_rows)
            return plan if plan is not None and plan.slots is not None else None
        counts = np.diff(meta.query_start_loc_cpu.astype(np.int64))
        first = meta.seq_lens_cpu.astype(np.int64) - counts
        if not len(first) or first.min() < 1 or counts.max() > ROW_CHUNK_MAX:
            return None  # a chunk that starts a sequence, or one long enough for the chunk path (a prefill tail)
        if not invariant.enabled() and _shared_blocks(meta.block_tables.numpy(), np.arange(len(first)), first + 1,
                                                      block_size):
            return None  # as decode_plan: n > 1 forks read their shared prompt once on the torch path
        if "cpu:rows" not in meta.plan_cache:
            meta.plan_cache["cpu:rows"] = _row_plan(meta, block_size, num_rows)
        rows: _RowPlan = meta.plan_cache["cpu:rows"]
        return rows if rows.slots is not None and not has_padding_slots(meta) else None

    def decode_plan(
        self, meta: AttentionMetadata, block_size: int, num_rows: int, window: int | None = None,
        cascade: bool = True,
    ) -> _CpuPlan | None:
        """The step's plan (built by the first layer, memoised in the metadata, one per window size); None = the
        torch path serves it (its cascade attention; never with `cascade` False, as for layers with sinks)."""
        key = ("cpu" if window is None else f"cpu:{window}") + ("" if cascade else ":flat")
        if key not in meta.plan_cache:
            meta.plan_cache[key] = _make_plan(meta, block_size, num_rows, window, cascade)
        return meta.plan_cache[key]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             s: _PrefillSeq, scale: float, window: int | None, softcap: float | None, sinks: torch.Tensor | None,
             out: torch.Tensor, route: tuple[bool, bool]) -> None:
    """One prefill chunk into `out` (`route`: the layer's `_tiles`): plain causal bf16 chunks through the core's
    tiled kernel where this CPU runs it (`_core.prefill_attention`: AVX-512 BF16 dot products, 3-4x SDPA at
    64-1,024 tokens on a Zen 4); else through GEMMs (cpu_prefill) where they beat the torch path (soft-capped
    logits, sinks, narrow windows; see cpu_prefill.serves), else the torch path (SDPA in bf16 for bf16).

    f32 activations over a bf16 cache (a GGUF's quantized weights on a CPU with native bf16: kv_cache_dtype auto)
    take the tiles too, their queries rounded to bf16 as a bf16 model's are: the keys and values are already the
    cache's bf16 values, and the chunk costs 2.3-3.6x less than f32 SDPA (128-2,048 tokens, 9 / 3 heads of 64,
    2-core Zen 4), what a GGUF prompt's prefill spent most of its attention time on. The kernel reads the f32
    rows and writes the f32 output itself (the same bits as casting around a bf16 call, without the casts)."""
    tiles, wide = route
    if not tiles and not serves(q.dtype, s.end - s.start, s.seq_len, window, softcap, sinks):
        out.copy_(_prefill_one(q, k, v, k_cache, v_cache, s, scale, softcap, sinks, half=True))
        return
    if s.context_len == 0:  # as _prefill_one: the keys are exactly the chunk's new rows
        ks, vs = k[s.start : s.end], v[s.start : s.end]
    else:
        ks = _gather_blocks(k_cache, s.blocks, "k")[: s.seq_len]
        vs = ks if v_cache is k_cache else _gather_blocks(v_cache, s.blocks, "v")[: s.seq_len]
        if tiles and ks.dtype in FP8_DTYPES:  # 8-bit values are exact in bf16, the tiles' type
            ks = widen(ks, torch.bfloat16)
            vs = ks if v_cache is k_cache else widen(vs, torch.bfloat16)
    if tiles and wide:  # f32 q and out, K/V this chunk's f32 rows or the cache's bf16 ones
        _core.prefill_attention(as_numpy(q[s.start : s.end]), as_numpy(ks), as_numpy(vs), s.context_len, scale,
                                as_numpy(out), torch.get_num_threads(), dtype="float32",
                                kv_dtype=CORE_DTYPES[ks.dtype])
        return
    if tiles:
        _core.prefill_attention(as_numpy(q[s.start : s.end]), as_numpy(ks), as_numpy(vs), s.context_len, scale,
                                as_numpy(out), torch.get_num_threads())
        return
    attend(q[s.start : s.end], ks, vs, s.context_len, scale, window, softcap, sinks, out=out)


def _tiles(q: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, window: int | None, softcap: float | None,
           sinks: torch.Tensor | None) -> tuple[bool, bool]:
    """Whether prefill chunks take the core's tiles, and whether as f32 rows over a bf16 or 8-bit cache (then
    both). An 8-bit cache's values are exact in bf16, so its chunks take the tiles as a bf16 cache's do."""
    wide = q.dtype == torch.float32 and (k_cache.dtype == torch.bfloat16 or k_cache.dtype in FP8_DTYPES)
    tiles = ((q.dtype == torch.bfloat16 or wide) and window is None and softcap is None and sinks is None
             and _core.prefill_attention_serves(q.shape[2], v.shape[2]))
    return tiles, tiles and wide


def _sink_view(sinks: torch.Tensor) -> np.ndarray:
    """The kernel's f32 [Hq] sinks (a view when the parameter is already f32 and contiguous)."""
    return np.ascontiguousarray(sinks.detach().to(torch.float32).numpy(), dtype=np.float32)


@dataclass
class _RowPlan:
    block_tables: np.ndarray  # [n, max_blocks] int32: each row's sequence's table
    seq_lens: np.ndarray  # [n] int32: keys row i sees, its position + 1
    slots: np.ndarray | None  # [n] int64 cache slots when q has no padding rows (else None)


def _kernel_rows(meta: AttentionMetadata, seqs: np.ndarray, block_size: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One kernel row per query row of the sequences `seqs` (ascending): row j of a sequence's chunk sits at
    position context + j. Returns the rows' indices in q, their int32 seq_lens (keys each sees) and block tables."""
    qsl = meta.query_start_loc_cpu.astype(np.int64)
    counts = np.diff(qsl)
    first = meta.seq_lens_cpu.astype(np.int64) - counts + 1  # keys a chunk's first row sees
    n = counts[seqs]
    seq = np.repeat(seqs, n)
    offset = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # each row's index in its chunk
    seq_lens = np.ascontiguousarray(first[seq] + offset, dtype=np.int32)
    width = int(-(-seq_lens.max(initial=0) // block_size))
    tables = np.ascontiguousarray(meta.block_tables.numpy()[seq, :width], dtype=np.int32)
    return qsl[seq] + offset, seq_lens, tables


def _row_plan(meta: AttentionMetadata, block_size: int, num_rows: int) -> _RowPlan:
    """One kernel row per query row (`_kernel_rows` of every sequence)."""
    _, seq_lens, tables = _kernel_rows(meta, np.arange(len(meta.query_start_loc_cpu) - 1), block_size)
    slots = None
    if int(meta.query_start_loc_cpu[-1]) == num_rows and meta.slot_mapping.shape[0] == num_rows:
        slots = np.ascontiguousarray(meta.slot_mapping.numpy(), dtype=np.int64)
    return _RowPlan(tables, seq_lens, slots)


def _make_plan(meta: AttentionMetadata, block_size: int, num_rows: int, window: int | None = None,
               cascade: bool = True) -> _CpuPlan | None:
    """The step's plan, or None when the torch path's cascade attention serves it better (never under a window,
    where the torch path does not cascade, nor without `cascade`). Decode rows and the rows of short chunks that
    extend a cached sequence (`ROW_CHUNK_MAX`) go to the kernel, one kernel row per query row; longer chunks and
    chunks that start a sequence are prefill."""
    qsl = meta.query_start_loc_cpu.astype(np.int64)
    counts = np.diff(qsl)
    first = meta.seq_lens_cpu.astype(np.int64) - counts + 1  # keys the chunk's first row sees
    kernel = (counts == 1) | ((counts <= ROW_CHUNK_MAX) & (first > 1))
    seqs = np.nonzero(kernel)[0]
    if cascade and window is None and not invariant.enabled() and _shared_blocks(meta.block_tables.numpy(), seqs,
                                                                                 first, block_size):
        return None
    idx, seq_lens, tables = _kernel_rows(meta, seqs, block_size)
    rows = None if len(idx) == num_rows else torch.from_numpy(idx)
    # only the chunks the kernel does not take: a verification chunk's mask is never built
    prefill = plan_prefill(meta, block_size, torch.device("cpu"), window, seqs=np.nonzero((counts > 1) & ~kernel)[0])
    slots = None
    if rows is None and len(idx) and meta.slot_mapping.shape[0] == num_rows:
        slots = np.ascontiguousarray(meta.slot_mapping.numpy(), dtype=np.int64)
    return _CpuPlan(rows, slots, tables, seq_lens, prefill, int(qsl[-1]), has_padding_slots(meta))
