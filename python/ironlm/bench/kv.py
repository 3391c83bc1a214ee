"""What the KV benchmarks measure inside the engine: per-step prefill work and pool fragmentation, tier counters.

`StepTap` sits between `LLMEngine.step` and the model runner for the length of one timed run, so it sees every
plan that reaches a forward (what `LLMEngine.step` does not hand back) and samples the core's slot counters at
that moment, when the step's blocks are allocated.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

# EngineConfig fields that give the engine a tier below the device pool; without them there is none.
TIER_FIELDS = ("kv_offload_memory", "kv_offload_dir", "kv_offload_size", "swap_space")

# Core counters (Scheduler.stats) the KV reports difference over a run.
TIER_COUNTERS = ("prefix_queries", "prefix_hits", "prefix_hits_tier", "kv_promotions", "kv_demotions",
                 "swap_out_blocks", "swap_in_blocks", "num_preemptions")


@dataclass
class StepTap:
    """Counts, over the steps of one run: prefill/decode tokens computed, prefix-cache tokens found at
    admission, and the slots of the blocks running sequences hold vs the tokens in them (KV waste)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    slots_allocated: int = 0
    slots_used: int = 0
    # Runner time (tier copies + forward) of steps with prefill tokens vs decode-only steps: what bounds a run.
    prefill_steps_s: float = 0.0
    decode_only_steps_s: float = 0.0
    decode_only_steps: int = 0

    def attach(self, engine) -> StepTap:
        self._engine = engine
        self._execute = engine.runner.execute
        engine.runner.execute = self._observe  # an instance attribute: the class and other engines are untouched
        return self

    def detach(self) -> None:
        del self._engine.runner.execute

    def _observe(self, plan, timer=None, extra_rows=None):
        self.steps += 1
        self.prefill_tokens += plan.num_prefill_tokens
        self.decode_tokens += plan.num_decode_tokens
        self.cached_tokens += plan.num_cached_tokens
        s = self._engine.scheduler.stats()
        self.slots_allocated += s["kv_slots_allocated"]
        self.slots_used += s["kv_slots_used"]
        t0 = time.perf_counter()
        logits = self._execute(plan, timer, extra_rows)  # the step timer syncs a GPU at the forward's end
        dt = time.perf_counter() - t0
        if plan.num_prefill_tokens:
            self.prefill_steps_s += dt
        else:
            self.decode_only_steps_s += dt
            self.decode_only_steps += 1
        return logits

    @property
    def kv_waste(self) -> float:
        """1 - used/allocated slots summed over steps: the step-weighted internal fragmentation of the pool."""
        return 1.0 - self.slots_used / self.slots_allocated if self.slots_allocated else 0.0

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                "cached_tokens": self.cached_tokens, "kv_slots_allocated": self.slots_allocated,
                "kv_slots_used": self.slots_used, "kv_waste": self.kv_waste,
                "prefill_steps_s": self.prefill_steps_s, "decode_only_steps_s": self.decode_only_steps_s,
                "decode_only_steps": self.decode_only_steps}


def core_counters(engine) -> dict[str, int]:
    s = engine.scheduler.stats()
    return {k: int(s[k]) for k in TIER_COUNTERS}


def counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def has_tier(engine_args: dict[str, Any]) -> bool:
    return (engine_args.get("kv_offload_memory") is not None or engine_args.get("kv_offload_dir") is not None
            or bool(engine_args.get("swap_space")))


def without_tier(engine_args: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in engine_args.items() if k not in TIER_FIELDS}


def block_bytes(engine) -> int:
    """Bytes one KV block takes in this engine's pool (every layer, keys and values)."""
    from ironlm.engine.kv_cache import bytes_per_block

    return bytes_per_block(engine.runner.shard_config, engine.config.block_size, engine.runner.kv_dtype)


class FreshTierDir:
    """An empty folder for a disk tier, removed afterwards: a tier file left by an earlier run of the same
    seeded workload would turn its first requests into free hits. Inside `parent` when one is given."""

    def __init__(self, parent: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix="ironlm-kv-bench-", dir=parent)

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def close_llm(llm) -> None:
    """End an offline engine the way a server shutdown does, so that a disk tier writes its index."""
    llm.engine.shutdown()
