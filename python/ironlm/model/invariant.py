"""Batch-invariant numerics (`EngineConfig.batch_invariant`): every row's result a function of that row's sequence
alone, whatever else shares its step.

Process-wide, like torch's own determinism switch: the engine sets it once when it loads the model (TP workers
too), and the CPU paths it affects read it per call: QuantLinear keeps the core's int8 kernels at every batch
size (no dense bf16 GEMM from DENSE_MIN_ROWS rows), DenseLinear multiplies in fixed tiles of TILE rows (MKL/oneDNN
pick their kernel and K blocking by M, so a row's bits depend on how many rows share the call; within one fixed M
they do not, measured for M up to 700 in fp32 and bf16), and CpuAttention sends every query row, prefill rows
included, through the core's paged kernel (one row, one reduction order over its own context; no SDPA chunks, no
cascade merge).
"""

from __future__ import annotations

TILE = 16  # rows per dense GEMM call in invariant mode: padding a decode row to 16 costs ~3x a GEMV, 64 costs ~8x

_enabled = False


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)
