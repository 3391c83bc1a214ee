//! Radix prefix cache over KV blocks.
//!
//! A tree of token runs: each node's edge holds whole blocks (their tokens and block ids), so a
//! path from the root spells a block-aligned prefix and the blocks that hold its KV data. One
//! edge may span many blocks; it is split on a block boundary when a match or insert stops inside.
//!
//! - Children are keyed by a hash of (namespace, first block's tokens); a hit is verified against
//!   the stored tokens, so a hash collision costs a miss, never a wrong block.
//! - `lock_ref` counts the sequences using a node or anything below it (lock walks node..root).
//!   Locked nodes are never evicted.
//! - Unlocked leaves sit in a `BTreeSet<(last_access, node)>` kept up to date on every change,
//!   so eviction pops the LRU leaf in O(log n) and never walks the tree.
//! - The tree holds blocks through the allocator's `cached` flag, not through ref counts: a
//!   cached block with no sequence holding it is evictable memory, reported apart from used.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::block::{BlockAllocator, BlockId};

pub type NodeId = u32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    pub blocks: Vec<BlockId>,
    /// Deepest matched node (ROOT if none); lock it while the blocks are in use.
    pub node: NodeId,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InsertResult {
    /// Deepest node of the inserted path; lock it while the blocks are in use.
    pub node: NodeId,
    /// The canonical block ids of the inserted prefix (already-cached positions keep their old id).
    pub blocks: Vec<BlockId>,
    pub num_cached_tokens: usize,
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

#[derive(Debug, Default)]
struct Node {
    parent: NodeId,
    /// This node's key in `parent.children`.
    key: u64,
    ns: u32,
    /// `blocks.len() * block_size` tokens.
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
    children: Children,
    lock_ref: u32,
    last_access: u64,
    /// In `leaves` (under the key `(last_access, id)`).
    in_leaves: bool,
    live: bool,
}

#[derive(Debug)]
pub struct RadixCache {
    block_size: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    /// Unlocked childless nodes, LRU first.
    leaves: BTreeSet<(u64, NodeId)>,
    /// Namespace name -> id (0 is the default namespace). Interned so namespaces never collide.
    namespaces: HashMap<String, u32>,
    clock: u64,
    queries: u64,
    hits: u64,
    num_cached: usize,
    num_evictable: usize,
}

impl RadixCache {
    pub const ROOT: NodeId = 0;

    pub fn new(block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be > 0");
        let root = Node {
            live: true,
            ..Node::default()
        };
        Self {
            block_size,
            nodes: vec![root],
            free_nodes: Vec::new(),
            leaves: BTreeSet::new(),
            namespaces: HashMap::new(),
            clock: 0,
            queries: 0,
            hits: 0,
            num_cached: 0,
            num_evictable: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Longest cached block-aligned prefix of `tokens` in namespace `ns`, leaving at least one
    /// token uncached so the model has something to compute. Touches the matched path.
    /// `count = false` keeps re-matches (of a preempted request) out of the hit-rate stats.
    pub fn match_prefix(&mut self, tokens: &[u32], ns: Option<&str>, count: bool) -> PrefixMatch {
        let cap = tokens.len().saturating_sub(1) / self.block_size;
        let (node, blocks) = match self.ns_id(ns) {
            Some(ns) => self.walk(&tokens[..cap * self.block_size], ns),
            None => (Self::ROOT, Vec::new()),
        };
        if count {
            self.queries += tokens.len() as u64;
            self.hits += (blocks.len() * self.block_size) as u64;
        }
        self.touch(node);
        PrefixMatch { blocks, node }
    }

    /// Pin `node` and its ancestors against eviction.
    pub fn lock(&mut self, node: NodeId) {
        let mut id = node;
        while id != Self::ROOT {
            let n = &mut self.nodes[id as usize];
            debug_assert!(n.live, "lock of dead node {id}");
            n.lock_ref += 1;
            if n.lock_ref == 1 {
                self.num_evictable -= n.blocks.len();
                self.leave_leaves(id);
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
                self.num_evictable += n.blocks.len();
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
        let bs = self.block_size;
        debug_assert!(
            blocks.len() >= tokens.len() / bs,
            "fewer blocks than full token blocks"
        );
        let total = (tokens.len() / bs).min(blocks.len());
        let ns = self.intern(ns);
        let (mut node, mut out) = self.walk(&tokens[..total * bs], ns);
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
                node = self.add_child(node, key, ns, &tokens[pos * bs..total * bs], new);
                out.extend_from_slice(new);
            }
        }
        self.touch(node);
        InsertResult {
            node,
            blocks: out,
            num_cached_tokens,
        }
    }

    /// Free up to `num_blocks` blocks, taking from the least recently used unlocked leaves, tail
    /// blocks first. A block some sequence still holds (ref > 0) is skipped with its leaf. A
    /// parent left childless and unlocked becomes an evictable leaf. Returns the number freed.
    pub fn evict(&mut self, alloc: &mut BlockAllocator, num_blocks: usize) -> usize {
        let mut freed = 0;
        let mut busy = Vec::new();
        while freed < num_blocks {
            let Some((_, id)) = self.leaves.pop_first() else {
                break;
            };
            let n = &mut self.nodes[id as usize];
            n.in_leaves = false;
            while freed < num_blocks {
                match n.blocks.last() {
                    Some(&b) if alloc.ref_count(b) == 0 => {
                        n.blocks.pop();
                        n.tokens.truncate(n.blocks.len() * self.block_size);
                        alloc.release_cached(b);
                        freed += 1;
                    }
                    Some(_) => {
                        busy.push(id);
                        break;
                    }
                    None => break,
                }
            }
            if n.blocks.is_empty() {
                let parent = n.parent;
                self.remove(id);
                self.sync_leaf(parent);
            } else if busy.last() != Some(&id) {
                self.sync_leaf(id);
            }
        }
        self.num_cached -= freed;
        self.num_evictable -= freed;
        for id in busy {
            self.sync_leaf(id);
        }
        freed
    }

    /// Drop every unlocked node (whatever its blocks' ref counts: those still held are freed when
    /// their holders let go). True if the tree is now empty. Walks the whole arena.
    pub fn reset(&mut self, alloc: &mut BlockAllocator) -> bool {
        for id in 1..self.nodes.len() as NodeId {
            let n = &self.nodes[id as usize];
            if !n.live || n.lock_ref > 0 {
                continue;
            }
            for &b in &n.blocks {
                alloc.release_cached(b);
            }
            self.num_cached -= n.blocks.len();
            self.num_evictable -= n.blocks.len();
            let parent = n.parent;
            let key = n.key;
            self.nodes[parent as usize].children.remove(&key);
            self.remove_slot(id);
        }
        // Survivors are all locked, so none is an evictable leaf.
        self.leaves.clear();
        debug_assert_eq!(self.num_evictable, 0);
        let empty = self.nodes[Self::ROOT as usize].children.is_empty();
        if empty {
            self.namespaces.clear();
            self.nodes.truncate(1);
            self.free_nodes.clear();
        }
        empty
    }

    pub fn queries(&self) -> u64 {
        self.queries
    }

    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Blocks held by the tree.
    pub fn num_cached_blocks(&self) -> usize {
        self.num_cached
    }

    /// Blocks held by unlocked nodes (evictable once no sequence holds them).
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
        let mut ids = Vec::new();
        let mut id = node;
        while id != Self::ROOT {
            ids.push(id);
            id = self.nodes[id as usize].parent;
        }
        let (mut tokens, mut blocks) = (Vec::new(), Vec::new());
        for &id in ids.iter().rev() {
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

    /// Panic if the tree, its counters, the leaf set or the allocator's cached flags disagree.
    /// Walks everything; for tests.
    pub fn check_invariants(&self, alloc: &BlockAllocator) {
        let bs = self.block_size;
        let mut seen = vec![false; alloc.num_blocks()];
        let (mut cached, mut evictable, mut live, mut leaves) = (0, 0, 1, 0);
        let mut stack = vec![Self::ROOT];
        while let Some(id) = stack.pop() {
            let n = &self.nodes[id as usize];
            assert!(n.live, "dead node {id} reachable");
            let mut child_locks = 0;
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
                }
                child_locks += ch.lock_ref;
                stack.push(c);
            }
            // The root is never locked; any other node counts its subtree's locks.
            assert!(
                id == Self::ROOT || n.lock_ref >= child_locks,
                "node {id}: lock below children's"
            );
            if id == Self::ROOT {
                assert!(!n.in_leaves);
                continue;
            }
            for &b in &n.blocks {
                assert!(!seen[b as usize], "block {b} held twice by the tree");
                seen[b as usize] = true;
                assert!(
                    alloc.is_cached(b),
                    "block {b} in the tree but not marked cached"
                );
            }
            cached += n.blocks.len();
            if n.lock_ref == 0 {
                evictable += n.blocks.len();
            }
            let leaf = n.lock_ref == 0 && n.children.is_empty();
            assert_eq!(n.in_leaves, leaf, "node {id}: leaf flag");
            if leaf {
                assert!(
                    self.leaves.contains(&(n.last_access, id)),
                    "node {id} not in leaf set"
                );
                leaves += 1;
            }
        }
        assert_eq!(leaves, self.leaves.len(), "leaf set has stale entries");
        assert_eq!(live, self.num_nodes(), "leaked node slots");
        assert_eq!(cached, self.num_cached);
        assert_eq!(evictable, self.num_evictable);
        for (b, &held) in seen.iter().enumerate() {
            assert_eq!(
                held,
                alloc.is_cached(b as BlockId),
                "block {b}: cached flag vs tree"
            );
        }
    }

    /// Follow `tokens` (whole blocks) down from the root; split an edge where the match stops
    /// inside it. Returns the deepest matched node and the blocks of the match.
    fn walk(&mut self, tokens: &[u32], ns: u32) -> (NodeId, Vec<BlockId>) {
        let bs = self.block_size;
        let total = tokens.len() / bs;
        let mut blocks = Vec::with_capacity(total);
        let mut node = Self::ROOT;
        while blocks.len() < total {
            let rest = &tokens[blocks.len() * bs..];
            let key = edge_key(ns, &rest[..bs]);
            let Some(&child) = self.nodes[node as usize].children.get(&key) else {
                break;
            };
            let c = &self.nodes[child as usize];
            if c.ns != ns {
                break;
            }
            let n = c
                .tokens
                .chunks_exact(bs)
                .zip(rest.chunks_exact(bs))
                .take_while(|(a, b)| a == b)
                .count();
            if n == 0 {
                break; // hash collision
            }
            blocks.extend_from_slice(&c.blocks[..n]);
            node = if n < c.blocks.len() {
                self.split(child, n)
            } else {
                child
            };
        }
        (node, blocks)
    }

    /// Cut `id`'s edge after `n` blocks: a new node takes the first part and becomes `id`'s
    /// parent, with `id`'s lock count (the same sequences lock both). Returns the new node.
    fn split(&mut self, id: NodeId, n: usize) -> NodeId {
        let bs = self.block_size;
        let c = &mut self.nodes[id as usize];
        let tokens: Vec<u32> = c.tokens.drain(..n * bs).collect();
        let blocks: Vec<BlockId> = c.blocks.drain(..n).collect();
        let (parent, key, ns, lock_ref, last_access) =
            (c.parent, c.key, c.ns, c.lock_ref, c.last_access);
        c.key = edge_key(ns, &c.tokens[..bs]);
        let child_key = c.key;
        let mid = self.alloc_node(Node {
            parent,
            key,
            ns,
            tokens,
            blocks,
            children: Children::default(),
            lock_ref,
            last_access,
            in_leaves: false,
            live: true,
        });
        self.nodes[mid as usize].children.insert(child_key, id);
        self.nodes[id as usize].parent = mid;
        self.nodes[parent as usize].children.insert(key, mid);
        mid
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
            children: Children::default(),
            lock_ref: 0,
            last_access: self.clock,
            in_leaves: false,
            live: true,
        });
        self.nodes[parent as usize].children.insert(key, id);
        self.leave_leaves(parent);
        self.num_cached += blocks.len();
        self.num_evictable += blocks.len();
        self.sync_leaf(id);
        id
    }

    /// Unlink an empty, childless node from its parent and free its slot.
    fn remove(&mut self, id: NodeId) {
        let n = &self.nodes[id as usize];
        debug_assert!(n.children.is_empty() && n.blocks.is_empty() && !n.in_leaves);
        let (parent, key) = (n.parent, n.key);
        self.nodes[parent as usize].children.remove(&key);
        self.remove_slot(id);
    }

    fn remove_slot(&mut self, id: NodeId) {
        let n = &mut self.nodes[id as usize];
        if n.in_leaves {
            self.leaves.remove(&(n.last_access, id));
        }
        *n = Node::default();
        self.free_nodes.push(id);
    }

    fn alloc_node(&mut self, node: Node) -> NodeId {
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                assert!(
                    self.nodes.len() < NodeId::MAX as usize,
                    "too many radix nodes"
                );
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// Stamp `node..root` as used now; re-key the node in the leaf set if it is there (only the
    /// deepest node of a path can be a leaf).
    fn touch(&mut self, node: NodeId) {
        self.clock += 1;
        let now = self.clock;
        self.leave_leaves(node);
        let mut id = node;
        while id != Self::ROOT {
            self.nodes[id as usize].last_access = now;
            id = self.nodes[id as usize].parent;
        }
        self.sync_leaf(node);
    }

    /// Take `id` out of the leaf set if it is in it.
    fn leave_leaves(&mut self, id: NodeId) {
        let n = &mut self.nodes[id as usize];
        if n.in_leaves {
            n.in_leaves = false;
            self.leaves.remove(&(n.last_access, id));
        }
    }

    /// Put `id` in the leaf set if it is an unlocked childless non-root node, else take it out.
    fn sync_leaf(&mut self, id: NodeId) {
        let n = &mut self.nodes[id as usize];
        let leaf = id != Self::ROOT && n.live && n.lock_ref == 0 && n.children.is_empty();
        if leaf && !n.in_leaves {
            n.in_leaves = true;
            self.leaves.insert((n.last_access, id));
        } else if !leaf && n.in_leaves {
            n.in_leaves = false;
            self.leaves.remove(&(n.last_access, id));
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
        id
    }
}

#[cfg(test)]
#[path = "radix_tests.rs"]
mod tests;
