//! Virtual token counters (VTC, Sheng et al., OSDI '24) for the `fair` policy.
//!
//! Each tenant has a counter of the service it received: prefill tokens × `input_weight` plus
//! generated tokens × `output_weight`, divided by its share. The queue admits from the tenant
//! with the smallest counter, preemption takes from the largest. A tenant that becomes active
//! (its first live request, or its first after being idle) is lifted to `floor`: the smallest
//! counter among the active tenants, or the last such value when none is active. Without the
//! lift a tenant idle for an hour would come back owed an hour of service and starve the
//! others while it spends it.
//!
//! Every operation is O(log tenants): the active counters live in a `BTreeSet`.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::error::CoreError;
use crate::sched::ord::OrdF64;

pub type TenantId = u32;

/// Fair-share settings. The default (every share 1, both token weights 1) charges served
/// tokens as they are.
#[derive(Debug, Clone, PartialEq)]
pub struct FairConfig {
    /// Shares of named tenants; unnamed ones get 1.
    pub tenant_weights: Vec<(String, f64)>,
    pub input_token_weight: f64,
    pub output_token_weight: f64,
}

impl Default for FairConfig {
    fn default() -> Self {
        Self {
            tenant_weights: Vec::new(),
            input_token_weight: 1.0,
            output_token_weight: 1.0,
        }
    }
}

impl FairConfig {
    pub fn validate(&self) -> Result<(), CoreError> {
        let positive = |name: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(CoreError::invalid(name, format!("must be > 0, got {v}")))
            }
        };
        positive("input_token_weight", self.input_token_weight)?;
        positive("output_token_weight", self.output_token_weight)?;
        for (name, w) in &self.tenant_weights {
            if !(w.is_finite() && *w > 0.0) {
                return Err(CoreError::invalid(
                    "tenant_weights",
                    format!("tenant {name:?}: weight must be > 0, got {w}"),
                ));
            }
        }
        Ok(())
    }
}

/// What one tenant received so far (for stats and metrics).
#[derive(Debug, Clone, PartialEq)]
pub struct TenantStats {
    pub name: Arc<str>,
    pub weight: f64,
    pub counter: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Requests queued or running.
    pub live: usize,
}

#[derive(Debug, Clone)]
struct Tenant {
    name: Arc<str>,
    weight: f64,
    counter: f64,
    input_tokens: u64,
    output_tokens: u64,
    live: usize,
}

#[derive(Debug, Clone)]
pub struct Vtc {
    cfg: FairConfig,
    ids: HashMap<Arc<str>, TenantId>,
    tenants: Vec<Tenant>,
    /// (counter, tenant) of the tenants with live requests.
    active: BTreeSet<(OrdF64, TenantId)>,
    floor: f64,
}

impl Default for Vtc {
    fn default() -> Self {
        Self::new(FairConfig::default())
    }
}

impl Vtc {
    /// The tenant "" (requests without one) is always id 0.
    pub fn new(cfg: FairConfig) -> Self {
        let mut v = Self {
            cfg,
            ids: HashMap::new(),
            tenants: Vec::new(),
            active: BTreeSet::new(),
            floor: 0.0,
        };
        v.id("");
        v
    }

    pub fn config(&self) -> &FairConfig {
        &self.cfg
    }

    /// The id of tenant `name`, registering it on first sight. Tenants are never dropped:
    /// an idle tenant's counter is what keeps it from banking credit.
    pub fn id(&mut self, name: &str) -> TenantId {
        if let Some(&t) = self.ids.get(name) {
            return t;
        }
        let weight = self
            .cfg
            .tenant_weights
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map_or(1.0, |&(_, w)| w);
        let t = self.tenants.len() as TenantId;
        let name: Arc<str> = name.into();
        self.tenants.push(Tenant {
            name: name.clone(),
            weight,
            counter: 0.0,
            input_tokens: 0,
            output_tokens: 0,
            live: 0,
        });
        self.ids.insert(name, t);
        t
    }

    pub fn counter(&self, t: TenantId) -> f64 {
        self.tenants[t as usize].counter
    }

    pub fn num_tenants(&self) -> usize {
        self.tenants.len()
    }

    /// The lift target: the smallest active counter (or the last one seen). Never decreases.
    pub fn floor(&self) -> f64 {
        match self.active.first() {
            Some((c, _)) => c.0.max(self.floor),
            None => self.floor,
        }
    }

    pub fn is_active(&self, t: TenantId) -> bool {
        self.tenants[t as usize].live > 0
    }

    /// A request of `t` became live; lifts `t` if it was idle. Returns (old, new) counter.
    pub fn join(&mut self, t: TenantId) -> (f64, f64) {
        let old = self.counter(t);
        let floor = self.floor();
        self.floor = floor;
        let tn = &mut self.tenants[t as usize];
        tn.live += 1;
        if tn.live == 1 {
            tn.counter = tn.counter.max(floor);
            self.active.insert((OrdF64(tn.counter), t));
        }
        (old, tn.counter)
    }

    /// A request of `t` is gone (finished, aborted or timed out).
    pub fn leave(&mut self, t: TenantId) {
        // Remember the active minimum while `t` still counts: when the last tenant leaves, the
        // next to arrive is lifted to where the service stood, not to its own old counter.
        self.floor = self.floor();
        let tn = &mut self.tenants[t as usize];
        debug_assert!(tn.live > 0, "tenant {t} leaves with no live request");
        tn.live = tn.live.saturating_sub(1);
        if tn.live == 0 {
            self.active.remove(&(OrdF64(tn.counter), t));
        }
    }

    /// Charge `t` for `input` prefill tokens and `output` generated tokens. Returns (old, new).
    pub fn charge(&mut self, t: TenantId, input: usize, output: usize) -> (f64, f64) {
        let (wi, wo) = (self.cfg.input_token_weight, self.cfg.output_token_weight);
        let tn = &mut self.tenants[t as usize];
        let old = tn.counter;
        tn.input_tokens += input as u64;
        tn.output_tokens += output as u64;
        tn.counter += (wi * input as f64 + wo * output as f64) / tn.weight;
        if tn.live > 0 && tn.counter != old {
            self.active.remove(&(OrdF64(old), t));
            self.active.insert((OrdF64(tn.counter), t));
        }
        (old, tn.counter)
    }

    pub fn stats(&self) -> Vec<TenantStats> {
        self.tenants
            .iter()
            .map(|t| TenantStats {
                name: t.name.clone(),
                weight: t.weight,
                counter: t.counter,
                input_tokens: t.input_tokens,
                output_tokens: t.output_tokens,
                live: t.live,
            })
            .collect()
    }
}

#[cfg(test)]
#[path = "fair_tests.rs"]
mod tests;
