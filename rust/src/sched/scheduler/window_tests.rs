//! Sliding-window release: blocks wholly before every query's window go back to the pool while
//! their sequence runs, shared ones lose one ref, cached ones stay cached, and a randomized run
//! against a simulated KV cache proves no released block was still needed.

use std::collections::HashMap;

use crate::error::CoreError;
use crate::sched::plan::Plan;
use crate::sched::queue::Policy;
use crate::sched::scheduler::{Scheduler, SchedulerConfig, SchedulerOptions};
use crate::sched::sequence::{RequestParams, Slot, Status};
use crate::test_rng::Rng;

fn windowed(c: SchedulerConfig, window: usize) -> Scheduler {
    let opts = SchedulerOptions {
        sliding_window: Some(window),
        ..Default::default()
    };
    Scheduler::with_options(c, opts).unwrap()
}

fn cfg(num_blocks: usize, block_size: usize, chunk: usize, caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 4,
        max_num_batched_tokens: chunk,
        max_model_len: 4096,
        policy: Policy::Fcfs,
        enable_prefix_caching: caching,
        max_queue_len: None,
    }
}

fn params(max_tokens: usize) -> RequestParams {
    RequestParams {
        arrival_time: Some(0.0),
        ignore_eos: true,
        ..RequestParams::new(max_tokens)
    }
}

fn held(s: &Scheduler, slot: Slot) -> usize {
    let q = &s.seqs[slot as usize];
    q.blocks.len() - q.window_freed
}

fn step(s: &mut Scheduler, token: i64) -> Plan {
    let plan = s.schedule(Some(0.0)).clone();
    let sampled = vec![token; plan.num_samples()];
    s.update(&sampled).unwrap();
    s.check_invariants();
    s.radix.check_invariants(&s.alloc);
    plan
}

#[test]
fn a_sequence_longer_than_the_pool_runs_inside_its_window() {
    // Window 8, blocks of 4, chunks of 8: at most (8 + 8) / 4 + 1 = 5 blocks held at once.
    let mut s = windowed(cfg(5, 4, 8, false), 8);
    assert_eq!(s.window_block_cap(), Some(5));
    let prompt: Vec<u32> = (0..30).collect();
    let slot = s.add_request("a", &prompt, params(30)).unwrap()[0];
    let mut steps = 0;
    while s.has_unfinished() {
        let plan = s.schedule(Some(0.0)).clone();
        // Released before the forward: every block wholly before the first query's window.
        let dead = (plan.context_lens[0] as usize + 1).saturating_sub(8) / 4;
        assert_eq!(s.seqs[slot as usize].window_freed, dead);
        assert!(held(&s, slot) <= 5);
        let bt = s.block_tables();
        assert!(bt[..dead].iter().all(|&b| b == 0));
        s.update(&vec![7; plan.num_samples()]).unwrap();
        s.check_invariants();
        steps += 1;
        assert!(steps < 200);
    }
    assert_eq!(s.stats().num_preemptions, 0);
    // 59 tokens with KV = 15 blocks; the last query (position 58) still sees 51..=58, so
    // blocks 0..=11 (positions 0..=47) were released along the way.
    assert_eq!(s.stats().window_freed_blocks, 12);
    assert_eq!(s.alloc.num_free(), 5);
}

#[test]
fn block_tables_hold_zero_for_released_entries() {
    let mut s = windowed(cfg(16, 4, 64, false), 6);
    let slot = s
        .add_request("a", &(0..20).collect::<Vec<_>>(), params(4))
        .unwrap()[0];
    step(&mut s, 7); // prefill 20 tokens: nothing released before the forward
    assert_eq!(s.seqs[slot as usize].window_freed, 0);
    let plan = s.schedule(Some(0.0)).clone();
    // Query at 20 sees 15..20: blocks 0..3 (positions 0..11) are dead.
    assert_eq!(plan.context_lens, [20]);
    let bt = s.block_tables();
    assert_eq!(&bt[..3], [0, 0, 0]);
    let blocks = &s.seqs[slot as usize].blocks;
    assert_eq!(
        &bt[3..6],
        &blocks[3..6].iter().map(|&b| b as i32).collect::<Vec<_>>()[..]
    );
    assert_eq!(s.stats().window_freed_blocks, 3);
    assert_eq!(s.alloc.num_used(), 3);
    s.update(&[1]).unwrap();
    s.check_invariants();
}

#[test]
fn the_pool_check_counts_only_what_the_window_holds() {
    // Without prefix caching a sequence needs cap = (8 + 8) / 4 + 1 = 5 blocks.
    let mut s = windowed(cfg(4, 4, 8, false), 8);
    let err = s.add_request("a", &[1; 40], params(10)).unwrap_err();
    assert!(matches!(err, CoreError::RequestTooLarge(_)), "{err}");
    // A short one still needs only its own blocks.
    s.add_request("b", &[1; 10], params(3)).unwrap();
    // With prefix caching, a cached path may keep up to cap released blocks in the pool.
    let mut s = windowed(cfg(9, 4, 8, true), 8);
    assert!(s.add_request("a", &[1; 40], params(10)).is_err());
    let mut s = windowed(cfg(10, 4, 8, true), 8);
    s.add_request("a", &[1; 40], params(10)).unwrap();
    let mut n = 0;
    while s.has_unfinished() {
        step(&mut s, 3);
        n += 1;
        assert!(n < 100, "no progress");
    }
}

#[test]
fn cached_prompt_stays_cached_and_later_blocks_are_not_inserted() {
    // The 12-token prompt is prefilled at once and cached (3 blocks); decoding to 24 tokens
    // releases blocks 0..4 (window 8): the cached ones stay in the tree, the generated ones
    // are never inserted (their path would need the released blocks).
    let mut s = windowed(cfg(32, 4, 64, true), 8);
    let prompt: Vec<u32> = (100..112).collect();
    s.add_request("a", &prompt, params(12)).unwrap();
    while s.has_unfinished() {
        step(&mut s, 5);
    }
    assert!(s.stats().window_freed_blocks >= 3);
    assert_eq!(s.alloc.num_used(), 0);
    assert_eq!(s.alloc.num_cached(), 3);
    // The same prompt hits its cached blocks (all but the last token's block).
    s.add_request("b", &prompt, params(2)).unwrap();
    let plan = step(&mut s, 5);
    assert_eq!(plan.new_request_cached_tokens, [8]);
}

#[test]
fn forks_share_then_release_their_own_refs() {
    let mut s = windowed(cfg(40, 4, 64, false), 8);
    let p = RequestParams { n: 3, ..params(16) };
    let slots = s.add_request("a", &(0..18).collect::<Vec<_>>(), p).unwrap();
    let mut samples = 0;
    while s.has_unfinished() {
        let plan = s.schedule(Some(0.0)).clone();
        // Different tokens per sibling: their tails diverge (copy-on-write).
        let sampled: Vec<i64> = (0..plan.num_samples())
            .map(|r| plan.sample_slots[r] + samples)
            .collect();
        samples += 1;
        s.update(&sampled).unwrap();
        s.check_invariants();
        for &slot in &slots {
            if s.is_live(slot) {
                assert!(held(&s, slot) <= s.window_block_cap().unwrap());
            }
        }
    }
    assert!(s.stats().window_freed_blocks > 3 * 4);
    assert_eq!(s.alloc.num_used(), 0);
    assert_eq!(s.alloc.num_free(), 40);
}

use crate::sched::scheduler::harness::SimKv;

#[derive(Debug, Default)]
struct Seen {
    freed: u64,
    preemptions: u64,
    hits: u64,
    forks: usize,
    rollbacks: usize,
    longer_than_pool: usize,
}

/// Random requests, aborts, finishes, rollbacks and steps against a simulated KV cache: every
/// row must read the right KV at every position inside its window, every running sequence
/// holds at most `window_block_cap` blocks, and the bookkeeping stays exact.
fn random_run(seed: u64, caching: bool, ops: usize, seen: &mut Seen) {
    let mut rng = Rng(seed);
    let bs = [1, 2, 4, 8][rng.index(4)];
    let window = 1 + rng.index(24);
    let c = SchedulerConfig {
        num_blocks: 0,
        block_size: bs,
        max_num_seqs: 1 + rng.index(6),
        max_num_batched_tokens: 0,
        max_model_len: 120,
        policy: [Policy::Fcfs, Policy::Priority][rng.index(2)],
        enable_prefix_caching: caching,
        max_queue_len: None,
    };
    let chunk = c.max_num_seqs + rng.index(24);
    let cap = (window + chunk).div_ceil(bs) + 1;
    // Down to the smallest pool add_request accepts a long sequence for (`blocks_to_complete`).
    let least = if caching { 2 * cap } else { cap };
    let c = SchedulerConfig {
        max_num_batched_tokens: chunk,
        num_blocks: least * (1 + rng.index(3)),
        ..c
    };
    let mut s = windowed(c.clone(), window);
    let mut kv = SimKv::new(c.num_blocks, bs);
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|_| (0..60).map(|_| rng.below(50) as u32).collect())
        .collect();
    let mut ns_of: HashMap<String, u64> = HashMap::new();
    let mut live: Vec<String> = Vec::new();
    let mut next_id = 0u64;
    for _ in 0..ops {
        match rng.below(10) {
            0..=1 => {
                let id = format!("r{next_id}");
                next_id += 1;
                let base = &prefixes[rng.index(3)];
                let mut prompt = base[..rng.index(60)].to_vec();
                for _ in 0..=rng.below(8) {
                    prompt.push(rng.below(50) as u32);
                }
                let nsi = rng.below(2);
                let p = RequestParams {
                    max_tokens: 1 + rng.index(50),
                    n: 1 + (rng.chance(20) as usize) * rng.index(3),
                    priority: rng.below(3) as i64,
                    eos_token_ids: vec![0],
                    namespace: (nsi == 1).then(|| "a".to_string()),
                    arrival_time: Some(0.0),
                    ..RequestParams::new(1)
                };
                let (total, n) = (prompt.len() + p.max_tokens, p.n);
                match s.add_request(&id, &prompt, p) {
                    Ok(_) => {
                        ns_of.insert(id.clone(), 7 + nsi);
                        live.push(id);
                        if (total - 1).div_ceil(bs) > c.num_blocks {
                            seen.longer_than_pool += 1;
                        }
                    }
                    Err(CoreError::RequestTooLarge(_)) => {
                        // The pool always holds what the window needs: only the other limits.
                        assert!(total > 120 || n > c.max_num_seqs);
                    }
                    Err(e) => panic!("add_request: {e}"),
                }
            }
            2 => {
                if !live.is_empty() && rng.chance(30) {
                    let id = live.swap_remove(rng.index(live.len()));
                    s.abort(&id);
                }
            }
            3 => {
                if rng.chance(30) {
                    s.finish(rng.index(s.num_slots().max(1)) as Slot);
                }
            }
            _ => {
                let plan = s.schedule(Some(0.0)).clone();
                let bt = s.block_tables();
                assert!(
                    !s.has_unfinished() || !plan.is_empty(),
                    "empty plan with work"
                );
                let ns = |id: &str| ns_of[id];
                kv.write(&s, &plan, &bt, &ns);
                kv.check_reads(&s, &plan, &bt, &ns, Some(window));
                for b in 0..plan.num_seqs() {
                    let slot = plan.seq_slots[b] as Slot;
                    assert!(
                        held(&s, slot) <= cap,
                        "slot {slot} holds {}",
                        held(&s, slot)
                    );
                }
                seen.forks += plan.num_samples() - {
                    let mut u = plan.logits_indices.clone();
                    u.dedup();
                    u.len()
                };
                if rng.chance(3) {
                    seen.rollbacks += 1;
                } else {
                    let sampled: Vec<i64> = (0..plan.num_samples())
                        .map(|_| rng.below(40) as i64)
                        .collect();
                    s.update(&sampled).unwrap();
                }
                live.retain(|id| s.contains_request(id));
            }
        }
        s.check_invariants();
        s.radix.check_invariants(&s.alloc);
        for (slot, q) in s.seqs.iter().enumerate() {
            if q.status == Status::Running {
                assert!(held(&s, slot as Slot) <= cap);
            }
        }
    }
    let mut steps = 0;
    while s.has_unfinished() {
        let n = s.schedule(Some(0.0)).num_samples();
        s.update(&vec![5; n]).unwrap();
        s.check_invariants();
        steps += 1;
        assert!(steps < 20_000, "did not drain");
    }
    assert_eq!(s.alloc.num_used(), 0);
    assert!(s.reset_prefix_cache());
    assert_eq!(s.alloc.num_free(), c.num_blocks);
    let st = s.stats();
    seen.freed += st.window_freed_blocks;
    seen.preemptions += st.num_preemptions;
    seen.hits += st.prefix_hits;
}

#[test]
fn randomized_window_invariants() {
    let mut seen = Seen::default();
    for seed in 0..16 {
        random_run(1000 + seed, seed % 2 == 0, 1500, &mut seen);
    }
    println!("{seen:?}");
    assert!(seen.freed > 10_000 && seen.preemptions > 500, "{seen:?}");
    assert!(seen.hits > 100 && seen.forks > 10, "{seen:?}");
    assert!(
        seen.rollbacks > 100 && seen.longer_than_pool > 200,
        "{seen:?}"
    );
}
