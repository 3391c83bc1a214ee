"""The KV tier's life around the step: restored at start, costed, pinned prefixes, saved at shutdown.

The core plans every copy between the device pool and the tier (kv/tier.py stores them); what it cannot do
alone is read the disk tier's index at start, know what a copy costs against a recompute, prefill the
`kv_pin_prefix` texts, and write every cached block back at the end. `TierLifecycle` does those, for the engine
that owns it, on the scheduler the engine last `attach`ed (a reset replaces the scheduler).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ironlm import _core
from ironlm.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from ironlm.config import EngineConfig
    from ironlm.engine.kv.tier import KVTier
    from ironlm.engine.model_runner import ModelRunner

logger = logging.getLogger("ironlm.engine")

# The promotion cost model's prefill estimate follows steps whose forward is at least this many prefill tokens
# (and mostly prefill), as an exponential average; the core gets a new figure once it moves by _COST_DRIFT.
_COST_MIN_PREFILL = 64
_COST_EMA = 0.2
_COST_DRIFT = 0.25

# Prefills one prompt as a one-token request until it finishes; returns its prompt token ids.
Prefill = Callable[[str, str], list[int]]


class TierLifecycle:
    """What the engine does for its KV tier outside the step; also the `kv_pin_prefix` pins (tier or not)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.config, self.runner = config, runner
        tier = runner.tier
        # Only a disk tier of a single-rank engine persists: other ranks' tiers would need their own index.
        self.persist = tier is not None and tier.persistent and config.tensor_parallel_size == 1
        if tier is not None and tier.persistent and not self.persist:
            logger.warning("kv_offload_dir: with tensor parallelism the disk KV tier starts empty and is not "
                           "saved at shutdown")
        # True once the index was read: from then on shutdown writes one back (also after a failed start).
        self.restored = False
        self.promote_cost: tuple[float, float] | None = None  # (copy s/block, prefill s/token) as the core has it
        self.prefill_s_per_token: float | None = None  # None until a real prefill-heavy step was timed
        self._scheduler: _core.Scheduler | None = None

    @property
    def tier(self) -> KVTier | None:
        return self.runner.tier

    @property
    def scheduler(self) -> _core.Scheduler:
        assert self._scheduler is not None, "attach a scheduler first"
        return self._scheduler

    def attach(self, scheduler: _core.Scheduler) -> None:
        """The engine's new scheduler (start or reset); it gets the cost figures the old one had."""
        self._scheduler = scheduler
        if self.promote_cost is not None:
            scheduler.set_promote_cost(*self.promote_cost)

    def start(self) -> None:
        """Before serving: restore a persistent tier's index, then measure what a promotion costs."""
        if self.persist:
            self._restore()
        if self.tier is not None:
            self._measure_costs()

    def _restore(self) -> None:
        """Rebuild the prefix cache's tier nodes from the disk tier's index (validated by the tier: a foreign or
        corrupt file yields nothing, with a warning)."""
        assert self.tier is not None
        t0 = time.perf_counter()
        entries = self.tier.load_index()
        restored = self.scheduler.tier_restore(entries) if entries else 0
        self.restored = True
        self.runner.startup_timings["kv_tier_restore"] = time.perf_counter() - t0
        logger.info("KV tier: restored %d of %d indexed blocks from %s", restored, len(entries),
                    self.config.kv_offload_dir)

    def _measure_costs(self) -> None:
        """The core promotes tier blocks on a hit only when copying them back beats recomputing them: measure
        both sides here (a timed prefill forward; blocks read back from the tier). The startup forward is short,
        so it overstates the per-token cost of a long prefill (2-3x on CPU): the first real prefill-heavy step
        replaces it, later ones refine it (`track_prefill`)."""
        runner, bs = self.runner, self.config.block_size
        tokens = max(1, min(runner.token_budget, 128, runner.num_blocks * bs))
        if not self.config.warmup:
            runner.profile(tokens)  # once untimed: the first forward compiles / allocates
        t0 = time.perf_counter()
        runner.profile(tokens)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        prefill_s = (time.perf_counter() - t0) / tokens
        copy_s = runner.measure_tier_copy()
        self.set_promote_cost(copy_s, prefill_s)
        logger.info("KV tier cost model: copy %.3g ms/block, prefill %.3g ms/token (%.3g ms per %d-token block)",
                    copy_s * 1e3, prefill_s * 1e3, prefill_s * bs * 1e3, bs)

    def set_promote_cost(self, copy_s_per_block: float, prefill_s_per_token: float) -> None:
        self.promote_cost = (copy_s_per_block, prefill_s_per_token)
        self.scheduler.set_promote_cost(copy_s_per_block, prefill_s_per_token)

    def track_prefill(self, plan: _core.SchedulerPlan, forward_s: float) -> None:
        """After a forward: a prefill-heavy step refines the prefill side of the cost model."""
        prefill = plan.num_prefill_tokens
        if self.promote_cost is None or prefill < _COST_MIN_PREFILL or plan.num_decode_tokens * 8 > prefill:
            return
        per_token = forward_s / prefill
        ema = self.prefill_s_per_token
        ema = per_token if ema is None else (1 - _COST_EMA) * ema + _COST_EMA * per_token
        self.prefill_s_per_token = ema
        copy_s, told = self.promote_cost
        if abs(ema - told) > _COST_DRIFT * told:
            self.set_promote_cost(copy_s, ema)
            logger.info("KV tier cost model: prefill now %.3g ms/token (from %d-token steps)", ema * 1e3, prefill)

    def pin_prefixes(self, prefill: Prefill) -> None:
        """Prefill each `kv_pin_prefix` text as a one-token request, then pin its full blocks on the device."""
        for i, text in enumerate(self.config.kv_pin_prefix):
            try:
                ids = prefill(f"pin-{i}", text)
            except ValueError as exc:
                raise InvalidArgumentError(f"kv_pin_prefix: entry {i} cannot be prefilled: {exc}",
                                           "kv_pin_prefix") from exc
            pinned = self.scheduler.pin_prefix(ids)
            logger.info("kv_pin_prefix %d: %d of %d tokens pinned on the device (whole blocks)", i, pinned, len(ids))
            if pinned == 0:
                logger.warning("kv_pin_prefix %d (%d tokens) pinned nothing: shorter than one KV block of %d tokens",
                               i, len(ids), self.config.block_size)

    def save(self) -> None:
        """At shutdown, once no request holds blocks: every cached block and its index go to a restored disk
        tier. The core's flush ends its last step itself (a plan never `update`d is rolled back, the last step's
        promotions become evictable) and returns every copy still queued with its own demotions. The engine
        calls it only when `restored`."""
        tier, kv = self.tier, self.runner.kv_caches
        assert tier is not None and kv is not None
        t0 = time.perf_counter()
        pairs = self.scheduler.tier_flush()
        if len(pairs):
            tier.store(kv, pairs)
        entries = self.scheduler.tier_entries()
        tier.save_index(entries)
        logger.info("KV tier: saved %d blocks (%d demoted at shutdown) to %s in %.2f s", len(entries), len(pairs),
                    self.config.kv_offload_dir, time.perf_counter() - t0)
