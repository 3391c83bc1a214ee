//! x86 register tiles of the dense kernels (see `mod.rs` for the arithmetic each must keep).
//!
//! `Kn`: `MR` activation rows × `NV` vectors of output columns; per `k` the weight row's slice
//! is loaded (widened to f32) once and used by every row of the tile. `Nk`: `MR` rows × `NR`
//! weight rows, 16 `k` a step. Column blocks are the outer loop and row tiles the inner one, so
//! with `M > MR` the second tile finds the block's weights in L1/L2. Tail columns (fewer than a
//! vector) take the scalar code, inlined here with hardware FMA, which computes the same bits.

use std::arch::x86_64::*;

use super::{hsum16, kn_scalar, Isa, Job, Kind, Layout, Sink, Weight};
use crate::cpu::elem::Bf16;

/// 16 elements from `p`, widened to f32 exactly.
#[inline(always)]
unsafe fn w16<T: Weight>(p: *const T) -> __m512 {
    match T::KIND {
        Kind::F32 => _mm512_loadu_ps(p as *const f32),
        Kind::Bf16 => {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
    }
}

/// 8 elements from `p`, widened to f32 exactly.
#[inline(always)]
unsafe fn w8<T: Weight>(p: *const T) -> __m256 {
    match T::KIND {
        Kind::F32 => _mm256_loadu_ps(p as *const f32),
        Kind::Bf16 => {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
    }
}

/// The last `k % 16` elements of a weight row, zero-padded to 16 (as the scalar path pads).
#[inline(always)]
unsafe fn tail16<T: Weight>(row: *const T, k: usize) -> [T; 16] {
    let full = k / 16 * 16;
    let mut t = [T::store(0.0); 16];
    for (i, v) in t.iter_mut().enumerate().take(k - full) {
        *v = *row.add(full + i);
    }
    t
}

pub(crate) fn run<T: Weight>(
    isa: Isa,
    layout: Layout,
    j: &Job<T>,
    sink: &Sink<T>,
    c0: usize,
    c1: usize,
) {
    assert!(isa.available() && isa != Isa::Scalar);
    assert!(j.xf.len() >= j.shape.m * j.kp && j.kp >= j.shape.k.div_ceil(16) * 16);
    // SAFETY: the CPU has the path's features (asserted); every pointer below stays inside `w`
    // ([k, n] or [n, k] elements, checked by `matmul`), `xf`/`xb` (m rows of kp, asserted) or
    // the part's own output columns c0..c1.
    unsafe {
        match (isa, layout) {
            (Isa::Avx512Bf16, Layout::Kn) if T::KIND == Kind::Bf16 => {
                kn_dp(as_bf16(j), as_bf16_sink(sink), c0, c1)
            }
            (Isa::Avx512Bf16, Layout::Nk) if T::KIND == Kind::Bf16 => {
                nk_dp(as_bf16(j), as_bf16_sink(sink), c0, c1)
            }
            (Isa::Avx512 | Isa::Avx512Bf16, Layout::Kn) => kn_avx512(j, sink, c0, c1),
            (Isa::Avx512 | Isa::Avx512Bf16, Layout::Nk) => nk_avx512(j, sink, c0, c1),
            (_, Layout::Kn) => kn_avx2(j, sink, c0, c1),
            (_, Layout::Nk) => nk_avx2(j, sink, c0, c1),
        }
    }
}

/// SAFETY: only for `T::KIND == Kind::Bf16`, i.e. `T = Bf16`.
unsafe fn as_bf16<'a, T: Weight>(j: &'a Job<'a, T>) -> &'a Job<'a, Bf16> {
    &*(j as *const Job<T> as *const Job<Bf16>)
}

/// SAFETY: as `as_bf16`.
unsafe fn as_bf16_sink<'a, T: Weight>(s: &'a Sink<'a, T>) -> &'a Sink<'a, Bf16> {
    &*(s as *const Sink<T> as *const Sink<Bf16>)
}

/// The largest of 8, 4, 2, 1 that is at most `left` and `cap`.
fn piece(left: usize, cap: usize) -> usize {
    [8, 4, 2, 1]
        .into_iter()
        .find(|&v| v <= left && v <= cap)
        .unwrap_or(1)
}

// ---- AVX-512F: Kn ---------------------------------------------------------------------------

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn kn_avx512<T: Weight>(j: &Job<T>, sink: &Sink<T>, c0: usize, c1: usize) {
    let (m, n) = (j.shape.m, j.shape.n);
    let vend = (n / 16 * 16).clamp(c0, c1);
    let mut c = c0;
    while c < vend {
        let bw = (vend - c).min(128) / 16;
        for r0 in (0..m).step_by(4) {
            let rows = (m - r0).min(4);
            let cap = if rows <= 2 { 8 } else { 4 };
            let (mut cc, mut left) = (c, bw);
            while left > 0 {
                let nv = piece(left, cap);
                kn512_tile(j, sink, r0, rows, cc, nv);
                cc += 16 * nv;
                left -= nv;
            }
        }
        c += bw * 16;
    }
    if vend < c1 {
        kn_scalar(j, sink, 0, m, vend, c1);
    }
}

#[inline(always)]
unsafe fn kn512_tile<T: Weight>(
    j: &Job<T>,
    sink: &Sink<T>,
    r0: usize,
    rows: usize,
    c: usize,
    nv: usize,
) {
    macro_rules! go {
        ($mr:literal) => {
            match nv {
                8 => kn512::<T, $mr, 8>(j, sink, r0, c),
                4 => kn512::<T, $mr, 4>(j, sink, r0, c),
                2 => kn512::<T, $mr, 2>(j, sink, r0, c),
                _ => kn512::<T, $mr, 1>(j, sink, r0, c),
            }
        };
    }
    match rows {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        _ => go!(4),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn kn512<T: Weight, const MR: usize, const NV: usize>(
    j: &Job<T>,
    sink: &Sink<T>,
    r0: usize,
    c: usize,
) {
    let (k, n) = (j.shape.k, j.shape.n);
    let w = j.w.as_ptr().add(c);
    let x: [*const f32; MR] = std::array::from_fn(|r| j.xf.as_ptr().add((r0 + r) * j.kp));
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    for kk in 0..k {
        let row = w.add(kk * n);
        let wv: [__m512; NV] = std::array::from_fn(|v| w16(row.add(16 * v)));
        for r in 0..MR {
            let xb = _mm512_set1_ps(*x[r].add(kk));
            for v in 0..NV {
                acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);
            }
        }
    }
    let mut buf = [0.0f32; 128];
    for (r, a) in acc.iter().enumerate() {
        for (v, &a) in a.iter().enumerate() {
            _mm512_storeu_ps(buf.as_mut_ptr().add(16 * v), a);
        }
        sink.put(r0 + r, c, &buf[..16 * NV]);
    }
}

// ---- AVX-512F: Nk ---------------------------------------------------------------------------

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn nk_avx512<T: Weight>(j: &Job<T>, sink: &Sink<T>, c0: usize, c1: usize) {
    let m = j.shape.m;
    let mut c = c0;
    while c < c1 {
        let nr = if c1 - c >= 4 { 4 } else { 1 };
        for r0 in (0..m).step_by(4) {
            let rows = (m - r0).min(4);
            macro_rules! go {
                ($mr:literal) => {
                    if nr == 4 {
                        nk512::<T, $mr, 4>(j, sink, r0, c)
                    } else {
                        nk512::<T, $mr, 1>(j, sink, r0, c)
                    }
                };
            }
            match rows {
                1 => go!(1),
                2 => go!(2),
                3 => go!(3),
                _ => go!(4),
            }
        }
        c += nr;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn nk512<T: Weight, const MR: usize, const NR: usize>(
    j: &Job<T>,
    sink: &Sink<T>,
    r0: usize,
    c: usize,
) {
    let k = j.shape.k;
    let full = k / 16 * 16;
    let w: [*const T; NR] = std::array::from_fn(|i| j.w.as_ptr().add((c + i) * k));
    let x: [*const f32; MR] = std::array::from_fn(|r| j.xf.as_ptr().add((r0 + r) * j.kp));
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    let mut step = |wv: [__m512; NR], kk: usize| {
        for r in 0..MR {
            let xv = _mm512_loadu_ps(x[r].add(kk));
            for i in 0..NR {
                acc[r][i] = _mm512_fmadd_ps(wv[i], xv, acc[r][i]);
            }
        }
    };
    for kk in (0..full).step_by(16) {
        step(std::array::from_fn(|i| w16(w[i].add(kk))), kk);
    }
    if full < k {
        let tails: [[T; 16]; NR] = std::array::from_fn(|i| tail16(w[i], k));
        step(std::array::from_fn(|i| w16(tails[i].as_ptr())), full);
    }
    for (r, a) in acc.iter().enumerate() {
        for (i, &a) in a.iter().enumerate() {
            let mut l = [0.0f32; 16];
            _mm512_storeu_ps(l.as_mut_ptr(), a);
            sink.put(r0 + r, c + i, &[hsum16(l)]);
        }
    }
}

// ---- AVX2 + FMA ------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kn_avx2<T: Weight>(j: &Job<T>, sink: &Sink<T>, c0: usize, c1: usize) {
    let (m, n) = (j.shape.m, j.shape.n);
    let vend = (n / 8 * 8).clamp(c0, c1);
    let mut c = c0;
    while c < vend {
        let bw = (vend - c).min(64) / 8;
        for r0 in (0..m).step_by(2) {
            let rows = (m - r0).min(2);
            let (mut cc, mut left) = (c, bw);
            while left > 0 {
                let nv = piece(left, 4);
                match (rows, nv) {
                    (1, 4) => kn256::<T, 1, 4>(j, sink, r0, cc),
                    (1, 2) => kn256::<T, 1, 2>(j, sink, r0, cc),
                    (1, _) => kn256::<T, 1, 1>(j, sink, r0, cc),
                    (_, 4) => kn256::<T, 2, 4>(j, sink, r0, cc),
                    (_, 2) => kn256::<T, 2, 2>(j, sink, r0, cc),
                    _ => kn256::<T, 2, 1>(j, sink, r0, cc),
                }
                cc += 8 * nv;
                left -= nv;
            }
        }
        c += bw * 8;
    }
    if vend < c1 {
        kn_scalar(j, sink, 0, m, vend, c1);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kn256<T: Weight, const MR: usize, const NV: usize>(
    j: &Job<T>,
    sink: &Sink<T>,
    r0: usize,
    c: usize,
) {
    let (k, n) = (j.shape.k, j.shape.n);
    let w = j.w.as_ptr().add(c);
    let x: [*const f32; MR] = std::array::from_fn(|r| j.xf.as_ptr().add((r0 + r) * j.kp));
    let mut acc = [[_mm256_setzero_ps(); NV]; MR];
    for kk in 0..k {
        let row = w.add(kk * n);
        let wv: [__m256; NV] = std::array::from_fn(|v| w8(row.add(8 * v)));
        for r in 0..MR {
            let xb = _mm256_set1_ps(*x[r].add(kk));
            for v in 0..NV {
                acc[r][v] = _mm256_fmadd_ps(wv[v], xb, acc[r][v]);
            }
        }
    }
    let mut buf = [0.0f32; 32];
    for (r, a) in acc.iter().enumerate() {
        for (v, &a) in a.iter().enumerate() {
            _mm256_storeu_ps(buf.as_mut_ptr().add(8 * v), a);
        }
        sink.put(r0 + r, c, &buf[..8 * NV]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nk_avx2<T: Weight>(j: &Job<T>, sink: &Sink<T>, c0: usize, c1: usize) {
    let m = j.shape.m;
    let mut c = c0;
    while c < c1 {
        let nr = if c1 - c >= 2 { 2 } else { 1 };
        for r0 in (0..m).step_by(2) {
            match ((m - r0).min(2), nr) {
                (1, 2) => nk256::<T, 1, 2>(j, sink, r0, c),
                (1, _) => nk256::<T, 1, 1>(j, sink, r0, c),
                (_, 2) => nk256::<T, 2, 2>(j, sink, r0, c),
                _ => nk256::<T, 2, 1>(j, sink, r0, c),
            }
        }
        c += nr;
    }
}

/// 16 lanes as two 8-lane halves, so the chains and the final tree match the other paths.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `h` picks the half in the weights, x and the accumulators alike
unsafe fn nk256<T: Weight, const MR: usize, const NR: usize>(
    j: &Job<T>,
    sink: &Sink<T>,
    r0: usize,
    c: usize,
) {
    let k = j.shape.k;
    let full = k / 16 * 16;
    let w: [*const T; NR] = std::array::from_fn(|i| j.w.as_ptr().add((c + i) * k));
    let x: [*const f32; MR] = std::array::from_fn(|r| j.xf.as_ptr().add((r0 + r) * j.kp));
    let mut acc = [[[_mm256_setzero_ps(); 2]; NR]; MR];
    let mut step = |wp: [*const T; NR], kk: usize| {
        for h in 0..2 {
            let wv: [__m256; NR] = std::array::from_fn(|i| w8(wp[i].add(8 * h)));
            for r in 0..MR {
                let xv = _mm256_loadu_ps(x[r].add(kk + 8 * h));
                for i in 0..NR {
                    acc[r][i][h] = _mm256_fmadd_ps(wv[i], xv, acc[r][i][h]);
                }
            }
        }
    };
    for kk in (0..full).step_by(16) {
        step(std::array::from_fn(|i| w[i].add(kk)), kk);
    }
    if full < k {
        let tails: [[T; 16]; NR] = std::array::from_fn(|i| tail16(w[i], k));
        step(std::array::from_fn(|i| tails[i].as_ptr()), full);
    }
    for (r, a) in acc.iter().enumerate() {
        for (i, a) in a.iter().enumerate() {
            let mut l = [0.0f32; 16];
            _mm256_storeu_ps(l.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(l.as_mut_ptr().add(8), a[1]);
            sink.put(r0 + r, c + i, &[hsum16(l)]);
        }
    }
}

/// Weight rows a column block's walk down `k` asks for ahead of use. The block's rows are `N`
/// elements apart, a page holds only a few of them, and the hardware prefetchers lose such a
/// stream at every page.
const PREFETCH_ROWS: usize = 16;

/// Prefetch rows `kk` and `kk + 1` (those below `k`) of a column block of `NV` 32-column bf16
/// vectors starting at `w`, rows `n` elements apart.
#[inline(always)]
unsafe fn prefetch_rows<const NV: usize>(w: *const u16, n: usize, kk: usize, k: usize) {
    for row in kk..(kk + 2).min(k) {
        for v in 0..NV {
            // SAFETY: a prefetch never faults; the address is inside the weight (row < k).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(w.add(row * n + 32 * v) as *const i8) };
        }
    }
}

// ---- AVX-512 BF16: vdpbf16ps -----------------------------------------------------------------

/// `acc + w[2i] x[2i] + w[2i+1] x[2i+1]` per f32 lane.
#[inline(always)]
pub(super) unsafe fn dp(acc: __m512, w: __m512i, x: __m512i) -> __m512 {
    _mm512_dpbf16_ps(
        acc,
        std::mem::transmute::<__m512i, __m512bh>(w),
        std::mem::transmute::<__m512i, __m512bh>(x),
    )
}

/// `Kn` with pairs of weight rows interleaved in registers (`vpunpck{l,h}wd`): lane `i` of the
/// low half holds column `8 (i / 4) + i % 4` of a 32-column slice, the high half the next 4.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn kn_dp(j: &Job<Bf16>, sink: &Sink<Bf16>, c0: usize, c1: usize) {
    let (m, n) = (j.shape.m, j.shape.n);
    let vend = (n / 32 * 32).clamp(c0, c1);
    let mut c = c0;
    while c < vend {
        let bw = (vend - c).min(128) / 32;
        for r0 in (0..m).step_by(4) {
            let rows = (m - r0).min(4);
            let cap = if rows <= 2 { 4 } else { 2 };
            let (mut cc, mut left) = (c, bw);
            while left > 0 {
                let nv = piece(left, cap);
                macro_rules! go {
                    ($mr:literal) => {
                        match nv {
                            4 => kndp::<$mr, 4>(j, sink, r0, cc),
                            2 => kndp::<$mr, 2>(j, sink, r0, cc),
                            _ => kndp::<$mr, 1>(j, sink, r0, cc),
                        }
                    };
                }
                match rows {
                    1 => go!(1),
                    2 => go!(2),
                    3 => go!(3),
                    _ => go!(4),
                }
                cc += 32 * nv;
                left -= nv;
            }
        }
        c += bw * 32;
    }
    if vend < c1 {
        kn_scalar(j, sink, 0, m, vend, c1);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn kndp<const MR: usize, const NV: usize>(
    j: &Job<Bf16>,
    sink: &Sink<Bf16>,
    r0: usize,
    c: usize,
) {
    let (k, n) = (j.shape.k, j.shape.n);
    let w = (j.w.as_ptr() as *const u16).add(c);
    let x: [*const u16; MR] = std::array::from_fn(|r| j.xb.as_ptr().add((r0 + r) * j.kp));
    let mut acc = [[[_mm512_setzero_ps(); 2]; NV]; MR];
    let mut step = |a: [__m512i; NV], b: [__m512i; NV], kk: usize| {
        // x[kk] in the low half of each pair, x[kk + 1] (zero padding past k) in the high one
        let xp: [__m512i; MR] = std::array::from_fn(|r| {
            _mm512_set1_epi32(std::ptr::read_unaligned(x[r].add(kk) as *const i32))
        });
        for v in 0..NV {
            let (lo, hi) = (
                _mm512_unpacklo_epi16(a[v], b[v]),
                _mm512_unpackhi_epi16(a[v], b[v]),
            );
            for r in 0..MR {
                acc[r][v][0] = dp(acc[r][v][0], lo, xp[r]);
                acc[r][v][1] = dp(acc[r][v][1], hi, xp[r]);
            }
        }
    };
    let load = |kk: usize| -> [__m512i; NV] {
        std::array::from_fn(|v| _mm512_loadu_si512(w.add(kk * n + 32 * v) as *const __m512i))
    };
    for kk in (0..k / 2 * 2).step_by(2) {
        prefetch_rows::<NV>(w, n, kk + PREFETCH_ROWS, k);
        step(load(kk), load(kk + 1), kk);
    }
    if k % 2 == 1 {
        step(load(k - 1), [_mm512_setzero_si512(); NV], k - 1);
    }
    let mut vals = [0.0f32; 128];
    for (r, a) in acc.iter().enumerate() {
        for (v, a) in a.iter().enumerate() {
            let (mut lo, mut hi) = ([0.0f32; 16], [0.0f32; 16]);
            _mm512_storeu_ps(lo.as_mut_ptr(), a[0]);
            _mm512_storeu_ps(hi.as_mut_ptr(), a[1]);
            for lane in 0..4 {
                for q in 0..4 {
                    vals[32 * v + 8 * lane + q] = lo[4 * lane + q];
                    vals[32 * v + 8 * lane + 4 + q] = hi[4 * lane + q];
                }
            }
        }
        sink.put(r0 + r, c, &vals[..32 * NV]);
    }
}

/// `Nk` with 32 `k` a step: lane `l` takes the pairs `(32 s + 2 l, 32 s + 2 l + 1)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn nk_dp(j: &Job<Bf16>, sink: &Sink<Bf16>, c0: usize, c1: usize) {
    let m = j.shape.m;
    let mut c = c0;
    while c < c1 {
        let nr = if c1 - c >= 4 { 4 } else { 1 };
        for r0 in (0..m).step_by(4) {
            macro_rules! go {
                ($mr:literal) => {
                    if nr == 4 {
                        nkdp::<$mr, 4>(j, sink, r0, c)
                    } else {
                        nkdp::<$mr, 1>(j, sink, r0, c)
                    }
                };
            }
            match (m - r0).min(4) {
                1 => go!(1),
                2 => go!(2),
                3 => go!(3),
                _ => go!(4),
            }
        }
        c += nr;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn nkdp<const MR: usize, const NR: usize>(
    j: &Job<Bf16>,
    sink: &Sink<Bf16>,
    r0: usize,
    c: usize,
) {
    let k = j.shape.k;
    let full = k / 32 * 32;
    let w: [*const u16; NR] =
        std::array::from_fn(|i| (j.w.as_ptr() as *const u16).add((c + i) * k));
    let x: [*const u16; MR] = std::array::from_fn(|r| j.xb.as_ptr().add((r0 + r) * j.kp));
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    let mut step = |wv: [__m512i; NR], kk: usize| {
        for r in 0..MR {
            let xv = _mm512_loadu_si512(x[r].add(kk) as *const __m512i);
            for i in 0..NR {
                acc[r][i] = dp(acc[r][i], wv[i], xv);
            }
        }
    };
    for kk in (0..full).step_by(32) {
        step(
            std::array::from_fn(|i| _mm512_loadu_si512(w[i].add(kk) as *const __m512i)),
            kk,
        );
    }
    if full < k {
        let tails: [[u16; 32]; NR] = std::array::from_fn(|i| {
            let mut t = [0u16; 32];
            t[..k - full].copy_from_slice(std::slice::from_raw_parts(w[i].add(full), k - full));
            t
        });
        step(
            std::array::from_fn(|i| _mm512_loadu_si512(tails[i].as_ptr() as *const __m512i)),
            full,
        );
    }
    for (r, a) in acc.iter().enumerate() {
        for (i, &a) in a.iter().enumerate() {
            let mut l = [0.0f32; 16];
            _mm512_storeu_ps(l.as_mut_ptr(), a);
            sink.put(r0 + r, c + i, &[hsum16(l)]);
        }
    }
}
