//! A float with a total order, for the ordered sets the queue and the fair-share counters keep.

use std::cmp::Ordering;

/// Times and counters are validated finite before they get here.
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
