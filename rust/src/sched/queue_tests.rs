//! Tests of the request queue: policies, timeouts, removal.

use super::*;

fn p(priority: i64, arrival: f64) -> QueueParams {
    QueueParams {
        priority,
        arrival,
        ..Default::default()
    }
}

fn drain(q: &mut RequestQueue<&'static str>) -> Vec<&'static str> {
    std::iter::from_fn(|| q.pop()).collect()
}

#[test]
fn fcfs_orders_by_arrival_then_push() {
    let mut q = RequestQueue::new(Policy::Fcfs, None);
    q.push("b", p(5, 2.0)).unwrap();
    q.push("a", p(9, 1.0)).unwrap();
    q.push("c", p(0, 2.0)).unwrap();
    assert_eq!(q.peek(), Some(&"a"));
    assert_eq!(drain(&mut q), ["a", "b", "c"]);
}

#[test]
fn priority_lower_value_first_then_arrival() {
    let mut q = RequestQueue::new(Policy::Priority, None);
    q.push("late-urgent", p(-1, 5.0)).unwrap();
    q.push("early", p(0, 1.0)).unwrap();
    q.push("low", p(3, 0.0)).unwrap();
    q.push("early2", p(0, 2.0)).unwrap();
    assert_eq!(drain(&mut q), ["late-urgent", "early", "early2", "low"]);
}

#[test]
fn deadline_earliest_first_rest_by_arrival() {
    let mut q = RequestQueue::new(Policy::Deadline, None);
    let d = |arrival, deadline| QueueParams {
        arrival,
        deadline,
        ..Default::default()
    };
    q.push("none-early", d(0.0, None)).unwrap();
    q.push("d-late", d(1.0, Some(10.0))).unwrap(); // 11
    q.push("d-soon", d(2.0, Some(1.0))).unwrap(); // 3
    q.push("none-late", d(3.0, None)).unwrap();
    assert_eq!(
        drain(&mut q),
        ["d-soon", "d-late", "none-early", "none-late"]
    );
}

#[test]
fn push_front_goes_first_except_under_priority() {
    let mut q = RequestQueue::new(Policy::Fcfs, None);
    q.push("a", p(0, 0.0)).unwrap();
    q.push("b", p(0, 1.0)).unwrap();
    q.push_front("x", p(0, 5.0));
    q.push_front("y", p(0, 6.0));
    assert_eq!(drain(&mut q), ["y", "x", "a", "b"]);

    let mut q = RequestQueue::new(Policy::Priority, None);
    q.push("urgent", p(0, 9.0)).unwrap();
    q.push_front("victim", p(5, 0.0));
    q.push("lazy", p(9, 0.0)).unwrap();
    assert_eq!(drain(&mut q), ["urgent", "victim", "lazy"]);
}

#[test]
fn remove_and_contains_and_errors() {
    let mut q = RequestQueue::new(Policy::Fcfs, Some(2));
    q.push("a", p(0, 0.0)).unwrap();
    assert_eq!(
        q.push("a", p(0, 0.0)),
        Err(CoreError::DuplicateRequest("\"a\"".into()))
    );
    q.push("b", p(0, 1.0)).unwrap();
    assert!(q.is_full());
    assert_eq!(
        q.push("c", p(0, 2.0)),
        Err(CoreError::QueueFull { max_len: 2 })
    );
    // push_front ignores max_len: preempted requests always go back.
    q.push_front("p", p(0, 3.0));
    assert_eq!(q.len(), 3);
    assert!(q.contains(&"a"));
    assert!(q.remove(&"a"));
    assert!(!q.remove(&"a"));
    assert!(!q.contains(&"a"));
    assert_eq!(drain(&mut q), ["p", "b"]);
    assert!(q.is_empty());
    let bad = QueueParams {
        queue_timeout: Some(-1.0),
        ..Default::default()
    };
    assert!(matches!(
        q.push("z", bad),
        Err(CoreError::InvalidArgument {
            name: "queue_timeout",
            ..
        })
    ));
    let bad = QueueParams {
        arrival: f64::NAN,
        ..Default::default()
    };
    assert!(q.push("z", bad).is_err());
}

#[test]
fn expire_only_touches_expired() {
    let mut q = RequestQueue::new(Policy::Fcfs, None);
    let t = |arrival, queue_timeout| QueueParams {
        arrival,
        queue_timeout,
        ..Default::default()
    };
    q.push("a", t(0.0, Some(1.0))).unwrap();
    q.push("b", t(0.0, Some(5.0))).unwrap();
    q.push("c", t(0.0, None)).unwrap();
    q.push("d", t(0.5, Some(0.2))).unwrap();
    assert_eq!(q.next_expiry(), Some(0.7));
    assert!(q.expire(0.7).is_empty()); // not yet *past*
    assert_eq!(q.expire(2.0), ["d", "a"]);
    assert!(q.remove(&"b"));
    assert!(q.expire(100.0).is_empty());
    assert_eq!(drain(&mut q), ["c"]);
    // push_front drops the timeout.
    q.push_front("e", t(0.0, Some(0.0)));
    assert!(q.expire(10.0).is_empty());
    assert_eq!(q.len(), 1);
}

#[test]
fn policy_parse() {
    assert_eq!("priority".parse::<Policy>().unwrap(), Policy::Priority);
    assert_eq!(Policy::Deadline.as_str(), "deadline");
    assert!("lifo".parse::<Policy>().is_err());
}

#[test]
fn randomized_against_sorted_vec_model() {
    // A model queue: a Vec of (key tuple, id), sorted on pop. 100k operations.
    let mut rng = 0x9E3779B97F4A7C15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for policy in [
        Policy::Fcfs,
        Policy::Priority,
        Policy::Deadline,
        Policy::Fair,
    ] {
        let mut q: RequestQueue<u32> = RequestQueue::new(policy, None);
        let mut model: Vec<(u32, QueueParams, u64)> = Vec::new();
        let mut seq = 0u64;
        let mut now = 0.0f64;
        let mut id = 0u32;
        for _ in 0..35_000 {
            match next() % 6 {
                0..=2 => {
                    let params = QueueParams {
                        priority: (next() % 4) as i64,
                        arrival: now + (next() % 3) as f64,
                        deadline: (next() % 2 == 0).then(|| (next() % 10) as f64),
                        queue_timeout: (next() % 3 == 0).then(|| (next() % 20) as f64),
                        tenant: 0,
                    };
                    q.push(id, params).unwrap();
                    model.push((id, params, seq));
                    seq += 1;
                    id += 1;
                }
                3 => {
                    let key = |(_, p, s): &(u32, QueueParams, u64)| match policy {
                        Policy::Fcfs => (0, OrdF64(p.arrival), *s),
                        Policy::Priority => (p.priority, OrdF64(p.arrival), *s),
                        // One tenant, counters never charged: priority order.
                        Policy::Fair => (p.priority, OrdF64(p.arrival), *s),
                        Policy::Deadline => match p.deadline {
                            Some(d) => (0, OrdF64(p.arrival + d), *s),
                            None => (1, OrdF64(p.arrival), *s),
                        },
                    };
                    let best = model.iter().enumerate().min_by_key(|(_, e)| key(e));
                    let want = best.map(|(i, _)| i);
                    let got = q.pop();
                    assert_eq!(got, want.map(|i| model[i].0));
                    if let Some(i) = want {
                        model.swap_remove(i);
                    }
                }
                4 => {
                    if !model.is_empty() {
                        let i = (next() as usize) % model.len();
                        let (victim, ..) = model.swap_remove(i);
                        assert!(q.remove(&victim));
                    }
                }
                _ => {
                    now += 1.0;
                    let mut got = q.expire(now);
                    let mut want: Vec<u32> = model
                        .iter()
                        .filter(|(_, p, _)| p.queue_timeout.is_some_and(|t| now > p.arrival + t))
                        .map(|e| e.0)
                        .collect();
                    model.retain(|(_, p, _)| !p.queue_timeout.is_some_and(|t| now > p.arrival + t));
                    got.sort_unstable();
                    want.sort_unstable();
                    assert_eq!(got, want);
                }
            }
            assert_eq!(q.len(), model.len());
        }
    }
}
