//! ironlm core: the scheduling half of the engine (`sched`), the CPU kernels (`cpu`), the
//! grammar engine for structured outputs (`grammar`) and their Python bindings (`py`).
//!
//! Dependencies point one way: `py` -> {`sched`, `cpu`, `grammar`}; `sched` -> `grammar` (a
//! sequence's token mask); every module -> `error`. `sched` never calls a kernel, and `cpu`
//! knows nothing of requests.

pub mod cpu;
pub mod error;
pub mod grammar;
pub mod sched;

pub use error::{CoreError, CoreResult};
pub use sched::plan::Plan;
pub use sched::queue::{monotonic, Policy, QueueParams, RequestQueue};
pub use sched::scheduler::{Scheduler, SchedulerConfig, SchedulerOptions, SchedulerStats};
pub use sched::sequence::{FinishReason, RequestParams, Slot};

#[cfg(feature = "python")]
mod py;

#[cfg(test)]
mod test_rng;
