//! What a scheduler is built from: `SchedulerConfig` (the sizes, every field the caller's) and
//! `SchedulerOptions` (settings whose defaults are neutral), each validated naming the field.

use crate::error::{CoreError, CoreResult};
use crate::sched::fair::FairConfig;
use crate::sched::queue::Policy;

/// Every field is the caller's to choose: the defaults live in the Python `EngineConfig` alone.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub policy: Policy,
    pub enable_prefix_caching: bool,
    pub max_queue_len: Option<usize>,
}

impl SchedulerConfig {
    pub fn validate(&self) -> CoreResult<()> {
        let positive = [
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(CoreError::invalid(name, "must be >= 1"));
            }
        }
        if self.num_blocks >= u32::MAX as usize / 2 {
            return Err(CoreError::invalid("num_blocks", "too large"));
        }
        if self.max_model_len < 2 {
            return Err(CoreError::invalid("max_model_len", "must be >= 2"));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(CoreError::invalid(
                "max_num_batched_tokens",
                format!(
                    "must be >= max_num_seqs ({}) so every running sequence gets a token each step, got {}",
                    self.max_num_seqs, self.max_num_batched_tokens
                ),
            ));
        }
        Ok(())
    }
}

/// Settings beyond `SchedulerConfig` whose defaults are neutral: equal tenant shares, tokens
/// charged as they are, no prefill delay.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SchedulerOptions {
    pub fair: FairConfig,
    /// vLLM's `scheduler_delay_factor`: while sequences run, admit new requests only once this
    /// × the last step's duration has passed since the last admission, so prefills that
    /// arrive close together share a step instead of each slowing a decode step. 0: off.
    pub delay_factor: f64,
    /// Capacity in blocks of the tier under the device pool (host memory or a disk file):
    /// evicted cached blocks are demoted there instead of dropped. 0: no tier.
    pub tier_blocks: usize,
    /// Swap: a preempted sequence's cached blocks go to the tier at once (swap-out) and come
    /// back on resume when copying beats recomputing (swap-in). Needs a tier.
    pub swap: bool,
    /// Every layer attends only inside this window: blocks wholly before it are released.
    pub sliding_window: Option<usize>,
    /// Conservative admission (SGLang-style): a waiting request is admitted only while the
    /// free and evictable blocks cover what every running sequence, and it, still needs to
    /// reach its max length, so running sequences are rarely preempted for blocks. Off: admit
    /// whatever fits now and preempt (recompute) when blocks run out.
    pub reserve_decode: bool,
}

impl SchedulerOptions {
    pub fn validate(&self) -> CoreResult<()> {
        self.fair.validate()?;
        if !(self.delay_factor.is_finite() && self.delay_factor >= 0.0) {
            return Err(CoreError::invalid(
                "scheduler_delay_factor",
                format!("must be >= 0, got {}", self.delay_factor),
            ));
        }
        if self.swap && self.tier_blocks == 0 {
            return Err(CoreError::invalid(
                "swap",
                "needs a tier to swap to (tier_blocks > 0)",
            ));
        }
        if self.tier_blocks >= u32::MAX as usize / 2 {
            return Err(CoreError::invalid("tier_blocks", "too large"));
        }
        if self.sliding_window == Some(0) {
            return Err(CoreError::invalid("sliding_window", "must be >= 1"));
        }
        Ok(())
    }
}
