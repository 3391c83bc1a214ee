"""Which requests may speculate: those whose every sampled row the sampler can verify exactly."""

from __future__ import annotations

from ironlm.sampling_params import SamplingParams


def may_speculate(params: SamplingParams) -> bool:
    """Penalties depend on the tokens sampled before a row in the same step (the proposals' rows would see a
    stale history): those requests decode one token a step. A grammar-constrained request speculates: the core
    cuts its proposal where the grammar rejects it and masks each verification row with the grammar state
    after the proposals before it."""
    return params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
