//! Continuous-batching scheduler: owns the request queue, the block allocator and the radix
//! prefix cache, and plans one step at a time (vLLM V1 style: every sequence has a number of
//! computed tokens and a target; each step gives tokens to running sequences first, then to
//! waiting ones in policy order, under `max_num_batched_tokens` and `max_num_seqs`).
//!
//! One step is `schedule()` → run the model on the plan's arrays → `update(sampled)`.
//! The step logic is in `step.rs`; this file holds the state and the request-level API.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{CoreError, CoreResult};
use crate::sched::block::{BlockAllocator, BlockUsage};
use crate::sched::fair::{TenantStats, Vtc};
use crate::sched::ord::OrdF64;
use crate::sched::plan::Plan;
use crate::sched::queue::{monotonic, Policy, QueueParams, RequestQueue};
use crate::sched::radix::{InsertResult, NodeId, RadixCache, TierStats};
pub use crate::sched::sequence::Finished;
use crate::sched::sequence::{ReqIdx, Request, RequestParams, Sequence, Slot, Status, StopTokens};
use crate::sched::spec::{SpecConfig, SpecStats};

#[cfg(test)]
mod admit_tests;
mod config;
#[cfg(test)]
mod fair_tests;
#[cfg(test)]
mod harness;
mod masks;
mod spec;
#[cfg(test)]
mod spec_tests;
mod step;
#[cfg(test)]
mod tests;
mod tier;
mod window;

pub use config::{SchedulerConfig, SchedulerOptions};
pub use masks::MaskStats;
use masks::Masks;
use tier::TierState;

/// Counters readable without a scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerStats {
    pub num_waiting: usize,
    pub num_running: usize,
    /// Sequences preempted (recompute) so far.
    pub num_preemptions: u64,
    /// Requests that timed out while waiting.
    pub num_timeouts: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub blocks: BlockUsage,
    /// Requests dropped by `abort`.
    pub num_aborted: u64,
    /// Sequences finished by a stop rule or `finish`.
    pub num_finished: u64,
    pub num_steps: u64,
    /// Live requests (waiting, running or both).
    pub num_requests: usize,
    pub tier: TierStats,
    /// Over running sequences: token slots of the blocks they hold, and tokens in them (the
    /// difference is internal fragmentation).
    pub kv_slots_allocated: usize,
    pub kv_slots_used: usize,
    /// Blocks released because they fell outside the sliding window.
    pub window_freed_blocks: u64,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    alloc: BlockAllocator,
    radix: RadixCache,
    queue: RequestQueue<Slot>,
    reqs: Vec<Option<Request>>,
    req_free: Vec<ReqIdx>,
    req_ids: HashMap<Arc<str>, ReqIdx>,
    /// Indexed by slot.
    seqs: Vec<Sequence>,
    seq_free: Vec<Slot>,
    /// Running sequences in batch order, sorted by victim key (the tail is the next victim).
    /// May hold stale entries (finished, preempted) until `compact_running`.
    running: Vec<Slot>,
    running_dirty: bool,
    running_unsorted: bool,
    /// Sequences with status Running.
    num_running: usize,
    /// Running sequences plus the not-yet-forked children of running fork parents.
    num_reserved: usize,
    plan: Plan,
    /// Step of the plan whose `update` has not come yet (0: none).
    pending_step: u64,
    step: u64,
    next_add_seq: u64,
    counts: Counters,
    scratch_slots: Vec<Slot>,
    scratch_gens: Vec<u32>,
    masks: Masks,
    pacing: Pacing,
    sliding_window: Option<usize>,
    /// `SchedulerOptions::reserve_decode`.
    reserve_decode: bool,
    tier: TierState,
    /// Speculative decoding (n-gram prompt lookup); None: off.
    spec: Option<SpecConfig>,
    spec_stats: SpecStats,
    /// The engine's per-step proposal budget (its cost model's choice); None: no limit but
    /// `max_batch_tokens`.
    spec_budget: Option<usize>,
    /// The proposal being planned (reused buffer).
    spec_draft: Vec<u32>,
    /// Per sample row of the last `update`: its token was appended (false: a row after a
    /// rejected proposal, or of a sequence gone since the plan).
    emitted: Vec<bool>,
}

/// Event counters (the rest of `SchedulerStats` is read from the parts that own it).
#[derive(Debug, Default)]
struct Counters {
    preemptions: u64,
    timeouts: u64,
    aborted: u64,
    finished: u64,
    window_freed_blocks: u64,
}

/// Admission pacing (`SchedulerOptions::delay_factor`).
#[derive(Debug)]
struct Pacing {
    delay_factor: f64,
    /// `now` of the last `schedule`, and the time between the last two while sequences ran.
    last_schedule: Option<f64>,
    last_step_s: f64,
    /// `now` of the last `schedule` that admitted a waiting request.
    last_admit: f64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> CoreResult<Self> {
        Self::with_options(cfg, SchedulerOptions::default())
    }

    pub fn with_options(cfg: SchedulerConfig, opts: SchedulerOptions) -> CoreResult<Self> {
        cfg.validate()?;
        opts.validate()?;
        if opts.tier_blocks > 0 && !cfg.enable_prefix_caching {
            return Err(CoreError::invalid(
                "tier_blocks",
                "a KV tier needs enable_prefix_caching",
            ));
        }
        Ok(Self {
            alloc: BlockAllocator::new(cfg.num_blocks, cfg.block_size),
            radix: RadixCache::new_tiered(cfg.block_size, opts.tier_blocks),
            queue: RequestQueue::with_vtc(cfg.policy, cfg.max_queue_len, Vtc::new(opts.fair)),
            reqs: Vec::new(),
            req_free: Vec::new(),
            req_ids: HashMap::new(),
            seqs: Vec::new(),
            seq_free: Vec::new(),
            running: Vec::new(),
            running_dirty: false,
            running_unsorted: false,
            num_running: 0,
            num_reserved: 0,
            plan: Plan::default(),
            pending_step: 0,
            step: 0,
            next_add_seq: 0,
            counts: Counters::default(),
            scratch_slots: Vec::new(),
            scratch_gens: Vec::new(),
            masks: Masks::default(),
            pacing: Pacing {
                delay_factor: opts.delay_factor,
                last_schedule: None,
                last_step_s: 0.0,
                last_admit: f64::NEG_INFINITY,
            },
            sliding_window: opts.sliding_window,
            reserve_decode: opts.reserve_decode,
            tier: TierState::new(opts.swap),
            spec: None,
            spec_stats: SpecStats::default(),
            spec_budget: None,
            spec_draft: Vec::new(),
            emitted: Vec::new(),
            cfg,
        })
    }

    /// Turn speculative decoding on (n-gram prompt lookup) or off, for requests added from now.
    pub fn set_speculation(&mut self, cfg: Option<SpecConfig>) -> CoreResult<()> {
        if let Some(c) = &cfg {
            c.validate()?;
        }
        self.spec = cfg;
        Ok(())
    }

    /// Most proposal tokens the next plans may carry, in all (0: those steps decode one token
    /// a sequence); None lifts the limit. Kept until changed.
    pub fn set_spec_budget(&mut self, budget: Option<usize>) {
        self.spec_budget = budget;
    }

    pub fn speculation(&self) -> Option<&SpecConfig> {
        self.spec.as_ref()
    }

    /// Per sample row of the last `update`: whether its token was appended.
    pub fn emitted(&self) -> &[bool] {
        &self.emitted
    }

    pub fn spec_stats(&self) -> &SpecStats {
        &self.spec_stats
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn allocator(&self) -> &BlockAllocator {
        &self.alloc
    }

    pub fn radix(&self) -> &RadixCache {
        &self.radix
    }

    /// The last plan built by `schedule`.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Queue a request. Returns its `n` sequence slots.
    pub fn add_request(
        &mut self,
        request_id: &str,
        prompt: &[u32],
        params: RequestParams,
    ) -> CoreResult<Vec<Slot>> {
        let qp = self.check_request(request_id, prompt, &params)?;
        let idx = match self.req_free.pop() {
            Some(i) => i,
            None => {
                self.reqs.push(None);
                (self.reqs.len() - 1) as ReqIdx
            }
        };
        let slots = self.new_seqs(idx, prompt, &params, qp.arrival);
        let id: Arc<str> = request_id.into();
        let tenant = self.queue.tenant_id(params.tenant.as_deref().unwrap_or(""));
        let qp = QueueParams { tenant, ..qp };
        self.queue.push(slots[0], qp)?;
        self.queue.tenant_join(tenant);
        self.reqs[idx as usize] = Some(Request {
            id: id.clone(),
            queue: qp,
            namespace: params.namespace.map(Into::into),
            slots: slots.clone().into(),
            live: params.n as u32,
            fork_parent: slots[0],
            pending: slots[1..].to_vec(),
            admitted: false,
            counted: false,
            preempted_step: 0,
            charged_prompt: 0,
        });
        self.req_ids.insert(id, idx);
        Ok(slots)
    }

    /// Everything `add_request` refuses, before anything changes: bad values, a duplicate id, a
    /// request that could never fit, a full queue. Returns its queue parameters (tenant 0).
    fn check_request(
        &self,
        request_id: &str,
        prompt: &[u32],
        params: &RequestParams,
    ) -> CoreResult<QueueParams> {
        let c = &self.cfg;
        if prompt.is_empty() {
            return Err(CoreError::invalid("prompt_token_ids", "must not be empty"));
        }
        if params.max_tokens == 0 {
            return Err(CoreError::invalid("max_tokens", "must be >= 1"));
        }
        if params.n == 0 {
            return Err(CoreError::invalid("n", "must be >= 1"));
        }
        if params.min_tokens > params.max_tokens {
            return Err(CoreError::invalid(
                "min_tokens",
                format!(
                    "must be <= max_tokens ({}), got {}",
                    params.max_tokens, params.min_tokens
                ),
            ));
        }
        let arrival = params.arrival_time.unwrap_or_else(monotonic);
        let qp = QueueParams {
            priority: params.priority,
            arrival,
            deadline: params.deadline,
            queue_timeout: params.queue_timeout,
            tenant: 0,
        };
        qp.validate()?;
        if self.req_ids.contains_key(request_id) {
            return Err(CoreError::DuplicateRequest(request_id.to_string()));
        }
        let total = prompt.len().saturating_add(params.max_tokens);
        if total > c.max_model_len {
            return Err(CoreError::RequestTooLarge(format!(
                "prompt ({} tokens) + max_tokens ({}) = {total} exceeds max_model_len ({})",
                prompt.len(),
                params.max_tokens,
                c.max_model_len
            )));
        }
        // The KV of the last generated token is never needed.
        let blocks = self.blocks_to_complete(total - 1);
        if blocks > c.num_blocks {
            return Err(CoreError::RequestTooLarge(format!(
                "prompt ({} tokens) + max_tokens ({}) needs {blocks} KV blocks, the cache has {}",
                prompt.len(),
                params.max_tokens,
                c.num_blocks
            )));
        }
        if params.n > c.max_num_seqs {
            return Err(CoreError::RequestTooLarge(format!(
                "n ({}) exceeds max_num_seqs ({})",
                params.n, c.max_num_seqs
            )));
        }
        if self.queue.is_full() {
            return Err(CoreError::QueueFull {
                max_len: self.queue.max_len().unwrap_or(0),
            });
        }
        Ok(qp)
    }

    /// The `n` sequences of request `idx`: the first waits, the others wait for its fork.
    fn new_seqs(
        &mut self,
        idx: ReqIdx,
        prompt: &[u32],
        params: &RequestParams,
        arrival: f64,
    ) -> Vec<Slot> {
        let c = &self.cfg;
        let add_seq = self.next_add_seq;
        self.next_add_seq += 1;
        let prio_key = if c.policy == Policy::Priority {
            params.priority
        } else {
            0
        };
        let stop = Arc::new(StopTokens::new(params));
        let max_len = (prompt.len() + params.max_tokens).min(c.max_model_len);
        let mut slots = Vec::with_capacity(params.n);
        for k in 0..params.n {
            let slot = match self.seq_free.pop() {
                Some(s) => s,
                None => {
                    self.seqs.push(Sequence::new());
                    (self.seqs.len() - 1) as Slot
                }
            };
            let s = &mut self.seqs[slot as usize];
            s.status = if k == 0 {
                Status::Waiting
            } else {
                Status::ForkPending
            };
            s.req = idx;
            s.tokens.clear();
            s.tokens.extend_from_slice(prompt);
            s.prompt_len = prompt.len();
            s.computed = 0;
            s.computed_before = 0;
            s.sched_step = 0;
            s.blocks.clear();
            s.node = RadixCache::ROOT;
            s.prefilling = false;
            s.insert_pending = false;
            s.is_fork_parent = k == 0 && params.n > 1;
            s.tail_shared = false;
            s.stop = stop.clone();
            s.min_len = prompt.len() + params.min_tokens;
            s.max_len = max_len;
            s.victim_key = (prio_key, OrdF64(arrival), add_seq, k as u32);
            s.grammar = params.grammar.as_ref().map(|g| g.new_matcher());
            let k = self.spec.as_ref().map_or(0, |c| c.num_speculative_tokens);
            s.spec.reset(params.speculate, k);
            slots.push(slot);
        }
        slots
    }

    /// Finish one live sequence now (e.g. a stop string matched); frees its blocks (its
    /// computed full blocks go to the prefix cache). False if the slot is not live.
    pub fn finish(&mut self, slot: Slot) -> bool {
        if !self.is_live(slot) {
            return false;
        }
        self.finish_seq(slot);
        self.counts.finished += 1;
        true
    }

    /// Drop a request (all its sequences) wherever it is. False if unknown.
    pub fn abort(&mut self, request_id: &str) -> bool {
        let Some(&idx) = self.req_ids.get(request_id) else {
            return false;
        };
        self.drop_request(idx);
        self.counts.aborted += 1;
        true
    }

    /// Prompt + generated tokens of a live sequence, or of a finished one whose slot has not
    /// been reused yet.
    pub fn token_ids(&self, slot: Slot) -> Option<&[u32]> {
        let s = self.seqs.get(slot as usize)?;
        (s.status != Status::Free).then_some(&s.tokens[..])
    }

    /// Generated tokens (see `token_ids`).
    pub fn output_token_ids(&self, slot: Slot) -> Option<&[u32]> {
        let s = self.seqs.get(slot as usize)?;
        (s.status != Status::Free).then_some(&s.tokens[s.prompt_len..])
    }

    /// Token ids that stop a live sequence: its stop_token_ids, plus the EOS ids unless
    /// ignore_eos. The sampler masks them while the plan says so (`sample_ban_stop`).
    pub fn stop_token_ids(&self, slot: Slot) -> Option<&[u32]> {
        let s = self.seqs.get(slot as usize).filter(|s| s.is_live())?;
        Some(s.stop.ids())
    }

    pub fn is_live(&self, slot: Slot) -> bool {
        self.seqs.get(slot as usize).is_some_and(Sequence::is_live)
    }

    /// Request id of a live sequence.
    pub fn request_id(&self, slot: Slot) -> Option<&Arc<str>> {
        let s = self.seqs.get(slot as usize).filter(|s| s.is_live())?;
        self.reqs[s.req as usize].as_ref().map(|r| &r.id)
    }

    pub fn contains_request(&self, request_id: &str) -> bool {
        self.req_ids.contains_key(request_id)
    }

    pub fn has_unfinished(&self) -> bool {
        !self.req_ids.is_empty()
    }

    pub fn num_waiting(&self) -> usize {
        self.queue.len()
    }

    pub fn num_running(&self) -> usize {
        self.num_running
    }

    /// Slots handed out so far (the highest slot + 1): size per-slot tables with it.
    pub fn num_slots(&self) -> usize {
        self.seqs.len()
    }

    /// Drop every unlocked cached block (tier included); false if some cached blocks are
    /// still in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.radix.reset(&mut self.alloc)
    }

    /// Served tokens and virtual counter per tenant seen so far (every policy counts; `fair`
    /// orders by the counters).
    pub fn tenant_stats(&self) -> Vec<TenantStats> {
        self.queue.vtc().stats()
    }

    pub fn delay_factor(&self) -> f64 {
        self.pacing.delay_factor
    }

    pub fn options(&self) -> SchedulerOptions {
        SchedulerOptions {
            fair: self.queue.vtc().config().clone(),
            delay_factor: self.pacing.delay_factor,
            tier_blocks: self.radix.tier_capacity(),
            swap: self.tier.swap,
            sliding_window: self.sliding_window,
            reserve_decode: self.reserve_decode,
        }
    }

    pub fn stats(&self) -> SchedulerStats {
        let bs = self.cfg.block_size;
        let (mut allocated, mut used) = (0, 0);
        for &slot in &self.running {
            let s = &self.seqs[slot as usize];
            if s.status == Status::Running {
                let (held, freed) = (s.blocks.len() - s.window_freed, s.window_freed * bs);
                allocated += held * bs;
                used += (s.computed - freed).min(held * bs);
            }
        }
        SchedulerStats {
            num_waiting: self.queue.len(),
            num_running: self.num_running,
            num_preemptions: self.counts.preemptions,
            num_timeouts: self.counts.timeouts,
            prefix_queries: self.radix.queries(),
            prefix_hits: self.radix.hits(),
            blocks: self.alloc.usage(),
            num_aborted: self.counts.aborted,
            num_finished: self.counts.finished,
            num_steps: self.step,
            num_requests: self.req_ids.len(),
            tier: TierStats {
                swap_out: self.tier.swap_out,
                swap_in: self.tier.swap_in,
                ..self.radix.tier_stats()
            },
            kv_slots_allocated: allocated,
            kv_slots_used: used,
            window_freed_blocks: self.counts.window_freed_blocks,
        }
    }

    // ---- sequence lifecycle ---------------------------------------------------------------

    fn req(&self, slot: Slot) -> &Request {
        let idx = self.seqs[slot as usize].req;
        self.reqs[idx as usize]
            .as_ref()
            .expect("live sequence has a request")
    }

    fn req_mut(&mut self, slot: Slot) -> &mut Request {
        let idx = self.seqs[slot as usize].req;
        self.reqs[idx as usize]
            .as_mut()
            .expect("live sequence has a request")
    }

    /// Not-yet-forked children counted with this sequence in `num_reserved`.
    fn pending_of(&self, slot: Slot) -> usize {
        if !self.seqs[slot as usize].is_fork_parent {
            return 0;
        }
        let r = self.req(slot);
        debug_assert_eq!(r.fork_parent, slot);
        r.pending.len()
    }

    /// Finish a live sequence. A fork parent with children still waiting for the fork hands
    /// the role to its first child, which goes (back) to the queue.
    fn finish_seq(&mut self, slot: Slot) {
        let is_parent = self.pending_of(slot) > 0;
        if !is_parent {
            self.release_seq(slot);
            return;
        }
        let running = self.seqs[slot as usize].status == Status::Running;
        let mut children = std::mem::take(&mut self.req_mut(slot).pending);
        if running {
            self.num_reserved -= children.len();
        }
        self.seqs[slot as usize].is_fork_parent = false;
        self.release_seq(slot);
        let heir = children.remove(0);
        let r = self.req_mut(heir);
        r.fork_parent = heir;
        let heir_is_parent = !children.is_empty();
        r.pending = children;
        let (qp, admitted) = (r.queue, r.admitted);
        let h = &mut self.seqs[heir as usize];
        h.status = Status::Waiting;
        h.is_fork_parent = heir_is_parent;
        if admitted {
            self.queue.push_front(heir, qp);
        } else {
            self.queue.reinsert(heir, qp);
        }
    }

    /// Drop every live sequence of a request.
    fn drop_request(&mut self, idx: ReqIdx) {
        let r = self.reqs[idx as usize].as_mut().expect("known request");
        let children = std::mem::take(&mut r.pending);
        let parent = r.fork_parent;
        let slots = r.slots.clone();
        if !children.is_empty() {
            // (`fork_parent` is stale once the request has forked: only read it before.)
            let p = &mut self.seqs[parent as usize];
            p.is_fork_parent = false;
            if p.status == Status::Running {
                self.num_reserved -= children.len();
            }
        }
        for &c in &children {
            self.seqs[c as usize].status = Status::Finished;
            self.retire_slot(c);
        }
        for &slot in slots.iter() {
            let s = &self.seqs[slot as usize];
            if s.is_live() && s.req == idx {
                self.release_seq(slot);
            }
        }
    }

    /// Remove a live sequence from wherever it is and free its slot. Its pending children
    /// (if any) must already have been taken care of, except for the reservation count.
    fn release_seq(&mut self, slot: Slot) {
        match self.seqs[slot as usize].status {
            Status::Waiting => {
                self.queue.remove(&slot);
            }
            Status::Running => {
                self.num_reserved -= 1 + self.pending_of(slot);
                self.release_blocks(slot);
                self.num_running -= 1;
                self.running_dirty = true;
            }
            Status::ForkPending => {
                let r = self.req_mut(slot);
                r.pending.retain(|&c| c != slot);
                let parent = r.fork_parent;
                let none_left = r.pending.is_empty();
                let p = &mut self.seqs[parent as usize];
                if none_left {
                    p.is_fork_parent = false;
                }
                if p.status == Status::Running {
                    self.num_reserved -= 1;
                }
            }
            Status::Free | Status::Finished => return,
        }
        self.seqs[slot as usize].status = Status::Finished;
        self.retire_slot(slot);
    }

    /// The slot's sequence is finished: bump its generation, free the slot, drop the request
    /// with its last sequence.
    fn retire_slot(&mut self, slot: Slot) {
        let s = &mut self.seqs[slot as usize];
        s.gen = s.gen.wrapping_add(1);
        s.insert_pending = false;
        s.grammar = None;
        let idx = s.req;
        self.seq_free.push(slot);
        let r = self.reqs[idx as usize].as_mut().expect("known request");
        r.live -= 1;
        if r.live == 0 {
            let (id, tenant) = (r.id.clone(), r.queue.tenant);
            self.queue.tenant_leave(tenant);
            self.req_ids.remove(&id);
            self.reqs[idx as usize] = None;
            self.req_free.push(idx);
        }
    }

    /// Give back a sequence's blocks: its safely computed full blocks go to the prefix cache
    /// first (so recompute or a later request hits them), then every ref is dropped.
    fn release_blocks(&mut self, slot: Slot) -> NodeId {
        let bs = self.cfg.block_size;
        let s = &self.seqs[slot as usize];
        // Tokens of a plan that has not been `update`d yet may not be in the KV cache.
        let safe = if self.pending_step != 0 && s.sched_step == self.pending_step {
            s.computed_before
        } else {
            s.computed
        };
        let full = (safe / bs).min(s.blocks.len());
        let mut cached = RadixCache::ROOT;
        // Its later blocks' path would need the ones the window released.
        if self.cfg.enable_prefix_caching && full > 0 && s.window_freed == 0 {
            cached = self.cache_seq(slot, full).node;
        }
        let s = &mut self.seqs[slot as usize];
        if s.node != RadixCache::ROOT {
            self.radix.unlock(s.node);
            s.node = RadixCache::ROOT;
        }
        self.alloc.free_all(&s.blocks[s.window_freed..]);
        s.blocks.clear();
        s.window_freed = 0;
        s.computed = 0;
        s.computed_before = 0;
        s.prefilling = false;
        s.insert_pending = false;
        s.tail_shared = false;
        cached
    }

    /// Cache the first `full` blocks of a sequence, under its request's namespace and priority.
    fn cache_seq(&mut self, slot: Slot, full: usize) -> InsertResult {
        let bs = self.cfg.block_size;
        let s = &self.seqs[slot as usize];
        let r = self.reqs[s.req as usize].as_ref();
        let ns = r.and_then(|r| r.namespace.as_deref());
        let prio = r.map_or(0, |r| r.queue.priority);
        let (tokens, blocks) = (&s.tokens[..full * bs], &s.blocks[..full]);
        self.radix
            .insert_with(&mut self.alloc, tokens, blocks, ns, prio, None)
    }

    /// Panic if the bookkeeping disagrees with itself. O(everything); for tests.
    pub fn check_invariants(&self) {
        self.alloc.check_invariants();
        self.radix.check_invariants(&self.alloc);
        let n = self.alloc.num_blocks();
        let mut holders = vec![0u32; n];
        let (mut running, mut waiting, mut reserved) = (0, 0, 0);
        for (slot, s) in self.seqs.iter().enumerate() {
            let slot = slot as Slot;
            match s.status {
                Status::Running => {
                    running += 1;
                    reserved += 1 + self.pending_of(slot);
                    assert!(s.computed <= s.tokens.len());
                    assert!(s.blocks.len() >= s.computed.div_ceil(self.cfg.block_size));
                    assert!(
                        self.running.contains(&slot),
                        "running seq {slot} not in running"
                    );
                }
                Status::Waiting => {
                    waiting += 1;
                    assert!(s.blocks.is_empty(), "waiting seq {slot} holds blocks");
                    assert!(self.queue.contains(&slot));
                }
                Status::ForkPending => {
                    assert!(s.blocks.is_empty());
                    assert!(self.req(slot).pending.contains(&slot));
                }
                Status::Free | Status::Finished => {
                    assert!(s.blocks.is_empty(), "finished seq {slot} holds blocks");
                    assert!(self.seq_free.contains(&slot));
                }
            }
            if s.is_live() {
                assert!(s.tokens.len() < self.cfg.max_model_len);
                let r = self.req(slot);
                assert!(r.slots.contains(&slot));
                let parent = r.fork_parent == slot && !r.pending.is_empty();
                assert_eq!(s.is_fork_parent, parent, "seq {slot}: fork parent flag");
                if !s.tail_shared && s.computed % self.cfg.block_size != 0 {
                    let b = s.blocks[s.computed / self.cfg.block_size];
                    assert!(self.alloc.ref_count(b) <= 1 && !self.alloc.is_cached(b));
                }
            }
            self.check_window(slot);
            for &b in &s.blocks[s.window_freed..] {
                holders[b as usize] += 1;
            }
        }
        for (b, &h) in holders.iter().enumerate() {
            assert_eq!(
                self.alloc.ref_count(b as u32),
                h,
                "block {b}: refs vs holders"
            );
        }
        assert_eq!(running, self.num_running);
        assert_eq!(reserved, self.num_reserved);
        assert!(
            reserved <= self.cfg.max_num_seqs,
            "reserved {reserved} seqs"
        );
        assert_eq!(waiting, self.queue.len());
        let mut live_reqs = 0;
        for (i, r) in self.reqs.iter().enumerate() {
            if let Some(r) = r {
                live_reqs += 1;
                assert_eq!(self.req_ids.get(&r.id), Some(&(i as ReqIdx)));
                let live = r
                    .slots
                    .iter()
                    .filter(|&&s| {
                        let s = &self.seqs[s as usize];
                        s.is_live() && s.req == i as ReqIdx
                    })
                    .count();
                assert_eq!(live as u32, r.live);
            }
        }
        assert_eq!(live_reqs, self.req_ids.len());
    }
}
