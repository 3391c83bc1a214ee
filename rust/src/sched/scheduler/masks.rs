//! Structured-output token masks: each plan's constrained rows get their masks computed on a
//! worker while the model runs the forward; the caller takes them before sampling.

use super::Scheduler;
use crate::error::{CoreError, CoreResult};
use crate::grammar::{compute, MaskJob, MaskUnit, TokenBitmask};

/// The mask state of a scheduler.
pub(super) struct Masks {
    /// The last plan's token masks, being computed since `schedule` (see `take_bitmask`).
    pub(super) job: Option<MaskJob>,
    pub(super) threads: usize,
    pub(super) stats: MaskStats,
    /// Per `plan.mask_units` entry while a draft model proposes (`draft_masks`): the draft
    /// tokens its matcher has taken, and whether one was refused (its later rows go unmasked:
    /// the target rejects that proposal anyway).
    pub(super) walked: Vec<(usize, bool)>,
    /// The plan's masks wait for a draft model's proposals (`set_proposals` starts them).
    pub(super) deferred: bool,
}

impl Default for Masks {
    fn default() -> Self {
        Self {
            job: None,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            stats: MaskStats::default(),
            walked: Vec::new(),
            deferred: false,
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
        if self.masks.deferred {
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
            self.masks.deferred = true;
            return;
        }
        self.launch_masks();
    }

    pub(super) fn launch_masks(&mut self) {
        self.unwalk();
        self.masks.deferred = false;
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

    /// Masks for a draft model's next proposals, so that it proposes only what the grammar
    /// allows: `rows` are sample rows of the last plan that verify a proposal, the `j`-th of
    /// their sequence's run, and `prev[i]` the draft's proposal before `rows[i]` (-1 for the
    /// first of a run). Each constrained row's matcher takes `prev[i]`, then its mask is
    /// computed: the result's `rows` are indices into `rows`. The matchers are rolled back by
    /// `set_proposals` (or when the plan ends). Computed now, over the mask threads.
    pub fn draft_masks(&mut self, rows: &[i64], prev: &[i64]) -> CoreResult<Option<TokenBitmask>> {
        if rows.len() != prev.len() {
            return Err(CoreError::invalid(
                "prev",
                format!("{} tokens for {} rows", prev.len(), rows.len()),
            ));
        }
        let p = &self.plan;
        if !self.masks.deferred || p.mask_units.is_empty() {
            return Ok(None); // no constrained sequence waits for proposals
        }
        if self.masks.walked.len() != p.mask_units.len() {
            self.masks.walked = vec![(0, false); p.mask_units.len()];
        }
        let (mut out_rows, mut units) = (Vec::new(), Vec::new());
        for (i, (&r, &t)) in rows.iter().zip(prev).enumerate() {
            // The unit whose rows hold r: mask_rows is ascending, each unit's rows contiguous.
            let Ok(at) = p.mask_rows.binary_search(&r) else {
                continue; // an unconstrained row
            };
            let (mut u, mut first) = (0, 0);
            while first + p.mask_units[u].rows() <= at {
                first += p.mask_units[u].rows();
                u += 1;
            }
            let unit = &p.mask_units[u];
            let walk = &mut self.masks.walked[u];
            if t >= 0 && !walk.1 {
                if unit.matcher.try_advance(t as u32) {
                    walk.0 += 1;
                } else {
                    walk.1 = true;
                }
            }
            if !walk.1 {
                out_rows.push(i as i64);
                units.push(MaskUnit::from(unit.matcher.clone()));
            }
        }
        if units.is_empty() {
            return Ok(None);
        }
        let words = units[0].matcher.mask_words();
        Ok(Some(compute(out_rows, units, words, self.masks.threads)))
    }

    /// Roll the matchers back from the draft model's walk (`draft_masks`).
    pub(super) fn unwalk(&mut self) {
        for (u, (n, _)) in self.plan.mask_units.iter().zip(self.masks.walked.drain(..)) {
            u.matcher.rollback(n);
        }
    }

    /// Drop the masks of a plan that is over, after their worker ends (it holds the matchers
    /// and rolls them back to where `update` advances them from).
    pub(super) fn discard_masks(&mut self) {
        if let Some(job) = self.masks.job.take() {
            self.masks.stats.compute_ns += job.join().compute_ns;
        }
        self.unwalk();
        self.masks.deferred = false;
        self.plan.mask_units.clear();
    }
}
