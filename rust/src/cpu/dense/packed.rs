//! A bf16 `[K, N]` weight repacked once for `vdpbf16ps`, for decode batches of 3 to ~64 rows.
//!
//! The `Kn` path interleaves two weight rows in registers at every step (`vpunpck{l,h}wd`) and
//! holds at most 4 activation rows, so from a few rows on its shuffles and loads, not its
//! multiply-adds, set the pace (a 2-core Zen 4 with AVX512_BF16 and no AMX, SmolLM2-135M's
//! shapes at M = 34: 186-261 GFLOP/s, oneDNN's prepacked GEMM 230-337). Here the pairs are laid
//! out in memory: 16 output columns a group, then `k` in pairs, lane `c` of a 64-byte vector
//! holding `(W[2p][c], W[2p+1][c])`. A tile of up to 8 activation rows and 2 groups loads one
//! vector a group and pair and issues 16 `vdpbf16ps`, nothing else.
//!
//! The arithmetic is [`super`]'s `Kn` `vdpbf16ps` chain lane for lane (the pairs `(k, k+1)` in
//! order from a zero accumulator, a zero weight and activation past an odd `K`, then the same
//! [`Sink`]), so both give the same bits for every row whatever `M` or the thread split.

use std::ops::Range;

use super::{Bf16, Job, Shape, Sink};
use crate::error::{CoreError, CoreResult};

/// A packed kernel's body: one part's column groups of a job into its sink.
pub(super) type GroupTile<'a, T> = dyn Fn(&Job<T>, &Sink<T>, Range<usize>) + Sync + 'a;

/// Output columns per group (one 512-bit vector of f32 lanes).
pub(super) const COLS: usize = 16;

/// An element of a packed layout, and how many consecutive `k` share an output lane: 2 for
/// bf16 bits (`vdpbf16ps` pairs), 1 for f32.
pub trait Lane: Copy + Default + Send + Sync {
    const PAIR: usize;
}

impl Lane for u16 {
    const PAIR: usize = 2;
}

impl Lane for f32 {
    const PAIR: usize = 1;
}

/// A weight `[k, n]` (`out = x @ W`) in groups of [`COLS`] output columns, each group
/// `[k / PAIR][COLS][PAIR]` (`k` zero-padded to whole pairs): one sequential stream a group.
pub struct Packed<E> {
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) data: Vec<E>,
}

/// bf16 weights (their bits) in `vdpbf16ps` pair order (see the module notes).
pub type PackedBf16 = Packed<u16>;

impl<E: Lane> Packed<E> {
    /// Packs `w`, a row-major `[k, n]`.
    pub fn pack(w: &[E], k: usize, n: usize) -> CoreResult<Self> {
        if w.len() != k * n {
            let r = format!("has {} elements, expected k * n = {k} * {n}", w.len());
            return Err(CoreError::invalid("weight", r));
        }
        let mut packed = Packed {
            k,
            n,
            data: Vec::new(),
        };
        let (len, groups) = (packed.group_len(), n.div_ceil(COLS));
        packed.data = vec![E::default(); groups * len];
        for (g, dst) in packed
            .data
            .chunks_exact_mut(len.max(1))
            .enumerate()
            .take(groups)
        {
            let cols = COLS.min(n - g * COLS);
            for (kk, row) in w.chunks_exact(n.max(1)).enumerate().take(k) {
                let (p, t) = (kk / E::PAIR, kk % E::PAIR);
                for (c, &v) in row[g * COLS..g * COLS + cols].iter().enumerate() {
                    dst[(p * COLS + c) * E::PAIR + t] = v;
                }
            }
        }
        Ok(packed)
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn n(&self) -> usize {
        self.n
    }

    /// Bytes of the packed copy.
    pub fn nbytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<E>()
    }

    /// `k` rounded up to whole pairs.
    pub(super) fn padded_k(&self) -> usize {
        self.k.div_ceil(E::PAIR) * E::PAIR
    }

    /// Elements of one column group.
    pub(super) fn group_len(&self) -> usize {
        self.padded_k() * COLS
    }

    /// What every packed `matmul` checks first: the operands' sizes (`x [m, k]`, `out [m, n]`,
    /// `bias [n]`), then the CPU (`runs`, else an error saying what it `needs`). `Ok(false)`: an
    /// empty product, nothing to do.
    pub(super) fn admit(
        &self,
        x: usize,
        out: usize,
        bias: Option<&[f32]>,
        m: usize,
        runs: bool,
        needs: &'static str,
    ) -> CoreResult<bool> {
        super::check_call(x, out, bias, m, self.k, self.n)?;
        if !runs {
            return Err(CoreError::invalid("isa", needs));
        }
        Ok(m > 0 && self.n > 0)
    }

    /// `tile(job, sink, groups)` over this weight's column groups on up to `threads` parts, each
    /// part's results (plus `bias`, added to `out` with `accumulate`) into its own columns of
    /// `out`.
    pub(super) fn split<T: Sync>(
        &self,
        job: &Job<T>,
        out: &mut [T],
        bias: Option<&[f32]>,
        accumulate: bool,
        threads: usize,
        tile: &GroupTile<T>,
    ) {
        let sink = Sink {
            out: out.as_mut_ptr(),
            n: self.n,
            bias,
            accumulate,
        };
        let sink = &sink;
        super::run_groups(threads, self.n.div_ceil(COLS), &|gs| tile(job, sink, gs));
    }
}

impl Packed<u16> {
    /// Whether this CPU runs [`PackedBf16::matmul`] (AVX-512 BF16).
    pub fn available() -> bool {
        super::Isa::Avx512Bf16.available()
    }

    /// `out [m, n] = x [m, k] @ W (+ bias)`, `+=` with `accumulate`, rounded once to bf16, as
    /// `dense::matmul` computes it on its `vdpbf16ps` path.
    pub fn matmul(
        &self,
        x: &[Bf16],
        m: usize,
        out: &mut [Bf16],
        accumulate: bool,
        bias: Option<&[f32]>,
        threads: usize,
    ) -> CoreResult<()> {
        let needs = "the packed bf16 kernel needs AVX-512 BF16";
        if !self.admit(x.len(), out.len(), bias, m, Self::available(), needs)? {
            return Ok(());
        }
        let (k, n) = (self.k, self.n);
        // The activations' bits, rows padded with a zero to whole pairs.
        let kp = self.padded_k();
        let mut xb = vec![0u16; m * kp];
        for (dst, src) in xb.chunks_exact_mut(kp).zip(x.chunks_exact(k.max(1))) {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.0;
            }
        }
        let job: Job<Bf16> = Job {
            w: &[],
            xf: &[],
            xb: &xb,
            kp,
            shape: Shape { m, k, n },
        };
        self.split(&job, out, bias, accumulate, threads, &|job, sink, gs| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512 BF16 checked above; the part owns groups `gs`, whose columns no
            // other part writes.
            unsafe {
                x86::run(self, job, sink, gs)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (job, sink, gs);
        });
        Ok(())
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::super::x86::dp;
    use super::{PackedBf16, COLS};
    use crate::cpu::dense::{Bf16, Job, Sink};

    /// Rows in tiles of 8 (then 4, 2, 1), groups two at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn run(w: &PackedBf16, j: &Job<Bf16>, sink: &Sink<Bf16>, gs: Range<usize>) {
        let m = j.shape.m;
        let mut g = gs.start;
        while g < gs.end {
            let ng = (gs.end - g).min(3);
            let mut r0 = 0;
            while r0 < m {
                let rows = m - r0;
                // SAFETY (every arm): the caller's contract; `tile` reads rows r0.. of `j.xb`
                // and groups g.. of `w`, all inside.
                unsafe {
                    let mr = match (rows, ng) {
                        (8.., 3) => tile::<8, 3>(w, j, sink, r0, g),
                        (8.., 2) => tile::<8, 2>(w, j, sink, r0, g),
                        (4..=7, 3) => tile::<4, 3>(w, j, sink, r0, g),
                        (2..=3, 3) => tile::<2, 3>(w, j, sink, r0, g),
                        (_, 3) => tile::<1, 3>(w, j, sink, r0, g),
                        (8.., _) => tile::<8, 1>(w, j, sink, r0, g),
                        (4..=7, 2) => tile::<4, 2>(w, j, sink, r0, g),
                        (4..=7, _) => tile::<4, 1>(w, j, sink, r0, g),
                        (2..=3, 2) => tile::<2, 2>(w, j, sink, r0, g),
                        (2..=3, _) => tile::<2, 1>(w, j, sink, r0, g),
                        (_, 2) => tile::<1, 2>(w, j, sink, r0, g),
                        (_, _) => tile::<1, 1>(w, j, sink, r0, g),
                    };
                    r0 += mr;
                }
            }
            g += ng;
        }
    }

    /// Rows `r0..r0 + MR` times groups `g..g + NG`; returns `MR`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const MR: usize, const NG: usize>(
        w: &PackedBf16,
        j: &Job<Bf16>,
        sink: &Sink<Bf16>,
        r0: usize,
        g: usize,
    ) -> usize {
        let group = w.group_len();
        // SAFETY: rows r0..r0 + MR of `j.xb` (`padded_k` apart) and groups g..g + NG of
        // `w.data` exist (the caller's tiling); prefetches never fault.
        unsafe {
            let x: [*const u16; MR] = std::array::from_fn(|r| j.xb.as_ptr().add((r0 + r) * j.kp));
            let wp: [*const u16; NG] =
                std::array::from_fn(|v| w.data.as_ptr().add((g + v) * group));
            let mut acc = [[_mm512_setzero_ps(); NG]; MR];
            for p in 0..w.padded_k() / 2 {
                for &b in wp.iter() {
                    _mm_prefetch::<_MM_HINT_T0>(b.add((p + 16) * COLS * 2) as *const i8);
                }
                let wv: [__m512i; NG] =
                    std::array::from_fn(|v| _mm512_loadu_si512(wp[v].add(p * COLS * 2).cast()));
                for r in 0..MR {
                    let xp = _mm512_set1_epi32(std::ptr::read_unaligned(x[r].add(2 * p).cast()));
                    for v in 0..NG {
                        acc[r][v] = dp(acc[r][v], wv[v], xp);
                    }
                }
            }
            let mut vals = [0.0f32; COLS];
            for (r, a) in acc.iter().enumerate() {
                for (v, &a) in a.iter().enumerate() {
                    let c = (g + v) * COLS;
                    let cols = COLS.min(w.n - c);
                    _mm512_storeu_ps(vals.as_mut_ptr(), a);
                    sink.put(r0 + r, c, &vals[..cols]);
                }
            }
        }
        MR
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::dense::{matmul, Isa, Layout, Opts};
    use crate::cpu::elem::Elem;
    use crate::test_rng::Rng;

    fn bf16s(rng: &mut Rng, n: usize) -> Vec<Bf16> {
        rng.floats(n).into_iter().map(Bf16::store).collect()
    }

    /// Every row, every shape (odd `k`, `n` not a multiple of 16, one to 20 rows), bias and
    /// accumulate: the same bits as `dense::matmul`'s `vdpbf16ps` path, on 1 and 3 threads.
    #[test]
    fn equals_the_kn_vdpbf16ps_path_bit_for_bit() {
        if !PackedBf16::available() {
            return;
        }
        let mut rng = Rng(11);
        for (k, n) in [(64, 48), (33, 17), (576, 960), (7, 5), (130, 100)] {
            let w = bf16s(&mut rng, k * n);
            let bits: Vec<u16> = w.iter().map(|b| b.0).collect();
            let packed = PackedBf16::pack(&bits, k, n).unwrap();
            for m in [1, 2, 3, 5, 8, 9, 20] {
                let x = bf16s(&mut rng, m * k);
                let bias = rng.floats(n);
                for (accumulate, with_bias) in [(false, false), (true, true), (false, true)] {
                    let init = bf16s(&mut rng, m * n);
                    let b = with_bias.then_some(&bias[..]);
                    let mut want = init.clone();
                    let opts = Opts {
                        accumulate,
                        bias: b,
                        threads: 1,
                        isa: Some(Isa::Avx512Bf16),
                    };
                    matmul(&x, &w, &mut want, Shape { m, k, n }, Layout::Kn, &opts).unwrap();
                    for threads in [1, 3] {
                        let mut got = init.clone();
                        packed
                            .matmul(&x, m, &mut got, accumulate, b, threads)
                            .unwrap();
                        let same = got.iter().zip(&want).all(|(a, b)| a.0 == b.0);
                        assert!(same, "k={k} n={n} m={m} acc={accumulate} threads={threads}");
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_mismatched_operands() {
        assert!(PackedBf16::pack(&[0; 5], 2, 3).is_err());
        let p = PackedBf16::pack(&[0; 6], 2, 3).unwrap();
        assert_eq!((p.k(), p.n(), p.nbytes()), (2, 3, 64));
        if !PackedBf16::available() {
            return;
        }
        let x = vec![Bf16::store(1.0); 4];
        let mut out = vec![Bf16::store(0.0); 6];
        assert!(p.matmul(&x[..3], 2, &mut out, false, None, 1).is_err());
        assert!(p.matmul(&x, 2, &mut out[..5], false, None, 1).is_err());
        assert!(p
            .matmul(&x, 2, &mut out, false, Some(&[0.0; 2]), 1)
            .is_err());
    }
}
