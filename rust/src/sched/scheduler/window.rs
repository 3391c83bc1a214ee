//! Sliding-window KV release. When every layer attends only inside a window of `W` tokens, a
//! query at position `p` reads keys in `(p - W, p]`, so once a running sequence's next query
//! position is `q`, its blocks whose last position is `<= q - W` are never read again: they go
//! back to the pool while the sequence runs.
//!
//! `s.blocks` stays positional (entry `i` covers tokens `i*bs..(i+1)*bs`); its first
//! `s.window_freed` entries are no longer held and read 0, which the block tables pass on. The
//! kernels never read there (the core's CPU kernel and Triton start at the window) or mask the
//! scores with -inf (the torch path gathers whole tables): the pool starts zeroed and only ever
//! holds finite KV, so a masked read of block 0 adds exactly nothing.
//!
//! The prefix cache: a released block the tree holds stays cached. A sequence that released
//! blocks caches nothing more (its path would need them), and lets go of its lock on the tree
//! (which pins the whole path from the root, released blocks included).

use super::Scheduler;
use crate::sched::radix::RadixCache;
use crate::sched::sequence::{Slot, Status};

#[cfg(test)]
#[path = "window_tests.rs"]
mod tests;

impl Scheduler {
    /// The most blocks one sequence holds at once under the window: the first query of a chunk
    /// sees up to `W - 1` earlier positions, the chunk adds up to `max_num_batched_tokens`, and
    /// block boundaries cost one more. None without a window.
    pub(crate) fn window_block_cap(&self) -> Option<usize> {
        let w = self.sliding_window?;
        Some((w + self.cfg.max_num_batched_tokens).div_ceil(self.cfg.block_size) + 1)
    }

    /// Blocks the pool must have for a sequence of `tokens` tokens with KV to ever complete.
    pub(crate) fn blocks_to_complete(&self, tokens: usize) -> usize {
        let all = tokens.div_ceil(self.cfg.block_size);
        let Some(cap) = self.window_block_cap() else {
            return all;
        };
        // With prefix caching, a path the sequence cached before its first release keeps its
        // released blocks in the pool until the window has passed the whole path (the tree
        // evicts leaves first, and the path's tail is still held): such a path is at most `cap`
        // blocks long, so holding `cap` more is always enough.
        let cap = if self.cfg.enable_prefix_caching {
            2 * cap
        } else {
            cap
        };
        all.min(cap)
    }

    /// Release the dead leading blocks of every running sequence: call while no plan is
    /// pending, before planning the step, so the blocks count as room for it.
    pub(super) fn release_window_blocks(&mut self) {
        if self.sliding_window.is_none() {
            return;
        }
        for i in 0..self.running.len() {
            let slot = self.running[i];
            self.release_window_blocks_of(slot);
        }
    }

    /// Release the dead leading blocks of the running sequence `slot`, whose next forward's
    /// first query sits at `computed`. Shared blocks (forks, prefix hits) lose one ref; a block
    /// the prefix cache holds stays cached.
    pub(super) fn release_window_blocks_of(&mut self, slot: Slot) {
        let Some(w) = self.sliding_window else {
            return;
        };
        let bs = self.cfg.block_size;
        let s = &mut self.seqs[slot as usize];
        // Block i is dead when (i + 1) * bs - 1 <= computed - w.
        let dead = ((s.computed + 1).saturating_sub(w) / bs).min(s.blocks.len());
        if dead <= s.window_freed {
            return;
        }
        if s.window_freed == 0 && s.node != RadixCache::ROOT {
            // A lock pins the whole path from the root, the released blocks included. The
            // sequence's refs keep what it still holds; unlocked, the path can be evicted once
            // the window has passed it.
            self.radix.unlock(s.node);
            s.node = RadixCache::ROOT;
        }
        for b in &mut s.blocks[s.window_freed..dead] {
            self.alloc.decref(*b);
            *b = 0;
        }
        self.counts.window_freed_blocks += (dead - s.window_freed) as u64;
        s.window_freed = dead;
    }

    /// `check_invariants`' part: released entries exist only under a window, read 0, and are
    /// all dead for the sequence's last planned query; a running sequence holds at most
    /// `window_block_cap` blocks.
    pub(super) fn check_window(&self, slot: Slot) {
        let s = &self.seqs[slot as usize];
        assert!(s.window_freed <= s.blocks.len(), "seq {slot}: window_freed");
        let (Some(w), Some(cap)) = (self.sliding_window, self.window_block_cap()) else {
            assert_eq!(s.window_freed, 0, "seq {slot}: released without a window");
            return;
        };
        assert!(s.blocks[..s.window_freed].iter().all(|&b| b == 0));
        if s.status == Status::Running {
            let held = s.blocks.len() - s.window_freed;
            assert!(held <= cap, "seq {slot} holds {held} blocks, cap {cap}");
            let dead = (s.computed + 1).saturating_sub(w) / self.cfg.block_size;
            assert!(s.window_freed <= dead, "seq {slot}: released a live block");
        }
    }
}
