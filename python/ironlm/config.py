"""Engine configuration: one dataclass shared by `LLM`, `ironlm serve` and the benchmarks."""

from __future__ import annotations

import re
from dataclasses import dataclass

_POLICIES = ("fcfs", "priority", "deadline")
# Here rather than in ironlm.attention so that config validation and the CLIs need no torch import.
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: int | str | None, field: str = "kv_cache_memory") -> int | None:
    """`2GiB`, `512MB`, `1e9` or a plain int → bytes."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"{field} must be > 0, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{field} must be bytes or a size such as '2GiB', got {value!r}")
    try:
        number = float(match.group(1))
    except ValueError:
        raise ValueError(f"{field} must be bytes or a size such as '2GiB', got {value!r}") from None
    size = int(number * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{field} must be > 0, got {value!r}")
    return size


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = the built-in SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto = cuda if available, else cpu
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes or "2GiB"; default: 1 GiB on CPU, a fraction of free GPU memory
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped to 8192 on CPU)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 2048 on CPU, 8192 on GPU (at least max_num_seqs)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_queue_len: int | None = None
    request_timeout: float | None = None  # seconds a request may wait in the queue before it times out
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    seed: int = 0
    served_model_name: str | None = None
    warmup: bool = True

    def __post_init__(self) -> None:
        positive = {"block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                    "num_kv_blocks": self.num_kv_blocks, "max_model_len": self.max_model_len,
                    "max_num_batched_tokens": self.max_num_batched_tokens, "max_queue_len": self.max_queue_len}
        for name, value in positive.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        parse_bytes(self.kv_cache_memory)
