//! The whole-tree consistency check the randomized tests run after every operation.

use super::tree::edge_key;
use super::{RadixCache, NONE};
use crate::sched::block::{BlockAllocator, BlockId};

impl RadixCache {
    /// Panic if the tree, its counters, the leaf sets, the tier's slots or the allocator's
    /// cached flags disagree. Walks everything; for tests.
    pub fn check_invariants(&self, alloc: &BlockAllocator) {
        let bs = self.block_size;
        let mut seen = vec![false; alloc.num_blocks()];
        let mut seen_slot = vec![false; self.tier_capacity()];
        let (mut cached, mut evictable, mut live) = (0, 0, 1);
        let (mut leaves, mut host_leaves, mut host, mut pinned) = (0, 0, 0, 0);
        let mut stack = vec![Self::ROOT];
        while let Some(id) = stack.pop() {
            let n = &self.nodes[id as usize];
            assert!(n.live, "dead node {id} reachable");
            let (mut child_locks, mut dev_children) = (0, 0);
            for (&key, &c) in &n.children {
                let ch = &self.nodes[c as usize];
                live += 1;
                assert_eq!(ch.parent, id, "node {c}: parent link");
                assert_eq!(ch.key, key, "node {c}: key");
                assert!(!ch.blocks.is_empty(), "node {c}: empty edge");
                assert_eq!(
                    ch.tokens.len(),
                    ch.blocks.len() * bs,
                    "node {c}: tokens vs blocks"
                );
                assert_eq!(
                    edge_key(ch.ns, &ch.tokens[..bs]),
                    key,
                    "node {c}: stale key"
                );
                if id != Self::ROOT {
                    assert_eq!(ch.ns, n.ns, "node {c}: namespace differs from parent");
                    // Tier residence is closed downwards.
                    assert!(
                        ch.dev == 0 || n.dev == n.blocks.len(),
                        "node {c}: device blocks below tier blocks"
                    );
                }
                child_locks += ch.lock_ref;
                dev_children += (ch.dev > 0) as u32;
                stack.push(c);
            }
            // (The root's count is not kept: it is never a leaf.)
            assert!(
                id == Self::ROOT || n.dev_children == dev_children,
                "node {id}: dev_children"
            );
            // The root is never locked; any other node counts its subtree's locks.
            assert!(
                id == Self::ROOT || n.lock_ref >= child_locks,
                "node {id}: lock below children's"
            );
            if id == Self::ROOT {
                assert!(!n.in_leaves && !n.in_host_leaves);
                continue;
            }
            assert!(n.dev <= n.blocks.len());
            if n.lock_ref > 0 {
                assert_eq!(n.dev, n.blocks.len(), "node {id}: locked with tier blocks");
            }
            for &b in &n.blocks[..n.dev] {
                assert!(!seen[b as usize], "block {b} held twice by the tree");
                seen[b as usize] = true;
                assert!(
                    alloc.is_cached(b),
                    "block {b} in the tree but not marked cached"
                );
                assert!(!alloc.is_free(b), "block {b} in the tree and free");
                assert_eq!(self.owner[b as usize], id, "block {b}: owner");
            }
            for &s in &n.blocks[n.dev..] {
                assert!(!seen_slot[s as usize], "tier slot {s} held twice");
                seen_slot[s as usize] = true;
                assert_eq!(self.tier.owner[s as usize], id, "tier slot {s}: owner");
            }
            host += n.blocks.len() - n.dev;
            cached += n.dev;
            if n.lock_ref == 0 {
                evictable += n.dev;
            }
            let leaf = n.lock_ref == 0 && n.dev > 0 && n.dev_children == 0;
            assert_eq!(n.in_leaves, leaf, "node {id}: leaf flag");
            if leaf {
                assert!(
                    self.leaves.contains(&n.leaf_key(id)),
                    "node {id} not in leaf set"
                );
                leaves += 1;
            }
            let hleaf = n.lock_ref == 0 && n.dev < n.blocks.len() && n.children.is_empty();
            assert_eq!(n.in_host_leaves, hleaf, "node {id}: host leaf flag");
            if hleaf {
                assert!(
                    self.host_leaves.contains(&n.leaf_key(id)),
                    "node {id} not in host leaf set"
                );
                host_leaves += 1;
            }
        }
        for &p in &self.pinned {
            assert!(self.nodes[p as usize].live && self.nodes[p as usize].lock_ref > 0);
            pinned += self
                .path_ids(p)
                .iter()
                .map(|&i| self.nodes[i as usize].dev)
                .sum::<usize>();
        }
        assert_eq!(pinned, self.stats.pinned, "pinned blocks");
        assert_eq!(leaves, self.leaves.len(), "leaf set has stale entries");
        assert_eq!(
            host_leaves,
            self.host_leaves.len(),
            "host leaf set has stale entries"
        );
        assert_eq!(live, self.num_nodes(), "leaked node slots");
        assert_eq!(cached, self.num_cached);
        assert_eq!(evictable, self.num_evictable);
        assert_eq!(host, self.tier.used, "tier used count");
        for (b, &held) in seen.iter().enumerate() {
            assert_eq!(
                held,
                alloc.is_cached(b as BlockId),
                "block {b}: cached flag vs tree"
            );
            if !held && b < self.owner.len() {
                assert_eq!(self.owner[b], NONE, "block {b}: stale owner");
            }
        }
        // Every tier slot is in exactly one place: held by the tree, free, or quarantined.
        let mut place = seen_slot.iter().map(|&h| h as u32).collect::<Vec<_>>();
        for &s in self.tier.free.iter().chain(&self.tier.quarantine) {
            assert_eq!(
                self.tier.owner[s as usize], NONE,
                "tier slot {s}: free but owned"
            );
            place[s as usize] += 1;
        }
        assert!(
            place.iter().all(|&p| p == 1),
            "tier slot lost or listed twice"
        );
    }
}
