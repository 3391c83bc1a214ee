//! Dynamic int8 quantization of the activations, once per matmul: every 32-block of a row gets
//! `scale = amax / 127` and `q = round(x / scale)` in -127..=127 (never -128, so AVX2's
//! sign trick cannot overflow), and the block sums `Σ q` (for the AVX2 path's offset correction)
//! and `scale Σ q` (for the weights' min term). Using the quantized sum, not the exact `Σ x`,
//! keeps the result that of `W @ xq` with no other error: `Σ (s q_w + m)(x - e) = Σ w x - Σ w e`,
//! `|e| <= scale / 2`; with the exact sum the error would be `Σ (w - m) e`, and `w - m` is up to
//! twice `|w|` (for Q8_0, `m = -128 s`, 128 steps on every weight).

use super::BLOCK;

pub(crate) struct QActs {
    pub k: usize,
    pub q: Vec<i8>,
    pub scale: Vec<f32>,
    pub sum: Vec<f32>,
    pub qsum: Vec<i32>,
}

pub(crate) fn quantize(x: &[f32], m: usize, k: usize) -> QActs {
    let nb = k / BLOCK;
    let mut a = QActs {
        k,
        q: vec![0; m * k],
        scale: vec![0.0; m * nb],
        sum: vec![0.0; m * nb],
        qsum: vec![0; m * nb],
    };
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            unsafe { quantize_avx512(x, &mut a) };
            return a;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            unsafe { quantize_avx2(x, &mut a) };
            return a;
        }
    }
    quantize_generic(x, &mut a);
    a
}

/// The generic body, inlined into each wrapper below and vectorised for its target features.
#[inline(always)]
fn quantize_generic(x: &[f32], a: &mut QActs) {
    let blocks = x.chunks_exact(BLOCK).zip(a.q.chunks_exact_mut(BLOCK));
    for (i, (xb, qb)) in blocks.enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut qsum = 0i32;
        for (d, &v) in qb.iter_mut().zip(xb) {
            let q = (v * inv).round_ties_even() as i32;
            qsum += q;
            *d = q as i8;
        }
        a.scale[i] = amax / 127.0;
        a.sum[i] = a.scale[i] * qsum as f32;
        a.qsum[i] = qsum;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn quantize_avx512(x: &[f32], a: &mut QActs) {
    quantize_generic(x, a)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quantize_avx2(x: &[f32], a: &mut QActs) {
    quantize_generic(x, a)
}
