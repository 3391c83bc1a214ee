//! Radix prefix cache over KV blocks, in two tiers.
//!
//! A tree of token runs: each node's edge holds whole blocks (their tokens and block ids), so a
//! path from the root spells a block-aligned prefix and the blocks that hold its KV data. One
//! edge may span many blocks; it is split on a block boundary when a match or insert stops inside.
//!
//! - Children are keyed by a hash of (namespace, first block's tokens); a hit is verified against
//!   the stored tokens, so a hash collision costs a miss, never a wrong block.
//! - `lock_ref` counts the sequences using a node or anything below it (lock walks node..root).
//!   Locked nodes are never evicted.
//! - The tree holds device blocks through the allocator's `cached` flag, not through ref counts:
//!   a cached block with no sequence holding it is evictable memory, reported apart from used.
//!
//! Tiers. With a lower tier (`new_tiered`: host memory or a disk file, `tier_blocks` slots), an
//! evicted block is demoted (its KV is copied to a tier slot) instead of dropped, and a match
//! that reaches demoted blocks may promote them (copied back to fresh device blocks). Each edge
//! keeps its device blocks first: `blocks[..dev]` are device block ids, `blocks[dev..]` tier
//! slots. Demotion goes leaf-first, so tier residence is closed downwards: below a tier block
//! everything is in the tier too. The copies are not done here: they are queued in `copies`
//! (device→tier before tier→device) for the caller to run before the next forward.
//!
//! Eviction order. Unlocked nodes with device blocks and no child holding device blocks sit in
//! `leaves`, keyed by (priority class, last access): blocks last used only by lower-priority
//! requests go first, LRU within a class. Tier nodes without children sit in `host_leaves`, from
//! which a full tier drops blocks (tail first). Both sets are kept up to date on every change, so
//! eviction never walks the tree.
//!
//! Files: this one holds the types and the read-only accessors; `tree` the structure (match,
//! insert, split, lock), `evict` the leaf sets and dropping, `tier` demotion, promotion, pins
//! and restart, `invariants` the check the randomized tests run.

use std::collections::{BTreeSet, HashMap};

use crate::sched::block::BlockId;
use evict::LeafKey;
use tree::Children;

mod evict;
mod invariants;
mod tier;
mod tree;

pub type NodeId = u32;
/// A slot of the lower tier.
pub type TierSlot = u32;

const NONE: NodeId = NodeId::MAX;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Device block ids, then (the last `host` entries) tier slots.
    pub blocks: Vec<BlockId>,
    /// Deepest matched node (ROOT if none); lock it while the blocks are in use.
    pub node: NodeId,
    /// Trailing entries of `blocks` that live in the tier (see `promote`).
    pub host: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InsertResult {
    /// Deepest node of the inserted path; lock it while the blocks are in use.
    pub node: NodeId,
    /// The canonical block ids of the inserted prefix (already-cached positions keep their old id).
    pub blocks: Vec<BlockId>,
    pub num_cached_tokens: usize,
}

/// Counters of the lower tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    /// Tier slots (0: no tier).
    pub capacity: usize,
    /// Slots holding a cached block.
    pub used: usize,
    /// Blocks copied tier → device / device → tier so far.
    pub promotions: u64,
    pub demotions: u64,
    /// Prompt tokens of prefix hits that were served from the tier.
    pub hits: u64,
    /// Blocks of preempted sequences swapped out / in (kept by the scheduler).
    pub swap_out: u64,
    pub swap_in: u64,
    /// Device blocks held by pinned prefixes.
    pub pinned: usize,
}

/// Copies the caller must run before the next forward, in this order: `demote` (device block,
/// tier slot) pairs, then `promote` (tier slot, device block) pairs; flat `[k * 2]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Copies {
    pub demote: Vec<i64>,
    pub promote: Vec<i64>,
}

impl Copies {
    pub fn is_empty(&self) -> bool {
        self.demote.is_empty() && self.promote.is_empty()
    }
}

#[derive(Debug, Default)]
struct Node {
    parent: NodeId,
    /// This node's key in `parent.children`.
    key: u64,
    ns: u32,
    /// `blocks.len() * block_size` tokens.
    tokens: Vec<u32>,
    /// Device block ids (`[..dev]`), then tier slots.
    blocks: Vec<BlockId>,
    dev: usize,
    /// Children with `dev > 0`.
    dev_children: u32,
    children: Children,
    lock_ref: u32,
    last_access: u64,
    /// The most important (lowest) priority of the requests that used it.
    prio: i64,
    /// Step in which its tier blocks were promoted: not demoted again before that step's
    /// copies have run.
    promoted_at: u64,
    /// In `leaves` / `host_leaves` (under `leaf_key`).
    in_leaves: bool,
    in_host_leaves: bool,
    live: bool,
}

/// Slots of the lower tier.
#[derive(Debug, Default)]
struct Tier {
    free: Vec<TierSlot>,
    /// Slots freed while a copy of the current step still reads or writes them: reusable from
    /// the next step on (a copy batch never names a slot twice).
    quarantine: Vec<TierSlot>,
    /// Per slot: the node holding it, or NONE.
    owner: Vec<NodeId>,
    /// Per slot: the last step a copy touched it.
    busy: Vec<u64>,
    used: usize,
}

#[derive(Debug)]
pub struct RadixCache {
    block_size: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    /// Device-evictable nodes (unlocked, device blocks, no child with device blocks).
    leaves: BTreeSet<LeafKey>,
    /// Tier-evictable nodes (unlocked, tier blocks, no children).
    host_leaves: BTreeSet<LeafKey>,
    /// Namespace name -> id (0 is the default namespace). Interned so namespaces never collide.
    namespaces: HashMap<String, u32>,
    ns_names: Vec<String>,
    /// Per device block: the node holding it, or NONE (grown on demand).
    owner: Vec<NodeId>,
    tier: Tier,
    copies: Copies,
    pinned: Vec<NodeId>,
    step: u64,
    clock: u64,
    queries: u64,
    hits: u64,
    stats: TierStats,
    num_cached: usize,
    num_evictable: usize,
}

impl RadixCache {
    pub const ROOT: NodeId = 0;

    pub fn new(block_size: usize) -> Self {
        Self::new_tiered(block_size, 0)
    }

    /// A cache with a lower tier of `tier_blocks` slots (0: none).
    pub fn new_tiered(block_size: usize, tier_blocks: usize) -> Self {
        assert!(block_size > 0, "block_size must be > 0");
        assert!(tier_blocks < NONE as usize, "too many tier slots");
        let root = Node {
            live: true,
            ..Node::default()
        };
        let tier = Tier {
            free: (0..tier_blocks as TierSlot).rev().collect(),
            owner: vec![NONE; tier_blocks],
            busy: vec![0; tier_blocks],
            ..Tier::default()
        };
        Self {
            block_size,
            nodes: vec![root],
            free_nodes: Vec::new(),
            leaves: BTreeSet::new(),
            host_leaves: BTreeSet::new(),
            namespaces: HashMap::new(),
            ns_names: Vec::new(),
            owner: Vec::new(),
            tier,
            copies: Copies::default(),
            pinned: Vec::new(),
            step: 1,
            clock: 0,
            queries: 0,
            hits: 0,
            stats: TierStats {
                capacity: tier_blocks,
                ..TierStats::default()
            },
            num_cached: 0,
            num_evictable: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn tier_capacity(&self) -> usize {
        self.tier.owner.len()
    }

    pub fn queries(&self) -> u64 {
        self.queries
    }

    pub fn hits(&self) -> u64 {
        self.hits
    }

    pub fn tier_stats(&self) -> TierStats {
        TierStats {
            used: self.tier.used,
            ..self.stats
        }
    }

    /// Device blocks held by the tree.
    pub fn num_cached_blocks(&self) -> usize {
        self.num_cached
    }

    /// Device blocks held by unlocked nodes (evictable once no sequence holds them).
    pub fn num_evictable_blocks(&self) -> usize {
        self.num_evictable
    }

    /// Live nodes, the root included.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    /// The lock count of `node`.
    pub fn lock_ref(&self, node: NodeId) -> u32 {
        self.nodes[node as usize].lock_ref
    }

    /// The tokens and blocks of every edge from the root to `node`, concatenated.
    pub fn path(&self, node: NodeId) -> (Vec<u32>, Vec<BlockId>) {
        let (mut tokens, mut blocks) = (Vec::new(), Vec::new());
        for id in self.path_ids(node) {
            tokens.extend_from_slice(&self.nodes[id as usize].tokens);
            blocks.extend_from_slice(&self.nodes[id as usize].blocks);
        }
        (tokens, blocks)
    }

    /// Every (node, path tokens, path blocks) of the live tree, the root excluded.
    pub fn edges(&self) -> Vec<(NodeId, Vec<u32>, Vec<BlockId>)> {
        let mut out = Vec::new();
        let mut stack = vec![(Self::ROOT, Vec::new(), Vec::new())];
        while let Some((id, toks, blocks)) = stack.pop() {
            for &c in self.nodes[id as usize].children.values() {
                let n = &self.nodes[c as usize];
                let t = [&toks[..], &n.tokens[..]].concat();
                let b = [&blocks[..], &n.blocks[..]].concat();
                out.push((c, t.clone(), b.clone()));
                stack.push((c, t, b));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod tier_tests;
