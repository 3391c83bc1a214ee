//! Tests of the tiered radix cache: demote, promote, restore, invalidate, priority order, and a
//! randomized run that checks the data itself: a fake KV store follows the queued copies, and
//! every cached block, on either tier, must hold the KV of exactly the prefix the tree says.

use super::*;
use crate::sched::block::BlockAllocator;
use crate::test_rng::Rng;

const BS: usize = 4;

fn toks(first: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| first * 1000 + i).collect()
}

/// Fresh blocks for `tokens`, cached by a request of priority `prio`, then released (ref 0).
fn cache(r: &mut RadixCache, a: &mut BlockAllocator, tokens: &[u32], prio: i64) -> Vec<BlockId> {
    super::tests::cache_with(r, a, tokens, None, prio)
}

fn pairs(flat: &[i64]) -> Vec<(u32, u32)> {
    flat.chunks_exact(2)
        .map(|p| (p[0] as u32, p[1] as u32))
        .collect()
}

#[test]
fn eviction_demotes_and_a_hit_promotes_back() {
    let (mut r, mut a) = (RadixCache::new_tiered(BS, 8), BlockAllocator::new(6, BS));
    let t = toks(1, 16);
    let blocks = cache(&mut r, &mut a, &t, 0);
    assert_eq!(r.evict(&mut a, 3), 3);
    r.check_invariants(&a);
    let st = r.tier_stats();
    assert_eq!((st.used, st.demotions, st.capacity), (3, 3, 8));
    let demoted = pairs(&r.take_copies().demote);
    // Tail first: the deepest blocks left the device.
    assert_eq!(
        demoted.iter().map(|p| p.0).collect::<Vec<_>>(),
        [blocks[3], blocks[2], blocks[1]]
    );
    // Device-only matching stops at the tier; tiered matching follows it.
    assert_eq!(
        r.match_prefix(&toks(1, 17), None, false).blocks,
        blocks[..1]
    );
    r.begin_step();
    let m = r.match_tiered(&toks(1, 17), None, true, 0, true);
    assert_eq!((m.blocks.len(), m.host), (4, 3));
    r.lock(m.node);
    let promoted = r.promote(&mut a, m.node);
    r.check_invariants(&a);
    assert_eq!(promoted[0], blocks[0]);
    let back = pairs(&r.take_copies().promote);
    assert_eq!(back.len(), 3);
    // Each promoted block comes from the slot its own position was demoted to.
    for (k, &(slot, dev)) in back.iter().enumerate() {
        assert_eq!(promoted[1 + k], dev);
        assert_eq!(demoted[2 - k].1, slot);
    }
    assert_eq!(r.tier_stats().used, 0);
    assert_eq!(r.tier_stats().hits, 12);
    r.unlock(m.node);
    r.check_invariants(&a);
}

#[test]
fn a_full_tier_drops_its_coldest_blocks() {
    let (mut r, mut a) = (RadixCache::new_tiered(BS, 2), BlockAllocator::new(8, BS));
    cache(&mut r, &mut a, &toks(1, 8), 0);
    cache(&mut r, &mut a, &toks(2, 8), 0);
    assert_eq!(r.evict(&mut a, 2), 2);
    assert_eq!(r.tier_stats().used, 2);
    // Within the step the slots just written are not reused: the next eviction drops.
    assert_eq!(r.evict(&mut a, 1), 1);
    assert_eq!(r.tier_stats().used, 2);
    r.take_copies();
    r.begin_step();
    // A step later the coldest tier blocks make room.
    assert_eq!(r.evict(&mut a, 1), 1);
    r.check_invariants(&a);
    assert_eq!(r.tier_stats().used, 2);
    r.begin_step();
    assert_eq!(r.match_tiered(&toks(1, 9), None, false, 0, true).host, 1);
    assert_eq!(r.match_tiered(&toks(2, 5), None, false, 0, true).host, 1);
    r.check_invariants(&a);
}

#[test]
fn without_room_in_the_tier_eviction_drops() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(8, BS));
    cache(&mut r, &mut a, &toks(1, 8), 0);
    assert_eq!(r.evict(&mut a, 2), 2);
    assert!(r.take_copies().is_empty());
    assert_eq!(r.num_nodes(), 1);
    r.check_invariants(&a);
}

#[test]
fn a_fresh_copy_replaces_the_tier_copy() {
    let (mut r, mut a) = (RadixCache::new_tiered(BS, 8), BlockAllocator::new(8, BS));
    let t = toks(1, 12);
    cache(&mut r, &mut a, &t, 0);
    r.evict(&mut a, 2);
    r.take_copies();
    r.begin_step();
    // A request that recomputed the prefix (no promotion) inserts its own blocks.
    let mut mine = Vec::new();
    for p in 0..12 {
        a.append_slot(&mut mine, p).unwrap();
    }
    let mut added = Vec::new();
    let res = r.insert_with(&mut a, &t, &mine, None, 0, Some(&mut added));
    assert_eq!(res.blocks[1..], mine[1..]);
    assert_eq!(added, mine[1..]);
    assert_eq!(r.tier_stats().used, 0);
    a.free_all(&mine);
    r.check_invariants(&a);
}

#[test]
fn lower_priority_blocks_are_evicted_first() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(8, BS));
    cache(&mut r, &mut a, &toks(1, 4), 0); // important, older
    cache(&mut r, &mut a, &toks(2, 4), 5); // less important, newer
    r.evict(&mut a, 1);
    assert_eq!(r.match_prefix(&toks(1, 5), None, false).blocks.len(), 1);
    assert_eq!(r.match_prefix(&toks(2, 5), None, false).blocks.len(), 0);
    r.check_invariants(&a);
}

#[test]
fn pinned_prefixes_survive_eviction_until_flushed() {
    let (mut r, mut a) = (RadixCache::new_tiered(BS, 8), BlockAllocator::new(8, BS));
    let sys = toks(1, 8);
    cache(&mut r, &mut a, &sys, 0);
    assert_eq!(r.pin(&sys, None), 8);
    assert_eq!(r.pin(&toks(9, 8), None), 0);
    assert_eq!(r.evict(&mut a, 8), 0);
    assert_eq!(r.tier_stats().pinned, 2);
    r.check_invariants(&a);
    let flushed = r.flush(&mut a);
    assert_eq!(flushed.demote.len(), 4);
    assert_eq!(r.num_cached_blocks(), 0);
    r.check_invariants(&a);
}

#[test]
fn flushed_entries_restore_into_a_new_cache() {
    let (mut r, mut a) = (RadixCache::new_tiered(BS, 16), BlockAllocator::new(16, BS));
    cache(&mut r, &mut a, &toks(1, 12), 0);
    let mut branch = toks(1, 8);
    branch.extend(toks(3, 8));
    cache(&mut r, &mut a, &branch, 0);
    let mut other = toks(2, 8);
    other.truncate(8);
    let res = {
        let mut blocks = Vec::new();
        for t in 0..8 {
            a.append_slot(&mut blocks, t).unwrap();
        }
        let res = r.insert_with(&mut a, &other, &blocks, Some("salt"), 0, None);
        a.free_all(&blocks);
        res
    };
    assert_eq!(res.blocks.len(), 2);
    r.flush(&mut a);
    let entries = r.tier_entries();
    assert_eq!(entries.len(), 3 + 2 + 2);
    // Parents come first.
    let mut seen = std::collections::HashSet::new();
    for (slot, parent, _, tokens) in &entries {
        assert!(*parent < 0 || seen.contains(&(*parent as u32)));
        assert_eq!(tokens.len(), BS);
        seen.insert(*slot);
    }
    let (mut r2, a2) = (RadixCache::new_tiered(BS, 16), BlockAllocator::new(16, BS));
    assert_eq!(r2.restore(&entries), 7);
    r2.check_invariants(&a2);
    assert_eq!(r2.match_tiered(&toks(1, 13), None, false, 0, true).host, 3);
    assert_eq!(r2.match_tiered(&branch, None, false, 0, true).host, 3);
    assert_eq!(
        r2.match_tiered(&toks(2, 9), Some("salt"), false, 0, true)
            .host,
        2
    );
    assert_eq!(r2.match_tiered(&toks(2, 9), None, false, 0, true).host, 0);
    // Dropping an entry drops what hangs below it.
    let root = entries
        .iter()
        .find(|e| e.1 < 0 && e.3 == toks(1, 4))
        .unwrap()
        .0;
    let without: Vec<_> = entries.iter().filter(|e| e.0 != root).cloned().collect();
    let mut r3 = RadixCache::new_tiered(BS, 16);
    assert_eq!(r3.restore(&without), 2);
    r3.check_invariants(&a2);
}

#[test]
fn invalidate_drops_a_block_and_everything_below_it() {
    let (mut r, mut a) = (RadixCache::new_tiered(BS, 16), BlockAllocator::new(16, BS));
    let blocks = cache(&mut r, &mut a, &toks(1, 16), 0);
    let mut branch = toks(1, 8);
    branch.extend(toks(3, 8));
    cache(&mut r, &mut a, &branch, 0);
    r.invalidate(&mut a, &[blocks[1]], &[]);
    r.check_invariants(&a);
    assert_eq!(r.num_cached_blocks(), 1);
    assert_eq!(r.match_prefix(&branch, None, false).blocks, blocks[..1]);
    // A tier slot too.
    cache(&mut r, &mut a, &toks(4, 8), 0);
    r.evict(&mut a, 1);
    let slot = pairs(&r.take_copies().demote)[0].1;
    r.invalidate(&mut a, &[], &[slot]);
    r.check_invariants(&a);
    assert_eq!(r.tier_stats().used, 0);
}

/// What a block holds in the fake KV store: the prefix it was computed for.
type Kv = Option<(Option<u32>, Vec<u32>)>;

#[test]
fn randomized_tiers_keep_every_cached_block_holding_its_prefix() {
    let (mut promoted, mut demoted) = (0, 0);
    for seed in 0..24u64 {
        let mut rng = Rng(seed);
        let (nblocks, nslots) = (6 + rng.index(10), rng.index(12));
        let mut r = RadixCache::new_tiered(BS, nslots);
        let mut a = BlockAllocator::new(nblocks, BS);
        let mut dev: Vec<Kv> = vec![None; nblocks];
        let mut tier: Vec<Kv> = vec![None; nslots];
        let prompts: Vec<Vec<u32>> = (0..6)
            .map(|i| {
                let mut p = toks(i % 3, 4 * (1 + rng.index(3)));
                p.extend(toks(10 + i, 4 * rng.index(3)));
                p
            })
            .collect();
        let nss = [None, Some("x")];
        for _step in 0..120 {
            // (blocks held, node locked) this step, and the forward's writes.
            let mut held: Vec<(Vec<BlockId>, NodeId)> = Vec::new();
            let mut writes: Vec<(BlockId, Kv)> = Vec::new();
            for _ in 0..1 + rng.index(3) {
                let p = &prompts[rng.index(prompts.len())];
                let ns = nss[rng.index(2)];
                let nsid = ns.map(|_| 1);
                let m = r.match_tiered(p, ns, true, rng.index(3) as i64, rng.chance(70));
                r.lock(m.node);
                let on_dev = m.blocks.len() - m.host;
                for &b in &m.blocks[..on_dev] {
                    a.incref(b);
                }
                let total = p.len().div_ceil(BS);
                let need = total - on_dev;
                if need > a.num_free() {
                    let short = need - a.num_free();
                    r.evict(&mut a, short);
                }
                if need > a.num_free() {
                    for &b in &m.blocks[..on_dev] {
                        a.decref(b);
                    }
                    r.unlock(m.node);
                    continue;
                }
                let mut blocks = if m.host > 0 {
                    let b = r.promote(&mut a, m.node);
                    for &x in &b[on_dev..] {
                        a.incref(x);
                    }
                    b
                } else {
                    m.blocks.clone()
                };
                let done = blocks.len();
                for pos in done * BS..p.len() {
                    a.append_slot(&mut blocks, pos).unwrap();
                }
                for (j, &b) in blocks.iter().enumerate().skip(done) {
                    let end = ((j + 1) * BS).min(p.len());
                    writes.push((b, Some((nsid, p[..end].to_vec()))));
                }
                // Same-step registration, as the scheduler does.
                let res = r.insert_with(&mut a, p, &blocks, ns, 0, None);
                r.lock(res.node);
                r.unlock(m.node);
                held.push((blocks, res.node));
                r.check_invariants(&a);
            }
            if rng.chance(20) {
                let want = rng.index(4);
                r.evict(&mut a, want);
            }
            if rng.chance(5) {
                r.reset(&mut a);
            }
            r.check_invariants(&a);
            // The caller runs the copies (demote, then promote), then the forward writes.
            let c = r.take_copies();
            for (b, s) in pairs(&c.demote) {
                tier[s as usize] = dev[b as usize].clone();
            }
            for (s, b) in pairs(&c.promote) {
                dev[b as usize] = tier[s as usize].clone();
            }
            for (b, kv) in writes {
                dev[b as usize] = kv;
            }
            for (blocks, node) in held {
                a.free_all(&blocks);
                r.unlock(node);
            }
            r.begin_step();
            r.check_invariants(&a);
            a.check_invariants();
            // Every cached block, on either tier, holds its own prefix.
            for (node, path, ids) in r.edges() {
                let n = &r.nodes[node as usize];
                let first = ids.len() - n.blocks.len();
                let nsid = (n.ns > 0).then_some(1);
                for (j, &id) in n.blocks.iter().enumerate() {
                    let pos = first + j;
                    let want = Some((nsid, path[..(pos + 1) * BS].to_vec()));
                    let got = if j < n.dev {
                        &dev[id as usize]
                    } else {
                        &tier[id as usize]
                    };
                    assert_eq!(got, &want, "seed {seed}: node {node} block {j}");
                }
            }
        }
        promoted += r.tier_stats().promotions;
        demoted += r.tier_stats().demotions;
    }
    assert!(promoted > 100 && demoted > 100, "{promoted} {demoted}");
}
