use super::*;

use crate::cpu::elem::{Bf16, F16};
use crate::test_rng::Rng;

fn cast<T: Elem>(xs: &[f32]) -> Vec<T> {
    xs.iter().map(|&x| T::store(x)).collect()
}

fn widen<T: Elem>(xs: &[T]) -> Vec<f32> {
    xs.iter().map(|x| x.load()).collect()
}

/// Max |got - want| over max(1, |want|): relative for large values, absolute near zero.
fn worst(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs() / w.abs().max(1.0))
        .fold(0.0, f64::max)
}

/// Storage rounding bounds the error: f32 ~1e-6, bf16 ~2^-8, f16 ~2^-11 (relative).
fn tolerance<T: Elem>() -> f64 {
    match std::mem::size_of::<T>() {
        4 => 2e-6,
        _ if T::store(1.0 + 1.0 / 512.0).load() == 1.0 => 8e-3,
        _ => 1e-3,
    }
}

fn rms_norm_case<T: Elem>(rng: &mut Rng, rows: usize, dim: usize, threads: usize, weighted: bool) {
    let x = cast::<T>(&rng.floats(rows * dim));
    let w = cast::<T>(&rng.floats(dim));
    let mut out = vec![T::store(f32::NAN); x.len()];
    let weight = weighted.then_some(&w[..]);
    rms_norm(&x, weight, 1e-5, &mut out, dim, threads).unwrap();
    let (xf, wf) = (widen(&x), widen(&w));
    let mut want = Vec::new();
    for r in xf.chunks(dim) {
        let ms = r.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let scale = 1.0 / (ms + 1e-5).sqrt();
        for (i, &v) in r.iter().enumerate() {
            want.push(v as f64 * scale * if weighted { wf[i] as f64 } else { 1.0 });
        }
    }
    let err = worst(&widen(&out), &want);
    assert!(
        err < tolerance::<T>(),
        "rows={rows} dim={dim} threads={threads}: {err}"
    );
}

#[test]
fn rms_norm_matches_reference() {
    let mut rng = Rng(5);
    for (rows, dim, threads) in [(1, 576, 1), (3, 7, 2), (200, 576, 2), (130, 1000, 3)] {
        rms_norm_case::<f32>(&mut rng, rows, dim, threads, true);
        rms_norm_case::<f32>(&mut rng, rows, dim, threads, false);
        rms_norm_case::<Bf16>(&mut rng, rows, dim, threads, true);
        rms_norm_case::<F16>(&mut rng, rows, dim, threads, true);
    }
}

fn rope_case<T: Elem>(
    rng: &mut Rng,
    rows: usize,
    heads: usize,
    extra: usize,
    d: usize,
    threads: usize,
) {
    let stride = heads * d + extra;
    let len = if rows == 0 {
        0
    } else {
        (rows - 1) * stride + heads * d
    };
    let before = cast::<T>(&rng.floats(len));
    let table = cast::<T>(&rng.floats(50 * d));
    let positions: Vec<i64> = (0..rows).map(|_| rng.index(50) as i64).collect();
    let mut x = before.clone();
    let shape = RopeShape {
        rows,
        stride,
        heads,
        head_dim: d,
    };
    rope(&mut x, shape, &positions, &table, threads).unwrap();
    let (bf, tf) = (widen(&before), widen(&table));
    let mut want: Vec<f64> = bf.iter().map(|&v| v as f64).collect();
    let half = d / 2;
    for (r, &p) in positions.iter().enumerate() {
        let cs = &tf[p as usize * d..][..d];
        for h in 0..heads {
            let at = r * stride + h * d;
            for j in 0..half {
                let (a, b) = (bf[at + j] as f64, bf[at + half + j] as f64);
                let (c, s) = (cs[j] as f64, cs[half + j] as f64);
                want[at + j] = a * c - b * s;
                want[at + half + j] = b * c + a * s;
            }
        }
    }
    let err = worst(&widen(&x), &want);
    assert!(
        err < 2.0 * tolerance::<T>(),
        "rows={rows} heads={heads}: {err}"
    );
}

#[test]
fn rope_rotates_in_place_and_leaves_the_rest() {
    let mut rng = Rng(9);
    // (rows, rotated heads, trailing v elements per row, head_dim, threads)
    for (rows, heads, extra, d, threads) in [
        (1, 12, 192, 64, 1),
        (5, 3, 0, 8, 2),
        (300, 12, 192, 64, 2),
        (0, 2, 4, 4, 1),
    ] {
        rope_case::<f32>(&mut rng, rows, heads, extra, d, threads);
        rope_case::<Bf16>(&mut rng, rows, heads, extra, d, threads);
        rope_case::<F16>(&mut rng, rows, heads, extra, d, threads);
    }
    let mut x = vec![0.0f32; 8];
    let shape = RopeShape {
        rows: 1,
        stride: 8,
        heads: 2,
        head_dim: 4,
    };
    let err = rope(&mut x, shape, &[4], &[0.0; 16], 1).unwrap_err();
    assert!(err.to_string().starts_with("positions"), "{err}");
    let err = rope(&mut x, RopeShape { heads: 3, ..shape }, &[0], &[0.0; 16], 1).unwrap_err();
    assert!(err.to_string().starts_with("x"), "{err}");
}

fn silu_case<T: Elem>(rng: &mut Rng, rows: usize, inter: usize, threads: usize) {
    let gu: Vec<T> = rng
        .floats(rows * 2 * inter)
        .iter()
        .map(|&v| T::store(8.0 * v))
        .collect();
    let mut out = vec![T::store(f32::NAN); rows * inter];
    silu_and_mul(&gu, &mut out, inter, threads).unwrap();
    let g = widen(&gu);
    let mut want = Vec::new();
    for r in g.chunks(2 * inter) {
        for j in 0..inter {
            let (a, b) = (r[j] as f64, r[inter + j] as f64);
            want.push(a / (1.0 + (-a).exp()) * b);
        }
    }
    let err = worst(&widen(&out), &want);
    assert!(err < tolerance::<T>(), "rows={rows} inter={inter}: {err}");
}

#[test]
fn silu_and_mul_matches_reference() {
    let mut rng = Rng(13);
    for (rows, inter, threads) in [(1, 1536, 1), (4, 5, 2), (100, 1536, 2)] {
        silu_case::<f32>(&mut rng, rows, inter, threads);
        silu_case::<Bf16>(&mut rng, rows, inter, threads);
        silu_case::<F16>(&mut rng, rows, inter, threads);
    }
    let mut out = [0.0f32; 2];
    let err = silu_and_mul(&[0.0f32; 6], &mut out, 2, 1).unwrap_err();
    assert!(err.to_string().starts_with("gate_up"), "{err}");
}

#[test]
fn exp_is_close_to_libm_on_both_sides() {
    let mut worst = 0.0f32;
    for i in 0..=200_000 {
        let x = -87.0 + 175.0 * i as f32 / 200_000.0;
        let (got, want) = (exp(x), x.exp());
        worst = worst.max((got - want).abs() / want);
    }
    assert!(worst < 4e-7, "max relative error {worst}");
    assert_eq!(exp(0.0), 1.0);
    assert!(exp(1000.0).is_finite() && exp(-1000.0) > 0.0);
}
