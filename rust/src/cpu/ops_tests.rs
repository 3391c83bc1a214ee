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

fn gelu_case<T: Elem>(rng: &mut Rng, rows: usize, inter: usize, threads: usize) {
    let gu: Vec<T> = rng
        .floats(rows * 2 * inter)
        .iter()
        .map(|&v| T::store(12.0 * v))
        .collect();
    let mut out = vec![T::store(f32::NAN); rows * inter];
    gelu_tanh_and_mul(&gu, &mut out, inter, threads).unwrap();
    let g = widen(&gu);
    let mut want = Vec::new();
    for r in g.chunks(2 * inter) {
        for j in 0..inter {
            // torch's gelu(approximate="tanh"), in f64
            let (a, b) = (r[j] as f64, r[inter + j] as f64);
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (a + 0.044715 * a * a * a);
            want.push(0.5 * a * (1.0 + inner.tanh()) * b);
        }
    }
    let err = worst(&widen(&out), &want);
    assert!(err < tolerance::<T>(), "rows={rows} inter={inter}: {err}");
}

#[test]
fn gelu_tanh_and_mul_matches_reference() {
    let mut rng = Rng(29);
    for (rows, inter, threads) in [(1, 2048, 1), (4, 5, 2), (100, 2048, 2)] {
        gelu_case::<f32>(&mut rng, rows, inter, threads);
        gelu_case::<Bf16>(&mut rng, rows, inter, threads);
        gelu_case::<F16>(&mut rng, rows, inter, threads);
    }
    // Far in both tails: ~0 (e^88 bounds the divisor) and the identity, never NaN.
    let mut out = [f32::NAN; 2];
    gelu_tanh_and_mul(&[-200.0f32, 200.0, 1.0, 1.0], &mut out, 2, 1).unwrap();
    assert!(out[0].abs() < 1e-30 && out[1] == 200.0, "{out:?}");
    let err = gelu_tanh_and_mul(&[0.0f32; 6], &mut out, 2, 1).unwrap_err();
    assert!(err.to_string().starts_with("gate_up"), "{err}");
}

fn qk_norm_case<T: Elem>(rng: &mut Rng, per_head: bool) {
    let (rows, hq, hkv, d, extra) = (3, 4, 2, 16, 5);
    let (qw, kw) = (hq * d, hkv * d);
    let stride = qw + kw + extra; // the v part (and beyond) is left alone
    let x0 = cast::<T>(&rng.floats(rows * stride));
    let (gq, gk) = if per_head { (d, d) } else { (qw, kw) };
    let q_w = cast::<T>(&rng.floats(gq));
    let k_w = cast::<T>(&rng.floats(gk));
    let mut x = x0.clone();
    let shape = QkShape {
        rows,
        stride,
        q_width: qw,
        k_width: kw,
    };
    qk_norm(&mut x, shape, &q_w, &k_w, 1e-6).unwrap();
    // Each group equals `rms_norm` of it as a row: the same bits, not only close.
    for r in 0..rows {
        let row = &x0[r * stride..(r + 1) * stride];
        let mut want = row.to_vec();
        rms_norm(&row[..qw], Some(&q_w), 1e-6, &mut want[..qw], gq, 1).unwrap();
        rms_norm(
            &row[qw..qw + kw],
            Some(&k_w),
            1e-6,
            &mut want[qw..qw + kw],
            gk,
            1,
        )
        .unwrap();
        let got = &x[r * stride..(r + 1) * stride];
        assert_eq!(widen(got), widen(&want), "row {r} per_head={per_head}");
    }
}

#[test]
fn qk_norm_is_rms_norm_per_group_in_place() {
    let mut rng = Rng(31);
    for per_head in [true, false] {
        qk_norm_case::<f32>(&mut rng, per_head);
        qk_norm_case::<Bf16>(&mut rng, per_head);
        qk_norm_case::<F16>(&mut rng, per_head);
    }
    let shape = QkShape {
        rows: 1,
        stride: 8,
        q_width: 6,
        k_width: 2,
    };
    let err = qk_norm(&mut [0.0f32; 8], shape, &[1.0; 4], &[1.0; 2], 1e-6).unwrap_err();
    assert!(err.to_string().starts_with("q_weight"), "{err}");
    let short = QkShape { rows: 2, ..shape };
    let err = qk_norm(&mut [0.0f32; 12], short, &[1.0; 6], &[1.0; 2], 1e-6).unwrap_err();
    assert!(err.to_string().starts_with("x"), "{err}");
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

/// `residual_add` against the ops it fuses run one by one (`rms_norm`, then the scale and the add,
/// each rounded to `T`): the same bits; and the f32 case against an f64 reference.
fn residual_add_case<T: Elem>(rng: &mut Rng, rows: usize, dim: usize, threads: usize) {
    let x = cast::<T>(&rng.floats(rows * dim));
    let h0 = cast::<T>(&rng.floats(rows * dim));
    let w = cast::<T>(&rng.floats(dim));
    for (normed, weighted, scale) in [
        (true, true, None),
        (true, false, Some(0.22f32)),
        (true, true, Some(1.7)),
        (false, false, Some(0.22)),
        (false, false, None),
    ] {
        let norm = normed.then_some(BranchNorm {
            weight: weighted.then_some(&w[..]),
            eps: 1e-6,
        });
        let mut h = h0.clone();
        residual_add(&x, norm, scale, &mut h, dim, threads).unwrap();
        let mut branch = x.clone();
        if let Some(n) = norm {
            rms_norm(&x, n.weight, n.eps, &mut branch, dim, 1).unwrap();
        }
        if let Some(s) = scale {
            branch.iter_mut().for_each(|b| *b = T::store(b.load() * s));
        }
        let want: Vec<T> = h0
            .iter()
            .zip(&branch)
            .map(|(a, b)| T::store(a.load() + b.load()))
            .collect();
        assert_eq!(
            widen(&h),
            widen(&want),
            "rows={rows} dim={dim} normed={normed} scale={scale:?}"
        );
        if std::mem::size_of::<T>() == 4 {
            let (xf, hf, wf) = (widen(&x), widen(&h0), widen(&w));
            let mut reference = Vec::new();
            for (xr, hr) in xf.chunks(dim).zip(hf.chunks(dim)) {
                let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
                let inv = if normed {
                    1.0 / (ms + 1e-6).sqrt()
                } else {
                    1.0
                };
                for (i, (&v, &a)) in xr.iter().zip(hr).enumerate() {
                    let wi = if weighted { wf[i] as f64 } else { 1.0 };
                    let s = scale.map_or(1.0, |s| s as f64);
                    reference.push(a as f64 + v as f64 * inv * wi * s);
                }
            }
            let err = worst(&widen(&h), &reference);
            assert!(err < 1e-5, "rows={rows} dim={dim}: {err}");
        }
    }
}

#[test]
fn residual_add_is_the_norm_scale_and_add_op_by_op() {
    let mut rng = Rng(11);
    for (rows, dim, threads) in [(1, 640, 1), (3, 7, 2), (130, 1000, 3)] {
        residual_add_case::<f32>(&mut rng, rows, dim, threads);
        residual_add_case::<Bf16>(&mut rng, rows, dim, threads);
        residual_add_case::<F16>(&mut rng, rows, dim, threads);
    }
}

#[test]
fn residual_add_rejects_mismatched_lengths() {
    let (x, w) = (vec![1.0f32; 8], vec![1.0f32; 3]);
    let mut h = vec![0.0f32; 6];
    assert!(residual_add(&x, None, None, &mut h, 4, 1).is_err());
    let mut h = vec![0.0f32; 8];
    assert!(residual_add(&x, None, None, &mut h, 3, 1).is_err());
    let norm = Some(BranchNorm {
        weight: Some(&w[..]),
        eps: 1e-6,
    });
    assert!(residual_add(&x, norm, None, &mut h, 4, 1).is_err());
}
