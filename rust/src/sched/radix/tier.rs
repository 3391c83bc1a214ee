//! The lower tier (host memory or a disk file): demoting evicted blocks to tier slots, promoting
//! them back on a hit, swap-out of a preempted path, pins, and flush/restore across restarts.
//! The copies themselves are the caller's: they are queued in `copies`.

use std::collections::HashMap;

use super::tree::edge_key;
use super::{Copies, Node, NodeId, RadixCache, TierSlot, NONE};
use crate::sched::block::{BlockAllocator, BlockId};

impl RadixCache {
    /// A new step: copies queued so far have been handed out, so slots they touched may be
    /// reused.
    pub fn begin_step(&mut self) {
        self.step += 1;
        let q = std::mem::take(&mut self.tier.quarantine);
        self.tier.free.extend(q);
    }

    /// Take the queued copies (see `Copies`).
    pub fn take_copies(&mut self) -> Copies {
        std::mem::take(&mut self.copies)
    }

    pub fn has_copies(&self) -> bool {
        !self.copies.is_empty()
    }

    /// Copy the tier blocks on the path root..`node` (locked by the caller) back to fresh
    /// device blocks; the caller made sure `alloc` has that many free. Returns the path's
    /// blocks, all on the device now (cached, ref 0 unless already held).
    pub fn promote(&mut self, alloc: &mut BlockAllocator, node: NodeId) -> Vec<BlockId> {
        let path = self.path_ids(node);
        let mut out = Vec::new();
        for id in path {
            let n = &self.nodes[id as usize];
            let (dev, len) = (n.dev, n.blocks.len());
            for j in dev..len {
                let b = alloc
                    .allocate()
                    .expect("promote: caller reserves free blocks");
                alloc.set_cached(b, true);
                alloc.decref(b);
                let slot = std::mem::replace(&mut self.nodes[id as usize].blocks[j], b);
                self.copies.promote.extend([slot as i64, b as i64]);
                self.tier.busy[slot as usize] = self.step;
                self.free_slot(slot);
                self.set_owner(b, id);
            }
            if dev < len {
                self.stats.promotions += (len - dev) as u64;
                self.nodes[id as usize].promoted_at = self.step;
                self.host_to_device(id, len - dev);
            }
            out.extend_from_slice(&self.nodes[id as usize].blocks);
        }
        out
    }

    /// Swap out the path ending at `node`: demote its blocks, deepest first, up to the first
    /// node another sequence still uses. Returns the blocks demoted.
    pub fn demote_path(&mut self, alloc: &mut BlockAllocator, node: NodeId) -> usize {
        let mut moved = 0;
        let mut id = node;
        while id != Self::ROOT {
            let n = &self.nodes[id as usize];
            if n.lock_ref > 0 || n.dev_children > 0 || n.promoted_at == self.step {
                break;
            }
            let parent = n.parent;
            while self.nodes[id as usize].dev > 0 {
                let n = &self.nodes[id as usize];
                if alloc.ref_count(n.blocks[n.dev - 1]) > 0 || !self.demote_tail(alloc, id) {
                    return moved;
                }
                moved += 1;
            }
            id = parent;
        }
        moved
    }

    /// Demote every unpinned, unused device block the tier can take (for a restart: the tier
    /// then holds whole paths from the root). Pins are released. Returns the copies queued so
    /// far, this flush's included; run them now.
    pub fn flush(&mut self, alloc: &mut BlockAllocator) -> Copies {
        for id in std::mem::take(&mut self.pinned) {
            self.unlock(id);
        }
        self.stats.pinned = 0;
        if self.tier_capacity() > 0 {
            self.evict_inner(alloc, usize::MAX, true);
        }
        self.take_copies()
    }

    /// Lock the device-cached full blocks of `tokens` for good. Returns the tokens pinned.
    pub fn pin(&mut self, tokens: &[u32], ns: Option<&str>) -> usize {
        let Some(ns) = self.ns_id(ns) else { return 0 };
        let full = tokens.len() / self.block_size * self.block_size;
        let (node, blocks, _) = self.walk_from(Self::ROOT, 0, &tokens[..full], ns, true);
        if node == Self::ROOT {
            return 0;
        }
        self.lock(node);
        self.pinned.push(node);
        self.stats.pinned += blocks.len();
        blocks.len() * self.block_size
    }

    /// Every tier block whose whole path from the root is in the tier, parents first:
    /// (slot, parent slot or -1, namespace, the block's tokens). What a restart can restore.
    pub fn tier_entries(&self) -> Vec<(TierSlot, i64, Option<String>, Vec<u32>)> {
        let bs = self.block_size;
        let mut out = Vec::new();
        let mut stack: Vec<(NodeId, i64)> = self.nodes[Self::ROOT as usize]
            .children
            .values()
            .map(|&c| (c, -1))
            .collect();
        while let Some((id, mut parent)) = stack.pop() {
            let n = &self.nodes[id as usize];
            if n.dev > 0 {
                continue;
            }
            let ns = (n.ns > 0).then(|| self.ns_names[n.ns as usize - 1].clone());
            for (j, &slot) in n.blocks.iter().enumerate() {
                out.push((
                    slot,
                    parent,
                    ns.clone(),
                    n.tokens[j * bs..(j + 1) * bs].to_vec(),
                ));
                parent = slot as i64;
            }
            stack.extend(n.children.values().map(|&c| (c, parent)));
        }
        out
    }

    /// Rebuild tier nodes from `tier_entries` output (of an earlier run), into an empty tree.
    /// Entries must come parents first; one whose parent is unknown, whose slot is out of range
    /// or taken, or whose tokens are not one block, is skipped. Returns the number restored.
    pub fn restore(&mut self, entries: &[(TierSlot, i64, Option<String>, Vec<u32>)]) -> usize {
        let bs = self.block_size;
        if self.num_nodes() > 1 || self.tier.used > 0 {
            return 0;
        }
        let cap = self.tier_capacity();
        let mut node_of: HashMap<TierSlot, NodeId> = HashMap::new();
        let mut restored = 0;
        for (slot, parent, ns, tokens) in entries {
            let s = *slot as usize;
            if s >= cap || self.tier.owner[s] != NONE || tokens.len() != bs {
                continue;
            }
            let parent = if *parent < 0 {
                Self::ROOT
            } else {
                match node_of.get(&(*parent as TierSlot)) {
                    Some(&p) => p,
                    None => continue,
                }
            };
            let ns = self.intern(ns.as_deref());
            if parent != Self::ROOT && self.nodes[parent as usize].ns != ns {
                continue;
            }
            let key = edge_key(ns, tokens);
            if self.nodes[parent as usize].children.contains_key(&key) {
                continue;
            }
            let id = self.alloc_node(Node {
                parent,
                key,
                ns,
                tokens: tokens.clone(),
                blocks: vec![*slot],
                live: true,
                ..Node::default()
            });
            self.nodes[parent as usize].children.insert(key, id);
            self.tier.owner[s] = id;
            self.tier.used += 1;
            self.sync_leaf(parent);
            self.sync_leaf(id);
            node_of.insert(*slot, id);
            restored += 1;
        }
        let owner = &self.tier.owner;
        self.tier.free = (0..cap as TierSlot)
            .rev()
            .filter(|&s| owner[s as usize] == NONE)
            .collect();
        restored
    }

    /// The tier blocks on the path root..`node` are also in `blocks` (the caller's device
    /// blocks, which hold the same KV): the caller's replace them.
    pub(super) fn materialize(
        &mut self,
        alloc: &mut BlockAllocator,
        node: NodeId,
        blocks: &[BlockId],
        out: &mut [BlockId],
        mut added: Option<&mut Vec<BlockId>>,
    ) {
        let mut pos = 0;
        for id in self.path_ids(node) {
            let n = &self.nodes[id as usize];
            let (dev, len) = (n.dev, n.blocks.len());
            for j in dev..len {
                let b = blocks[pos + j];
                alloc.set_cached(b, true);
                if let Some(a) = added.as_deref_mut() {
                    a.push(b);
                }
                let slot = std::mem::replace(&mut self.nodes[id as usize].blocks[j], b);
                out[pos + j] = b;
                self.free_slot(slot);
                self.set_owner(b, id);
            }
            if dev < len {
                self.host_to_device(id, len - dev);
            }
            pos += len;
        }
    }

    /// `k` tier blocks of `id` (its whole tier tail) are device blocks now: fix the counters.
    pub(super) fn host_to_device(&mut self, id: NodeId, k: usize) {
        let n = &mut self.nodes[id as usize];
        let was_host_only = n.dev == 0;
        n.dev += k;
        debug_assert_eq!(n.dev, n.blocks.len());
        if n.lock_ref == 0 {
            self.num_evictable += k;
        }
        self.num_cached += k;
        self.tier.used -= k;
        let parent = n.parent;
        if was_host_only && parent != Self::ROOT {
            self.nodes[parent as usize].dev_children += 1;
            self.sync_leaf(parent);
        }
        self.sync_leaf(id);
    }

    /// Move `id`'s last device block to a tier slot (queueing the copy). False (nothing
    /// changed) if the tier has no slot to give.
    pub(super) fn demote_tail(&mut self, alloc: &mut BlockAllocator, id: NodeId) -> bool {
        let Some(slot) = self.take_slot() else {
            return false;
        };
        let n = &mut self.nodes[id as usize];
        n.dev -= 1;
        let j = n.dev;
        let b = std::mem::replace(&mut n.blocks[j], slot);
        let (locked, host_only, parent) = (n.lock_ref > 0, n.dev == 0, n.parent);
        alloc.release_cached(b);
        self.owner[b as usize] = NONE;
        self.tier.owner[slot as usize] = id;
        self.tier.busy[slot as usize] = self.step;
        self.tier.used += 1;
        self.copies.demote.extend([b as i64, slot as i64]);
        self.stats.demotions += 1;
        self.num_cached -= 1;
        if !locked {
            self.num_evictable -= 1;
        }
        if host_only && parent != Self::ROOT {
            self.nodes[parent as usize].dev_children -= 1;
            self.sync_leaf(parent);
        }
        self.sync_leaf(id);
        true
    }

    /// A free tier slot, dropping the coldest tier blocks if the tier is full. None if there is no tier or nothing can be dropped this step.
    pub(super) fn take_slot(&mut self) -> Option<TierSlot> {
        loop {
            if let Some(s) = self.tier.free.pop() {
                return Some(s);
            }
            let &key = self.host_leaves.first()?;
            let id = key.2;
            let bs = self.block_size;
            let n = &mut self.nodes[id as usize];
            let s = *n.blocks.last().expect("host leaf has tier blocks");
            if self.tier.busy[s as usize] == self.step {
                // Copied this step: its slot is not reusable before the next one, so dropping
                // it would gain nothing.
                return None;
            }
            n.blocks.pop();
            n.tokens.truncate(n.blocks.len() * bs);
            let (now_empty, parent) = (n.blocks.is_empty(), n.parent);
            self.tier.used -= 1;
            self.free_slot(s);
            if now_empty {
                self.remove(id);
                self.sync_leaf(parent);
            } else {
                self.sync_leaf(id);
            }
        }
    }

    /// Give a tier slot back: reusable now, or next step if a copy of this step touches it.
    pub(super) fn free_slot(&mut self, s: TierSlot) {
        self.tier.owner[s as usize] = NONE;
        if self.tier.busy[s as usize] == self.step {
            self.tier.quarantine.push(s);
        } else {
            self.tier.free.push(s);
        }
    }
}
