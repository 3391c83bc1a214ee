//! The plan checker the randomized scheduler tests share: a simulated KV cache that every plan
//! writes into the way the model runner would (copy-on-write pairs first, then one entry per
//! query row), and a check that every row then reads exactly its own prefix.
//!
//! An entry holds a hash of (namespace, tokens[0..=pos]), so a block that holds some other
//! sequence's KV, stale KV or nothing is caught at the first position that reads it.

use std::collections::HashSet;

use super::Scheduler;
use crate::sched::plan::Plan;
use crate::sched::sequence::Slot;

/// The next prefix hash after `token`.
pub(super) fn kv_hash(prev: u64, token: u32) -> u64 {
    (prev ^ token as u64)
        .wrapping_mul(0x100_0000_01B3)
        .rotate_left(17)
        .wrapping_add(1)
}

pub(super) struct SimKv {
    kv: Vec<u64>,
    bs: usize,
}

impl SimKv {
    pub(super) fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            kv: vec![u64::MAX; num_blocks * block_size],
            bs: block_size,
        }
    }

    /// Run `plan` (whose block tables are `bt`) as a forward would: its copy-on-write pairs,
    /// then its rows' writes. Checks every row's position, input token and slot, and that no
    /// slot is written twice. `ns` gives a request's namespace seed.
    pub(super) fn write(
        &mut self,
        s: &Scheduler,
        plan: &Plan,
        bt: &[i32],
        ns: &dyn Fn(&str) -> u64,
    ) {
        let (bs, w) = (self.bs, plan.block_table_width);
        for pair in plan.cow_pairs.chunks(2) {
            let (src, dst) = (pair[0] as usize * bs, pair[1] as usize * bs);
            self.kv.copy_within(src..src + bs, dst);
        }
        let mut written = HashSet::new();
        for b in 0..plan.num_seqs() {
            let slot = plan.seq_slots[b] as Slot;
            let tokens = s.token_ids(slot).unwrap();
            let mut h = ns(s.request_id(slot).unwrap());
            let (q0, q1) = (plan.query_start_loc[b], plan.query_start_loc[b + 1]);
            let (ctx, len) = (plan.context_lens[b], plan.seq_lens[b]);
            assert_eq!(len - ctx, q1 - q0);
            for (pos, &t) in tokens[..len as usize].iter().enumerate() {
                h = kv_hash(h, t);
                if pos as i64 >= ctx {
                    let kslot = bt[b * w + pos / bs] as usize * bs + pos % bs;
                    let row = (q0 + pos as i64 - ctx) as usize;
                    assert_eq!(plan.positions[row], pos as i64);
                    assert_eq!(plan.input_ids[row], t as i64);
                    assert_eq!(plan.slot_mapping[row], kslot as i64);
                    assert!(written.insert(kslot), "slot {kslot} written twice");
                    self.kv[kslot] = h;
                }
            }
        }
    }

    /// Every row of `plan` reads a context that holds exactly its own prefix: at every position,
    /// or with a sliding `window` only where the chunk's first query still sees it (earlier
    /// block-table entries must merely be valid block ids).
    pub(super) fn check_reads(
        &self,
        s: &Scheduler,
        plan: &Plan,
        bt: &[i32],
        ns: &dyn Fn(&str) -> u64,
        window: Option<usize>,
    ) {
        let (bs, w) = (self.bs, plan.block_table_width);
        for b in 0..plan.num_seqs() {
            let slot = plan.seq_slots[b] as Slot;
            let tokens = s.token_ids(slot).unwrap();
            let mut h = ns(s.request_id(slot).unwrap());
            let (ctx, len) = (plan.context_lens[b] as usize, plan.seq_lens[b] as usize);
            let first = window.map_or(0, |win| (ctx + 1).saturating_sub(win));
            for (pos, &t) in tokens[..len].iter().enumerate() {
                h = kv_hash(h, t);
                let blk = bt[b * w + pos / bs] as usize;
                if pos >= first {
                    assert_eq!(
                        self.kv[blk * bs + pos % bs],
                        h,
                        "slot {slot} pos {pos}: stale KV"
                    );
                } else {
                    assert!(blk * bs < self.kv.len());
                }
            }
        }
    }
}
