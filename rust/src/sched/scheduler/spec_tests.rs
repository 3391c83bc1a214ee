//! Speculative decoding in the scheduler: proposals as extra query rows, rollback of rejected
//! lookahead (blocks and cache), and a randomized run checking every plan against a simulated
//! KV cache in which proposed positions hold the proposed tokens' KV.

use super::harness::kv_hash;
use super::*;
use crate::error::CoreError;
use crate::sched::plan::Plan;
use crate::sched::sequence::FinishReason;
use crate::sched::spec::SpecConfig;
use crate::test_rng::Rng;

fn spec(k: usize) -> SpecConfig {
    SpecConfig {
        num_speculative_tokens: k,
        prompt_lookup_max: 3,
        prompt_lookup_min: 1,
        max_batch_tokens: 64,
        external: false,
    }
}

fn sched(num_blocks: usize, bs: usize, k: usize) -> Scheduler {
    let mut s = Scheduler::new(super::tests::cfg(num_blocks, bs)).unwrap();
    s.set_speculation(Some(spec(k))).unwrap();
    s
}

fn params(max_tokens: usize) -> RequestParams {
    RequestParams {
        arrival_time: Some(0.0),
        ..RequestParams::new(max_tokens)
    }
}

#[test]
fn a_repeating_prompt_is_verified_in_one_step_and_rejections_roll_back() {
    let mut s = sched(32, 2, 4);
    // 1 2 3 4 5 6 7 8 9 1 2: the suffix "1 2" proposes 3 4 5 6.
    let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2];
    s.add_request("a", &prompt, params(20)).unwrap();
    let plan = s.schedule(Some(0.0)).clone();
    assert_eq!(plan.num_samples(), 1, "a prefill proposes nothing");
    s.update(&[3]).unwrap();
    let plan = s.schedule(Some(1.0)).clone();
    // Row 0 verifies "4" (after 1 2 3), then 5 6 7 ...
    assert_eq!(plan.input_ids, vec![3, 4, 5, 6, 7]);
    assert_eq!(plan.positions, vec![11, 12, 13, 14, 15]);
    assert_eq!(plan.logits_indices, vec![0, 1, 2, 3, 4]);
    assert_eq!(plan.sample_draft, vec![4, 5, 6, 7, -1]);
    assert_eq!(plan.sample_output_lens, vec![1, 2, 3, 4, 5]);
    assert_eq!(plan.seq_lens, vec![16]);
    assert_eq!(plan.num_decode_tokens, 5);
    let used = s.stats().blocks.used;
    // The model agrees on 4 and 5, then says 0 (not 6): 4 5 0 appended, 6 7 rolled back.
    s.update(&[4, 5, 0, 6, 7]).unwrap();
    assert_eq!(s.emitted(), &[true, true, true, false, false]);
    assert_eq!(s.output_token_ids(0).unwrap(), &[3, 4, 5, 0]);
    let q = &s.seqs[0];
    assert_eq!(q.computed, 14, "3 4 5 have KV now, 0 does not");
    assert_eq!(
        q.blocks.len(),
        7,
        "the lookahead block past position 13 is freed"
    );
    assert!(s.stats().blocks.used < used);
    assert_eq!(s.spec_stats().num_draft_tokens, 4);
    assert_eq!(s.spec_stats().num_accepted_tokens, 2);
    assert_eq!(s.spec_stats().accepted_per_pos, vec![1, 1, 0, 0]);
    s.check_invariants();
    // The next step starts right after the accepted run.
    let plan = s.schedule(Some(2.0)).clone();
    assert_eq!(plan.positions[0], 14);
    assert_eq!(plan.input_ids[0], 0);
    s.check_invariants();
}

#[test]
fn a_short_match_proposes_little_and_a_longer_one_proposes_through_the_backoff() {
    let mut s = sched(64, 4, 4);
    // Short matches: one proposed token for a 1-token match (not the 4 that followed it).
    let prompt = [5, 1, 2, 3, 4, 9, 7, 8, 6, 9];
    s.add_request("a", &prompt, params(30)).unwrap();
    s.schedule(Some(0.0));
    s.update(&[5]).unwrap();
    // "9 5" matches nothing, "5" matches at 0: a 1-token match proposes one token.
    let plan = s.schedule(Some(1.0)).clone();
    assert_eq!(plan.sample_draft, vec![1, -1]);
    // Rejected: the model says 0. One miss: the sequence backs off a step.
    s.update(&[0, 1]).unwrap();
    assert_eq!(s.output_token_ids(0).unwrap(), &[5, 0]);
    assert!(s.seqs[0].spec.cooldown > 0);
    // Backing off: "0" matches nothing, no proposal ...
    let plan = s.schedule(Some(2.0)).clone();
    assert_eq!(plan.sample_draft, vec![-1]);
    s.update(&[7]).unwrap();
    // ... then, backed off, "7" (at 6) is a 1-token match: one token.
    assert_eq!(s.seqs[0].spec.cooldown, 0);
    let plan = s.schedule(Some(3.0)).clone();
    assert_eq!(plan.sample_draft, vec![8, -1]);
    s.update(&[3, 3]).unwrap(); // rejected again: a longer backoff
    let cool = s.seqs[0].spec.cooldown;
    assert!(cool > 1, "{cool}");
    // Backing off, "3" alone (a 1-token match) does not propose; then "3 4" (at 3..5) does: a
    // 2-token match proposes while backing off, at the sequence's length (1 after misses).
    let plan = s.schedule(Some(4.0)).clone();
    assert_eq!(plan.sample_draft, vec![-1]);
    s.update(&[4]).unwrap();
    let plan = s.schedule(Some(5.0)).clone();
    assert_eq!(plan.sample_draft, vec![9, -1]);
    s.update(&[9, 7]).unwrap();
    assert!(s.seqs[0].spec.cooldown > 0 && s.seqs[0].spec.cooldown < cool);
    // "4 9 7" matches 3 tokens: the whole length (3 after the hit), still backing off.
    let plan = s.schedule(Some(6.0)).clone();
    assert_eq!(plan.sample_draft, vec![8, 6, 9, -1]);
    s.update(&[8, 6, 9, 5]).unwrap();
    assert_eq!(
        s.output_token_ids(0).unwrap(),
        &[5, 0, 7, 3, 4, 9, 7, 8, 6, 9, 5]
    );
    // "6 9 5": k grown to the cap.
    let plan = s.schedule(Some(7.0)).clone();
    assert_eq!(plan.sample_draft, vec![0, 7, 3, 4, -1]);
    s.check_invariants();
}

#[test]
fn stop_tokens_and_max_tokens_cut_an_accepted_run() {
    let mut s = sched(32, 4, 4);
    let prompt = [1, 2, 3, 4, 5, 6, 1, 2];
    let p = RequestParams {
        eos_token_ids: vec![5],
        ..params(20)
    };
    s.add_request("a", &prompt, p).unwrap();
    s.schedule(Some(0.0));
    s.update(&[3]).unwrap();
    let plan = s.schedule(Some(1.0)).clone();
    assert_eq!(plan.sample_draft, vec![4, 5, 6, 1, -1]);
    // 4 accepted, then 5 is EOS: the run ends there although 5 was the proposal too.
    let fin = s.update(&[4, 5, 6, 1, 2]).unwrap();
    assert_eq!(fin.len(), 1);
    assert_eq!(s.emitted(), &[true, true, false, false, false]);
    assert_eq!(s.token_ids(0).unwrap().len(), prompt.len() + 3);
    s.check_invariants();

    // max_tokens 3, one generated: one proposal (2 tokens with the row after it).
    s.add_request("b", &prompt, params(3)).unwrap();
    s.schedule(Some(2.0));
    s.update(&[3]).unwrap();
    let plan = s.schedule(Some(3.0)).clone();
    assert_eq!(plan.sample_draft, vec![4, -1]);
    let fin = s.update(&[4, 5]).unwrap();
    assert!(matches!(fin[0].2, FinishReason::Length));
    assert_eq!(s.output_token_ids(fin[0].1).unwrap(), &[3, 4, 5]);
    s.check_invariants();
    assert_eq!(
        s.stats().blocks.used,
        0,
        "every block is back (free or cached)"
    );
}

#[test]
fn min_tokens_bans_stop_on_each_verified_row() {
    let mut s = sched(32, 4, 4);
    let p = RequestParams {
        min_tokens: 3,
        eos_token_ids: vec![9],
        ..params(20)
    };
    s.add_request("a", &[1, 2, 3, 4, 5, 6, 1, 2], p).unwrap();
    s.schedule(Some(0.0));
    s.update(&[3]).unwrap();
    let plan = s.schedule(Some(1.0)).clone();
    // One token generated; rows sample tokens 2, 3, 4, ...: the first two may not stop.
    assert_eq!(plan.sample_ban_stop, vec![true, true, false, false, false]);
}

#[test]
fn speculation_stays_off_where_it_must() {
    let mut s = sched(32, 4, 4);
    let prompt = [1, 2, 3, 4, 1, 2];
    let off = RequestParams {
        speculate: false,
        ..params(8)
    };
    s.add_request("off", &prompt, off).unwrap();
    s.schedule(Some(0.0));
    s.update(&[3]).unwrap();
    let plan = s.schedule(Some(1.0)).clone();
    assert_eq!(plan.sample_draft, vec![-1]);
    // Past max_batch_tokens running sequences: a compute-bound batch never speculates.
    let mut s = sched(64, 4, 4);
    s.set_speculation(Some(SpecConfig {
        max_batch_tokens: 2,
        ..spec(4)
    }))
    .unwrap();
    for id in ["a", "b"] {
        s.add_request(id, &prompt, params(8)).unwrap();
    }
    s.schedule(Some(0.0));
    s.update(&[3, 3]).unwrap();
    let plan = s.schedule(Some(1.0)).clone();
    assert_eq!(plan.num_tokens(), 2);
    assert!(plan.sample_draft.iter().all(|&d| d < 0));
    // The engine's per-step budget: 0 pauses speculation, n caps the step's proposals (in
    // running order), None lifts the limit again.
    let mut s = sched(64, 4, 4);
    for id in ["a", "b"] {
        s.add_request(id, &prompt, params(12)).unwrap();
    }
    s.schedule(Some(0.0));
    s.update(&[3, 3]).unwrap();
    let proposals = |p: &Plan| p.sample_draft.iter().filter(|&&d| d >= 0).count();
    s.set_spec_budget(Some(0));
    let plan = s.schedule(Some(1.0)).clone();
    assert_eq!((plan.num_tokens(), proposals(&plan)), (2, 0));
    s.update(&[4, 4]).unwrap();
    s.set_spec_budget(Some(3));
    let plan = s.schedule(Some(2.0)).clone();
    assert_eq!(proposals(&plan), 3);
    assert_eq!(plan.num_tokens(), 5);
    // All accepted, then "1": each sequence's suffix occurs earlier again.
    let sampled: Vec<i64> = plan.sample_draft.iter().map(|&d| d.max(1)).collect();
    s.update(&sampled).unwrap();
    s.set_spec_budget(None);
    let plan = s.schedule(Some(3.0)).clone();
    assert!(proposals(&plan) > 3, "{:?}", plan.sample_draft);
    // Bad settings name the field.
    let err = s.set_speculation(Some(SpecConfig {
        prompt_lookup_min: 5,
        ..spec(4)
    }));
    assert!(matches!(err, Err(CoreError::InvalidArgument { .. })));
}

/// Writes and checks a plan the way a forward reads it: the context (positions < ctx) must
/// hold the hashes of the sequence's own verified prefix; query rows write the hash of the
/// prefix they were given, proposals included (so a rejected proposal's KV is wrong KV).
fn run_plan(s: &Scheduler, plan: &Plan, kv: &mut [u64], bs: usize) {
    let bt = s.block_tables();
    let w = plan.block_table_width;
    for pair in plan.cow_pairs.chunks(2) {
        let (src, dst) = (pair[0] as usize * bs, pair[1] as usize * bs);
        kv.copy_within(src..src + bs, dst);
    }
    for b in 0..plan.num_seqs() {
        let slot = plan.seq_slots[b] as Slot;
        let tokens = s.token_ids(slot).unwrap();
        let (q0, q1) = (
            plan.query_start_loc[b] as usize,
            plan.query_start_loc[b + 1] as usize,
        );
        let ctx = plan.context_lens[b] as usize;
        let at = |pos: usize| bt[b * w + pos / bs] as usize * bs + pos % bs;
        let mut h = 1;
        for (pos, &t) in tokens[..ctx].iter().enumerate() {
            h = kv_hash(h, t);
            assert_eq!(
                kv[at(pos)],
                h,
                "slot {slot} pos {pos}: wrong KV in the context"
            );
        }
        for row in q0..q1 {
            let pos = plan.positions[row] as usize;
            assert_eq!(pos, ctx + row - q0);
            assert_eq!(plan.slot_mapping[row] as usize, at(pos));
            if pos < tokens.len() {
                assert_eq!(plan.input_ids[row], tokens[pos] as i64);
            }
            h = kv_hash(h, plan.input_ids[row] as u32);
            kv[at(pos)] = h;
        }
    }
}

#[test]
fn randomized_accept_reject_cycles_keep_blocks_and_cache_exact() {
    let mut accepted_any = 0;
    for seed in 0..60u64 {
        let mut rng = Rng(seed);
        let bs = [1, 2, 4, 8][rng.index(4)];
        let num_blocks = 12 + rng.index(40);
        let mut s = Scheduler::new(SchedulerConfig {
            num_blocks,
            block_size: bs,
            max_num_seqs: 1 + rng.index(6),
            max_num_batched_tokens: 8 + rng.index(32),
            max_model_len: 64,
            policy: Policy::Fcfs,
            enable_prefix_caching: rng.chance(80),
            max_queue_len: None,
        })
        .unwrap();
        s.set_speculation(Some(SpecConfig {
            num_speculative_tokens: 1 + rng.index(6),
            prompt_lookup_max: 1 + rng.index(3),
            prompt_lookup_min: 1,
            max_batch_tokens: 4 + rng.index(40),
            external: false,
        }))
        .unwrap();
        let mut kv = vec![u64::MAX; num_blocks * bs];
        let base: Vec<u32> = (0..16).map(|_| rng.below(6) as u32).collect();
        for step in 0..300 {
            if rng.chance(25) {
                let mut prompt = base[..1 + rng.index(15)].to_vec();
                prompt.push(rng.below(6) as u32);
                let max_tokens = 1 + rng.index(20);
                let p = RequestParams {
                    max_tokens,
                    min_tokens: rng.index(3).min(max_tokens),
                    n: if rng.chance(15) { 2 } else { 1 },
                    eos_token_ids: vec![7],
                    ..params(1)
                };
                let id = format!("r{seed}-{step}");
                match s.add_request(&id, &prompt, p) {
                    Ok(_) | Err(CoreError::RequestTooLarge(_)) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            if rng.chance(3) {
                s.finish(rng.index(s.num_slots().max(1)) as Slot);
            }
            // The engine's cost model changes the step's proposal budget at will.
            let budget = match rng.index(4) {
                0 => None,
                1 => Some(0),
                _ => Some(rng.index(12)),
            };
            s.set_spec_budget(budget);
            let plan = s.schedule(Some(step as f64)).clone();
            assert!(plan.num_tokens() <= s.config().max_num_batched_tokens);
            let proposed = plan.sample_draft.iter().filter(|&&d| d >= 0).count();
            assert!(
                proposed <= budget.unwrap_or(usize::MAX),
                "over the step's budget"
            );
            run_plan(&s, &plan, &mut kv, bs);
            if rng.chance(3) {
                continue; // never updated: rolled back (preempted) by the next schedule
            }
            // The "model" agrees with a proposal most of the time, else says something else
            // (sometimes EOS), as a verifier would.
            let sampled: Vec<i64> = plan
                .sample_draft
                .iter()
                .map(|&d| match (d >= 0 && rng.chance(70), rng.chance(5)) {
                    (true, _) => d,
                    (false, true) => 7,
                    _ => rng.below(6) as i64,
                })
                .collect();
            s.update(&sampled).unwrap();
            // Rows after a rejected proposal are never appended.
            for (r, &e) in s.emitted().iter().enumerate() {
                if e && r > 0 && plan.sample_slots[r] == plan.sample_slots[r - 1] {
                    assert_eq!(sampled[r - 1], plan.sample_draft[r - 1]);
                }
            }
            s.check_invariants();
            // Blocks held by running sequences are exactly what their verified tokens need.
            for &slot in &s.running {
                let q = &s.seqs[slot as usize];
                if q.status == Status::Running {
                    assert!(q.blocks.len() <= q.computed.div_ceil(bs), "lookahead kept");
                }
            }
        }
        accepted_any += s.spec_stats().num_accepted_tokens;
        // Drain: every block comes back.
        for _ in 0..500 {
            if !s.has_unfinished() {
                break;
            }
            let plan = s.schedule(None).clone();
            run_plan(&s, &plan, &mut kv, bs);
            let sampled: Vec<i64> = plan.sample_draft.iter().map(|&d| d.max(1)).collect();
            s.update(&sampled).unwrap();
            s.check_invariants();
        }
        assert!(!s.has_unfinished());
        assert_eq!(s.stats().blocks.used, 0, "seed {seed}: a block leaked");
        assert!(s.reset_prefix_cache());
        assert_eq!(s.stats().blocks.free, num_blocks);
    }
    assert!(accepted_any > 100, "the run must actually accept proposals");
}

#[test]
fn external_proposals_fill_the_reserved_rows_and_roll_back_like_ngram_ones() {
    let mut s = Scheduler::new(super::tests::cfg(32, 2)).unwrap();
    s.set_speculation(Some(SpecConfig {
        external: true,
        ..spec(3)
    }))
    .unwrap();
    let prompt = [7, 8, 9];
    s.add_request("a", &prompt, params(20)).unwrap();
    s.schedule(Some(0.0));
    assert!(
        s.set_proposals(&[]).is_ok(),
        "a prefill has no proposal row"
    );
    s.update(&[1]).unwrap();
    assert!(matches!(
        s.set_proposals(&[1]),
        Err(CoreError::InvalidArgument { .. })
    ));
    let plan = s.schedule(Some(1.0)).clone();
    // Three rows reserved with the last token as placeholder, blocks grown for them.
    assert_eq!(plan.input_ids, vec![1, 1, 1, 1]);
    assert_eq!(plan.sample_draft, vec![1, 1, 1, -1]);
    assert_eq!(plan.seq_lens, vec![7]);
    assert!(matches!(
        s.set_proposals(&[2, 3]),
        Err(CoreError::InvalidArgument { .. })
    ));
    assert!(s.set_proposals(&[2, 3, -1]).is_err());
    s.set_proposals(&[2, 3, 4]).unwrap();
    assert_eq!(s.plan().input_ids, vec![1, 2, 3, 4]);
    assert_eq!(s.plan().sample_draft, vec![2, 3, 4, -1]);
    // 2 accepted, then 5 instead of 3: 2 5 appended, the rest rolled back.
    s.update(&[2, 5, 4, 6]).unwrap();
    assert_eq!(s.emitted(), &[true, true, false, false]);
    assert_eq!(s.output_token_ids(0).unwrap(), &[1, 2, 5]);
    assert_eq!(s.seqs[0].computed, 5);
    assert_eq!(s.seqs[0].blocks.len(), 3);
    assert_eq!(s.spec_stats().num_accepted_tokens, 1);
    s.check_invariants();
}
