//! Tests of the scheduler: plans, stop rules, forks, preemption, and a randomized run that
//! checks every plan against a simulated KV cache.

use std::collections::{HashMap, HashSet};

use super::*;
use crate::sched::sequence::FinishReason;

pub(super) fn cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        policy: Policy::Fcfs,
        enable_prefix_caching: true,
        max_queue_len: None,
    }
}

fn params(max_tokens: usize) -> RequestParams {
    RequestParams {
        arrival_time: Some(0.0),
        ..RequestParams::new(max_tokens)
    }
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// schedule + update with the given token for every sample row; returns the finished.
fn step(s: &mut Scheduler, token: i64) -> (Plan, Vec<Finished>) {
    let plan = s.schedule(Some(0.0)).clone();
    let sampled = vec![token; plan.num_samples()];
    let fin = s.update(&sampled).unwrap();
    s.check_invariants();
    s.radix.check_invariants(&s.alloc);
    (plan, fin)
}

#[test]
fn single_request_prefill_then_decode_to_length() {
    let mut s = Scheduler::new(cfg(16, 4)).unwrap();
    let slots = s.add_request("a", &toks(0..10), params(3)).unwrap();
    assert_eq!(slots, [0]);
    let plan = s.schedule(Some(0.0)).clone();
    assert_eq!(plan.input_ids, (0..10).collect::<Vec<i64>>());
    assert_eq!(plan.positions, (0..10).collect::<Vec<i64>>());
    assert_eq!(plan.query_start_loc, [0, 10]);
    assert_eq!(plan.seq_lens, [10]);
    assert_eq!(plan.context_lens, [0]);
    assert_eq!(plan.seq_slots, [0]);
    assert_eq!(plan.logits_indices, [9]);
    assert_eq!(plan.sample_slots, [0]);
    assert_eq!(plan.new_request_ids, [Arc::from("a")]);
    assert_eq!(plan.new_request_cached_tokens, [0]);
    assert_eq!(plan.num_prefill_tokens, 10);
    assert_eq!(plan.block_table_width, 3);
    let bt = s.block_tables();
    for (i, &sm) in plan.slot_mapping.iter().enumerate() {
        assert_eq!(sm, bt[i / 4] as i64 * 4 + (i % 4) as i64);
    }
    assert!(s.update(&[100]).unwrap().is_empty());
    let (plan, fin) = step(&mut s, 101);
    assert_eq!(plan.input_ids, [100]);
    assert_eq!(plan.positions, [10]);
    assert_eq!(plan.num_decode_tokens, 1);
    assert!(fin.is_empty());
    let (_, fin) = step(&mut s, 102);
    assert_eq!(fin, [(Arc::from("a"), 0, FinishReason::Length)]);
    assert_eq!(s.output_token_ids(0).unwrap(), [100, 101, 102]);
    assert!(!s.has_unfinished());
    assert!(s.schedule(Some(0.0)).is_empty());
    // 10 prompt + 2 generated tokens with KV = 3 full blocks cached, nothing used.
    assert_eq!(s.alloc.num_used(), 0);
    assert_eq!(s.alloc.num_cached(), 3);
    assert!(s.reset_prefix_cache());
    assert_eq!(s.alloc.num_free(), 16);
    assert_eq!(s.stats().num_finished, 1);
}

#[test]
fn chunked_prefill_never_starves_decodes() {
    let mut c = cfg(64, 4);
    c.max_num_batched_tokens = 8;
    c.max_num_seqs = 4;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("d", &toks(0..3), params(50)).unwrap();
    step(&mut s, 7); // d prefilled, now decoding
    s.add_request("long", &toks(100..120), params(5)).unwrap();
    let mut got = Vec::new();
    for _ in 0..4 {
        let (plan, _) = step(&mut s, 7);
        assert!(plan.num_tokens() <= 8);
        assert_eq!(plan.seq_slots[0], 0, "the decode goes first");
        assert_eq!(plan.query_start_loc[1], 1);
        got.push((plan.num_tokens(), plan.num_samples()));
    }
    // 20 prompt tokens at 7 per step alongside the decode: 7, 7, 6 (+ sample), then decode.
    assert_eq!(got, [(8, 1), (8, 1), (7, 2), (2, 2)]);
}

#[test]
fn prefix_hit_shares_blocks_and_counts() {
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    let prompt = toks(0..13);
    s.add_request("a", &prompt, params(4)).unwrap();
    step(&mut s, 50); // prefill done, prompt blocks cached at update
    let mut p2 = prompt.clone();
    p2.push(99);
    s.add_request("b", &p2, params(4)).unwrap();
    let (plan, _) = step(&mut s, 51);
    assert_eq!(plan.new_request_ids, [Arc::from("b")]);
    assert_eq!(plan.new_request_cached_tokens, [12]);
    assert_eq!(plan.num_cached_tokens, 12);
    // a decodes position 14 (token 50 at 13); b computes positions 12..14.
    assert_eq!(plan.seq_slots, [0, 1]);
    assert_eq!(plan.positions, [13, 12, 13]);
    assert_eq!(plan.context_lens, [13, 12]);
    let a = s.seqs[0].blocks.clone();
    let b = s.seqs[1].blocks.clone();
    assert_eq!(a[..3], b[..3]);
    assert_ne!(a[3], b[3]);
    let st = s.stats();
    assert_eq!(st.prefix_queries, 13 + 14);
    assert_eq!(st.prefix_hits, 12);
}

#[test]
fn requests_admitted_in_one_step_share_their_prefix() {
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    // The first one's full blocks are cached as they are allocated: the second hits them in
    // the same step (its context is written by the same forward, before attention reads it).
    s.add_request("a", &toks(0..9), params(4)).unwrap();
    s.add_request("b", &toks(0..9), params(4)).unwrap();
    let plan = s.schedule(Some(0.0)).clone();
    assert_eq!(plan.new_request_cached_tokens, [0, 8]);
    assert_eq!(plan.num_prefill_tokens, 9 + 1);
    assert_eq!(s.alloc.num_used(), 4);
    s.update(&[1, 2]).unwrap();
    s.check_invariants();
    assert_eq!(s.seqs[0].blocks[..2], s.seqs[1].blocks[..2]);
    assert_eq!(s.alloc.num_used(), 4);
}

#[test]
fn a_plan_that_never_ran_uncaches_what_it_would_have_written() {
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    s.add_request("a", &toks(0..9), params(4)).unwrap();
    s.schedule(Some(0.0));
    assert_eq!(s.radix.num_cached_blocks(), 2);
    // No update: the forward failed. Its blocks never got their KV, so nobody may hit them.
    let plan = s.schedule(Some(1.0)).clone();
    s.check_invariants();
    assert_eq!(plan.new_request_cached_tokens.len(), 0);
    assert_eq!(plan.num_cached_tokens, 0, "re-admitted a without a hit");
    assert_eq!(plan.preempted_request_ids, [Arc::from("a")]);
    s.update(&[7]).unwrap();
    s.check_invariants();
    assert_eq!(s.radix.num_cached_blocks(), 2);
}

#[test]
fn preemption_recomputes_without_resampling() {
    // 6 blocks of 4: two sequences of 9 prompt tokens (3 blocks each) fill the pool.
    let mut c = cfg(6, 4);
    c.enable_prefix_caching = false;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", &toks(0..9), params(8)).unwrap();
    s.add_request("b", &toks(100..109), params(8)).unwrap();
    let (plan, _) = step(&mut s, 1);
    assert_eq!(plan.seq_slots, [0, 1]);
    // Both decode in place up to 12 tokens.
    step(&mut s, 2);
    step(&mut s, 3);
    step(&mut s, 4);
    assert_eq!(s.seqs[1].tokens.len(), 13);
    // Position 12 needs a 4th block each: b (latest) is preempted for a.
    let (plan, _) = step(&mut s, 5);
    assert_eq!(plan.preempted_request_ids, [Arc::from("b")]);
    assert_eq!(plan.seq_slots, [0]);
    assert_eq!(s.stats().num_preemptions, 1);
    assert_eq!(s.num_waiting(), 1);
    // Run a to the end; b comes back and recomputes its 12 known tokens, sampling only at
    // the last one.
    let mut fin = Vec::new();
    while fin.is_empty() {
        fin = step(&mut s, 6).1;
    }
    assert_eq!(fin[0].0.as_ref(), "a");
    let (plan, _) = step(&mut s, 7);
    assert_eq!(plan.seq_slots, [1]);
    assert_eq!(plan.num_tokens(), 13);
    assert_eq!(plan.num_prefill_tokens, 13);
    assert_eq!(plan.logits_indices, [12]);
    assert_eq!(
        plan.input_ids[9..],
        [1, 2, 3, 4],
        "generated tokens are recomputed"
    );
    assert!(plan.new_request_ids.is_empty());
    assert_eq!(s.output_token_ids(1).unwrap(), [1, 2, 3, 4, 7]);
}

#[test]
fn preempted_blocks_stay_cached_for_a_cheap_recompute() {
    let mut s = Scheduler::new(cfg(6, 4)).unwrap();
    s.add_request("a", &toks(0..9), params(8)).unwrap();
    s.add_request("b", &toks(100..109), params(8)).unwrap();
    for t in 1..=5 {
        step(&mut s, t);
    }
    assert_eq!(s.stats().num_preemptions, 1);
    // b's three full blocks (9 prompt + 3 generated tokens) were cached; a needed one of
    // them (LRU tail first), b re-hits the other two when readmitted after a finishes.
    let mut fin = Vec::new();
    while fin.is_empty() {
        let (plan, f) = step(&mut s, 6);
        assert_eq!(plan.num_cached_tokens, 0);
        fin = f;
    }
    let (plan, _) = step(&mut s, 7);
    assert_eq!(plan.seq_slots, [1]);
    assert_eq!(plan.num_cached_tokens, 8);
    // A re-admission is no new request: its hit is in the step total only.
    assert!(plan.new_request_ids.is_empty() && plan.new_request_cached_tokens.is_empty());
    assert_eq!(plan.num_tokens(), 13 - 8);
}

#[test]
fn n_greater_than_one_forks_after_prefill_with_copy_on_write() {
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    let slots = s
        .add_request("r", &toks(0..6), RequestParams { n: 3, ..params(4) })
        .unwrap();
    assert_eq!(slots, [0, 1, 2]);
    let plan = s.schedule(Some(0.0)).clone();
    assert_eq!(plan.seq_slots, [0]);
    assert_eq!(plan.logits_indices, [5, 5, 5]);
    assert_eq!(plan.sample_slots, [0, 1, 2]);
    s.update(&[10, 11, 12]).unwrap();
    s.check_invariants();
    assert_eq!(s.num_running(), 3);
    assert_eq!(s.seqs[1].blocks, s.seqs[0].blocks);
    assert_eq!(s.alloc.ref_count(s.seqs[0].blocks[1]), 3);
    let (plan, _) = step(&mut s, 20);
    assert_eq!(plan.seq_slots, [0, 1, 2]);
    assert_eq!(plan.input_ids, [10, 11, 12]);
    assert_eq!(plan.positions, [6, 6, 6]);
    // The shared, partly filled block 1 is copied for two of the three writers.
    assert_eq!(plan.cow_pairs.len(), 4);
    let bt = s.block_tables();
    let w = plan.block_table_width;
    let second: HashSet<i32> = (0..3).map(|b| bt[b * w + 1]).collect();
    assert_eq!(second.len(), 3);
    assert_eq!(s.output_token_ids(2).unwrap(), [12, 20]);
}

#[test]
fn n_reserves_seq_budget() {
    let mut c = cfg(64, 4);
    c.max_num_seqs = 4;
    let mut s = Scheduler::new(c).unwrap();
    let n3 = RequestParams { n: 3, ..params(4) };
    s.add_request("a", &toks(0..5), n3.clone()).unwrap();
    s.add_request("b", &toks(10..15), n3).unwrap();
    let (plan, _) = step(&mut s, 1);
    assert_eq!(plan.new_request_ids, [Arc::from("a")]);
    assert_eq!(s.num_running(), 3);
    assert!(s.stats().num_waiting == 1);
    assert!(matches!(
        s.add_request("c", &[1], RequestParams { n: 5, ..params(1) }),
        Err(CoreError::RequestTooLarge(_))
    ));
}

#[test]
fn stop_rules() {
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    let base = RequestParams {
        eos_token_ids: vec![2],
        stop_token_ids: vec![7],
        ..params(10)
    };
    s.add_request("eos", &[1], base.clone()).unwrap();
    s.add_request(
        "ign",
        &[1],
        RequestParams {
            ignore_eos: true,
            ..base.clone()
        },
    )
    .unwrap();
    s.add_request(
        "min",
        &[1],
        RequestParams {
            min_tokens: 2,
            ..base.clone()
        },
    )
    .unwrap();
    let plan = s.schedule(Some(0.0));
    assert_eq!(plan.sample_output_lens, [0, 0, 0]);
    assert_eq!(plan.sample_ban_stop, [false, false, true]);
    let fin = s.update(&[2, 2, 2]).unwrap();
    // EOS reports no stop token.
    assert_eq!(fin, [(Arc::from("eos"), 0, FinishReason::Stop(None))]);
    let plan = s.schedule(Some(0.0));
    assert_eq!(plan.sample_output_lens, [1, 1]);
    assert_eq!(plan.sample_ban_stop, [false, true]);
    // ignore_eos still honours stop_token_ids (and reports the id); "min" has generated
    // 1 < min_tokens tokens before this one, so its stop tokens do not count yet.
    let fin = s.update(&[7, 7]).unwrap();
    assert_eq!(fin, [(Arc::from("ign"), 1, FinishReason::Stop(Some(7)))]);
    let plan = s.schedule(Some(0.0));
    assert_eq!(plan.sample_ban_stop, [false]);
    let fin = s.update(&[7]).unwrap();
    assert_eq!(fin, [(Arc::from("min"), 2, FinishReason::Stop(Some(7)))]);
    assert_eq!(s.output_token_ids(2).unwrap(), [2, 7, 7]);
}

#[test]
fn stop_token_reported_unless_it_is_an_active_eos() {
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    let base = RequestParams {
        eos_token_ids: vec![2, 3],
        stop_token_ids: vec![3, 9, 9],
        ..params(10)
    };
    let ign = RequestParams {
        ignore_eos: true,
        ..base.clone()
    };
    s.add_request("a", &[1], base.clone()).unwrap();
    s.add_request("b", &[1], base).unwrap();
    s.add_request("c", &[1], ign.clone()).unwrap();
    s.add_request("d", &[1], ign).unwrap();
    assert_eq!(s.stop_token_ids(0).unwrap(), [2, 3, 9]);
    assert_eq!(s.stop_token_ids(2).unwrap(), [3, 9]);
    s.schedule(Some(0.0));
    // 3 is both an EOS and a stop token id: an EOS while EOS counts, a stop token id under
    // ignore_eos (as vLLM reports it).
    let fin = s.update(&[3, 9, 3, 2]).unwrap();
    assert_eq!(
        fin,
        [
            (Arc::from("a"), 0, FinishReason::Stop(None)),
            (Arc::from("b"), 1, FinishReason::Stop(Some(9))),
            (Arc::from("c"), 2, FinishReason::Stop(Some(3))),
        ]
    );
    assert!(s.stop_token_ids(0).is_none(), "finished");
    assert_eq!(s.stop_token_ids(3).unwrap(), [3, 9]);
}

#[test]
fn min_tokens_bans_stop_tokens_for_exactly_min_tokens_rows_and_forks_inherit_it() {
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    let p = RequestParams {
        eos_token_ids: vec![2],
        min_tokens: 2,
        n: 2,
        ..params(6)
    };
    s.add_request("a", &[5, 6, 7], p).unwrap();
    let (plan, fin) = step(&mut s, 2);
    // The fork parent's first token: one row per sequence, both banned.
    assert_eq!(plan.sample_slots, [0, 1]);
    assert_eq!(plan.sample_output_lens, [0, 0]);
    assert_eq!(plan.sample_ban_stop, [true, true]);
    assert!(
        fin.is_empty(),
        "a banned row that sampled EOS anyway does not stop"
    );
    let (plan, fin) = step(&mut s, 2);
    assert_eq!(plan.sample_output_lens, [1, 1]);
    assert_eq!(plan.sample_ban_stop, [true, true]);
    assert!(fin.is_empty());
    let (plan, fin) = step(&mut s, 2);
    assert_eq!(plan.sample_output_lens, [2, 2]);
    assert_eq!(plan.sample_ban_stop, [false, false]);
    assert_eq!(
        fin,
        [
            (Arc::from("a"), 0, FinishReason::Stop(None)),
            (Arc::from("a"), 1, FinishReason::Stop(None))
        ]
    );
}

#[test]
fn length_and_stop_on_the_same_token_is_a_stop() {
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    let p = RequestParams {
        eos_token_ids: vec![2],
        ..params(1)
    };
    s.add_request("a", &[1], p).unwrap();
    let (_, fin) = step(&mut s, 2);
    assert_eq!(fin, [(Arc::from("a"), 0, FinishReason::Stop(None))]);
}

#[test]
fn sample_output_lens_survive_preemption() {
    // The sampler's random stream continues where it was after a recompute.
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    s.add_request("a", &[1, 2, 3], params(8)).unwrap();
    for n in 0..3 {
        let (plan, _) = step(&mut s, 10 + n);
        assert_eq!(plan.sample_output_lens, [n]);
    }
    // A plan never updated: the sequence is preempted and recomputed.
    s.schedule(Some(0.0));
    let plan = s.schedule(Some(0.0)).clone();
    assert_eq!(plan.preempted_request_ids, [Arc::from("a")]);
    assert_eq!(plan.sample_output_lens, [3]);
    s.update(&[20]).unwrap();
    assert_eq!(s.output_token_ids(0).unwrap(), [10, 11, 12, 20]);
}

#[test]
fn max_model_len_and_size_checks() {
    let mut c = cfg(4, 4);
    c.max_model_len = 20;
    let mut s = Scheduler::new(c).unwrap();
    let e = s.add_request("a", &toks(0..15), params(6)).unwrap_err();
    assert!(matches!(e, CoreError::RequestTooLarge(_)), "{e}");
    // 15 + 2 = 17 tokens, KV for 16 = 4 blocks: fits exactly.
    s.add_request("b", &toks(0..15), params(2)).unwrap();
    let e = s.add_request("c", &toks(0..16), params(2)).unwrap_err();
    assert!(e.to_string().contains("KV blocks"), "{e}");
    assert!(matches!(
        s.add_request("b", &[1], params(1)),
        Err(CoreError::DuplicateRequest(_))
    ));
    for (p, name) in [
        (params(0), "max_tokens"),
        (RequestParams { n: 0, ..params(1) }, "n"),
        (
            RequestParams {
                min_tokens: 3,
                ..params(1)
            },
            "min_tokens",
        ),
        (
            RequestParams {
                queue_timeout: Some(f64::NAN),
                ..params(1)
            },
            "queue_timeout",
        ),
    ] {
        match s.add_request("x", &[1], p) {
            Err(CoreError::InvalidArgument { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    assert!(matches!(
        s.add_request("x", &[], params(1)),
        Err(CoreError::InvalidArgument {
            name: "prompt_token_ids",
            ..
        })
    ));
    let (_, fin) = step(&mut s, 3);
    assert!(fin.is_empty());
    let (_, fin) = step(&mut s, 3);
    assert_eq!(fin[0].2, FinishReason::Length);
    assert!(Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 4,
        ..cfg(4, 4)
    })
    .is_err());
}

#[test]
fn queue_full_and_abort_everywhere() {
    let mut c = cfg(64, 4);
    c.max_queue_len = Some(2);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", &toks(0..5), params(9)).unwrap();
    s.add_request("b", &toks(0..5), RequestParams { n: 2, ..params(9) })
        .unwrap();
    assert_eq!(
        s.add_request("c", &[1], params(1)),
        Err(CoreError::QueueFull { max_len: 2 })
    );
    step(&mut s, 1); // a running; b (n=2) does not fit max_num_seqs=2 with a
    s.add_request("c", &[1], params(1)).unwrap();
    assert!(s.abort("a")); // running
    assert!(s.abort("b")); // waiting, with a pending child
    assert!(!s.abort("b"));
    s.check_invariants();
    assert_eq!(s.num_running(), 0);
    assert_eq!(s.num_waiting(), 1);
    let (plan, _) = step(&mut s, 1);
    assert_eq!(plan.new_request_ids, [Arc::from("c")]);
    assert!(!s.has_unfinished());
    assert_eq!(s.stats().num_aborted, 2);
    assert!(s.reset_prefix_cache());
    assert_eq!(s.alloc.num_free(), 64);
}

#[test]
fn finishing_a_fork_parent_early_hands_over_to_a_child() {
    let mut s = Scheduler::new(cfg(64, 4)).unwrap();
    s.add_request("r", &toks(0..9), RequestParams { n: 3, ..params(5) })
        .unwrap();
    // Parent finished before its first token (a waiting one here).
    assert!(s.finish(0));
    s.check_invariants();
    let plan = s.schedule(Some(0.0)).clone();
    assert_eq!(plan.seq_slots, [1]);
    assert_eq!(plan.sample_slots, [1, 2]);
    s.update(&[4, 5]).unwrap();
    s.check_invariants();
    assert_eq!(s.num_running(), 2);
    assert!(!s.finish(0));
}

#[test]
fn timeouts_only_hit_waiting_requests() {
    let mut c = cfg(64, 4);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(c).unwrap();
    let t = |timeout| RequestParams {
        queue_timeout: Some(timeout),
        ..params(5)
    };
    s.add_request("run", &[1, 2], t(1.0)).unwrap();
    s.add_request("wait", &[1, 2], RequestParams { n: 2, ..t(1.0) })
        .unwrap();
    s.schedule(Some(0.5));
    s.update(&[3]).unwrap();
    let plan = s.schedule(Some(1.5)).clone();
    assert_eq!(
        plan.finished,
        [
            (Arc::from("wait"), 1, FinishReason::Timeout),
            (Arc::from("wait"), 2, FinishReason::Timeout)
        ]
    );
    assert_eq!(plan.seq_slots, [0]);
    s.update(&[4]).unwrap();
    assert_eq!(s.stats().num_timeouts, 1);
    s.check_invariants();
}

#[test]
fn priority_preempts_lower_priority_running() {
    let mut c = cfg(8, 4);
    c.policy = Policy::Priority;
    let mut s = Scheduler::new(c).unwrap();
    let prio = |p| RequestParams {
        priority: p,
        ..params(8)
    };
    s.add_request("low", &toks(0..20), prio(5)).unwrap();
    step(&mut s, 1);
    s.add_request("high", &toks(100..112), prio(0)).unwrap();
    let (plan, _) = step(&mut s, 2);
    assert_eq!(plan.preempted_request_ids, [Arc::from("low")]);
    assert_eq!(plan.new_request_ids, [Arc::from("high")]);
    // A request of equal or lower priority never preempts.
    s.add_request("other", &toks(200..220), prio(5)).unwrap();
    let (plan, _) = step(&mut s, 2);
    assert!(plan.preempted_request_ids.is_empty());
}

#[test]
fn deadline_policy_admits_earliest_deadline_first() {
    let mut c = cfg(64, 4);
    c.policy = Policy::Deadline;
    c.max_num_seqs = 1;
    let mut s = Scheduler::new(c).unwrap();
    let d = |deadline| RequestParams {
        deadline,
        ..params(1)
    };
    s.add_request("none", &[1], d(None)).unwrap();
    s.add_request("late", &[1], d(Some(9.0))).unwrap();
    s.add_request("soon", &[1], d(Some(1.0))).unwrap();
    let mut order = Vec::new();
    while s.has_unfinished() {
        let (plan, _) = step(&mut s, 1);
        order.extend(plan.new_request_ids.iter().map(|x| x.to_string()));
    }
    assert_eq!(order, ["soon", "late", "none"]);
}

#[test]
fn schedule_without_update_rolls_back() {
    let mut s = Scheduler::new(cfg(64, 4)).unwrap();
    s.add_request("a", &toks(0..10), params(5)).unwrap();
    step(&mut s, 1);
    s.schedule(Some(0.0)); // decode planned, never run
    let plan = s.schedule(Some(0.0)).clone();
    assert_eq!(plan.preempted_request_ids, [Arc::from("a")]);
    // Re-admitted at once: the 8 cached prompt tokens hit, the rest recomputes.
    assert_eq!(plan.num_cached_tokens, 8);
    assert_eq!(plan.num_tokens(), 3);
    s.update(&[2]).unwrap();
    s.check_invariants();
    assert_eq!(s.output_token_ids(0).unwrap(), [1, 2]);
    assert!(s.update(&[2]).is_err(), "no plan is waiting");
    assert!(s.update(&[]).is_ok());
}

#[test]
fn update_validates_its_input() {
    let mut s = Scheduler::new(cfg(64, 4)).unwrap();
    s.add_request("a", &toks(0..10), params(5)).unwrap();
    s.schedule(Some(0.0));
    assert!(matches!(
        s.update(&[1, 2]),
        Err(CoreError::InvalidArgument {
            name: "sampled_token_ids",
            ..
        })
    ));
    assert!(s.update(&[-1]).is_err());
    assert!(s.update(&[1]).is_ok());
}

#[test]
fn namespaces_never_share_blocks() {
    let mut s = Scheduler::new(cfg(64, 4)).unwrap();
    let ns = |n: &str| RequestParams {
        namespace: Some(n.into()),
        ..params(2)
    };
    s.add_request("a", &toks(0..9), ns("x")).unwrap();
    step(&mut s, 1);
    s.add_request("b", &toks(0..9), ns("y")).unwrap();
    s.add_request("c", &toks(0..9), ns("x")).unwrap();
    let (plan, _) = step(&mut s, 1);
    assert_eq!(plan.num_cached_tokens, 8);
    assert_eq!(plan.new_request_cached_tokens, [0, 8]);
    assert_eq!(plan.seq_slots[1..], [1, 2]);
    assert_eq!(plan.context_lens[1..], [0, 8]);
}

// ---- randomized -----------------------------------------------------------------------------

use super::harness::SimKv;
use crate::test_rng::Rng;

/// Drives the scheduler like an engine would, with a simulated KV cache: every plan's writes
/// land in `kv` (after its copy-on-write pairs), and every row's whole context is checked to
/// hold the right (namespace, prefix) hashes. Returns the number of operations run.
#[derive(Debug, Default)]
struct Seen {
    ops: usize,
    preemptions: u64,
    timeouts: u64,
    hits: u64,
    cow: usize,
    forks: usize,
    rollbacks: usize,
    chunked: usize,
    resampled_rows_skipped: usize,
}

fn random_run(seed: u64, policy: Policy, caching: bool, ops: usize, seen: &mut Seen) {
    let mut rng = Rng(seed);
    let c = SchedulerConfig {
        num_blocks: 10 + rng.below(30) as usize,
        block_size: [1, 2, 4, 8][rng.below(4) as usize],
        max_num_seqs: 1 + rng.below(8) as usize,
        max_num_batched_tokens: 0,
        max_model_len: 48,
        policy,
        enable_prefix_caching: caching,
        max_queue_len: if rng.chance(50) { Some(12) } else { None },
    };
    let c = SchedulerConfig {
        max_num_batched_tokens: c.max_num_seqs + rng.below(24) as usize,
        ..c
    };
    let bs = c.block_size;
    let opts = SchedulerOptions {
        reserve_decode: rng.chance(30),
        ..SchedulerOptions::default()
    };
    let mut s = Scheduler::with_options(c.clone(), opts).unwrap();
    let mut kv = SimKv::new(c.num_blocks, bs);
    let prefixes: Vec<Vec<u32>> = (0..4)
        .map(|_| (0..24).map(|_| rng.below(50) as u32).collect())
        .collect();
    let namespaces = [None, Some("a"), Some("b")];
    let mut ns_of: HashMap<String, u64> = HashMap::new();
    let mut min_tokens_of: HashMap<String, usize> = HashMap::new();
    let mut live: Vec<String> = Vec::new();
    let mut next_id = 0u64;
    let mut now = 0.0;
    let mut done = 0;
    while done < ops {
        done += 1;
        match rng.below(10) {
            0..=2 => {
                let id = format!("r{next_id}");
                next_id += 1;
                let base = &prefixes[rng.below(4) as usize];
                let mut prompt = base[..rng.below(24) as usize].to_vec();
                for _ in 0..=rng.below(8) {
                    prompt.push(rng.below(50) as u32);
                }
                let nsi = rng.below(3) as usize;
                let p = RequestParams {
                    max_tokens: 1 + rng.below(16) as usize,
                    min_tokens: rng.below(2) as usize,
                    n: 1 + (rng.chance(20) as usize) * rng.below(3) as usize,
                    priority: rng.below(3) as i64,
                    eos_token_ids: vec![0],
                    stop_token_ids: if rng.chance(30) { vec![1] } else { vec![] },
                    ignore_eos: rng.chance(20),
                    deadline: rng.chance(50).then(|| rng.below(10) as f64),
                    queue_timeout: rng.chance(20).then(|| rng.below(20) as f64),
                    namespace: namespaces[nsi].map(String::from),
                    arrival_time: Some(now),
                    grammar: None,
                    // From the id, not the rng: the other policies' runs stay as they were.
                    tenant: (!next_id.is_multiple_of(3)).then(|| format!("t{}", next_id % 3)),
                    speculate: true,
                };
                let min_tokens = p.min_tokens;
                match s.add_request(&id, &prompt, p) {
                    Ok(_) => {
                        ns_of.insert(id.clone(), 7 + nsi as u64);
                        min_tokens_of.insert(id.clone(), min_tokens);
                        live.push(id);
                    }
                    Err(CoreError::RequestTooLarge(_)) | Err(CoreError::QueueFull { .. }) => {}
                    Err(e) => panic!("add_request: {e}"),
                }
            }
            3 => {
                if !live.is_empty() {
                    let id = live.swap_remove(rng.below(live.len() as u64) as usize);
                    s.abort(&id);
                }
            }
            4 => {
                let slot = rng.below(s.num_slots().max(1) as u64) as Slot;
                s.finish(slot);
            }
            _ => {
                now += 1.0;
                let before: Vec<Slot> = s.running.clone();
                let plan = s.schedule(Some(now)).clone();
                let bt = s.block_tables();
                // Budgets.
                assert!(plan.num_tokens() <= c.max_num_batched_tokens);
                assert!(plan.num_seqs() <= c.max_num_seqs);
                assert!(s.num_running() <= c.max_num_seqs);
                // Progress: live work always gets a non-empty plan.
                assert!(
                    !s.has_unfinished() || !plan.is_empty(),
                    "empty plan with work"
                );
                // No starvation: every running sequence got a token or was preempted.
                let in_plan: HashSet<i64> = plan.seq_slots.iter().copied().collect();
                for slot in before {
                    let st = s.seqs[slot as usize].status;
                    if st == Status::Running {
                        assert!(in_plan.contains(&(slot as i64)), "running {slot} starved");
                    }
                }
                // Copy-on-write, then the step's writes; every row reads its own prefix.
                let ns = |id: &str| ns_of[id];
                kv.write(&s, &plan, &bt, &ns);
                kv.check_reads(&s, &plan, &bt, &ns, None);
                for b in 0..plan.num_seqs() {
                    let tokens = s.token_ids(plan.seq_slots[b] as Slot).unwrap();
                    // Samples only where the known tokens end.
                    let last = plan.query_start_loc[b + 1] - 1;
                    let samples = plan.logits_indices.contains(&last);
                    assert_eq!(samples, plan.seq_lens[b] as usize == tokens.len());
                }
                seen.cow += plan.cow_pairs.len() / 2;
                seen.forks += plan.num_samples() - {
                    let mut u = plan.logits_indices.clone();
                    u.dedup();
                    u.len()
                };
                for b in 0..plan.num_seqs() {
                    let slot = plan.seq_slots[b] as Slot;
                    let n_tok = s.token_ids(slot).unwrap().len() as i64;
                    let prompt = n_tok - s.output_token_ids(slot).unwrap().len() as i64;
                    if plan.seq_lens[b] < n_tok && plan.seq_lens[b] > prompt {
                        seen.resampled_rows_skipped += 1;
                    }
                    if plan.seq_lens[b] < n_tok && plan.context_lens[b] > 0 {
                        seen.chunked += 1;
                    }
                }
                // A new request's cached-token count is where its first chunk starts.
                assert_eq!(
                    plan.new_request_cached_tokens.len(),
                    plan.new_request_ids.len()
                );
                for (id, &cached) in plan
                    .new_request_ids
                    .iter()
                    .zip(&plan.new_request_cached_tokens)
                {
                    assert_eq!(cached as usize % c.block_size, 0);
                    let row = (0..plan.num_seqs())
                        .find(|&b| s.request_id(plan.seq_slots[b] as Slot) == Some(id))
                        .expect("a new request has a row");
                    assert_eq!(plan.context_lens[row], cached);
                }
                // What the sampler gets: each row's output length and whether min_tokens
                // still bans its stop tokens.
                for (r, &slot) in plan.sample_slots.iter().enumerate() {
                    let slot = slot as Slot;
                    let out = s.output_token_ids(slot).unwrap().len();
                    let min = min_tokens_of[s.request_id(slot).unwrap().as_ref()];
                    assert_eq!(plan.sample_output_lens[r], out as i64);
                    assert_eq!(plan.sample_ban_stop[r], out < min);
                }
                let sampled: Vec<i64> = (0..plan.num_samples())
                    .map(|_| rng.below(40) as i64)
                    .collect();
                // Sometimes the engine never updates (a failed step): rollback next time.
                if rng.chance(3) {
                    seen.rollbacks += 1;
                } else {
                    for (id, slot, why) in s.update(&sampled).unwrap() {
                        let out = s.output_token_ids(slot).unwrap();
                        let last = *out.last().unwrap();
                        match why {
                            // eos_token_ids [0], stop_token_ids [1] or none.
                            FinishReason::Stop(tok) => {
                                assert_eq!(tok, (last == 1).then_some(1), "{id}: {out:?}");
                                assert!(last <= 1 && out.len() > min_tokens_of[id.as_ref()]);
                            }
                            FinishReason::Length => {}
                            FinishReason::Timeout => panic!("{id}: a timeout from update"),
                        }
                    }
                }
                live.retain(|id| s.contains_request(id));
            }
        }
        s.check_invariants();
        if done % 7 == 0 {
            s.radix.check_invariants(&s.alloc);
        }
    }
    // Drain: everything finishes, then the cache empties completely.
    let mut steps = 0;
    while s.has_unfinished() {
        now += 1.0;
        let n = s.schedule(Some(now)).num_samples();
        s.update(&vec![5; n]).unwrap();
        steps += 1;
        assert!(steps < 10_000, "did not drain");
    }
    s.check_invariants();
    assert_eq!(s.alloc.num_used(), 0);
    assert!(s.reset_prefix_cache());
    assert_eq!(s.alloc.num_free(), c.num_blocks);
    let st = s.stats();
    assert_eq!((st.num_running, st.num_waiting, st.num_requests), (0, 0, 0));
    seen.ops += done;
    seen.preemptions += st.num_preemptions;
    seen.timeouts += st.num_timeouts;
    seen.hits += st.prefix_hits;
}

#[test]
fn randomized_scheduler_invariants() {
    let mut seen = Seen::default();
    let mut seed = 1;
    for policy in [
        Policy::Fcfs,
        Policy::Priority,
        Policy::Deadline,
        Policy::Fair,
    ] {
        for caching in [true, false] {
            for _ in 0..6 {
                random_run(seed, policy, caching, 3_000, &mut seen);
                seed += 1;
            }
        }
    }
    println!("{seen:?}");
    assert!(seen.ops >= 100_000, "{seen:?}");
    // Every path was exercised.
    assert!(
        seen.preemptions > 100 && seen.timeouts > 10 && seen.hits > 1000,
        "{seen:?}"
    );
    assert!(
        seen.cow > 10 && seen.forks > 10 && seen.rollbacks > 100,
        "{seen:?}"
    );
    assert!(
        seen.chunked > 100 && seen.resampled_rows_skipped > 10,
        "{seen:?}"
    );
}

#[test]
fn tier_flush_ends_the_step_first() {
    let opts = SchedulerOptions {
        tier_blocks: 8,
        ..SchedulerOptions::default()
    };
    let mut s = Scheduler::with_options(cfg(8, 4), opts).unwrap();
    // Cached, demoted by a flood, then promoted back by a hit whose request ends that step.
    s.add_request("a", &toks(0..9), params(1)).unwrap();
    step(&mut s, 1);
    s.add_request("flood", &toks(100..128), params(1)).unwrap();
    step(&mut s, 1);
    assert!(s.stats().tier.demotions > 0);
    s.add_request("b", &toks(0..9), params(1)).unwrap();
    let (plan, _) = step(&mut s, 1);
    assert!(!plan.kv_promote.is_empty());
    // Its promoted blocks are flushed although the promoting step was the last one.
    let copies = s.tier_flush();
    s.check_invariants();
    assert_eq!(s.radix.num_cached_blocks(), 0, "{copies:?}");
    let prefix: Vec<_> = s
        .tier_entries()
        .into_iter()
        .filter(|e| e.3 == toks(0..4))
        .collect();
    assert_eq!(prefix.len(), 1);

    // A plan that never ran is rolled back, not flushed.
    s.add_request("c", &toks(200..209), params(1)).unwrap();
    s.schedule(Some(9.0));
    s.tier_flush();
    s.check_invariants();
    assert!(s.tier_entries().iter().all(|e| e.3 != toks(200..204)));
}
