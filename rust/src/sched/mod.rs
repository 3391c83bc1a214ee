//! The bookkeeping half of the engine: what runs each step before and after the model.
//!
//! Requests wait in the `queue` (ordered by policy; `fair` keeps the per-tenant counters it
//! orders by), become `sequence`s, hold paged KV blocks from the `block` allocator, share
//! prefixes through the `radix` cache (and its host/disk tier), and the `scheduler` turns all of
//! that into one `plan` per step. Nothing here runs model math: that is `cpu` and Python.

pub mod block;
pub mod fair;
pub mod ord;
pub mod plan;
pub mod queue;
pub mod radix;
pub mod scheduler;
pub mod sequence;
pub mod spec;
