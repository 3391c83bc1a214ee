//! One step: `schedule` builds the plan, `update` applies the sampled tokens.

use super::{Finished, Scheduler};
use crate::error::{CoreError, CoreResult};
use crate::grammar::MaskUnit;
use crate::sched::ord::OrdF64;
use crate::sched::plan::Plan;
use crate::sched::queue::{monotonic, Policy};
use crate::sched::radix::RadixCache;
use crate::sched::sequence::{FinishReason, Slot, Status};

impl Scheduler {
    /// Plan the next step. Waiting requests past their timeout are finished first (reported
    /// in `plan.finished`). If the previous plan was never `update`d, its sequences are
    /// preempted: their work in that step is assumed lost.
    pub fn schedule(&mut self, now: Option<f64>) -> &Plan {
        let now = now.unwrap_or_else(monotonic);
        // Sequences left running means the engine stepped again at once: the gap is one step.
        // Without them it may have idled, and an idle gap is no step duration.
        if let Some(prev) = self.pacing.last_schedule.filter(|_| self.num_running > 0) {
            self.pacing.last_step_s = (now - prev).max(0.0);
        }
        self.pacing.last_schedule = Some(now);
        self.step += 1;
        self.rollback_pending();
        // Copies queued by a plan that had nothing to run are still waiting to be handed out:
        // the slots they touch stay reserved until they are.
        if !self.radix.has_copies() {
            self.radix.begin_step();
        }
        if self.cfg.policy == Policy::Fair && self.running.len() > 1 {
            // Counters moved since the last step: re-rank who gets tokens first and who is
            // preempted first.
            self.running_unsorted = true;
        }
        self.compact_running();
        self.expire_waiting(now);
        self.release_window_blocks();

        let mut budget = self.cfg.max_num_batched_tokens;
        let mut make_room_for_waiting = false;
        if matches!(self.cfg.policy, Policy::Priority | Policy::Fair) {
            make_room_for_waiting = self.priority_preempt();
        }

        // Running sequences first: a decode token each (plus its proposals), or the next
        // prefill chunk.
        let mut preempted = false;
        let mut spec_left = self.spec_allowance();
        let mut i = 0;
        while i < self.running.len() {
            let slot = self.running[i];
            let s = &self.seqs[slot as usize];
            let (len, computed) = (s.tokens.len(), s.computed);
            // Every running sequence after this one gets at least one token.
            let reserve = self.running.len() - i - 1;
            let num_new = (len - computed).min(budget.saturating_sub(reserve));
            if num_new == 0 {
                i += 1;
                continue;
            }
            let mut scheduled = true;
            loop {
                if self.make_room(slot, computed + num_new) {
                    break;
                }
                // Out of blocks: preempt the lowest-priority / latest running sequence.
                let victim = self.running.pop().expect("slot itself is running");
                self.preempt(victim);
                preempted = true;
                if victim == slot {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break; // it was the tail: nobody after it
            }
            if !self.grow(slot, computed + num_new) {
                // Cannot happen after make_room; never spin on it either.
                debug_assert!(false, "grow failed after make_room");
                self.running.remove(i);
                self.preempt(slot);
                preempted = true;
                continue;
            }
            let mut k = 0;
            if num_new == 1 && spec_left > 0 {
                k = self.propose(slot, budget.saturating_sub(reserve + 1).min(spec_left));
                spec_left -= k;
            }
            let draft = std::mem::take(&mut self.spec_draft);
            self.emit(slot, num_new, &draft[..k]);
            self.spec_draft = draft;
            budget -= num_new + k;
            i += 1;
        }

        // Then waiting requests in policy order, unless this step had to preempt for blocks
        // or the delay factor holds them for a bigger prefill batch.
        let held = self.pacing.delay_factor > 0.0
            && self.num_running > 0
            && now - self.pacing.last_admit < self.pacing.delay_factor * self.pacing.last_step_s;
        let admitted_before = self.num_running;
        if (!preempted || make_room_for_waiting) && !held {
            // Conservative admission: blocks the running sequences will still take.
            let mut promised = if self.reserve_decode {
                self.blocks_to_finish()
            } else {
                0
            };
            while budget > 0 {
                let Some(&slot) = self.queue.peek() else {
                    break;
                };
                let n_reserve = 1 + self.pending_of(slot);
                if self.num_reserved + n_reserve > self.cfg.max_num_seqs {
                    break;
                }
                if !self.try_admit(slot, n_reserve, &mut budget, &mut promised) {
                    break;
                }
            }
        }
        if self.num_running > admitted_before {
            self.pacing.last_admit = now;
        }
        if !self.plan.is_empty() {
            self.pending_step = self.step;
            let c = self.radix.take_copies();
            self.tier
                .inflight
                .slots
                .extend(c.demote.chunks_exact(2).map(|p| p[1] as u32));
            self.plan.kv_demote = c.demote;
            self.plan.kv_promote = c.promote;
        }
        self.start_masks();
        &self.plan
    }

    /// Apply the tokens sampled for the last plan: one per `plan.sample_slots` row. Appends
    /// them, forks `n > 1` requests, caches completed prefills and applies the stop rules
    /// (stop tokens once min_tokens is reached, then max_tokens / max_model_len). Returns the
    /// sequences that finished, with the stop token that matched.
    pub fn update(&mut self, sampled: &[i64]) -> CoreResult<Vec<Finished>> {
        let mut out = Vec::new();
        self.update_into(sampled, &mut out)?;
        Ok(out)
    }

    pub fn update_into(&mut self, sampled: &[i64], out: &mut Vec<Finished>) -> CoreResult<()> {
        self.emitted.clear();
        if self.pending_step == 0 {
            if sampled.is_empty() {
                return Ok(());
            }
            return Err(CoreError::invalid(
                "sampled_token_ids",
                "no plan is waiting for an update",
            ));
        }
        let expected = self.plan.sample_slots.len();
        if sampled.len() != expected {
            return Err(CoreError::invalid(
                "sampled_token_ids",
                format!(
                    "expected {expected} tokens (one per plan.sample_slots row), got {}",
                    sampled.len()
                ),
            ));
        }
        if let Some(bad) = sampled.iter().find(|&&t| t < 0 || t > u32::MAX as i64) {
            return Err(CoreError::invalid(
                "sampled_token_ids",
                format!("token id {bad} out of range"),
            ));
        }
        // The plan ran: its tokens are in the KV cache now.
        self.pending_step = 0;
        self.tier.inflight.blocks.clear();
        self.tier.inflight.slots.clear();
        // Its masks are stale once the matchers advance (the sampler took them, or never will).
        self.discard_masks();
        self.emitted.resize(expected, false);
        let n = sampled.len();
        let mut r = 0;
        while r < n {
            // A sequence's rows: one, or its proposals' rows and the one after them.
            let mut last = r;
            while self.plan.sample_draft[last] >= 0 {
                last += 1;
            }
            let slot = self.plan.sample_slots[r] as Slot;
            let s = &self.seqs[slot as usize];
            let live = s.gen == self.plan.sample_gens[r] && s.status == Status::Running;
            let (before, proposed) = (s.computed, last - r);
            let mut accepted = 0;
            // Finished or aborted since the plan was made: nothing to apply.
            #[allow(clippy::needless_range_loop)] // rows index three parallel arrays
            for row in r..=last {
                if !live {
                    break;
                }
                if row > r {
                    // The proposal this row was computed after is right: its KV is valid.
                    self.seqs[slot as usize].computed += 1;
                }
                let token = sampled[row] as u32;
                self.emitted[row] = true;
                let hit = self.plan.sample_draft[row] == token as i64;
                accepted += hit as usize;
                if self.apply(slot, token, out) || !hit {
                    break;
                }
            }
            if live && proposed > 0 {
                self.settle(slot, proposed, accepted, before);
            }
            r = last + 1;
        }
        Ok(())
    }

    /// Append one sampled token to `slot`: cache a completed prefill, fork, advance the
    /// grammar, apply the stop rules. True if the sequence finished.
    fn apply(&mut self, slot: Slot, token: u32, out: &mut Vec<Finished>) -> bool {
        if self.seqs[slot as usize].insert_pending {
            self.cache_prefill(slot);
        }
        if self.seqs[slot as usize].is_fork_parent {
            self.fork(slot);
        }
        let s = &mut self.seqs[slot as usize];
        let may_stop = s.may_stop();
        s.tokens.push(token);
        let mut stop = s.check_stop(token, may_stop);
        if let Some(g) = &s.grammar {
            // A complete grammar (or a token it rejects) ends the sequence: "stop",
            // unless a stop token already said so.
            if g.advance(token) && !matches!(stop, Some(FinishReason::Stop(_))) {
                stop = Some(FinishReason::Stop(None));
            }
        }
        let Some(reason) = stop else {
            return false;
        };
        let id = self.req(slot).id.clone();
        self.finish_seq(slot);
        self.counts.finished += 1;
        out.push((id, slot, reason));
        true
    }

    /// Write the last plan's block tables, row-major `num_seqs × block_table_width`, padded
    /// with 0, into `out` (which must have exactly that length). Call before `update`.
    pub fn fill_block_tables(&self, out: &mut [i32]) {
        let p = &self.plan;
        let w = p.block_table_width;
        debug_assert_eq!(out.len(), p.num_seqs() * w);
        let bs = self.cfg.block_size;
        for (b, row) in out
            .chunks_exact_mut(w.max(1))
            .take(p.num_seqs())
            .enumerate()
        {
            let s = &self.seqs[p.seq_slots[b] as usize];
            let n = (p.seq_lens[b] as usize).div_ceil(bs).min(s.blocks.len());
            for (dst, &src) in row.iter_mut().zip(&s.blocks[..n]) {
                *dst = src as i32;
            }
            row[n..].fill(0);
        }
    }

    /// The last plan's block tables as a new Vec (see `fill_block_tables`).
    pub fn block_tables(&self) -> Vec<i32> {
        let mut v = vec![0; self.plan.num_seqs() * self.plan.block_table_width];
        self.fill_block_tables(&mut v);
        v
    }

    // ---- schedule helpers -----------------------------------------------------------------

    /// Clear the plan; preempt the sequences of a plan that was never `update`d.
    pub(super) fn rollback_pending(&mut self) {
        let mut slots = std::mem::take(&mut self.scratch_slots);
        let mut gens = std::mem::take(&mut self.scratch_gens);
        slots.clear();
        gens.clear();
        if self.pending_step != 0 {
            slots.extend(self.plan.seq_slots.iter().map(|&s| s as Slot));
            gens.extend_from_slice(&self.plan.row_gens);
        }
        self.discard_masks();
        self.plan.clear();
        for (&slot, &gen) in slots.iter().zip(&gens) {
            let s = &self.seqs[slot as usize];
            if s.gen == gen && s.status == Status::Running {
                self.preempt_with(slot, false);
                self.running_dirty = true;
            }
        }
        // What that plan would have written (forward) or copied (tier) is not there.
        let (blocks, slots_) = (
            std::mem::take(&mut self.tier.inflight.blocks),
            std::mem::take(&mut self.tier.inflight.slots),
        );
        if !blocks.is_empty() || !slots_.is_empty() {
            self.radix.invalidate(&mut self.alloc, &blocks, &slots_);
        }
        self.pending_step = 0;
        self.scratch_slots = slots;
        self.scratch_gens = gens;
    }

    fn compact_running(&mut self) {
        if self.running_dirty {
            let seqs = &self.seqs;
            self.running
                .retain(|&s| seqs[s as usize].status == Status::Running);
            self.running_dirty = false;
        }
        if self.running_unsorted && self.cfg.policy == Policy::Fair {
            // Priority, then the tenant's counter (the tail, the next victim, is the most
            // served tenant's latest sequence), then arrival. O(running · log running).
            let (seqs, reqs, vtc) = (&self.seqs, &self.reqs, self.queue.vtc());
            let key = |s: Slot| {
                let q = &seqs[s as usize];
                let r = reqs[q.req as usize]
                    .as_ref()
                    .expect("running has a request");
                let c = OrdF64(vtc.counter(r.queue.tenant));
                (r.queue.priority, c, q.victim_key)
            };
            self.running.sort_unstable_by_key(|&s| key(s));
            self.running_unsorted = false;
        } else if self.running_unsorted {
            let seqs = &self.seqs;
            self.running
                .sort_unstable_by_key(|&s| seqs[s as usize].victim_key);
            self.running_unsorted = false;
        }
        debug_assert_eq!(self.running.len(), self.num_running);
    }

    fn expire_waiting(&mut self, now: f64) {
        if !self.queue.next_expiry().is_some_and(|t| now > t) {
            return;
        }
        let mut expired = std::mem::take(&mut self.scratch_slots);
        expired.clear();
        self.queue.expire_into(now, &mut expired);
        for &slot in &expired {
            let s = &self.seqs[slot as usize];
            if !s.is_live() {
                continue;
            }
            let idx = s.req;
            let r = self.reqs[idx as usize].as_ref().expect("live request");
            let id = r.id.clone();
            for &sl in r.slots.iter() {
                // A slot of this request that finished may hold another request's sequence.
                let q = &self.seqs[sl as usize];
                if q.is_live() && q.req == idx {
                    self.plan
                        .finished
                        .push((id.clone(), sl, FinishReason::Timeout));
                }
            }
            self.drop_request(idx);
            self.counts.timeouts += 1;
        }
        self.scratch_slots = expired;
    }

    /// Under `priority`: while the best waiting request is more important than the worst
    /// running one and would not fit, preempt the worst running one. True if it preempted.
    fn priority_preempt(&mut self) -> bool {
        let bs = self.cfg.block_size;
        let mut any = false;
        while let (Some(&head), Some(&tail)) = (self.queue.peek(), self.running.last()) {
            if self.req(head).queue.priority >= self.req(tail).queue.priority {
                break;
            }
            let n_reserve = 1 + self.pending_of(head);
            let mut fits = self.num_reserved + n_reserve <= self.cfg.max_num_seqs
                && self.running.len() < self.cfg.max_num_batched_tokens;
            if fits {
                // Blocks for one token of every running sequence plus the head's first chunk.
                let mut need: usize = self
                    .running
                    .iter()
                    .map(|&s| {
                        let c = self.seqs[s as usize].computed;
                        self.blocks_needed(s, c + 1)
                    })
                    .sum();
                let cached = if self.cfg.enable_prefix_caching {
                    let s = &self.seqs[head as usize];
                    let r = self.reqs[s.req as usize].as_ref().expect("live request");
                    let ns = r.namespace.as_deref();
                    self.radix.match_prefix(&s.tokens, ns, false).blocks.len()
                } else {
                    0
                };
                let len = self.seqs[head as usize].tokens.len();
                let room = self
                    .cfg
                    .max_num_batched_tokens
                    .saturating_sub(self.running.len())
                    .max(1);
                let chunk = (len - cached * bs).min(room);
                need += (cached * bs + chunk).div_ceil(bs) - cached;
                let avail = self.alloc.num_free() + self.radix.num_evictable_blocks();
                fits = need <= avail;
            }
            if fits {
                break;
            }
            self.running.pop();
            self.preempt(tail);
            any = true;
        }
        any
    }

    /// Blocks `slot` must allocate to hold tokens [computed, upto): new blocks plus one
    /// copy-on-write if the partly filled block receiving the first new token is shared.
    fn blocks_needed(&self, slot: Slot, upto: usize) -> usize {
        let s = &self.seqs[slot as usize];
        let bs = self.cfg.block_size;
        let mut need = upto.div_ceil(bs).saturating_sub(s.blocks.len());
        // Only a fork shares a partly filled block (the prefix cache holds full ones).
        if s.tail_shared && s.computed < upto {
            if let Some(&b) = s.blocks.get(s.computed / bs) {
                if self.alloc.ref_count(b) > 1 || self.alloc.is_cached(b) {
                    need += 1;
                }
            }
        }
        need
    }

    /// Make sure `slot` can grow to `upto` tokens, evicting cached blocks if needed.
    fn make_room(&mut self, slot: Slot, upto: usize) -> bool {
        let need = self.blocks_needed(slot, upto);
        if need <= self.alloc.num_free() {
            return true;
        }
        if self.cfg.enable_prefix_caching {
            let short = need - self.alloc.num_free();
            self.radix.evict(&mut self.alloc, short);
        }
        need <= self.alloc.num_free()
    }

    /// Allocate (and copy-on-write) the blocks for tokens [computed, upto).
    pub(super) fn grow(&mut self, slot: Slot, upto: usize) -> bool {
        let bs = self.cfg.block_size;
        let s = &mut self.seqs[slot as usize];
        let mut pos = s.computed;
        while pos < upto {
            // Inside a block it owns alone: nothing to do.
            if s.tail_shared || pos / bs >= s.blocks.len() {
                match self.alloc.append_slot(&mut s.blocks, pos) {
                    Ok(Some((src, dst))) => {
                        self.plan.cow_pairs.push(src as i64);
                        self.plan.cow_pairs.push(dst as i64);
                    }
                    Ok(None) => {}
                    Err(_) => return false,
                }
            }
            s.tail_shared = false;
            pos = (pos / bs + 1) * bs;
        }
        true
    }

    /// Add `num_new` tokens of `slot` (from its computed count on) to the plan, then the
    /// proposed tokens `draft` after them (a decode only: `num_new` = 1), each with a row to
    /// verify. `computed` counts only the known tokens: proposals become computed as `update`
    /// accepts them.
    fn emit(&mut self, slot: Slot, num_new: usize, draft: &[u32]) {
        let bs = self.cfg.block_size;
        let step = self.step;
        let caching = self.cfg.enable_prefix_caching;
        let p = &mut self.plan;
        let s = &mut self.seqs[slot as usize];
        let start = s.computed;
        let end = start + num_new;
        let bsi = bs as i64;
        let k = draft.len();
        let tokens = s.tokens[start..end].iter().chain(draft);
        for (pos, &t) in (start..end + k).zip(tokens) {
            p.input_ids.push(t as i64);
            p.positions.push(pos as i64);
            p.slot_mapping
                .push(s.blocks[pos / bs] as i64 * bsi + (pos % bs) as i64);
        }
        let (q, kv_end) = (num_new + k, end + k);
        let q_end = p.query_start_loc.last().copied().unwrap_or(0) + q as i64;
        p.query_start_loc.push(q_end);
        p.seq_lens.push(kv_end as i64);
        p.context_lens.push(start as i64);
        p.seq_slots.push(slot as i64);
        p.row_gens.push(s.gen);
        p.max_query_len = p.max_query_len.max(q);
        p.max_seq_len = p.max_seq_len.max(kv_end);
        p.block_table_width = p.block_table_width.max(kv_end.div_ceil(bs));
        if s.prefilling {
            p.num_prefill_tokens += num_new;
        } else {
            p.num_decode_tokens += q;
        }
        s.computed_before = start;
        s.sched_step = step;
        s.computed = end;
        // After a window release the path would need the released blocks: nothing to cache.
        if caching && end / bs > start / bs && s.window_freed == 0 {
            // Same-step sharing: a block this forward fills is cached now (its KV is written
            // before any attention of the same forward reads it), so requests admitted after
            // this one in the step already hit it.
            let r = self.reqs[s.req as usize].as_ref().expect("live request");
            let (ns, prio) = (r.namespace.as_deref(), r.queue.priority);
            let full = end / bs;
            let node = self.radix.extend(
                &mut self.alloc,
                s.node,
                &s.tokens[..full * bs],
                &s.blocks[..full],
                ns,
                prio,
                Some(&mut self.tier.inflight.blocks),
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
        // Fairness charges prompt tokens once (not their recompute after a preemption) and
        // each sampled token.
        let r = self.reqs[s.req as usize].as_mut().expect("live request");
        let prompt_end = end.min(s.prompt_len);
        let input = prompt_end.saturating_sub(start.max(r.charged_prompt));
        r.charged_prompt = r.charged_prompt.max(prompt_end);
        let samples = if end < s.tokens.len() {
            0
        } else if s.is_fork_parent {
            1 + r.pending.len()
        } else {
            1
        };
        if input + samples > 0 {
            self.queue.charge(r.queue.tenant, input, samples);
        }
        if end < s.tokens.len() {
            return; // a chunk of a prefill, or re-creating known tokens: nothing to sample
        }
        if s.prefilling {
            s.prefilling = false;
            s.insert_pending = caching;
        }
        let row = p.input_ids.len() as i64 - 1 - k as i64;
        let (out_len, ban_stop) = (s.num_generated() as i64, s.ban_stop());
        if let Some(g) = &s.grammar {
            let r0 = p.sample_slots.len() as i64;
            p.mask_rows.extend(r0..=r0 + k as i64);
            p.mask_units.push(MaskUnit {
                matcher: g.clone(),
                draft: draft.to_vec(),
            });
        }
        // Row j verifies the proposal draft[j] (and samples the token after the run).
        for j in 0..=k {
            p.logits_indices.push(row + j as i64);
            p.sample_slots.push(slot as i64);
            p.sample_gens.push(s.gen);
            p.sample_output_lens.push(out_len + j as i64);
            let ban = if j == 0 {
                ban_stop
            } else {
                s.tokens.len() + j < s.min_len && s.grammar.is_none()
            };
            p.sample_ban_stop.push(ban);
            p.sample_draft.push(draft.get(j).map_or(-1, |&d| d as i64));
        }
        // The first token of an n > 1 request: one row per sequence, forked in `update`.
        if s.is_fork_parent {
            let r = self.reqs[s.req as usize].as_ref().expect("live request");
            for &c in &r.pending {
                // Each child has its own matcher, still in the start state like the parent's.
                if let Some(g) = &self.seqs[c as usize].grammar {
                    p.mask_rows.push(p.sample_slots.len() as i64);
                    p.mask_units.push(g.clone().into());
                }
                p.logits_indices.push(row);
                p.sample_slots.push(c as i64);
                p.sample_gens.push(self.seqs[c as usize].gen);
                p.sample_output_lens.push(out_len);
                p.sample_ban_stop.push(ban_stop);
                p.sample_draft.push(-1);
            }
        }
    }

    /// Blocks the running sequences (and their not-yet-forked children) have still to allocate
    /// to reach their max length: what conservative admission keeps free for them.
    fn blocks_to_finish(&self) -> usize {
        let bs = self.cfg.block_size;
        let mut total = 0;
        for &slot in &self.running {
            let s = &self.seqs[slot as usize];
            if s.status == Status::Running {
                let own = s.max_len.div_ceil(bs).saturating_sub(s.blocks.len());
                let forks = self.pending_of(slot) * (s.max_len.div_ceil(bs) - s.prompt_len / bs);
                total += own + forks;
            }
        }
        total
    }

    /// Admit the waiting sequence `slot` (the queue head) with its first chunk, if its blocks
    /// can be found. False (nothing changed) if not. `promised`: blocks conservative admission
    /// keeps for the running sequences (`blocks_to_finish`); grows by what this one will take.
    fn try_admit(
        &mut self,
        slot: Slot,
        n_reserve: usize,
        budget: &mut usize,
        promised: &mut usize,
    ) -> bool {
        #[cfg(test)]
        self.check_fair_head(slot);
        let bs = self.cfg.block_size;
        let idx = self.seqs[slot as usize].req as usize;
        let tiered = self.tier.promote && self.radix.tier_capacity() > 0;
        let (mut blocks, node, host, resumed) = if self.cfg.enable_prefix_caching {
            let r = self.reqs[idx].as_mut().expect("live request");
            let count = !r.counted;
            r.counted = true;
            let (ns, prio, resumed) = (
                r.namespace.as_deref(),
                r.queue.priority,
                r.preempted_step != 0,
            );
            let toks = &self.seqs[slot as usize].tokens;
            let m = self.radix.match_tiered(toks, ns, count, prio, tiered);
            (m.blocks, m.node, m.host, resumed)
        } else {
            (Vec::new(), RadixCache::ROOT, 0, false)
        };
        let cached = blocks.len() * bs;
        let len = self.seqs[slot as usize].tokens.len();
        let num_new = (len - cached).min(*budget);
        // Hold the hit before evicting anything (the tier part is promoted below).
        if node != RadixCache::ROOT {
            self.radix.lock(node);
        }
        let on_device = blocks.len() - host;
        for &b in &blocks[..on_device] {
            self.alloc.incref(b);
        }
        let need = (cached + num_new).div_ceil(bs) - on_device;
        // Conservative: everything this sequence and its forks will take up to their max length,
        // on top of what is promised to the running ones, must be free or evictable now. With
        // nothing running it goes in as it fits, so blocks held for good (pins) cannot starve it.
        let s = &self.seqs[slot as usize];
        let to_finish = s.max_len.div_ceil(bs).saturating_sub(on_device)
            + (n_reserve - 1) * (s.max_len.div_ceil(bs) - s.prompt_len / bs);
        let short_of_reserve = self.reserve_decode
            && self.num_running > 0
            && to_finish + *promised > self.alloc.num_free() + self.radix.num_evictable_blocks();
        if need > self.alloc.num_free() && self.cfg.enable_prefix_caching && !short_of_reserve {
            let short = need - self.alloc.num_free();
            self.radix.evict(&mut self.alloc, short);
        }
        if short_of_reserve || need > self.alloc.num_free() {
            for &b in blocks[..on_device].iter().rev() {
                self.alloc.decref(b);
            }
            if node != RadixCache::ROOT {
                self.radix.unlock(node);
            }
            return false;
        }
        if host > 0 {
            blocks = self.radix.promote(&mut self.alloc, node);
            for &b in &blocks[on_device..] {
                self.alloc.incref(b);
            }
            self.tier
                .inflight
                .blocks
                .extend_from_slice(&blocks[on_device..]);
            if resumed {
                self.tier.swap_in += host as u64;
            }
        }
        self.queue.pop();
        let s = &mut self.seqs[slot as usize];
        s.blocks = blocks;
        s.node = node;
        s.computed = cached;
        s.status = Status::Running;
        s.prefilling = true;
        let key = s.victim_key;
        let ok = self.grow(slot, cached + num_new);
        debug_assert!(ok, "grow failed after the free-block check");
        if let Some(&last) = self.running.last() {
            if self.seqs[last as usize].victim_key > key {
                self.running_unsorted = true;
            }
        }
        self.running.push(slot);
        self.num_running += 1;
        self.num_reserved += n_reserve;
        if self.reserve_decode {
            *promised += to_finish.saturating_sub(need);
        }
        let r = self.reqs[idx].as_mut().expect("live request");
        if !r.admitted {
            r.admitted = true;
            self.plan.new_request_ids.push(r.id.clone());
            self.plan.new_request_cached_tokens.push(cached as i64);
        }
        self.plan.num_cached_tokens += cached;
        self.release_window_blocks_of(slot);
        self.emit(slot, num_new, &[]);
        *budget -= num_new;
        true
    }

    /// Preempt a running sequence (recompute): its computed full blocks go to the prefix
    /// cache, its blocks are freed, and it goes back to the front of the queue keeping its
    /// generated tokens. The caller removes it from `running` (or marks it dirty).
    fn preempt(&mut self, slot: Slot) {
        self.preempt_with(slot, self.tier.swap);
    }

    /// `preempt`; with `swap`, its cached blocks go to the tier at once (swap-out).
    fn preempt_with(&mut self, slot: Slot, swap: bool) {
        self.num_reserved -= 1 + self.pending_of(slot);
        let node = self.release_blocks(slot);
        if swap && node != RadixCache::ROOT {
            self.tier.swap_out += self.radix.demote_path(&mut self.alloc, node) as u64;
        }
        self.seqs[slot as usize].status = Status::Waiting;
        self.num_running -= 1;
        self.counts.preemptions += 1;
        let step = self.step;
        let r = self.req_mut(slot);
        let qp = r.queue;
        if r.preempted_step != step {
            r.preempted_step = step;
            let id = r.id.clone();
            self.plan.preempted_request_ids.push(id);
        }
        self.queue.push_front(slot, qp);
    }

    // ---- update helpers -------------------------------------------------------------------

    /// The prefill of `slot` completed: cache its full blocks, take the canonical copy of any
    /// block another request cached first, and move the lock to the new node.
    fn cache_prefill(&mut self, slot: Slot) {
        let bs = self.cfg.block_size;
        let s = &mut self.seqs[slot as usize];
        s.insert_pending = false;
        let full = (s.computed / bs).min(s.blocks.len());
        if full == 0 || s.window_freed > 0 {
            return;
        }
        let res = self.cache_seq(slot, full);
        let s = &mut self.seqs[slot as usize];
        for (mine, &canon) in s.blocks.iter_mut().zip(&res.blocks) {
            if *mine != canon {
                self.alloc.incref(canon);
                self.alloc.decref(*mine);
                *mine = canon;
            }
        }
        if res.node != RadixCache::ROOT {
            self.radix.lock(res.node);
        }
        if s.node != RadixCache::ROOT {
            self.radix.unlock(s.node);
        }
        s.node = res.node;
    }

    /// The fork parent sampled its first token: its children share all its blocks (the
    /// partly filled last one is copied on write when first appended to).
    fn fork(&mut self, parent: Slot) {
        let children = std::mem::take(&mut self.req_mut(parent).pending);
        let p = &mut self.seqs[parent as usize];
        p.is_fork_parent = false;
        p.tail_shared = true;
        for &c in &children {
            let [p, s] = self
                .seqs
                .get_disjoint_mut([parent as usize, c as usize])
                .expect("distinct slots");
            s.tokens.clear();
            s.tokens.extend_from_slice(&p.tokens);
            s.blocks.clear();
            s.blocks.extend_from_slice(&p.blocks);
            s.computed = p.computed;
            s.computed_before = p.computed;
            s.sched_step = 0;
            s.node = p.node;
            s.prefilling = false;
            s.insert_pending = false;
            s.is_fork_parent = false;
            s.tail_shared = true;
            s.status = Status::Running;
            s.window_freed = p.window_freed;
            self.alloc.fork(&s.blocks[s.window_freed..]);
            if s.node != RadixCache::ROOT {
                self.radix.lock(s.node);
            }
            let key = s.victim_key;
            if let Some(&last) = self.running.last() {
                if self.seqs[last as usize].victim_key > key {
                    self.running_unsorted = true;
                }
            }
            self.running.push(c);
            self.num_running += 1; // already counted in num_reserved
        }
    }
}
