//! The scheduler's half of speculative decoding: propose and reserve lookahead blocks when a
//! decode is planned, and after verification keep the accepted run and roll the rest back.
//!
//! Invariant kept: after `update`, a sequence that speculated holds exactly the blocks a
//! sequence that decoded the same tokens one at a time would hold, and the radix cache holds
//! only blocks of verified tokens (proposals are never in `tokens`, so never inserted).

use super::Scheduler;
use crate::error::{CoreError, CoreResult};
use crate::sched::radix::RadixCache;
use crate::sched::sequence::{Slot, Status};
use crate::sched::spec::{ngram_propose, BYPASS_MATCH, TRUSTED_MATCH};

impl Scheduler {
    /// Tokens the step may spend on proposals: the engine's budget for the step, and none
    /// once the decode batch is past `max_batch_tokens`, or with speculation off.
    pub(super) fn spec_allowance(&self) -> usize {
        match &self.spec {
            Some(c) if self.sliding_window.is_none() => c
                .max_batch_tokens
                .saturating_sub(self.running.len())
                .min(self.spec_budget.unwrap_or(usize::MAX)),
            _ => 0,
        }
    }

    /// For a running sequence about to decode one token (its blocks for that token grown):
    /// propose up to `room` tokens into `spec_draft` and grow its blocks for them without
    /// evicting or preempting anything. Returns how many were proposed (0: a plain decode).
    pub(super) fn propose(&mut self, slot: Slot, room: usize) -> usize {
        self.spec_draft.clear();
        let Some(c) = &self.spec else {
            return 0;
        };
        let (min_n, max_n, max_k, external) = (
            c.prompt_lookup_min,
            c.prompt_lookup_max,
            c.num_speculative_tokens,
            c.external,
        );
        let s = &mut self.seqs[slot as usize];
        let len = s.tokens.len();
        let plain = !s.prefilling && !s.is_fork_parent;
        if !s.spec.allowed || !plain || s.computed + 1 != len {
            return 0;
        }
        // Backing off after misses: a draft model sits it out; the n-gram lookup still runs,
        // and only a match of `BYPASS_MATCH` tokens or more proposes.
        let cooling = s.spec.cooldown > 0;
        if cooling {
            s.spec.cooldown -= 1;
            if external {
                return 0;
            }
        }
        // Up to max_len tokens in all: the last sampled one is its own row.
        let k = s
            .spec
            .k
            .min(max_k)
            .min(room)
            .min(s.max_len.saturating_sub(len + 1));
        if k == 0 {
            return 0;
        }
        if external {
            // Placeholders (the last token) until `set_proposals`: valid ids, so a plan whose
            // proposals never came still runs, and verification rejects what it must.
            let last = s.tokens[len - 1];
            self.spec_draft.resize(k, last);
        } else {
            let n = ngram_propose(&s.tokens, min_n, max_n, k, &mut self.spec_draft);
            if cooling && n < BYPASS_MATCH {
                self.spec_draft.clear();
                return 0;
            }
            if n < TRUSTED_MATCH.min(max_n) {
                self.spec_draft.truncate(n);
            }
            if let Some(g) = &s.grammar {
                // Past the first token the grammar rejects, no row could be accepted.
                let ok = g.allowed_prefix(&self.spec_draft);
                self.spec_stats.grammar_cut_tokens += (self.spec_draft.len() - ok) as u64;
                self.spec_draft.truncate(ok);
            }
        }
        let bs = self.cfg.block_size;
        // Only free blocks: a proposal never evicts a cached block or preempts anyone.
        let held = (s.blocks.len() + self.alloc.num_free()) * bs;
        let fit = held.saturating_sub(len);
        self.spec_draft.truncate(fit);
        let k = self.spec_draft.len();
        if k > 0 {
            let ok = self.grow(slot, len + k);
            debug_assert!(ok, "lookahead grow failed after the free-block check");
        }
        k
    }

    /// External proposals (a draft model) for the plan `schedule` just built: one token per
    /// sample row that verifies a proposal (`plan.sample_draft >= 0`), in row order. They
    /// replace the placeholders in the plan's input rows and in `sample_draft`; `update` then
    /// accepts them like n-gram proposals. Only before that plan's `update`.
    pub fn set_proposals(&mut self, tokens: &[i64]) -> CoreResult<()> {
        if self.pending_step == 0 {
            return Err(CoreError::invalid(
                "proposals",
                "no plan is waiting for an update",
            ));
        }
        let p = &mut self.plan;
        let constrained = p.mask_rows.iter().any(|&r| p.sample_draft[r as usize] >= 0);
        if constrained && !self.masks.deferred {
            // Their masks were computed for the placeholders already.
            return Err(CoreError::invalid(
                "proposals",
                "the plan's token masks were taken before its proposals came",
            ));
        }
        let want = p.sample_draft.iter().filter(|&&d| d >= 0).count();
        if tokens.len() != want {
            return Err(CoreError::invalid(
                "proposals",
                format!(
                    "expected {want} tokens (one per proposal row), got {}",
                    tokens.len()
                ),
            ));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t < 0 || t > u32::MAX as i64) {
            return Err(CoreError::invalid(
                "proposals",
                format!("token id {bad} out of range"),
            ));
        }
        let mut next = tokens.iter();
        for (r, d) in p.sample_draft.iter_mut().enumerate() {
            if *d >= 0 {
                let t = *next.next().expect("counted above");
                *d = t;
                // The row after a verifying row is the proposal's own input row.
                p.input_ids[p.logits_indices[r] as usize + 1] = t;
            }
        }
        // Constrained sequences' masks waited for these proposals (`start_masks`). Rows cannot
        // be taken out of the plan any more: the grammar's cut only counts here, and the rows
        // past it are never accepted (their target probability is masked to 0).
        self.unwalk();
        let p = &mut self.plan;
        let mut at = 0;
        for u in &mut p.mask_units {
            let r0 = p.mask_rows[at] as usize;
            at += u.rows();
            for (j, d) in u.draft.iter_mut().enumerate() {
                *d = p.sample_draft[r0 + j] as u32;
            }
            let ok = u.matcher.allowed_prefix(&u.draft);
            self.spec_stats.grammar_cut_tokens += (u.draft.len() - ok) as u64;
        }
        self.launch_masks();
        Ok(())
    }

    /// `update` verified `proposed` tokens of `slot`, `accepted` of which were right (the
    /// sequence's `computed` already counts them). Free the lookahead blocks past what its
    /// verified tokens need, cache blocks the accepted run filled, adapt its proposal length.
    /// `before`: its `computed` when the run was planned.
    pub(super) fn settle(&mut self, slot: Slot, proposed: usize, accepted: usize, before: usize) {
        self.spec_stats.record(proposed, accepted);
        let max_k = self.spec.as_ref().map_or(1, |c| c.num_speculative_tokens);
        let bs = self.cfg.block_size;
        if accepted > 0 && self.seqs[slot as usize].status == Status::Running {
            let t = self.req(slot).queue.tenant;
            self.queue.charge(t, 0, accepted);
        }
        let s = &mut self.seqs[slot as usize];
        if s.status != Status::Running {
            return; // finished inside the run: its blocks are gone already
        }
        s.spec.record(proposed, accepted, max_k);
        let keep = s.computed.div_ceil(bs).max(s.window_freed);
        if s.blocks.len() > keep {
            self.alloc.free_all(&s.blocks[keep..]);
            s.blocks.truncate(keep);
        }
        let full = s.computed / bs;
        let caching = self.cfg.enable_prefix_caching && s.window_freed == 0;
        if !caching || full <= before / bs {
            return;
        }
        let r = self.reqs[s.req as usize].as_ref().expect("live request");
        let (ns, prio) = (r.namespace.as_deref(), r.queue.priority);
        let node = self.radix.extend(
            &mut self.alloc,
            s.node,
            &s.tokens[..full * bs],
            &s.blocks[..full],
            ns,
            prio,
            None,
        );
        if node != s.node {
            if node != RadixCache::ROOT {
                self.radix.lock(node);
            }
            if s.node != RadixCache::ROOT {
                self.radix.unlock(s.node);
            }
            s.node = node;
        }
    }
}
