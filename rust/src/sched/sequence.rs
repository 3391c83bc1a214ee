//! Requests and sequences as the scheduler keeps them.
//!
//! A request owns `n` sequences (generation streams). Each sequence has a stable integer handle,
//! its *slot*, dense and reused after the sequence is finished. Before its first token a request
//! with `n > 1` is one sequence (the fork parent) plus `n - 1` children waiting for the fork.

use std::sync::Arc;

use crate::grammar::{CompiledGrammar, SeqMatcher};
use crate::sched::block::BlockId;
use crate::sched::ord::OrdF64;
use crate::sched::queue::QueueParams;
use crate::sched::radix::{NodeId, RadixCache};
use crate::sched::spec::SpecState;

pub type Slot = u32;
pub type ReqIdx = u32;

/// Why a sequence finished: decided by the core alone (`update` and `schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Sampled a stop token: `Some(id)` for one of the request's `stop_token_ids`, `None` for
    /// EOS (vLLM reports EOS with no `stop_reason`).
    Stop(Option<u32>),
    /// max_tokens or max_model_len reached.
    Length,
    /// Still waiting when its timeout passed.
    Timeout,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::Timeout => "timeout",
        }
    }

    /// The `stop_token_ids` entry that stopped the sequence, if one did.
    pub fn stop_token(&self) -> Option<u32> {
        match self {
            FinishReason::Stop(t) => *t,
            _ => None,
        }
    }
}

/// A sequence the core finished: (request id, slot, reason).
pub type Finished = (Arc<str>, Slot, FinishReason);

/// The token ids that stop a request's sequences; its `n` sequences share one.
#[derive(Debug, Default)]
pub(crate) struct StopTokens {
    /// stop_token_ids plus, unless ignore_eos, the EOS ids: sorted, distinct.
    ids: Box<[u32]>,
    /// The EOS ids among `ids`.
    eos: Box<[u32]>,
}

impl StopTokens {
    /// The one place `ignore_eos` is applied.
    pub fn new(params: &RequestParams) -> Self {
        let sorted = |v: &[u32]| {
            let mut v = v.to_vec();
            v.sort_unstable();
            v.dedup();
            v.into_boxed_slice()
        };
        let eos = if params.ignore_eos {
            Box::default()
        } else {
            sorted(&params.eos_token_ids)
        };
        let mut ids = params.stop_token_ids.clone();
        ids.extend_from_slice(&eos);
        Self {
            ids: sorted(&ids),
            eos,
        }
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The finish reason if `token` stops the sequence.
    pub fn check(&self, token: u32) -> Option<FinishReason> {
        self.ids.binary_search(&token).ok()?;
        let is_eos = self.eos.binary_search(&token).is_ok();
        Some(FinishReason::Stop((!is_eos).then_some(token)))
    }
}

/// Per-request parameters given to `add_request`.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestParams {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub n: usize,
    pub priority: i64,
    pub eos_token_ids: Vec<u32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Time-to-first-token deadline, seconds after arrival (policy `deadline`).
    pub deadline: Option<f64>,
    /// Seconds after arrival after which a still-waiting request finishes with reason
    /// `timeout`; a running request is never timed out by the core.
    pub queue_timeout: Option<f64>,
    pub namespace: Option<String>,
    /// Defaults to the core's clock at `add_request`.
    pub arrival_time: Option<f64>,
    /// Constrain every sequence's output to this grammar (structured outputs).
    pub grammar: Option<CompiledGrammar>,
    /// Who it is served for (policy `fair`); None is the tenant "".
    pub tenant: Option<String>,
    /// Its sequences may speculate when the scheduler has speculation on (off where the
    /// sampler could not verify proposals exactly, e.g. penalties).
    pub speculate: bool,
}

impl Default for RequestParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            min_tokens: 0,
            n: 1,
            priority: 0,
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            deadline: None,
            queue_timeout: None,
            namespace: None,
            arrival_time: None,
            grammar: None,
            tenant: None,
            speculate: true,
        }
    }
}

impl RequestParams {
    pub fn new(max_tokens: usize) -> Self {
        Self {
            max_tokens,
            ..Default::default()
        }
    }
}

#[derive(Debug)]
pub(crate) struct Request {
    pub id: Arc<str>,
    pub queue: QueueParams,
    pub namespace: Option<Box<str>>,
    /// Every slot of the request, live or not, in index order.
    pub slots: Box<[Slot]>,
    /// Sequences not finished yet; the request is dropped at 0.
    pub live: u32,
    /// Slot of the sequence that prefills for all, while `pending` is not empty.
    pub fork_parent: Slot,
    /// Children waiting for the fork parent's first token.
    pub pending: Vec<Slot>,
    /// Reported in `new_request_ids` already.
    pub admitted: bool,
    /// Its prompt was counted in the prefix-cache query/hit counters already.
    pub counted: bool,
    /// Last step that reported it in `preempted_request_ids` (one entry per step).
    pub preempted_step: u64,
    /// Prompt tokens its tenant was charged for: a recompute after preemption is not served
    /// twice as far as fairness goes.
    pub charged_prompt: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Never used.
    Free,
    /// In the waiting queue, holding no blocks.
    Waiting,
    /// In the running set.
    Running,
    /// A child of an `n > 1` request waiting for the fork; holds no blocks.
    ForkPending,
    /// Done; the slot is free again but keeps its tokens until reused.
    Finished,
}

/// Orders sequences for preemption: the largest key is the victim.
pub(crate) type VictimKey = (i64, OrdF64, u64, u32);

#[derive(Debug)]
pub(crate) struct Sequence {
    /// Bumped when the slot is reused, so a stale plan row is recognised.
    pub gen: u32,
    pub status: Status,
    pub req: ReqIdx,
    /// Prompt + generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose KV is (or, once the pending plan runs, will be) in `blocks`.
    pub computed: usize,
    /// `computed` before the step of `sched_step` (what is certainly written).
    pub computed_before: usize,
    pub sched_step: u64,
    pub blocks: Vec<BlockId>,
    /// Radix node this sequence holds a lock on (ROOT: none).
    pub node: NodeId,
    /// Computing tokens it already knows (prompt or recompute); set at admission.
    pub prefilling: bool,
    /// Its prefill completes in the pending plan: cache its blocks at `update`.
    pub insert_pending: bool,
    /// It prefills for siblings still waiting for the fork (its request's `pending`).
    pub is_fork_parent: bool,
    /// Its partly filled last block may be shared (after a fork, until it next appends).
    pub tail_shared: bool,
    /// Leading entries of `blocks` released by the sliding window (no longer held; read 0).
    pub window_freed: usize,
    pub stop: Arc<StopTokens>,
    /// Length (prompt + min_tokens) it must reach before its next token may be a stop token.
    pub min_len: usize,
    /// Length at which it finishes with `length` (max_tokens or max_model_len).
    pub max_len: usize,
    pub victim_key: VictimKey,
    /// Its grammar state, if its request is constrained; advanced by `update`.
    pub grammar: Option<SeqMatcher>,
    /// Speculation: may it propose, how many tokens next.
    pub spec: SpecState,
}

impl Sequence {
    pub fn new() -> Self {
        Self {
            gen: 0,
            status: Status::Free,
            req: 0,
            tokens: Vec::new(),
            prompt_len: 0,
            computed: 0,
            computed_before: 0,
            sched_step: 0,
            blocks: Vec::new(),
            node: RadixCache::ROOT,
            prefilling: false,
            insert_pending: false,
            is_fork_parent: false,
            tail_shared: false,
            window_freed: 0,
            stop: Arc::default(),
            min_len: 0,
            max_len: 0,
            victim_key: (0, OrdF64(0.0), 0, 0),
            grammar: None,
            spec: SpecState::default(),
        }
    }

    /// Whether the token sampled next may stop it. The min_tokens rule lives here alone: the
    /// plan tells the sampler to mask the stop tokens where this is false (`sample_ban_stop`),
    /// and `update` does not stop on them there either.
    pub fn may_stop(&self) -> bool {
        self.tokens.len() >= self.min_len
    }

    /// Whether the sampler must mask its stop tokens for the next token. Never under a
    /// grammar: the grammar decides when the output ends, and banning EOS where the grammar
    /// allows nothing else would leave no token to sample.
    pub fn ban_stop(&self) -> bool {
        !self.may_stop() && self.grammar.is_none()
    }

    /// The stop rules for `token`, just appended; `may_stop` is `may_stop()` from before.
    pub fn check_stop(&self, token: u32, may_stop: bool) -> Option<FinishReason> {
        if may_stop {
            if let Some(reason) = self.stop.check(token) {
                return Some(reason);
            }
        }
        (self.tokens.len() >= self.max_len).then_some(FinishReason::Length)
    }

    /// Tokens generated so far.
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn is_live(&self) -> bool {
        matches!(
            self.status,
            Status::Waiting | Status::Running | Status::ForkPending
        )
    }
}
