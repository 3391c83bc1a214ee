"""Which requests may speculate: those whose every sampled row the sampler can verify exactly."""

from __future__ import annotations

from ironlm.sampling_params import SamplingParams


def may_speculate(params: SamplingParams) -> bool:
    """Penalties depend on the tokens sampled before a row in the same step (the proposals' rows would see a
    stale history), and a grammar may reject a proposal mid-run: those requests decode one token a step (the
    core also never speculates for a grammar-constrained sequence)."""
    penalties = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                 or params.frequency_penalty != 0.0)
    return not penalties and params.structured_outputs is None
