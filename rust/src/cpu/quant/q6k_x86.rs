//! The x86 tiles of [`QKind::Q6K`](super::QKind::Q6K) blocks (layout and arithmetic in `q6k.rs`).
//! AVX2: up to two activation rows at a time, each 256-bit vector holding 8 rows of the group (the
//! low or high 32 bytes of a 64-byte chunk), as in the other kinds' 256-bit tiles. AVX-512 VNNI:
//! a vector holds the whole group, up to four activation rows at a time (at M = 1 the AVX2 body
//! read 16 GB/s on a 2-core Zen 4 against 33-36 for Q4_0 / Q8_0 blocks: it was compute-bound).

use std::arch::x86_64::*;

use super::act::QActs;
use super::q6k::{BLOCK_BYTES, D_AT, QUANT_BYTES, SUPER_BYTES};
use super::{Format, Isa, Tile, BLOCK, ROWS};

/// The four activation bytes `x[c .. c + 4]` in every i32 lane.
#[inline(always)]
unsafe fn x4(x: *const i8, c: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(x.add(c) as *const i32))
}

/// What both tiles' bodies rely on (their `SAFETY`): `blocks` holds `nb / 8` packed super-blocks,
/// activation rows up to `end` exist with their half sums, `out` has `rows` rows, the CPU runs `isa`.
fn check(blocks: &[u8], nb: usize, a: &QActs, end: usize, rows: usize, out: &Tile, isa: Isa) {
    assert!(blocks.len() >= nb / 8 * SUPER_BYTES && nb.is_multiple_of(8));
    assert!(end * a.k <= a.q.len() && end * nb <= a.halves.len());
    assert!(rows <= out.len() && isa.available());
}

pub(crate) fn tile_avx2(
    _fmt: Format,
    blocks: &[u8],
    nb: usize,
    a: &QActs,
    row0: usize,
    rows: usize,
    out: &mut Tile,
) {
    check(blocks, nb, a, row0 + rows, rows, out, Isa::Avx2);
    let p = blocks.as_ptr();
    // Pairs of rows: each row's arithmetic is the same in a pair or alone.
    for r in (0..rows).step_by(2) {
        let o = &mut out[r..];
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted), `blocks` holds `nb / 8` packed
        // super-blocks and rows row0 .. row0 + rows of `a` exist (asserted).
        unsafe {
            if rows - r >= 2 {
                body::<2>(p, nb, a, row0 + r, o)
            } else {
                body::<1>(p, nb, a, row0 + r, o)
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn body<const MR: usize>(
    blocks: *const u8,
    nb: usize,
    a: &QActs,
    row0: usize,
    out: &mut [[f32; ROWS]],
) {
    let x: [*const i8; MR] = std::array::from_fn(|r| a.q.as_ptr().add((row0 + r) * a.k));
    let base: [usize; MR] = std::array::from_fn(|r| (row0 + r) * nb);
    let (nibble, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    // [row][half]: rows 0..8 of the group, then 8..16.
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    let ahead = super::prefetch::lead::<MR>();
    for s in 0..nb / 8 {
        let sb = blocks.add(s * SUPER_BYTES);
        let d = [
            _mm256_cvtph_ps(_mm_loadu_si128(sb.add(D_AT) as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(sb.add(D_AT + 16) as *const __m128i)),
        ];
        for b8 in 0..8 {
            let blk = sb.add(b8 * BLOCK_BYTES);
            // The super-block's 32 bytes of scales after its blocks come with the next one's.
            super::prefetch::ahead(blk, ahead, BLOCK_BYTES);
            let b = s * 8 + b8;
            let c0 = b * BLOCK;
            for h in 0..2 {
                let lo8 = _mm_loadl_epi64(blk.add(QUANT_BYTES + 8 * h) as *const __m128i);
                let hi8 = _mm_loadl_epi64(blk.add(QUANT_BYTES + ROWS + 8 * h) as *const __m128i);
                // Each row's sub-scale in both i16 halves of its lane: vpmaddwd's multiplier.
                let sc_lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo8, lo8));
                let sc_hi = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(hi8, hi8));
                // (32 sc_lo, 32 sc_hi) per lane, against the activations' half sums: the -32.
                let sc32 =
                    _mm256_slli_epi16::<5>(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo8, hi8)));
                let mut isum = [_mm256_setzero_si256(); MR];
                for u in 0..2 {
                    let hb = _mm256_loadu_si256(blk.add(256 + 64 * u + 32 * h) as *const __m256i);
                    // Chunks 2u and 2u + 1 summed in i16 (|Σ| <= 2 · 2 · 63 · 127 = 32004, the
                    // activations never -128), then one `vpmaddwd` with the sub-scales for both:
                    // half the multiplies on the port `vpmaddubsw` also needs, the same exact
                    // integers (1.04-1.05x from 19 rows on a 2-core Zen 1; one row unchanged).
                    let mut pairs = [[_mm256_setzero_si256(); 2]; MR];
                    for jj in 0..2 {
                        let j = 2 * u + jj;
                        let v = _mm256_loadu_si256(blk.add(64 * j + 32 * h) as *const __m256i);
                        // Bit pairs 2t.. with t = 2 jj (+ 1 for the high nibbles), moved to bits 4..6.
                        let (hl, hh) = if jj == 0 {
                            (_mm256_slli_epi16::<4>(hb), _mm256_slli_epi16::<2>(hb))
                        } else {
                            (hb, _mm256_srli_epi16::<2>(hb))
                        };
                        let ql = _mm256_or_si256(
                            _mm256_and_si256(v, nibble),
                            _mm256_and_si256(hl, high),
                        );
                        let qh = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble),
                            _mm256_and_si256(hh, high),
                        );
                        for r in 0..MR {
                            let pl = _mm256_maddubs_epi16(ql, x4(x[r], c0 + 4 * j));
                            let ph = _mm256_maddubs_epi16(qh, x4(x[r], c0 + 16 + 4 * j));
                            pairs[r][0] = _mm256_add_epi16(pairs[r][0], pl);
                            pairs[r][1] = _mm256_add_epi16(pairs[r][1], ph);
                        }
                    }
                    for r in 0..MR {
                        let both = _mm256_add_epi32(
                            _mm256_madd_epi16(pairs[r][0], sc_lo),
                            _mm256_madd_epi16(pairs[r][1], sc_hi),
                        );
                        isum[r] = _mm256_add_epi32(isum[r], both);
                    }
                }
                for r in 0..MR {
                    let ia = base[r] + b;
                    let corr = _mm256_madd_epi16(sc32, _mm256_set1_epi32(a.halves[ia]));
                    let f = _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], corr));
                    let ds = _mm256_mul_ps(d[h], _mm256_set1_ps(a.scale[ia]));
                    acc[r][h] = _mm256_fmadd_ps(f, ds, acc[r][h]);
                }
            }
        }
    }
    for r in 0..MR {
        _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r][0]);
        _mm256_storeu_ps(out[r].as_mut_ptr().add(8), acc[r][1]);
    }
}

/// The AVX-512 VNNI tile: one 512-bit vector holds all 16 rows of the group (a whole 64-byte
/// chunk), `vpdpbusd` sums each half block's `q · xq` unscaled (`|Σ| <= 16 · 63 · 128`), and the
/// sub-scales multiply the two i32 sums once a block (`vpmulld`), the `-32` subtracted before:
/// `isum = sc_lo (Σ_lo q xq - 32 Σ_lo xq) + sc_hi (..)`, the same exact integer as the AVX2
/// body's, so the same f32 results bit for bit. Up to four activation rows at a time.
pub(crate) fn tile_avx512(
    _fmt: Format,
    blocks: &[u8],
    nb: usize,
    a: &QActs,
    row0: usize,
    rows: usize,
    out: &mut Tile,
) {
    check(blocks, nb, a, row0 + rows, rows, out, Isa::Avx512Vnni);
    let p = blocks.as_ptr();
    for r in (0..rows).step_by(4) {
        let o = &mut out[r..];
        // SAFETY: the CPU has AVX-512 F/BW/VNNI (asserted), `blocks` holds `nb / 8` packed
        // super-blocks and rows row0 .. row0 + rows of `a` exist (asserted).
        unsafe {
            match rows - r {
                1 => body512::<1>(p, nb, a, row0 + r, o),
                2 => body512::<2>(p, nb, a, row0 + r, o),
                3 => body512::<3>(p, nb, a, row0 + r, o),
                _ => body512::<4>(p, nb, a, row0 + r, o),
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
unsafe fn body512<const MR: usize>(
    blocks: *const u8,
    nb: usize,
    a: &QActs,
    row0: usize,
    out: &mut [[f32; ROWS]],
) {
    let x: [*const i8; MR] = std::array::from_fn(|r| a.q.as_ptr().add((row0 + r) * a.k));
    let base: [usize; MR] = std::array::from_fn(|r| (row0 + r) * nb);
    let (nibble, high) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    let x4 =
        |r: usize, c: usize| _mm512_set1_epi32(std::ptr::read_unaligned(x[r].add(c) as *const i32));
    let mut acc = [_mm512_setzero_ps(); MR];
    let ahead = super::prefetch::lead::<MR>();
    for s in 0..nb / 8 {
        let sb = blocks.add(s * SUPER_BYTES);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(sb.add(D_AT) as *const __m256i));
        for b8 in 0..8 {
            let blk = sb.add(b8 * BLOCK_BYTES);
            // The super-block's 32 bytes of scales after its blocks come with the next one's.
            super::prefetch::ahead(blk, ahead, BLOCK_BYTES);
            let b = s * 8 + b8;
            let c0 = b * BLOCK;
            let mut lo = [_mm512_setzero_si512(); MR];
            let mut hi = [_mm512_setzero_si512(); MR];
            for u in 0..2 {
                let hb = _mm512_loadu_si512(blk.add(256 + 64 * u) as *const __m512i);
                for jj in 0..2 {
                    let j = 2 * u + jj;
                    let v = _mm512_loadu_si512(blk.add(64 * j) as *const __m512i);
                    let (hl, hh) = if jj == 0 {
                        (_mm512_slli_epi16::<4>(hb), _mm512_slli_epi16::<2>(hb))
                    } else {
                        (hb, _mm512_srli_epi16::<2>(hb))
                    };
                    let ql =
                        _mm512_or_si512(_mm512_and_si512(v, nibble), _mm512_and_si512(hl, high));
                    let qh = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble),
                        _mm512_and_si512(hh, high),
                    );
                    for r in 0..MR {
                        lo[r] = _mm512_dpbusd_epi32(lo[r], ql, x4(r, c0 + 4 * j));
                        hi[r] = _mm512_dpbusd_epi32(hi[r], qh, x4(r, c0 + 16 + 4 * j));
                    }
                }
            }
            let sc_lo =
                _mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(QUANT_BYTES) as *const __m128i));
            let sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                blk.add(QUANT_BYTES + ROWS) as *const __m128i
            ));
            for r in 0..MR {
                let ia = base[r] + b;
                let h = *a.halves.get_unchecked(ia);
                let (h_lo, h_hi) = ((h << 16) >> 16, h >> 16);
                let t_lo = _mm512_sub_epi32(lo[r], _mm512_set1_epi32(32 * h_lo));
                let t_hi = _mm512_sub_epi32(hi[r], _mm512_set1_epi32(32 * h_hi));
                let isum = _mm512_add_epi32(
                    _mm512_mullo_epi32(t_lo, sc_lo),
                    _mm512_mullo_epi32(t_hi, sc_hi),
                );
                let ds = _mm512_mul_ps(d, _mm512_set1_ps(*a.scale.get_unchecked(ia)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), ds, acc[r]);
            }
        }
    }
    for r in 0..MR {
        _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
}
