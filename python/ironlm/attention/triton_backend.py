"""Paged attention through the Triton kernels in ``ironlm.kernels`` (the CUDA path).

Per step, the host plan (from the metadata's ``*_cpu`` arrays, no device syncs) splits the sequences into decode
rows (query length 1: the split-K decode kernel) and prefill/extend chunks (the prefill kernel); both write into
one output tensor. The plan is memoised in ``meta.plan_cache`` so layers 2..N only launch kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ironlm.attention.metadata import AttentionMetadata
from ironlm.kernels.cache_write import reshape_and_cache
from ironlm.kernels.decode_attention import paged_decode_attention
from ironlm.kernels.prefill_attention import paged_prefill_attention


@dataclass
class _TritonPlan:
    decode_ids: torch.Tensor  # int32 sequence indices with query length 1
    prefill_ids: torch.Tensor  # int32 sequence indices with longer chunks
    decode_max_seq_len: int
    prefill_max_query_len: int
    num_tokens: int


def _make_plan(meta: AttentionMetadata, device: torch.device) -> _TritonPlan:
    qlens = np.diff(meta.query_start_loc_cpu.astype(np.int64))
    dec = np.nonzero(qlens == 1)[0].astype(np.int32)
    pre = np.nonzero(qlens > 1)[0].astype(np.int32)
    seq_lens = meta.seq_lens_cpu

    def ids(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

    return _TritonPlan(
        decode_ids=ids(dec),
        prefill_ids=ids(pre),
        decode_max_seq_len=int(seq_lens[dec].max(initial=0)),
        prefill_max_query_len=int(qlens[pre].max(initial=0)),
        num_tokens=int(meta.query_start_loc_cpu[-1]),
    )


class TritonAttention:
    """AttentionBackend on the Triton kernels. head_dim must be a power of two >= 16 (tl.arange / tl.dot)."""

    name = "triton"
    fused_decode_qkv = False  # see AttentionBackend

    def __init__(self, *, decode_block_n: int = 64, prefill_block_m: int = 64, prefill_block_n: int = 64,
                 decode_num_splits: int | None = None, num_sms: int | None = None) -> None:
        self.decode_block_n = decode_block_n
        self.decode_num_splits = decode_num_splits  # None: chosen per step from batch size and context
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n
        self._num_sms = num_sms

    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else 4)
        return self._num_sms

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
        d = q.shape[-1]
        if d < 16 or d & (d - 1):
            raise ValueError(f"the triton attention backend needs a power-of-two head_dim >= 16, got {d}; "
                             "use the torch backend")
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = meta.plan_cache.get("triton")
        if plan is None:
            plan = _make_plan(meta, q.device)
            meta.plan_cache["triton"] = plan
        if q.stride(2) != 1:
            q = q.contiguous()
        # Padding rows (beyond the real tokens) are never written by the kernels: zero them.
        out = torch.zeros_like(q) if plan.num_tokens < q.shape[0] else torch.empty_like(q)
        if plan.decode_ids.numel():
            paged_decode_attention(
                q, k_cache, v_cache, out, plan.decode_ids, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                scale, plan.decode_max_seq_len, block_n=self.decode_block_n, num_splits=self.decode_num_splits,
                num_sms=self._sms(q.device), window=window, softcap=softcap, sinks=sinks,
            )
        if plan.prefill_ids.numel():
            paged_prefill_attention(
                q, k_cache, v_cache, out, plan.prefill_ids, meta.query_start_loc, meta.seq_lens,
                meta.block_tables, scale, plan.prefill_max_query_len, block_m=self.prefill_block_m,
                block_n=self.prefill_block_n, window=window, softcap=softcap, sinks=sinks,
            )
        return out
