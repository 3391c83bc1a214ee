//! Conservative admission (`SchedulerOptions::reserve_decode`) against the default, which
//! admits what fits now and preempts when blocks run out.

use super::*;

fn run(reserve_decode: bool) -> (Scheduler, Vec<Vec<Slot>>, usize) {
    // 8 blocks of 4 tokens; three requests of 4 prompt tokens and 12 output tokens need 4
    // blocks each at the end: 12 in all, so only two can run to the end side by side.
    let c = SchedulerConfig {
        num_blocks: 8,
        block_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        policy: Policy::Fcfs,
        enable_prefix_caching: false,
        max_queue_len: None,
    };
    let opts = SchedulerOptions {
        reserve_decode,
        ..SchedulerOptions::default()
    };
    let mut s = Scheduler::with_options(c, opts).unwrap();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        let start = 100 * i as u32;
        let p = RequestParams {
            arrival_time: Some(i as f64),
            ..RequestParams::new(12)
        };
        s.add_request(id, &(start..start + 4).collect::<Vec<_>>(), p)
            .unwrap();
    }
    let (mut batches, mut finished) = (Vec::new(), 0);
    for _ in 0..200 {
        if finished == 3 {
            break;
        }
        let plan = s.schedule(Some(0.0)).clone();
        batches.push(plan.seq_slots.iter().map(|&x| x as Slot).collect());
        let sampled = vec![1; plan.num_samples()];
        finished += s.update(&sampled).unwrap().len();
        s.check_invariants();
    }
    (s, batches, finished)
}

#[test]
fn default_admits_all_and_preempts_when_blocks_run_out() {
    let (s, batches, finished) = run(false);
    assert_eq!(finished, 3);
    assert_eq!(batches[0], [0, 1, 2]);
    assert!(s.stats().num_preemptions > 0);
}

#[test]
fn conservative_admits_only_what_can_finish_and_never_preempts() {
    let (s, batches, finished) = run(true);
    assert_eq!(finished, 3);
    // c waits until the blocks a and b will still need are no longer promised to them.
    assert_eq!(batches[0], [0, 1]);
    assert!(batches.iter().any(|b| b.contains(&2)));
    assert_eq!(s.stats().num_preemptions, 0);
}
