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

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::sched::block::{BlockAllocator, BlockId};

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

/// Child keys are already well-mixed hashes: pass them through instead of hashing them again.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(K);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Children = HashMap<u64, NodeId, BuildHasherDefault<KeyHasher>>;

const K: u64 = 0x517c_c1b7_2722_0a95;

/// Key of a child edge: its namespace and first block's tokens (fx-style fold, then a finalizer
/// so the low bits hashbrown uses for buckets are mixed too).
fn edge_key(ns: u32, block: &[u32]) -> u64 {
    let mut h = (ns as u64).wrapping_add(1).wrapping_mul(K);
    let mut words = block.chunks_exact(2);
    for w in &mut words {
        let v = w[0] as u64 | (w[1] as u64) << 32;
        h = (h.rotate_left(5) ^ v).wrapping_mul(K);
    }
    if let [t] = words.remainder() {
        h = (h.rotate_left(5) ^ *t as u64).wrapping_mul(K);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// Eviction key: the larger the priority value (the less important its users), the earlier;
/// then least recently used first.
type LeafKey = (Reverse<i64>, u64, NodeId);

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

impl Node {
    fn leaf_key(&self, id: NodeId) -> LeafKey {
        (Reverse(self.prio), self.last_access, id)
    }
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

    /// Longest cached block-aligned prefix of `tokens` in namespace `ns` held on the device,
    /// leaving at least one token uncached so the model has something to compute. Touches the
    /// matched path. `count = false` keeps re-matches (of a preempted request) out of the
    /// hit-rate stats.
    pub fn match_prefix(&mut self, tokens: &[u32], ns: Option<&str>, count: bool) -> PrefixMatch {
        self.match_tiered(tokens, ns, count, 0, false)
    }

    /// `match_prefix` that also follows blocks in the tier when `tiered` (they are the last
    /// `host` entries; `promote` them or unlock). `prio`: the matching request's priority.
    pub fn match_tiered(
        &mut self,
        tokens: &[u32],
        ns: Option<&str>,
        count: bool,
        prio: i64,
        tiered: bool,
    ) -> PrefixMatch {
        let cap = tokens.len().saturating_sub(1) / self.block_size;
        let (node, blocks, host) = match self.ns_id(ns) {
            Some(ns) => {
                self.walk_from(Self::ROOT, 0, &tokens[..cap * self.block_size], ns, !tiered)
            }
            None => (Self::ROOT, Vec::new(), 0),
        };
        if count {
            self.queries += tokens.len() as u64;
            self.hits += (blocks.len() * self.block_size) as u64;
            self.stats.hits += (host * self.block_size) as u64;
        }
        self.touch(node, prio);
        PrefixMatch { blocks, node, host }
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

    /// Pin `node` and its ancestors against eviction.
    pub fn lock(&mut self, node: NodeId) {
        let mut id = node;
        while id != Self::ROOT {
            let n = &mut self.nodes[id as usize];
            debug_assert!(n.live, "lock of dead node {id}");
            n.lock_ref += 1;
            if n.lock_ref == 1 {
                self.num_evictable -= n.dev;
                self.sync_leaf(id);
            }
            id = self.nodes[id as usize].parent;
        }
    }

    /// Undo one `lock(node)`.
    pub fn unlock(&mut self, node: NodeId) {
        let mut id = node;
        while id != Self::ROOT {
            let n = &mut self.nodes[id as usize];
            assert!(n.lock_ref > 0, "unlock of unlocked node {id}");
            n.lock_ref -= 1;
            if n.lock_ref == 0 {
                self.num_evictable += n.dev;
                self.sync_leaf(id);
            }
            id = self.nodes[id as usize].parent;
        }
    }

    /// Cache the full blocks of `tokens`, held in `blocks`. Positions already cached keep their
    /// cached block, which is returned in place of the caller's (the caller swaps its duplicate
    /// for it). A hash collision with a different edge stops the insert there: caching less is
    /// always safe.
    pub fn insert(
        &mut self,
        alloc: &mut BlockAllocator,
        tokens: &[u32],
        blocks: &[BlockId],
        ns: Option<&str>,
    ) -> InsertResult {
        self.insert_with(alloc, tokens, blocks, ns, 0, None)
    }

    /// `insert` for a request of priority `prio`. Positions cached only in the tier take the
    /// caller's device block (the fresh copy replaces the tier one). Blocks the tree took from
    /// the caller are appended to `added`.
    pub fn insert_with(
        &mut self,
        alloc: &mut BlockAllocator,
        tokens: &[u32],
        blocks: &[BlockId],
        ns: Option<&str>,
        prio: i64,
        added: Option<&mut Vec<BlockId>>,
    ) -> InsertResult {
        self.insert_from(alloc, Self::ROOT, tokens, blocks, ns, prio, added)
    }

    /// A running sequence that holds (locked) `from` has full blocks up to `tokens.len() / bs`:
    /// cache the new ones. Returns the node to lock instead of `from` (maybe `from` itself).
    /// The common case, a sequence that alone holds its edge, lengthens the edge in place:
    /// no hashing, no allocation.
    #[allow(clippy::too_many_arguments)]
    pub fn extend(
        &mut self,
        alloc: &mut BlockAllocator,
        from: NodeId,
        tokens: &[u32],
        blocks: &[BlockId],
        ns: Option<&str>,
        prio: i64,
        mut added: Option<&mut Vec<BlockId>>,
    ) -> NodeId {
        let bs = self.block_size;
        let total = (tokens.len() / bs).min(blocks.len());
        if from != Self::ROOT && self.extends_in_place(from) {
            let mut skip = 0;
            let mut id = from;
            while id != Self::ROOT {
                skip += self.nodes[id as usize].blocks.len();
                id = self.nodes[id as usize].parent;
            }
            if skip >= total {
                self.touch(from, prio);
                return from;
            }
            let new = &blocks[skip..total];
            for &b in new {
                alloc.set_cached(b, true);
                self.set_owner(b, from);
            }
            if let Some(a) = added.as_deref_mut() {
                a.extend_from_slice(new);
            }
            let n = &mut self.nodes[from as usize];
            n.tokens.extend_from_slice(&tokens[skip * bs..total * bs]);
            n.blocks.extend_from_slice(new);
            n.dev += new.len();
            self.num_cached += new.len();
            self.touch(from, prio);
            return from;
        }
        self.insert_from(alloc, from, tokens, blocks, ns, prio, added)
            .node
    }

    /// `insert_with` for a caller that already holds `from`, a node whose path spells a prefix
    /// of `tokens` (the node it locked after its last insert): the walk starts there, so a
    /// sequence that fills one more block hashes one block, not its whole history.
    #[allow(clippy::too_many_arguments)]
    fn insert_from(
        &mut self,
        alloc: &mut BlockAllocator,
        from: NodeId,
        tokens: &[u32],
        blocks: &[BlockId],
        ns: Option<&str>,
        prio: i64,
        mut added: Option<&mut Vec<BlockId>>,
    ) -> InsertResult {
        let bs = self.block_size;
        debug_assert!(
            blocks.len() >= tokens.len() / bs,
            "fewer blocks than full token blocks"
        );
        let total = (tokens.len() / bs).min(blocks.len());
        let ns = self.intern(ns);
        let mut out = Vec::with_capacity(total);
        let mut start = Self::ROOT;
        if from != Self::ROOT
            && self.nodes[from as usize].live
            && self.nodes[from as usize].ns == ns
        {
            for id in self.path_ids(from) {
                out.extend_from_slice(&self.nodes[id as usize].blocks);
            }
            if out.len() <= total {
                start = from;
            } else {
                out.clear();
            }
        }
        debug_assert!(start == Self::ROOT || self.path(start).0 == tokens[..out.len() * bs]);
        let skip = out.len();
        let (mut node, cont, host) = self.walk_from(start, skip, &tokens[..total * bs], ns, false);
        out.extend_from_slice(&cont);
        if host > 0 {
            self.materialize(alloc, node, blocks, &mut out, added.as_deref_mut());
        }
        let num_cached_tokens = out.len() * bs;
        let pos = out.len();
        if pos < total {
            let key = edge_key(ns, &tokens[pos * bs..(pos + 1) * bs]);
            // A present key here means walk stopped on a collision: leave the rest uncached.
            if !self.nodes[node as usize].children.contains_key(&key) {
                let new = &blocks[pos..total];
                for &b in new {
                    alloc.set_cached(b, true);
                }
                if let Some(a) = added {
                    a.extend_from_slice(new);
                }
                node = self.add_child(node, key, ns, &tokens[pos * bs..total * bs], new);
                out.extend_from_slice(new);
            }
        }
        self.touch(node, prio);
        InsertResult {
            node,
            blocks: out,
            num_cached_tokens,
        }
    }

    /// Free up to `num_blocks` device blocks, taking from the evictable leaves in eviction
    /// order, tail blocks first: demoted to the tier if there is one (and room), else dropped.
    /// A block some sequence still holds (ref > 0) is skipped with its leaf. Returns the number
    /// of device blocks freed.
    pub fn evict(&mut self, alloc: &mut BlockAllocator, num_blocks: usize) -> usize {
        self.evict_inner(alloc, num_blocks, false)
    }

    fn evict_inner(
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

    /// Follow `tokens` (whole blocks) down from the root; split an edge where the match stops
    /// inside it (at a mismatch, or at the first tier block when `device_only`). Returns the
    /// deepest matched node, the blocks of the match and how many of them (the last) are tier
    /// slots.
    /// Starts at `from`, whose path spells the first `skip` blocks of `tokens`; the blocks
    /// returned are the continuation.
    fn walk_from(
        &mut self,
        from: NodeId,
        skip: usize,
        tokens: &[u32],
        ns: u32,
        device_only: bool,
    ) -> (NodeId, Vec<BlockId>, usize) {
        let bs = self.block_size;
        let total = tokens.len() / bs - skip;
        let mut blocks = Vec::with_capacity(total);
        let mut host = 0;
        let mut node = from;
        while blocks.len() < total {
            let rest = &tokens[(skip + blocks.len()) * bs..];
            let key = edge_key(ns, &rest[..bs]);
            let Some(&child) = self.nodes[node as usize].children.get(&key) else {
                break;
            };
            let c = &self.nodes[child as usize];
            if c.ns != ns {
                break;
            }
            let mut n = c
                .tokens
                .chunks_exact(bs)
                .zip(rest.chunks_exact(bs))
                .take_while(|(a, b)| a == b)
                .count();
            if device_only {
                n = n.min(c.dev);
            }
            if n == 0 {
                break; // hash collision, or nothing on the device
            }
            host += n.saturating_sub(c.dev);
            blocks.extend_from_slice(&c.blocks[..n]);
            if n < c.blocks.len() {
                node = self.split(child, n);
                break;
            }
            node = child;
        }
        (node, blocks, host)
    }

    /// Cut `id`'s edge after `n` blocks: a new node takes the first part and becomes `id`'s
    /// parent, with `id`'s lock count (the same sequences lock both). Returns the new node.
    fn split(&mut self, id: NodeId, n: usize) -> NodeId {
        let bs = self.block_size;
        let c = &mut self.nodes[id as usize];
        let tokens: Vec<u32> = c.tokens.drain(..n * bs).collect();
        let blocks: Vec<BlockId> = c.blocks.drain(..n).collect();
        let mid_dev = c.dev.min(n);
        c.dev -= mid_dev;
        let (parent, key, ns, lock_ref, last_access, prio, promoted_at) = (
            c.parent,
            c.key,
            c.ns,
            c.lock_ref,
            c.last_access,
            c.prio,
            c.promoted_at,
        );
        c.key = edge_key(ns, &c.tokens[..bs]);
        let child_key = c.key;
        let child_dev = c.dev > 0;
        let mid = self.alloc_node(Node {
            parent,
            key,
            ns,
            tokens,
            blocks,
            dev: mid_dev,
            dev_children: child_dev as u32,
            children: Children::default(),
            lock_ref,
            last_access,
            prio,
            promoted_at,
            in_leaves: false,
            in_host_leaves: false,
            live: true,
        });
        self.nodes[mid as usize].children.insert(child_key, id);
        self.nodes[id as usize].parent = mid;
        self.nodes[parent as usize].children.insert(key, mid);
        self.adopt(mid);
        self.sync_leaf(id);
        self.sync_leaf(mid);
        mid
    }

    /// `id` may take more blocks at the end of its edge: one sequence alone holds it, nothing
    /// hangs below it and all its blocks are on the device (locked nodes always are).
    fn extends_in_place(&self, id: NodeId) -> bool {
        let n = &self.nodes[id as usize];
        n.lock_ref == 1 && n.children.is_empty() && n.dev == n.blocks.len()
    }

    /// Point the owner maps at `id` for all its blocks.
    fn adopt(&mut self, id: NodeId) {
        let n = &self.nodes[id as usize];
        let (dev, blocks) = (n.dev, n.blocks.clone());
        for &b in &blocks[..dev] {
            self.set_owner(b, id);
        }
        for &s in &blocks[dev..] {
            self.tier.owner[s as usize] = id;
        }
    }

    /// The tier blocks on the path root..`node` are also in `blocks` (the caller's device
    /// blocks, which hold the same KV): the caller's replace them.
    fn materialize(
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
    fn host_to_device(&mut self, id: NodeId, k: usize) {
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
    fn demote_tail(&mut self, alloc: &mut BlockAllocator, id: NodeId) -> bool {
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

    /// Drop `id`'s last device block, with what lies below it (its tier tail and any tier
    /// children: their KV is only valid after this block's).
    fn drop_tail(&mut self, alloc: &mut BlockAllocator, id: NodeId) {
        let j = self.nodes[id as usize].dev - 1;
        self.cut(alloc, id, j);
    }

    /// A free tier slot, dropping the coldest tier blocks if the tier is full. None if there is no tier or nothing can be dropped this step.
    fn take_slot(&mut self) -> Option<TierSlot> {
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
    fn free_slot(&mut self, s: TierSlot) {
        self.tier.owner[s as usize] = NONE;
        if self.tier.busy[s as usize] == self.step {
            self.tier.quarantine.push(s);
        } else {
            self.tier.free.push(s);
        }
    }

    fn set_owner(&mut self, b: BlockId, id: NodeId) {
        let i = b as usize;
        if i >= self.owner.len() {
            self.owner.resize(i + 1, NONE);
        }
        self.owner[i] = id;
    }

    /// Free every block of `id` (device ones to the allocator, tier ones to the tier) and fix
    /// the counters; the node itself stays.
    fn release_blocks_of(&mut self, alloc: &mut BlockAllocator, id: NodeId) {
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
    fn cut(&mut self, alloc: &mut BlockAllocator, id: NodeId, j: usize) {
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

    fn add_child(
        &mut self,
        parent: NodeId,
        key: u64,
        ns: u32,
        tokens: &[u32],
        blocks: &[BlockId],
    ) -> NodeId {
        let id = self.alloc_node(Node {
            parent,
            key,
            ns,
            tokens: tokens.to_vec(),
            blocks: blocks.to_vec(),
            dev: blocks.len(),
            last_access: self.clock,
            prio: i64::MAX,
            live: true,
            ..Node::default()
        });
        self.nodes[parent as usize].children.insert(key, id);
        if parent != Self::ROOT {
            self.nodes[parent as usize].dev_children += 1;
        }
        self.adopt(id);
        self.num_cached += blocks.len();
        self.num_evictable += blocks.len();
        self.sync_leaf(parent);
        self.sync_leaf(id);
        id
    }

    /// Unlink an empty, childless node from its parent and free its slot.
    fn remove(&mut self, id: NodeId) {
        let n = &self.nodes[id as usize];
        debug_assert!(n.children.is_empty() && n.blocks.is_empty());
        let (parent, key) = (n.parent, n.key);
        self.nodes[parent as usize].children.remove(&key);
        self.remove_slot(id);
    }

    fn remove_slot(&mut self, id: NodeId) {
        self.leave_leaves(id);
        self.nodes[id as usize] = Node::default();
        self.free_nodes.push(id);
    }

    fn alloc_node(&mut self, node: Node) -> NodeId {
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                assert!(self.nodes.len() < NONE as usize, "too many radix nodes");
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// Root's children first, `node` last.
    fn path_ids(&self, node: NodeId) -> Vec<NodeId> {
        let mut ids = Vec::new();
        let mut id = node;
        while id != Self::ROOT {
            ids.push(id);
            id = self.nodes[id as usize].parent;
        }
        ids.reverse();
        ids
    }

    /// Stamp `node..root` as used now by a request of priority `prio` (re-keying those in a
    /// leaf set).
    fn touch(&mut self, node: NodeId, prio: i64) {
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
    fn leave_leaves(&mut self, id: NodeId) {
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
    fn sync_leaf(&mut self, id: NodeId) {
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

    fn ns_id(&self, ns: Option<&str>) -> Option<u32> {
        match ns {
            None => Some(0),
            Some(name) => self.namespaces.get(name).copied(),
        }
    }

    fn intern(&mut self, ns: Option<&str>) -> u32 {
        let Some(name) = ns else { return 0 };
        if let Some(&id) = self.namespaces.get(name) {
            return id;
        }
        let id = self.namespaces.len() as u32 + 1;
        self.namespaces.insert(name.to_owned(), id);
        self.ns_names.push(name.to_owned());
        id
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod tier_tests;
