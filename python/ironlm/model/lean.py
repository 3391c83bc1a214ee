"""The lean CPU decode step: a small decode batch through the core's kernels, layer by layer, in place.

At decode batch sizes a step's cost outside the weight streaming is per-op dispatch, so this path replaces the
decoder's op chain with four matmuls and a few core calls per layer (norm; qk-norm + RoPE + cache write +
attention; norm; activation-mul; and for families that norm a branch before its residual add, that norm and the
add), every operand a preallocated buffer with its numpy view. It runs when the attention backend declares
``fused_decode_qkv`` (its ``lean_plan`` yields the step's block tables and slots and the core attends straight
from the fused q|k|v projection) and the model's blocks are ones this step implements
(`ModelConfig.lean_supported`); every other step takes `DecoderLayer`'s ordinary forward, which computes the same
thing with the same kernels.

A step's rows may also be short chunks of cached sequences (speculative verification: a sequence's last token
and its proposals): the plan gives each row its own position and context, the core writes every new K/V row
before it attends, and every op here is row-wise or a matmul whose rows do not interact. With quantized linears
(the CPU default) the core's kernels give a row the same bits at any M, so a verified row gets the bits that row
would get alone and speculative greedy output equals plain greedy output; dense weights go through torch's GEMM
above the rows their packed copies serve (`DenseLinear.packed_rows`), which may round a row differently at another
M (exact there in batch-invariant mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ironlm import _core, invariant
from ironlm.core_views import CACHE_DTYPES, CORE_DTYPES, FP8_DTYPES, as_numpy
from ironlm.model.config import ModelConfig
from ironlm.model.layers import CoreRope

if TYPE_CHECKING:
    from ironlm.attention import AttentionMetadata

# Decode batches of up to this many tokens take the lean step. Below ~8 rows per-op dispatch, not the matmuls'
# work, is what a step spends outside the weight streaming; at W's 34-row mean decode batch the ordinary forward
# still spent ~5 ms a step in Python and torch glue (its op chain, a separate RoPE and attention plan per layer):
# measured on a 2-core Zen 4 (benches/profile_w.py, 64 requests, bf16), W's decode phase 15.7 -> 14.6 s with
# every decode step here (and the GEMMs writing no copies, see `DenseLinear.into`).
# Steps of short chunks (speculative verification rows: a sequence's last token and its proposals) take it too,
# each row attended as a decode row (the attention backend's `lean_plan` refuses longer chunks): W at 64 concurrent
# with n-gram speculation ran 0.87x plain while only plain decode steps took it.
LEAN_MAX_TOKENS = 256


class LeanBuffers:
    """The step's activations for T tokens and their numpy views, reused by every layer and step: no allocation
    and no tensor-to-numpy conversion inside the layer loop."""

    def __init__(self, cfg: ModelConfig, t: int, dtype: torch.dtype) -> None:
        def buf(n: int) -> tuple[torch.Tensor, np.ndarray]:
            tensor = torch.empty(t, n, dtype=dtype)
            return tensor, as_numpy(tensor)

        self.h, self.h_np = buf(cfg.hidden_size)  # the residual stream
        self.x, self.x_np = buf(cfg.hidden_size)  # normed input of the next matmul, or a normed branch
        self.br, self.br_np = buf(cfg.hidden_size)  # a branch's output before its norm / scale and residual add
        self.qkv, self.qkv_np = buf(cfg.q_size + 2 * cfg.kv_size)
        self.attn, self.attn_np = buf(cfg.q_size)
        self.gate_up, self.gate_up_np = buf(2 * cfg.intermediate_size)
        self.act, self.act_np = buf(cfg.intermediate_size)
        # rounded to the activation dtype first, as `DecoderLM._embed` (and transformers) does; built once
        self.embed_scale = None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale, dtype=dtype)


@dataclass
class LeanStep:
    """What every layer's attention call shares in one step (host arrays from the step's plan)."""

    dtype: str
    cache_dtype: str  # the KV caches' (EngineConfig.kv_cache_dtype): dtype's, or 16-bit under float32
    threads: int
    block_tables: np.ndarray
    seq_lens: np.ndarray
    slots: np.ndarray
    positions: np.ndarray
    tables: list[np.ndarray]  # the cos|sin table of each of the model's rotaries (Gemma 3: global, local)


@dataclass
class LayerViews:
    """A layer's norm weights as numpy views (None where the block has no such norm)."""

    input: np.ndarray | None
    attn_out: np.ndarray | None
    pre_mlp: np.ndarray | None
    mlp_out: np.ndarray | None
    qk: tuple[np.ndarray, np.ndarray] | None


def lean_forward(
    model: Any,  # DecoderLM (not imported: llama.py imports this module)
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
) -> torch.Tensor | None:
    """The last layer's rows `logits_indices` for a small CPU decode batch; None where the lean step does not
    apply (GPU, prefill chunks, blocks it does not implement, backends without the capability, steps the backend
    sends to cascade attention)."""
    t = input_ids.shape[0]
    backend = model.attn_backend
    if (t > LEAN_MAX_TOKENS or not model.config.lean_supported or model.dtype not in CORE_DTYPES
            or not getattr(backend, "fused_decode_qkv", False) or not kv_caches):
        return None
    kv_dtype = kv_caches[0][0].dtype
    cache_dtype = CACHE_DTYPES.get(kv_dtype)
    if cache_dtype is None or (kv_dtype != model.dtype and model.dtype != torch.float32
                               and kv_dtype not in FP8_DTYPES):
        return None
    plan = backend.lean_plan(meta, kv_caches[0][0].shape[1], t)
    if plan is None:
        return None
    assert plan.slots is not None
    ropes: list[CoreRope] = []
    for rotary in model.rotaries:
        rope = rotary.fused(positions, int(meta.max_seq_len))
        if rope is None:
            return None
        ropes.append(rope)
    ws = model._lean.get(t)
    if ws is None:
        ws = model._lean[t] = LeanBuffers(model.config, t, model.dtype)
    if model._kv_np is None or model._kv_np[0] is not kv_caches or len(model._kv_np[1]) != len(kv_caches):
        model._kv_np = (kv_caches, [(as_numpy(k), as_numpy(v)) for k, v in kv_caches])
    step = LeanStep(CORE_DTYPES[model.dtype], cache_dtype, torch.get_num_threads(), plan.block_tables, plan.seq_lens,
                    plan.slots, ropes[0].positions, [r.table for r in ropes])
    _embed(model, input_ids, ws)
    fused = stack(model)
    if fused is not None and t <= fused.max_rows and not (fused.dense and invariant.enabled()):
        streamed = fused.core.run(ws.h_np, model._kv_np[1], step.block_tables, step.seq_lens, step.slots,
                                  step.positions, step.tables, step.threads, step.cache_dtype)
        for i, block in fused.moe:
            block.streamed += streamed[i]
    else:
        for layer, (k_np, v_np) in zip(model.layers, model._kv_np[1]):
            lean_layer(layer, ws, k_np, v_np, step)
    return ws.h.index_select(0, logits_indices)


@dataclass
class Stack:
    """The model's layers as one `_core.LeanStack`; its MoE blocks by layer index (their `streamed` counters take
    the bytes each step's experts read); the most rows a step may have to take it (dense weights: the rows their
    packed copies serve, see linear.PACKED_MAX_ROWS) and whether its weights are dense (batch-invariant mode sends
    those to other kernels, so the stack steps aside there)."""

    core: _core.LeanStack
    moe: list[tuple[int, Any]]
    max_rows: int = LEAN_MAX_TOKENS
    dense: bool = False


def stack(model: Any) -> Stack | None:
    """Every layer as one core call a step (`_core.LeanStack`: the kernels `lean_layer` calls, in its order, with
    the GIL released once), built on first use: where every layer is a pre-norm block with both residual adds fused
    and no tensor parallelism, and either (float32 rows) its linears block-quantized (`QuantLinear`, a GGUF's or
    load-time quantized weights: the CPU default) and its MLP dense or a MoE block without a shared expert whose
    router runs on the core (`MoeBlock.routes_on_core`: Mixtral, OLMoE, Qwen3-MoE), or (bf16 or f32 rows) every
    linear dense with the core's packed copy (`DenseLinear.core_packed`: HF checkpoints). Every row gets the bits
    `lean_layer` gives it. At one sequence of the default GGUF the Python between `lean_layer`'s calls was ~1 ms of a
    4.3 ms step (2-core Zen 4). None: `lean_layer` runs."""
    if not FUSE_LAYERS:
        return None
    if model._lean_stack is None:
        model._lean_stack = _build(model) or False
    return model._lean_stack or None


# Whether `stack` may fuse the layers (tests and benches/profile_w.py set it False to time or compare lean_layer).
FUSE_LAYERS = True


def _build(model: Any) -> Stack | None:
    from ironlm.model.linear import DenseLinear, QuantLinear

    if model.tp is not None or model.dtype not in (torch.float32, torch.bfloat16):
        return None
    # Every linear QuantLinear itself (not a subclass: GPTQ act-order's permutes x first), or every one dense.
    first = model.layers[0].qkv if model.layers else None
    dense = type(first) is DenseLinear
    if not dense and model.dtype != torch.float32:
        return None

    def proj(lin: Any) -> tuple[Any, np.ndarray | None] | None:
        if not dense and type(lin) is QuantLinear:
            return lin.matrix, lin._bias_np
        if dense and type(lin) is DenseLinear and lin.packed_rows():
            packed = lin.core_packed()
            return None if packed is None else (packed, lin.packed_bias())
        return None

    layers, moe = [], []
    for i, layer in enumerate(model.layers):
        if (layer.tp is not None or layer.mla is not None or layer.qk_norm_ranks
                or not (layer.fuse_attn_residual and layer.fuse_mlp_residual and layer.owns_residual)
                or layer.input_norm is None or layer.post_norm is None):
            return None
        attn = [proj(layer.qkv), proj(layer.o)]
        mlp: dict[str, Any]
        if layer.moe is None:
            mlp_projs = [proj(layer.gate_up), proj(layer.down)]
            if None in attn + mlp_projs:
                return None
            (qkv, qkv_b), (o, o_b), (gate_up, gu_b), (down, down_b) = attn + mlp_projs  # type: ignore[misc]
            mlp = {"gate_up": gate_up, "down": down, "activation": layer.activation}
            biases = (qkv_b, o_b, gu_b, down_b)
        else:
            block = layer.moe
            if (dense or None in attn or not block.routes_on_core(torch.device("cpu"), model.dtype)
                    or block.shared is not None or block.fused or block.cfg.local_experts is not None):
                return None
            (qkv, qkv_b), (o, o_b) = attn  # type: ignore[misc]
            spec = block.spec
            bias = None if block.router_bias is None else as_numpy(block.router_bias.data)
            route = (spec.scoring, spec.top_k, spec.renormalize, spec.renorm_eps, spec.scaling)
            mlp = {"moe": (block.core, as_numpy(block.router_weight.data), bias, route)}
            biases = (qkv_b, o_b, None, None)
            moe.append((i, block))
        views = layer._lean_views = layer._lean_views or _views(layer)
        assert views.input is not None and views.pre_mlp is not None
        layers.append(_core.LeanLayer(
            input_norm=views.input, post_norm=views.pre_mlp, qkv=qkv, o=o, biases=biases, qk_norm=views.qk,
            rotary=layer.rotary, window=layer.window, softcap=layer.softcap, scale=layer.scale,
            num_heads=layer.num_heads, eps=layer.eps, **mlp))
    if not layers:
        return None
    # Every dense linear has the model's dtype: the first one's row limit is all of theirs.
    rows = model.layers[0].qkv.packed_rows() if dense else LEAN_MAX_TOKENS
    return Stack(_core.LeanStack(layers, model.config.hidden_size), moe, rows, dense)


def _embed(model: Any, input_ids: torch.Tensor, ws: LeanBuffers) -> None:
    """`DecoderLM._embed` into `ws.h`."""
    if model.tp is not None:
        ws.h.copy_(model._embed(input_ids))
        return
    if model.embed_q is not None and ws.h.dtype == torch.float32:
        model.embed_q.embed(input_ids, out=ws.h)
    elif model.embed_q is not None:
        ws.h.copy_(model.embed_q.embed(input_ids))
    else:
        torch.index_select(model.embed, 0, input_ids, out=ws.h)
    if ws.embed_scale is not None:
        ws.h.mul_(ws.embed_scale)


def _views(layer: Any) -> LayerViews:
    def view(p: torch.Tensor | None) -> np.ndarray | None:
        return None if p is None else as_numpy(p.data)

    return LayerViews(view(layer.input_norm), view(layer.attn_out_norm), view(layer.post_norm),
                      view(layer.mlp_out_norm), layer.qk_norm_np())


def lean_layer(layer: Any, ws: LeanBuffers, k_cache: np.ndarray, v_cache: np.ndarray,
               step: LeanStep) -> None:
    """`DecoderLayer.forward` for the step, in place on `ws.h`."""
    views = layer._lean_views
    if views is None:
        views = layer._lean_views = _views(layer)
    assert layer.qkv is not None and layer.o is not None
    x, x_np = _normed(layer, views.input, ws, step)
    ws.qkv, ws.qkv_np = _held(layer.qkv.into(x, ws.qkv, x_np, ws.qkv_np), ws.qkv, ws.qkv_np)
    qk = views.qk
    if layer.qk_norm_ranks:  # the whole-width norm needs every rank's heads: normed here, not in the kernel
        layer.qk_norm_across_ranks(ws.qkv)
        qk = None
    _core.decode_attention_qkv(
        ws.qkv_np, k_cache, v_cache, step.block_tables, step.seq_lens, step.slots, step.positions,
        None if layer.rotary is None else step.tables[layer.rotary], layer.scale, ws.attn_np, layer.num_heads,
        step.dtype, step.threads, layer.window, q_norm=None if qk is None else qk[0],
        k_norm=None if qk is None else qk[1], eps=layer.eps, softcap=layer.softcap, cache_dtype=step.cache_dtype)
    _branch(layer, layer.o, ws.attn, ws.attn_np, layer.fuse_attn_residual, views.attn_out, ws, step)
    x, x_np = _normed(layer, views.pre_mlp, ws, step)
    if layer.moe is not None:
        _moe_branch(layer, x, views.mlp_out, ws, step)
        return
    assert layer.gate_up is not None and layer.down is not None
    ws.gate_up, ws.gate_up_np = _held(layer.gate_up.into(x, ws.gate_up, x_np, ws.gate_up_np), ws.gate_up,
                                      ws.gate_up_np)
    act = _core.silu_and_mul if layer.activation == "silu" else _core.gelu_tanh_and_mul
    act(ws.gate_up_np, ws.act_np, step.dtype, step.threads)
    _branch(layer, layer.down, ws.act, ws.act_np, layer.fuse_mlp_residual, views.mlp_out, ws, step)


def _moe_branch(layer: Any, x: torch.Tensor, norm: np.ndarray | None, ws: LeanBuffers, step: LeanStep) -> None:
    """A sparse layer's MLP: the MoE block's routing and experts (the core's MoE kernel on CPU), then `_add`."""
    out = layer.moe(x)
    if layer.tp is not None:
        layer.tp.all_reduce(out)
    if out.dtype != ws.br.dtype or not out.is_contiguous():
        out = out.to(ws.br.dtype).contiguous()
    _add(layer, as_numpy(out), norm, ws, step)


def _held(result: torch.Tensor, buf: torch.Tensor, buf_np: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """A linear's result as the step's new buffer (with its numpy view): the buffer itself when the product was
    written into it, else the fresh tensor the GEMM returned, which takes the buffer's place from here on (the
    next step writes into it)."""
    return (buf, buf_np) if result is buf else (result, as_numpy(result))


def _normed(layer: Any, weight: np.ndarray | None, ws: LeanBuffers,
            step: LeanStep) -> tuple[torch.Tensor, np.ndarray]:
    """The residual stream normed into `ws.x`, or the stream itself for a block without that pre-norm (OLMo 2)."""
    if weight is None:
        return ws.h, ws.h_np
    _core.rms_norm(ws.h_np, weight, layer.eps, ws.x_np, step.dtype, step.threads)
    return ws.x, ws.x_np


def _branch(layer: Any, out: Any, x: torch.Tensor, x_np: np.ndarray, fused: bool, norm: np.ndarray | None,
            ws: LeanBuffers, step: LeanStep) -> None:
    """`DecoderLayer._residual` in place on `ws.h`: the add inside the matmul when nothing comes between, else
    the branch into `ws.br`, then [normed,] [scaled and] added by the core."""
    if fused:
        if not layer.owns_residual:
            ws.h.zero_()
        ws.h, ws.h_np = _held(out.accumulate(x, ws.h, x_np, ws.h_np), ws.h, ws.h_np)
        if layer.tp is not None:
            layer.tp.all_reduce(ws.h)
        return
    ws.br, ws.br_np = _held(out.into(x, ws.br, x_np, ws.br_np), ws.br, ws.br_np)
    if layer.tp is not None:
        layer.tp.all_reduce(ws.br)
    _add(layer, ws.br_np, norm, ws, step)


def _add(layer: Any, branch_np: np.ndarray, norm: np.ndarray | None, ws: LeanBuffers, step: LeanStep) -> None:
    """The rest of `DecoderLayer._add` in place on `ws.h` (the branch already summed over TP ranks): [norm,]
    [scale,] add in one core pass, rounded after each step as `_add`'s ops are."""
    _core.residual_add(branch_np, ws.h_np, norm=norm is not None, weight=norm, eps=layer.eps,
                       scale=layer.residual_scale, dtype=step.dtype, threads=step.threads)
