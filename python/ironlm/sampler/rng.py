"""Counter-based randomness: a row's uniform is a hash of (slot seed, output position, attempt).

No generator state: a draw depends only on its own seed and position, not on which rows share the batch nor
where it sits in it, and a recomputed (preempted) sequence continues its stream where it was.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROUND = 0xD1B54A32D192ED03
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# Keeps u * total strictly below total after float64 rounding, so the inverse CDF never runs past the last
# token with non-zero mass.
U_MAX = 1.0 - 2.0**-40


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic, which numpy arrays do silently)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: np.ndarray, positions: np.ndarray, attempt: int = 0) -> np.ndarray:
    """Uniform [0, 1) per row from (mixed seed, output position, attempt)."""
    x = seeds + (positions.astype(np.uint64) + np.uint64(1)) * _GOLDEN + np.uint64(attempt * _ROUND & _MASK64)
    u = (_splitmix64(x) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.minimum(u, U_MAX)


def mix_seed(seed: int) -> np.uint64:
    # Nearby user seeds (0, 1, 2 ...) would give overlapping splitmix streams; hashing them first decorrelates.
    return _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))[0]
