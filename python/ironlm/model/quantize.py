"""Weight-only quantization at load: which linears stay block-quantized, and building them.

`quantization` (EngineConfig) = `auto` keeps what the file has (a GGUF file's quantized blocks stay quantized on
the CPU; HF checkpoints stay dense), `none` dequantizes everything (the pre-quantization behaviour, bit-identical
to transformers on the dequantized weights), `int8` / `int4` quantize an HF checkpoint's (or a GGUF's) linears at
load: round-to-nearest, one scale per output channel (int8 default) or per group of 32/64/128 weights.

Quantized linears are the projections (fused q|k|v, o, fused gate|up, down) and the LM head; a tied embedding is
read from the LM head's blocks (`QuantMatrix.gather`), so the table is stored once. Norms and biases stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ironlm import _core
from ironlm.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from ironlm.model.gguf import GGUFFile

# ggml types the core keeps quantized: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K
GGML_QUANTIZED = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# GGUF tensor-name suffixes of the linears that stay quantized
_PROJECTIONS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                "ffn_up.weight", "ffn_down.weight")


@dataclass(frozen=True)
class QuantSpec:
    """How a model's linears are stored: `bits` 0 = dense; `group_size` 0 = one scale per output channel;
    `source` = "gguf" (the file's own blocks) or "load" (quantized from float weights at load)."""

    bits: int = 0
    group_size: int = 0
    source: str = "load"

    @property
    def enabled(self) -> bool:
        return self.bits > 0


def resolve(quantization: str, group_size: int | None, device: torch.device, gguf: GGUFFile | None) -> QuantSpec:
    """The storage for one load: `auto` follows the file, int8/int4 need a CPU (the kernels are the core's)."""
    if quantization in ("none", "auto") and (quantization == "none" or gguf is None or device.type != "cpu"):
        return QuantSpec()
    if device.type != "cpu":
        raise InvalidArgumentError(
            f"quantization: {quantization} runs on the CPU kernels of the core; use quantization='none' "
            f"(or 'auto') on {device}", "quantization")
    if quantization == "auto":
        assert gguf is not None
        quantized = any(info.ggml_type in GGML_QUANTIZED for name, info in gguf.tensors.items()
                        if name.endswith(_PROJECTIONS))
        return QuantSpec(bits=4, source="gguf") if quantized else QuantSpec()
    bits = 8 if quantization == "int8" else 4
    group = (0 if bits == 8 else 32) if group_size is None else group_size
    return QuantSpec(bits=bits, group_size=group)


def is_quantized_tensor(gguf_name: str) -> bool:
    """Whether a GGUF tensor is one of the linears a quantized model keeps quantized (embedding included)."""
    return gguf_name.endswith(_PROJECTIONS) or gguf_name in ("token_embd.weight", "output.weight")


def from_float(weight: torch.Tensor, spec: QuantSpec) -> _core.QuantMatrix:
    """A dense `[out, in]` weight (any dtype, possibly a strided view) quantized per `spec`."""
    w = np.ascontiguousarray(weight.detach().float().numpy())
    cols = w.shape[1]
    group = spec.group_size
    if group and cols % group:  # e.g. 576 columns and groups of 128: the largest block multiple that divides
        group = max(g for g in range(32, group + 1, 32) if cols % g == 0)
    return _core.QuantMatrix.from_float(w, spec.bits, group)


def from_gguf(gf: GGUFFile, name: str, spec: QuantSpec, unpermute_heads: int = 0) -> _core.QuantMatrix:
    """A GGUF tensor as a QuantMatrix: quantized types keep their blocks (rows re-ordered for llama Q/K without
    dequantizing: a block never spans rows); float tensors are quantized per `spec` (int8, groups of 32 when the
    file decides)."""
    from ironlm.model.gguf import dequantize, unpermute_qk

    info = gf.tensors[name]
    rows, cols = info.shape
    if info.ggml_type in GGML_QUANTIZED and spec.source == "gguf":
        raw = np.asarray(gf.raw(info)).reshape(rows, -1)
        if unpermute_heads:
            raw = unpermute_qk(torch.from_numpy(raw.copy()), unpermute_heads).numpy()
        return _core.QuantMatrix.from_ggml(np.ascontiguousarray(raw).reshape(-1), info.ggml_type, rows, cols)
    w = dequantize(gf.raw(info), info.ggml_type, info.shape)
    if unpermute_heads:
        w = unpermute_qk(w, unpermute_heads)
    fallback = spec if spec.source == "load" else QuantSpec(bits=8, group_size=32)
    return from_float(w, fallback)
