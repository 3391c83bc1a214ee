//! Dynamic int8 quantization of the activations, once per matmul: every 32-block of a row gets
//! `scale = amax / 127` and `q = round(x / scale)` in -127..=127 (never -128, so AVX2's
//! sign trick cannot overflow), and the block sums `Σ q` (for the AVX2 path's offset correction)
//! and `scale Σ q` (for the weights' min term). Using the quantized sum, not the exact `Σ x`,
//! keeps the result that of `W @ xq` with no other error: `Σ (s q_w + m)(x - e) = Σ w x - Σ w e`,
//! `|e| <= scale / 2`; with the exact sum the error would be `Σ (w - m) e`, and `w - m` is up to
//! twice `|w|` (for Q8_0, `m = -128 s`, 128 steps on every weight).
//!
//! Q6_K weights (`q6k.rs`) have one scale per 16 columns, so their offset correction needs the sums of each
//! block's two halves: `halves`, both in one i32 as two i16s (`|Σ| <= 16 · 127`), the operand of one `vpmaddwd`.

use super::BLOCK;

pub(crate) struct QActs {
    pub k: usize,
    pub q: Vec<i8>,
    pub scale: Vec<f32>,
    pub sum: Vec<f32>,
    pub qsum: Vec<i32>,
    /// Per block: `Σ q[0..16]` in the low i16, `Σ q[16..32]` in the high one (empty unless
    /// asked for: see `quantize`).
    pub halves: Vec<i32>,
}

/// Rows per part below which one thread quantizes everything (a fork costs a few µs).
const MIN_PART: usize = 1 << 15;

/// `halves`: also fill [`QActs::halves`], which only Q6K tiles read (a serial pass over `q`,
/// skipped for every other kind).
pub(crate) fn quantize(x: &[f32], m: usize, k: usize, threads: usize, halves: bool) -> QActs {
    let nb = k / BLOCK;
    let mut a = QActs {
        k,
        q: vec![0; m * k],
        scale: vec![0.0; m * nb],
        sum: vec![0.0; m * nb],
        qsum: vec![0; m * nb],
        halves: Vec::new(),
    };
    let parts = threads.clamp(1, (m * k / MIN_PART).clamp(1, m.max(1)));
    // Disjoint row ranges of every array, one per part (the mutex only proves them disjoint).
    let mut runs = Vec::with_capacity(parts);
    let (mut q, mut sc, mut su, mut qs) = (
        &mut a.q[..],
        &mut a.scale[..],
        &mut a.sum[..],
        &mut a.qsum[..],
    );
    for p in 0..parts {
        let rows = m * (p + 1) / parts - m * p / parts;
        let (q0, q1) = std::mem::take(&mut q).split_at_mut(rows * k);
        let (s0, s1) = std::mem::take(&mut sc).split_at_mut(rows * nb);
        let (u0, u1) = std::mem::take(&mut su).split_at_mut(rows * nb);
        let (t0, t1) = std::mem::take(&mut qs).split_at_mut(rows * nb);
        let xs = &x[m * p / parts * k..][..rows * k];
        runs.push(std::sync::Mutex::new(Rows {
            x: xs,
            q: q0,
            scale: s0,
            sum: u0,
            qsum: t0,
        }));
        (q, sc, su, qs) = (q1, s1, u1, t1);
    }
    crate::cpu::parallel::run_parts(parts, &|p| {
        let mut run = runs[p].lock().unwrap_or_else(|e| e.into_inner());
        quantize_rows(&mut run);
    });
    drop(runs);
    if halves {
        a.halves = half_sums(&a.q);
    }
    a
}

/// [`QActs::halves`] of quantized blocks `q`.
pub(crate) fn half_sums(q: &[i8]) -> Vec<i32> {
    let sum = |h: &[i8]| h.iter().map(|&v| v as i32).sum::<i32>();
    q.chunks_exact(BLOCK)
        .map(|b| (sum(&b[..16]) & 0xFFFF) | (sum(&b[16..]) << 16))
        .collect()
}

/// A run of rows: their `x`, and where their quants and block sums go.
struct Rows<'a> {
    x: &'a [f32],
    q: &'a mut [i8],
    scale: &'a mut [f32],
    sum: &'a mut [f32],
    qsum: &'a mut [i32],
}

fn quantize_rows(r: &mut Rows) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return unsafe { quantize_avx512(r) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { quantize_avx2(r) };
        }
    }
    quantize_generic(r)
}

/// The generic body, inlined into each wrapper below and vectorised for its target features.
#[inline(always)]
fn quantize_generic(r: &mut Rows) {
    let blocks = r.x.chunks_exact(BLOCK).zip(r.q.chunks_exact_mut(BLOCK));
    for (i, (xb, qb)) in blocks.enumerate() {
        // Lane-wise maxima first: a plain fold is a serial chain of `maxss` (f32 max does not
        // reassociate), ~4x slower than the rest of the block's work.
        let mut lanes = [0.0f32; 8];
        for c in xb.chunks_exact(8) {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l = l.max(v.abs());
            }
        }
        let amax = lanes.iter().fold(0.0f32, |m, &v| m.max(v));
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut qsum = 0i32;
        for (d, &v) in qb.iter_mut().zip(xb) {
            let q = (v * inv).round_ties_even() as i32;
            qsum += q;
            *d = q as i8;
        }
        r.scale[i] = amax / 127.0;
        r.sum[i] = r.scale[i] * qsum as f32;
        r.qsum[i] = qsum;
        if xb.iter().any(|v| !v.is_finite()) {
            poison(qb, &mut r.scale[i], &mut r.sum[i], &mut r.qsum[i]);
        }
    }
}

/// A block holding NaN or ±inf: zero quants (the integer paths stay in range) and a NaN scale,
/// so every output it feeds is NaN, as a float matmul would make it (not a silent 0).
#[inline(always)]
fn poison(q: &mut [i8], scale: &mut f32, sum: &mut f32, qsum: &mut i32) {
    q.fill(0);
    (*scale, *sum, *qsum) = (f32::NAN, f32::NAN, 0);
}

/// Explicit SIMD: the autovectorised generic body spills and extracts bytes one by one.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn quantize_avx512(r: &mut Rows) {
    use std::arch::x86_64::*;
    let blocks = r.x.chunks_exact(BLOCK).zip(r.q.chunks_exact_mut(BLOCK));
    for (i, (xb, qb)) in blocks.enumerate() {
        // SAFETY: `xb` holds 32 f32 and `qb` 32 bytes (exact chunks); unaligned loads/stores.
        unsafe {
            let lo = _mm512_loadu_ps(xb.as_ptr());
            let hi = _mm512_loadu_ps(xb.as_ptr().add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            let inv = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            // Round to nearest even (the default MXCSR mode), as `round_ties_even` does.
            let qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
            let qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            _mm_storeu_si128(qb.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128(
                qb.as_mut_ptr().add(16) as *mut __m128i,
                _mm512_cvtepi32_epi8(qhi),
            );
            let qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
            r.scale[i] = amax / 127.0;
            r.sum[i] = r.scale[i] * qsum as f32;
            r.qsum[i] = qsum;
            // `max` drops NaNs, so look for them directly (unordered: either side NaN).
            if _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(lo, hi) != 0 || !amax.is_finite() {
                poison(qb, &mut r.scale[i], &mut r.sum[i], &mut r.qsum[i]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quantize_avx2(r: &mut Rows) {
    use std::arch::x86_64::*;
    let blocks = r.x.chunks_exact(BLOCK).zip(r.q.chunks_exact_mut(BLOCK));
    for (i, (xb, qb)) in blocks.enumerate() {
        // SAFETY: as in `quantize_avx512`.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(xb.as_ptr().add(8 * j)));
            let sign = _mm256_set1_ps(-0.0);
            let abs = |x| _mm256_andnot_ps(sign, x);
            let m = _mm256_max_ps(
                _mm256_max_ps(abs(v[0]), abs(v[1])),
                _mm256_max_ps(abs(v[2]), abs(v[3])),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            let q: [__m256i; 4] =
                std::array::from_fn(|j| _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)));
            // packs work within 128-bit lanes: bytes come out as 0-3, 8-11, 16-19, 24-27, 4-7, ...
            let bytes = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            _mm256_storeu_si256(
                qb.as_mut_ptr() as *mut __m256i,
                _mm256_permutevar8x32_epi32(bytes, order),
            );
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let qsum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b00_00_00_01>(s)));
            r.scale[i] = amax / 127.0;
            r.sum[i] = r.scale[i] * qsum as f32;
            r.qsum[i] = qsum;
            let nan = _mm256_or_ps(
                _mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[1]),
                _mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[3]),
            );
            if _mm256_movemask_ps(nan) != 0 || !amax.is_finite() {
                poison(qb, &mut r.scale[i], &mut r.sum[i], &mut r.qsum[i]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    /// Each SIMD quantizer against the generic one: identical bytes and sums.
    #[test]
    fn simd_quantizers_match_the_generic_one() {
        let mut rng = Rng(17);
        let (m, k) = (9, 256);
        let mut x: Vec<f32> = rng.floats(m * k).iter().map(|v| v * 50.0).collect();
        x[..32].fill(0.0); // an all-zero block
        x[40] = 1e-30; // a tiny amax
        let run = |f: &dyn Fn(&mut Rows)| {
            let mut a = QActs {
                k,
                q: vec![0; m * k],
                scale: vec![0.0; m * k / 32],
                sum: vec![0.0; m * k / 32],
                qsum: vec![0; m * k / 32],
                halves: Vec::new(),
            };
            f(&mut Rows {
                x: &x,
                q: &mut a.q,
                scale: &mut a.scale,
                sum: &mut a.sum,
                qsum: &mut a.qsum,
            });
            (a.q, a.scale, a.sum, a.qsum)
        };
        let want = run(&|r| quantize_generic(r));
        assert!(want.0.contains(&127) && want.0.contains(&-127));
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
            {
                // SAFETY: checked just above.
                assert!(run(&|r| unsafe { quantize_avx512(r) }) == want, "avx512");
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: checked just above.
                assert!(run(&|r| unsafe { quantize_avx2(r) }) == want, "avx2");
            }
        }
    }
}
