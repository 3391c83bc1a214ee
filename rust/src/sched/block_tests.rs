//! Tests of the block allocator: ref counts, fork, copy-on-write, the cached LRU, a randomized invariant run.

use super::*;
use crate::test_rng::Rng;

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
    let mut rng = Rng(0x1234_5678);
    let mut a = BlockAllocator::new(N, BS);
    // Model: each holder is (blocks, tokens written); `cached` mirrors the radix flag.
    let mut seqs: Vec<(Vec<BlockId>, usize)> = Vec::new();
    let mut cached = [false; N];
    for step in 0..200_000 {
        match rng.index(10) {
            0..=3 if !seqs.is_empty() => {
                // Grow a sequence by one token.
                let i = rng.index(seqs.len());
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
                let i = rng.index(seqs.len());
                a.fork(&seqs[i].0);
                seqs.push(seqs[i].clone());
            }
            5..=6 if !seqs.is_empty() => {
                let (blocks, _) = seqs.swap_remove(rng.index(seqs.len()));
                a.free_all(&blocks);
            }
            7 => seqs.push((Vec::new(), 0)),
            8 => {
                let b = rng.index(N);
                cached[b] = rng.index(2) == 0;
                if cached[b] {
                    a.set_cached(b as BlockId, true);
                } else {
                    a.release_cached(b as BlockId);
                }
            }
            _ => a.touch(rng.index(N) as BlockId),
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
