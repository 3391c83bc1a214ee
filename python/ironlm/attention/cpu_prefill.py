"""CPU prefill attention through GEMMs: one sequence's chunk of query rows against its keys.

torch's CPU flash kernel (SDPA) runs a 512-token bf16 prompt at ~30 GFLOP/s on this project's Xeon, where its
bf16 GEMMs (oneDNN, AMX tiles) reach 400-880: the flash kernel's small blocks and per-block softmax bookkeeping
cost more than the products. Here the chunk is cut into tiles of query rows; a tile's scores against all the
keys it may see are one batched GEMM per KV head group (the G query heads of a KV head are G rows each of the
tile's positions, so K and V are read as they are, never repeated), then a whole-row softmax, then one GEMM with V.

Numerics follow SDPA's bf16 path: Q·Kᵀ of bf16 inputs in f32 (the products of bf16 values are exact in f32, so
this is the flash kernel's own f32 accumulation), the softmax in f32, the probabilities rounded to bf16 for the
P·V GEMM, which accumulates in f32 and rounds the output once. An f32 chunk stays f32 throughout; fp16 is
attended in f32 (no fp16 GEMM units here).

Keys past a tile's last position (causal) or before its first row's window are not multiplied at all, so a
causal prompt costs about half its square. Memory is bounded: a tile holds at most SCORE_ELEMS f32 scores.
"""

from __future__ import annotations

import math

import torch

from ironlm.attention.torch_backend import _WS

# f32 scores held by one tile, all heads together (16 MiB): the tile's query positions shrink as the context
# grows, so a 32k-token context still takes ~14 positions at a time for 9 query heads.
SCORE_ELEMS = 1 << 22
# Query positions a tile takes at most (bounded by SCORE_ELEMS too). Measured: see benches/bench_prefill_attention.py.
TILE_ROWS = 128
DTYPES = (torch.bfloat16, torch.float32, torch.float16)
# A windowed chunk without softcap or sinks comes here once its keys span this many windows: SDPA (with the
# plan's bool mask) multiplies every key, this path only the band each tile sees. Measured (one thread, loaded
# machine, 128-token window): 1.76x faster at 2,048 keys (16 windows), 0.5-0.7x at 512-1,024 (4-8), 1.45x
# at 640 (5, noise); so 16.
WINDOW_SPAN = 16


def serves(dtype: torch.dtype, rows: int, seq_len: int, window: int | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> bool:
    """Whether a chunk of `rows` query rows over `seq_len` keys is attended here rather than on the torch path.

    Measured with benches/bench_prefill_attention.py (bf16, 9 / 3 heads of 64, one thread, on a loaded
    machine: ratios only): plain causal chunks stay on SDPA, whose fused flash kernel beats these unfused
    GEMMs and softmax passes (0.2-0.9x here at L = 32-2048 with and without a 512-token prefix, one 1.3x at
    L = 512 in the noise); soft-capped logits and sinks, which SDPA cannot express, come here from the
    explicit softmax (which repeats K/V per query head and multiplies and masks the whole square): softcap
    1.1x at L = 32, 1.9-7.5x at 128-2048; sinks 1.1-1.2x at 32-128, 2-8x at 512-2048; a 128-token window
    with sinks (gpt-oss's sliding layers) 1.2x at 32, 3.3-61x at 512-2048; and windows WINDOW_SPAN times
    narrower than the keys."""
    if dtype not in DTYPES or rows < 2:
        return False
    if softcap is not None or sinks is not None:
        return True
    return window is not None and seq_len >= WINDOW_SPAN * window


def attend(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, context_len: int, scale: float,
           window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, Hq, D] at positions context_len .. context_len + n - 1 against keys / values ks, vs [S, Hkv, D]
    (S = context_len + n, position order) -> [n, Hq, D] in q's dtype, written into `out` when given.

    `window`: query p sees keys (p - window, p]; `softcap`: logits cap * tanh(logits / cap) before the mask;
    `sinks` [Hq]: one extra logit per head in each row's softmax denominator (no value row)."""
    n, hq, d = q.shape
    seq_len, hkv, dv = ks.shape[0], ks.shape[1], vs.shape[2]
    if seq_len != context_len + n or vs.shape[0] != seq_len:
        raise ValueError(f"keys cover {seq_len} positions, values {vs.shape[0]}, expected {context_len + n}")
    g = hq // hkv
    f32 = torch.float32
    half = q.dtype == torch.bfloat16
    # Queries grouped by KV head, position-major within a head (row j * G + i is position j's i-th query head),
    # so a tile of positions is a contiguous row range; the scale is folded into this f32 copy.
    qg = torch.empty(hkv, n, g, d, dtype=f32)
    qg.copy_(q.view(n, hkv, g, d).transpose(0, 1))
    qg.mul_(scale)
    kf = ks.transpose(0, 1).to(f32).contiguous()  # [Hkv, S, D]: Kᵀ as the GEMM's transposed operand
    pv = q.dtype if half else f32
    vf = vs.transpose(0, 1).to(pv).contiguous()  # [Hkv, S, D]
    dst = torch.empty(n, hkv, g, dv, dtype=q.dtype) if out is None else out.view(n, hkv, g, dv)
    sink = None if sinks is None else sinks.detach().to(f32).view(hkv, 1, g, 1)
    rows = max(1, min(TILE_ROWS, SCORE_ELEMS // (hq * seq_len)))
    for j0 in range(0, n, rows):
        j1 = min(n, j0 + rows)
        t = j1 - j0
        p0, p1 = context_len + j0, context_len + j1  # this tile's positions p0 .. p1 - 1
        lo = 0 if window is None else max(0, p0 - window + 1)  # the first key any row of the tile sees
        shape = (hkv, t * g, p1 - lo)
        s = _buf("pf:s", shape, f32)
        torch.bmm(qg[:, j0:j1].reshape(hkv, t * g, d), kf[:, lo:p1].transpose(1, 2), out=s)
        if softcap is not None:
            s.div_(softcap).tanh_().mul_(softcap)
        s4 = s.view(hkv, t, g, p1 - lo)
        _mask(s4, p0, lo, window)
        if sink is None:
            p = torch.softmax(s, dim=-1, out=_buf("pf:p", shape, f32))
        else:  # the max includes the sink, so a sink far above the logits cannot overflow
            top = torch.maximum(s4.amax(dim=-1, keepdim=True), sink)
            s4.sub_(top).exp_()
            s4.div_(s4.sum(dim=-1, keepdim=True).add_(torch.exp(sink - top)))
            p = s
        if pv != f32:
            p = _buf("pf:pb", shape, pv).copy_(p)
        o = torch.bmm(p, vf[:, lo:p1], out=_buf("pf:o", (hkv, t * g, dv), pv))
        dst[j0:j1].copy_(o.view(hkv, t, g, dv).transpose(0, 1))
    return dst.view(n, hq, dv)


def _buf(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer: a fresh multi-MiB score tile per layer would cost more in page faults than its softmax."""
    return _WS.get(key, math.prod(shape), dtype, torch.device("cpu")).view(shape)


def _mask(s: torch.Tensor, p0: int, lo: int, window: int | None) -> None:
    """-inf into a tile's scores s [Hkv, T, G, keys lo ..] where row t (position p0 + t) must not look: keys past
    p0 + t (the last T - 1 columns) and, under a window, keys at or before p0 + t - window (the first ones)."""
    t = s.shape[1]
    if t > 1:  # column p0 - lo + c is key p0 + c: hidden from rows t < c
        future = torch.ones(t, t, dtype=torch.bool).triu_(1)
        s[..., p0 - lo :].masked_fill_(future.view(t, 1, t), float("-inf"))
    if window is not None:
        off = p0 - window + 1 - lo  # row t sees columns >= t + off
        width = min(s.shape[-1], t - 1 + off)
        if width > 0:
            cols = torch.arange(width)
            old = cols[None, :] < (torch.arange(t)[:, None] + off)
            s[..., :width].masked_fill_(old.view(t, 1, width), float("-inf"))
