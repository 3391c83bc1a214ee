"""Vectorised batch sampler: per-slot state (state.py), penalties (penalties.py), temperature / top-k / top-p /
min-p draws (filters.py) over counter-based randomness (rng.py), and `Sampler.sample` (sampler.py)."""

from ironlm.sampler.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput"]
