"""Routed experts stacked in one checkpoint tensor per projection -> the MoE block's parameters.

transformers 5 holds a MoE layer's routed experts fused (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3):
``mlp.experts.gate_up_proj`` ``[E, 2I, hidden]`` (each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` ``[E, hidden, I]``, nn.Linear's ``[out, in]`` per expert. Its ``save_pretrained``
converts them back to the Hub's per-expert tensors by default (``block_sparse_moe.experts.N.w1/w2/w3`` for Mixtral,
``mlp.experts.N.gate_proj/up_proj/down_proj`` for the others) and writes the stacked tensors as they are with
``save_original_format=False``; its ``from_pretrained`` reads either, and so does ironlm.

gpt-oss's checkpoints are stacked only, in a layout of their own: ``[in, out]`` per expert (``gate_up_proj``
``[E, hidden, 2I]``, ``down_proj`` ``[E, I, hidden]``) with gate and up interleaved (gate in the even columns), and
biases ``gate_up_proj_bias`` ``[E, 2I]`` (interleaved alike) and ``down_proj_bias`` ``[E, hidden]``.

MoeBlock keeps ``gate_up_weight`` ``[E_local, hidden, 2I]`` (gate columns, then up) and ``down_weight``
``[E_local, I, hidden]``, so one stacked tensor fills a whole parameter. Under expert parallelism only the rank's
experts are read: a leading-axis slice, which a safetensors slice reads without the other experts' bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

STACKED_RE = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


@dataclass(frozen=True)
class Layout:
    in_out: bool  # weights [E, in, out] (gpt-oss), not nn.Linear's [E, out, in]
    interleaved: bool  # gate_up alternates gate and up (gate first), not all gate then all up


# a Family's `experts_layout` names one of these
LAYOUTS = {"transformers": Layout(in_out=False, interleaved=False), "gpt_oss": Layout(in_out=True, interleaved=True)}


def is_stacked(rest: str) -> bool:
    """Whether the layer-relative name `rest` is a stacked expert tensor."""
    return STACKED_RE.match(rest) is not None


def checkpoint_dims(block: Any, layout: Layout, rest: str) -> tuple[tuple[str, int], ...]:
    """The whole checkpoint tensor's dimensions (every expert, not only this rank's), named and sized."""
    m = STACKED_RE.match(rest)
    assert m is not None
    experts, inter = ("experts", block.cfg.num_experts), block.cfg.intermediate_size
    hidden = ("hidden", block.router_weight.shape[0])
    if m.group(1) == "gate_up_proj":
        out, inp = ("2 x expert intermediate", 2 * inter), hidden
    else:
        out, inp = hidden, ("expert intermediate", inter)
    if m.group(2):
        return (experts, out)
    return (experts, inp, out) if layout.in_out else (experts, out, inp)


def load(block: Any, layout: Layout, name: str, rest: str, source: Any,
         shape: tuple[int, ...] | None = None) -> list[str]:
    """Copy this rank's experts of the stacked tensor `source` (a tensor, or a safetensors slice of full `shape`)
    into `block`; returns the per-expert names (``mlp.experts.N.gate_proj.weight``, ...) it filled, [] when the
    block has no such parameter (expert biases of a family without them)."""
    m = STACKED_RE.match(rest)
    assert m is not None
    gate_up, bias = m.group(1) == "gate_up_proj", m.group(2) is not None
    target = {(True, False): block.gate_up_weight, (False, False): block.down_weight,
              (True, True): block.gate_up_bias, (False, True): block.down_bias}[(gate_up, bias)]
    if target is None:
        return []
    full = tuple(source.shape) if shape is None else tuple(shape)
    dims = checkpoint_dims(block, layout, rest)
    if full != tuple(size for _, size in dims):
        raise ValueError(f"weight {name}: checkpoint shape {full} != expected {tuple(size for _, size in dims)} "
                         f"[{', '.join(label for label, _ in dims)}]")
    experts = block.cfg.expert_range
    part = source[experts.start:experts.stop]
    if not bias and not layout.in_out:
        part = part.transpose(1, 2)
    if gate_up and layout.interleaved:
        part = torch.cat([part[..., 0::2], part[..., 1::2]], dim=-1)
    target.copy_(part)
    kind = "bias" if bias else "weight"
    projs = ("gate", "up") if gate_up else ("down",)
    return [f"mlp.experts.{e}.{x}_proj.{kind}" for e in experts for x in projs]
