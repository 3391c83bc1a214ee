"""The one decoder ironlm runs: Llama / Mistral / Qwen2 / Qwen3, driven by `ModelConfig`.

The forward pass takes ONE flat token batch (no padding, no batch dimension) of all scheduled sequences, writes
their K/V into the paged cache through the attention backend, and returns logits only for `logits_indices`.

Weights are stored fused — q|k|v in one matrix, gate|up in one matrix — so each layer runs 4 GEMMs — and
transposed ([in, out], used as `x @ W`): on CPU, MKL runs the small-M GEMMs of decode batches 15-40% faster in
this layout than with [out, in] weights (equal at large M). They are allocated once at their final dtype/device
and filled slice by slice while loading (`load_weight` / `weight_target`), so loading never keeps a second full
copy of the model. Tied embeddings share one tensor ([vocab, hidden], also the lm_head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ironlm import _core
from ironlm.model import invariant
from ironlm.model.config import ModelConfig
from ironlm.model.layers import (
    CORE_DTYPES,
    CoreRope,
    RotaryEmbedding,
    apply_rotary,
    as_numpy,
    rms_norm,
    silu_and_mul,
)
from ironlm.model.linear import QUANTIZED_LINEARS, DenseLinear, Linear, QuantizedLinear, QuantLinear
from ironlm.model.quantize import QuantSpec, from_float

if TYPE_CHECKING:
    from ironlm.attention import AttentionBackend, AttentionMetadata
    from ironlm.distributed.group import TPGroup

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Decode batches of up to this many tokens take the lean CPU step: there per-op dispatch, not the matmuls' work,
# is what a step spends outside the weight streaming.
LEAN_MAX_TOKENS = 8


class _LeanBuffers:
    """The lean decode step's activations for T tokens and their numpy views, reused by every layer and step: no
    allocation and no tensor-to-numpy conversion inside the layer loop."""

    def __init__(self, cfg: ModelConfig, t: int, dtype: torch.dtype) -> None:
        def buf(n: int) -> tuple[torch.Tensor, np.ndarray]:
            tensor = torch.empty(t, n, dtype=dtype)
            return tensor, as_numpy(tensor)

        self.h, self.h_np = buf(cfg.hidden_size)  # the residual stream
        self.x, self.x_np = buf(cfg.hidden_size)  # normed input of the next matmul
        self.qkv, self.qkv_np = buf(cfg.q_size + 2 * cfg.kv_size)
        self.attn, self.attn_np = buf(cfg.q_size)
        self.gate_up, self.gate_up_np = buf(2 * cfg.intermediate_size)
        self.act, self.act_np = buf(cfg.intermediate_size)


@dataclass
class _LeanStep:
    """What every layer's attention call shares in one lean decode step (host arrays from the step's plan)."""

    dtype: str
    threads: int
    block_tables: np.ndarray
    seq_lens: np.ndarray
    slots: np.ndarray
    rope: CoreRope


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None,
                 window: int | None = None) -> None:
        super().__init__()
        self.window = window  # sliding-window attention span in tokens; None = full causal
        # Tensor parallel: o and down yield partial sums that one all-reduce each completes; only rank 0 adds the
        # residual (and o's bias) into its partial, so the sum carries it exactly once.
        self.tp = tp
        self.owns_residual = tp is None or tp.rank == 0
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = q, kv
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        # [in, out] layouts; HF [out, in] tensors are copied into transposed views (see DecoderLM.weight_target)
        self.input_norm = _param((h,), dtype, device)
        self.qkv_weight = _param((h, q + 2 * kv), dtype, device)
        self.qkv_bias = _param((q + 2 * kv,), dtype, device) if cfg.attention_bias else None
        self.o_weight = _param((q, h), dtype, device)
        self.o_bias = _param((h,), dtype, device) if cfg.attention_out_bias else None
        self.q_norm = _param((cfg.head_dim,), dtype, device) if cfg.qk_norm else None
        self.k_norm = _param((cfg.head_dim,), dtype, device) if cfg.qk_norm else None
        self.qk_norm_weight: torch.Tensor | None = None  # [Hq + Hkv, D], built by finish_loading
        self._norms_np: tuple[np.ndarray, np.ndarray] | None = None  # numpy views for the lean CPU step
        self.post_norm = _param((h,), dtype, device)
        self.gate_up_weight = _param((h, 2 * inter), dtype, device)
        self.down_weight = _param((inter, h), dtype, device)
        # The four matmuls, built over the dense parameters by finish_loading unless a quantizing loader set them
        self.qkv: Linear | None = None
        self.o: Linear | None = None
        self.gate_up: Linear | None = None
        self.down: Linear | None = None

    def finish_loading(self) -> None:
        if self.qkv is None:
            self.qkv = DenseLinear(self.qkv_weight, self.qkv_bias)
        if self.o is None:
            self.o = DenseLinear(self.o_weight, self.o_bias)
        if self.gate_up is None:
            self.gate_up = DenseLinear(self.gate_up_weight)
        if self.down is None:
            self.down = DenseLinear(self.down_weight)
        if self.q_norm is not None and self.k_norm is not None:
            self.qk_norm_weight = torch.cat(
                [self.q_norm.expand(self.num_heads, -1), self.k_norm.expand(self.num_kv_heads, -1)]
            ).contiguous()

    def forward(
        self,
        h: torch.Tensor,
        rope: CoreRope | tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        select: torch.Tensor | None,
    ) -> torch.Tensor:
        """`rope` is the core's in-place RoPE (CPU) or the step's (cos, sin) for the torch path."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = rms_norm(h, self.input_norm, self.eps)
        assert self.qkv is not None and self.o is not None and self.gate_up is not None and self.down is not None
        qkv = self.qkv(x)
        if isinstance(rope, CoreRope):
            # q and k rotated in place inside the projection's output; q, k, v stay views of it.
            rope.apply_(qkv, hq + hkv, d)
            q, k, v = qkv.view(t, hq + 2 * hkv, d).split((hq, hkv, hkv), dim=1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d)
            v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
            if self.qk_norm_weight is not None:
                qk = rms_norm(qk, None, self.eps).mul_(self.qk_norm_weight)
            qk = apply_rotary(qk, *rope)  # q and k rotated together: one set of kernels
            q, k = qk[:, :hq], qk[:, hq:]
        k_cache, v_cache = kv_cache
        if self.window is None:
            attn = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        else:
            attn = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, window=self.window)
        attn = attn.reshape(t, self.q_size)
        if select is not None:  # last layer: only the rows whose logits are wanted go on
            attn = attn.index_select(0, select)
            h = h.index_select(0, select)
        h = self.o(attn, residual=h if self.owns_residual else None)  # residual add fused into the GEMM
        if self.tp is not None:
            self.tp.all_reduce(h)
        x = rms_norm(h, self.post_norm, self.eps)
        x = silu_and_mul(self.gate_up(x))
        h = self.down(x, residual=h if self.owns_residual else None)
        if self.tp is not None:
            self.tp.all_reduce(h)
        return h


    def lean_forward(self, ws: _LeanBuffers, k_cache: np.ndarray, v_cache: np.ndarray, step: _LeanStep) -> None:
        """`forward` for a CPU decode batch, in place on `ws.h`: four matmuls and three core calls (norm,
        RoPE + cache write + attention, norm; then SiLU-mul), every operand a preallocated buffer."""
        if self._norms_np is None:
            self._norms_np = (as_numpy(self.input_norm.data), as_numpy(self.post_norm.data))
        _core.rms_norm(ws.h_np, self._norms_np[0], self.eps, ws.x_np, step.dtype, step.threads)
        assert self.qkv is not None and self.o is not None and self.gate_up is not None and self.down is not None
        self.qkv.into(ws.x, ws.qkv, ws.x_np, ws.qkv_np)
        _core.decode_attention_qkv(
            ws.qkv_np, k_cache, v_cache, step.block_tables, step.seq_lens, step.slots, step.rope.positions,
            step.rope.table, self.scale, ws.attn_np, self.num_heads, step.dtype, step.threads, self.window)
        if not self.owns_residual:
            ws.h.zero_()
        self.o.accumulate(ws.attn, ws.h, ws.attn_np, ws.h_np)
        if self.tp is not None:
            self.tp.all_reduce(ws.h)
        _core.rms_norm(ws.h_np, self._norms_np[1], self.eps, ws.x_np, step.dtype, step.threads)
        self.gate_up.into(ws.x, ws.gate_up, ws.x_np, ws.gate_up_np)
        _core.silu_and_mul(ws.gate_up_np, ws.act_np, step.dtype, step.threads)
        if not self.owns_residual:
            ws.h.zero_()
        self.down.accumulate(ws.act, ws.h, ws.act_np, ws.h_np)
        if self.tp is not None:
            self.tp.all_reduce(ws.h)


class DecoderLM(nn.Module):
    """Causal LM over a paged KV cache. See the module docstring for the calling convention."""

    batch_invariant = False  # EngineConfig.batch_invariant: each forward runs in ironlm.model.invariant's scope

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
        self.layers = nn.ModuleList([DecoderLayer(config, dtype, device, tp, window)
                                     for window in config.layer_windows])
        self.norm = _param((config.hidden_size,), dtype, device)
        if config.num_labels:  # a sequence-classification checkpoint: its score head stands in for the LM head
            self.lm_head = _param((config.num_labels, config.hidden_size), dtype, device)
        elif config.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = _param((config.vocab_size, config.hidden_size), dtype, device)
        self.rotary = RotaryEmbedding(config, dtype, device)
        self.head: Linear | None = None  # the LM head; dense over lm_head unless quantized
        self.embed_q: QuantizedLinear | None = None  # a quantized embedding table (the head's blocks when tied)
        self.quant: QuantSpec = QuantSpec()
        if attn_backend is None:
            attn_backend = _default_backend(device)
        self.attn_backend = attn_backend
        self._loaded: set[str] = set()
        self._lean: dict[int, _LeanBuffers] = {}
        self._kv_np: tuple[list, list[tuple[np.ndarray, np.ndarray]]] | None = None
        self.eval()

    # ---- attention backend ---------------------------------------------------------------------------------
    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.attn_backend = backend

    # ---- weights -------------------------------------------------------------------------------------------
    def expected_weights(self) -> list[str]:
        """HF parameter names a checkpoint must provide."""
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("score.weight" if cfg.num_labels else "lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            if cfg.attention_bias:
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if cfg.attention_out_bias:
                names.append(p + "self_attn.o_proj.bias")
            if cfg.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def weight_target(self, name: str) -> torch.Tensor | None:
        """The view of a parameter an HF-named checkpoint tensor goes into, in the checkpoint's own shape
        ([out, in] for projections: a transposed, possibly strided view); None = not used by ironlm."""
        cfg = self.config
        if name == "model.embed_tokens.weight":
            return self.embed
        if name == "model.norm.weight":
            return self.norm
        if name == "lm_head.weight":
            return None if cfg.tie_word_embeddings or cfg.num_labels else self.lm_head
        if name == "score.weight":
            return self.lm_head if cfg.num_labels else None
        m = _LAYER_RE.match(name)
        if m is None:
            return None
        idx, rest = int(m.group(1)), m.group(2)
        if idx >= cfg.num_layers:
            return None
        layer: DecoderLayer = self.layers[idx]  # type: ignore[assignment]
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        if rest.startswith("self_attn.") and rest[11:] in ("_proj.weight", "_proj.bias") and rest[10] in qkv_rows:
            rows = qkv_rows[rest[10]]
            if rest.endswith("weight"):
                return layer.qkv_weight[:, rows].t()
            return None if layer.qkv_bias is None else layer.qkv_bias[rows]
        simple = {
            "input_layernorm.weight": layer.input_norm,
            "post_attention_layernorm.weight": layer.post_norm,
            "self_attn.o_proj.weight": layer.o_weight.t(),
            "self_attn.o_proj.bias": layer.o_bias,
            "self_attn.q_norm.weight": layer.q_norm,
            "self_attn.k_norm.weight": layer.k_norm,
            "mlp.gate_proj.weight": layer.gate_up_weight[:, :inter].t(),
            "mlp.up_proj.weight": layer.gate_up_weight[:, inter:].t(),
            "mlp.down_proj.weight": layer.down_weight.t(),
        }
        return simple.get(rest)

    @torch.no_grad()
    def load_weight(self, name: str, tensor: Any, shape: tuple[int, ...] | None = None) -> bool:
        """Copy one HF-named tensor into place (cast to the model dtype/device). False if ironlm ignores it.

        Under tensor parallelism `tensor` is the whole weight, or a safetensors slice of full `shape` (only this
        rank's part is then read), and this rank's part is copied."""
        target = self.weight_target(name)
        if target is None:
            return False
        if self.tp is not None:
            tensor = self.tp.shard.take(name, tensor, tuple(tensor.shape) if shape is None else shape)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        target.copy_(tensor)
        self._loaded.add(name)
        return True

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

    # ---- quantized storage ---------------------------------------------------------------------------------
    def quantize_(self, spec: QuantSpec, parts: dict[str, _core.QuantMatrix] | None = None) -> None:
        """Keep the linears block-quantized and drop their dense storage. `parts` are HF-named matrices a
        loader built from the file's own blocks (GGUF); without them the loaded dense weights are quantized."""
        if spec.backend != "core":
            self._quantize_gpu(spec)
            return
        cfg = self.config
        parts = parts or {}

        def mat(name: str, dense: torch.Tensor) -> _core.QuantMatrix:
            return parts[name] if name in parts else from_float(dense, spec)

        for i, module in enumerate(self.layers):
            layer: DecoderLayer = module  # type: ignore[assignment]
            p, inter = f"model.layers.{i}.", cfg.intermediate_size
            w = layer.qkv_weight.t()  # [q + 2kv, h]
            q, kv = cfg.q_size, cfg.kv_size
            qkv = [mat(p + "self_attn.q_proj.weight", w[:q]), mat(p + "self_attn.k_proj.weight", w[q:q + kv]),
                   mat(p + "self_attn.v_proj.weight", w[q + kv:])]
            gu = layer.gate_up_weight.t()
            gate_up = [mat(p + "mlp.gate_proj.weight", gu[:inter]), mat(p + "mlp.up_proj.weight", gu[inter:])]
            layer.qkv = QuantLinear(_core.QuantMatrix.concat(qkv), layer.qkv_bias)
            layer.o = QuantLinear(mat(p + "self_attn.o_proj.weight", layer.o_weight.t()), layer.o_bias)
            layer.gate_up = QuantLinear(_core.QuantMatrix.concat(gate_up))
            layer.down = QuantLinear(mat(p + "mlp.down_proj.weight", layer.down_weight.t()))
            for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
                setattr(layer, name, _param((0,), self.dtype, self.device))
        if cfg.tie_word_embeddings:
            self.head = self.embed_q = QuantLinear(mat("model.embed_tokens.weight", self.embed))
        else:
            self.head = QuantLinear(mat("lm_head.weight", self.lm_head))
            self.embed_q = QuantLinear(mat("model.embed_tokens.weight", self.embed))
            self.lm_head = _param((0,), self.dtype, self.device)
        self.embed = _param((0,), self.dtype, self.device)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        self.quant = spec

    def _quantize_gpu(self, spec: QuantSpec) -> None:
        """int8/int4 (Triton) or fp8 (`_scaled_mm`) linears from the loaded dense weights, fused ones kept fused."""
        from ironlm.model.linear_gpu import Fp8Linear, TritonQuantLinear

        def make(weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantizedLinear:
            if spec.backend == "fp8":
                return Fp8Linear.from_float(weight, bias)
            return TritonQuantLinear.from_float(weight, spec.bits, spec.group_size, bias)

        for module in self.layers:
            layer: DecoderLayer = module  # type: ignore[assignment]
            layer.qkv = make(layer.qkv_weight.t(), layer.qkv_bias)
            layer.o = make(layer.o_weight.t(), layer.o_bias)
            layer.gate_up = make(layer.gate_up_weight.t())
            layer.down = make(layer.down_weight.t())
            for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
                setattr(layer, name, _param((0,), self.dtype, self.device))
        head = make(self.embed if self.config.tie_word_embeddings else self.lm_head)
        self.head = head
        self.embed_q = head if self.config.tie_word_embeddings else make(self.embed)
        self.embed = self.lm_head = _param((0,), self.dtype, self.device)
        self.quant = spec

    def weight_bytes(self) -> int:
        """Resident bytes of the weights as stored (quantized blocks, dense tensors, each counted once)."""
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        linears = [self.head, self.embed_q] + [lin for layer in layers
                                                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
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
        lean = self._lean_forward(input_ids, positions, kv_caches, meta, logits_indices)
        if lean is not None:
            return lean
        max_len = int(meta.max_seq_len)
        fused = None if self.config.qk_norm else self.rotary.fused(positions, max_len)
        rope = fused if fused is not None else self.rotary.cos_sin(positions, max_len)
        h = self._embed(input_ids)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
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
            return logits if gathered is None else gathered
        return logits

    def _lean_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """A small CPU decode batch through `DecoderLayer.lean_forward`: the last layer's rows `logits_indices`;
        None where it does not apply (GPU, prefill rows, qk-norm models, other backends, steps the CPU backend sends
        to cascade attention)."""
        t = input_ids.shape[0]
        backend = self.attn_backend
        if (t > LEAN_MAX_TOKENS or self.config.qk_norm or self.dtype not in CORE_DTYPES
                or getattr(backend, "name", None) != "cpu" or not meta.decode_only or not kv_caches):
            return None
        plan = backend.decode_plan(meta, kv_caches[0][0].shape[1], t)  # type: ignore[union-attr]
        rope = None if plan is None or plan.slots is None else self.rotary.fused(positions, int(meta.max_seq_len))
        if rope is None:
            return None
        ws = self._lean.get(t)
        if ws is None:
            ws = self._lean[t] = _LeanBuffers(self.config, t, self.dtype)
        if self._kv_np is None or self._kv_np[0] is not kv_caches or len(self._kv_np[1]) != len(kv_caches):
            self._kv_np = (kv_caches, [(as_numpy(k), as_numpy(v)) for k, v in kv_caches])
        step = _LeanStep(CORE_DTYPES[self.dtype], torch.get_num_threads(), plan.block_tables, plan.seq_lens,
                         plan.slots, rope)
        if self.tp is not None:
            ws.h.copy_(self._embed(input_ids))
        elif self.embed_q is not None and ws.h.dtype == torch.float32:
            self.embed_q.embed(input_ids, out=ws.h)
        elif self.embed_q is not None:
            ws.h.copy_(self.embed_q.embed(input_ids))
        else:
            torch.index_select(self.embed, 0, input_ids, out=ws.h)
        for layer, (k_np, v_np) in zip(self.layers, self._kv_np[1]):
            layer.lean_forward(ws, k_np, v_np, step)  # type: ignore[operator]
        return ws.h.index_select(0, logits_indices)


def _default_backend(device: torch.device) -> AttentionBackend | None:
    try:
        from ironlm.attention import get_backend
    except ImportError:
        return None
    return get_backend("auto", device)
