"""Building blocks of the decoder: RMSNorm, rotary embeddings (default / linear / llama3 / yarn / GGUF freq
factors) with a lazily grown cos|sin table, and the gated MLP activations (SiLU, GELU-tanh).

On the CPU, RMSNorm, RoPE, SiLU-mul and GELU-tanh-mul run as single fused kernels of the core (``ironlm._core``) for f32, bf16
and fp16: at batch 1 the torch op chains they replace cost more in dispatch than the matmuls between them.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from ironlm import _core
from ironlm.core_views import CORE_DTYPES, as_numpy, core_ok
from ironlm.model.config import ModelConfig, UnsupportedModelError

__all__ = ["CORE_DTYPES", "CoreRope", "RotaryEmbedding", "act_and_mul", "apply_rotary", "as_numpy", "core_ok",
           "cpu_has_fast_bf16", "rms_norm", "rope_inv_freq", "silu_and_mul"]


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU does bf16 math natively (AVX512_BF16 or AMX): there bf16 weights halve the bytes a decode
    step streams and the matmuls run at least as fast as in fp32; elsewhere torch emulates bf16 and fp32 wins."""
    features = set(_core.cpu_features())
    return "avx512_bf16" in features or "amx_bf16" in features


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32 (like HF's upcast). One fused kernel on CPU."""
    if core_ok(x):
        out = torch.empty(x.shape, dtype=x.dtype)
        w = None if weight is None else as_numpy(weight)
        _core.rms_norm(as_numpy(x), w, eps, as_numpy(out), CORE_DTYPES[x.dtype], torch.get_num_threads())
        return out
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]: one pass over memory on CPU instead of torch's three.

    Measured (one thread, I = 1536): 551 vs 638 us at 512 rows (bf16 496 vs 645), even at 64. A single row would be
    1.6 us cheaper through torch, but torch's SiLU rounds differently from the core's, which the lean decode step
    uses: one row would then get other bits alone than in a batch."""
    if core_ok(gate_up):
        out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype)
        _core.silu_and_mul(as_numpy(gate_up), as_numpy(out), CORE_DTYPES[out.dtype], torch.get_num_threads())
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate)
    out.mul_(up)
    return out


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up for the config's `activation` (silu | gelu_tanh). GELU-tanh goes
    through the core on CPU, as the lean decode step's does: a decode row gets the same bits on either path."""
    if activation == "silu":
        return silu_and_mul(gate_up)
    if core_ok(gate_up):
        out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype)
        _core.gelu_tanh_and_mul(as_numpy(gate_up), as_numpy(out), CORE_DTYPES[out.dtype], torch.get_num_threads())
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.gelu(gate, approximate="tanh")
    out.mul_(up)
    return out


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (fp32) and the cos/sin scale factor, exactly as transformers builds them."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    attention_factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context_len = scaling.get("original_max_position_embeddings") or 8192
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
    elif rope_type == "yarn":
        if config.hf_config is None:
            raise UnsupportedModelError("yarn rope scaling is only supported for HF checkpoints")
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config.hf_config, torch.device("cpu"))
        inv_freq = inv_freq.float().cpu()
    elif rope_type == "longrope":
        inv_freq, attention_factor = _longrope(config, scaling, dim, base)
    elif rope_type != "default":
        raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}")
    if config.rope_freq_factors is not None:
        factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise UnsupportedModelError(
                f"rope_freqs has {factors.numel()} entries, expected head_dim/2 = {inv_freq.numel()}"
            )
        inv_freq = inv_freq / factors
    return inv_freq, float(attention_factor)


def _longrope(config: ModelConfig, scaling: dict, dim: int, base: float) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE ('su'): per-frequency divisors, the long set when the model's context exceeds the original
    one, the short set otherwise. transformers switches per forward call (long once a call's sequence passes
    original_max_position_embeddings), which would rotate one position differently depending on how its sequence
    was batched; like llama.cpp (per context size), ironlm fixes the choice per model, so prefix caching, chunked
    prefill and preemption see one rotation per position. Both agree wherever every sequence is longer than the
    original context, or the context is not extended."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or config.max_position_embeddings / orig
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    key = "long_factor" if config.max_position_embeddings > orig else "short_factor"
    ext = torch.tensor(scaling[key], dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise UnsupportedModelError(f"longrope {key} has {ext.numel()} entries, expected rotary dim / 2 = {dim // 2}")
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Neox-style (rotate-half) rotary embedding with a cos|sin table [P, head_dim] in the model dtype.

    The table starts at min(max_position_embeddings, 4096) rows and grows (doubling) when a step needs more;
    the step's length comes from host metadata, so growing never syncs with the device.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq, self.scale = rope_inv_freq(config)
        self.dtype = dtype
        self.device = device
        self.table = torch.empty(0, config.head_dim, dtype=dtype, device=device)
        self._table_np: tuple[torch.Tensor, np.ndarray] | None = None  # (table, its numpy view) for the core
        self.ensure(min(config.max_position_embeddings, 4096))

    def ensure(self, length: int) -> None:
        if length <= self.table.shape[0]:
            return
        size = max(length, 2 * self.table.shape[0], 64)
        pos = torch.arange(size, dtype=torch.int64).float()
        freqs = pos[:, None] * self.inv_freq[None, :]
        cos = freqs.cos() * self.scale
        sin = freqs.sin() * self.scale
        self.table = torch.cat([cos, sin], dim=-1).to(device=self.device, dtype=self.dtype)

    def cos_sin(self, positions: torch.Tensor, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, each [T, 1, head_dim/2] (ready to broadcast over heads)."""
        if max_len is not None:
            self.ensure(max_len)
        cos, sin = self.table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def fused(self, positions: torch.Tensor, max_len: int) -> CoreRope | None:
        """The step's inputs for the core's in-place RoPE, or None where it does not apply (GPU, other dtypes)."""
        if not core_ok(self.table) or positions.device.type != "cpu":
            return None
        self.ensure(max_len)
        if self._table_np is None or self._table_np[0] is not self.table:
            self._table_np = (self.table, as_numpy(self.table))
        pos = positions.numpy() if positions.dtype == torch.int64 else positions.long().numpy()
        return CoreRope(pos, self._table_np[1], CORE_DTYPES[self.dtype])


class CoreRope:
    """One step's positions and the cos|sin table as numpy views, shared by every layer."""

    __slots__ = ("dtype", "positions", "table")

    def __init__(self, positions: np.ndarray, table: np.ndarray, dtype: str) -> None:
        self.positions, self.table, self.dtype = positions, table, dtype

    def apply_(self, qkv: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate the first `heads` heads of every row of `qkv` ([T, width], contiguous) in place."""
        _core.rope_inplace(as_numpy(qkv), self.positions, self.table, heads, head_dim, self.dtype,
                           torch.get_num_threads())


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (may be a strided view) -> new contiguous [T, H, D] rotated by (cos, sin) [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out
