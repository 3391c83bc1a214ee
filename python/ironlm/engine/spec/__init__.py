"""Speculative decoding: which requests may speculate (verify.py), the draft model (draft.py);
`speculative_config` is ironlm/spec_config.py's.

n-gram proposals, every proposal's lookahead blocks and the rollback of rejected tokens are the Rust core's
(rust/src/sched/spec.rs, sched/scheduler/spec.rs); a draft model's proposals are handed to the core
(`Scheduler.set_proposals`) for rows it reserved. An n-gram proposal is verified by sampling every one of its
rows from the target model with that row's own random-stream position and accepting the run while the sampled
token equals the proposed one: for a point-mass proposal that is exactly modified rejection sampling (accept x
with probability p(x), else draw from normalize(max(0, p - q)) = p without x), so the output is the target
model's, token for token, with the same seed. A draft model's proposals carry their full q: the sampler applies
the general rule (sampler/rejection.py).
"""
