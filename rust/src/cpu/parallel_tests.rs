//! Tests of the CPU thread pool helpers.

use std::sync::atomic::{AtomicUsize, Ordering};

#[test]
fn every_part_runs_exactly_once() {
    for parts in [0, 1, 2, 5] {
        let seen: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
        super::run_parts(parts, &|p| {
            seen[p].fetch_add(1, Ordering::Relaxed);
        });
        assert!(
            seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
            "parts={parts}"
        );
    }
}
