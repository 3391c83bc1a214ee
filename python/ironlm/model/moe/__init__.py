"""Mixture-of-experts layers, shared by every MoE family: spec.py (what a MoE layer is; no torch, so ModelConfig
can carry it), route.py (`route`: each token's experts and weights), experts.py (`MoeBlock`: the experts, run only
where routed), stacked.py (checkpoints that stack the experts in one tensor), gguf.py (GGUF's). This package's
__init__ imports nothing, so importing spec.py does not load torch."""
