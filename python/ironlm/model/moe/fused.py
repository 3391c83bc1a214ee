"""A MoeBlock's routed experts through the Triton fused-MoE kernel (kernels/fused_moe.py): two launches per step
instead of two GEMMs per routed expert, and no host sync (the per-expert loop reads the counts back to slice).

It takes the block's stacked dense weights as they are (`[E, in, out]`), or, after load-time quantization for the
GPU (`backend="triton"`: every expert a `TritonQuantLinear`), the experts' int8 / int4 matrices stacked once into
`[E, N, K']` with each expert's linear re-pointed at its slice, so the weights are held once. It runs on CUDA
tensors, and on the CPU only when a test forces it (`MoeBlock.fused = True`, under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from ironlm import invariant
from ironlm.model.linear_gpu import TritonQuantLinear

if TYPE_CHECKING:
    from ironlm.kernels.fused_moe import MoeWeights

Pair = tuple["MoeWeights", "MoeWeights"]


class Block(Protocol):
    """What this module reads of a MoeBlock (experts.py imports this module, so it cannot import the class)."""

    fused: bool | None
    fused_weights: Pair | None

    @property
    def custom_act(self) -> bool: ...
    @property
    def activation(self) -> str: ...
    @property
    def clamp(self) -> tuple[float, float] | None: ...
    @property
    def first(self) -> int: ...
    @property
    def gate_up_weight(self) -> torch.Tensor: ...
    @property
    def down_weight(self) -> torch.Tensor: ...
    @property
    def gate_up_bias(self) -> torch.Tensor | None: ...
    @property
    def down_bias(self) -> torch.Tensor | None: ...
    @property
    def experts(self) -> list[Any] | None: ...


def takes(block: Block, x: torch.Tensor) -> bool:
    """Whether this step's routed experts run on the kernel: CUDA (or forced), an activation it has, and weights in
    a layout it reads."""
    if block.fused is False or not (block.fused or x.is_cuda) or block.custom_act:
        return False
    if block.clamp is None and block.activation not in ("silu", "gelu_tanh"):
        return False
    return weights(block) is not None


def weights(block: Block) -> Pair | None:
    """The (gate_up, down) stacks the kernel reads, built once per block; None when the experts are in another
    format (the CPU core's blocks, FP8)."""
    if block.fused_weights is not None:
        return block.fused_weights
    from ironlm.kernels.fused_moe import MoeWeights

    pair: Pair | None = None
    if block.gate_up_weight.numel() and block.down_weight.numel():
        pair = (MoeWeights(block.gate_up_weight, bias=block.gate_up_bias),
                MoeWeights(block.down_weight, bias=block.down_bias))
    elif block.experts and _uniform(block.experts):
        pair = (_stack([m.gate_up for m in block.experts]), _stack([m.down for m in block.experts]))
    block.fused_weights = pair
    return pair


def _uniform(experts: list[Any]) -> bool:
    """Every expert's gate_up (and every down) a TritonQuantLinear of one format, in groups BLOCK_K can divide."""
    for lins in ([m.gate_up for m in experts], [m.down for m in experts]):
        if not all(isinstance(lin, TritonQuantLinear) for lin in lins):
            return False
        formats = {(lin.bits, lin.group, lin.bias is None) for lin in lins if isinstance(lin, TritonQuantLinear)}
        if len(formats) != 1 or next(iter(formats))[1] % 32:
            return False
    return True


def _stack(lins: list[TritonQuantLinear]) -> MoeWeights:
    """The experts' matrices as one `[E, ...]` tensor each, every linear re-pointed at its slice (same values: the
    per-expert path, embeddings and byte counts keep working) so the separate copies are freed."""
    from ironlm.kernels.fused_moe import MoeWeights

    q = torch.stack([lin.qweight for lin in lins])
    s = torch.stack([lin.scales for lin in lins])
    biases = [lin.bias for lin in lins if lin.bias is not None]  # all or none (_uniform)
    bias = torch.stack(biases) if biases else None
    for i, lin in enumerate(lins):
        lin.qweight, lin.scales = q[i], s[i]
        if bias is not None:
            lin.bias = bias[i]
    return MoeWeights(q, bits=lins[0].bits, group=lins[0].group, scales=s, bias=bias)


def run(block: Block, x: torch.Tensor, route_w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    from ironlm.kernels.fused_moe import fused_moe, tiles

    pair = weights(block)
    assert pair is not None
    gate_up, down = pair
    blocks = None
    if invariant.enabled():
        # one tile shape for every batch size: a token's dot products then run in the same order in any batch
        _, block_n, block_k = tiles(1, 1, max(gate_up.k, down.k), gate_up.group, down.group)
        blocks = (16, block_n, block_k)
    return fused_moe(x, route_w, ids, gate_up, down, block.activation, block.clamp, block.first, blocks)
