//! The scheduler's side of the KV tier: swap and the promote cost model, pins, and the
//! flush/restore of a persistent tier; plus what the pending plan wrote into cached blocks, so a
//! plan that never runs leaves no block in the cache that was never written.

use super::Scheduler;
use crate::error::{CoreError, CoreResult};

/// The tier state of a scheduler.
#[derive(Debug)]
pub(super) struct TierState {
    /// Swap: a preempted sequence's cached blocks go to the tier (see `SchedulerOptions`).
    pub(super) swap: bool,
    /// Promote tier blocks on a hit (the cost model says copying beats recomputing).
    pub(super) promote: bool,
    /// What the pending plan wrote or copied into cached blocks: dropped from the cache if
    /// the plan never runs.
    pub(super) inflight: Inflight,
    pub(super) swap_out: u64,
    pub(super) swap_in: u64,
}

impl TierState {
    pub(super) fn new(swap: bool) -> Self {
        Self {
            swap,
            promote: true,
            inflight: Inflight::default(),
            swap_out: 0,
            swap_in: 0,
        }
    }
}

/// Cached blocks whose KV data only the pending plan's forward (or copies) will write.
#[derive(Debug, Default)]
pub(super) struct Inflight {
    /// Device blocks registered in the cache this step, or promoted into.
    pub(super) blocks: Vec<u32>,
    /// Tier slots demoted into.
    pub(super) slots: Vec<u32>,
}

impl Scheduler {
    /// The cost model: promote tier blocks on a hit only if copying one back costs less than
    /// recomputing its `block_size` tokens.
    pub fn set_promote_cost(
        &mut self,
        copy_s_per_block: f64,
        prefill_s_per_token: f64,
    ) -> CoreResult<()> {
        for (name, v) in [
            ("copy_s_per_block", copy_s_per_block),
            ("prefill_s_per_token", prefill_s_per_token),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(CoreError::invalid(name, format!("must be >= 0, got {v}")));
            }
        }
        self.tier.promote = copy_s_per_block < prefill_s_per_token * self.cfg.block_size as f64;
        Ok(())
    }

    pub fn promotes(&self) -> bool {
        self.tier.promote
    }

    /// Lock the device-cached full blocks of `tokens` for good; returns the tokens pinned.
    pub fn pin_prefix(&mut self, tokens: &[u32], ns: Option<&str>) -> usize {
        if !self.cfg.enable_prefix_caching {
            return 0;
        }
        self.radix.pin(tokens, ns)
    }

    /// Demote every unpinned, unused device-cached block the tier can take (shutdown of a
    /// persistent tier); returns the copies still to run, (device block, tier slot) pairs.
    /// Ends the step first: a plan never `update`d is rolled back (what it would have written
    /// is uncached), and blocks promoted by the last plan, whose copies have run, may go.
    pub fn tier_flush(&mut self) -> Vec<i64> {
        self.rollback_pending();
        if !self.radix.has_copies() {
            self.radix.begin_step();
        }
        let c = self.radix.flush(&mut self.alloc);
        debug_assert!(c.promote.is_empty(), "promotions are never deferred");
        c.demote
    }

    /// See `RadixCache::tier_entries`.
    pub fn tier_entries(&self) -> Vec<(u32, i64, Option<String>, Vec<u32>)> {
        self.radix.tier_entries()
    }

    /// See `RadixCache::restore`. Only into an idle scheduler with an empty cache.
    pub fn tier_restore(
        &mut self,
        entries: &[(u32, i64, Option<String>, Vec<u32>)],
    ) -> CoreResult<usize> {
        if self.has_unfinished() || self.radix.num_nodes() > 1 {
            return Err(CoreError::invalid(
                "entries",
                "tier_restore needs an idle scheduler with an empty prefix cache",
            ));
        }
        Ok(self.radix.restore(entries))
    }
}
