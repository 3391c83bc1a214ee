//! Structured-output token masks: each plan's constrained rows get their masks computed on a
//! worker while the model runs the forward; the caller takes them before sampling.

use super::Scheduler;
use crate::grammar::{MaskJob, TokenBitmask};

/// The mask state of a scheduler.
pub(super) struct Masks {
    /// The last plan's token masks, being computed since `schedule` (see `take_bitmask`).
    pub(super) job: Option<MaskJob>,
    pub(super) threads: usize,
    pub(super) stats: MaskStats,
}

impl Default for Masks {
    fn default() -> Self {
        Self {
            job: None,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            stats: MaskStats::default(),
        }
    }
}

/// Where the mask computation's time went, summed over steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MaskStats {
    /// Steps with at least one constrained sample row.
    pub steps: u64,
    /// Mask rows computed.
    pub rows: u64,
    /// Wall-clock time the worker spent computing masks.
    pub compute_ns: u64,
    /// Time `take_bitmask` callers waited for them: what did not overlap the forward.
    pub wait_ns: u64,
}

impl Scheduler {
    /// The token masks of the last plan's constrained sample rows (`plan.mask_rows`), waiting
    /// for their computation to end if needed. None if the plan has none or they were taken.
    pub fn take_bitmask(&mut self) -> Option<TokenBitmask> {
        if self.masks.job.is_none() && self.pending_step != 0 {
            // Proposals that never came (`set_proposals`): the placeholders' masks.
            self.launch_masks();
        }
        let job = self.masks.job.take()?;
        let t0 = std::time::Instant::now();
        let m = job.join();
        self.masks.stats.wait_ns += t0.elapsed().as_nanos() as u64;
        self.masks.stats.compute_ns += m.compute_ns;
        Some(m)
    }

    /// Threads the mask computation of one step may use (default: the machine's CPUs).
    pub fn set_mask_threads(&mut self, n: usize) {
        self.masks.threads = n.max(1);
    }

    pub fn mask_threads(&self) -> usize {
        self.masks.threads
    }

    pub fn mask_stats(&self) -> MaskStats {
        self.masks.stats
    }

    /// Start computing the new plan's masks on a worker thread, unless they depend on
    /// proposals still to come from a draft model (then `set_proposals` starts them).
    pub(super) fn start_masks(&mut self) {
        let external = self.spec.as_ref().is_some_and(|c| c.external);
        if external && self.plan.mask_units.iter().any(|u| !u.draft.is_empty()) {
            return;
        }
        self.launch_masks();
    }

    pub(super) fn launch_masks(&mut self) {
        let p = &mut self.plan;
        if p.mask_units.is_empty() {
            return;
        }
        let words = p.mask_units[0].matcher.mask_words();
        let (rows, units) = (p.mask_rows.clone(), std::mem::take(&mut p.mask_units));
        self.masks.stats.steps += 1;
        self.masks.stats.rows += rows.len() as u64;
        self.masks.job = Some(MaskJob::start(rows, units, words, self.masks.threads));
    }

    /// Drop the masks of a plan that is over, after their worker ends (it holds the matchers
    /// and rolls them back to where `update` advances them from).
    pub(super) fn discard_masks(&mut self) {
        if let Some(job) = self.masks.job.take() {
            self.masks.stats.compute_ns += job.join().compute_ns;
        }
        self.plan.mask_units.clear();
    }
}
