"""Batch-invariant numerics (`EngineConfig.batch_invariant`): every row's result a function of that row's sequence
alone, whatever else shares its step.

Per model: the engine sets `DecoderLM.batch_invariant` from its config, and the model's forward opens `scope` around
its step, so two engines in one process (tests, a pooling and a generating model) keep their own setting even on
concurrent engine threads. Inside the scope the CPU paths read `enabled()` per call: QuantLinear keeps the core's
int8 kernels at every batch size (no dense bf16 GEMM from DENSE_MIN_ROWS rows), DenseLinear multiplies in fixed
tiles of TILE rows (MKL/oneDNN pick their kernel and K blocking by M, so a row's bits depend on how many rows share
the call; within one fixed M they do not, measured for M up to 700 in fp32 and bf16), and CpuAttention sends every
query row, prefill rows included, through the core's paged kernel (one row, one reduction order over its own
context; no SDPA chunks, no cascade merge).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

TILE = 16  # rows per dense GEMM call in invariant mode: padding a decode row to 16 costs ~3x a GEMV, 64 costs ~8x

_state = threading.local()


def enabled() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def scope(on: bool) -> Iterator[None]:
    """Batch-invariant numerics on this thread while the block runs (a model's forward)."""
    before = enabled()
    _state.on = on
    try:
        yield
    finally:
        _state.on = before
