//! The weight prefetch of the x86 tiles: how far ahead of the block in use each tile asks the
//! L2 for its weights, and the asking.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
use std::sync::atomic::{AtomicUsize, Ordering};

/// How far ahead of the block in use the x86 tiles prefetch their weights, in bytes (0: not
/// at all): tiles of 1-2 activation rows, and of 3 or more. Process-wide tuning knobs: benches
/// flip them in process to compare both ways under the same memory load.
static PREFETCH_NEAR: AtomicUsize = AtomicUsize::new(768);
static PREFETCH_FAR: AtomicUsize = AtomicUsize::new(4096);

/// The prefetch distances `(near, far)`: for tiles of 1-2 rows, and of 3 or more.
pub fn prefetch_distances() -> (usize, usize) {
    (
        PREFETCH_NEAR.load(Ordering::Relaxed),
        PREFETCH_FAR.load(Ordering::Relaxed),
    )
}

pub fn set_prefetch_distances(near: usize, far: usize) {
    PREFETCH_NEAR.store(near, Ordering::Relaxed);
    PREFETCH_FAR.store(far, Ordering::Relaxed);
}

/// How far ahead a tile of `MR` rows asks the L2 for its weights ([`prefetch_distances`]:
/// near for tiles of 1-2 rows, far for more; prefetches never fault, so past the matrix's end
/// is harmless). A group is one sequential stream, yet the hardware prefetcher does not keep it
/// far enough ahead. 2-core Zen 4, in-process alternation: one MoE decode (experts at M = 1),
/// Q4_0 +8% at 512-768 bytes ahead, +3% at 1 KiB, -3% at 4 KiB; Q8_0 +10% at 768; the default
/// model +2% at 512-768. From M ≈ 4 rows the tile computes long enough per block that it needs
/// a longer lead: 64 Q4_0 matrices of 576 x 3072 from memory, M = 6 61 -> 47 us a matrix at
/// 4 KiB, Q8_0 131 -> 88, Q6_K 181 -> 120; the default model's 6-row verification step 0.94x.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn lead<const MR: usize>() -> usize {
    let (near, far) = prefetch_distances();
    if MR < 3 {
        near
    } else {
        far
    }
}

/// The `len` bytes `ahead` past `blk` into L2 (`ahead` from [`lead`], read once a tile: the
/// block loop stays free of the knobs' loads).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn ahead(blk: *const u8, ahead: usize, len: usize) {
    if ahead == 0 {
        return;
    }
    let pf = blk.wrapping_add(ahead);
    let mut off = 0;
    while off < len {
        // SAFETY: a prefetch is a hint: it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(off) as *const i8) };
        off += 64;
    }
}
