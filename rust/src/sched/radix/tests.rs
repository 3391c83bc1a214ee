//! Tests of the radix prefix cache, with a randomized run against a reference model.

use super::*;
use crate::sched::block::BlockAllocator;
use crate::test_rng::Rng;

const BS: usize = 4;

/// A finished request's life: fresh blocks for `tokens`, insert, swap duplicates for the
/// canonical blocks, release. Returns the canonical blocks (now cached, ref 0).
fn cache(
    r: &mut RadixCache,
    a: &mut BlockAllocator,
    tokens: &[u32],
    ns: Option<&str>,
) -> Vec<BlockId> {
    cache_with(r, a, tokens, ns, 0)
}

/// `cache` for a request of priority `prio` (also used by the tier tests).
pub(super) fn cache_with(
    r: &mut RadixCache,
    a: &mut BlockAllocator,
    tokens: &[u32],
    ns: Option<&str>,
    prio: i64,
) -> Vec<BlockId> {
    let mut blocks = Vec::new();
    for t in 0..tokens.len() {
        a.append_slot(&mut blocks, t).unwrap();
    }
    let res = r.insert_with(a, tokens, &blocks, ns, prio, None);
    for (mine, &canon) in blocks.iter_mut().zip(&res.blocks) {
        if *mine != canon {
            a.incref(canon);
            a.decref(*mine);
            *mine = canon;
        }
    }
    a.free_all(&blocks);
    r.check_invariants(a);
    a.check_invariants();
    res.blocks
}

fn toks(first: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| first * 1000 + i).collect()
}

#[test]
fn match_leaves_one_token_to_compute() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(16, BS));
    let t = toks(1, 8);
    let blocks = cache(&mut r, &mut a, &t, None);
    assert_eq!(blocks.len(), 2);
    assert_eq!(r.match_prefix(&t, None, true).blocks, blocks[..1]);
    assert_eq!(r.match_prefix(&toks(1, 9), None, true).blocks, blocks);
    assert_eq!(
        r.match_prefix(&t[..4], None, true).blocks,
        Vec::<u32>::new()
    );
    assert_eq!(r.match_prefix(&[], None, true).node, RadixCache::ROOT);
    assert_eq!((r.queries(), r.hits()), (8 + 9 + 4, 4 + 8));
    r.match_prefix(&t, None, false);
    assert_eq!(r.queries(), 21);
    r.check_invariants(&a);
}

#[test]
fn match_splits_an_edge_and_returns_the_split_node() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(16, BS));
    let t = toks(1, 16);
    let blocks = cache(&mut r, &mut a, &t, None);
    let mut q = t[..9].to_vec();
    q.extend([7, 7, 7, 7, 7]);
    let m = r.match_prefix(&q, None, true);
    assert_eq!(m.blocks, blocks[..2]);
    assert_eq!(r.path(m.node), (t[..8].to_vec(), blocks[..2].to_vec()));
    assert_eq!(r.num_nodes(), 3);
    // Locking the split node pins its two blocks; the tail is still evictable.
    r.lock(m.node);
    assert_eq!(r.num_evictable_blocks(), 2);
    assert_eq!(r.evict(&mut a, 10), 2);
    assert_eq!(r.match_prefix(&t, None, true).blocks, blocks[..2]);
    r.unlock(m.node);
    r.check_invariants(&a);
}

#[test]
fn namespaces_never_share() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(16, BS));
    let t = toks(1, 9);
    let a_blocks = cache(&mut r, &mut a, &t, Some("tenant-a"));
    assert!(r.match_prefix(&t, None, true).blocks.is_empty());
    assert!(r.match_prefix(&t, Some("tenant-b"), true).blocks.is_empty());
    assert_eq!(r.match_prefix(&t, Some("tenant-a"), true).blocks, a_blocks);
    // The same tokens in another namespace get their own blocks.
    let d_blocks = cache(&mut r, &mut a, &t, None);
    assert!(d_blocks.iter().all(|b| !a_blocks.contains(b)));
    assert_eq!(r.num_cached_blocks(), 4);
    assert_eq!(r.match_prefix(&t, None, true).blocks, d_blocks);
}

#[test]
fn duplicate_insert_returns_the_canonical_blocks() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(16, BS));
    let t = toks(1, 12);
    let first = cache(&mut r, &mut a, &t[..8], None);
    let mut mine = Vec::new();
    for i in 0..t.len() {
        a.append_slot(&mut mine, i).unwrap();
    }
    let res = r.insert(&mut a, &t, &mine, None);
    assert_eq!(res.num_cached_tokens, 8);
    assert_eq!(res.blocks[..2], first);
    assert_eq!(res.blocks[2], mine[2]);
    assert_eq!(r.path(res.node).1, res.blocks);
    // Swap the duplicates: they go back to the free list, not into the cache.
    let dups = mine[..2].to_vec();
    for (m, &c) in mine.iter_mut().zip(&res.blocks) {
        if *m != c {
            a.incref(c);
            a.decref(*m);
            *m = c;
        }
    }
    assert!(dups.iter().all(|&b| a.is_free(b)));
    assert_eq!(r.num_cached_blocks(), 3);
    a.free_all(&mine);
    assert_eq!(a.usage().cached, 3);
    r.check_invariants(&a);
    a.check_invariants();
}

#[test]
fn eviction_takes_the_least_recently_used_leaf_tail_first() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(16, BS));
    let x = cache(&mut r, &mut a, &toks(1, 8), None);
    let y = cache(&mut r, &mut a, &toks(2, 8), None);
    let z = cache(&mut r, &mut a, &toks(3, 8), None);
    r.match_prefix(&toks(1, 9), None, true); // x is now the most recent
    assert_eq!(r.evict(&mut a, 1), 1);
    assert!(a.is_free(y[1]) && a.is_cached(y[0]));
    assert_eq!(r.evict(&mut a, 2), 2);
    assert!(a.is_free(y[0]) && a.is_free(z[1]) && a.is_cached(z[0]));
    assert_eq!(r.evict(&mut a, 10), 3);
    assert!(x.iter().chain(&z).all(|&b| a.is_free(b)));
    assert_eq!((r.num_cached_blocks(), r.num_nodes()), (0, 1));
    r.check_invariants(&a);
    a.check_invariants();
}

#[test]
fn locked_and_held_blocks_are_never_evicted() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(16, BS));
    let t = toks(1, 8);
    let blocks = cache(&mut r, &mut a, &t, None);
    let m = r.match_prefix(&toks(1, 9), None, true);
    r.lock(m.node);
    a.fork(&m.blocks);
    assert_eq!(r.num_evictable_blocks(), 0);
    assert_eq!(r.evict(&mut a, 10), 0);
    // Unlocked but still referenced: skipped, and kept for later.
    r.unlock(m.node);
    assert_eq!(r.num_evictable_blocks(), 2);
    assert_eq!(r.evict(&mut a, 10), 0);
    r.check_invariants(&a);
    a.free_all(&m.blocks);
    assert_eq!(r.evict(&mut a, 10), 2);
    assert!(blocks.iter().all(|&b| a.is_free(b)));
    r.check_invariants(&a);
}

#[test]
fn a_parent_left_childless_becomes_evictable() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(16, BS));
    let mut p = toks(1, 8);
    p.extend(toks(2, 4));
    let mut q = toks(1, 8);
    q.extend(toks(3, 4));
    let pb = cache(&mut r, &mut a, &p, None);
    let qb = cache(&mut r, &mut a, &q, None);
    assert_eq!(pb[..2], qb[..2]); // shared prefix, split into a parent with two leaves
    assert_eq!(r.num_nodes(), 4);
    r.match_prefix(&[&q[..], &[0]].concat(), None, true);
    assert_eq!(r.evict(&mut a, 1), 1);
    assert!(a.is_free(pb[2]));
    // The shared parent still has a child: the q leaf goes next, then the parent.
    assert_eq!(r.evict(&mut a, 2), 2);
    assert!(a.is_free(qb[2]) && a.is_free(qb[1]) && a.is_cached(qb[0]));
    assert_eq!(r.evict(&mut a, 5), 1);
    assert_eq!(r.num_nodes(), 1);
    r.check_invariants(&a);
}

#[test]
fn reset_drops_everything_unlocked() {
    let (mut r, mut a) = (RadixCache::new(BS), BlockAllocator::new(32, BS));
    cache(&mut r, &mut a, &toks(1, 16), None);
    cache(&mut r, &mut a, &toks(2, 16), Some("ns"));
    let m = r.match_prefix(&toks(1, 5), None, true);
    r.lock(m.node);
    assert!(!r.reset(&mut a));
    assert_eq!(r.num_cached_blocks(), 1);
    r.check_invariants(&a);
    r.unlock(m.node);
    assert!(r.reset(&mut a));
    assert_eq!(a.num_free(), 32);
    assert_eq!(r.num_nodes(), 1);
    r.check_invariants(&a);
    // Still usable afterwards.
    cache(&mut r, &mut a, &toks(2, 16), Some("ns"));
    assert_eq!(
        r.match_prefix(&toks(2, 16), Some("ns"), true).blocks.len(),
        3
    );
}

struct Req {
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
    node: NodeId,
    ns: Option<&'static str>,
}

/// Random requests against a small pool: prefix hits, decoding, forks (copy-on-write),
/// inserts, releases, eviction under pressure and resets, checked against a model of
/// holders and of the tokens written into every block.
#[test]
fn randomized_invariants() {
    const N: usize = 96;
    const NS: [Option<&str>; 3] = [None, Some("a"), Some("b")];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut a = BlockAllocator::new(N, BS);
    let mut r = RadixCache::new(BS);
    let mut reqs: Vec<Req> = Vec::new();
    let mut written: Vec<Vec<u32>> = vec![Vec::new(); N];
    let mut block_ns: Vec<Option<&str>> = vec![None; N];
    // How often each path ran: CoW copies, evictions under pressure, duplicate swaps,
    // prefix hits, resets that kept locked nodes, resets that emptied the tree, match splits.
    let mut seen = [0usize; 7];

    // Make token `t` of `req` writable and write it, evicting on demand. False if out of blocks.
    fn write(
        a: &mut BlockAllocator,
        r: &mut RadixCache,
        written: &mut [Vec<u32>],
        seen: &mut [usize; 7],
        req: &mut Req,
        t: usize,
        tok: u32,
    ) -> bool {
        let cow = loop {
            match a.append_slot(&mut req.blocks, t) {
                Ok(cow) => break cow,
                Err(_) if r.evict(a, 1) == 1 => seen[1] += 1,
                Err(_) => return false,
            }
        };
        let b = req.blocks[t / BS] as usize;
        if t.is_multiple_of(BS) {
            written[b].clear();
        } else if let Some((src, _)) = cow {
            seen[0] += 1;
            written[b] = written[src as usize][..t % BS].to_vec();
        }
        assert_eq!(written[b].len(), t % BS, "block {b} has a gap");
        written[b].push(tok);
        true
    }

    fn release(a: &mut BlockAllocator, r: &mut RadixCache, req: Req) {
        r.unlock(req.node);
        a.free_all(&req.blocks);
    }

    for step in 0..100_000 {
        match rng.index(16) {
            // A new request: prefix hit, then prefill the rest.
            0..=3 if reqs.len() < 12 => {
                let len = 1 + rng.index(40);
                let fam = rng.index(4) as u32;
                let shared = rng.index(len + 1);
                let tokens: Vec<u32> = (0..len)
                    .map(|i| {
                        if i < shared {
                            (fam * 7 + i as u32) % 5
                        } else {
                            rng.index(3) as u32
                        }
                    })
                    .collect();
                let ns = NS[rng.index(3)];
                let nodes = r.num_nodes();
                let m = r.match_prefix(&tokens, ns, true);
                seen[6] += (r.num_nodes() > nodes) as usize;
                assert!(m.blocks.len() <= (len - 1) / BS);
                assert_eq!(r.path(m.node).1, m.blocks);
                for (i, &b) in m.blocks.iter().enumerate() {
                    assert_eq!(
                        written[b as usize],
                        tokens[i * BS..(i + 1) * BS],
                        "step {step}"
                    );
                    assert_eq!(block_ns[b as usize], ns, "namespace leak");
                }
                a.fork(&m.blocks);
                r.lock(m.node);
                let mut req = Req {
                    tokens: Vec::new(),
                    blocks: m.blocks,
                    node: m.node,
                    ns,
                };
                req.tokens
                    .extend_from_slice(&tokens[..req.blocks.len() * BS]);
                let mut ok = true;
                for (t, &tok) in tokens.iter().enumerate().skip(req.tokens.len()) {
                    if !write(&mut a, &mut r, &mut written, &mut seen, &mut req, t, tok) {
                        ok = false;
                        break;
                    }
                    req.tokens.push(tok);
                }
                if ok {
                    reqs.push(req);
                } else {
                    release(&mut a, &mut r, req);
                }
            }
            // Decode one token.
            4..=7 if !reqs.is_empty() => {
                let i = rng.index(reqs.len());
                let (t, tok) = (reqs[i].tokens.len(), rng.index(3) as u32);
                if write(
                    &mut a,
                    &mut r,
                    &mut written,
                    &mut seen,
                    &mut reqs[i],
                    t,
                    tok,
                ) {
                    reqs[i].tokens.push(tok);
                }
            }
            // Cache a request's full blocks and adopt the canonical ones.
            8..=9 if !reqs.is_empty() => {
                let i = rng.index(reqs.len());
                let req = &mut reqs[i];
                let full = req.tokens.len() / BS;
                let res = r.insert(&mut a, &req.tokens, &req.blocks, req.ns);
                assert_eq!(res.blocks.len(), full);
                assert_eq!(res.num_cached_tokens % BS, 0);
                for i in 0..full {
                    let (mine, canon) = (req.blocks[i], res.blocks[i]);
                    assert_eq!(written[canon as usize], req.tokens[i * BS..(i + 1) * BS]);
                    if i >= res.num_cached_tokens / BS {
                        assert_eq!(mine, canon, "new positions keep the caller's block");
                        block_ns[mine as usize] = req.ns;
                    } else if mine != canon {
                        seen[2] += 1;
                        a.incref(canon);
                        a.decref(mine);
                        req.blocks[i] = canon;
                    }
                }
                r.lock(res.node);
                r.unlock(req.node);
                req.node = res.node;
            }
            // Fork: the copies share every block until one writes into a shared one.
            10 if !reqs.is_empty() && reqs.len() < 12 => {
                let src = &reqs[rng.index(reqs.len())];
                let copy = Req {
                    tokens: src.tokens.clone(),
                    blocks: src.blocks.clone(),
                    node: src.node,
                    ns: src.ns,
                };
                a.fork(&copy.blocks);
                r.lock(copy.node);
                reqs.push(copy);
            }
            11..=12 if !reqs.is_empty() => {
                let req = reqs.swap_remove(rng.index(reqs.len()));
                release(&mut a, &mut r, req);
            }
            13 => {
                let (n, cached, free) = (rng.index(8), r.num_cached_blocks(), a.num_free());
                let freed = r.evict(&mut a, n);
                assert!(freed <= n);
                assert_eq!(r.num_cached_blocks(), cached - freed);
                assert_eq!(a.num_free(), free + freed);
            }
            14 if rng.index(64) == 0 => {
                if rng.index(4) == 0 {
                    for req in reqs.drain(..) {
                        release(&mut a, &mut r, req);
                    }
                }
                let empty = r.reset(&mut a);
                seen[4 + empty as usize] += 1;
                assert_eq!(empty, reqs.iter().all(|q| q.node == RadixCache::ROOT));
            }
            _ => {}
        }

        // Ref counts are exactly the holders; the locked path is the request's prefix.
        let mut holders = [0u32; N];
        for q in &reqs {
            assert_eq!(q.blocks.len(), q.tokens.len().div_ceil(BS));
            let (path_tokens, path_blocks) = r.path(q.node);
            assert_eq!(path_blocks, q.blocks[..path_blocks.len()]);
            assert_eq!(path_tokens, q.tokens[..path_tokens.len()]);
            assert!(r.lock_ref(q.node) > 0 || q.node == RadixCache::ROOT);
            for (i, &b) in q.blocks.iter().enumerate() {
                holders[b as usize] += 1;
                let end = q.tokens.len().min((i + 1) * BS);
                assert_eq!(written[b as usize], q.tokens[i * BS..end], "step {step}");
            }
        }
        for (b, &h) in holders.iter().enumerate() {
            assert_eq!(a.ref_count(b as BlockId), h, "step {step}: block {b}");
        }
        let u = a.usage();
        assert_eq!(u.free + u.used + u.cached, N);
        a.check_invariants();
        r.check_invariants(&a);
        if step % 8 == 0 {
            for (_, tokens, blocks) in r.edges() {
                for (i, &b) in blocks.iter().enumerate() {
                    assert_eq!(
                        written[b as usize],
                        tokens[i * BS..(i + 1) * BS],
                        "step {step}"
                    );
                }
            }
        }
    }

    seen[3] = r.hits() as usize;
    assert!(seen.iter().all(|&n| n > 0), "a path never ran: {seen:?}");
    for req in reqs.drain(..) {
        release(&mut a, &mut r, req);
    }
    assert!(r.reset(&mut a));
    assert_eq!(a.num_free(), N);
    assert_eq!(r.num_nodes(), 1);
    a.check_invariants();
    r.check_invariants(&a);
}
