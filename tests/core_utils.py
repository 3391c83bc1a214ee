"""A core `Scheduler` for tests: the binding takes every setting explicitly, so tests fill what they do not
vary from EngineConfig (the one home of the defaults) instead of carrying copies of the numbers."""

from __future__ import annotations

from typing import Any

from ironlm import _core
from ironlm.config import EngineConfig

# EngineConfig leaves the context length to the model; core tests have no model, so they fix one.
TEST_MAX_MODEL_LEN = 4096


def scheduler_kwargs(num_blocks: int, **overrides: Any) -> dict[str, Any]:
    cfg = EngineConfig()
    kw: dict[str, Any] = {
        "num_blocks": num_blocks, "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.resolve_max_num_batched_tokens("cpu"),
        "max_model_len": TEST_MAX_MODEL_LEN, "policy": cfg.scheduling_policy,
        "enable_prefix_caching": cfg.enable_prefix_caching, "max_queue_len": cfg.max_queue_len,
    }
    return kw | overrides


def make_scheduler(num_blocks: int, **overrides: Any) -> _core.Scheduler:
    return _core.Scheduler(**scheduler_kwargs(num_blocks, **overrides))
