//! ironlm core: the bookkeeping half of the engine.

pub mod attention;
pub mod block;
pub mod ops;
pub mod ops_cpu;
pub mod ops_decode;
pub mod ops_elem;
pub mod quant;
pub mod radix;

pub mod error;
pub mod fair;
pub mod grammar;
pub mod parallel;
pub mod plan;
pub mod queue;
pub mod scheduler;
pub mod sequence;

pub use error::{CoreError, CoreResult};
pub use plan::Plan;
pub use queue::{monotonic, Policy, QueueParams, RequestQueue};
pub use scheduler::{Scheduler, SchedulerConfig, SchedulerOptions, SchedulerStats};
pub use sequence::{FinishReason, RequestParams, Slot};

#[cfg(feature = "python")]
mod py;

#[cfg(test)]
mod test_rng;
