//! Tests of the virtual token counters and of the `fair` queue order against a model.

use super::*;
use crate::sched::queue::{Policy, QueueParams, RequestQueue};
use crate::test_rng::Rng;

fn weights(w: &[(&str, f64)]) -> FairConfig {
    FairConfig {
        tenant_weights: w.iter().map(|&(n, w)| (n.to_string(), w)).collect(),
        ..FairConfig::default()
    }
}

#[test]
fn charge_divides_by_the_share_and_weighs_tokens() {
    let mut v = Vtc::new(FairConfig {
        input_token_weight: 1.0,
        output_token_weight: 2.0,
        ..weights(&[("a", 2.0)])
    });
    let (a, b) = (v.id("a"), v.id("b"));
    assert_eq!(v.id(""), 0);
    v.join(a);
    v.join(b);
    v.charge(a, 10, 5);
    v.charge(b, 10, 5);
    assert_eq!(v.counter(a), 10.0);
    assert_eq!(v.counter(b), 20.0);
    let s = v.stats();
    assert_eq!((s[1].input_tokens, s[1].output_tokens), (10, 5));
}

#[test]
fn arrivals_are_lifted_to_the_active_minimum() {
    let mut v = Vtc::default();
    let (a, b, c) = (v.id("a"), v.id("b"), v.id("c"));
    v.join(a);
    v.join(b);
    v.charge(a, 100, 0);
    v.charge(b, 40, 0);
    // c arrives late: it starts where the least served active tenant stands, not at 0.
    assert_eq!(v.join(c), (0.0, 40.0));
    // b goes idle, gets nothing for a while, comes back: no credit banked while away.
    v.leave(b);
    v.charge(c, 200, 0);
    assert_eq!(v.join(b).1, 100.0); // min(a = 100, c = 240)
                                    // A tenant ahead of the minimum keeps its counter.
    v.leave(a);
    assert_eq!(v.join(a).1, 100.0);
    // Everyone leaves, c (240) last: the next arrival starts where the last active tenant
    // stood, as in the paper.
    v.leave(a);
    v.leave(b);
    v.leave(c);
    let d = v.id("d");
    assert_eq!(v.join(d).1, 240.0);
}

#[test]
fn invalid_weights_name_the_parameter() {
    let bad = weights(&[("a", 0.0)]).validate().unwrap_err();
    assert!(bad.to_string().contains("tenant_weights"), "{bad}");
    let bad = FairConfig {
        output_token_weight: f64::NAN,
        ..FairConfig::default()
    };
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("output_token_weight"));
}

/// The `fair` queue against a sorted-Vec model with several tenants, priorities, charges,
/// joins/leaves (as the scheduler does them), removes and timeouts. Also checks that counters
/// never decrease, the floor never decreases, and every join lifts to the active minimum.
#[test]
fn randomized_fair_queue_against_model() {
    let mut rng = Rng(7);
    let mut q: RequestQueue<u32> = RequestQueue::with_vtc(
        Policy::Fair,
        None,
        Vtc::new(weights(&[("t1", 2.0), ("t3", 0.5)])),
    );
    let tenants: Vec<TenantId> = (0..5).map(|i| q.tenant_id(&format!("t{i}"))).collect();
    // (id, params, seq)
    let mut model: Vec<(u32, QueueParams, u64)> = Vec::new();
    let (mut id, mut seq, mut now) = (0u32, 0u64, 0.0f64);
    let mut last = vec![0.0f64; q.vtc().num_tenants()];
    let mut floor = 0.0;
    let mut pops = 0;
    for _ in 0..60_000 {
        match rng.below(8) {
            0..=2 => {
                let t = tenants[rng.index(tenants.len())];
                let p = QueueParams {
                    priority: rng.below(3) as i64,
                    arrival: now + rng.below(3) as f64,
                    deadline: None,
                    queue_timeout: rng.chance(20).then(|| rng.below(30) as f64),
                    tenant: t,
                };
                let was_active = q.vtc().is_active(t);
                let before = q.vtc().counter(t);
                let min_other = q.vtc().floor();
                q.push(id, p).unwrap();
                q.tenant_join(t);
                if !was_active {
                    assert_eq!(q.vtc().counter(t), before.max(min_other), "lift");
                } else {
                    assert_eq!(q.vtc().counter(t), before);
                }
                model.push((id, p, seq));
                id += 1;
                seq += 1;
            }
            3 => {
                let vtc = q.vtc();
                let key = |(_, p, s): &(u32, QueueParams, u64)| {
                    let c = crate::sched::ord::OrdF64(vtc.counter(p.tenant));
                    (
                        p.priority,
                        c,
                        p.tenant,
                        crate::sched::ord::OrdF64(p.arrival),
                        *s,
                    )
                };
                let want = model
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, e)| key(e))
                    .map(|(i, _)| i);
                assert_eq!(q.peek().copied(), want.map(|i| model[i].0));
                assert_eq!(q.pop(), want.map(|i| model[i].0));
                if let Some(i) = want {
                    let (_, p, _) = model.swap_remove(i);
                    pops += 1;
                    // Served, then done: charge like a short request and leave.
                    q.charge(p.tenant, rng.below(20) as usize, 1 + rng.below(8) as usize);
                    q.tenant_leave(p.tenant);
                }
            }
            4 => {
                // Charges with waiting work re-rank the tenant.
                let t = tenants[rng.index(tenants.len())];
                q.charge(t, rng.below(10) as usize, rng.below(3) as usize);
            }
            5 => {
                if !model.is_empty() {
                    let (victim, p, _) = model.swap_remove(rng.index(model.len()));
                    assert!(q.remove(&victim));
                    q.tenant_leave(p.tenant);
                }
            }
            _ => {
                now += 1.0;
                let expired = q.expire(now);
                for e in &expired {
                    let i = model.iter().position(|m| m.0 == *e).expect("queued");
                    let (_, p, _) = model.swap_remove(i);
                    assert!(p.queue_timeout.is_some_and(|t| now > p.arrival + t));
                    q.tenant_leave(p.tenant);
                }
                assert!(!model
                    .iter()
                    .any(|(_, p, _)| p.queue_timeout.is_some_and(|t| now > p.arrival + t)));
            }
        }
        assert_eq!(q.len(), model.len());
        for (t, l) in last.iter_mut().enumerate() {
            let c = q.vtc().counter(t as TenantId);
            assert!(c >= *l, "tenant {t}: counter went down");
            *l = c;
        }
        assert!(q.vtc().floor() >= floor, "floor went down");
        floor = q.vtc().floor();
        assert_eq!(
            q.iter().count(),
            model.len(),
            "iter lists every waiting request"
        );
    }
    assert!(pops > 5_000, "{pops}");
}
