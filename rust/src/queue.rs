//! Waiting-request queue under one policy: `fcfs`, `priority` or `deadline`.
//!
//! Entries live in a `BTreeMap` ordered by a policy key, plus a hash map from id to key, so
//! push, pop, remove-by-id (abort) are O(log n) and never scan. Requests that carry a timeout
//! are also kept in a second `BTreeMap` ordered by expiry, so `expire` only touches the expired.
//!
//! Ordering:
//! - `fcfs`: arrival time, then push order.
//! - `priority`: lower `priority` value first, then arrival.
//! - `deadline`: requests with a deadline first, earliest absolute deadline (arrival + deadline)
//!   first; the rest by arrival.
//!
//! `push_front` (a preempted request going back) puts an entry ahead of every normal entry under
//! `fcfs` and `deadline` (the most recent `push_front` first); under `priority` the entry simply
//! re-enters at its (priority, arrival) rank, so it never jumps a more important request.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Instant;

use crate::error::CoreError;

/// The core's monotonic clock in seconds (shared with Python as `ironlm._core.monotonic()`).
pub fn monotonic() -> f64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    #[default]
    Fcfs,
    Priority,
    Deadline,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
            Policy::Deadline => "deadline",
        }
    }
}

impl FromStr for Policy {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            "deadline" => Ok(Policy::Deadline),
            _ => Err(CoreError::invalid(
                "policy",
                format!("expected 'fcfs', 'priority' or 'deadline', got {s:?}"),
            )),
        }
    }
}

/// A float with a total order (times are validated finite before they get here).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OrdF64(pub f64);

impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// What the queue needs to know about a request. Times in seconds; `deadline` and `timeout`
/// are relative to `arrival`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct QueueParams {
    pub priority: i64,
    pub arrival: f64,
    pub deadline: Option<f64>,
    pub timeout: Option<f64>,
}

impl QueueParams {
    /// Checks that every time is finite and the timeout is not negative.
    pub fn validate(&self) -> Result<(), CoreError> {
        if !self.arrival.is_finite() {
            return Err(CoreError::invalid(
                "arrival_time",
                "must be a finite number",
            ));
        }
        if let Some(d) = self.deadline {
            if !d.is_finite() {
                return Err(CoreError::invalid("deadline", "must be a finite number"));
            }
        }
        if let Some(t) = self.timeout {
            if !t.is_finite() || t < 0.0 {
                return Err(CoreError::invalid(
                    "timeout",
                    format!("must be >= 0, got {t}"),
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    /// 0 for normal entries; push_front entries get decreasing negative bands.
    band: i64,
    /// Priority (`priority`), has-no-deadline flag (`deadline`), 0 (`fcfs`).
    class: i64,
    /// Arrival (`fcfs`, `priority`) or absolute deadline (`deadline` with one).
    time: OrdF64,
    /// Push order: unique, so keys never collide.
    seq: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    key: Key,
    expires: Option<(OrdF64, u64)>,
}

#[derive(Debug, Clone)]
pub struct RequestQueue<K> {
    policy: Policy,
    max_len: Option<usize>,
    order: BTreeMap<Key, K>,
    expiry: BTreeMap<(OrdF64, u64), K>,
    entries: HashMap<K, Entry>,
    next_seq: u64,
    next_front: i64,
}

impl<K: Hash + Eq + Clone> RequestQueue<K> {
    pub fn new(policy: Policy, max_len: Option<usize>) -> Self {
        Self {
            policy,
            max_len,
            order: BTreeMap::new(),
            expiry: BTreeMap::new(),
            entries: HashMap::new(),
            next_seq: 0,
            next_front: 0,
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    pub fn max_len(&self) -> Option<usize> {
        self.max_len
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains<Q>(&self, id: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.entries.contains_key(id)
    }

    /// True if `push` would fail with `QueueFull`.
    pub fn is_full(&self) -> bool {
        self.max_len.is_some_and(|m| self.len() >= m)
    }

    /// Queue a new request. Fails with `QueueFull` beyond `max_len`, `DuplicateRequest` when
    /// `id` is already queued (reported with `describe(id)`).
    pub fn push(&mut self, id: K, p: QueueParams) -> Result<(), CoreError>
    where
        K: std::fmt::Debug,
    {
        p.validate()?;
        if self.entries.contains_key(&id) {
            return Err(CoreError::DuplicateRequest(format!("{id:?}")));
        }
        if let Some(max_len) = self.max_len {
            if self.len() >= max_len {
                return Err(CoreError::QueueFull { max_len });
            }
        }
        self.insert(id, p, false);
        Ok(())
    }

    /// Put a request back ahead of the normal entries (see the module docs), ignoring
    /// `max_len` and any timeout: it already started. Replaces an existing entry for `id`.
    pub fn push_front(&mut self, id: K, p: QueueParams) {
        self.remove(&id);
        let p = QueueParams { timeout: None, ..p };
        self.insert(id, p, true);
    }

    /// Queue `id` at its normal rank (keeping its timeout) without the `max_len` check.
    /// Replaces an existing entry for `id`.
    pub fn reinsert(&mut self, id: K, p: QueueParams) {
        self.remove(&id);
        self.insert(id, p, false);
    }

    fn insert(&mut self, id: K, p: QueueParams, front: bool) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let band = if front && self.policy != Policy::Priority {
            self.next_front -= 1;
            self.next_front
        } else {
            0
        };
        let (class, time) = match self.policy {
            Policy::Fcfs => (0, p.arrival),
            Policy::Priority => (p.priority, p.arrival),
            Policy::Deadline => match p.deadline {
                Some(d) => (0, p.arrival + d),
                None => (1, p.arrival),
            },
        };
        let key = Key {
            band,
            class,
            time: OrdF64(time),
            seq,
        };
        let expires = p.timeout.map(|t| (OrdF64(p.arrival + t), seq));
        self.order.insert(key, id.clone());
        if let Some(e) = expires {
            self.expiry.insert(e, id.clone());
        }
        self.entries.insert(id, Entry { key, expires });
    }

    /// The next request in policy order.
    pub fn peek(&self) -> Option<&K> {
        self.order.first_key_value().map(|(_, id)| id)
    }

    pub fn pop(&mut self) -> Option<K> {
        let (_, id) = self.order.pop_first()?;
        if let Some(e) = self.entries.remove(&id) {
            if let Some(x) = e.expires {
                self.expiry.remove(&x);
            }
        }
        Some(id)
    }

    /// Remove `id` wherever it is; false if it is not queued. O(log n).
    pub fn remove<Q>(&mut self, id: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        match self.entries.remove(id) {
            Some(e) => {
                self.order.remove(&e.key);
                if let Some(x) = e.expires {
                    self.expiry.remove(&x);
                }
                true
            }
            None => false,
        }
    }

    /// The earliest time at which some queued request times out.
    pub fn next_expiry(&self) -> Option<f64> {
        self.expiry.first_key_value().map(|((t, _), _)| t.0)
    }

    /// Remove the requests whose timeout has passed (`now > arrival + timeout`), appending
    /// them to `out` in expiry order. O(expired · log n).
    pub fn expire_into(&mut self, now: f64, out: &mut Vec<K>) {
        while let Some(((t, _), _)) = self.expiry.first_key_value() {
            if now <= t.0 {
                break;
            }
            let (_, id) = self.expiry.pop_first().expect("non-empty");
            if let Some(e) = self.entries.remove(&id) {
                self.order.remove(&e.key);
            }
            out.push(id);
        }
    }

    pub fn expire(&mut self, now: f64) -> Vec<K> {
        let mut out = Vec::new();
        self.expire_into(now, &mut out);
        out
    }

    /// Ids in policy order.
    pub fn iter(&self) -> impl Iterator<Item = &K> + '_ {
        self.order.values()
    }

    pub fn clear(&mut self) {
        self.order.clear();
        self.expiry.clear();
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
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
            timeout: Some(-1.0),
            ..Default::default()
        };
        assert!(matches!(
            q.push("z", bad),
            Err(CoreError::InvalidArgument {
                name: "timeout",
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
        let t = |arrival, timeout| QueueParams {
            arrival,
            timeout,
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
        for policy in [Policy::Fcfs, Policy::Priority, Policy::Deadline] {
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
                            timeout: (next() % 3 == 0).then(|| (next() % 20) as f64),
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
                            .filter(|(_, p, _)| p.timeout.is_some_and(|t| now > p.arrival + t))
                            .map(|e| e.0)
                            .collect();
                        model.retain(|(_, p, _)| !p.timeout.is_some_and(|t| now > p.arrival + t));
                        got.sort_unstable();
                        want.sort_unstable();
                        assert_eq!(got, want);
                    }
                }
                assert_eq!(q.len(), model.len());
            }
        }
    }
}
