//! Paged KV block allocator.
//!
//! Every block is in exactly one of three states:
//! - **free**: on the free list, ref count 0, not held by the radix cache;
//! - **used**: ref count > 0 (one ref per sequence holding it; the radix cache may hold it too);
//! - **cached**: ref count 0 but held by the radix cache, so it keeps its KV data until evicted.
//!
//! The free list is intrusive and doubly linked (`prev`/`next` index vectors with a sentinel), so
//! allocate, free and touch are O(1). Blocks are freed to the MRU end and allocated from the LRU end:
//! a block freed long ago is reused before one freed just now.

pub type BlockId = u32;

/// `append_slot` could not get a block. Nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfBlocks;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockUsage {
    pub total: usize,
    pub free: usize,
    pub used: usize,
    pub cached: usize,
}

#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    refs: Vec<u32>,
    cached: Vec<bool>,
    // Free list links. Index `num_blocks` is the sentinel: next[sentinel] is the LRU head,
    // prev[sentinel] the MRU tail. Links of blocks that are not free are stale and never read.
    prev: Vec<u32>,
    next: Vec<u32>,
    num_free: usize,
    num_used: usize,
    num_cached: usize,
}

impl BlockAllocator {
    /// `num_blocks` blocks of `block_size` token slots each, all free, in id order.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be > 0");
        assert!(num_blocks < u32::MAX as usize, "too many blocks");
        let n = num_blocks as u32;
        // A ring through the sentinel: n -> 0 -> 1 -> ... -> n-1 -> n.
        let next = (0..=n).map(|i| if i == n { 0 } else { i + 1 }).collect();
        let prev = (0..=n).map(|i| if i == 0 { n } else { i - 1 }).collect();
        Self {
            block_size,
            refs: vec![0; num_blocks],
            cached: vec![false; num_blocks],
            prev,
            next,
            num_free: num_blocks,
            num_used: 0,
            num_cached: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    pub fn num_used(&self) -> usize {
        self.num_used
    }

    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    pub fn usage(&self) -> BlockUsage {
        BlockUsage {
            total: self.num_blocks(),
            free: self.num_free,
            used: self.num_used,
            cached: self.num_cached,
        }
    }

    /// Take the least recently freed block, with ref count 1.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.next[self.sentinel()];
        if b as usize == self.sentinel() {
            return None;
        }
        self.unlink(b);
        self.num_free -= 1;
        self.num_used += 1;
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// One more holder. Reviving a cached (or even a free) block is allowed: that is how a
    /// prefix-cache hit takes its blocks back.
    pub fn incref(&mut self, b: BlockId) {
        let i = b as usize;
        if self.refs[i] == 0 {
            if self.cached[i] {
                self.num_cached -= 1;
            } else {
                self.unlink(b);
                self.num_free -= 1;
            }
            self.num_used += 1;
        }
        self.refs[i] += 1;
    }

    /// One holder fewer. At zero the block stays cached if the radix cache holds it, else it is freed.
    pub fn decref(&mut self, b: BlockId) {
        let i = b as usize;
        assert!(self.refs[i] > 0, "decref of unreferenced block {b}");
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            self.num_used -= 1;
            if self.cached[i] {
                self.num_cached += 1;
            } else {
                self.push_mru(b);
                self.num_free += 1;
            }
        }
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.refs[b as usize]
    }

    /// A new holder (a forked sequence) shares all of `blocks`.
    pub fn fork(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.incref(b);
        }
    }

    /// Drop one holder's refs. Reverse order: the tail blocks, least likely to be shared by a
    /// future prefix, land on the free list first and so are reused first.
    pub fn free_all(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            self.decref(b);
        }
    }

    /// Move a free block to the MRU end of the free list. No-op for blocks that are not free.
    pub fn touch(&mut self, b: BlockId) {
        if self.is_free(b) {
            self.unlink(b);
            self.push_mru(b);
        }
    }

    /// Make token position `num_tokens` writable for a sequence owning `blocks`.
    ///
    /// A position that starts a new block gets a fresh block pushed. A position inside a block
    /// that someone else can see (ref > 1, or held by the radix cache) is copy-on-write: a new
    /// block replaces it and `Some((src, dst))` tells the caller to copy the KV data.
    pub fn append_slot(
        &mut self,
        blocks: &mut Vec<BlockId>,
        num_tokens: usize,
    ) -> Result<Option<(BlockId, BlockId)>, OutOfBlocks> {
        let idx = num_tokens / self.block_size;
        if idx >= blocks.len() {
            debug_assert_eq!(idx, blocks.len(), "append_slot skipped a block");
            blocks.push(self.allocate().ok_or(OutOfBlocks)?);
            return Ok(None);
        }
        let src = blocks[idx];
        if self.refs[src as usize] <= 1 && !self.cached[src as usize] {
            return Ok(None);
        }
        let dst = self.allocate().ok_or(OutOfBlocks)?;
        blocks[idx] = dst;
        self.decref(src);
        Ok(Some((src, dst)))
    }

    /// The radix cache marks blocks it holds (`true`) and stops holding them (`false`).
    pub fn set_cached(&mut self, b: BlockId, cached: bool) {
        let i = b as usize;
        if self.cached[i] == cached {
            return;
        }
        if self.refs[i] == 0 {
            if cached {
                self.unlink(b);
                self.num_free -= 1;
                self.num_cached += 1;
            } else {
                self.num_cached -= 1;
                self.push_mru(b);
                self.num_free += 1;
            }
        }
        self.cached[i] = cached;
    }

    pub fn is_cached(&self, b: BlockId) -> bool {
        self.cached[b as usize]
    }

    /// The radix cache evicted `b`: free it now, or when its last holder lets go.
    pub fn release_cached(&mut self, b: BlockId) {
        self.set_cached(b, false);
    }

    /// True if `b` is on the free list.
    pub fn is_free(&self, b: BlockId) -> bool {
        self.refs[b as usize] == 0 && !self.cached[b as usize]
    }

    /// Free blocks from LRU to MRU (the order `allocate` hands them out).
    pub fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        let s = self.sentinel() as u32;
        let mut b = self.next[s as usize];
        std::iter::from_fn(move || {
            if b == s {
                return None;
            }
            let cur = b;
            b = self.next[b as usize];
            Some(cur)
        })
    }

    /// Panic if the counters, flags and free list disagree. O(n); for tests.
    pub fn check_invariants(&self) {
        let n = self.num_blocks();
        assert_eq!(self.num_free + self.num_used + self.num_cached, n);
        let mut on_list = vec![false; n];
        let mut count = 0;
        let mut prev = self.sentinel() as u32;
        for b in self.free_blocks() {
            assert!(!on_list[b as usize], "block {b} twice on the free list");
            assert_eq!(self.prev[b as usize], prev, "broken prev link at {b}");
            on_list[b as usize] = true;
            prev = b;
            count += 1;
            assert!(count <= n, "free list cycle");
        }
        assert_eq!(self.prev[self.sentinel()], prev, "broken tail link");
        assert_eq!(count, self.num_free);
        let (mut used, mut cached) = (0, 0);
        for (i, &listed) in on_list.iter().enumerate() {
            assert_eq!(
                listed,
                self.is_free(i as u32),
                "block {i}: free list vs state"
            );
            used += (self.refs[i] > 0) as usize;
            cached += (self.refs[i] == 0 && self.cached[i]) as usize;
        }
        assert_eq!(used, self.num_used);
        assert_eq!(cached, self.num_cached);
    }

    fn sentinel(&self) -> usize {
        self.refs.len()
    }

    fn unlink(&mut self, b: BlockId) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
    }

    fn push_mru(&mut self, b: BlockId) {
        let s = self.sentinel() as u32;
        let tail = self.prev[s as usize];
        self.next[tail as usize] = b;
        self.prev[b as usize] = tail;
        self.next[b as usize] = s;
        self.prev[s as usize] = b;
    }
}

#[cfg(test)]
#[path = "block_tests.rs"]
mod tests;
