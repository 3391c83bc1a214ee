//! Waiting-request queue under one policy: `fcfs`, `priority`, `deadline` or `fair`.
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
//! - `fair`: lower `priority` first; within a priority, the tenant with the smallest virtual
//!   token counter (`fair.rs`), then that tenant's own order (re-queued preempted ones first,
//!   then arrival). Each tenant has its own `BTreeMap`, and the tenants with waiting requests
//!   sit in a `BTreeSet` keyed by (head priority, counter), re-keyed whenever either changes:
//!   peek and pop stay O(log n) however many requests one tenant queues.
//!
//! `push_front` (a preempted request going back) puts an entry ahead of every normal entry under
//! `fcfs` and `deadline` (the most recent `push_front` first); under `priority` the entry simply
//! re-enters at its (priority, arrival) rank, so it never jumps a more important request.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::Hash;
use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Instant;

use crate::error::CoreError;
use crate::sched::fair::{TenantId, Vtc};
use crate::sched::ord::OrdF64;

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
    Fair,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
            Policy::Deadline => "deadline",
            Policy::Fair => "fair",
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
            "fair" => Ok(Policy::Fair),
            _ => Err(CoreError::invalid(
                "policy",
                format!("expected 'fcfs', 'priority', 'deadline' or 'fair', got {s:?}"),
            )),
        }
    }
}

/// What the queue needs to know about a request. Times in seconds; `deadline` and
/// `queue_timeout` are relative to `arrival`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct QueueParams {
    pub priority: i64,
    pub arrival: f64,
    pub deadline: Option<f64>,
    /// How long it may wait in the queue: the queue's to enforce, so it bounds waiting only.
    pub queue_timeout: Option<f64>,
    /// Its tenant (`RequestQueue::tenant_id`); 0 is the tenant "".
    pub tenant: TenantId,
}

impl QueueParams {
    /// Checks that every time is finite and the queue timeout is not negative.
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
        if let Some(t) = self.queue_timeout {
            if !t.is_finite() || t < 0.0 {
                return Err(CoreError::invalid(
                    "queue_timeout",
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
    tenant: TenantId,
}

/// (head priority, counter, tenant) of a tenant with waiting requests (`fair`).
type ReadyKey = (i64, OrdF64, TenantId);

#[derive(Debug, Clone)]
pub struct RequestQueue<K> {
    policy: Policy,
    max_len: Option<usize>,
    order: BTreeMap<Key, K>,
    expiry: BTreeMap<(OrdF64, u64), K>,
    entries: HashMap<K, Entry>,
    next_seq: u64,
    next_front: i64,
    /// Served-token counters, kept under every policy (per-tenant stats); only `fair` orders
    /// by them.
    vtc: Vtc,
    /// `fair`: each tenant's waiting requests (`order` stays empty).
    by_tenant: Vec<BTreeMap<Key, K>>,
    /// `fair`: the tenants with waiting requests.
    ready: BTreeSet<ReadyKey>,
}

impl<K: Hash + Eq + Clone> RequestQueue<K> {
    pub fn new(policy: Policy, max_len: Option<usize>) -> Self {
        Self::with_vtc(policy, max_len, Vtc::default())
    }

    pub fn with_vtc(policy: Policy, max_len: Option<usize>, vtc: Vtc) -> Self {
        Self {
            policy,
            max_len,
            order: BTreeMap::new(),
            expiry: BTreeMap::new(),
            entries: HashMap::new(),
            next_seq: 0,
            next_front: 0,
            vtc,
            by_tenant: Vec::new(),
            ready: BTreeSet::new(),
        }
    }

    pub fn vtc(&self) -> &Vtc {
        &self.vtc
    }

    /// The id of tenant `name` (registered on first sight); "" is 0.
    pub fn tenant_id(&mut self, name: &str) -> TenantId {
        self.vtc.id(name)
    }

    /// A request of tenant `t` became live (see `Vtc::join`).
    pub fn tenant_join(&mut self, t: TenantId) {
        let old = self.ready_key(t);
        self.vtc.join(t);
        self.rekey(t, old);
    }

    /// A request of tenant `t` is gone.
    pub fn tenant_leave(&mut self, t: TenantId) {
        self.vtc.leave(t);
    }

    /// Charge tenant `t` for served tokens (see `Vtc::charge`).
    pub fn charge(&mut self, t: TenantId, input: usize, output: usize) {
        let old = self.ready_key(t);
        self.vtc.charge(t, input, output);
        self.rekey(t, old);
    }

    fn ready_key(&self, t: TenantId) -> Option<ReadyKey> {
        let (k, _) = self.by_tenant.get(t as usize)?.first_key_value()?;
        Some((k.band, OrdF64(self.vtc.counter(t)), t))
    }

    /// Tenant `t`'s queue head or counter may have changed: move its `ready` entry.
    fn rekey(&mut self, t: TenantId, old: Option<ReadyKey>) {
        if self.policy != Policy::Fair {
            return;
        }
        let new = self.ready_key(t);
        if old != new {
            if let Some(o) = old {
                self.ready.remove(&o);
            }
            if let Some(n) = new {
                self.ready.insert(n);
            }
        }
    }

    /// Drop `key` from wherever the policy keeps it.
    fn unlink(&mut self, key: &Key, t: TenantId) {
        if self.policy != Policy::Fair {
            self.order.remove(key);
            return;
        }
        let old = self.ready_key(t);
        self.by_tenant[t as usize].remove(key);
        self.rekey(t, old);
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
        let p = QueueParams {
            queue_timeout: None,
            ..p
        };
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
        let band = if front && !matches!(self.policy, Policy::Priority | Policy::Fair) {
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
            // Within a tenant the priority leads, a re-queued preempted request next.
            Policy::Fair => (0, p.arrival),
        };
        let mut key = Key {
            band,
            class,
            time: OrdF64(time),
            seq,
        };
        if self.policy == Policy::Fair {
            key.band = p.priority;
            if front {
                self.next_front -= 1;
                key.class = self.next_front;
            }
        }
        let expires = p.queue_timeout.map(|t| (OrdF64(p.arrival + t), seq));
        let tenant = p.tenant;
        if self.policy == Policy::Fair {
            let t = tenant as usize;
            if self.by_tenant.len() <= t {
                self.by_tenant.resize_with(t + 1, BTreeMap::new);
            }
            let old = self.ready_key(tenant);
            self.by_tenant[t].insert(key, id.clone());
            self.rekey(tenant, old);
        } else {
            self.order.insert(key, id.clone());
        }
        if let Some(e) = expires {
            self.expiry.insert(e, id.clone());
        }
        self.entries.insert(
            id,
            Entry {
                key,
                expires,
                tenant,
            },
        );
    }

    /// The next request in policy order.
    pub fn peek(&self) -> Option<&K> {
        if self.policy == Policy::Fair {
            let &(_, _, t) = self.ready.first()?;
            return self.by_tenant[t as usize]
                .first_key_value()
                .map(|(_, id)| id);
        }
        self.order.first_key_value().map(|(_, id)| id)
    }

    pub fn pop(&mut self) -> Option<K> {
        let id = self.peek()?.clone();
        self.remove(&id);
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
                self.unlink(&e.key, e.tenant);
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

    /// Remove the requests whose timeout has passed (`now > arrival + queue_timeout`), appending
    /// them to `out` in expiry order. O(expired · log n).
    pub fn expire_into(&mut self, now: f64, out: &mut Vec<K>) {
        while let Some(((t, _), _)) = self.expiry.first_key_value() {
            if now <= t.0 {
                break;
            }
            let (_, id) = self.expiry.pop_first().expect("non-empty");
            if let Some(e) = self.entries.remove(&id) {
                self.unlink(&e.key, e.tenant);
            }
            out.push(id);
        }
    }

    pub fn expire(&mut self, now: f64) -> Vec<K> {
        let mut out = Vec::new();
        self.expire_into(now, &mut out);
        out
    }

    /// Ids in policy order; under `fair` tenant by tenant (in the order their heads would be
    /// admitted now), which is the admission order only while no counter changes.
    pub fn iter(&self) -> Box<dyn Iterator<Item = &K> + '_> {
        if self.policy == Policy::Fair {
            return Box::new(
                self.ready
                    .iter()
                    .flat_map(|&(_, _, t)| self.by_tenant[t as usize].values()),
            );
        }
        Box::new(self.order.values())
    }

    pub fn clear(&mut self) {
        self.by_tenant.iter_mut().for_each(BTreeMap::clear);
        self.ready.clear();
        self.order.clear();
        self.expiry.clear();
        self.entries.clear();
    }
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
