"""Paged attention backends.

``get_backend("auto", device)`` picks Triton on CUDA, the fused CPU decode kernel on the CPU, and torch
elsewhere. The Triton backend is imported
lazily: importing ``ironlm.kernels`` runs the ``@triton.jit`` decorators, which must happen after
``TRITON_INTERPRET`` is decided (see tests/test_kernels.py), and CPU-only users never need Triton at all.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ironlm.attention.cpu_backend import CpuAttention
from ironlm.attention.metadata import AttentionMetadata
from ironlm.attention.torch_backend import TorchAttention
from ironlm.config import ATTENTION_BACKENDS


class AttentionBackend(Protocol):
    name: str
    # Whether the backend has `lean_plan` and the core attends a decode step straight from the fused q|k|v
    # projection (`_core.decode_attention_qkv`): the capability the model's lean CPU decode step needs.
    fused_decode_qkv: bool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v ([T, Hkv, D]) at meta.slot_mapping into the paged caches ([num_blocks, block_size, Hkv, D],
        one layer), then attend each query row ([T, Hq, D]) causally over its sequence's context: all of it, or
        with a sliding `window` only the keys at positions (p - window, p] for a query at position p. With
        `softcap` the logits (q k * scale) become softcap * tanh(logits / softcap) before the softmax. With
        `sinks` (float32 [Hq], gpt-oss's attention sinks) head h's softmax denominator gains exp(sinks[h]), a
        term with no value row.
        Returns [T, Hq, D] in q's dtype.

        `v_cache` may be `k_cache` itself (and `v` then `k`): multi-head latent attention's one cached row per
        token is both key and value (model/mla.py); backends write it once and read it as both."""
        ...


BACKENDS = ATTENTION_BACKENDS


def get_backend(name: str = "auto", device: torch.device | str | None = None) -> AttentionBackend:
    dev = torch.device(device) if device is not None else None
    if name == "auto":
        name = "cpu" if dev is None or dev.type == "cpu" else "torch"
        if dev is not None and dev.type == "cuda":
            try:
                import triton  # noqa: F401
            except ImportError:
                pass  # a CUDA torch without triton still runs, on the torch backend
            else:
                name = "triton"
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        return CpuAttention()
    if name == "triton":
        from ironlm.attention.triton_backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "CpuAttention", "TorchAttention", "get_backend"]
