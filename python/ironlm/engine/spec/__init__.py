"""Speculative decoding: which requests may speculate (verify.py); `speculative_config` is ironlm/spec_config.py's.

The proposals themselves (n-gram prompt lookup), their lookahead blocks and the rollback of rejected tokens
are the Rust core's (rust/src/sched/spec.rs, sched/scheduler/spec.rs). A proposal is verified by sampling
every one of its rows from the target model with that row's own random-stream position and accepting the run
while the sampled token equals the proposed one: for a point-mass proposal that is exactly modified rejection
sampling (accept x with probability p(x), else draw from normalize(max(0, p - q)) = p without x), so the output
is the target model's, token for token, with the same seed (a draft model's full q would need the general case:
not built).
"""
