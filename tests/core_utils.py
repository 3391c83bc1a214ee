"""A core `Scheduler` for tests: the binding takes every setting explicitly, so tests fill what they do not
vary from EngineConfig (the one home of the defaults) instead of carrying copies of the numbers."""

from __future__ import annotations

import dataclasses
from typing import Any

from ironlm import _core
from ironlm.config import EngineConfig, SchedulerConfig

# EngineConfig leaves the context length to the model; core tests have no model, so they fix one.
TEST_MAX_MODEL_LEN = 4096


def scheduler_config(num_blocks: int, **overrides: Any) -> SchedulerConfig:
    """EngineConfig's scheduler settings for a pool of `num_blocks`; `overrides` replace fields as given (unchecked
    by Python, so tests reach the core's own validation)."""
    cfg = EngineConfig()
    base = cfg.scheduler_config(num_blocks=num_blocks, max_num_batched_tokens=cfg.resolve_max_num_batched_tokens("cpu"),
                                max_model_len=TEST_MAX_MODEL_LEN, tier_blocks=0, sliding_window=None)
    return dataclasses.replace(base, **overrides)


def make_scheduler(num_blocks: int, **overrides: Any) -> _core.Scheduler:
    return _core.Scheduler(scheduler_config(num_blocks, **overrides))


def spy_rows(monkeypatch: Any, name: str) -> list[int]:
    """Wrap `_core.<name>` for the test: each call's first argument's row count goes into the returned list (which
    kernel a step reached, with how many rows), and the real kernel runs."""
    real = getattr(_core, name)
    calls: list[int] = []

    def spy(first: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(first.shape[0])
        return real(first, *args, **kwargs)

    monkeypatch.setattr(_core, name, spy)
    return calls
