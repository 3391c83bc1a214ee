"""Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent row per token, not per-head K and V.

A token's row is ``[c | k_pe]``: the normed ``kv_lora_rank`` compression ``c`` of the hidden state and the
``qk_rope_head_dim`` rotary key every head shares. Per head h, its key is ``[c W_UK_h | k_pe]`` and its value
``c W_UV_h`` (W_UK_h, W_UV_h: head h's columns of ``kv_b_proj``). The up-projections are absorbed into the query
and the output, as DeepSeek serves it:

    q_h . k_h = (q_nope_h W_UK_h^T) . c + q_pe_h . k_pe     ->  query [q_nope_h W_UK_h^T | q_pe_h] on row [c | k_pe]
    sum_j p_j v_jh = (sum_j p_j c_j) W_UV_h                 ->  attend the same row as value, keep its first r dims

so every step (decode and prefill chunks alike, against a cached prefix or not) is multi-query attention with ONE
KV head of width ``kv_lora_rank + qk_rope_head_dim``, through any attention backend, with the row as both key and
value (``k_cache is v_cache``); the softmax scale is the expanded heads' (``(nope + rope) ** -0.5``). Expanding
K and V for a prefill would cost ``kv_b_proj`` over the whole cached context per chunk; the absorbed form keeps
one code path for chunked prefill, prefix hits, recompute after preemption and the KV tier (the pool is generic).

Checkpoints that rotate interleaved pairs (``rope_interleave``: DeepSeek-V2 always, V3 by default) get their rope
rows de-interleaved at load: q and k move by the same permutation, so their dot products are unchanged and the
decoder's rotate-half RoPE applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ironlm.model.config import ModelConfig
from ironlm.model.layers import apply_rotary, rms_norm
from ironlm.model.linear import DenseLinear, Linear

if TYPE_CHECKING:
    from ironlm.attention import AttentionBackend, AttentionMetadata

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not config.rms_norm_eps
LATENT_NORM_EPS = 1e-6


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def deinterleave(width: int) -> torch.Tensor:
    """Index order (0, 2, 4, ..., 1, 3, 5, ...): interleaved rotary pairs -> rotate-half halves."""
    return torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])


def rope_rows(cfg: ModelConfig, rest: str) -> torch.Tensor | None:
    """For loaders that keep a file's blocks (finish_loading de-interleaves only the dense weights): the row order
    that de-interleaves the rope rows of the projection ``self_attn.<rest>`` ([out, in]), None when it has none or
    the checkpoint rotates halves already."""
    if not cfg.mla or not cfg.rope_interleave:
        return None
    assert cfg.qk_nope_head_dim is not None and cfg.qk_rope_head_dim is not None and cfg.kv_lora_rank is not None
    nope, rope, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if rest in ("q_proj.weight", "q_b_proj.weight"):  # [heads * (nope + rope), in]
        head = torch.cat([torch.arange(nope), nope + deinterleave(rope)])
        return torch.cat([h * (nope + rope) + head for h in range(cfg.num_heads)])
    if rest == "kv_a_proj_with_mqa.weight":  # [rank + rope, hidden]
        return torch.cat([torch.arange(rank), rank + deinterleave(rope)])
    return None


class LatentAttention(nn.Module):
    """One layer's MLA projections; weights [in, out] like the decoder's (HF [out, in] tensors load transposed)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        assert cfg.kv_lora_rank is not None
        h, heads = cfg.hidden_size, cfg.num_heads
        self.heads, self.rank = heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.interleaved = cfg.rope_interleave
        qk = self.nope + self.rope
        self.scale = cfg.scale
        bias = cfg.attention_bias
        self.q_weight = _param((h, heads * qk), dtype, device) if cfg.q_lora_rank is None else None
        self.q_a_weight = self.q_a_bias = self.q_a_norm = self.q_b_weight = None
        if cfg.q_lora_rank is not None:
            self.q_a_weight = _param((h, cfg.q_lora_rank), dtype, device)
            self.q_a_bias = _param((cfg.q_lora_rank,), dtype, device) if bias else None
            self.q_a_norm = _param((cfg.q_lora_rank,), dtype, device)
            self.q_b_weight = _param((cfg.q_lora_rank, heads * qk), dtype, device)
        self.kv_a_weight = _param((h, self.rank + self.rope), dtype, device)
        self.kv_a_bias = _param((self.rank + self.rope,), dtype, device) if bias else None
        self.kv_a_norm = _param((self.rank,), dtype, device)
        self.kv_b_weight = _param((self.rank, heads * (self.nope + self.v_dim)), dtype, device)
        # The projections as linears, built by finish_loading (quantize_ swaps them for quantized ones); kv_b stays
        # a dense tensor: its heads' slices are the absorbed W_UK / W_UV of the batched matmuls
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_b_proj: Linear | None = None
        self.kv_a_proj: Linear | None = None

    # ---- weights ---------------------------------------------------------------------------------------------
    def weight_target(self, rest: str) -> torch.Tensor | None:
        """The view an HF ``self_attn.<rest>`` tensor is copied into, in the checkpoint's shape."""
        targets = {
            "q_proj.weight": self.q_weight, "q_a_proj.weight": self.q_a_weight, "q_a_proj.bias": self.q_a_bias,
            "q_a_layernorm.weight": self.q_a_norm, "q_b_proj.weight": self.q_b_weight,
            "kv_a_proj_with_mqa.weight": self.kv_a_weight, "kv_a_proj_with_mqa.bias": self.kv_a_bias,
            "kv_a_layernorm.weight": self.kv_a_norm, "kv_b_proj.weight": self.kv_b_weight,
        }
        t = targets.get(rest)
        if t is None and rest in ("k_b_proj.weight", "v_b_proj.weight"):
            # llama.cpp's per-head halves of kv_b_proj: k_b [heads, rank, nope] (transposed), v_b [heads, v, rank]
            kv_b = self.kv_b_weight.view(self.rank, self.heads, self.nope + self.v_dim)
            return kv_b[:, :, :self.nope].transpose(0, 1) if rest[0] == "k" else kv_b[:, :, self.nope:].permute(1, 2, 0)
        return None if t is None else (t.t() if t.dim() == 2 else t)

    @staticmethod
    def weight_names(cfg: ModelConfig) -> list[str]:
        """``self_attn.`` suffixes a checkpoint provides (o_proj is the decoder layer's)."""
        kv_b = ["k_b_proj.weight", "v_b_proj.weight"] if cfg.source == "gguf" else ["kv_b_proj.weight"]
        names = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", *kv_b]
        names += (["q_proj.weight"] if cfg.q_lora_rank is None
                  else ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"])
        if cfg.attention_bias:
            names += ["kv_a_proj_with_mqa.bias"] + ([] if cfg.q_lora_rank is None else ["q_a_proj.bias"])
        return names

    @torch.no_grad()
    def finish_loading(self) -> None:
        self._deinterleave()
        if self.kv_a_proj is None:
            self.kv_a_proj = DenseLinear(self.kv_a_weight, self.kv_a_bias)
            if self.q_weight is not None:
                self.q_proj = DenseLinear(self.q_weight)
            else:
                assert self.q_a_weight is not None and self.q_b_weight is not None
                self.q_a_proj = DenseLinear(self.q_a_weight, self.q_a_bias)
                self.q_b_proj = DenseLinear(self.q_b_weight)

    def quantize_(self, make: Callable[[str, torch.Tensor, torch.Tensor | None], Linear], empty: nn.Parameter) -> None:
        """The projections (not kv_b) through `make(HF name under self_attn., weight [out, in], bias)`; their dense
        parameters are replaced by `empty`."""
        self.kv_a_proj = make("kv_a_proj_with_mqa.weight", self.kv_a_weight.t(), self.kv_a_bias)
        self.kv_a_weight = empty
        if self.q_weight is not None:
            self.q_proj = make("q_proj.weight", self.q_weight.t(), None)
            self.q_weight = empty
        else:
            assert self.q_a_weight is not None and self.q_b_weight is not None
            self.q_a_proj = make("q_a_proj.weight", self.q_a_weight.t(), self.q_a_bias)
            self.q_b_proj = make("q_b_proj.weight", self.q_b_weight.t(), None)
            self.q_a_weight = self.q_b_weight = empty

    def linears(self) -> list[Linear]:
        return [lin for lin in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj) if lin is not None]

    def _deinterleave(self) -> None:
        if not self.interleaved:
            return
        perm = deinterleave(self.rope).to(self.kv_a_weight.device)
        qk = self.nope + self.rope
        q = self.q_weight if self.q_weight is not None else self.q_b_weight
        assert q is not None
        cols = q.view(q.shape[0], self.heads, qk)[..., self.nope:]
        cols.copy_(cols[..., perm].clone())
        k = self.kv_a_weight[:, self.rank:]
        k.copy_(k[:, perm].clone())
        if self.kv_a_bias is not None:
            b = self.kv_a_bias[self.rank:]
            b.copy_(b[perm].clone())
        self.interleaved = False  # a second call must not permute again

    # ---- forward ---------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] (normed) -> the heads' attention output [T, heads * v_head_dim], o_proj's input."""
        t, heads, r = x.shape[0], self.heads, self.rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_norm, LATENT_NORM_EPS))
        q = q.view(t, heads, self.nope + self.rope)
        assert self.kv_a_proj is not None
        latent = self.kv_a_proj(x)
        cos, sin = rope
        row = torch.empty((t, 1, r + self.rope), dtype=x.dtype, device=x.device)
        row[:, 0, :r] = rms_norm(latent[:, :r].contiguous(), self.kv_a_norm, LATENT_NORM_EPS)
        row[:, :, r:] = apply_rotary(latent[:, None, r:], cos, sin)
        query = torch.empty((t, heads, r + self.rope), dtype=x.dtype, device=x.device)
        # q_nope_h W_UK_h^T for every head at once: [H, T, nope] @ [H, nope, r]
        kv_b = self.kv_b_weight.view(r, heads, self.nope + self.v_dim)
        w_uk = kv_b[:, :, : self.nope].permute(1, 2, 0)
        query[:, :, :r] = torch.bmm(q[:, :, : self.nope].transpose(0, 1), w_uk).transpose(0, 1)
        query[:, :, r:] = apply_rotary(q[:, :, self.nope:], cos, sin)
        out = backend.forward(query, row, row, cache, cache, meta, self.scale)
        # (sum_j p_j c_j) W_UV_h: [H, T, r] @ [H, r, v_dim]
        w_uv = kv_b[:, :, self.nope:].transpose(0, 1)
        o = torch.bmm(out[:, :, :r].transpose(0, 1), w_uv)
        return o.transpose(0, 1).reshape(t, heads * self.v_dim)
