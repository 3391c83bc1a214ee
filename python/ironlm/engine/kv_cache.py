"""Paged KV tensors: sizing, allocation and copy-on-write block copies."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ironlm.config import EngineConfig
from ironlm.exceptions import InvalidArgumentError
from ironlm.model import resolve_dtype
from ironlm.model.config import ModelConfig
from ironlm.model.layers import cpu_has_fast_bf16

# vLLM's names for 8-bit caches: fp8 is e4m3 (the "fn" variant: no infinities, largest 448), as on its GPUs.
FP8_CACHES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# Per layer: (keys, values) [blocks, block_size, Hkv, D]. Latent attention (ModelConfig.mla) caches one row per
# token that is both key and value: its pair is the SAME tensor twice (`k is v`), so it costs one plane of bytes.
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device,
                     quantized: bool = False) -> torch.dtype:
    """The cache's element type (EngineConfig.kv_cache_dtype): auto = the activations' `dtype`, but 16-bit where
    they are float32 only because the weights are kept quantized for the core's CPU kernels (`quantized`: a GGUF's
    blocks, int8/int4 under dtype auto), as llama.cpp's default f16 cache: bfloat16 on CPUs with native bf16, whose
    prefill chunks then take the core's bf16 attention tiles (CpuAttention), float16 elsewhere. Explicitly, a 16-bit
    type under float32 activations on CPU, where the core's kernels and the torch path read it (rows rounded once,
    on the write), or an 8-bit float (FP8_CACHES) under float32 or bfloat16 on CPU; anything else must equal
    `dtype`."""
    if kv_cache_dtype == "auto":
        if quantized and device.type == "cpu" and dtype == torch.float32:
            return torch.bfloat16 if cpu_has_fast_bf16() else torch.float16
        return dtype
    if kv_cache_dtype in FP8_CACHES:
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise InvalidArgumentError(
                f"kv_cache_dtype: {kv_cache_dtype} caches are implemented on CPU under float32 or bfloat16 "
                f"activations, not {str(dtype).removeprefix('torch.')} on {device.type}", "kv_cache_dtype")
        return FP8_CACHES[kv_cache_dtype]
    try:
        kv = resolve_dtype(kv_cache_dtype, device)  # the dtype names and aliases, one table
    except ValueError:
        raise InvalidArgumentError(f"kv_cache_dtype: must be auto, float32, float16, bfloat16, fp8, fp8_e4m3 or "
                                   f"fp8_e5m2, got {kv_cache_dtype!r}", "kv_cache_dtype") from None
    if kv != dtype and not (device.type == "cpu" and dtype == torch.float32 and kv != torch.float32):
        raise InvalidArgumentError(
            f"kv_cache_dtype: a {kv_cache_dtype} cache under {str(dtype).removeprefix('torch.')} activations on "
            f"{device.type} is not supported (a 16-bit cache needs float32 activations on CPU)", "kv_cache_dtype")
    return kv


def quantized_auto(dtype: str, model: Any) -> bool:
    """Whether the model runs float32 activations only because dtype is auto and its linears are kept quantized for
    the core's CPU kernels (`load_model`'s rule), so that resolve_kv_dtype's auto picks a 16-bit cache."""
    quant = getattr(model, "quant", None)
    return dtype == "auto" and quant is not None and quant.enabled and quant.backend == "core"


def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model_config.kv_bytes_per_token(elem) * block_size


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                  profile: Callable[[], None], extra_block_bytes: int = 0) -> int:
    """`num_kv_blocks` if set, else the configured pool size (EngineConfig.resolve_kv_cache_memory), else (GPU)
    a share of the free memory left after a profiling forward of a full token budget. `extra_block_bytes`: what
    each block costs besides this model's KV (a draft model's pool, indexed by the same block ids)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(model_config, config.block_size, dtype) + extra_block_bytes
    budget = config.resolve_kv_cache_memory(device.type)
    if budget is None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile()  # a forward over the engine's full token budget
        free, total = torch.cuda.mem_get_info(device)
        peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        budget = int(free - (1 - config.gpu_memory_utilization) * total - peak_extra)
    blocks = budget // per_block
    if blocks < 1:
        raise InvalidArgumentError(
            f"kv_cache_memory ({budget} bytes) is smaller than one KV block ({per_block} bytes)",
            param="kv_cache_memory")
    return int(blocks)


_HUGE_PAGE = 2 << 20


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache plane; on CPU, one the kernel may back with transparent huge pages. A decode step reads each
    sequence's blocks scattered over the pool: on 4 KiB pages a block spans pages that the hardware prefetchers
    stop at and the TLB misses on (2-core Zen 4: W's decode attention 4.71 -> 4.05 s and 4.32 -> 3.69 s in two
    alternating pairs, 0.65 of ~20 s; the kernel alone, 34 sequences over a 576 MiB pool, 0.653 -> 0.568 ms a
    layer). THP's common default, madvise, gives huge pages only to regions that ask."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # One huge page more than needed, so that the plane can start on a huge page.
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP off or unsupported: plain pages
    raw = np.frombuffer(buf, dtype=np.uint8)
    start = -raw.ctypes.data % _HUGE_PAGE
    # Touched now, as torch.zeros touches its pages: the pool is resident from the start (RSS does not creep up
    # as blocks are first used, which a soak would read as growth), and each fault maps a huge page.
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape).zero_()


def allocate_kv_caches(model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> KVCaches:
    shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    caches: KVCaches = []
    for _ in range(model_config.num_layers):
        k = _zeros(shape, dtype, device)
        caches.append((k, k) if model_config.mla else (k, _zeros(shape, dtype, device)))
    return caches


def copy_blocks(kv_caches: KVCaches, pairs: np.ndarray) -> None:
    """Copy-on-write: block `src` → block `dst` in every layer, all pairs at once."""
    device = kv_caches[0][0].device
    src = torch.from_numpy(np.ascontiguousarray(pairs[:, 0])).to(device)
    dst = torch.from_numpy(np.ascontiguousarray(pairs[:, 1])).to(device)
    for k, v in kv_caches:
        k[dst] = k[src]
        if v is not k:
            v[dst] = v[src]
