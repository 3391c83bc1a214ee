//! [`QKind::Q6K`]: GGUF Q6_K blocks kept at their own 6.5625 bits a weight, repacked for the
//! 16-row groups of the other kinds, and their matmul.
//!
//! A Q6_K super-block is 256 weights of a row, `w = d · sc[c / 16] · (q - 32)`: `q` 6-bit, `sc`
//! one i8 per 16 weights, `d` one f16. Re-rounded into Q8 32-blocks (two sub-scales do not fit
//! one `(scale, min)`) with f32 scales it took 10 bits a weight, which for an LM head is most of
//! what a decode token streams; here it keeps its own bits.
//!
//! # Layout
//! A group (16 rows) stores its super-blocks in `K` order, each 3360 B: eight 416 B 32-blocks,
//! then the 16 rows' `d` (f16). A 32-block:
//!
//! ```text
//! 4 x 64 B  low nibbles as in Q4: chunk j, row r, byte i = q[4j+i] & 15 | (q[16+4j+i] & 15) << 4
//! 2 x 64 B  high 2 bits: chunk u, row r, byte i, bits 2t.. = q[16 h + 4 (2u + jj) + i] >> 4
//!           for t = 2 jj + h (so nibble chunk j's high bits sit in chunk j / 2)
//! 32 B      sub-scales: 16 rows' sc of columns 0..16, then 16 rows' sc of columns 16..32
//! ```
//!
//! # Arithmetic
//! `q` (0..63) times int8 activations by `vpmaddubsw` cannot saturate (2 · 63 · 127 < 2^15), and
//! the sub-scale multiplies the i16 pairs in the `vpmaddwd` that sums them (the ones vector of
//! the other kinds), so a block's integer dot product `Σ sc (q - 32) xq` is exact in i32; the
//! `-32` is `32 (sc_lo Σ_lo xq + sc_hi Σ_hi xq)`, one more `vpmaddwd` against the activations'
//! half sums ([`QActs::halves`]). Its magnitude is below `32 · 128 · 32 · 127 < 2^24`, so the
//! conversion to f32 is exact too, and a block adds `isum · (d · xs)` to the row's f32
//! accumulator: the result is `W @ xq` up to that rounding, as for the other kinds. Each output
//! row's arithmetic is the same whatever rows share its tile or thread.

use super::act::QActs;
use super::ggml::{self, f16_to_f32};
use super::{Line, QKind, QMatrix, Tile, BLOCK, ROWS};

/// Weights of a Q6_K super-block.
pub(crate) const SUPER: usize = 256;
/// Bytes of a Q6_K super-block in a GGUF file.
pub(crate) const RAW_BYTES: usize = 210;
/// Quant bytes of a packed 32-block (16 rows): 4 nibble chunks and 2 high-bit chunks.
pub(crate) const QUANT_BYTES: usize = 384;
/// Bytes of a packed 32-block: quants and 32 sub-scales.
pub(crate) const BLOCK_BYTES: usize = QUANT_BYTES + 2 * ROWS;
/// Where a packed super-block's `d`s start.
pub(crate) const D_AT: usize = 8 * BLOCK_BYTES;
/// Bytes of a packed super-block (16 rows × 256 columns: 6.5625 bits a weight).
pub(crate) const SUPER_BYTES: usize = D_AT + 2 * ROWS;

/// One row's super-block unpacked: `q` (0..63) of its 256 weights, the 16 sub-scales, `d` (f16).
pub(crate) struct Super {
    pub q: [u8; SUPER],
    pub sc: [i8; 16],
    pub d: u16,
}

/// A GGUF Q6_K super-block (llama.cpp's `block_q6_K`: 128 B low nibbles, 64 B high 2 bits, 16 i8
/// scales, f16 d) unpacked.
pub(crate) fn decode(src: &[u8]) -> Super {
    let (ql, qh) = (&src[0..128], &src[128..192]);
    let mut q = [0u8; SUPER];
    for (i, v) in q.iter_mut().enumerate() {
        // Weight 128h + 32p + l: ql[64h + 32(p%2) + l] (low nibble for p < 2) and bits 2p.. of
        // qh[32h + l].
        let (h, p, l) = (i / 128, i % 128 / 32, i % 32);
        let byte = ql[64 * h + 32 * (p % 2) + l];
        let lo = if p < 2 { byte & 0x0F } else { byte >> 4 };
        *v = lo | (((qh[32 * h + l] >> (2 * p)) & 3) << 4);
    }
    Super {
        q,
        sc: std::array::from_fn(|j| src[192 + j] as i8),
        d: u16::from_le_bytes([src[208], src[209]]),
    }
}

/// [`decode`]'s inverse.
pub(crate) fn encode(s: &Super, dst: &mut [u8]) {
    dst[..192].fill(0);
    for (i, &v) in s.q.iter().enumerate() {
        let (h, p, l) = (i / 128, i % 128 / 32, i % 32);
        let at = 64 * h + 32 * (p % 2) + l;
        dst[at] |= if p < 2 { v & 0x0F } else { (v & 0x0F) << 4 };
        dst[128 + 32 * h + l] |= (v >> 4) << (2 * p);
    }
    for (d, &v) in dst[192..208].iter_mut().zip(&s.sc) {
        *d = v as u8;
    }
    dst[208..210].copy_from_slice(&s.d.to_le_bytes());
}

/// Row `r` of a packed super-block unpacked.
pub(crate) fn unpack(sb: &[u8], r: usize) -> Super {
    let mut s = Super {
        q: [0; SUPER],
        sc: [0; 16],
        d: u16::from_le_bytes([sb[D_AT + 2 * r], sb[D_AT + 2 * r + 1]]),
    };
    for b in 0..8 {
        let blk = &sb[b * BLOCK_BYTES..][..BLOCK_BYTES];
        let q = &mut s.q[b * BLOCK..][..BLOCK];
        for j in 0..4 {
            for i in 0..4 {
                let (nib, hb) = (blk[64 * j + 4 * r + i], blk[256 + 64 * (j / 2) + 4 * r + i]);
                for h in 0..2 {
                    let t = 2 * (j % 2) + h;
                    let lo = if h == 0 { nib & 0x0F } else { nib >> 4 };
                    q[16 * h + 4 * j + i] = lo | (((hb >> (2 * t)) & 3) << 4);
                }
            }
        }
        s.sc[2 * b] = blk[QUANT_BYTES + r] as i8;
        s.sc[2 * b + 1] = blk[QUANT_BYTES + ROWS + r] as i8;
    }
    s
}

/// Row `r` of `s` into a packed super-block.
fn pack_row(s: &Super, dst: &mut [u8], r: usize) {
    for b in 0..8 {
        let blk = &mut dst[b * BLOCK_BYTES..][..BLOCK_BYTES];
        let q = &s.q[b * BLOCK..][..BLOCK];
        for j in 0..4 {
            for i in 0..4 {
                let (lo, hi) = (q[4 * j + i], q[16 + 4 * j + i]);
                blk[64 * j + 4 * r + i] = (lo & 0x0F) | ((hi & 0x0F) << 4);
                let t = 2 * (j % 2);
                blk[256 + 64 * (j / 2) + 4 * r + i] |=
                    ((lo >> 4) << (2 * t)) | ((hi >> 4) << (2 * t + 2));
            }
        }
        blk[QUANT_BYTES + r] = s.sc[2 * b] as u8;
        blk[QUANT_BYTES + ROWS + r] = s.sc[2 * b + 1] as u8;
    }
    dst[D_AT + 2 * r..][..2].copy_from_slice(&s.d.to_le_bytes());
}

/// The weights of `s`, as llama.cpp's `dequantize_row_q6_K` computes them: `(d · sc) · (q - 32)`.
#[inline(always)]
fn weights(s: &Super, out: &mut [f32]) {
    let d = f16_to_f32(s.d);
    for (c, o) in out.iter_mut().enumerate() {
        *o = d * s.sc[c / 16] as f32 * (s.q[c] as i32 - 32) as f32;
    }
}

impl QMatrix {
    /// A Q6K matrix from the raw bytes of a GGUF Q6_K tensor (shape and size checked by the
    /// caller: `cols` a multiple of 256, `rows * cols / 256` super-blocks).
    pub(crate) fn pack_q6k(raw: &[u8], rows: usize, cols: usize) -> Self {
        let (ns, groups) = (cols / SUPER, rows.div_ceil(ROWS));
        let mut data = vec![Line([0; 64]); (groups * ns * SUPER_BYTES).div_ceil(64)];
        // SAFETY: as in `QMatrix::bytes`, mutable and exclusive.
        let out: &mut [u8] =
            unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), data.len() * 64) };
        for row in 0..rows {
            let (g, r) = (row / ROWS, row % ROWS);
            for s in 0..ns {
                let src = &raw[(row * ns + s) * RAW_BYTES..][..RAW_BYTES];
                pack_row(&decode(src), &mut out[(g * ns + s) * SUPER_BYTES..], r);
            }
        }
        QMatrix {
            rows,
            cols,
            kind: QKind::Q6K,
            half: true,
            sym: true,
            data,
        }
    }

    /// Super-block `s` of `row`, unpacked.
    pub(crate) fn q6k_super(&self, row: usize, s: usize) -> Super {
        let sb = &self.group(row / ROWS)[s * SUPER_BYTES..][..SUPER_BYTES];
        unpack(sb, row % ROWS)
    }

    /// The GGUF Q6_K bytes of the whole matrix (row-major), e.g. to stack Q6K matrices.
    pub(crate) fn q6k_raw(&self) -> Vec<u8> {
        let ns = self.cols / SUPER;
        let mut raw = vec![0u8; self.rows * ns * RAW_BYTES];
        for (i, dst) in raw.chunks_exact_mut(RAW_BYTES).enumerate() {
            encode(&self.q6k_super(i / ns, i % ns), dst);
        }
        raw
    }

    /// 32-block `b` of `row` re-rounded into Q8 `(scale, min, quants)` (exact when both halves
    /// fit one 256-step grid; see `ggml.rs`): what a Q6K part becomes beside other kinds.
    pub(crate) fn q6k_block_q8(&self, row: usize, b: usize) -> (f32, f32, [u8; BLOCK]) {
        let s = self.q6k_super(row, b / 8);
        let c0 = b % 8 * BLOCK;
        let q6: [i32; BLOCK] = std::array::from_fn(|c| s.q[c0 + c] as i32 - 32);
        let sc = [s.sc[c0 / 16] as i32, s.sc[c0 / 16 + 1] as i32];
        let mut q = [0u8; BLOCK];
        let (scale, min) = ggml::q6_block(f16_to_f32(s.d), sc, &q6, &mut q);
        (scale, min, q)
    }

    /// Row `row`'s weights into `out` (`cols` long).
    pub(crate) fn q6k_row_into(&self, row: usize, out: &mut [f32]) {
        for (s, o) in out.chunks_exact_mut(SUPER).enumerate() {
            weights(&self.q6k_super(row, s), o);
        }
    }
}

/// The reference path: per block the exact `Σ sc (q - 32) xq`, then `acc += isum · (d · xs)`.
pub(super) fn tile_scalar(
    _fmt: super::Format,
    blocks: &[u8],
    nb: usize,
    a: &QActs,
    row0: usize,
    rows: usize,
    out: &mut Tile,
) {
    for row in 0..ROWS {
        for s in 0..nb / 8 {
            let sup = unpack(&blocks[s * SUPER_BYTES..][..SUPER_BYTES], row);
            let d = f16_to_f32(sup.d);
            for (r, res) in out[..rows].iter_mut().enumerate() {
                let i = row0 + r;
                if s == 0 {
                    res[row] = 0.0;
                }
                for b8 in 0..8 {
                    let b = s * 8 + b8;
                    let xq = &a.q[i * a.k + b * BLOCK..][..BLOCK];
                    let isum: i32 = (0..BLOCK)
                        .map(|c| {
                            let w = sup.sc[2 * b8 + c / 16] as i32
                                * (sup.q[b8 * BLOCK + c] as i32 - 32);
                            w * xq[c] as i32
                        })
                        .sum();
                    res[row] += isum as f32 * (d * a.scale[i * nb + b]);
                }
            }
        }
    }
}
