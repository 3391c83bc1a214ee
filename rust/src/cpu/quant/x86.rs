//! x86 register tiles: `MR` activation rows × one 16-row group, over all blocks of `K`.
//!
//! Per block and activation row the integer dot products of the 16 rows build up in i32 lanes
//! (see the layout in `quant/mod.rs`), then one conversion and two FMAs fold the block into the
//! f32 accumulators: `acc += isum * (scale * xs) + min * Σx`. Each chunk of weights is loaded
//! once per tile and used by all `MR` rows.
//!
//! 512-bit: one vector covers the group; tiles of up to 8 rows (10% faster than 4 once
//! compute-bound, M >= 8). Below 4 rows each row gets two i32 accumulators (even and odd chunks) so
//! that at M = 1 the `vpdpbusd` latency chain does not bound the weight stream.
//! 256-bit: a vector covers 8 rows (the low or high half of a chunk); 16 ymm registers leave room
//! for MR = 2. AVX2 without VNNI has only `vpmaddubsw` (u8 × i8 pairs into saturating i16): 4-bit
//! weights are safe (2 · 15 · 127 < 2^15), 8-bit ones are offset to `q - 128` and multiplied as
//! `|q - 128| · sign(x, q - 128)` (|products| ≤ 128 · 127, pairs < 2^15), adding `128 Σ xq` back.
//! MXFP4 runs the 4-bit body with one `vpshufb` per nibble vector ([`mx4::LUT`]: 0..=24, pairs
//! ≤ 2 · 24 · 127 < 2^15) and E8M0 scales; it has no 512-bit body (none could be tested here):
//! AVX-512 machines run it on the AVX2 tile.

use std::arch::x86_64::*;

use super::act::QActs;
use super::Isa;
use super::{mx4, Format, QKind, Tile, BLOCK, ROWS};

/// The four activation bytes `x[i][b*32 + c .. + 4]` in every i32 lane.
#[inline(always)]
unsafe fn x4_512(x: *const i8, c: usize) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(x.add(c) as *const i32))
}

#[inline(always)]
unsafe fn x4_256(x: *const i8, c: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(x.add(c) as *const i32))
}

/// 16 f32 (or f16, widened) scales at `p`, unaligned.
#[inline(always)]
unsafe fn load16(p: *const u8, half: bool) -> __m512 {
    if half {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

/// 8 f32 (or f16, widened) scales at `p`, unaligned.
#[inline(always)]
unsafe fn load8(p: *const u8, half: bool) -> __m256 {
    if half {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

pub(crate) fn tile_avx512_vnni(
    fmt: Format,
    blocks: &[u8],
    nb: usize,
    a: &QActs,
    row0: usize,
    rows: usize,
    out: &mut Tile,
) {
    assert!(blocks.len() >= nb * fmt.block_bytes() && (row0 + rows) * a.k <= a.q.len());
    assert!(Isa::Avx512Vnni.available());
    if fmt.kind == QKind::Mx4 {
        // The AVX2 tile's two rows at a time (every AVX-512 CPU has AVX2, FMA and F16C).
        let mut part: Tile = [[0.0; ROWS]; 8];
        for r0 in (0..rows).step_by(2) {
            let n = 2.min(rows - r0);
            tile_avx2(fmt, blocks, nb, a, row0 + r0, n, &mut part);
            out[r0..r0 + n].copy_from_slice(&part[..n]);
        }
        return;
    }
    let (p, sym) = (blocks.as_ptr(), fmt.sym);
    // SAFETY: the CPU has the features (asserted), `blocks` holds `nb` blocks of this format
    // (loaded unaligned: symmetric f16 blocks are not multiples of 64 bytes) and rows row0..
    // of `a` exist (asserted).
    unsafe {
        match (fmt.kind, fmt.half) {
            (QKind::Q8, false) => rows512::<false, false>(p, sym, nb, a, row0, rows, out),
            (QKind::Q8, true) => rows512::<false, true>(p, sym, nb, a, row0, rows, out),
            (QKind::Q4, false) => rows512::<true, false>(p, sym, nb, a, row0, rows, out),
            (QKind::Q4, true) => rows512::<true, true>(p, sym, nb, a, row0, rows, out),
            (QKind::Mx4, _) => unreachable!("run on the AVX2 tile above"),
            (QKind::Q6K, _) => super::q6k_x86::tile_avx512(fmt, blocks, nb, a, row0, rows, out),
        }
    }
}

#[inline(always)]
unsafe fn rows512<const Q4: bool, const HALF: bool>(
    p: *const u8,
    sym: bool,
    nb: usize,
    a: &QActs,
    row0: usize,
    rows: usize,
    out: &mut Tile,
) {
    // `sym` as a constant: a branch on it inside the block loop let LLVM hoist every broadcast of
    // `x` above it and spill them to the stack (the Q8 tile ran at half the Q4 tile's rate).
    if sym {
        rows512_sym::<Q4, HALF, true>(p, nb, a, row0, rows, out)
    } else {
        rows512_sym::<Q4, HALF, false>(p, nb, a, row0, rows, out)
    }
}

#[inline(always)]
unsafe fn rows512_sym<const Q4: bool, const HALF: bool, const SYM: bool>(
    p: *const u8,
    nb: usize,
    a: &QActs,
    row0: usize,
    rows: usize,
    out: &mut Tile,
) {
    match rows {
        1 => avx512::<Q4, HALF, SYM, 1>(p, nb, a, row0, out),
        2 => avx512::<Q4, HALF, SYM, 2>(p, nb, a, row0, out),
        3 => avx512::<Q4, HALF, SYM, 3>(p, nb, a, row0, out),
        4 => avx512::<Q4, HALF, SYM, 4>(p, nb, a, row0, out),
        5 => avx512::<Q4, HALF, SYM, 5>(p, nb, a, row0, out),
        6 => avx512::<Q4, HALF, SYM, 6>(p, nb, a, row0, out),
        7 => avx512::<Q4, HALF, SYM, 7>(p, nb, a, row0, out),
        _ => avx512::<Q4, HALF, SYM, 8>(p, nb, a, row0, out),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn avx512<const Q4: bool, const HALF: bool, const SYM: bool, const MR: usize>(
    blocks: *const u8,
    nb: usize,
    a: &QActs,
    row0: usize,
    out: &mut Tile,
) {
    let kind = if Q4 { QKind::Q4 } else { QKind::Q8 };
    let fmt = Format {
        kind,
        half: HALF,
        sym: SYM,
    };
    let (bb, qb, sb) = (fmt.block_bytes(), fmt.quant_bytes(), fmt.scales_bytes());
    let x: [*const i8; MR] = std::array::from_fn(|r| a.q.as_ptr().add((row0 + r) * a.k));
    let xs: [*const f32; MR] = std::array::from_fn(|r| a.scale.as_ptr().add((row0 + r) * nb));
    let xsum: [*const f32; MR] = std::array::from_fn(|r| a.sum.as_ptr().add((row0 + r) * nb));
    let nibble = _mm512_set1_epi8(0x0F);
    let neg_offset = _mm512_set1_ps(kind.neg_offset());
    let mut acc = [_mm512_setzero_ps(); MR];
    let ahead = super::prefetch::lead::<MR>();
    for b in 0..nb {
        let blk = blocks.add(b * bb);
        super::prefetch::ahead(blk, ahead, bb);
        let c0 = b * BLOCK;
        let mut even = [_mm512_setzero_si512(); MR];
        let mut odd = [_mm512_setzero_si512(); MR];
        if Q4 && MR < 4 {
            // The high nibbles stay in place (16 q each): the odd sums are 16x theirs, one
            // exact shift a block instead of one a chunk, so a latency-bound M = 1 issues
            // fewer ops per byte.
            let high = _mm512_set1_epi8(0xF0u8 as i8);
            for j in 0..4 {
                let v = _mm512_loadu_si512(blk.add(j * 64) as *const __m512i);
                let lo = _mm512_and_si512(v, nibble);
                let hi = _mm512_and_si512(v, high);
                for r in 0..MR {
                    even[r] = _mm512_dpbusd_epi32(even[r], lo, x4_512(x[r], c0 + 4 * j));
                    odd[r] = _mm512_dpbusd_epi32(odd[r], hi, x4_512(x[r], c0 + 16 + 4 * j));
                }
            }
            for o in odd.iter_mut() {
                *o = _mm512_srai_epi32::<4>(*o);
            }
        } else if Q4 {
            for j in 0..4 {
                let v = _mm512_loadu_si512(blk.add(j * 64) as *const __m512i);
                let lo = _mm512_and_si512(v, nibble);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                for r in 0..MR {
                    even[r] = _mm512_dpbusd_epi32(even[r], lo, x4_512(x[r], c0 + 4 * j));
                    even[r] = _mm512_dpbusd_epi32(even[r], hi, x4_512(x[r], c0 + 16 + 4 * j));
                }
            }
        } else if MR >= 4 {
            // The block's 8 weight vectors loaded once into registers, then each row's chain:
            // with `sym` constant, the interleaved shape below still ran 448-521 int8 GOP/s at
            // M = 8-128 (3,072 x 576, Zen 4) against 531-585 this way.
            let w: [__m512i; 8] =
                std::array::from_fn(|c| _mm512_loadu_si512(blk.add(64 * c) as *const __m512i));
            for r in 0..MR {
                for (c, &wc) in w.iter().enumerate() {
                    even[r] = _mm512_dpbusd_epi32(even[r], wc, x4_512(x[r], c0 + 4 * c));
                }
            }
        } else {
            // Below 4 rows: two chains a row, so the `vpdpbusd` latency does not bound M = 1.
            for j in 0..4 {
                let v0 = _mm512_loadu_si512(blk.add(128 * j) as *const __m512i);
                let v1 = _mm512_loadu_si512(blk.add(128 * j + 64) as *const __m512i);
                for r in 0..MR {
                    even[r] = _mm512_dpbusd_epi32(even[r], v0, x4_512(x[r], c0 + 8 * j));
                    odd[r] = _mm512_dpbusd_epi32(odd[r], v1, x4_512(x[r], c0 + 8 * j + 4));
                }
            }
        }
        let scale = load16(blk.add(qb), HALF);
        // -offset * scale is exact (a power of two): the min a full block would store.
        let min = if SYM {
            _mm512_mul_ps(scale, neg_offset)
        } else {
            load16(blk.add(qb + sb), HALF)
        };
        for r in 0..MR {
            let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
            let s = _mm512_mul_ps(scale, _mm512_set1_ps(*xs[r].add(b)));
            acc[r] = _mm512_fmadd_ps(isum, s, acc[r]);
            acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(*xsum[r].add(b)), acc[r]);
        }
    }
    for r in 0..MR {
        _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
}

/// 8 E8M0 bytes at `p` as `2^(e - 128)`: [`mx4::e8m0_half`]'s two normal powers, exact.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn e8m0_8(p: *const u8) -> __m256 {
    let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let hi = _mm256_srli_epi32::<1>(_mm256_add_epi32(e, _mm256_set1_epi32(1)));
    let lo = _mm256_srli_epi32::<1>(e);
    let pow = |k| {
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            k,
            _mm256_set1_epi32(63),
        )))
    };
    _mm256_mul_ps(pow(hi), pow(lo))
}

/// `acc + Σ4 u8 × i8` per i32 lane, by VNNI.
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn dot_vnni(acc: __m256i, w: __m256i, x: __m256i, _q8: bool) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, w, x)
}

/// `acc + Σ4 w × x` per i32 lane, by `vpmaddubsw`: `w` as is for 4-bit weights, `w - 128` for
/// 8-bit ones (the caller adds `128 Σ x` back).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(acc: __m256i, w: __m256i, x: __m256i, q8: bool) -> __m256i {
    let pairs = if q8 {
        let ws = _mm256_xor_si256(w, _mm256_set1_epi8(-128));
        _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws))
    } else {
        _mm256_maddubs_epi16(w, x)
    };
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// A 256-bit tile body, instantiated per ISA so every helper inlines into its target features.
macro_rules! tile256 {
    ($entry:ident, $body:ident, $features:literal, $dot:ident, $offset:literal, $isa:ident) => {
        tile256!(
            $entry,
            $body,
            $features,
            $dot,
            $offset,
            $isa,
            |_fmt, _rows| false
        );
    };
    ($entry:ident, $body:ident, $features:literal, $dot:ident, $offset:literal, $isa:ident,
     $own:expr) => {
        pub(crate) fn $entry(
            fmt: Format,
            blocks: &[u8],
            nb: usize,
            a: &QActs,
            row0: usize,
            rows: usize,
            out: &mut Tile,
        ) {
            assert!(blocks.len() >= nb * fmt.block_bytes() && (row0 + rows) * a.k <= a.q.len());
            assert!(Isa::$isa.available());
            if ($own)(fmt, rows) {
                return tile_avx2_q4(fmt, blocks, nb, a, row0, rows, out);
            }
            let (p, s) = (blocks.as_ptr(), fmt.sym);
            // SAFETY: as in `tile_avx512_vnni`.
            unsafe {
                match (fmt.kind, fmt.half, rows) {
                    (QKind::Q8, false, 1) => {
                        $body::<false, false, false, 1>(p, s, nb, a, row0, out)
                    }
                    (QKind::Q8, false, _) => {
                        $body::<false, false, false, 2>(p, s, nb, a, row0, out)
                    }
                    (QKind::Q8, true, 1) => $body::<false, true, false, 1>(p, s, nb, a, row0, out),
                    (QKind::Q8, true, _) => $body::<false, true, false, 2>(p, s, nb, a, row0, out),
                    (QKind::Q4, false, 1) => $body::<true, false, false, 1>(p, s, nb, a, row0, out),
                    (QKind::Q4, false, _) => $body::<true, false, false, 2>(p, s, nb, a, row0, out),
                    (QKind::Q4, true, 1) => $body::<true, true, false, 1>(p, s, nb, a, row0, out),
                    (QKind::Q4, true, _) => $body::<true, true, false, 2>(p, s, nb, a, row0, out),
                    (QKind::Mx4, _, 1) => $body::<true, false, true, 1>(p, s, nb, a, row0, out),
                    (QKind::Mx4, _, _) => $body::<true, false, true, 2>(p, s, nb, a, row0, out),
                    (QKind::Q6K, _, _) => {
                        super::q6k_x86::tile_avx2(fmt, blocks, nb, a, row0, rows, out)
                    }
                }
            }
        }

        #[target_feature(enable = $features)]
        unsafe fn $body<const Q4: bool, const HALF: bool, const MX: bool, const MR: usize>(
            blocks: *const u8,
            sym: bool,
            nb: usize,
            a: &QActs,
            row0: usize,
            out: &mut Tile,
        ) {
            let kind = match (MX, Q4) {
                (true, _) => QKind::Mx4,
                (false, true) => QKind::Q4,
                (false, false) => QKind::Q8,
            };
            let fmt = Format {
                kind,
                half: HALF,
                sym,
            };
            let (bb, qb, sb) = (fmt.block_bytes(), fmt.quant_bytes(), fmt.scales_bytes());
            let neg_offset = _mm256_set1_ps(kind.neg_offset());
            let lut =
                _mm256_broadcastsi128_si256(_mm_loadu_si128(mx4::LUT.as_ptr() as *const __m128i));
            let x: [*const i8; MR] = std::array::from_fn(|r| a.q.as_ptr().add((row0 + r) * a.k));
            let base: [usize; MR] = std::array::from_fn(|r| (row0 + r) * nb);
            let nibble = _mm256_set1_epi8(0x0F);
            // [row][half]: rows 0..8 of the group in the low 32 bytes of a chunk, 8..16 high.
            let mut acc = [[_mm256_setzero_ps(); 2]; MR];
            let ahead = super::prefetch::lead::<MR>();
            for b in 0..nb {
                let blk = blocks.add(b * bb);
                super::prefetch::ahead(blk, ahead, bb);
                let c0 = b * BLOCK;
                let mut isum = [[_mm256_setzero_si256(); 2]; MR];
                for h in 0..2 {
                    if Q4 {
                        for j in 0..4 {
                            let v = _mm256_loadu_si256(blk.add(j * 64 + 32 * h) as *const __m256i);
                            let mut lo = _mm256_and_si256(v, nibble);
                            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
                            if MX {
                                lo = _mm256_shuffle_epi8(lut, lo);
                                hi = _mm256_shuffle_epi8(lut, hi);
                            }
                            for r in 0..MR {
                                let i = &mut isum[r][h];
                                *i = $dot(*i, lo, x4_256(x[r], c0 + 4 * j), false);
                                *i = $dot(*i, hi, x4_256(x[r], c0 + 16 + 4 * j), false);
                            }
                        }
                    } else {
                        for j in 0..8 {
                            let v = _mm256_loadu_si256(blk.add(j * 64 + 32 * h) as *const __m256i);
                            for r in 0..MR {
                                let i = &mut isum[r][h];
                                *i = $dot(*i, v, x4_256(x[r], c0 + 4 * j), true);
                            }
                        }
                    }
                }
                for r in 0..MR {
                    let ia = base[r] + b;
                    let xs = _mm256_set1_ps(a.scale[ia]);
                    let xsum = _mm256_set1_ps(a.sum[ia]);
                    let fix = _mm256_set1_epi32(if $offset && !Q4 { 128 * a.qsum[ia] } else { 0 });
                    for h in 0..2 {
                        let at = if HALF { 16 * h } else { 32 * h };
                        let scale = if MX {
                            e8m0_8(blk.add(qb + 8 * h))
                        } else {
                            load8(blk.add(qb + at), HALF)
                        };
                        let min = if sym {
                            _mm256_mul_ps(scale, neg_offset)
                        } else {
                            load8(blk.add(qb + sb + at), HALF)
                        };
                        let s = _mm256_cvtepi32_ps(_mm256_add_epi32(isum[r][h], fix));
                        acc[r][h] = _mm256_fmadd_ps(s, _mm256_mul_ps(scale, xs), acc[r][h]);
                        acc[r][h] = _mm256_fmadd_ps(min, xsum, acc[r][h]);
                    }
                }
            }
            for r in 0..MR {
                _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r][0]);
                _mm256_storeu_ps(out[r].as_mut_ptr().add(8), acc[r][1]);
            }
        }
    };
}

tile256!(
    tile_avx_vnni,
    avx_vnni,
    "avx2,fma,f16c,avxvnni",
    dot_vnni,
    false,
    AvxVnni
);
tile256!(
    tile_avx2,
    avx2,
    "avx2,fma,f16c",
    dot_avx2,
    true,
    Avx2,
    // Only Q4: MXFP4's table values (up to 24) would overflow the 4-row tile's i16 sums.
    |fmt: Format, _rows| fmt.kind == QKind::Q4
);

/// AVX2's 4-bit tile of up to 4 rows: a block half's `vpmaddubsw` pairs summed in i16 lanes,
/// then one `vpmaddwd` per row and half instead of one per pair. 8 pairs of `15 · 127` products
/// stay inside i16 (|Σ| ≤ 8 · 2 · 15 · 127 = 30480, activations never -128), and integer sums
/// are exact, so the bits are those of the pair-at-a-time body; but at M > 1, where the
/// multiply ports bound the tile, it issues 9 multiplies per 8 pairs, not 16. Not for MXFP4:
/// its table values 0..=24 (`2 e2m1 + 12`) give |Σ| up to 8 · 2 · 24 · 127 = 48768 > 32767, so
/// the i16 lanes would wrap (folding every 4 pairs, 24384, would fit, but that body is not
/// written); MXFP4 stays on the 2-row body, which folds each pair (≤ 6096) into i32 at once.
fn tile_avx2_q4(
    fmt: Format,
    blocks: &[u8],
    nb: usize,
    a: &QActs,
    row0: usize,
    rows: usize,
    out: &mut Tile,
) {
    assert!(fmt.kind == QKind::Q4 && rows <= 4);
    let (p, s) = (blocks.as_ptr(), fmt.sym);
    // SAFETY: as in `tile_avx512_vnni`; the caller (`tile_avx2`) checked the features and sizes.
    unsafe {
        match (fmt.half, rows) {
            (false, 1) => avx2_q4::<false, 1>(p, s, nb, a, row0, out),
            (false, 2) => avx2_q4::<false, 2>(p, s, nb, a, row0, out),
            (false, 3) => avx2_q4::<false, 3>(p, s, nb, a, row0, out),
            (false, _) => avx2_q4::<false, 4>(p, s, nb, a, row0, out),
            (true, 1) => avx2_q4::<true, 1>(p, s, nb, a, row0, out),
            (true, 2) => avx2_q4::<true, 2>(p, s, nb, a, row0, out),
            (true, 3) => avx2_q4::<true, 3>(p, s, nb, a, row0, out),
            (true, _) => avx2_q4::<true, 4>(p, s, nb, a, row0, out),
        }
    }
}

// `h` picks the chunk half and each row's accumulator alike: an index reads plainer than a zip.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_q4<const HALF: bool, const MR: usize>(
    blocks: *const u8,
    sym: bool,
    nb: usize,
    a: &QActs,
    row0: usize,
    out: &mut Tile,
) {
    let fmt = Format {
        kind: QKind::Q4,
        half: HALF,
        sym,
    };
    let (bb, qb, sb) = (fmt.block_bytes(), fmt.quant_bytes(), fmt.scales_bytes());
    let neg_offset = _mm256_set1_ps(QKind::Q4.neg_offset());
    let x: [*const i8; MR] = std::array::from_fn(|r| a.q.as_ptr().add((row0 + r) * a.k));
    let base: [usize; MR] = std::array::from_fn(|r| (row0 + r) * nb);
    let (nibble, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    // [row][half]: rows 0..8 of the group in the low 32 bytes of a chunk, 8..16 high.
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    let ahead = super::prefetch::lead::<MR>();
    for b in 0..nb {
        let blk = blocks.add(b * bb);
        super::prefetch::ahead(blk, ahead, bb);
        let c0 = b * BLOCK;
        // Both halves of each chunk at once (rows 0..8 and 8..16 of the group): one broadcast of
        // x serves two `vpmaddubsw` (a half at a time took one broadcast per multiply). Each
        // half's i16 sums take the same terms in the same order, so the bits are unchanged;
        // 1.03-1.06x at 2 threads on a 2-core Zen 1, every shape and M (alternating, one process).
        let mut pairs = [[_mm256_setzero_si256(); 2]; MR];
        for j in 0..4 {
            let v = [0, 1].map(|h| _mm256_loadu_si256(blk.add(j * 64 + 32 * h) as *const __m256i));
            let lo = v.map(|v| _mm256_and_si256(v, nibble));
            for r in 0..MR {
                let x = x4_256(x[r], c0 + 4 * j);
                for h in 0..2 {
                    pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_maddubs_epi16(lo[h], x));
                }
            }
            let hi = v.map(|v| _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble));
            for r in 0..MR {
                let x = x4_256(x[r], c0 + 16 + 4 * j);
                for h in 0..2 {
                    pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_maddubs_epi16(hi[h], x));
                }
            }
        }
        for h in 0..2 {
            let at = if HALF { 16 * h } else { 32 * h };
            let scale = load8(blk.add(qb + at), HALF);
            let min = if sym {
                _mm256_mul_ps(scale, neg_offset)
            } else {
                load8(blk.add(qb + sb + at), HALF)
            };
            for r in 0..MR {
                let ia = base[r] + b;
                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r][h], ones));
                let xs = _mm256_set1_ps(a.scale[ia]);
                acc[r][h] = _mm256_fmadd_ps(s, _mm256_mul_ps(scale, xs), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(min, _mm256_set1_ps(a.sum[ia]), acc[r][h]);
            }
        }
    }
    for r in 0..MR {
        _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r][0]);
        _mm256_storeu_ps(out[r].as_mut_ptr().add(8), acc[r][1]);
    }
}
