"""Fused MoE for GPUs: a step's routed experts as two grouped GEMMs over token blocks sorted by expert.

`align` sorts the step's (token, choice) pairs by expert and pads each expert's run to a multiple of BLOCK_M, so
every BLOCK_M-row block belongs to one expert (`expert_ids[block]`, -1 past the last). It is torch ops only, with
no host sync: the grid is an upper bound on the block count (programs past the end exit at once), which also
keeps the launch shape fixed for a given batch size (CUDA graphs).

`fused_moe_kernel` is one program per (token block, N block): it reads its expert, gathers its rows of A by pair
id and multiplies them by that expert's weight tile. Two launches:
- gate_up: A = x (pair p reads token p // top_k), the gated activation applied in registers (two accumulators,
  gate and up columns n and n + I), into a per-pair intermediate `[P, I]`;
- down: A = that intermediate, times the pair's routing weight, into per-pair fp32 rows `[P, hidden]`.
The top-k contributions are then summed by a torch reduction over `[T, top_k, hidden]`, not atomic adds: the
order of the additions is fixed, so a token's output has the same bits on every run and in every batch.

Weights: ironlm's stacked `[E, in, out]` layout in fp32 / bf16 / fp16, or kernels/quant_matmul.py's weight-only
formats stacked per expert (int8 `[E, N, K]`, int4 `[E, N, K/2]`, scales `[E, N, K/group or 1]`), dequantized per
K tile in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ACTS = {"none": 0, "silu": 1, "gelu_tanh": 2, "swiglu_clamp": 3}


@triton.jit
def fused_moe_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    route_w_ptr,
    N,  # output columns (I for a gated gate_up: the weight has 2N)
    K,
    num_pairs,
    stride_am,
    stride_we,
    stride_wk,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    alpha,
    limit,
    ROW_DIV: tl.constexpr,  # top_k when A is x (a pair reads its token's row), 1 when A is per pair
    ACT: tl.constexpr,  # ACTS: 0 none, 1 silu(gate) * up, 2 gelu_tanh(gate) * up, 3 gpt-oss's clamped SwiGLU
    BITS: tl.constexpr,  # 16 dense, 8 / 4 weight-only
    GROUP: tl.constexpr,  # columns per scale; 0 = one per output row
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED: tl.constexpr,  # times the pair's routing weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP
    COMPUTE_F32: tl.constexpr,  # upcast after load (the interpreter's bf16 arithmetic is wrong)
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:
        return  # past the last padded block: the grid is an upper bound
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rm)
    m_ok = pair < num_pairs  # padding slots hold num_pairs
    pair64 = pair.to(tl.int64)
    a_rows = a_ptr + (pair64 // ROW_DIV)[:, None] * stride_am
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    w_cols = w_ptr + e64 * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    s_rows = s_ptr + e64 * stride_se + rn.to(tl.int64) * stride_sn
    up_w = N.to(tl.int64) * stride_wn  # the up half's columns sit N after the gate's
    up_s = N.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if COMPUTE_F32:
            a = a.to(tl.float32)
        w_mask = k_ok[:, None] & n_ok[None, :]
        if BITS == 16:
            w_off = kk[:, None] * stride_wk
        else:
            w_off = (kk[:, None] // (8 // BITS)) * stride_wk
        if GROUP == 0:
            s_off = 0
        else:
            s_off = k0 // GROUP
        w = _weight_tile(w_cols + w_off, s_rows + s_off, w_mask, n_ok, kk, BITS, a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if ACT != 0:
            w_up = _weight_tile(w_cols + up_w + w_off, s_rows + up_s + s_off, w_mask, n_ok, kk, BITS, a.dtype)
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b_row = bias_ptr + e64 * stride_be + rn
        acc += tl.load(b_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc_up += tl.load(b_row + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:
        acc = acc * tl.sigmoid(acc) * acc_up
    elif ACT == 2:
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0)) * acc_up
    elif ACT == 3:
        g = tl.minimum(acc, limit)
        u = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    if MUL_ROUTED:
        acc = acc * tl.load(route_w_ptr + pair, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair64[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _weight_tile(ptrs, s_ptrs, mask, n_ok, kk, BITS: tl.constexpr, DTYPE: tl.constexpr):
    """One [BLOCK_K, BLOCK_N] weight tile in the dot's dtype: loaded (dense) or dequantized (int8 / int4)."""
    if BITS == 16:
        w = tl.load(ptrs, mask=mask, other=0.0).to(DTYPE)
    else:
        if BITS == 8:
            q = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
        else:
            packed = tl.load(ptrs, mask=mask, other=0x88).to(tl.int32)
            q = ((packed >> ((kk[:, None] % 2) * 4)) & 0xF).to(tl.float32) - 8.0
        scale = tl.load(s_ptrs, mask=n_ok, other=0.0).to(tl.float32)
        w = (q * scale[None, :]).to(DTYPE)
    return w


@dataclass
class MoeWeights:
    """One projection of every (local) expert, stacked.

    Dense: `weight` `[E, K, N]` (ironlm's `[in, out]`). Weight-only (`bits` 8 / 4): `weight` int8 `[E, N, K]` or
    packed uint8 `[E, N, K / 2]` (quant_matmul's layout per expert), `scales` `[E, N, K / group or 1]`.
    `bias` `[E, N]` or None. For a gated gate_up, N is 2I: gate columns then up columns."""

    weight: torch.Tensor
    bits: int = 16
    group: int = 0
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8, 16):
            raise ValueError(f"bits must be 16 (dense), 8 or 4, got {self.bits}")
        if self.bits != 16 and self.scales is None:
            raise ValueError(f"{self.bits}-bit expert weights need scales")

    @property
    def k(self) -> int:
        if self.bits == 16:
            return self.weight.shape[1]
        return self.weight.shape[2] * (2 if self.bits == 4 else 1)

    @property
    def n(self) -> int:
        return self.weight.shape[2] if self.bits == 16 else self.weight.shape[1]

    def strides(self) -> tuple[int, int, int]:
        """(expert, k, n) element strides of `weight`."""
        w = self.weight
        return (w.stride(0), w.stride(1), w.stride(2)) if self.bits == 16 else (w.stride(0), w.stride(2), w.stride(1))


def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """An upper bound on the padded blocks: each expert that gets c pairs takes ceil(c / BLOCK_M) <= c / BLOCK_M + 1
    blocks, and at most min(E, pairs) experts get any."""
    return pairs // block_m + min(experts, pairs)


def align(ids: torch.Tensor, experts: int, block_m: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids `[T, top_k]` (global expert ids) -> (sorted_ids int32 `[B * BLOCK_M]`, expert_ids int32 `[B]`).

    sorted_ids lists the pairs (t * top_k + j) of local expert 0 (global `first`), padded with the pair count to a
    multiple of BLOCK_M, then those of expert 1, ...; pairs routed outside [first, first + experts) (other ranks'
    experts) are left out. expert_ids is each block's local expert, -1 for blocks past the last."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    nb = max_blocks(pairs, experts, block_m)
    local = flat - first
    key = torch.where((local >= 0) & (local < experts), local, experts)  # `experts`: not this rank's
    # not torch.bincount: on CUDA it reads the max back to size its output (a sync, and no CUDA-graph capture)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    run_start = torch.cumsum(counts, 0) - counts  # of each expert's run in `order`
    dest_start = torch.cat((ends - padded, ends.new_full((1,), nb * block_m)))  # the foreign bucket: a spare slot
    rank = torch.arange(pairs, device=flat.device) - run_start[sorted_key]
    dest = torch.where(sorted_key < experts, dest_start[sorted_key] + rank, nb * block_m)
    sorted_ids = torch.full((nb * block_m + 1,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(nb, device=flat.device) * block_m
    expert_ids = torch.searchsorted(ends, starts, right=True)
    expert_ids = torch.where(expert_ids < experts, expert_ids, -1).to(torch.int32)
    return sorted_ids[:-1], expert_ids


def interpreted() -> bool:
    """Whether this kernel was built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fused_moe_kernel, InterpretedFunction)


def tiles(pairs: int, experts: int, k: int, *groups: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16-row blocks while experts average at most 16 rows (decode: padding wastes the
    least), up to 64 for prefill; BLOCK_K divides every quantization group (0: none)."""
    per_expert = pairs / max(experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    block_k = 64 if k >= 64 and all(g % 64 == 0 for g in groups) else 32
    return block_m, 64, block_k


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 products (torch's own fp32 matmul does not use tf32 by default either)
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch(a: torch.Tensor, w: MoeWeights, out: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
            route_w: torch.Tensor, n: int, row_div: int, act: int, clamp: tuple[float, float] | None,
            blocks: tuple[int, int, int], compute_f32: bool, precision: str) -> None:
    block_m, block_n, block_k = blocks
    if w.bits != 16 and w.group and w.group % block_k:
        raise ValueError(f"BLOCK_K {block_k} does not divide the quantization group {w.group}")
    we, wk, wn = w.strides()
    s = w.scales
    grid = (expert_ids.shape[0], triton.cdiv(n, block_n))
    alpha, limit = clamp if clamp is not None else (1.0, 0.0)
    fused_moe_kernel[grid](
        a, w.weight, s if s is not None else a, w.bias if w.bias is not None else a, out, sorted_ids, expert_ids,
        route_w, n, w.k, route_w.numel(), a.stride(0), we, wk, wn,
        s.stride(0) if s is not None else 0, s.stride(1) if s is not None else 0,
        w.bias.stride(0) if w.bias is not None else 0, out.stride(0), float(alpha), float(limit),
        ROW_DIV=row_div, ACT=act, BITS=w.bits, GROUP=w.group, HAS_BIAS=w.bias is not None,
        MUL_ROUTED=act == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, COMPUTE_F32=compute_f32,
        DOT_PRECISION=precision,
    )


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: MoeWeights, down: MoeWeights,
              activation: str = "silu", clamp: tuple[float, float] | None = None, first: int = 0,
              blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_up_e(x[t]))) with e = ids[t, j] - first, over the local experts
    (`gate_up.weight.shape[0]` of them, global ids [first, first + E)); pairs routed elsewhere add nothing.

    x `[T, hidden]`, weights / ids `[T, top_k]`; `clamp` (alpha, limit) selects gpt-oss's clamped SwiGLU over
    `activation` (silu | gelu_tanh). Returns `[T, hidden]` in x's dtype. `blocks` overrides the tiles (tests)."""
    if clamp is None and activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"fused_moe has no activation {activation!r} (silu, gelu_tanh, or a clamp)")
    t, hidden = x.shape
    experts, inter = gate_up.weight.shape[0], gate_up.n // 2
    if gate_up.k != hidden or down.k != inter or down.n != hidden or down.weight.shape[0] != experts:
        raise ValueError(f"expert shapes gate_up {tuple(gate_up.weight.shape)} / down {tuple(down.weight.shape)} "
                         f"do not fit hidden {hidden}")
    top_k = ids.shape[1]
    pairs = t * top_k
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return out.to(x.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    blocks = blocks or tiles(pairs, experts, max(hidden, inter), gate_up.group, down.group)
    sorted_ids, expert_ids = align(ids, experts, blocks[0], first)
    route_w = weights.reshape(-1).float().contiguous()
    compute_f32 = x.dtype == torch.bfloat16 and interpreted()
    precision = "ieee" if compute_f32 else dot_precision(x.dtype)
    mid = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    act = ACTS["swiglu_clamp"] if clamp is not None else ACTS[activation]
    _launch(x, gate_up, mid, sorted_ids, expert_ids, route_w, inter, top_k, act, clamp, blocks, compute_f32,
            precision)
    _launch(mid, down, out, sorted_ids, expert_ids, route_w, hidden, 1, ACTS["none"], None, blocks, compute_f32,
            precision)
    return out.view(t, top_k, hidden).sum(1).to(x.dtype)
