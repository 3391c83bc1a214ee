"""Weight-only quantization at load: which linears stay block-quantized, and building them.

`quantization` (EngineConfig) = `auto` keeps what the file has (a GGUF file's quantized blocks stay quantized on
the CPU; HF checkpoints stay dense), `none` dequantizes everything (the pre-quantization behaviour, bit-identical
to transformers on the dequantized weights), `int8` / `int4` quantize an HF checkpoint's (or a GGUF's) linears at
load: round-to-nearest, one scale per output channel (int8 default) or per group of 32/64/128 weights. `fp8`
(GPUs with FP8 tensor cores, sm_89+) keeps e4m3 weights with a scale per output channel.

Backends: on the CPU the core's block kernels (`_core.QuantMatrix`, model/linear.py); on a GPU int8/int4 go through
the Triton dequant-GEMM and fp8 through `torch._scaled_mm` (model/linear_gpu.py).

Quantized linears are the projections (fused q|k|v, o, fused gate|up, down) and the LM head; a tied embedding is
read from the LM head's blocks (`QuantMatrix.gather`), so the table is stored once. Norms and biases stay dense.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from ironlm import _core
from ironlm.exceptions import InvalidArgumentError

# ggml types the core keeps quantized: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, and MXFP4 (gpt-oss's experts, kept as
# 4-bit E2M1 codes with their E8M0 scales: QuantMatrix kind "mxfp4"; a GPU or `none` dequantizes them at load)
GGML_QUANTIZED = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 39: "MXFP4"}
# GGUF tensor-name suffixes of the linears that stay quantized
_PROJECTIONS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                "ffn_up.weight", "ffn_down.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                "ffn_down_shexp.weight", "attn_q_a.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight")  # + MLA's
_EXPERT = re.compile(r"\.ffn_(gate|up|down)_exps(\.\d+)?\.weight$")  # a stack or one of its experts (moe/gguf.py)


@dataclass(frozen=True)
class QuantSpec:
    """How a model's linears are stored: `bits` 0 = dense; `group_size` 0 = one scale per output channel;
    `source` = "gguf" (the file's own blocks) or "load" (quantized from float weights at load); `backend` = "core"
    (CPU block kernels), "triton" (GPU int8/int4) or "fp8" (GPU `_scaled_mm`)."""

    bits: int = 0
    group_size: int = 0
    source: str = "load"
    backend: str = "core"

    @property
    def enabled(self) -> bool:
        return self.bits > 0


def resolve(quantization: str, group_size: int | None, device: torch.device,
            file_quantized: bool | None) -> QuantSpec:
    """The storage for one load: `auto` follows the file (`file_quantized`: a GGUF whose linears are quantized
    blocks; None for HF checkpoints) on the CPU and dequantizes on a GPU; int8/int4 run on either; fp8 needs a GPU
    with FP8 tensor cores."""
    if quantization in ("awq", "gptq", "compressed-tensors"):  # HF folders with a quantization_config: prequant/
        raise InvalidArgumentError(f"quantization: {quantization} loads an HF checkpoint quantized with it "
                                   "(config.json quantization_config), not this model", "quantization")
    if quantization == "none" or (quantization == "auto" and (not file_quantized or device.type != "cpu")):
        return QuantSpec()
    if quantization == "auto":
        return QuantSpec(bits=4, source="gguf")
    if quantization == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            raise InvalidArgumentError(
                f"quantization: fp8 needs a GPU with FP8 tensor cores (sm_89+: Ada, Hopper), not {device}; "
                "use int8 or int4", "quantization")
        return QuantSpec(bits=8, backend="fp8")
    bits = 8 if quantization == "int8" else 4
    group = (0 if bits == 8 else 32) if group_size is None else group_size
    return QuantSpec(bits=bits, group_size=group, backend="core" if device.type == "cpu" else "triton")


def is_quantized_tensor(gguf_name: str) -> bool:
    """Whether a GGUF tensor is one of the linears a quantized model keeps quantized (embedding included)."""
    return (gguf_name.endswith(_PROJECTIONS) or gguf_name in ("token_embd.weight", "output.weight")
            or _EXPERT.search(gguf_name) is not None)


def from_float(weight: torch.Tensor, spec: QuantSpec) -> _core.QuantMatrix:
    """A dense `[out, in]` weight (any dtype, possibly a strided view) quantized per `spec`."""
    w = np.ascontiguousarray(weight.detach().float().numpy())
    return _core.QuantMatrix.from_float(w, spec.bits, fit_group(w.shape[1], spec.group_size))


def fit_group(cols: int, group: int) -> int:
    """The group a `cols`-wide row can take: `group` when it divides, else the largest multiple of 32 below it that
    does (576 columns in groups of 128 → 64), else one scale per row (0)."""
    if group == 0 or cols % group == 0:
        return group
    fits = [g for g in range(32, group + 1, 32) if cols % g == 0]
    return max(fits) if fits else 0
