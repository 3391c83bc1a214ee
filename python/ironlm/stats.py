"""Summary statistics of latency samples, shared by `LLM.get_metrics` and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def latency_summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, std, min, max, median, p90, p99 of `values` × `scale` (all 0 for no samples)."""
    keys = ("mean", "std", "min", "max", *("median" if q == 50 else f"p{q}" for q in PERCENTILES))
    if not len(values):
        return dict.fromkeys(keys, 0.0)
    arr = np.asarray(values, dtype=float) * scale
    out = {"mean": float(arr.mean()), "std": float(arr.std()), "min": float(arr.min()), "max": float(arr.max())}
    for q in PERCENTILES:
        out["median" if q == 50 else f"p{q}"] = float(np.percentile(arr, q))
    return out
