//! GGUF (ggml) block formats → [`QMatrix`]. Byte layouts as in llama.cpp's `ggml-common.h`;
//! values as its `dequantize_row_*` compute them, f16 scales widened to f32.
//!
//! | type | block | per 32 weights | maps to |
//! |---|---|---|---|
//! | Q4_0 (2) | 18 B: f16 d, 16 B nibbles | `d (q - 8)` | Q4, scale d, min -8d (exact) |
//! | Q4_1 (3) | 20 B: f16 d, f16 m, 16 B nibbles | `d q + m` | Q4 (exact) |
//! | Q8_0 (8) | 34 B: f16 d, 32 i8 | `d q` | Q8, q + 128, min -128d (exact) |
//! | Q4_K (12) | 144 B / 256: f16 d, f16 dmin, 12 B 6-bit scales+mins, 128 B nibbles | `d sc q - dmin m` | Q4 (exact) |
//! | Q5_K (13) | 176 B / 256: as Q4_K plus 32 B high bits | same, q in 0..32 | Q8 (exact) |
//! | Q6_K (14) | 210 B / 256: 128 B low nibbles, 64 B high 2 bits, 16 i8 scales, f16 d | `d sc16 (q - 32)` | Q6K (exact, `q6k.rs`) |
//!
//! Q6_K has one scale per 16 weights, so a 32-block has two. Stacked with matrices of other kinds
//! (`QMatrix::concat`, e.g. a Q6_K v beside Q4_K q and k) it becomes Q8: when both halves fit one grid of
//! 256 steps (`scale = d g`, `g` the gcd of the two sub-scales: equal sub-scales, one twice the
//! other, ...) the block is kept as is (up to the f32 rounding of `scale * q + min`); otherwise it
//! is re-rounded onto `s = (hi - lo) / 255` over the block's own range. The range spans at most
//! 64 steps of the coarser sub-scale, so the added error is at most `64 / 510` (one eighth) of that
//! Q6_K step; the tests assert this bound.

use super::{check_shape, Blocks, QKind, QMatrix, BLOCK};
use crate::error::{CoreError, CoreResult};

pub const Q4_0: u32 = 2;
pub const Q4_1: u32 = 3;
pub const Q8_0: u32 = 8;
pub const Q4_K: u32 = 12;
pub const Q5_K: u32 = 13;
pub const Q6_K: u32 = 14;

/// `(weights per block, bytes per block)` of a supported ggml type.
pub fn block_size(ggml_type: u32) -> Option<(usize, usize)> {
    Some(match ggml_type {
        Q4_0 => (32, 18),
        Q4_1 => (32, 20),
        Q8_0 => (32, 34),
        Q4_K => (256, 144),
        Q5_K => (256, 176),
        Q6_K => (256, 210),
        _ => return None,
    })
}

/// IEEE half → f32 (exact), subnormals included.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1F) as u32;
    let man = (h & 0x3FF) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: man * 2^-24, exact in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        (31, _) => sign | 0x7F80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

fn f16_at(b: &[u8], o: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[o], b[o + 1]]))
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

impl QMatrix {
    /// A matrix `[rows, cols]` from the raw bytes of a GGUF tensor of `ggml_type` (row-major,
    /// `cols` being ggml's first dimension).
    pub fn from_ggml(raw: &[u8], ggml_type: u32, rows: usize, cols: usize) -> CoreResult<Self> {
        check_shape(rows, cols)?;
        let Some((per, bytes)) = block_size(ggml_type) else {
            let r = format!("unsupported type {ggml_type} (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
            return Err(CoreError::invalid("ggml_type", r));
        };
        if !cols.is_multiple_of(per) {
            let r = format!("must be a multiple of {per} for ggml type {ggml_type}, got {cols}");
            return Err(CoreError::invalid("cols", r));
        }
        let want = rows * cols / per * bytes;
        if raw.len() != want {
            let r = format!(
                "has {} bytes, expected {want} for [{rows}, {cols}] of type {ggml_type}",
                raw.len()
            );
            return Err(CoreError::invalid("raw", r));
        }
        let kind = match ggml_type {
            Q4_0 | Q4_1 | Q4_K => QKind::Q4,
            Q6_K => return Ok(Self::pack_q6k(raw, rows, cols)),
            _ => QKind::Q8,
        };
        let mut b = Blocks::new(rows, cols);
        for (i, src) in raw.chunks_exact(bytes).enumerate() {
            // Super-block i covers weights i*per.., i.e. 32-blocks i*per/32...
            let first = i * per / BLOCK;
            match ggml_type {
                Q4_0 | Q4_1 => {
                    let d = f16_at(src, 0);
                    let (min, qs) = if ggml_type == Q4_0 {
                        (-8.0 * d, &src[2..18])
                    } else {
                        (f16_at(src, 2), &src[4..20])
                    };
                    let q = &mut b.q[first * BLOCK..][..BLOCK];
                    for (l, &byte) in qs.iter().enumerate() {
                        q[l] = byte & 0x0F;
                        q[l + 16] = byte >> 4;
                    }
                    b.scale[first] = d;
                    b.min[first] = min;
                }
                Q8_0 => {
                    let d = f16_at(src, 0);
                    let q = &mut b.q[first * BLOCK..][..BLOCK];
                    for (dst, &v) in q.iter_mut().zip(&src[2..34]) {
                        *dst = (v as i8 as i32 + 128) as u8;
                    }
                    b.scale[first] = d;
                    b.min[first] = -128.0 * d;
                }
                Q4_K | Q5_K => {
                    let (d, dmin) = (f16_at(src, 0), f16_at(src, 2));
                    let scales = &src[4..16];
                    let (qh, qs) = if ggml_type == Q4_K {
                        (None, &src[16..144])
                    } else {
                        (Some(&src[16..48]), &src[48..176])
                    };
                    for sub in 0..8 {
                        let (sc, m) = scale_min_k4(sub, scales);
                        let (pair, high) = (sub / 2, sub % 2 == 1);
                        let q = &mut b.q[(first + sub) * BLOCK..][..BLOCK];
                        for (l, dst) in q.iter_mut().enumerate() {
                            let byte = qs[pair * 32 + l];
                            let mut v = if high { byte >> 4 } else { byte & 0x0F };
                            if let Some(qh) = qh {
                                v |= ((qh[l] >> sub) & 1) << 4;
                            }
                            *dst = v;
                        }
                        b.scale[first + sub] = d * sc as f32;
                        b.min[first + sub] = -(dmin * m as f32);
                    }
                }
                _ => unreachable!("checked by block_size"),
            }
        }
        Ok(Self::pack(rows, cols, kind, &b))
    }
}

fn gcd(a: i32, b: i32) -> i32 {
    let (mut a, mut b) = (a.abs(), b.abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// One Q6_K 32-block (`w[l] = d · s[l / 16] · q6[l]`) as Q8 quants `q` (returns scale, min):
/// exact when the two halves fit one 256-step grid, re-rounded otherwise.
pub(super) fn q6_block(d: f32, s: [i32; 2], q6: &[i32; BLOCK], q: &mut [u8]) -> (f32, f32) {
    let g = gcd(s[0], s[1]);
    if g == 0 {
        q.fill(0);
        return (0.0, 0.0);
    }
    let units: Vec<i32> = (0..BLOCK).map(|l| s[l / 16] / g * q6[l]).collect();
    let (lo, hi) = (*units.iter().min().unwrap(), *units.iter().max().unwrap());
    if hi - lo <= 255 {
        for (dst, u) in q.iter_mut().zip(&units) {
            *dst = (u - lo) as u8;
        }
        let step = d * g as f32;
        return (step, step * lo as f32);
    }
    // The f32 values llama.cpp computes, then an ordinary asymmetric 8-bit grid over them.
    let w: Vec<f32> = (0..BLOCK)
        .map(|l| d * s[l / 16] as f32 * q6[l] as f32)
        .collect();
    let lo = w.iter().fold(f32::INFINITY, |a, &v| a.min(v));
    let hi = w.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let step = (hi - lo) / 255.0;
    for (dst, &v) in q.iter_mut().zip(&w) {
        *dst = ((v - lo) / step).round().clamp(0.0, 255.0) as u8;
    }
    (step, lo)
}
