//! Eviction: the two leaf sets (device-evictable, tier-evictable) kept current on every change,
//! and dropping blocks with what lies below them.

use std::cmp::Reverse;

use super::{Node, NodeId, RadixCache, TierSlot, NONE};
use crate::sched::block::{BlockAllocator, BlockId};

/// Eviction key: the larger the priority value (the less important its users), the earlier;
/// then least recently used first.
pub(super) type LeafKey = (Reverse<i64>, u64, NodeId);

impl Node {
    pub(super) fn leaf_key(&self, id: NodeId) -> LeafKey {
        (Reverse(self.prio), self.last_access, id)
    }
}

impl RadixCache {
    /// Free up to `num_blocks` device blocks, taking from the evictable leaves in eviction
    /// order, tail blocks first: demoted to the tier if there is one (and room), else dropped.
    /// A block some sequence still holds (ref > 0) is skipped with its leaf. Returns the number
    /// of device blocks freed.
    pub fn evict(&mut self, alloc: &mut BlockAllocator, num_blocks: usize) -> usize {
        self.evict_inner(alloc, num_blocks, false)
    }

    pub(super) fn evict_inner(
        &mut self,
        alloc: &mut BlockAllocator,
        num_blocks: usize,
        only_demote: bool,
    ) -> usize {
        let mut freed = 0;
        let mut busy = Vec::new();
        while freed < num_blocks {
            let Some(&key) = self.leaves.first() else {
                break;
            };
            let id = key.2;
            self.leaves.remove(&key);
            self.nodes[id as usize].in_leaves = false;
            if self.nodes[id as usize].promoted_at == self.step {
                busy.push(id);
                continue;
            }
            let mut stuck = false;
            while freed < num_blocks && self.nodes[id as usize].dev > 0 {
                let n = &self.nodes[id as usize];
                let b = n.blocks[n.dev - 1];
                if alloc.ref_count(b) > 0 {
                    stuck = true;
                    break;
                }
                if !self.demote_tail(alloc, id) {
                    if only_demote {
                        stuck = true;
                        break;
                    }
                    self.drop_tail(alloc, id);
                }
                freed += 1;
            }
            if stuck {
                busy.push(id);
            } else if self.nodes[id as usize].live {
                self.sync_leaf(id);
            }
        }
        for id in busy {
            if self.nodes[id as usize].live {
                self.sync_leaf(id);
            }
        }
        freed
    }

    /// Drop every unlocked node (whatever its blocks' ref counts: those still held are freed when
    /// their holders let go), tier blocks included. True if the tree is now empty. Walks the
    /// whole arena.
    pub fn reset(&mut self, alloc: &mut BlockAllocator) -> bool {
        for id in 1..self.nodes.len() as NodeId {
            let n = &self.nodes[id as usize];
            if !n.live || n.lock_ref > 0 {
                continue;
            }
            let (parent, key) = (n.parent, n.key);
            self.release_blocks_of(alloc, id);
            self.nodes[parent as usize].children.remove(&key);
            self.remove_slot(id);
        }
        // Survivors are all locked (so they hold no tier blocks and are no evictable leaf).
        self.leaves.clear();
        self.host_leaves.clear();
        for id in 0..self.nodes.len() {
            if self.nodes[id].live {
                let kids: Vec<NodeId> = self.nodes[id].children.values().copied().collect();
                let d = kids
                    .iter()
                    .filter(|&&c| self.nodes[c as usize].dev > 0)
                    .count();
                self.nodes[id].dev_children = d as u32;
            }
        }
        debug_assert_eq!(self.num_evictable, 0);
        let empty = self.nodes[Self::ROOT as usize].children.is_empty();
        if empty {
            self.namespaces.clear();
            self.ns_names.clear();
            self.nodes.truncate(1);
            self.free_nodes.clear();
        }
        empty
    }

    /// Drop from the tree the given device blocks and tier slots wherever they are, with
    /// everything below them (their KV data is not to be trusted: a step that wrote or copied
    /// them never ran). Locked nodes are left alone.
    pub fn invalidate(
        &mut self,
        alloc: &mut BlockAllocator,
        blocks: &[BlockId],
        slots: &[TierSlot],
    ) {
        for &b in blocks {
            let n = self.owner.get(b as usize).copied().unwrap_or(NONE);
            if n == NONE {
                continue;
            }
            let node = &self.nodes[n as usize];
            if let Some(j) = node.blocks[..node.dev].iter().position(|&x| x == b) {
                self.cut(alloc, n, j);
            }
        }
        for &s in slots {
            let n = self.tier.owner.get(s as usize).copied().unwrap_or(NONE);
            if n == NONE {
                continue;
            }
            let node = &self.nodes[n as usize];
            if let Some(j) = node.blocks[node.dev..].iter().position(|&x| x == s) {
                let j = node.dev + j;
                self.cut(alloc, n, j);
            }
        }
    }

    /// Drop `id`'s last device block, with what lies below it (its tier tail and any tier
    /// children: their KV is only valid after this block's).
    pub(super) fn drop_tail(&mut self, alloc: &mut BlockAllocator, id: NodeId) {
        let j = self.nodes[id as usize].dev - 1;
        self.cut(alloc, id, j);
    }

    /// Free every block of `id` (device ones to the allocator, tier ones to the tier) and fix
    /// the counters; the node itself stays.
    pub(super) fn release_blocks_of(&mut self, alloc: &mut BlockAllocator, id: NodeId) {
        let n = &mut self.nodes[id as usize];
        let blocks = std::mem::take(&mut n.blocks);
        let (dev, locked) = (n.dev, n.lock_ref > 0);
        n.dev = 0;
        n.tokens.clear();
        for &b in &blocks[..dev] {
            alloc.release_cached(b);
            self.owner[b as usize] = NONE;
        }
        for &s in &blocks[dev..] {
            self.free_slot(s);
        }
        self.num_cached -= dev;
        if !locked {
            self.num_evictable -= dev;
        }
        self.tier.used -= blocks.len() - dev;
    }

    /// Drop `id`'s blocks from index `j` on and its whole subtree (unless something there is
    /// locked: then nothing is dropped).
    pub(super) fn cut(&mut self, alloc: &mut BlockAllocator, id: NodeId, j: usize) {
        let mut sub = Vec::new();
        let mut stack: Vec<NodeId> = self.nodes[id as usize].children.values().copied().collect();
        while let Some(c) = stack.pop() {
            stack.extend(self.nodes[c as usize].children.values().copied());
            sub.push(c);
        }
        if self.nodes[id as usize].lock_ref > 0
            || sub.iter().any(|&c| self.nodes[c as usize].lock_ref > 0)
        {
            return;
        }
        // Children before parents, so each removal finds its node childless.
        for &c in sub.iter().rev() {
            self.release_blocks_of(alloc, c);
            self.leave_leaves(c);
            let (parent, key) = (self.nodes[c as usize].parent, self.nodes[c as usize].key);
            self.nodes[parent as usize].children.remove(&key);
            self.remove_slot(c);
        }
        let bs = self.block_size;
        let n = &mut self.nodes[id as usize];
        n.dev_children = 0;
        let tail: Vec<BlockId> = n.blocks.drain(j..).collect();
        n.tokens.truncate(j * bs);
        let old_dev = n.dev;
        let new_dev = old_dev.min(j);
        n.dev = new_dev;
        let (locked, parent, now_empty) = (n.lock_ref > 0, n.parent, n.blocks.is_empty());
        let cut_dev = old_dev - new_dev;
        for (k, &b) in tail.iter().enumerate() {
            if j + k < old_dev {
                alloc.release_cached(b);
                self.owner[b as usize] = NONE;
            } else {
                self.free_slot(b);
            }
        }
        self.num_cached -= cut_dev;
        if !locked {
            self.num_evictable -= cut_dev;
        }
        self.tier.used -= tail.len() - cut_dev;
        if old_dev > 0 && new_dev == 0 && parent != Self::ROOT {
            self.nodes[parent as usize].dev_children -= 1;
        }
        if now_empty {
            self.leave_leaves(id);
            self.remove(id);
        } else {
            self.sync_leaf(id);
        }
        self.sync_leaf(parent);
    }

    /// Stamp `node..root` as used now by a request of priority `prio` (re-keying those in a
    /// leaf set).
    pub(super) fn touch(&mut self, node: NodeId, prio: i64) {
        self.clock += 1;
        let now = self.clock;
        let mut id = node;
        while id != Self::ROOT {
            let n = &self.nodes[id as usize];
            // Only a node in a leaf set is keyed by these fields (a locked path has none).
            let keyed = n.in_leaves || n.in_host_leaves;
            if keyed {
                self.leave_leaves(id);
            }
            let n = &mut self.nodes[id as usize];
            n.last_access = now;
            n.prio = n.prio.min(prio);
            if keyed {
                self.sync_leaf(id);
            }
            id = self.nodes[id as usize].parent;
        }
    }

    /// Take `id` out of both leaf sets.
    pub(super) fn leave_leaves(&mut self, id: NodeId) {
        let n = &mut self.nodes[id as usize];
        let key = n.leaf_key(id);
        if n.in_leaves {
            n.in_leaves = false;
            self.leaves.remove(&key);
        }
        if n.in_host_leaves {
            n.in_host_leaves = false;
            self.host_leaves.remove(&key);
        }
    }

    /// Put `id` in the leaf sets it belongs to, and out of the others.
    pub(super) fn sync_leaf(&mut self, id: NodeId) {
        let n = &mut self.nodes[id as usize];
        let key = n.leaf_key(id);
        let free = id != Self::ROOT && n.live && n.lock_ref == 0;
        let leaf = free && n.dev > 0 && n.dev_children == 0;
        let hleaf = free && n.dev < n.blocks.len() && n.children.is_empty();
        if leaf != n.in_leaves {
            n.in_leaves = leaf;
            if leaf {
                self.leaves.insert(key);
            } else {
                self.leaves.remove(&key);
            }
        }
        if hleaf != n.in_host_leaves {
            n.in_host_leaves = hleaf;
            if hleaf {
                self.host_leaves.insert(key);
            } else {
                self.host_leaves.remove(&key);
            }
        }
    }
}
