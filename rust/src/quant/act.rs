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

/// Rows per part below which one thread quantizes everything (a fork costs a few µs).
const MIN_PART: usize = 1 << 15;

pub(crate) fn quantize(x: &[f32], m: usize, k: usize, threads: usize) -> QActs {
    let nb = k / BLOCK;
    let mut a = QActs {
        k,
        q: vec![0; m * k],
        scale: vec![0.0; m * nb],
        sum: vec![0.0; m * nb],
        qsum: vec![0; m * nb],
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
    crate::parallel::run_parts(parts, &|p| {
        let mut run = runs[p].lock().unwrap_or_else(|e| e.into_inner());
        quantize_rows(&mut run);
    });
    drop(runs);
    a
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
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
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
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn quantize_avx512(r: &mut Rows) {
    quantize_generic(r)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quantize_avx2(r: &mut Rows) {
    quantize_generic(r)
}
