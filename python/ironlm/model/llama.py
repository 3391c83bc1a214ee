"""The one decoder ironlm runs, for every registered family (see registry.py), driven by `ModelConfig`.

The forward pass takes ONE flat token batch (no padding, no batch dimension) of all scheduled sequences, writes
their K/V into the paged cache through the attention backend, and returns logits only for `logits_indices`.

Weights are stored fused — q|k|v in one matrix, gate|up in one matrix — so each layer runs 4 GEMMs — and
transposed ([in, out], used as `x @ W`): on CPU, MKL runs the small-M GEMMs of decode batches 15-40% faster in
this layout than with [out, in] weights (equal at large M). They are allocated once at their final dtype/device
and filled slice by slice while loading (weights.py), so loading never keeps a second full copy of the model.
Tied embeddings share one tensor ([vocab, hidden], also the lm_head). Small CPU decode batches of the blocks lean.py
implements (`ModelConfig.lean_supported`) take the lean step instead of `forward`'s op chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ironlm import _core, invariant
from ironlm.core_views import CORE_DTYPES, as_numpy, core_ok
from ironlm.exceptions import UnsupportedModelError
from ironlm.model import lean, weights
from ironlm.model.config import ModelConfig
from ironlm.model.layers import CoreRope, RotaryEmbedding, act_and_mul, apply_rotary, rms_norm
from ironlm.model.linear import QUANTIZED_LINEARS, DenseLinear, Linear, QuantizedLinear
from ironlm.model.mla import LatentAttention
from ironlm.model.moe.experts import MoeBlock
from ironlm.model.quantize import QuantSpec
from ironlm.model.quantized import quantize_core, quantize_gpu

if TYPE_CHECKING:
    from ironlm.attention import AttentionBackend, AttentionMetadata
    from ironlm.distributed.group import TPGroup

Rope = CoreRope | tuple[torch.Tensor, torch.Tensor] | None


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None,
                 index: int = 0, rotary: int | None = 0) -> None:
        super().__init__()
        self.window = cfg.layer_windows[index]  # sliding-window attention span in tokens; None = full causal
        self.rotary = rotary  # index into DecoderLM.rotaries; None = a NoPE layer
        self.rotary_dim = cfg.rotary_dim
        # Tensor parallel: o and down yield partial sums that one all-reduce each completes; only rank 0 adds the
        # residual (and o's bias) into its partial, so the sum carries it exactly once.
        self.tp = tp
        self.owns_residual = tp is None or tp.rank == 0
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = q, kv
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.scale
        self.softcap = cfg.attn_softcap
        self.activation = cfg.activation
        self.residual_scale = cfg.residual_scale

        def norm(present: bool, width: int = h) -> nn.Parameter | None:
            return _param((width,), dtype, device) if present else None

        # [in, out] layouts; HF [out, in] tensors are copied into transposed views (see weights.weight_target)
        self.input_norm = norm(cfg.pre_attn_norm)
        # Latent attention (DeepSeek) has its own projections (mla.py); o_proj stays here, over its heads' output
        self.mla = LatentAttention(cfg, dtype, device) if cfg.mla else None
        self.attn_out_size = cfg.attn_out_size
        fused_qkv = 0 if cfg.mla else q + 2 * kv
        self.qkv_weight = _param((h, fused_qkv), dtype, device)
        self.qkv_bias = _param((fused_qkv,), dtype, device) if cfg.attention_bias and not cfg.mla else None
        self.o_weight = _param((cfg.attn_out_size, h), dtype, device)
        self.o_bias = _param((h,), dtype, device) if cfg.attention_out_bias else None
        # gpt-oss's sinks, one per query head, in fp32 whatever the model dtype: the kernels read them as f32
        if cfg.attn_sinks and tp is not None:
            raise UnsupportedModelError("attention sinks do not run tensor parallel")
        self.sinks = _param((cfg.num_heads,), torch.float32, device) if cfg.attn_sinks else None
        # qk-norm per head ([head_dim] weights, Qwen3) or over the whole projection (OLMo 2: [q_size], [kv_size])
        self.qk_norm_full = cfg.qk_norm and cfg.qk_norm_full
        # Under TP a rank holds some heads of that width (and its slice of the norm weights, see ShardSpec): the
        # sums of squares are all-reduced, k's only where the KV heads split (a KV head replicated on every rank
        # is whole there already), as vLLM's OLMo 2 does.
        self.qk_norm_ranks = self.qk_norm_full and tp is not None
        self.k_norm_split = tp is not None and tp.shard.num_kv_heads < tp.shard.config.num_kv_heads
        self.q_norm = norm(cfg.qk_norm, q if self.qk_norm_full else cfg.head_dim)
        self.k_norm = norm(cfg.qk_norm, kv if self.qk_norm_full else cfg.head_dim)
        self.qk_norm_weight: torch.Tensor | None = None  # [Hq + Hkv, D], built by finish_loading
        self._lean_views: lean.LayerViews | None = None  # numpy views of the norms for the lean CPU step
        self._qk_np: tuple[np.ndarray, np.ndarray] | None = None
        self.attn_out_norm = norm(cfg.post_attn_norm)
        self.post_norm = norm(cfg.pre_mlp_norm)  # before the MLP (Llama's post_attention_layernorm)
        self.mlp_out_norm = norm(cfg.post_mlp_norm)
        # A MoE layer's MLP is the block (its experts, router, shared expert); the dense MLP weights stay empty
        self.moe: MoeBlock | None = None
        if cfg.moe is not None and cfg.moe.sparse_layers[index]:
            if tp is not None and cfg.moe.local_experts is None:  # ShardSpec refuses this first
                raise UnsupportedModelError("mixture-of-experts layers run across ranks only with "
                                            "--enable-expert-parallel")
            self.moe = MoeBlock(h, cfg.moe, dtype, device, cfg.activation, clamp=cfg.swiglu_clamp)
            inter = 0
        self.gate_up_weight = _param((h, 2 * inter), dtype, device)
        self.down_weight = _param((inter, h), dtype, device)
        # The residual add goes into the o / down GEMMs unless the branch is normed or scaled before it
        self.fuse_attn_residual = not cfg.post_attn_norm and cfg.residual_scale is None
        self.fuse_mlp_residual = not cfg.post_mlp_norm and cfg.residual_scale is None
        # The four matmuls, built over the dense parameters by finish_loading unless a quantizing loader set them
        self.qkv: Linear | None = None
        self.o: Linear | None = None
        self.gate_up: Linear | None = None
        self.down: Linear | None = None

    def finish_loading(self) -> None:
        if self.mla is not None:
            self.mla.finish_loading()
        if self.qkv is None:
            self.qkv = DenseLinear(self.qkv_weight, self.qkv_bias)
        if self.o is None:
            self.o = DenseLinear(self.o_weight, self.o_bias)
        if self.gate_up is None:
            self.gate_up = DenseLinear(self.gate_up_weight)
        if self.down is None:
            self.down = DenseLinear(self.down_weight)
        if self.moe is not None:
            self.moe.finish_loading()
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_full:
            self.qk_norm_weight = torch.cat(
                [self.q_norm.expand(self.num_heads, -1), self.k_norm.expand(self.num_kv_heads, -1)]
            ).contiguous()

    def _qkv(self, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projection, qk-norm and rotary: q [T, Hq, D], k and v [T, Hkv, D]."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = h if self.input_norm is None else rms_norm(h, self.input_norm, self.eps)
        assert self.qkv is not None
        qkv = self.qkv(x)
        if isinstance(rope, CoreRope) or (rope is None and core_ok(qkv)):
            # CPU: qk-norm and RoPE in place inside the projection's output, by the lean decode step's kernels;
            # q, k, v stay views of it.
            if self.qk_norm_ranks:
                self.qk_norm_across_ranks(qkv)
            elif self.q_norm is not None:
                self._core_qk_norm(qkv)
            if rope is not None:
                rope.apply_(qkv, hq + hkv, d)
            q, k, v = qkv.view(t, hq + 2 * hkv, d).split((hq, hkv, hkv), dim=1)
            return q, k, v
        qk = qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        if self.qk_norm_weight is not None:
            qk = rms_norm(qk, None, self.eps).mul_(self.qk_norm_weight)
        elif self.qk_norm_ranks:
            self.qk_norm_across_ranks(qkv)  # in place: qk is a view of it
        elif self.qk_norm_full:
            assert self.q_norm is not None and self.k_norm is not None
            q_part, k_part = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            qk = torch.cat([rms_norm(q_part, self.q_norm, self.eps), rms_norm(k_part, self.k_norm, self.eps)],
                           dim=1).view(t, hq + hkv, d)
        if rope is not None:
            if self.rotary_dim is None:
                qk = apply_rotary(qk, *rope)  # q and k rotated together: one set of kernels
            else:  # partial rotary: the first rotary_dim dims of each head turn, the rest pass through
                rd = self.rotary_dim
                qk = torch.cat([apply_rotary(qk[..., :rd], *rope), qk[..., rd:]], dim=-1)
        return qk[:, :hq], qk[:, hq:], v

    def qk_norm_np(self) -> tuple[np.ndarray, np.ndarray] | None:
        """numpy views of the q and k norm weights ([head_dim] each, or the projections' widths), or None."""
        if self.q_norm is None or self.k_norm is None:
            return None
        if self._qk_np is None:
            self._qk_np = (as_numpy(self.q_norm.data), as_numpy(self.k_norm.data))
        return self._qk_np

    def qk_norm_across_ranks(self, qkv: torch.Tensor) -> None:
        """The whole-projection qk-norm of this rank's heads, in place in `qkv` [T, q + 2 kv]: the statistics of
        the full width, summed over the ranks (one all-reduce), in fp32 as HF's Olmo2RMSNorm."""
        assert self.tp is not None and self.q_norm is not None and self.k_norm is not None
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        qf, kf = q.float(), k.float()
        q_ss, k_ss = qf.square().sum(-1, keepdim=True), kf.square().sum(-1, keepdim=True)
        world = self.tp.world
        # Each rank's sum counts its heads; the total counts a KV head once per rank holding it (GQA groups wider
        # than a rank), so world x this rank's width is the full width times that count: the mean is exact.
        if self.k_norm_split:
            ss = torch.cat([q_ss, k_ss], dim=1)
            self.tp.all_reduce(ss)
            q_ss, k_ss = ss[:, :1], ss[:, 1:] / (world * self.kv_size)
        else:
            self.tp.all_reduce(q_ss)
            k_ss = k_ss / self.kv_size
        q_var = q_ss / (world * self.q_size)
        q.copy_(qf * torch.rsqrt(q_var + self.eps) * self.q_norm.float())
        k.copy_(kf * torch.rsqrt(k_ss + self.eps) * self.k_norm.float())

    def _core_qk_norm(self, qkv: torch.Tensor) -> None:
        weights = self.qk_norm_np()
        assert weights is not None
        _core.qk_norm_inplace(as_numpy(qkv), *weights, self.eps, self.q_size, self.kv_size, CORE_DTYPES[qkv.dtype])

    def _residual(self, h: torch.Tensor, out: Linear, x: torch.Tensor, fused: bool,
                  norm: torch.Tensor | None) -> torch.Tensor:
        """h + [residual_scale *] [norm(] out(x) [)], the add fused into the GEMM when nothing comes between."""
        if fused:
            h = out(x, residual=h if self.owns_residual else None)
            if self.tp is not None:
                self.tp.all_reduce(h)
            return h
        return self._add(h, out(x), norm)

    def _add(self, h: torch.Tensor, branch: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """h + [residual_scale *] [norm(] branch [)], for a branch whose residual add could not be fused."""
        if self.tp is not None:  # the norm needs the whole sum; the residual is added once, after it
            self.tp.all_reduce(branch)
        if norm is not None:
            branch = rms_norm(branch, norm, self.eps)
        if self.residual_scale is not None:
            branch = branch * self.residual_scale
        return h + branch

    def forward(
        self,
        h: torch.Tensor,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        select: torch.Tensor | None,
    ) -> torch.Tensor:
        """`rope` is the core's in-place RoPE (CPU), the step's (cos, sin) for the torch path, or None (NoPE)."""
        t = h.shape[0]
        if self.mla is not None:
            assert isinstance(rope, tuple)  # the model hands latent layers the (cos, sin) pair
            x = h if self.input_norm is None else rms_norm(h, self.input_norm, self.eps)
            attn = self.mla(x, rope, kv_cache[0], meta, backend)
        else:
            q, k, v = self._qkv(h, rope)
            k_cache, v_cache = kv_cache
            extra: dict[str, Any] = {}
            if self.window is not None:
                extra["window"] = self.window
            if self.softcap is not None:
                extra["softcap"] = self.softcap
            if self.sinks is not None:
                extra["sinks"] = self.sinks
            attn = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, **extra)
            attn = attn.reshape(t, self.q_size)
        if select is not None:  # last layer: only the rows whose logits are wanted go on
            attn = attn.index_select(0, select)
            h = h.index_select(0, select)
        assert self.o is not None and self.gate_up is not None and self.down is not None
        h = self._residual(h, self.o, attn, self.fuse_attn_residual, self.attn_out_norm)
        x = h if self.post_norm is None else rms_norm(h, self.post_norm, self.eps)
        if self.moe is not None:
            return self._add(h, self.moe(x), self.mlp_out_norm)
        x = act_and_mul(self.gate_up(x), self.activation)
        return self._residual(h, self.down, x, self.fuse_mlp_residual, self.mlp_out_norm)


class DecoderLM(nn.Module):
    """Causal LM over a paged KV cache. See the module docstring for the calling convention."""

    batch_invariant = False  # EngineConfig.batch_invariant: each forward runs in ironlm.invariant's scope

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        attn_backend: AttentionBackend | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        """`config` is this rank's share of the model under tensor parallelism (`tp`; see ironlm.distributed)."""
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.tp = tp
        self.dtype = dtype
        self.device = device
        self.embed = _param((config.vocab_size, config.hidden_size), dtype, device)
        # One rotary per distinct rope config (Gemma 3's local layers have their own base), shared by its layers
        rope_cfgs: list[ModelConfig] = []
        layer_rotary: list[int | None] = []
        for i in range(config.num_layers):
            if config.rope_layers is not None and not config.rope_layers[i]:
                layer_rotary.append(None)
                continue
            rc = config.rotary_config(i)
            if rc not in rope_cfgs:
                rope_cfgs.append(rc)
            layer_rotary.append(rope_cfgs.index(rc))
        rope_cfgs = rope_cfgs or [config]
        self.rotaries = [RotaryEmbedding(self._rotary_shape(rc), dtype, device) for rc in rope_cfgs]
        self.rotary = self.rotaries[0]
        self.layers = nn.ModuleList([DecoderLayer(config, dtype, device, tp, i, r)
                                     for i, r in enumerate(layer_rotary)])
        self.norm = _param((config.hidden_size,), dtype, device)
        if config.num_labels:  # a sequence-classification checkpoint: its score head stands in for the LM head
            self.lm_head = _param((config.num_labels, config.hidden_size), dtype, device)
        elif config.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = _param((config.vocab_size, config.hidden_size), dtype, device)
        self.head: Linear | None = None  # the LM head; dense over lm_head unless quantized
        self.embed_q: QuantizedLinear | None = None  # a quantized embedding table (the head's blocks when tied)
        self.quant: QuantSpec = QuantSpec()
        if attn_backend is None:
            attn_backend = _default_backend(device)
        self.attn_backend = attn_backend
        self._loaded: set[str] = set()
        self._lean: dict[int, lean.LeanBuffers] = {}
        self._kv_np: tuple[list, list[tuple[np.ndarray, np.ndarray]]] | None = None
        self._lean_stack: lean.Stack | bool | None = None  # every layer as one core call (lean.stack); False: not this model
        self.eval()

    @staticmethod
    def _rotary_shape(cfg: ModelConfig) -> ModelConfig:
        if cfg.rotary_dim is None or cfg.rotary_dim == cfg.head_dim:
            return cfg
        from dataclasses import replace

        return replace(cfg, head_dim=cfg.rotary_dim, rotary_dim=None)

    # ---- attention backend ---------------------------------------------------------------------------------
    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.attn_backend = backend

    # ---- weights (weights.py) ------------------------------------------------------------------------------
    def expected_weights(self) -> list[str]:
        """ironlm (HF-style) parameter names a checkpoint must provide."""
        return weights.expected_weights(self.config)

    def weight_target(self, name: str) -> torch.Tensor | None:
        """The view of a parameter the ironlm-named tensor `name` goes into, in the checkpoint's own shape (an HF
        checkpoint's names pass through `weights.canonical` first)."""
        return weights.weight_target(self, name)

    def load_weight(self, name: str, tensor: Any, shape: tuple[int, ...] | None = None) -> bool:
        """Copy one HF-named tensor into place (see weights.load_weight). False if ironlm ignores it."""
        return weights.load_weight(self, name, tensor, shape)

    def mark_loaded(self, name: str) -> None:
        """For loaders that fill `weight_target(name)` themselves."""
        self._loaded.add(name)

    def finish_loading(self) -> None:
        """Check every weight arrived and build the derived tensors."""
        missing = [n for n in self.expected_weights() if n not in self._loaded]
        if missing:
            more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {', '.join(missing[:8])}{more}")
        for layer in self.layers:
            layer.finish_loading()  # type: ignore[operator]
        if self.head is None:
            self.head = DenseLinear(self.lm_head.t())
        self._loaded.clear()

    # ---- quantized storage (quantized.py) ------------------------------------------------------------------
    def quantize_(self, spec: QuantSpec, parts: dict[str, _core.QuantMatrix] | None = None) -> None:
        """Keep the linears block-quantized and drop their dense storage. `parts` are HF-named matrices a
        loader built from the file's own blocks (GGUF); without them the loaded dense weights are quantized."""
        if spec.backend != "core":
            quantize_gpu(self, spec)
        else:
            quantize_core(self, spec, parts)

    def weight_bytes(self) -> int:
        """Resident bytes of the weights as stored (quantized blocks, dense tensors, each counted once)."""
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        linears = [self.head, self.embed_q] + [lin for layer in layers
                                                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        linears += [lin for layer in layers if layer.moe is not None for lin in layer.moe.linears()]
        linears += [lin for layer in layers if layer.mla is not None for lin in layer.mla.linears()]
        seen: set[int] = set()
        total = 0
        for lin in linears:
            if isinstance(lin, QUANTIZED_LINEARS) and id(lin) not in seen:
                seen.add(id(lin))
                total += lin.nbytes
        for t in self.parameters():
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self._lookup(input_ids)
        if self.config.embed_scale is not None:  # in the activation dtype, as transformers rounds it
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        return h

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self._embed_parallel(input_ids, self.tp)
        if self.embed_q is not None:
            return self.embed_q.embed(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.embed)

    def _embed_parallel(self, input_ids: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        """Vocab-parallel lookup: each rank fills the rows of its ids, zeros elsewhere; the all-reduce joins them."""
        local = input_ids - tp.shard.vocab_start
        outside = (local < 0) | (local >= self.config.vocab_size)
        local = local.masked_fill(outside, 0)
        if self.embed_q is not None:
            h = self.embed_q.embed(local).to(self.dtype)
        else:
            h = F.embedding(local, self.embed)
        h.masked_fill_(outside[:, None], 0)
        tp.all_reduce(h)
        return h

    # ---- forward -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> float32 logits [len(logits_indices), vocab] (or [.., num_labels] for a
        sequence-classification checkpoint)."""
        with invariant.scope(self.batch_invariant):
            return self._logits(self._last_rows(input_ids, positions, kv_caches, meta, logits_indices))

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` up to the final norm: float32 [len(rows), hidden] of the token rows `rows` (what pooling
        models embed; transformers' last_hidden_state)."""
        with invariant.scope(self.batch_invariant):
            h = self._last_rows(input_ids, positions, kv_caches, meta, rows)
        return rms_norm(h, self.norm, self.config.rms_norm_eps).float()

    def _last_rows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The last layer's output (before the final norm) for the rows `logits_indices`."""
        backend = self.attn_backend
        if backend is None:
            raise RuntimeError("no attention backend: call model.set_attention_backend(...) first")
        rows = lean.lean_forward(self, input_ids, positions, kv_caches, meta, logits_indices)
        if rows is not None:
            return rows
        max_len = int(meta.max_seq_len)
        # The core's in-place RoPE turns whole heads (after the core's qk-norm, if any): not partial rotary, not
        # latent attention (its rope part is a slice of the latent row)
        core_rope = self.config.rotary_dim is None and not self.config.mla
        ropes: list[Rope] = []
        for rotary in self.rotaries:
            fused = rotary.fused(positions, max_len) if core_rope else None
            ropes.append(fused if fused is not None else rotary.cos_sin(positions, max_len))
        h = self._embed(input_ids)
        last = len(self.layers) - 1
        for i, module in enumerate(self.layers):
            layer: DecoderLayer = module  # type: ignore[assignment]
            rope = None if layer.rotary is None else ropes[layer.rotary]
            h = layer(h, rope, kv_caches[i], meta, backend, logits_indices if i == last else None)
        if last < 0:
            h = h.index_select(0, logits_indices)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over the rows whose logits are wanted: float32 [rows, vocab]."""
        h = rms_norm(h, self.norm, self.config.rms_norm_eps)
        assert self.head is not None
        logits = self.head(h).float()
        if self.tp is not None:  # vocab-parallel head: rank 0 gets every rank's columns, the others nothing
            gathered = self.tp.gather_vocab(logits)
            if gathered is None:
                return logits
            logits = gathered
        cfg = self.config
        if cfg.logit_scale is not None:
            logits = logits / cfg.logit_scale
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits


def _default_backend(device: torch.device) -> AttentionBackend | None:
    try:
        from ironlm.attention import get_backend
    except ImportError:
        return None
    return get_backend("auto", device)
