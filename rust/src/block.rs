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
mod tests {
    use super::*;

    /// xorshift64*: seeded, dependency-free randomness for the invariant tests.
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Self {
            Self(seed.max(1))
        }
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    fn drain(a: &mut BlockAllocator) -> Vec<BlockId> {
        std::iter::from_fn(|| a.allocate()).collect()
    }

    #[test]
    fn allocates_in_order_then_runs_out() {
        let mut a = BlockAllocator::new(3, 16);
        assert_eq!(drain(&mut a), vec![0, 1, 2]);
        assert_eq!(a.allocate(), None);
        assert_eq!(
            a.usage(),
            BlockUsage {
                total: 3,
                free: 0,
                used: 3,
                cached: 0
            }
        );
        a.check_invariants();
    }

    #[test]
    fn freed_blocks_are_reused_lru_first() {
        let mut a = BlockAllocator::new(4, 16);
        let all = drain(&mut a);
        a.decref(2);
        a.decref(0);
        a.decref(3);
        assert_eq!(a.free_blocks().collect::<Vec<_>>(), vec![2, 0, 3]);
        assert_eq!(a.allocate(), Some(2));
        a.decref(2);
        assert_eq!(drain(&mut a), vec![0, 3, 2]);
        assert_eq!(all.len(), 4);
        a.check_invariants();
    }

    #[test]
    fn free_all_releases_tail_first() {
        let mut a = BlockAllocator::new(4, 16);
        let seq = drain(&mut a);
        a.free_all(&seq);
        assert_eq!(a.free_blocks().collect::<Vec<_>>(), vec![3, 2, 1, 0]);
        assert_eq!(a.num_free(), 4);
        a.check_invariants();
    }

    #[test]
    fn touch_moves_a_free_block_to_mru() {
        let mut a = BlockAllocator::new(4, 16);
        a.touch(0);
        assert_eq!(a.free_blocks().collect::<Vec<_>>(), vec![1, 2, 3, 0]);
        a.touch(2);
        a.touch(0); // already MRU
        assert_eq!(a.free_blocks().collect::<Vec<_>>(), vec![1, 3, 2, 0]);
        let b = a.allocate().unwrap();
        a.touch(b); // used: no-op
        assert_eq!(a.ref_count(b), 1);
        a.check_invariants();
    }

    #[test]
    fn fork_then_append_copies_on_write() {
        let mut a = BlockAllocator::new(8, 4);
        let mut seq = Vec::new();
        for t in 0..6 {
            assert_eq!(a.append_slot(&mut seq, t), Ok(None));
        }
        assert_eq!(seq, vec![0, 1]);
        a.fork(&seq);
        let mut child = seq.clone();
        assert_eq!((a.ref_count(0), a.ref_count(1)), (2, 2));
        // Token 6 goes into the shared, half-full block 1: the writer gets its own copy.
        assert_eq!(a.append_slot(&mut child, 6), Ok(Some((1, 2))));
        assert_eq!(child, vec![0, 2]);
        assert_eq!((a.ref_count(1), a.ref_count(2)), (1, 1));
        // The other holder now owns block 1 alone: no copy.
        assert_eq!(a.append_slot(&mut seq, 6), Ok(None));
        // A new block never copies, even with a shared prefix.
        assert_eq!(a.append_slot(&mut child, 8), Ok(None));
        assert_eq!(child, vec![0, 2, 3]);
        a.free_all(&seq);
        a.free_all(&child);
        assert_eq!(a.num_free(), 8);
        a.check_invariants();
    }

    #[test]
    fn append_slot_out_of_blocks_changes_nothing() {
        let mut a = BlockAllocator::new(2, 4);
        let mut seq = Vec::new();
        a.append_slot(&mut seq, 0).unwrap();
        a.append_slot(&mut seq, 4).unwrap();
        let before = (seq.clone(), a.usage());
        assert_eq!(a.append_slot(&mut seq, 8), Err(OutOfBlocks));
        a.fork(&seq);
        let usage = a.usage();
        assert_eq!(a.append_slot(&mut seq, 5), Err(OutOfBlocks)); // CoW needs a block too
        assert_eq!((seq.clone(), a.usage()), (before.0, usage));
        assert_eq!(a.ref_count(1), 2);
        a.check_invariants();
    }

    #[test]
    fn cached_blocks_are_neither_free_nor_used() {
        let mut a = BlockAllocator::new(4, 16);
        let b = a.allocate().unwrap();
        a.set_cached(b, true);
        assert_eq!(
            a.usage(),
            BlockUsage {
                total: 4,
                free: 3,
                used: 1,
                cached: 0
            }
        );
        a.decref(b);
        assert_eq!(
            a.usage(),
            BlockUsage {
                total: 4,
                free: 3,
                used: 0,
                cached: 1
            }
        );
        assert!(!a.free_blocks().any(|x| x == b));
        a.incref(b); // a prefix hit revives it
        assert_eq!(
            a.usage(),
            BlockUsage {
                total: 4,
                free: 3,
                used: 1,
                cached: 0
            }
        );
        a.release_cached(b); // evicted while in use: freed on the last decref
        assert_eq!(a.num_used(), 1);
        a.decref(b);
        assert_eq!(
            a.usage(),
            BlockUsage {
                total: 4,
                free: 4,
                used: 0,
                cached: 0
            }
        );
        // Marking and releasing a free block keeps the counts right too.
        a.set_cached(2, true);
        assert_eq!(a.num_cached(), 1);
        a.release_cached(2);
        assert_eq!(a.num_free(), 4);
        a.check_invariants();
    }

    #[test]
    fn appending_into_a_cached_block_copies() {
        let mut a = BlockAllocator::new(4, 4);
        let mut seq = vec![a.allocate().unwrap()];
        a.set_cached(seq[0], true);
        assert_eq!(a.append_slot(&mut seq, 3), Ok(Some((0, 1))));
        assert_eq!(
            a.usage(),
            BlockUsage {
                total: 4,
                free: 2,
                used: 1,
                cached: 1
            }
        );
        a.check_invariants();
    }

    #[test]
    fn randomized_holders_match_ref_counts() {
        const N: usize = 48;
        const BS: usize = 4;
        let mut rng = Rng::new(0x1234_5678);
        let mut a = BlockAllocator::new(N, BS);
        // Model: each holder is (blocks, tokens written); `cached` mirrors the radix flag.
        let mut seqs: Vec<(Vec<BlockId>, usize)> = Vec::new();
        let mut cached = [false; N];
        for step in 0..200_000 {
            match rng.below(10) {
                0..=3 if !seqs.is_empty() => {
                    // Grow a sequence by one token.
                    let i = rng.below(seqs.len());
                    let (blocks, len) = &mut seqs[i];
                    let before = blocks.clone();
                    let free = a.num_free();
                    match a.append_slot(blocks, *len) {
                        Ok(cow) => {
                            if let Some((src, dst)) = cow {
                                assert_eq!(before[*len / BS], src);
                                assert_eq!(blocks[*len / BS], dst);
                            }
                            *len += 1;
                        }
                        Err(OutOfBlocks) => {
                            assert_eq!(free, 0);
                            assert_eq!(*blocks, before);
                        }
                    }
                }
                4 if !seqs.is_empty() => {
                    let i = rng.below(seqs.len());
                    a.fork(&seqs[i].0);
                    seqs.push(seqs[i].clone());
                }
                5..=6 if !seqs.is_empty() => {
                    let (blocks, _) = seqs.swap_remove(rng.below(seqs.len()));
                    a.free_all(&blocks);
                }
                7 => seqs.push((Vec::new(), 0)),
                8 => {
                    let b = rng.below(N);
                    cached[b] = rng.below(2) == 0;
                    if cached[b] {
                        a.set_cached(b as BlockId, true);
                    } else {
                        a.release_cached(b as BlockId);
                    }
                }
                _ => a.touch(rng.below(N) as BlockId),
            }
            let mut holders = [0u32; N];
            for (blocks, len) in &seqs {
                assert_eq!(blocks.len(), len.div_ceil(BS));
                for &b in blocks {
                    holders[b as usize] += 1;
                }
            }
            let (mut used, mut in_cache) = (0, 0);
            for b in 0..N {
                assert_eq!(
                    a.ref_count(b as BlockId),
                    holders[b],
                    "step {step} block {b}"
                );
                assert_eq!(a.is_cached(b as BlockId), cached[b]);
                used += (holders[b] > 0) as usize;
                in_cache += (holders[b] == 0 && cached[b]) as usize;
            }
            assert_eq!((a.num_used(), a.num_cached()), (used, in_cache));
            assert_eq!(a.num_free() + used + in_cache, N);
            if step % 64 == 0 {
                a.check_invariants();
            }
        }
        for (blocks, _) in seqs.drain(..) {
            a.free_all(&blocks);
        }
        for b in 0..N {
            a.release_cached(b as BlockId);
        }
        assert_eq!(a.num_free(), N);
        a.check_invariants();
    }
}
