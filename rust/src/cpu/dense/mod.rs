//! Dense matmuls for small batches: `out[M, N] (+)= x[M, K] @ W (+ bias)` with `W` f32, bf16 or
//! f16 and `M` a decode batch (1..8 rows), streaming the weights once per call.
//!
//! torch's GEMMs are built for large `M`: at `M = 1` a bf16 `mm` over a 135M model reads its
//! weights at a fraction of the memory bandwidth. These kernels read every weight once per call
//! (a row tile of up to 4 activation rows against a column block held in registers, the next tile
//! finding the block in L1/L2) and split the output columns over the core's pool.
//!
//! # Layouts
//! The weight is read where the model keeps it, with no copy: [`Layout::Kn`] is `W [K, N]`
//! row-major (ironlm's `[in, out]` parameters, `x @ W`): each step over `k` broadcasts `x[k]`
//! and multiplies-adds it into whole vectors of output columns, so there are no horizontal sums.
//! [`Layout::Nk`] is `W^T [N, K]` row-major (the LM head: the `[vocab, hidden]` embedding
//! table), a dot product per output over 16 lanes of `k`.
//!
//! # Row invariance
//! Each output element's arithmetic is a fixed sequence that depends on its column, `K` and the
//! ISA only, never on `M`, on which tile its row fell in, or on the thread split: `Kn` runs one
//! f32 FMA chain over `k = 0, 1, ..` (`acc = fma(w[k][n], x[k], acc)`); `Nk` runs lane `l` of 16
//! over `k ≡ l (mod 16)` (a zero-padded last chunk), then sums the lanes in the fixed tree of
//! [`hsum16`]; with AVX-512 BF16 the pairs `(k, k+1)` go through `vdpbf16ps` instead (`Kn`
//! interleaves two weight rows per step; `Nk` reads 32 `k` per step). Then `+ bias`,
//! `+ out` with `accumulate`, one rounding to the storage type. So a decode row gets the bits it
//! gets in any batch, which batch-invariant mode needs; the scalar path computes the FMA chains
//! in the same order, bit for bit (the tests check).

#[cfg(target_arch = "x86_64")]
mod x86;

mod packed;
mod packed_f32;
pub use packed::PackedBf16;
pub use packed_f32::PackedF32;

/// A packed kernel's call: output column groups `0..groups` split over up to `threads` parts, each
/// part running `f` on its own contiguous range (so no two parts write the same columns).
fn run_groups(threads: usize, groups: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    let parts = threads.clamp(1, groups);
    crate::cpu::parallel::run_parts(parts, &|p| f(groups * p / parts..groups * (p + 1) / parts));
}

/// The packed kernels' operand checks: `x [m, k]`, `out [m, n]`, `bias [n]`.
fn check_call(
    x: usize,
    out: usize,
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
) -> CoreResult<()> {
    if x != m * k {
        let r = format!("has {x} elements, expected m * k = {m} * {k}");
        return Err(CoreError::invalid("x", r));
    }
    if out != m * n {
        let r = format!("has {out} elements, expected m * n = {m} * {n}");
        return Err(CoreError::invalid("out", r));
    }
    match bias {
        Some(b) if b.len() != n => {
            let r = format!("has {} elements, expected n = {n}", b.len());
            Err(CoreError::invalid("bias", r))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;

use std::sync::OnceLock;

use crate::cpu::elem::{Bf16, Elem, F16};
use crate::error::{CoreError, CoreResult};

/// Where the weight's elements lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `W [K, N]` row-major: `out = x @ W`.
    Kn,
    /// `W^T [N, K]` row-major: `out = x @ W^T[..]^T`, each output a dot product of two rows.
    Nk,
}

/// A SIMD path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Scalar,
    /// AVX2 + FMA + F16C, 8 lanes.
    Avx2,
    /// AVX-512F (+BW), 16 lanes; bf16 and f16 weights widened to f32.
    Avx512,
    /// AVX-512 BF16 `vdpbf16ps` on bf16 weights and activations (other types take [`Isa::Avx512`]).
    Avx512Bf16,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512_bf16",
        }
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::Avx512 => avx512,
                Isa::Avx512Bf16 => avx512 && has!("avx512bf16"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// The fastest path this CPU has.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let rank = [Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2];
            rank.into_iter()
                .find(|i| i.available())
                .unwrap_or(Isa::Scalar)
        })
    }
}

/// The shape of a call: `x [m, k]`, `out [m, n]`.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// Options of [`matmul`].
#[derive(Clone, Copy, Debug)]
pub struct Opts<'a> {
    /// `out += x @ W` (the residual add) instead of `out = x @ W`.
    pub accumulate: bool,
    /// Added to every output row, `[n]`.
    pub bias: Option<&'a [f32]>,
    pub threads: usize,
    /// Force a SIMD path (tests, benches); `None` = [`Isa::best`].
    pub isa: Option<Isa>,
}

impl Default for Opts<'_> {
    fn default() -> Self {
        Opts {
            accumulate: false,
            bias: None,
            threads: 1,
            isa: None,
        }
    }
}

/// Which storage type a [`Weight`] is (the SIMD paths widen each differently).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    F32,
    Bf16,
    F16,
}

/// An element type the kernels read: widened to f32 lane-wise by the SIMD paths.
pub trait Weight: Elem {
    const KIND: Kind;

    /// `Some` for bf16: its bits, for the `vdpbf16ps` path.
    fn bf16_bits(_: &[Self]) -> Option<&[u16]> {
        None
    }
}

impl Weight for f32 {
    const KIND: Kind = Kind::F32;
}

impl Weight for F16 {
    const KIND: Kind = Kind::F16;
}

impl Weight for Bf16 {
    const KIND: Kind = Kind::Bf16;

    fn bf16_bits(s: &[Bf16]) -> Option<&[u16]> {
        // SAFETY: `Bf16` is a transparent u16.
        Some(unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) })
    }
}

/// The operands one part works on: `xf` is `x` widened to f32, rows `kp` apart (zero-padded to a
/// multiple of 32), `xb` the same for bf16 bits (only on the `vdpbf16ps` path).
pub(crate) struct Job<'a, T> {
    pub w: &'a [T],
    pub xf: &'a [f32],
    pub xb: &'a [u16],
    pub kp: usize,
    pub shape: Shape,
}

/// Where results go: adds the bias and (with `accumulate`) the old output, rounds once.
pub(crate) struct Sink<'a, T> {
    out: *mut T,
    n: usize,
    bias: Option<&'a [f32]>,
    accumulate: bool,
}

// SAFETY: the parts write disjoint output columns (see `matmul`), and `run_parts` returns only
// after all of them finish.
unsafe impl<T> Sync for Sink<'_, T> {}

impl<T: Elem> Sink<'_, T> {
    /// Results of row `row`, columns `col..col + vals.len()`.
    #[inline(always)]
    pub fn put(&self, row: usize, col: usize, vals: &[f32]) {
        // SAFETY: callers pass row < m and columns inside the part's own range of 0..n.
        let o =
            unsafe { std::slice::from_raw_parts_mut(self.out.add(row * self.n + col), vals.len()) };
        match (self.bias, self.accumulate) {
            (None, false) => o.iter_mut().zip(vals).for_each(|(o, &v)| *o = T::store(v)),
            (None, true) => o
                .iter_mut()
                .zip(vals)
                .for_each(|(o, &v)| *o = T::store(v + o.load())),
            (Some(b), acc) => {
                for ((o, &v), &b) in o.iter_mut().zip(vals).zip(&b[col..]) {
                    let v = v + b;
                    *o = T::store(if acc { v + o.load() } else { v });
                }
            }
        }
    }
}

/// The 16 lanes of an `Nk` dot product summed in a fixed tree (halves, quarters, ...), the same
/// on every path.
#[inline(always)]
pub(crate) fn hsum16(mut l: [f32; 16]) -> f32 {
    for s in [8, 4, 2, 1] {
        for i in 0..s {
            l[i] += l[i + s];
        }
    }
    l[0]
}

/// `Kn` columns `c0..c1` (any width) of rows `r0..r0 + rows` (≤ 16 columns at a time), one FMA
/// chain per output: the reference, and the SIMD paths' tail columns.
#[inline(always)]
pub(crate) fn kn_scalar<T: Weight>(
    j: &Job<T>,
    sink: &Sink<T>,
    r0: usize,
    rows: usize,
    c0: usize,
    c1: usize,
) {
    let (k, n) = (j.shape.k, j.shape.n);
    let mut c = c0;
    while c < c1 {
        let w = (c1 - c).min(16);
        for r in r0..r0 + rows {
            let x = &j.xf[r * j.kp..][..k];
            let mut acc = [0.0f32; 16];
            for (kk, &xv) in x.iter().enumerate() {
                let wr = &j.w[kk * n + c..][..w];
                for (a, &wv) in acc.iter_mut().zip(wr) {
                    *a = wv.load().mul_add(xv, *a);
                }
            }
            sink.put(r, c, &acc[..w]);
        }
        c += w;
    }
}

/// `Nk` outputs `n0..n1` of rows `r0..r0 + rows`: 16 lanes over `k`, the last chunk zero-padded,
/// then [`hsum16`].
#[inline(always)]
pub(crate) fn nk_scalar<T: Weight>(
    j: &Job<T>,
    sink: &Sink<T>,
    r0: usize,
    rows: usize,
    n0: usize,
    n1: usize,
) {
    let k = j.shape.k;
    for r in r0..r0 + rows {
        let x = &j.xf[r * j.kp..][..k.div_ceil(16) * 16];
        for c in n0..n1 {
            let w = &j.w[c * k..][..k];
            let mut lanes = [0.0f32; 16];
            for (ch, xc) in x.chunks_exact(16).enumerate() {
                for (l, lane) in lanes.iter_mut().enumerate() {
                    let wv = w.get(ch * 16 + l).map_or(0.0, |v| v.load());
                    *lane = wv.mul_add(xc[l], *lane);
                }
            }
            sink.put(r, c, &[hsum16(lanes)]);
        }
    }
}

/// `out = x @ W (+ bias)` (`+=` with `opts.accumulate`), `W` as `layout` says, all row-major.
pub fn matmul<T: Weight>(
    x: &[T],
    w: &[T],
    out: &mut [T],
    shape: Shape,
    layout: Layout,
    opts: &Opts,
) -> CoreResult<()> {
    let Shape { m, k, n } = shape;
    let want = [
        ("x", x.len(), m * k),
        ("weight", w.len(), k * n),
        ("out", out.len(), m * n),
    ];
    for (name, got, want) in want {
        if got != want {
            let r = format!("has {got} elements, expected {want} (m={m}, k={k}, n={n})");
            return Err(CoreError::invalid(name, r));
        }
    }
    if let Some(b) = opts.bias {
        if b.len() != n {
            let r = format!("has {} elements, expected n = {n}", b.len());
            return Err(CoreError::invalid("bias", r));
        }
    }
    let mut isa = opts.isa.unwrap_or_else(Isa::best);
    if !isa.available() {
        let r = format!("{} is not supported by this CPU", isa.name());
        return Err(CoreError::invalid("isa", r));
    }
    let bits = T::bf16_bits(x);
    if isa == Isa::Avx512Bf16 && bits.is_none() {
        isa = Isa::Avx512;
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    // Activations widened (or, for vdpbf16ps, copied) once, rows padded with zeros to a multiple
    // of 32 so every kernel reads whole chunks: a few KiB against the weights' megabytes.
    let kp = k.div_ceil(32) * 32;
    let mut xf = vec![0.0f32; m * kp];
    let mut xb = Vec::new();
    for (dst, src) in xf.chunks_exact_mut(kp).zip(x.chunks_exact(k.max(1))) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.load());
    }
    if let (Isa::Avx512Bf16, Some(b)) = (isa, bits) {
        xb = vec![0u16; m * kp];
        for (dst, src) in xb.chunks_exact_mut(kp).zip(b.chunks_exact(k.max(1))) {
            dst[..k].copy_from_slice(src);
        }
    }
    let job = Job {
        w,
        xf: &xf,
        xb: &xb,
        kp,
        shape,
    };
    let sink = Sink {
        out: out.as_mut_ptr(),
        n,
        bias: opts.bias,
        accumulate: opts.accumulate,
    };
    // Parts own contiguous output columns; `Kn` splits on 32-column boundaries so a column's
    // kernel (full vector or scalar tail) never depends on the split.
    let unit = match layout {
        Layout::Kn => 32,
        Layout::Nk => 4,
    };
    let units = n.div_ceil(unit);
    let parts = opts.threads.clamp(1, units);
    let (job, sink) = (&job, &sink);
    crate::cpu::parallel::run_parts(parts, &|p| {
        let c0 = (units * p / parts * unit).min(n);
        let c1 = (units * (p + 1) / parts * unit).min(n);
        run(isa, layout, job, sink, c0, c1);
    });
    Ok(())
}

fn run<T: Weight>(isa: Isa, layout: Layout, j: &Job<T>, sink: &Sink<T>, c0: usize, c1: usize) {
    let m = j.shape.m;
    match (isa, layout) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16, _) => x86::run(isa, layout, j, sink, c0, c1),
        (_, Layout::Kn) => kn_scalar(j, sink, 0, m, c0, c1),
        (_, Layout::Nk) => nk_scalar(j, sink, 0, m, c0, c1),
    }
}
