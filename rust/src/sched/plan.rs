//! The step plan: flat arrays for the model runner, built into reusable buffers.
//!
//! Rows of the token batch (length T) are grouped by sequence in batch order (length B).
//! The block table is not materialised here: `Scheduler::fill_block_tables` writes it straight
//! into the caller's (numpy) buffer, `num_seqs × block_table_width`, padded with 0.

use std::sync::Arc;

use crate::grammar::MaskUnit;
use crate::sched::sequence::Finished;

#[derive(Debug, Default, Clone)]
pub struct Plan {
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    /// [B + 1], starts with 0.
    pub query_start_loc: Vec<i64>,
    pub seq_lens: Vec<i64>,
    pub context_lens: Vec<i64>,
    pub seq_slots: Vec<i64>,
    pub logits_indices: Vec<i64>,
    pub sample_slots: Vec<i64>,
    /// Tokens each sample row's sequence has generated so far (the sampler's random-stream
    /// position: independent of batch company, and it survives preemption).
    pub sample_output_lens: Vec<i64>,
    /// Sample rows whose stop tokens must not be sampled yet (min_tokens not reached).
    pub sample_ban_stop: Vec<bool>,
    /// Per sample row: the proposed token the row's sampled token must equal for the next row
    /// of the same sequence to count (speculative decoding), or -1 (the run ends there).
    pub sample_draft: Vec<i64>,
    /// Sample rows of grammar-constrained sequences, ascending: row `i` of the step's token
    /// bitmask (`Scheduler::take_bitmask`) is for sample row `mask_rows[i]`. A speculating
    /// sequence has one per verification row, each under the grammar state after the
    /// proposals before it.
    pub mask_rows: Vec<i64>,
    /// [K * 2], (src, dst) pairs.
    pub cow_pairs: Vec<i64>,
    /// [K * 2], (device block, tier slot) pairs: copy to the tier before anything else.
    pub kv_demote: Vec<i64>,
    /// [K * 2], (tier slot, device block) pairs: copy back after `kv_demote`, before
    /// `cow_pairs` and the forward.
    pub kv_promote: Vec<i64>,
    pub new_request_ids: Vec<Arc<str>>,
    /// Per `new_request_ids` entry: prompt tokens its first admission found in the prefix
    /// cache (full blocks only). Later re-admissions after preemption do not count, as in vLLM.
    pub new_request_cached_tokens: Vec<i64>,
    pub preempted_request_ids: Vec<Arc<str>>,
    /// Sequences of requests that timed out while waiting.
    pub finished: Vec<Finished>,
    pub num_prefill_tokens: usize,
    pub num_decode_tokens: usize,
    pub num_cached_tokens: usize,
    pub max_query_len: usize,
    pub max_seq_len: usize,
    /// Columns of the block table: the most blocks any row needs.
    pub block_table_width: usize,
    /// Generation of each sample row's sequence when planned (stale rows are skipped).
    pub(crate) sample_gens: Vec<u32>,
    /// Generation of each batch row's sequence.
    pub(crate) row_gens: Vec<u32>,
    /// The matchers of the `mask_rows` entries, with the proposals each run of rows verifies.
    pub(crate) mask_units: Vec<MaskUnit>,
}

impl Plan {
    pub(crate) fn clear(&mut self) {
        self.input_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.query_start_loc.clear();
        self.query_start_loc.push(0);
        self.seq_lens.clear();
        self.context_lens.clear();
        self.seq_slots.clear();
        self.logits_indices.clear();
        self.sample_slots.clear();
        self.sample_output_lens.clear();
        self.sample_ban_stop.clear();
        self.sample_draft.clear();
        self.mask_rows.clear();
        self.mask_units.clear();
        self.cow_pairs.clear();
        self.kv_demote.clear();
        self.kv_promote.clear();
        self.new_request_ids.clear();
        self.new_request_cached_tokens.clear();
        self.preempted_request_ids.clear();
        self.finished.clear();
        self.num_prefill_tokens = 0;
        self.num_decode_tokens = 0;
        self.num_cached_tokens = 0;
        self.max_query_len = 0;
        self.max_seq_len = 0;
        self.block_table_width = 0;
        self.sample_gens.clear();
        self.row_gens.clear();
    }

    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.seq_slots.len()
    }

    pub fn num_samples(&self) -> usize {
        self.sample_slots.len()
    }

    /// No token to compute (it may still report finished or preempted requests).
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}
