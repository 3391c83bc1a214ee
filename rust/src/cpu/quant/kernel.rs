//! The matmul driver: quantize `x` once, split the row groups over threads, and for each group
//! run a register tile of up to `Isa::tile_rows` activation rows against its blocks. Each
//! group's blocks (≤ 10 KiB per 576 columns) stay in L1 while every tile of `x` streams past.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::act::{self, QActs};
use super::{Format, QKind, QMatrix, Tile, BLOCK, ROWS};
use crate::error::{CoreError, CoreResult};

/// A SIMD path of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Scalar,
    /// AVX2 `vpmaddubsw` (x86-64-v3).
    Avx2,
    /// AVX-VNNI `vpdpbusd` on 256-bit vectors.
    AvxVnni,
    /// AVX-512 VNNI `vpdpbusd` on 512-bit vectors.
    Avx512Vnni,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx_vnni",
            Isa::Avx512Vnni => "avx512_vnni",
        }
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::AvxVnni => avx2 && has!("avxvnni"),
                Isa::Avx512Vnni => has!("avx512f") && has!("avx512bw") && has!("avx512vnni"),
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
            let rank = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2];
            rank.into_iter()
                .find(|i| i.available())
                .unwrap_or(Isa::Scalar)
        })
    }

    /// `isa`, or [`Isa::best`] for `None`; an error when this CPU cannot run it.
    pub(crate) fn pick(isa: Option<Isa>) -> CoreResult<Isa> {
        let isa = isa.unwrap_or_else(Isa::best);
        if !isa.available() {
            let r = format!("{} is not supported by this CPU", isa.name());
            return Err(CoreError::invalid("isa", r));
        }
        Ok(isa)
    }

    /// Activation rows per register tile of a `kind` matrix (16 ymm registers hold 2 rows'
    /// accumulators; AVX2's 4-bit body sums in i16 lanes and folds each block half at once, so
    /// 4 rows fit and every unpacked chunk serves twice as many rows). MXFP4 cannot take that
    /// body: its table values reach 24, and a lane's 8 pairs sum to up to 8 · 2 · 24 · 127 =
    /// 48768 > 32767 (Q4: 30480), so it keeps the 2-row pair-at-a-time body (see `x86.rs`).
    pub(super) fn tile_rows(self, kind: QKind) -> usize {
        match (self, kind) {
            (Isa::Avx512Vnni, _) => 8,
            (Isa::Scalar, _) | (Isa::Avx2, QKind::Q4) => 4,
            (Isa::Avx2 | Isa::AvxVnni, _) => 2,
        }
    }
}

/// Activation rows a pass over the row groups takes at most: a prefill chunk's rows go through
/// every group in slabs, so a slab's int8 activations (512 x 1,536 = 768 KiB at most for
/// SmolLM2's down projection) stay in L2 while the groups stream past, where one pass over ~2,000
/// rows read them from L3 for every group. Tiles and their sums are the same either way (the
/// same bits); SmolLM2-135M's four matrices at 1,932 rows, Zen 4, 2 threads: a layer 1.01-1.10x.
pub(super) const SLAB_ROWS: usize = 512;

/// Options of [`QMatrix::matmul`].
#[derive(Clone, Copy, Debug)]
pub struct MatmulOpts<'a> {
    /// `out += x @ W^T` (e.g. the residual add) instead of `out = x @ W^T`.
    pub accumulate: bool,
    /// Added to every output row, `[rows]`.
    pub bias: Option<&'a [f32]>,
    /// Threads (parts of the row groups); at most one per group is used.
    pub threads: usize,
    /// Force a SIMD path (tests, benches); `None` = [`Isa::best`].
    pub isa: Option<Isa>,
}

impl Default for MatmulOpts<'_> {
    fn default() -> Self {
        MatmulOpts {
            accumulate: false,
            bias: None,
            threads: 1,
            isa: None,
        }
    }
}

/// Runs one tile: `(format, group blocks, blocks per row, activations, first row, rows, out)`.
pub(super) type TileFn = fn(Format, &[u8], usize, &QActs, usize, usize, &mut Tile);

/// The output pointer shared by the parts: each writes only the columns of the groups it claimed.
pub(super) struct OutPtr(pub *mut f32);
// SAFETY: the parts write disjoint column ranges of `out` (see `matmul`), and `run_parts`
// returns only after all of them finish.
unsafe impl Sync for OutPtr {}

impl QMatrix {
    /// `out[m, rows] = x[m, cols] @ W^T` (`+=` with `opts.accumulate`, `+ bias`), all f32
    /// row-major.
    pub fn matmul(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        opts: &MatmulOpts,
    ) -> CoreResult<()> {
        let (n, k) = (self.rows, self.cols);
        if x.len() != m * k {
            let r = format!("has {} elements, expected m * cols = {m} * {k}", x.len());
            return Err(CoreError::invalid("x", r));
        }
        if out.len() != m * n {
            let r = format!("has {} elements, expected m * rows = {m} * {n}", out.len());
            return Err(CoreError::invalid("out", r));
        }
        if let Some(b) = opts.bias {
            if b.len() != n {
                let r = format!("has {} elements, expected rows = {n}", b.len());
                return Err(CoreError::invalid("bias", r));
            }
        }
        let isa = Isa::pick(opts.isa)?;
        if m == 0 {
            return Ok(());
        }
        let acts = act::quantize(x, m, k, opts.threads, self.kind() == QKind::Q6K);
        let tile = tile_fn(isa);
        let dst = OutPtr(out.as_mut_ptr());
        let dst = &dst;
        for slab in (0..m).step_by(SLAB_ROWS) {
            let rows = slab..(slab + SLAB_ROWS).min(m);
            steal(opts.threads, self.groups(), &|g, res| {
                // SAFETY: `out` is `[m, rows]` (checked above) and `steal` hands group `g`, i.e.
                // columns g*16 .. g*16 + 16, to exactly one part.
                unsafe {
                    self.group_into(
                        g,
                        tile,
                        isa,
                        &acts,
                        rows.clone(),
                        dst,
                        opts.bias,
                        opts.accumulate,
                        res,
                    )
                }
            });
        }
        Ok(())
    }

    /// Activation rows `rows` of `acts` times row group `g` into `dst` (row `i` of `acts` goes
    /// to row `i` of a row-major `[_, self.rows]` output), `+ bias`, added with `accumulate`.
    ///
    /// # Safety
    /// `dst` must hold `rows.end` rows of `self.rows` columns, and no other thread may touch
    /// columns `g*16 .. g*16 + 16` of those rows meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn group_into(
        &self,
        g: usize,
        tile: TileFn,
        isa: Isa,
        acts: &QActs,
        rows: std::ops::Range<usize>,
        dst: &OutPtr,
        bias: Option<&[f32]>,
        accumulate: bool,
        res: &mut Tile,
    ) {
        let (n, nb, mr) = (self.rows, self.blocks_per_row(), isa.tile_rows(self.kind()));
        let (blocks, fmt) = (self.group(g), self.format());
        // The caller picks the tile by ISA; Q6K blocks have tiles of their own.
        let tile = if fmt.kind == QKind::Q6K {
            q6k_tile_fn(isa)
        } else {
            tile
        };
        let cols = ROWS.min(n - g * ROWS);
        let bias = bias.map(|b| &b[g * ROWS..g * ROWS + cols]);
        for i0 in rows.clone().step_by(mr) {
            let count = mr.min(rows.end - i0);
            tile(fmt, blocks, nb, acts, i0, count, res);
            for (r, vals) in res[..count].iter().enumerate() {
                // SAFETY: row i0 + r < rows.end and columns g*16 .. g*16 + cols < n lie inside
                // `dst`, which the caller reserves for this group.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(dst.0.add((i0 + r) * n + g * ROWS), cols)
                };
                epilogue(o, &vals[..cols], bias, accumulate);
            }
        }
    }
}

/// The tile function of `isa` for Q6K blocks: the 512-bit VNNI body on AVX-512 VNNI, the AVX2
/// body on the other x86 SIMD paths (AVX-VNNI has no 256-bit body of its own here).
fn q6k_tile_fn(isa: Isa) -> TileFn {
    match isa {
        Isa::Scalar => super::q6k::tile_scalar,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => super::q6k_x86::tile_avx512,
        #[cfg(target_arch = "x86_64")]
        _ => super::q6k_x86::tile_avx2,
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only Scalar is available"),
    }
}

/// The tile function of `isa` (which must be available).
pub(super) fn tile_fn(isa: Isa) -> TileFn {
    match isa {
        Isa::Scalar => tile_scalar,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::x86::tile_avx2,
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => super::x86::tile_avx_vnni,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => super::x86::tile_avx512_vnni,
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only Scalar is available"),
    }
}

/// `f(item, scratch)` for every item of `0..items` on up to `threads` parts.
///
/// Each part owns a contiguous range of items (so repeated calls find the same weights in the
/// same core's cache) and hands it out in small chunks; a part that finishes takes chunks from
/// the others. A thread that falls behind (descheduled on a shared machine) then delays the
/// call by about a chunk, not by its whole share; the join still waits for every thread to
/// arrive once.
pub(super) fn steal(threads: usize, items: usize, f: &(dyn Fn(usize, &mut Tile) + Sync)) {
    let parts = threads.clamp(1, items.max(1));
    let chunk = (items / (8 * parts)).max(1);
    let next: Vec<AtomicUsize> = (0..parts)
        .map(|p| AtomicUsize::new(items * p / parts))
        .collect();
    crate::cpu::parallel::run_parts(parts, &|p| {
        let mut res: Tile = [[0.0; ROWS]; 8];
        for owner in (0..parts).map(|i| (p + i) % parts) {
            let end = items * (owner + 1) / parts;
            loop {
                let first = next[owner].fetch_add(chunk, Ordering::Relaxed);
                if first >= end {
                    break;
                }
                for item in first..(first + chunk).min(end) {
                    f(item, &mut res);
                }
            }
        }
    });
}

fn epilogue(out: &mut [f32], vals: &[f32], bias: Option<&[f32]>, accumulate: bool) {
    // One loop per case, so each vectorises without per-element branches.
    match (bias, accumulate) {
        (None, false) => out.copy_from_slice(vals),
        (None, true) => out.iter_mut().zip(vals).for_each(|(o, &v)| *o += v),
        (Some(b), false) => {
            for ((o, &v), &b) in out.iter_mut().zip(vals).zip(b) {
                *o = v + b;
            }
        }
        (Some(b), true) => {
            for ((o, &v), &b) in out.iter_mut().zip(vals).zip(b) {
                *o += v + b;
            }
        }
    }
}

/// The reference path: same arithmetic as the SIMD tiles (exact integer block dot products,
/// then `acc += isum * (s * xs)`, `acc += min * Σx` per block), one element at a time.
fn tile_scalar(
    fmt: Format,
    blocks: &[u8],
    nb: usize,
    a: &QActs,
    row0: usize,
    rows: usize,
    out: &mut Tile,
) {
    let bb = fmt.block_bytes();
    for (r, res) in out[..rows].iter_mut().enumerate() {
        let i = row0 + r;
        for (row, acc_out) in res.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for b in 0..nb {
                let blk = &blocks[b * bb..][..bb];
                let xq = &a.q[i * a.k + b * BLOCK..][..BLOCK];
                let q = super::dequant::unpack(fmt.kind, blk, row);
                let isum: i32 = q.iter().zip(xq).map(|(&w, &x)| w as i32 * x as i32).sum();
                let (s, min) = fmt.scale_min_at(blk, row);
                acc += isum as f32 * (s * a.scale[i * nb + b]);
                acc += min * a.sum[i * nb + b];
            }
            *acc_out = acc;
        }
    }
}
