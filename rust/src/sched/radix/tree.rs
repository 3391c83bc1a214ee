//! The tree itself: matching a prefix, inserting and extending edges, splitting them on a block
//! boundary, locking paths, and the arena of nodes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::{InsertResult, Node, NodeId, PrefixMatch, RadixCache, NONE};
use crate::sched::block::{BlockAllocator, BlockId};

/// Child keys are already well-mixed hashes: pass them through instead of hashing them again.
#[derive(Default)]
pub(super) struct KeyHasher(u64);

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

pub(super) type Children = HashMap<u64, NodeId, BuildHasherDefault<KeyHasher>>;

const K: u64 = 0x517c_c1b7_2722_0a95;

/// Key of a child edge: its namespace and first block's tokens (fx-style fold, then a finalizer
/// so the low bits hashbrown uses for buckets are mixed too).
pub(super) fn edge_key(ns: u32, block: &[u32]) -> u64 {
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

impl RadixCache {
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
    pub(super) fn insert_from(
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

    /// Follow `tokens` (whole blocks) down from the root; split an edge where the match stops
    /// inside it (at a mismatch, or at the first tier block when `device_only`). Returns the
    /// deepest matched node, the blocks of the match and how many of them (the last) are tier
    /// slots.
    /// Starts at `from`, whose path spells the first `skip` blocks of `tokens`; the blocks
    /// returned are the continuation.
    pub(super) fn walk_from(
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
    pub(super) fn split(&mut self, id: NodeId, n: usize) -> NodeId {
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
    pub(super) fn extends_in_place(&self, id: NodeId) -> bool {
        let n = &self.nodes[id as usize];
        n.lock_ref == 1 && n.children.is_empty() && n.dev == n.blocks.len()
    }

    /// Point the owner maps at `id` for all its blocks.
    pub(super) fn adopt(&mut self, id: NodeId) {
        let n = &self.nodes[id as usize];
        let (dev, blocks) = (n.dev, n.blocks.clone());
        for &b in &blocks[..dev] {
            self.set_owner(b, id);
        }
        for &s in &blocks[dev..] {
            self.tier.owner[s as usize] = id;
        }
    }

    pub(super) fn set_owner(&mut self, b: BlockId, id: NodeId) {
        let i = b as usize;
        if i >= self.owner.len() {
            self.owner.resize(i + 1, NONE);
        }
        self.owner[i] = id;
    }

    pub(super) fn add_child(
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
    pub(super) fn remove(&mut self, id: NodeId) {
        let n = &self.nodes[id as usize];
        debug_assert!(n.children.is_empty() && n.blocks.is_empty());
        let (parent, key) = (n.parent, n.key);
        self.nodes[parent as usize].children.remove(&key);
        self.remove_slot(id);
    }

    pub(super) fn remove_slot(&mut self, id: NodeId) {
        self.leave_leaves(id);
        self.nodes[id as usize] = Node::default();
        self.free_nodes.push(id);
    }

    pub(super) fn alloc_node(&mut self, node: Node) -> NodeId {
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
    pub(super) fn path_ids(&self, node: NodeId) -> Vec<NodeId> {
        let mut ids = Vec::new();
        let mut id = node;
        while id != Self::ROOT {
            ids.push(id);
            id = self.nodes[id as usize].parent;
        }
        ids.reverse();
        ids
    }

    pub(super) fn ns_id(&self, ns: Option<&str>) -> Option<u32> {
        match ns {
            None => Some(0),
            Some(name) => self.namespaces.get(name).copied(),
        }
    }

    pub(super) fn intern(&mut self, ns: Option<&str>) -> u32 {
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
