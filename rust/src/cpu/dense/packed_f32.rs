//! An f32 `[K, N]` weight repacked once in 16-column groups (`[groups][K][16]`), for the decode
//! calls (one row to a few dozen) of CPUs without AVX-512 BF16 (where `dtype=auto` keeps dense
//! models in f32, and the `bf16` pair-packed tiles of [`super::PackedBf16`] do not run).
//!
//! The `Kn` kernel reads a row slice of the weight `N` floats apart at every `k` (strides of a
//! page or more): the prefetcher follows one sequential stream per group here instead. The
//! arithmetic is `Kn`'s f32 chain lane for lane (`acc = fma(w[k][c], x[k], acc)` from zero over
//! `k` in order, then the same [`Sink`]), so both give the same bits on a given SIMD width.

use super::packed::{Packed, COLS};
use super::{Job, Shape};
use crate::error::CoreResult;

/// f32 weights in 16-column groups, `k` in order.
pub type PackedF32 = Packed<f32>;

impl Packed<f32> {
    /// Whether this CPU runs [`PackedF32::matmul`] (AVX2 + FMA).
    pub fn available() -> bool {
        super::Isa::Avx2.available()
    }

    /// `out [m, n] = x [m, k] @ W (+ bias)`, `+=` with `accumulate`, as `dense::matmul`
    /// computes it with `isa` (`Avx512` on CPUs with AVX-512F, else `Avx2`).
    pub fn matmul(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        accumulate: bool,
        bias: Option<&[f32]>,
        threads: usize,
    ) -> CoreResult<()> {
        let wide = super::Isa::Avx512.available();
        self.matmul_on(x, m, out, accumulate, bias, threads, wide)
    }

    /// `matmul` on 512-bit vectors (`wide`, AVX-512F) or 256-bit ones (tests run both).
    #[allow(clippy::too_many_arguments)]
    fn matmul_on(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        accumulate: bool,
        bias: Option<&[f32]>,
        threads: usize,
        wide: bool,
    ) -> CoreResult<()> {
        let needs = "the packed f32 kernel needs AVX2 and FMA";
        if !self.admit(x.len(), out.len(), bias, m, Self::available(), needs)? {
            return Ok(());
        }
        let (k, n) = (self.k, self.n);
        let job: Job<f32> = Job {
            w: &[],
            xf: x,
            xb: &[],
            kp: k,
            shape: Shape { m, k, n },
        };
        self.split(&job, out, bias, accumulate, threads, &|job, sink, gs| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 + FMA checked above (AVX-512F with `wide`); the part owns groups
            // `gs`, whose columns no other part writes.
            unsafe {
                x86::run(self, job, sink, gs, wide)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (job, sink, gs, wide);
        });
        Ok(())
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{PackedF32, COLS};
    use crate::cpu::dense::{Job, Sink};

    /// 512-bit: rows in tiles of 4 (then 2, 1), groups two at a time. 256-bit: one and two rows
    /// take two groups at a time (two weight streams for a bandwidth-bound GEMV); from three rows
    /// on the product is FMA-bound, and a tile of 6 rows x 1 group (12 accumulators, 2 weight
    /// vectors and a broadcast: 15 of the 16 ymm registers) keeps every value in a register,
    /// where 4 rows x 2 groups (16 accumulators) spilled to the stack at every `k`; the rows are
    /// split into even tiles, as a one-row tile runs at a GEMV's pace.
    pub(super) unsafe fn run(
        w: &PackedF32,
        j: &Job<f32>,
        sink: &Sink<f32>,
        gs: Range<usize>,
        wide: bool,
    ) {
        let m = j.shape.m;
        let tall = !wide && m > 2;
        let mut g = gs.start;
        while g < gs.end {
            let ng = if tall { 1 } else { (gs.end - g).min(2) };
            let mut r0 = 0;
            while r0 < m {
                let left = m - r0;
                let mr = if tall {
                    // the rows left in even tiles of at most 6 (19 rows: 5, 5, 5, 4, not 6, 6, 6, 1)
                    left.div_ceil(left.div_ceil(6))
                } else {
                    match left {
                        4.. => 4,
                        2..=3 => 2,
                        _ => 1,
                    }
                };
                // Only the tiles each path picks are instantiated: `mr` is 1, 2 or 4 outside
                // `tall` (and 1 or 2 on the 256-bit path, whose rows are then at most 2).
                macro_rules! go {
                    ($tile:ident, $ng:literal; $($mr:literal)*) => {
                        match mr {
                            $($mr => $tile::<$mr, $ng>(w, j, sink, r0, g),)*
                            _ => unreachable!("no {}-row tile here", mr),
                        }
                    };
                }
                // SAFETY: the caller's contract; rows r0..r0 + mr and groups g..g + ng exist.
                unsafe {
                    match (wide, ng) {
                        (true, 2) => go!(tile512, 2; 4 2 1),
                        (true, _) => go!(tile512, 1; 4 2 1),
                        (false, 2) => go!(tile256, 2; 2 1),
                        (false, _) => go!(tile256, 1; 6 5 4 3 2 1),
                    }
                }
                r0 += mr;
            }
            g += ng;
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn tile512<const MR: usize, const NG: usize>(
        w: &PackedF32,
        j: &Job<f32>,
        sink: &Sink<f32>,
        r0: usize,
        g: usize,
    ) {
        let k = w.k;
        // SAFETY: rows r0..r0 + MR of `j.xf` (k apart) and groups g..g + NG of `w.data` exist;
        // prefetches never fault.
        unsafe {
            let x: [*const f32; MR] = std::array::from_fn(|r| j.xf.as_ptr().add((r0 + r) * k));
            let wp: [*const f32; NG] =
                std::array::from_fn(|v| w.data.as_ptr().add((g + v) * w.group_len()));
            let mut acc = [[_mm512_setzero_ps(); NG]; MR];
            for kk in 0..k {
                for &b in wp.iter() {
                    _mm_prefetch::<_MM_HINT_T0>(b.add((kk + 16) * COLS) as *const i8);
                }
                let wv: [__m512; NG] =
                    std::array::from_fn(|v| _mm512_loadu_ps(wp[v].add(kk * COLS)));
                for r in 0..MR {
                    let xb = _mm512_set1_ps(*x[r].add(kk));
                    for v in 0..NG {
                        acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);
                    }
                }
            }
            let mut vals = [0.0f32; COLS];
            for (r, a) in acc.iter().enumerate() {
                for (v, &a) in a.iter().enumerate() {
                    let c = (g + v) * COLS;
                    _mm512_storeu_ps(vals.as_mut_ptr(), a);
                    sink.put(r0 + r, c, &vals[..COLS.min(w.n - c)]);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile256<const MR: usize, const NG: usize>(
        w: &PackedF32,
        j: &Job<f32>,
        sink: &Sink<f32>,
        r0: usize,
        g: usize,
    ) {
        let k = w.k;
        // SAFETY: as in `tile512`.
        unsafe {
            let x: [*const f32; MR] = std::array::from_fn(|r| j.xf.as_ptr().add((r0 + r) * k));
            let wp: [*const f32; NG] =
                std::array::from_fn(|v| w.data.as_ptr().add((g + v) * w.group_len()));
            let mut acc = [[[_mm256_setzero_ps(); 2]; NG]; MR];
            for kk in 0..k {
                for &b in wp.iter() {
                    _mm_prefetch::<_MM_HINT_T0>(b.add((kk + 16) * COLS) as *const i8);
                }
                let wv: [[__m256; 2]; NG] = std::array::from_fn(|v| {
                    let p = wp[v].add(kk * COLS);
                    [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
                });
                for r in 0..MR {
                    let xb = _mm256_set1_ps(*x[r].add(kk));
                    for v in 0..NG {
                        for h in 0..2 {
                            acc[r][v][h] = _mm256_fmadd_ps(wv[v][h], xb, acc[r][v][h]);
                        }
                    }
                }
            }
            let mut vals = [0.0f32; COLS];
            for (r, a) in acc.iter().enumerate() {
                for (v, a) in a.iter().enumerate() {
                    let c = (g + v) * COLS;
                    _mm256_storeu_ps(vals.as_mut_ptr(), a[0]);
                    _mm256_storeu_ps(vals.as_mut_ptr().add(8), a[1]);
                    sink.put(r0 + r, c, &vals[..COLS.min(w.n - c)]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::dense::{matmul, Isa, Layout, Opts};
    use crate::test_rng::Rng;

    /// Every row, every shape (`n` off the 16-column groups, 1-9 rows), bias and accumulate: the
    /// same bits as `dense::matmul`'s `Kn` path at each width this CPU runs, on 1 and 3 threads.
    #[test]
    fn equals_the_kn_path_bit_for_bit() {
        if !PackedF32::available() {
            return;
        }
        let widths = [(false, Isa::Avx2), (true, Isa::Avx512)];
        for (wide, isa) in widths.into_iter().filter(|(_, i)| i.available()) {
            same_bits_as_kn(wide, isa);
        }
    }

    fn same_bits_as_kn(wide: bool, isa: Isa) {
        let mut rng = Rng(13);
        for (k, n) in [(64, 48), (33, 17), (576, 960), (7, 5), (130, 100)] {
            let w = rng.floats(k * n);
            let packed = PackedF32::pack(&w, k, n).unwrap();
            for m in [1, 2, 3, 5, 7, 9, 13] {
                let x = rng.floats(m * k);
                let bias = rng.floats(n);
                for (accumulate, with_bias) in [(false, false), (true, true), (false, true)] {
                    let init = rng.floats(m * n);
                    let b = with_bias.then_some(&bias[..]);
                    let mut want = init.clone();
                    let opts = Opts {
                        accumulate,
                        bias: b,
                        threads: 1,
                        isa: Some(isa),
                    };
                    matmul(&x, &w, &mut want, Shape { m, k, n }, Layout::Kn, &opts).unwrap();
                    for threads in [1, 3] {
                        let mut got = init.clone();
                        packed
                            .matmul_on(&x, m, &mut got, accumulate, b, threads, wide)
                            .unwrap();
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        let case =
                            format!("{isa:?} k={k} n={n} m={m} acc={accumulate} t={threads}");
                        assert!(same, "{case}");
                    }
                }
            }
        }
    }
}
