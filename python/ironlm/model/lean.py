"""The lean CPU decode step: a small all-decode batch through the core's kernels, layer by layer, in place.

At decode batch sizes a step's cost outside the weight streaming is per-op dispatch, so this path replaces the
decoder's op chain with four matmuls and three core calls per layer (norm, RoPE + cache write + attention, norm;
SiLU-mul), every operand a preallocated buffer with its numpy view. It runs when the attention backend declares
``fused_decode_qkv`` (its ``decode_plan`` yields the step's block tables and slots and the core attends straight
from the fused q|k|v projection) and the model's blocks are plain Llama blocks (`ModelConfig.plain_block`); every
other step takes `Any`'s ordinary forward, which computes the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ironlm import _core
from ironlm.core_views import CORE_DTYPES, as_numpy
from ironlm.model.config import ModelConfig
from ironlm.model.layers import CoreRope

if TYPE_CHECKING:
    from ironlm.attention import AttentionMetadata

# Decode batches of up to this many tokens take the lean step: there per-op dispatch, not the matmuls' work, is
# what a step spends outside the weight streaming.
LEAN_MAX_TOKENS = 8


class LeanBuffers:
    """The step's activations for T tokens and their numpy views, reused by every layer and step: no allocation
    and no tensor-to-numpy conversion inside the layer loop."""

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
class LeanStep:
    """What every layer's attention call shares in one step (host arrays from the step's plan)."""

    dtype: str
    threads: int
    block_tables: np.ndarray
    seq_lens: np.ndarray
    slots: np.ndarray
    rope: CoreRope


def lean_forward(
    model: Any,  # DecoderLM (not imported: llama.py imports this module)
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
) -> torch.Tensor | None:
    """The last layer's rows `logits_indices` for a small CPU decode batch; None where the lean step does not
    apply (GPU, prefill rows, blocks it does not implement, backends without the capability, steps the backend
    sends to cascade attention)."""
    t = input_ids.shape[0]
    backend = model.attn_backend
    if (t > LEAN_MAX_TOKENS or not model.config.plain_block or model.dtype not in CORE_DTYPES
            or not getattr(backend, "fused_decode_qkv", False) or not meta.decode_only or not kv_caches):
        return None
    plan = backend.decode_plan(meta, kv_caches[0][0].shape[1], t)
    rotary = model.rotaries[0]
    rope = None if plan is None or plan.slots is None else rotary.fused(positions, int(meta.max_seq_len))
    if rope is None:
        return None
    ws = model._lean.get(t)
    if ws is None:
        ws = model._lean[t] = LeanBuffers(model.config, t, model.dtype)
    if model._kv_np is None or model._kv_np[0] is not kv_caches or len(model._kv_np[1]) != len(kv_caches):
        model._kv_np = (kv_caches, [(as_numpy(k), as_numpy(v)) for k, v in kv_caches])
    step = LeanStep(CORE_DTYPES[model.dtype], torch.get_num_threads(), plan.block_tables, plan.seq_lens,
                    plan.slots, rope)
    if model.tp is not None:
        ws.h.copy_(model._embed(input_ids))
    elif model.embed_q is not None and ws.h.dtype == torch.float32:
        model.embed_q.embed(input_ids, out=ws.h)
    elif model.embed_q is not None:
        ws.h.copy_(model.embed_q.embed(input_ids))
    else:
        torch.index_select(model.embed, 0, input_ids, out=ws.h)
    for layer, (k_np, v_np) in zip(model.layers, model._kv_np[1]):
        lean_layer(layer, ws, k_np, v_np, step)
    return ws.h.index_select(0, logits_indices)


def lean_layer(layer: Any, ws: LeanBuffers, k_cache: np.ndarray, v_cache: np.ndarray,
               step: LeanStep) -> None:
    """`Any.forward` for the step, in place on `ws.h`."""
    assert layer.input_norm is not None and layer.post_norm is not None
    if layer._norms_np is None:
        layer._norms_np = (as_numpy(layer.input_norm.data), as_numpy(layer.post_norm.data))
    _core.rms_norm(ws.h_np, layer._norms_np[0], layer.eps, ws.x_np, step.dtype, step.threads)
    assert layer.qkv is not None and layer.o is not None and layer.gate_up is not None and layer.down is not None
    layer.qkv.into(ws.x, ws.qkv, ws.x_np, ws.qkv_np)
    _core.decode_attention_qkv(
        ws.qkv_np, k_cache, v_cache, step.block_tables, step.seq_lens, step.slots, step.rope.positions,
        step.rope.table, layer.scale, ws.attn_np, layer.num_heads, step.dtype, step.threads, layer.window)
    if not layer.owns_residual:
        ws.h.zero_()
    layer.o.accumulate(ws.attn, ws.h, ws.attn_np, ws.h_np)
    if layer.tp is not None:
        layer.tp.all_reduce(ws.h)
    _core.rms_norm(ws.h_np, layer._norms_np[1], layer.eps, ws.x_np, step.dtype, step.threads)
    layer.gate_up.into(ws.x, ws.gate_up, ws.x_np, ws.gate_up_np)
    _core.silu_and_mul(ws.gate_up_np, ws.act_np, step.dtype, step.threads)
    if not layer.owns_residual:
        ws.h.zero_()
    layer.down.accumulate(ws.act, ws.h, ws.act_np, ws.h_np)
    if layer.tp is not None:
        layer.tp.all_reduce(ws.h)
