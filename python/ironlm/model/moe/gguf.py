"""MoE layers in llama.cpp's GGUF files: the config from the metadata, the stacked expert tensors split per expert.

llama.cpp stores each layer's experts stacked, ``blk.N.ffn_{gate,up,down}_exps.weight`` of shape [E, out, in]
(torch order), and its router as ``ffn_gate_inp``; a shared expert is ``ffn_{gate,up,down}_shexp`` with its gate
``ffn_gate_inp_shexp``. An expert's matrix is a contiguous run of whole rows in every GGUF type, so
`split_experts` turns a stack into E ordinary 2-D tensors ``blk.N.ffn_gate_exps.E.weight`` (byte ranges of the
same mapping, quantized blocks kept) that load like any projection; gpt-oss's stacked expert biases
``ffn_*_exps.bias`` [E, out] become E 1-D ``blk.N.ffn_gate_exps.E.bias`` alike.

Renormalising the top-k weights is not in the metadata for most architectures: llama.cpp decides it per
architecture in its graph (`llm_build_moe_ffn`'s norm_w), and `RENORMALIZE` mirrors that choice.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from ironlm.model.moe.spec import MoeConfig, RouteSpec

# llama.cpp's per-architecture choice of renormalising the top-k weights (Mixtral is arch llama)
RENORMALIZE = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
_STACK = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")


def gguf_moe(meta: Callable[..., Any], gf: Any, arch: str, num_layers: int) -> MoeConfig | None:
    """The MoE layers a GGUF file describes, or None for a dense model. A layer is sparse when it has a router."""
    experts = int(meta("expert_count", 0) or 0)
    if not experts:
        return None
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in gf.tensors for i in range(num_layers))
    first = sparse.index(True) if any(sparse) else 0
    shared = int(meta("expert_shared_feed_forward_length", 0) or 0)
    if f"blk.{first}.ffn_up_shexp.weight" not in gf.tensors:
        shared = 0
    elif not shared:
        shared = gf.tensors[f"blk.{first}.ffn_up_shexp.weight"].shape[0]
    renorm = meta("expert_weights_norm", RENORMALIZE.get(arch, False))
    return MoeConfig(
        route=RouteSpec(experts, int(meta("expert_used_count")), renormalize=bool(renorm),
                        scaling=float(meta("expert_weights_scale", 1.0) or 1.0)),
        intermediate_size=int(meta("expert_feed_forward_length", 0) or meta("feed_forward_length")),
        sparse_layers=sparse,
        shared_intermediate_size=shared,
        shared_gate=shared > 0 and f"blk.{first}.ffn_gate_inp_shexp.weight" in gf.tensors,
    )


def split_experts(gf: Any, type_sizes: Callable[[int], tuple[int, int]]) -> None:
    """Each stacked expert tensor -> one 2-D tensor per expert (in place, idempotent), and the shared expert's
    gate [1, hidden] however the file shapes it; `type_sizes(ggml_type)` is (elements per block, bytes per block)."""
    for name, info in list(gf.tensors.items()):
        if name.endswith(".ffn_gate_inp_shexp.weight") and len(info.shape) == 1:  # llama-quantize writes it 1-D
            gf.tensors[name] = dataclasses.replace(info, shape=(1, info.shape[0]))
        m = _STACK.match(name)
        if m is None or len(info.shape) != (3 if m.group(3) == "weight" else 2):
            continue
        e, shape = info.shape[0], info.shape[1:]  # a bias stack (gpt-oss) is [E, out]: one row per expert
        block, type_size = type_sizes(info.ggml_type)
        size = (shape[0] if len(shape) == 2 else 1) * (shape[-1] // block) * type_size
        del gf.tensors[name]
        for i in range(e):
            part = f"blk.{m.group(1)}.ffn_{m.group(2)}_exps.{i}.{m.group(3)}"
            gf.tensors[part] = dataclasses.replace(info, name=part, shape=shape, offset=info.offset + i * size,
                                                   nbytes=size)
