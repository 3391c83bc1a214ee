"""One small decode batch through the lean CPU step or the ordinary forward, for the tests that hold the two equal
bit for bit (dense families, Gemma's post-norms, MoE layers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

CONTEXTS = (5, 11, 14)  # three sequences in blocks of 4 (Gemma's local layers: two past their window)
BLOCK = 4


def decode_batch(model: Any, dtype: torch.dtype, lean_on: bool,
                 monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The logits of one decode step of three sequences over random caches (the same for both paths), and the
    caches it wrote into; the lean step is allowed (`lean_on`) or held off."""
    from ironlm.attention import AttentionMetadata
    from ironlm.model import lean

    cfg = model.config
    monkeypatch.setattr(lean, "LEAN_MAX_TOKENS", 8 if lean_on else 0)
    shape = (16, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
              for _ in range(cfg.num_layers)]
    ctx = np.array(CONTEXTS)
    meta = AttentionMetadata.from_lengths(context_lens=ctx, query_lens=np.ones(len(ctx), np.int64),
                                          block_tables=np.arange(12, dtype=np.int32).reshape(3, 4),
                                          block_size=BLOCK)
    return model(torch.tensor([3, 17, 42]), torch.from_numpy(ctx), caches, meta, torch.arange(len(ctx))), caches


def assert_same_step(got: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]],
                     want: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """Logits and every cache row written equal bit for bit."""
    assert torch.equal(got[0], want[0])
    for (k, v), (k2, v2) in zip(got[1], want[1], strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
