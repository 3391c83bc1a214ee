//! AVX2 body of `attention::attend` for head dims that are a multiple of 8 (up to 128, and 256):
//! `attention_x86`'s two passes on 8 lanes and 16 registers, for CPUs without AVX-512.
//!
//! - Logits: per position each KV head's K row is loaded (and widened: bf16 by a shift, f16 by
//!   F16C) once, up to 8 registers at a time, and multiplied against every query head of its
//!   group in every row; the products stay as 8-lane partial sums, one per (row, head,
//!   position), in a tile of 8 positions, and one transpose-reduce turns 8 of them into 8
//!   logits. A head dim above 64 takes its K row in chunks of 8 registers, the partial sums
//!   going through the tile between chunks (a store and a reload: the same bits as one chain).
//! - Softmax: max, `exp` (the polynomial of `ops::exp`, 8 lanes) and sum, vectorised.
//! - Weighted sum: per position each KV head's V row is loaded once per chunk of columns and
//!   multiplied into the accumulators of up to 12 registers' worth of (row, head) pairs, kept in
//!   registers across all positions and stored once.
//!
//! A logit is one chain of multiply-adds over its own head's columns and one fixed reduction
//! tree, every sum runs over a row's own positions in order, and how pairs and columns are
//! grouped only decides which of them share a pass: a row's result does not depend on its
//! neighbours (the module's promise, tested in `attention_tests.rs`).

use std::any::TypeId;
use std::arch::x86_64::*;
use std::ops::Range;

use super::x86::{At, Geo, Pair, Spans, E4M3_REBIAS};
use super::{DecodeArgs, Lanes, Scratch};
use crate::cpu::elem::{Bf16, Elem, F16, F8E4M3, F8E5M2};

/// Whether this path serves head dim `d` (it needs AVX2, FMA and F16C, checked by the caller).
pub(super) fn serves(d: usize) -> bool {
    d.is_multiple_of(8) && matches!(d / 8, 1..=16 | 32)
}

/// `attend` for a head dim that `serves` accepts.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `args` must have passed `validate`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    rows: Range<usize>,
    scratch: &mut Scratch,
    out: &mut [T],
) {
    // SAFETY (all arms): the caller's contract, passed on.
    unsafe {
        match args.shape.head_dim / 8 {
            1 => attend_dv::<T, C, 1>(args, rows, scratch, out),
            2 => attend_dv::<T, C, 2>(args, rows, scratch, out),
            3 => attend_dv::<T, C, 3>(args, rows, scratch, out),
            4 => attend_dv::<T, C, 4>(args, rows, scratch, out),
            5 => attend_dv::<T, C, 5>(args, rows, scratch, out),
            6 => attend_dv::<T, C, 6>(args, rows, scratch, out),
            7 => attend_dv::<T, C, 7>(args, rows, scratch, out),
            8 => attend_dv::<T, C, 8>(args, rows, scratch, out),
            9 => attend_dv::<T, C, 9>(args, rows, scratch, out),
            10 => attend_dv::<T, C, 10>(args, rows, scratch, out),
            11 => attend_dv::<T, C, 11>(args, rows, scratch, out),
            12 => attend_dv::<T, C, 12>(args, rows, scratch, out),
            13 => attend_dv::<T, C, 13>(args, rows, scratch, out),
            14 => attend_dv::<T, C, 14>(args, rows, scratch, out),
            15 => attend_dv::<T, C, 15>(args, rows, scratch, out),
            16 => attend_dv::<T, C, 16>(args, rows, scratch, out),
            32 => attend_dv::<T, C, 32>(args, rows, scratch, out),
            _ => unreachable!("head dim {} is not served here", args.shape.head_dim),
        }
    }
}

/// Floats in one tile: 8 positions' 8-lane partial sums per (row, head).
const TILE: usize = 64;

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_dv<T: Elem, C: Elem, const DV: usize>(
    args: &DecodeArgs<T, C>,
    rows: Range<usize>,
    scratch: &mut Scratch,
    out: &mut [T],
) {
    let s = args.shape;
    let (d, hq) = (s.head_dim, s.num_q_heads);
    let geo = Geo::new(
        &args.block_tables[rows.start * s.max_blocks..(rows.start + 1) * s.max_blocks],
        s.block_size,
        s.kv_stride,
    );
    let Scratch {
        scores,
        q,
        spans,
        tile,
        ..
    } = scratch;
    let (total, lo, hi) = args.gather(rows.clone(), q, spans);
    scores.clear();
    scores.resize(total, 0.0);
    tile.clear();
    tile.resize(spans.len() * hq * TILE / 16, Lanes([0.0; 16]));
    // SAFETY: the CPU has AVX2 + FMA + F16C (this function's contract); `validate` checked
    // every block id and length, so each row offset and slice below stays inside its buffer.
    unsafe {
        logits::<T, C, DV>(args, geo, spans, q, tile, scores, lo..hi);
    }
    if let Some(cap) = args.softcap {
        scores.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
    }
    for &(first, len, base) in spans.iter() {
        let span = len - first;
        for h in 0..hq {
            let sink = args.sinks.map(|sk| sk[h]);
            // SAFETY: AVX2 + FMA, as above.
            unsafe { softmax(&mut scores[base + h * span..base + (h + 1) * span], sink) };
        }
    }
    let group = hq / s.num_kv_heads;
    // Columns per pass: as many as the registers allow for this many pairs (one V register per
    // column vector, one for the broadcast probability, the rest accumulators).
    let wide = match spans.len() * group {
        1..=2 => 4,
        3..=4 => 3,
        _ => 2,
    };
    let mut pairs = [Pair::default(); 12];
    for kvh in 0..s.num_kv_heads {
        for c0 in (0..DV).step_by(wide) {
            let nc = (DV - c0).min(wide);
            let np = if nc == 4 { 2 } else { 12 / nc };
            let mut n = 0;
            let all = spans
                .iter()
                .enumerate()
                .flat_map(|(r, &(first, len, base))| {
                    (0..group).map(move |g| {
                        let h = kvh * group + g;
                        Pair {
                            first,
                            len,
                            off: base + h * (len - first),
                            out: (r * hq + h) * d,
                        }
                    })
                });
            let mut flush = |chunk: &[Pair]| {
                let col = kvh * d + c0 * 8;
                // SAFETY: AVX2 + FMA, as above; `nc` picks the instance whose width it names.
                unsafe {
                    match nc {
                        4 => weigh::<T, C, 4, 2>(args.v_cache, geo, chunk, col, scores, out, c0),
                        3 => weigh::<T, C, 3, 4>(args.v_cache, geo, chunk, col, scores, out, c0),
                        2 => weigh::<T, C, 2, 6>(args.v_cache, geo, chunk, col, scores, out, c0),
                        _ => weigh::<T, C, 1, 12>(args.v_cache, geo, chunk, col, scores, out, c0),
                    }
                }
            };
            for p in all {
                pairs[n] = p;
                n += 1;
                if n == np {
                    flush(&pairs[..n]);
                    n = 0;
                }
            }
            if n > 0 {
                flush(&pairs[..n]);
            }
        }
    }
}

/// 8 elements at `p` widened to f32 (exactly, as `Elem::load`).
#[inline(always)]
unsafe fn load8<T: Elem>(p: *const T) -> __m256 {
    // SAFETY: the caller guarantees 8 readable elements at `p` and AVX2 + F16C; the casts
    // follow the `TypeId` checks, so each reads the type that is really there.
    unsafe {
        if TypeId::of::<T>() == TypeId::of::<f32>() {
            _mm256_loadu_ps(p.cast())
        } else if TypeId::of::<T>() == TypeId::of::<Bf16>() {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else if TypeId::of::<T>() == TypeId::of::<F16>() {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        } else if TypeId::of::<T>() == TypeId::of::<F8E5M2>() {
            let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(p.cast()));
            _mm256_cvtph_ps(_mm_slli_epi16::<8>(b))
        } else if TypeId::of::<T>() == TypeId::of::<F8E4M3>() {
            // As `attention_x86::e4m3x16` (NaN codes read as +-480), 8 lanes.
            let x = _mm256_slli_epi32::<20>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())));
            let bits = _mm256_and_si256(x, _mm256_set1_epi32(0x87f0_0000u32 as i32));
            _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(E4M3_REBIAS))
        } else {
            let mut x = [0.0f32; 8];
            for (i, x) in x.iter_mut().enumerate() {
                *x = (*p.add(i)).load();
            }
            _mm256_loadu_ps(x.as_ptr())
        }
    }
}

/// Lane `j` of the result is the sum of vector `j`'s 8 lanes (vectors 8 floats apart at `v`),
/// by the same tree for every `j`: `((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))`.
#[inline(always)]
unsafe fn reduce8(v: *const f32) -> __m256 {
    // SAFETY: the caller guarantees 64 readable floats at `v`, 32-byte aligned, and AVX.
    unsafe {
        let at = |i: usize| _mm256_load_ps(v.add(8 * i));
        // Pairwise sums within each 128-bit half: after two rounds, half `k` of `u[i]` holds the
        // sums of lanes 4k..4k+4 of vectors 4i..4i+4.
        let t = [
            _mm256_hadd_ps(at(0), at(1)),
            _mm256_hadd_ps(at(2), at(3)),
            _mm256_hadd_ps(at(4), at(5)),
            _mm256_hadd_ps(at(6), at(7)),
        ];
        let u = [_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3])];
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u[0], u[1]),
            _mm256_permute2f128_ps::<0x31>(u[0], u[1]),
        )
    }
}

/// One position's partial sums for one KV head's columns `c0 * 8..(c0 + KC) * 8` (K's registers
/// `k`), for every query head of the group in every row whose span holds `pos`: the first chunk
/// starts each sum, later ones continue it from the tile.
///
/// # Safety
/// AVX2 + FMA; `tp` is the tile (`spans.len() * hq * TILE` floats, 32-byte aligned) and `qp`
/// the group's queries (`spans.len() * hq * d` floats).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn partial<const KC: usize>(
    k: &[__m256; KC],
    spans: &[(usize, usize, usize)],
    heads: Range<usize>,
    (hq, d, c0): (usize, usize, usize),
    qp: *const f32,
    tp: *mut f32,
    pos: usize,
    slot: usize,
) {
    for (r, &(first, len, _)) in spans.iter().enumerate() {
        if pos < first || pos >= len {
            continue;
        }
        for h in heads.clone() {
            // SAFETY: inside the query and tile buffers (the caller's contract).
            unsafe {
                let qh = qp.add((r * hq + h) * d + c0 * 8);
                let dst = tp.add((r * hq + h) * TILE + slot * 8);
                let mut acc = if c0 == 0 {
                    _mm256_mul_ps(_mm256_loadu_ps(qh), k[0])
                } else {
                    _mm256_fmadd_ps(_mm256_loadu_ps(qh), k[0], _mm256_load_ps(dst))
                };
                for (c, &k) in k.iter().enumerate().skip(1) {
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh.add(c * 8)), k, acc);
                }
                _mm256_store_ps(dst, acc);
            }
        }
    }
}

/// Every logit of the rows in `spans` at positions `range`, times `args.scale`, into `scores`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn logits<T: Elem, C: Elem, const DV: usize>(
    args: &DecodeArgs<T, C>,
    geo: Geo,
    spans: &[(usize, usize, usize)],
    q: &[f32],
    tile: &mut [Lanes],
    scores: &mut [f32],
    range: Range<usize>,
) {
    let s = args.shape;
    let (d, hq, bs) = (s.head_dim, s.num_q_heads, s.block_size);
    let group = hq / s.num_kv_heads;
    let (lo, hi) = (range.start, range.end);
    let scale = _mm256_set1_ps(args.scale);
    let (kp, qp) = (args.k_cache.as_ptr(), q.as_ptr());
    let tp: *mut f32 = tile.as_mut_ptr().cast();
    let mut t0 = lo / 8 * 8;
    while t0 < hi {
        for pos in t0.max(lo)..(t0 + 8).min(hi) {
            if pos + bs < hi {
                let next = geo.row(pos + bs);
                super::prefetch(&args.k_cache[next..next + s.num_kv_heads * d]);
            }
            let slot = pos - t0;
            // SAFETY: `validate` bounds every row offset; q holds `spans.len() * hq * d` floats
            // and the tile `spans.len() * hq * TILE`.
            unsafe {
                let krow = kp.add(geo.row(pos));
                for kvh in 0..s.num_kv_heads {
                    let heads = kvh * group..(kvh + 1) * group;
                    let kh = krow.add(kvh * d);
                    // Whole chunks of 8 registers, then the rest (both counts are constants).
                    for c0 in (0..DV / 8 * 8).step_by(8) {
                        let k: [__m256; 8] = std::array::from_fn(|c| load8(kh.add((c0 + c) * 8)));
                        partial(&k, spans, heads.clone(), (hq, d, c0), qp, tp, pos, slot);
                    }
                    let c0 = DV / 8 * 8;
                    macro_rules! rest {
                        ($($n:literal)*) => {
                            match DV % 8 {
                                $($n => {
                                    let k: [__m256; $n] =
                                        std::array::from_fn(|c| load8(kh.add((c0 + c) * 8)));
                                    partial(&k, spans, heads, (hq, d, c0), qp, tp, pos, slot);
                                })*
                                _ => {}
                            }
                        };
                    }
                    rest!(1 2 3 4 5 6 7);
                }
            }
        }
        for (r, &(first, len, base)) in spans.iter().enumerate() {
            let (a, b) = (t0.max(first), (t0 + 8).min(len));
            if a >= b {
                continue;
            }
            let span = len - first;
            for h in 0..hq {
                // SAFETY: the tile holds this pair's 64 floats; the logits of positions `a..b`
                // lie inside this row's and head's `span` scores.
                unsafe {
                    let x = _mm256_mul_ps(reduce8(tp.add((r * hq + h) * TILE)), scale);
                    let dst = scores.as_mut_ptr().add(base + h * span);
                    if a == t0 && b == t0 + 8 {
                        _mm256_storeu_ps(dst.add(t0 - first), x);
                    } else {
                        let mut lanes = [0.0f32; 8];
                        _mm256_storeu_ps(lanes.as_mut_ptr(), x);
                        for pos in a..b {
                            *dst.add(pos - first) = lanes[pos - t0];
                        }
                    }
                }
            }
        }
        t0 += 8;
    }
}

/// `ops::exp` on 8 lanes, the same operations in the same order (so the same bits).
#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    // SAFETY: register arithmetic only; the caller guarantees AVX2.
    unsafe {
        use crate::cpu::ops::exp_consts::*;
        let c = _mm256_set1_ps;
        let round = c(ROUND);
        let x = _mm256_min_ps(_mm256_max_ps(x, c(LO)), c(HI));
        let t = _mm256_add_ps(_mm256_mul_ps(x, c(std::f32::consts::LOG2_E)), round);
        let n = _mm256_sub_ps(t, round);
        let r = _mm256_add_ps(
            _mm256_sub_ps(x, _mm256_mul_ps(n, c(LN2_HI))),
            _mm256_mul_ps(n, c(LN2_LO)),
        );
        let mut p = c(P0);
        for k in POLY {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), c(k));
        }
        let y = _mm256_add_ps(
            _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
            c(1.0),
        );
        let bits = _mm256_add_epi32(
            _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(round)),
            _mm256_set1_epi32(127),
        );
        _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(bits)))
    }
}

/// One (row, head)'s logits to probabilities in place, the sink (if any) in the denominator.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax(sc: &mut [f32], sink: Option<f32>) {
    let n = sc.len() / 8 * 8;
    let p = sc.as_mut_ptr();
    // SAFETY: every access is below `sc.len()`: vectors at multiples of 8 below `n`.
    unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(8) {
            m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        // A sink enters the max too, so a sink far above every logit cannot overflow exp().
        let max = sc[n..]
            .iter()
            .chain(&lanes)
            .copied()
            .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
        let (vmax, mut acc) = (_mm256_set1_ps(max), _mm256_setzero_ps());
        for i in (0..n).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vmax));
            _mm256_storeu_ps(p.add(i), e);
            acc = _mm256_add_ps(acc, e);
        }
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut tail = 0.0;
        for x in sc[n..].iter_mut() {
            *x = crate::cpu::ops::exp(*x - max);
            tail += *x;
        }
        let total = lanes.iter().sum::<f32>() + tail;
        let inv = 1.0 / (total + sink.map_or(0.0, |x| crate::cpu::ops::exp(x - max)));
        let vinv = _mm256_set1_ps(inv);
        for i in (0..n).step_by(8) {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), vinv));
        }
        sc[n..].iter_mut().for_each(|x| *x *= inv);
    }
}

/// `out` columns `c0 * 8..(c0 + NC) * 8` of every pair in `pairs` (at most `NP`): the sum over
/// its positions of probability × V row (cache columns `col..col + NC * 8`), accumulated in
/// registers, positions in order.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn weigh<T: Elem, C: Elem, const NC: usize, const NP: usize>(
    v_cache: &[C],
    geo: Geo,
    pairs: &[Pair],
    col: usize,
    scores: &[f32],
    out: &mut [T],
    c0: usize,
) {
    let np = pairs.len().min(NP);
    let pairs = &pairs[..np];
    let Spans {
        lo,
        all_lo,
        all_hi,
        hi,
    } = Spans::of(pairs);
    let mut acc = [[_mm256_setzero_ps(); NC]; NP];
    let at = At {
        v_cache,
        scores,
        geo,
        col,
        hi,
    };
    // SAFETY (all three): AVX2 + FMA + F16C (this function's contract); `step`'s own contract
    // holds for positions inside the pairs' spans, which these ranges are.
    unsafe {
        for pos in lo..all_lo.min(hi) {
            step::<C, NC, NP, true>(&at, pairs, &mut acc, pos);
        }
        for pos in all_lo..all_hi {
            step::<C, NC, NP, false>(&at, pairs, &mut acc, pos);
        }
        for pos in all_hi.max(lo)..hi {
            step::<C, NC, NP, true>(&at, pairs, &mut acc, pos);
        }
    }
    for (pr, acc) in pairs.iter().zip(&acc) {
        let dst = &mut out[pr.out + c0 * 8..pr.out + (c0 + NC) * 8];
        let mut lanes = [0.0f32; 8];
        for (c, &a) in acc.iter().enumerate() {
            // SAFETY: an 8-float local buffer; AVX.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
            for (o, &x) in dst[c * 8..(c + 1) * 8].iter_mut().zip(&lanes) {
                *o = T::store(x);
            }
        }
    }
}

/// One position of `weigh`: its V row (NC vectors) into every pair's accumulators; with
/// `CHECK`, only the pairs whose span holds `pos`.
///
/// # Safety
/// AVX2 + FMA + F16C; `pos` is a position of some pair's span (so its cache row exists), and
/// with `CHECK = false`, of every pair's.
#[inline(always)]
unsafe fn step<T: Elem, const NC: usize, const NP: usize, const CHECK: bool>(
    at: &At<T>,
    pairs: &[Pair],
    acc: &mut [[__m256; NC]; NP],
    pos: usize,
) {
    let geo = at.geo;
    if pos + geo.block_size < at.hi {
        let next = geo.row(pos + geo.block_size) + at.col;
        super::prefetch(&at.v_cache[next..next + NC * 8]);
    }
    // SAFETY: `validate` bounds the row offset; a pair's score is read only at its own
    // positions, inside its `len - first` logits.
    unsafe {
        let vr = at.v_cache.as_ptr().add(geo.row(pos) + at.col);
        let mut v = [_mm256_setzero_ps(); NC];
        for (c, v) in v.iter_mut().enumerate() {
            *v = load8(vr.add(c * 8));
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            if i >= pairs.len() {
                break;
            }
            let pr = pairs.get_unchecked(i);
            if CHECK && (pos < pr.first || pos >= pr.len) {
                continue;
            }
            let w = _mm256_set1_ps(*at.scores.as_ptr().add(pr.off + pos - pr.first));
            for (a, &v) in acc.iter_mut().zip(&v) {
                *a = _mm256_fmadd_ps(w, v, *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has_avx2() -> bool {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }

    #[test]
    fn reduce8_sums_each_vector_into_its_lane() {
        if !has_avx2() {
            return;
        }
        #[repr(C, align(32))]
        struct Tile([f32; TILE]);
        let mut tile = Tile([0.0; TILE]);
        let flat = &mut tile.0;
        for (i, x) in flat.iter_mut().enumerate() {
            let (j, l) = (i / 8, i % 8);
            *x = (j * 100 + l) as f32 * if l % 3 == 0 { -1.0 } else { 1.0 };
        }
        let mut got = [0.0f32; 8];
        // SAFETY: AVX checked above; 64 floats, 32-byte aligned.
        unsafe { _mm256_storeu_ps(got.as_mut_ptr(), reduce8(flat.as_ptr())) };
        for (j, g) in got.iter().enumerate() {
            let want = flat[j * 8..(j + 1) * 8].iter().sum::<f32>();
            assert_eq!(*g, want, "lane {j}");
        }
        // A different order of the same terms rounds differently: the tree is the one documented.
        let x = [1e8f32, 1.0, -1e8, 1.0, 0.5, 0.25, 3.0, -0.75];
        let tree = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
        flat.iter_mut().for_each(|y| *y = 0.0);
        flat[..8].copy_from_slice(&x);
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(got.as_mut_ptr(), reduce8(flat.as_ptr())) };
        assert_eq!(got[0].to_bits(), tree.to_bits());
    }

    #[test]
    fn exp8_equals_the_scalar_exp() {
        if !has_avx2() {
            return;
        }
        let xs: Vec<f32> = (0..4096)
            .map(|i| -100.0 + i as f32 * 0.0471)
            .chain([
                f32::NEG_INFINITY,
                0.0,
                -0.0,
                88.5,
                -87.5,
                1e-30,
                -1e-30,
                90.0,
            ])
            .collect();
        for chunk in xs.chunks_exact(8) {
            let mut got = [0.0f32; 8];
            // SAFETY: AVX2 checked above; 8 floats each way.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), exp8(_mm256_loadu_ps(chunk.as_ptr()))) };
            for (g, &x) in got.iter().zip(chunk) {
                assert_eq!(g.to_bits(), crate::cpu::ops::exp(x).to_bits(), "exp({x})");
            }
        }
    }

    #[test]
    fn load8_widens_exactly_as_elem_load() {
        if !has_avx2() || !std::is_x86_feature_detected!("f16c") {
            return;
        }
        // Every 16-bit pattern: normals, subnormals, zeros, infinities (NaNs compared as NaN).
        let all: Vec<u16> = (0..=u16::MAX).collect();
        for chunk in all.chunks_exact(8) {
            let b: Vec<Bf16> = chunk.iter().map(|&x| Bf16(x)).collect();
            let h: Vec<F16> = chunk.iter().map(|&x| F16(x)).collect();
            let mut got = [[0.0f32; 8]; 2];
            // SAFETY: AVX2 + F16C checked above; 8 elements each.
            unsafe {
                _mm256_storeu_ps(got[0].as_mut_ptr(), load8(b.as_ptr()));
                _mm256_storeu_ps(got[1].as_mut_ptr(), load8(h.as_ptr()));
            }
            for i in 0..8 {
                for (g, w) in [(got[0][i], b[i].load()), (got[1][i], h[i].load())] {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "pattern {:#06x}: {g} vs {w}",
                        chunk[i]
                    );
                }
            }
        }
    }

    #[test]
    fn load8_widens_every_8_bit_code_as_elem_load() {
        if !has_avx2() || !std::is_x86_feature_detected!("f16c") {
            return;
        }
        fn check<T: Elem>(codes: &[T]) {
            for chunk in codes.chunks(8) {
                let mut got = [0.0f32; 8];
                // SAFETY: AVX2 and F16C checked above; 8 elements each way.
                unsafe { _mm256_storeu_ps(got.as_mut_ptr(), load8(chunk.as_ptr())) };
                for (g, c) in got.iter().zip(chunk) {
                    let want = c.load();
                    // e4m3's NaN codes read as +-480 (`attention_x86::e4m3x16`).
                    let e4m3_nan =
                        std::mem::size_of::<T>() == 1 && want.is_nan() && g.abs() == 480.0;
                    assert!(
                        g.to_bits() == want.to_bits() || g.is_nan() && want.is_nan() || e4m3_nan
                    );
                }
            }
        }
        check(&(0..=255u8).map(F8E4M3).collect::<Vec<_>>());
        check(&(0..=255u8).map(F8E5M2).collect::<Vec<_>>());
    }
}
