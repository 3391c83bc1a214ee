//! Block-quantized weight matrices and their CPU matmul: `out[M, N] (+)= x[M, K] @ W^T`, with
//! `W` kept quantized (`N = rows`, `K = cols`) and `x` quantized on the fly to int8.
//!
//! # Format
//! Every run of 32 consecutive weights of a row (a *block*) is affine: `w = scale * q + min`,
//! `q` unsigned (`u8` for [`QKind::Q8`], 4-bit for [`QKind::Q4`]), `scale` and `min` f32. The
//! GGUF formats Q4_0, Q4_1 and Q4_K map onto Q4 exactly, Q8_0 and Q5_K onto Q8 exactly (their
//! sub-block scales and mins are exact f32 products). Q6_K, whose scales cover 16 weights, keeps
//! its own blocks as [`QKind::Q6K`] (6.5625 bits a weight, layout and kernels in `q6k.rs`);
//! stacked with other kinds ([`QMatrix::concat`]) it is re-rounded into Q8 (see [`ggml`]).
//!
//! Unsigned weights times signed int8 activations is what VNNI `vpdpbusd` (u8 × i8, four
//! products summed into each i32 lane) and AVX2 `vpmaddubsw` take. The min term needs no
//! integer work: `Σ (s q + m) x = s Σ q x + m Σ x`, with `Σ x` taken over the quantized
//! activations, computed once per block when quantizing them (see `act.rs`). So the result is
//! exactly `W @ xq` up to f32 rounding,
//! `xq` being `x` rounded to int8 per 32-block, so its error is `|Σ w (x - xq)| <= Σ_b
//! amax_b / 254 · Σ |w|`, which the tests assert.
//!
//! # Layout
//! Rows are packed in groups of [`ROWS`] = 16 (the last group zero-padded: scale 0, min 0), and
//! each group stores its blocks in `K` order, each block as one contiguous, 64-byte aligned run:
//!
//! ```text
//! Q8 (640 B): 8 chunks of 64 B, chunk j = for each row r of the group: q[r][4j..4j+4]
//!             then 16 scales, 16 mins (row order; f32, or f16 when exact)
//! Q4 (384 B): 4 chunks of 64 B, chunk j = for each row r: byte i = q[r][4j+i] | q[r][4j+16+i] << 4
//!             then 16 scales, 16 mins (Q8: 576 B and Q4: 320 B with f16 ones)
//! ```
//!
//! Symmetric blocks (every min `-offset * scale`: Q4_0, Q8_0, int8 per channel) drop the 16 mins
//! (Q8: 544 B, Q4: 288 B with f16 scales: 8.5 and 4.5 bits a weight, as in the GGUF file).
//!
//! So one 64-byte load (Q4: plus a mask and a shift) holds four columns of all 16 rows, and
//! `vpdpbusd` against the four matching activation bytes broadcast to every lane leaves each
//! row's partial dot product in its own lane: no horizontal sums, the per-block scaling is a
//! multiply and two FMAs on 16 rows at once, and one loaded chunk serves every activation row of
//! a register tile. A whole group is one sequential stream (what the hardware prefetcher wants
//! at M = 1), and threads split the groups. Resident size: 6 bits a weight for Q4, 10 for Q8
//! with f32 scales and mins (Q4_K's `d · sc` products need them), 5 and 9 bits when all of them
//! are exact f16s (Q4_1 files: 16 f16 scales, then 16 f16 mins; see `Format`), 4.5 and 8.5 when
//! the mins are implied as well (Q4_0, Q8_0 files).
//!
//! # Regimes (one Sapphire Rapids-class core, `benches/bench_quant_matmul.py --clock thread`)
//! M = 1 streams 60-120 GB/s from L1/L2 and ~28 GB/s from L3 (the LM head), M = 8..16 reaches
//! 380-480 int8 GOP/s; from M ≈ 32-64 a dense bf16 `torch.mm` on AMX is faster (500-1400
//! GFLOP/s), hence [`QMatrix::dequantize_into`] with bf16 output for large batches.

mod act;
mod dequant;
pub mod ggml;
mod kernel;
mod moe;
mod mx4;
mod parts;
mod prefetch;
mod q6k;
#[cfg(target_arch = "x86_64")]
mod q6k_x86;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod moe_tests;
#[cfg(test)]
mod mx4_tests;
#[cfg(test)]
mod q6k_tests;
#[cfg(test)]
mod tests;

pub use dequant::DequantOut;
pub use kernel::{Isa, MatmulOpts};
pub use moe::{Experts, MoeAct, Routing};
pub use prefetch::{prefetch_distances, set_prefetch_distances};

use crate::error::{CoreError, CoreResult};

/// Rows per packed group (one 512-bit vector of i32 lanes).
pub const ROWS: usize = 16;
/// Weights per block.
pub const BLOCK: usize = 32;

/// One tile's result: up to 8 activation rows × the 16 rows of a group (the kernel's SIMD paths fill it).
pub(crate) type Tile = [[f32; ROWS]; 8];

/// One cache line, so the packed data is 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QKind {
    /// 8-bit unsigned quants.
    Q8,
    /// 4-bit unsigned quants.
    Q4,
    /// GGUF Q6_K super-blocks: 6-bit quants, an i8 scale per 16 weights, an f16 one per 256
    /// (`q6k.rs`; only from Q6_K files).
    Q6K,
    /// MXFP4: 4-bit E2M1 codes read through a table as `2 e2m1 + 12` (0..=24), one E8M0 byte
    /// per block for `scale = 2^(e - 128)`, min `-12 scale` (see `mx4.rs`).
    Mx4,
}

impl QKind {
    /// Bytes of quants per packed block (16 rows × 32 columns).
    pub(crate) const fn quant_bytes(self) -> usize {
        match self {
            QKind::Q8 => ROWS * BLOCK,
            QKind::Q4 | QKind::Mx4 => ROWS * BLOCK / 2,
            QKind::Q6K => q6k::QUANT_BYTES,
        }
    }

    pub const fn max_q(self) -> u8 {
        match self {
            QKind::Q8 => 255,
            QKind::Q4 => 15,
            QKind::Q6K => 63,
            QKind::Mx4 => 24,
        }
    }

    /// `-offset`: a symmetric block's min is `-offset * scale` (`w = scale * (q - offset)`).
    pub(crate) const fn neg_offset(self) -> f32 {
        match self {
            QKind::Q8 => -128.0,
            QKind::Q4 => -8.0,
            QKind::Q6K => -32.0,
            QKind::Mx4 => -mx4::OFFSET,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QKind::Q8 => "q8",
            QKind::Q4 => "q4",
            QKind::Q6K => "q6k",
            QKind::Mx4 => "mxfp4",
        }
    }
}

/// How a matrix's blocks are packed: the quant width, whether scales and mins are stored as
/// f16 (when every one of them is exactly an f16, as in Q4_0, Q4_1 and Q8_0 files: 5 and 9 bits a
/// weight instead of 6 and 10, less to stream per token) or f32, and whether the mins are stored
/// at all: in symmetric blocks (Q4_0, Q8_0, int8 per channel) every min is exactly
/// `-offset * scale` ([`QKind::neg_offset`]), which the kernels recompute (exact: a power of two), so
/// a block is its quants and 16 scales only (4.5 and 8.5 bits a weight with f16 scales).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Format {
    pub kind: QKind,
    pub half: bool,
    pub sym: bool,
}

impl Format {
    pub const fn quant_bytes(self) -> usize {
        self.kind.quant_bytes()
    }

    /// Bytes of one block's 16 scales (or of its 16 mins; MXFP4: 16 E8M0 bytes, no mins).
    pub const fn scales_bytes(self) -> usize {
        ROWS * match (self.kind, self.half) {
            (QKind::Mx4, _) => 1,
            (_, true) => 2,
            (_, false) => 4,
        }
    }

    /// Bytes per packed block: quants, 16 scales, 16 mins unless symmetric (a multiple of 64
    /// except for symmetric f16 blocks, 288 and 544 B, which the kernels load unaligned).
    pub const fn block_bytes(self) -> usize {
        match self.kind {
            QKind::Q6K => q6k::BLOCK_BYTES,
            _ => self.quant_bytes() + self.scales_bytes() * if self.sym { 1 } else { 2 },
        }
    }

    /// Bytes of a row group's blocks over `cols` columns (Q6K adds its super-blocks' `d`s).
    pub const fn group_bytes(self, cols: usize) -> usize {
        match self.kind {
            QKind::Q6K => cols / q6k::SUPER * q6k::SUPER_BYTES,
            _ => cols / BLOCK * self.block_bytes(),
        }
    }

    /// `(scale, min)` of row `r` (0..16) in a packed block (not Q6K: two scales a block).
    #[inline(always)]
    pub fn scale_min_at(self, blk: &[u8], r: usize) -> (f32, f32) {
        debug_assert!(self.kind != QKind::Q6K);
        let (qb, sb) = (self.quant_bytes(), self.scales_bytes());
        if self.kind == QKind::Mx4 {
            let s = mx4::e8m0_half(blk[qb + r]);
            return (s, s * self.kind.neg_offset());
        }
        let at = |o: usize| {
            if self.half {
                ggml::f16_to_f32(u16::from_le_bytes([blk[o], blk[o + 1]]))
            } else {
                f32::from_le_bytes(blk[o..o + 4].try_into().unwrap())
            }
        };
        let w = sb / ROWS;
        let s = at(qb + r * w);
        let m = if self.sym {
            s * self.kind.neg_offset()
        } else {
            at(qb + sb + r * w)
        };
        (s, m)
    }
}

/// `v` as f16 bits when that is exact.
fn exact_f16(v: f32) -> Option<u16> {
    let sign = if v.is_sign_negative() { 0x8000u16 } else { 0 };
    let a = v.abs();
    if a == 0.0 {
        return Some(sign);
    }
    if !a.is_finite() || a > 65504.0 {
        return None;
    }
    // Subnormal f16s are the multiples of 2^-24 below 2^-14; normal ones have 11 significant bits.
    let bits = if a < 2f32.powi(-14) {
        let m = a * 2f32.powi(24);
        (m.fract() == 0.0).then_some(m as u16)?
    } else {
        let (e, m) = (
            ((a.to_bits() >> 23) & 0xFF) as i32 - 127,
            a.to_bits() & 0x7F_FFFF,
        );
        if m & 0x1FFF != 0 {
            return None;
        }
        (((e + 15) as u16) << 10) | (m >> 13) as u16
    };
    Some(sign | bits)
}

/// A weight matrix `[rows, cols]` (`[out_features, in_features]`), block-quantized and packed.
#[derive(Clone)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    kind: QKind,
    /// Scales and mins stored as f16 (see [`Format`]).
    half: bool,
    /// Mins implied by the scales, not stored (see [`Format`]).
    sym: bool,
    data: Vec<Line>,
}

/// Unpacked blocks: `q[rows * cols]`, `scale`/`min` `[rows * cols / 32]`, row-major.
pub(crate) struct Blocks {
    pub q: Vec<u8>,
    pub scale: Vec<f32>,
    pub min: Vec<f32>,
}

impl Blocks {
    pub fn new(rows: usize, cols: usize) -> Self {
        Blocks {
            q: vec![0; rows * cols],
            scale: vec![0.0; rows * cols / BLOCK],
            min: vec![0.0; rows * cols / BLOCK],
        }
    }
}

pub(crate) fn check_shape(rows: usize, cols: usize) -> CoreResult<()> {
    if rows == 0 {
        return Err(CoreError::invalid("rows", "must be >= 1"));
    }
    if cols == 0 || !cols.is_multiple_of(BLOCK) {
        return Err(CoreError::invalid(
            "cols",
            format!("must be a positive multiple of {BLOCK}, got {cols}"),
        ));
    }
    Ok(())
}

impl QMatrix {
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn kind(&self) -> QKind {
        self.kind
    }

    /// Resident bytes of the packed weights (padding rows included).
    pub fn nbytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<Line>()
    }

    /// Whether scales and mins are stored as f16 (exactly: only when all of them are f16s).
    pub fn half_scales(&self) -> bool {
        self.half
    }

    /// Whether the mins are implied by the scales (`-offset * scale`) and not stored.
    pub fn implied_mins(&self) -> bool {
        self.sym
    }

    pub(crate) fn format(&self) -> Format {
        Format {
            kind: self.kind,
            half: self.half,
            sym: self.sym,
        }
    }

    pub(crate) fn groups(&self) -> usize {
        self.rows.div_ceil(ROWS)
    }

    pub(crate) fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is 64 plain bytes with no padding, so the lines are one byte run.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr().cast(), self.nbytes()) }
    }

    /// The packed blocks of row group `g`, in `K` order.
    pub(crate) fn group(&self, g: usize) -> &[u8] {
        let len = self.format().group_bytes(self.cols);
        &self.bytes()[g * len..(g + 1) * len]
    }

    /// Pack unpacked blocks (quants must be `<= kind.max_q()`), with f16 scales and mins when
    /// all of them are exact f16s, and without the mins when every one is `-offset * scale`.
    pub(crate) fn pack(rows: usize, cols: usize, kind: QKind, b: &Blocks) -> Self {
        Self::pack_as(rows, cols, kind, b, true)
    }

    /// [`pack`](Self::pack), storing the mins even when they are implied unless `implied`.
    pub(crate) fn pack_as(
        rows: usize,
        cols: usize,
        kind: QKind,
        b: &Blocks,
        implied: bool,
    ) -> Self {
        // Bit for bit, so the kernels' recomputed min is the stored one (-0.0 included). MXFP4
        // has no stored mins (its callers only build blocks on its grid).
        let mx = kind == QKind::Mx4;
        let sym = mx
            || implied
                && b.scale
                    .iter()
                    .zip(&b.min)
                    .all(|(&s, &m)| (s * kind.neg_offset()).to_bits() == m.to_bits());
        let halves: Option<Vec<(u16, u16)>> = if mx {
            None
        } else {
            b.scale
                .iter()
                .zip(&b.min)
                .map(|(&s, &m)| Some((exact_f16(s)?, if sym { 0 } else { exact_f16(m)? })))
                .collect()
        };
        let fmt = Format {
            kind,
            half: halves.is_some(),
            sym,
        };
        let nb = cols / BLOCK;
        let (bb, qb, sb) = (fmt.block_bytes(), fmt.quant_bytes(), fmt.scales_bytes());
        let groups = rows.div_ceil(ROWS);
        let mut data = vec![Line([0; 64]); (groups * nb * bb).div_ceil(64)];
        // SAFETY: as in `bytes`, now mutable and exclusive.
        let out: &mut [u8] =
            unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), data.len() * 64) };
        for g in 0..groups {
            for blk in 0..nb {
                let dst = &mut out[(g * nb + blk) * bb..][..bb];
                for r in 0..ROWS.min(rows - g * ROWS) {
                    let row = g * ROWS + r;
                    let q = &b.q[row * cols + blk * BLOCK..][..BLOCK];
                    for (c, &v) in q.iter().enumerate() {
                        debug_assert!(v <= kind.max_q());
                        match kind {
                            QKind::Q8 => dst[(c / 4) * 64 + r * 4 + c % 4] = v,
                            QKind::Q4 | QKind::Mx4 => {
                                let v = if mx {
                                    mx4::code_of(v).expect("MXFP4 quants lie on its grid")
                                } else {
                                    v
                                };
                                let (j, hi) = ((c / 4) % 4, c >= 16);
                                dst[j * 64 + r * 4 + c % 4] |= if hi { v << 4 } else { v };
                            }
                            QKind::Q6K => {
                                unreachable!("Q6K is packed from its own blocks (q6k.rs)")
                            }
                        }
                    }
                    let i = row * nb + blk;
                    if mx {
                        let e = mx4::e8m0_of(b.scale[i]).expect("MXFP4 scales are E8M0 powers");
                        debug_assert_eq!(b.min[i].to_bits(), (b.scale[i] * -mx4::OFFSET).to_bits());
                        dst[qb + r] = e;
                        continue;
                    }
                    match &halves {
                        Some(h) => {
                            dst[qb + r * 2..][..2].copy_from_slice(&h[i].0.to_le_bytes());
                            if !sym {
                                let m = &mut dst[qb + sb + r * 2..][..2];
                                m.copy_from_slice(&h[i].1.to_le_bytes());
                            }
                        }
                        None => {
                            dst[qb + r * 4..][..4].copy_from_slice(&b.scale[i].to_le_bytes());
                            if !sym {
                                let m = &mut dst[qb + sb + r * 4..][..4];
                                m.copy_from_slice(&b.min[i].to_le_bytes());
                            }
                        }
                    }
                }
            }
        }
        QMatrix {
            rows,
            cols,
            kind,
            half: fmt.half,
            sym,
            data,
        }
    }

    /// Block `b` of `row`: `(scale, min, quants)`; a Q6K block re-rounded into Q8 (see `ggml.rs`).
    pub fn block(&self, row: usize, b: usize) -> (f32, f32, [u8; BLOCK]) {
        if self.kind == QKind::Q6K {
            return self.q6k_block_q8(row, b);
        }
        let fmt = self.format();
        let bb = fmt.block_bytes();
        let blk = &self.group(row / ROWS)[b * bb..][..bb];
        let r = row % ROWS;
        let (s, m) = fmt.scale_min_at(blk, r);
        (s, m, dequant::unpack(self.kind, blk, r))
    }

    /// The f32 weights `[rows, cols]`: `scale * q + min` per element.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        self.dequantize_into(DequantOut::F32(&mut out), 1)
            .expect("out has rows * cols elements");
        out
    }

    /// The unpacked blocks of every row.
    fn unpack_all(&self) -> Blocks {
        let (nb, mut b) = (self.blocks_per_row(), Blocks::new(self.rows, self.cols));
        for row in 0..self.rows {
            for blk in 0..nb {
                let (s, m, q) = self.block(row, blk);
                b.q[(row * nb + blk) * BLOCK..][..BLOCK].copy_from_slice(&q);
                b.scale[row * nb + blk] = s;
                b.min[row * nb + blk] = m;
            }
        }
        b
    }

    /// The rows of `parts` stacked into one matrix (e.g. q, k and v into one qkv projection, so
    /// one call quantizes the activations once and streams all three). Q4 and MXFP4 parts join
    /// a Q8 result losslessly (same scales and mins, quants widened) when the kinds differ,
    /// except that Q4 parts stay Q4 and MXFP4 parts MXFP4 among themselves; Q6K parts stay Q6K
    /// among themselves and are re-rounded into Q8 beside other kinds.
    pub fn concat(parts: &[&QMatrix]) -> CoreResult<QMatrix> {
        let Some(first) = parts.first() else {
            return Err(CoreError::invalid("parts", "needs at least one matrix"));
        };
        let cols = first.cols;
        if let Some(p) = parts.iter().find(|p| p.cols != cols) {
            let r = format!("all parts need the same cols, got {} and {}", cols, p.cols);
            return Err(CoreError::invalid("parts", r));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        if parts.iter().all(|p| p.kind == QKind::Q6K) {
            let raw: Vec<u8> = parts.iter().flat_map(|p| p.q6k_raw()).collect();
            return Ok(Self::pack_q6k(&raw, rows, cols));
        }
        // MXFP4 stays itself when alone; beside other kinds its quants (<= 24) widen to Q8.
        let kind = if parts.iter().all(|p| p.kind == QKind::Mx4) {
            QKind::Mx4
        } else if parts.iter().any(|p| p.kind != QKind::Q4) {
            QKind::Q8
        } else {
            QKind::Q4
        };
        let mut all = Blocks {
            q: Vec::new(),
            scale: Vec::new(),
            min: Vec::new(),
        };
        for p in parts {
            let b = p.unpack_all();
            all.q.extend(b.q);
            all.scale.extend(b.scale);
            all.min.extend(b.min);
        }
        Ok(Self::pack(rows, cols, kind, &all))
    }

    /// Rows `ids` dequantized into `out[ids.len(), cols]`: the embedding lookup of a quantized
    /// (e.g. tied LM head) table.
    pub fn gather_rows(&self, ids: &[i64], out: &mut [f32]) -> CoreResult<()> {
        if out.len() != ids.len() * self.cols {
            let r = format!(
                "has {} elements, expected len(ids) * cols = {} * {}",
                out.len(),
                ids.len(),
                self.cols
            );
            return Err(CoreError::invalid("out", r));
        }
        if let Some(bad) = ids.iter().find(|&&i| i < 0 || i as usize >= self.rows) {
            return Err(CoreError::invalid(
                "ids",
                format!("row {bad} out of range (rows = {})", self.rows),
            ));
        }
        for (&row, dst) in ids.iter().zip(out.chunks_exact_mut(self.cols)) {
            if self.kind == QKind::Q6K {
                self.q6k_row_into(row as usize, dst);
                continue;
            }
            for (b, d) in dst.chunks_exact_mut(BLOCK).enumerate() {
                let (s, m, q) = self.block(row as usize, b);
                for (o, &q) in d.iter_mut().zip(&q) {
                    *o = s * q as f32 + m;
                }
            }
        }
        Ok(())
    }

    /// Quantize an f32 matrix `[rows, cols]` with round-to-nearest, `group` weights of a row per
    /// scale (a multiple of 32 dividing `cols`; 0 = one group per row, i.e. per channel).
    /// `bits = 8`: symmetric, `q - 128 = round(w / s)` in -127..=127 with `s = amax / 127`.
    /// `bits = 4`: asymmetric, `q = round((w - lo) / s)` in 0..=15 with `s = (hi - lo) / 15`.
    pub fn quantize(
        w: &[f32],
        rows: usize,
        cols: usize,
        bits: u32,
        group: usize,
    ) -> CoreResult<Self> {
        check_shape(rows, cols)?;
        if w.len() != rows * cols {
            let r = format!(
                "has {} elements, expected rows * cols = {}",
                w.len(),
                rows * cols
            );
            return Err(CoreError::invalid("weight", r));
        }
        if let Some(bad) = w.iter().find(|v| !v.is_finite()) {
            return Err(CoreError::invalid("weight", format!("holds {bad}")));
        }
        let group = if group == 0 { cols } else { group };
        if !group.is_multiple_of(BLOCK) || !cols.is_multiple_of(group) {
            let r =
                format!("must be 0 or a multiple of {BLOCK} dividing cols = {cols}, got {group}");
            return Err(CoreError::invalid("group_size", r));
        }
        let kind = match bits {
            8 => QKind::Q8,
            4 => QKind::Q4,
            _ => {
                return Err(CoreError::invalid(
                    "bits",
                    format!("must be 4 or 8, got {bits}"),
                ))
            }
        };
        let mut b = Blocks::new(rows, cols);
        for (gi, chunk) in w.chunks_exact(group).enumerate() {
            let q = &mut b.q[gi * group..][..group];
            let (scale, min) = match kind {
                QKind::Q8 => {
                    let amax = chunk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let s = amax / 127.0;
                    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                    for (d, &v) in q.iter_mut().zip(chunk) {
                        *d = ((v * inv).round().clamp(-127.0, 127.0) as i32 + 128) as u8;
                    }
                    (s, -128.0 * s)
                }
                QKind::Q4 => {
                    let lo = chunk.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                    let hi = chunk.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                    let s = (hi - lo) / 15.0;
                    let inv = if hi > lo { 15.0 / (hi - lo) } else { 0.0 };
                    for (d, &v) in q.iter_mut().zip(chunk) {
                        *d = ((v - lo) * inv).round().clamp(0.0, 15.0) as u8;
                    }
                    (s, lo)
                }
                QKind::Q6K | QKind::Mx4 => unreachable!("bits is 4 or 8"),
            };
            let blocks = group / BLOCK;
            b.scale[gi * blocks..][..blocks].fill(scale);
            b.min[gi * blocks..][..blocks].fill(min);
        }
        Ok(Self::pack(rows, cols, kind, &b))
    }
}
