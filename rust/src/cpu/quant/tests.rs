//! Each GGUF format against an f64 dequantizer written here from the ggml byte layouts; the
//! f32 quantizers against their rounding bounds; every SIMD path this CPU has against an f64
//! matmul, within the analytic bound of the activation quantization.

use super::ggml::{self, f16_to_f32};
use super::{Isa, MatmulOpts, QKind, QMatrix, BLOCK};
use crate::test_rng::Rng;

const EPS: f64 = f32::EPSILON as f64;

/// IEEE half from its bits, by the definition (not the shift-based conversion under test).
fn half(bits: u16) -> f64 {
    let sign = if bits >> 15 == 1 { -1.0 } else { 1.0 };
    let (e, m) = (((bits >> 10) & 31) as i32, (bits & 1023) as f64);
    if e == 0 {
        sign * m / 1024.0 * 2f64.powi(-14)
    } else {
        sign * (1.0 + m / 1024.0) * 2f64.powi(e - 15)
    }
}

/// A random finite half, magnitudes 2^-10 .. 2^2 (like real block scales).
fn rand_half(rng: &mut Rng) -> [u8; 2] {
    let bits =
        ((rng.below(2) as u16) << 15) | ((5 + rng.below(12) as u16) << 10) | rng.below(1024) as u16;
    bits.to_le_bytes()
}

fn h(b: &[u8], o: usize) -> f64 {
    half(u16::from_le_bytes([b[o], b[o + 1]]))
}

/// Random raw blocks of `ty` for `n` weights, with valid half scales.
fn raw_blocks(rng: &mut Rng, ty: u32, n: usize) -> Vec<u8> {
    let (per, bytes) = ggml::block_size(ty).unwrap();
    let mut raw = Vec::new();
    for _ in 0..n / per {
        let mut blk: Vec<u8> = (0..bytes).map(|_| rng.below(256) as u8).collect();
        let halves: &[usize] = match ty {
            ggml::Q4_0 | ggml::Q8_0 => &[0],
            ggml::Q4_1 | ggml::Q4_K | ggml::Q5_K => &[0, 2],
            _ => &[208],
        };
        for &o in halves {
            blk[o..o + 2].copy_from_slice(&rand_half(rng));
        }
        if ty == ggml::Q6_K && rng.chance(30) {
            // Equal sub-scale pairs: the exact Q6_K case.
            for p in 0..8 {
                blk[193 + 2 * p] = blk[192 + 2 * p];
            }
        }
        raw.extend(blk);
    }
    raw
}

/// f64 reference: one super-block of `ty` → its weights, following llama.cpp's loops.
pub(super) fn reference_block(ty: u32, b: &[u8]) -> Vec<f64> {
    let mut y = Vec::new();
    match ty {
        ggml::Q4_0 | ggml::Q4_1 => {
            let d = h(b, 0);
            let (m, qs) = if ty == ggml::Q4_0 {
                (None, &b[2..])
            } else {
                (Some(h(b, 2)), &b[4..])
            };
            let mut v = vec![0.0; 32];
            for j in 0..16 {
                let (x0, x1) = ((qs[j] & 15) as f64, (qs[j] >> 4) as f64);
                match m {
                    None => (v[j], v[j + 16]) = ((x0 - 8.0) * d, (x1 - 8.0) * d),
                    Some(m) => (v[j], v[j + 16]) = (x0 * d + m, x1 * d + m),
                }
            }
            y = v;
        }
        ggml::Q8_0 => y.extend(b[2..34].iter().map(|&q| q as i8 as f64 * h(b, 0))),
        ggml::Q4_K | ggml::Q5_K => {
            let (d, dmin, sc) = (h(b, 0), h(b, 2), &b[4..16]);
            let six = |j: usize| -> (f64, f64) {
                if j < 4 {
                    ((sc[j] & 63) as f64, (sc[j + 4] & 63) as f64)
                } else {
                    let s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
                    let m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
                    (s as f64, m as f64)
                }
            };
            let (qh, ql) = if ty == ggml::Q4_K {
                (&b[0..0], &b[16..144])
            } else {
                (&b[16..48], &b[48..176])
            };
            let (mut u1, mut u2) = (1u8, 2u8);
            for j in 0..4 {
                let ((s1, m1), (s2, m2)) = (six(2 * j), six(2 * j + 1));
                let q = &ql[32 * j..32 * j + 32];
                let hb = |l: usize, u: u8| {
                    if !qh.is_empty() && qh[l] & u != 0 {
                        16.0
                    } else {
                        0.0
                    }
                };
                y.extend((0..32).map(|l| d * s1 * ((q[l] & 15) as f64 + hb(l, u1)) - dmin * m1));
                y.extend((0..32).map(|l| d * s2 * ((q[l] >> 4) as f64 + hb(l, u2)) - dmin * m2));
                (u1, u2) = (u1 << 2, u2 << 2);
            }
        }
        ggml::Q6_K => {
            let d = h(b, 208);
            y = vec![0.0; 256];
            for n in 0..2 {
                let (ql, qh, sc) = (&b[64 * n..], &b[128 + 32 * n..], &b[192 + 8 * n..]);
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as f64 - 32.0;
                    let q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as f64 - 32.0;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as f64 - 32.0;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as f64 - 32.0;
                    let s = |i: usize| d * sc[i] as i8 as f64;
                    y[128 * n + l] = s(is) * q1;
                    y[128 * n + l + 32] = s(is + 2) * q2;
                    y[128 * n + l + 64] = s(is + 4) * q3;
                    y[128 * n + l + 96] = s(is + 6) * q4;
                }
            }
        }
        _ => unreachable!(),
    }
    y
}

#[test]
fn f16_conversion_matches_the_definition() {
    for bits in 0..=u16::MAX {
        if (bits >> 10) & 31 == 31 {
            continue;
        }
        assert_eq!(f16_to_f32(bits) as f64, half(bits), "bits {bits:#06x}");
    }
}

#[test]
fn known_bytes_give_known_values() {
    // Q4_0, d = 0.5: byte 0x1F holds q[0] = 15 and q[16] = 1, i.e. (15-8)/2 and (1-8)/2.
    let mut b = vec![0x00, 0x38];
    b.extend([0x1F; 16]);
    let w = QMatrix::from_ggml(&b, ggml::Q4_0, 1, 32)
        .unwrap()
        .dequantize();
    assert_eq!((w[0], w[15], w[16], w[31]), (3.5, 3.5, -3.5, -3.5));
    // Q8_0, d = 0.25, q = -3 and 127.
    let mut b = vec![0x00, 0x34, (-3i8) as u8, 127];
    b.extend([0; 30]);
    let w = QMatrix::from_ggml(&b, ggml::Q8_0, 1, 32)
        .unwrap()
        .dequantize();
    assert_eq!((w[0], w[1], w[2]), (-0.75, 31.75, 0.0));
    // Q4_K, d = 1, dmin = 0.5, sub-block 0: scale 2, min 3, q[0] = 5: 1*2*5 - 0.5*3 = 8.5.
    let mut b = vec![0u8; 144];
    b[..4].copy_from_slice(&[0x00, 0x3C, 0x00, 0x38]);
    (b[4], b[8], b[16]) = (2, 3, 5);
    let w = QMatrix::from_ggml(&b, ggml::Q4_K, 1, 256)
        .unwrap()
        .dequantize();
    assert_eq!((w[0], w[1], w[32]), (8.5, -1.5, 0.0));
}

#[test]
fn ggml_formats_match_the_f64_reference() {
    let mut rng = Rng(7);
    for ty in [
        ggml::Q4_0,
        ggml::Q4_1,
        ggml::Q8_0,
        ggml::Q4_K,
        ggml::Q5_K,
        ggml::Q6_K,
    ] {
        let (per, bytes) = ggml::block_size(ty).unwrap();
        let (rows, cols) = (37, 2 * per.max(64));
        let raw = raw_blocks(&mut rng, ty, rows * cols);
        let m = QMatrix::from_ggml(&raw, ty, rows, cols).unwrap();
        let kind = match ty {
            ggml::Q4_0 | ggml::Q4_1 | ggml::Q4_K => QKind::Q4,
            ggml::Q6_K => QKind::Q6K,
            _ => QKind::Q8,
        };
        assert_eq!(m.kind(), kind);
        let want: Vec<f64> = raw
            .chunks_exact(bytes)
            .flat_map(|b| reference_block(ty, b))
            .collect();
        let got = m.dequantize();
        let (mut worst, mut exact) = (0.0f64, 0usize);
        for row in 0..rows {
            for b in 0..cols / BLOCK {
                let (s, mn, q) = m.block(row, b);
                let at = row * cols + b * BLOCK;
                // Q6K's `block` is its Q8 re-rounding (what it becomes beside other kinds); its
                // own dequantization is exact (q6k_tests.rs).
                let q8: Vec<f32> = (0..BLOCK).map(|c| s * q[c] as f32 + mn).collect();
                let g = if ty == ggml::Q6_K {
                    &q8[..]
                } else {
                    &got[at..at + BLOCK]
                };
                let w = &want[at..at + BLOCK];
                // f32 evaluation of `s q + m`: two roundings.
                let ulp =
                    |c: usize| 2.0 * EPS * ((s as f64 * q[c] as f64).abs() + (mn as f64).abs());
                if ty != ggml::Q6_K {
                    for c in 0..BLOCK {
                        assert!(
                            (g[c] as f64 - w[c]).abs() <= ulp(c),
                            "type {ty} row {row} block {b} col {c}: {} vs {}",
                            g[c],
                            w[c]
                        );
                    }
                    continue;
                }
                // Q6_K: within 1/8 of the block's coarser Q6_K step (see ggml.rs), on top of f32 rounding.
                let sb = &raw[(row * cols + b * BLOCK) / 256 * bytes..][..bytes];
                let sub = (b * BLOCK % 256) / 16;
                let d = h(sb, 208);
                let step = d.abs()
                    * (sb[192 + sub] as i8 as f64)
                        .abs()
                        .max((sb[193 + sub] as i8 as f64).abs());
                let err = (0..BLOCK)
                    .map(|c| (g[c] as f64 - w[c]).abs() - ulp(c))
                    .fold(0.0, f64::max);
                assert!(
                    err <= step / 8.0 * (1.0 + 1e-5),
                    "Q6_K row {row} block {b}: error {err} > step {step} / 8"
                );
                if err <= 0.0 {
                    exact += 1;
                } else {
                    worst = worst.max(err / step);
                }
            }
        }
        if ty == ggml::Q6_K {
            println!(
                "Q6_K: {exact} of {} blocks exact, worst error {worst:.4} of the coarser Q6_K step",
                rows * cols / BLOCK
            );
            assert!(exact > 0 && worst > 0.0);
        }
    }
}

#[test]
fn ggml_rejects_bad_input() {
    let raw = vec![0u8; 18];
    assert!(QMatrix::from_ggml(&raw, 99, 1, 32).is_err());
    assert!(QMatrix::from_ggml(&raw, ggml::Q4_0, 1, 64).is_err());
    assert!(QMatrix::from_ggml(&raw, ggml::Q4_0, 1, 16).is_err());
    assert!(QMatrix::from_ggml(&[0u8; 144], ggml::Q4_K, 1, 32).is_err());
    assert!(QMatrix::from_ggml(&[0u8; 144], ggml::Q4_K, 1, 256).is_ok());
    assert!(QMatrix::from_ggml(&raw, ggml::Q4_0, 1, 32).is_ok());
}

#[test]
fn f32_quantization_error_is_within_half_a_step() {
    let mut rng = Rng(3);
    for (bits, group) in [
        (8, 0),
        (8, 32),
        (8, 64),
        (8, 128),
        (4, 32),
        (4, 64),
        (4, 128),
        (4, 0),
    ] {
        let (rows, cols) = (19, 256);
        let w: Vec<f32> = rng.floats(rows * cols).iter().map(|v| v * 3.0).collect();
        let m = QMatrix::quantize(&w, rows, cols, bits, group).unwrap();
        let deq = m.dequantize();
        let g = if group == 0 { cols } else { group };
        for (gi, (ws, ds)) in w.chunks(g).zip(deq.chunks(g)).enumerate() {
            let lo = ws.iter().fold(f32::INFINITY, |a, &v| a.min(v)) as f64;
            let hi = ws.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64;
            let step = if bits == 8 {
                lo.abs().max(hi.abs()) / 127.0
            } else {
                (hi - lo) / 15.0
            };
            for (&a, &d) in ws.iter().zip(ds) {
                let tol = step * (0.5 + 1e-5) + 4.0 * EPS * (a.abs() as f64 + step * 255.0);
                assert!(
                    (a as f64 - d as f64).abs() <= tol,
                    "bits {bits} group {g} #{gi}: {a} vs {d}"
                );
            }
        }
    }
    let w = vec![0.5f32; 64];
    assert!(QMatrix::quantize(&w, 2, 32, 5, 0).is_err());
    assert!(QMatrix::quantize(&w, 2, 32, 8, 48).is_err());
    assert!(QMatrix::quantize(&w, 1, 64, 4, 128).is_err());
    assert!(QMatrix::quantize(&w, 3, 32, 4, 0).is_err());
    assert!(QMatrix::quantize(&[f32::NAN; 32], 1, 32, 8, 0).is_err());
    // Constant groups are exact, including all zeros.
    let z = QMatrix::quantize(&[0.0; 64], 2, 32, 4, 0).unwrap();
    assert!(z.dequantize().iter().all(|&v| v == 0.0));
}

/// The ISAs this CPU runs, scalar included: every test runs each of them.
pub(super) fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.available()).collect()
}

/// `w`'s matmul of `m` rows of `x` on path `isa`, default options otherwise.
pub(super) fn matmul_on(w: &QMatrix, x: &[f32], m: usize, n: usize, isa: Isa) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    let opts = MatmulOpts {
        isa: Some(isa),
        ..Default::default()
    };
    w.matmul(x, m, &mut out, &opts).unwrap();
    out
}

/// f64 `x @ W^T` and the analytic bound on |kernel - exact|: activation rounding
/// `|x - xs q| <= xs / 2` times `Σ |w|` per block, plus f32 rounding of the accumulation.
fn reference(w: &QMatrix, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (w.rows(), w.cols());
    let (mut wf, mut wmag) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
    for row in 0..n {
        for b in 0..k / BLOCK {
            let (s, mn, q) = w.block(row, b);
            let (s, mn) = (s as f64, mn as f64);
            for &qc in &q[..BLOCK] {
                wf.push(s * qc as f64 + mn);
                wmag.push((s * qc as f64).abs() + mn.abs());
            }
        }
    }
    reference_matmul(&wf, &wmag, n, k, x, m)
}

/// f64 `x @ W^T` over exact weights `w` (`[n, k]`) and the bound on |kernel - exact| that every
/// kind's tests share: the activations' rounding, `amax / 127 · (0.5 + 1e-4)` per element times
/// `|w|`, plus the f32 rounding of each block's FMAs and of the accumulation over terms of size
/// `wmag · (|x| + amax / 254)`, `wmag` the magnitude of the parts the kernel sums for a weight.
pub(super) fn reference_matmul(
    w: &[f64],
    wmag: &[f64],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
) -> (Vec<f64>, Vec<f64>) {
    let nb = k / BLOCK;
    let (mut out, mut bound) = (vec![0.0; m * n], vec![0.0; m * n]);
    for i in 0..m {
        for row in 0..n {
            let (mut acc, mut quant, mut mag) = (0.0f64, 0.0f64, 0.0f64);
            for b in 0..nb {
                let xb = &x[i * k + b * BLOCK..][..BLOCK];
                let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                for c in 0..BLOCK {
                    let (wc, wm) = (w[row * k + b * BLOCK + c], wmag[row * k + b * BLOCK + c]);
                    acc += wc * xb[c] as f64;
                    mag += wm * (xb[c].abs() as f64 + amax / 254.0);
                    quant += wc.abs() * amax / 127.0 * (0.5 + 1e-4);
                }
            }
            out[i * n + row] = acc;
            bound[i * n + row] = quant + (2 * nb + 40) as f64 * EPS * mag;
        }
    }
    (out, bound)
}

/// Asserts each `out[i]` (row-major, as many columns as the bias has) lies
/// within `bound[i]`, plus f32 rounding of the sum, of `want[i]` with the bias and, when
/// accumulating, the prior output added; `what` names the case in the failure.
pub(super) fn assert_within_bound(
    out: &[f32],
    want: &[f64],
    bound: &[f64],
    bias: Option<&[f32]>,
    prior: Option<&[f32]>,
    what: &dyn Fn() -> String,
) {
    for i in 0..want.len() {
        let mut exact = want[i];
        if let Some(b) = bias {
            exact += b[i % b.len()] as f64;
        }
        if let Some(p) = prior {
            exact += p[i] as f64;
        }
        let tol = bound[i] + 2.0 * EPS * (exact.abs() + 1.0);
        let err = (out[i] as f64 - exact).abs();
        assert!(
            err <= tol,
            "{} [{i}]: {} vs {exact} (bound {tol})",
            what(),
            out[i]
        );
    }
}

fn random_matrix(rng: &mut Rng, kind: QKind, n: usize, k: usize) -> QMatrix {
    let w: Vec<f32> = rng.floats(n * k);
    let m = match kind {
        QKind::Q8 => QMatrix::quantize(&w, n, k, 8, 32),
        QKind::Q4 => QMatrix::quantize(&w, n, k, 4, 32),
        QKind::Q6K | QKind::Mx4 => {
            unreachable!("Q6K and MXFP4 cases are in q6k_tests.rs, mx4_tests.rs")
        }
    };
    m.unwrap()
}

#[test]
fn matmul_matches_f64_within_the_activation_quantization_bound() {
    let mut rng = Rng(11);
    let isas = isas();
    println!("paths tested: {isas:?}");
    for case in 0..48 {
        let kind = if case % 2 == 0 { QKind::Q8 } else { QKind::Q4 };
        let m = 1 + rng.index(70);
        let k = BLOCK * (1 + rng.index(24));
        let mut n = 1 + rng.index(90);
        if n.is_multiple_of(16) {
            n += 1 + rng.index(15);
        }
        // Every fourth case from GGUF blocks, whose f16 scales are stored as f16.
        let w = if case % 4 == 3 {
            let ty = match (kind, case % 8) {
                (QKind::Q8, _) => ggml::Q8_0,
                (QKind::Q4, 7) => ggml::Q4_0,
                (QKind::Q4, _) => ggml::Q4_1,
                (QKind::Q6K | QKind::Mx4, _) => unreachable!("case kinds are Q8 and Q4"),
            };
            let w = QMatrix::from_ggml(&raw_blocks(&mut rng, ty, n * k), ty, n, k).unwrap();
            assert!(w.half_scales());
            assert_eq!(w.implied_mins(), ty != ggml::Q4_1);
            w
        } else {
            random_matrix(&mut rng, kind, n, k)
        };
        let x: Vec<f32> = rng.floats(m * k).iter().map(|v| v * 4.0).collect();
        let bias = rng.floats(n);
        let prior = rng.floats(m * n);
        let (want, bound) = reference(&w, &x, m);
        let (accumulate, use_bias) = (case % 3 == 1, case % 4 == 2);
        let mut first: Option<Vec<f32>> = None;
        for &isa in &isas {
            for threads in [1, 3] {
                let mut out = prior.clone();
                let opts = MatmulOpts {
                    accumulate,
                    bias: use_bias.then_some(&bias[..]),
                    threads,
                    isa: Some(isa),
                };
                w.matmul(&x, m, &mut out, &opts).unwrap();
                let (b, p) = (
                    use_bias.then_some(&bias[..]),
                    accumulate.then_some(&prior[..]),
                );
                assert_within_bound(&out, &want, &bound, b, p, &|| {
                    format!("{isa:?} {kind:?} m={m} k={k} n={n} threads={threads}")
                });
                // Threads split whole row groups, so the result never depends on them.
                match &first {
                    Some(f) if threads > 1 => assert_eq!(f, &out, "{isa:?} threads"),
                    _ => first = Some(out),
                }
            }
            first = None;
        }
    }
}

/// Blocks whose mins are implied (`-offset * scale`, not stored) give the bits the same blocks
/// give with their mins stored, on every path, tile height and tail.
#[test]
fn implied_mins_are_the_stored_ones_bit_for_bit() {
    let mut rng = Rng(37);
    let isas = isas();
    let cases = [
        (ggml::Q4_0, 37, 96),
        (ggml::Q8_0, 21, 64),
        (ggml::Q4_0, 16, 32),
        (ggml::Q8_0, 5, 160),
    ];
    for (ty, n, k) in cases {
        let sym = QMatrix::from_ggml(&raw_blocks(&mut rng, ty, n * k), ty, n, k).unwrap();
        assert!(sym.implied_mins() && sym.half_scales());
        let full = QMatrix::pack_as(n, k, sym.kind(), &sym.unpack_all(), false);
        assert!(!full.implied_mins() && full.half_scales());
        assert!(sym.nbytes() <= full.nbytes());
        let wide = QMatrix::pack_as(n, k, QKind::Q8, &sym.unpack_all(), true);
        assert_eq!(
            wide.implied_mins(),
            ty == ggml::Q8_0,
            "Q4 mins are not Q8's offset"
        );
        assert_eq!(sym.dequantize(), full.dequantize());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for m in [1, 2, 3, 4, 5, 8, 9] {
            let x: Vec<f32> = rng.floats(m * k).iter().map(|v| v * 3.0).collect();
            let mut first: Option<Vec<u32>> = None;
            for &isa in &isas {
                let opts = MatmulOpts {
                    isa: Some(isa),
                    threads: 2,
                    ..Default::default()
                };
                let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
                sym.matmul(&x, m, &mut a, &opts).unwrap();
                full.matmul(&x, m, &mut b, &opts).unwrap();
                assert_eq!(bits(&a), bits(&b), "type {ty} {isa:?} m={m}");
                // and the SIMD paths agree (same integer sums, same FMAs; the scalar one rounds
                // its products separately)
                match &first {
                    _ if isa == Isa::Scalar => {}
                    Some(f) => assert_eq!(f, &bits(&a), "type {ty} {isa:?} m={m} vs the first"),
                    None => first = Some(bits(&a)),
                }
            }
        }
    }
}

#[test]
fn matmul_bound_is_tight_enough_to_see_a_wrong_block() {
    // Negating one block of weights must break the bound: the test above can fail.
    let mut rng = Rng(5);
    let (m, n, k) = (3, 17, 64);
    let w = random_matrix(&mut rng, QKind::Q8, n, k);
    let x: Vec<f32> = rng.floats(m * k);
    let (want, bound) = reference(&w, &x, m);
    let mut d = w.dequantize();
    d[..BLOCK].iter_mut().for_each(|v| *v = -*v);
    let bad = QMatrix::quantize(&d, n, k, 8, 32).unwrap();
    let mut out = vec![0.0; m * n];
    bad.matmul(&x, m, &mut out, &MatmulOpts::default()).unwrap();
    assert!((0..m).any(|i| (out[i * n] as f64 - want[i * n]).abs() > bound[i * n]));
}

#[test]
fn matmul_rejects_bad_shapes() {
    let w = QMatrix::quantize(&[0.25; 64], 2, 32, 8, 0).unwrap();
    let mut out = vec![0.0; 2];
    let o = MatmulOpts::default();
    assert!(w.matmul(&[0.0; 31], 1, &mut out, &o).is_err());
    assert!(w.matmul(&[0.0; 32], 1, &mut out[..1], &o).is_err());
    let bias = [0.0; 3];
    assert!(w
        .matmul(
            &[0.0; 32],
            1,
            &mut out,
            &MatmulOpts {
                bias: Some(&bias),
                ..o
            }
        )
        .is_err());
    w.matmul(&[1.0; 32], 1, &mut out, &o).unwrap();
    assert!((out[0] - 8.0).abs() < 0.01, "{out:?}");
}

#[test]
fn gather_rows_is_the_embedding_lookup() {
    let mut rng = Rng(9);
    let w = random_matrix(&mut rng, QKind::Q4, 40, 64);
    let full = w.dequantize();
    let ids = [3i64, 39, 0, 3];
    let mut out = vec![0.0; ids.len() * 64];
    w.gather_rows(&ids, &mut out).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(&out[i * 64..][..64], &full[id as usize * 64..][..64]);
    }
    assert!(w.gather_rows(&[40], &mut out[..64]).is_err());
    assert!(w.gather_rows(&[-1], &mut out[..64]).is_err());
    assert!(w.gather_rows(&[1], &mut out).is_err());
}

#[test]
fn large_batches_quantize_activations_in_parallel_with_the_same_result() {
    // 300 × 512 activations: big enough for several quantization parts.
    let mut rng = Rng(13);
    let (m, n, k) = (300, 33, 512);
    let w = random_matrix(&mut rng, QKind::Q4, n, k);
    let x: Vec<f32> = rng.floats(m * k);
    let (want, bound) = reference(&w, &x, m);
    let mut outs = Vec::new();
    for threads in [1, 4] {
        let mut out = vec![0.0; m * n];
        w.matmul(
            &x,
            m,
            &mut out,
            &MatmulOpts {
                threads,
                ..Default::default()
            },
        )
        .unwrap();
        for i in 0..m * n {
            assert!(
                (out[i] as f64 - want[i]).abs() <= bound[i] + 2.0 * EPS * (want[i].abs() + 1.0)
            );
        }
        outs.push(out);
    }
    assert_eq!(outs[0], outs[1]);
}

#[test]
fn dequantize_into_f32_and_bf16_over_threads() {
    use super::DequantOut;
    let mut rng = Rng(21);
    for kind in [QKind::Q8, QKind::Q4] {
        let (n, k) = (53, 96);
        let w = random_matrix(&mut rng, kind, n, k);
        // Reference: scale * q + min from the block accessors.
        let mut want = vec![0.0f32; n * k];
        for row in 0..n {
            for b in 0..k / BLOCK {
                let (s, m, q) = w.block(row, b);
                for c in 0..BLOCK {
                    want[row * k + b * BLOCK + c] = s * q[c] as f32 + m;
                }
            }
        }
        for threads in [1, 2, 5] {
            let mut f = vec![0.0f32; n * k];
            w.dequantize_into(DequantOut::F32(&mut f), threads).unwrap();
            assert_eq!(f, want, "{kind:?} threads {threads}");
            let mut h = vec![0u16; n * k];
            w.dequantize_into(DequantOut::Bf16(&mut h), threads)
                .unwrap();
            for (&b, &v) in h.iter().zip(&want) {
                let back = f32::from_bits((b as u32) << 16);
                // Nearest bf16: within half a bf16 ulp (2^-8 relative).
                assert!((back - v).abs() <= v.abs() * 2f32.powi(-8), "{v} -> {back}");
            }
        }
        assert!(w
            .dequantize_into(DequantOut::F32(&mut [0.0; 3]), 1)
            .is_err());
    }
    // Ties go to even: 1 + 2^-8 (bf16 halfway between 1 and 1 + 2^-7) rounds down to 1.
    assert_eq!(
        <u16 as super::dequant::Elem>::from_f32(1.0 + 2f32.powi(-8)),
        0x3F80
    );
    assert_eq!(
        <u16 as super::dequant::Elem>::from_f32(1.0 + 3.0 * 2f32.powi(-8)),
        0x3F82
    );
}

#[test]
fn concat_stacks_rows_and_widens_q4_losslessly() {
    let mut rng = Rng(23);
    let a = random_matrix(&mut rng, QKind::Q4, 20, 64);
    let b = random_matrix(&mut rng, QKind::Q8, 7, 64);
    let c = random_matrix(&mut rng, QKind::Q4, 16, 64);
    let q4 = QMatrix::concat(&[&a, &c]).unwrap();
    assert_eq!((q4.kind(), q4.rows(), q4.cols()), (QKind::Q4, 36, 64));
    assert_eq!(q4.dequantize(), [a.dequantize(), c.dequantize()].concat());
    let mixed = QMatrix::concat(&[&a, &b, &c]).unwrap();
    assert_eq!((mixed.kind(), mixed.rows()), (QKind::Q8, 43));
    let want = [a.dequantize(), b.dequantize(), c.dequantize()].concat();
    assert_eq!(mixed.dequantize(), want);
    // The stacked matmul is the parts' matmuls side by side (same activation quantization).
    let x = rng.floats(3 * 64);
    let mut whole = vec![0.0; 3 * 43];
    mixed
        .matmul(&x, 3, &mut whole, &MatmulOpts::default())
        .unwrap();
    let mut pa = vec![0.0; 3 * 20];
    a.matmul(&x, 3, &mut pa, &MatmulOpts::default()).unwrap();
    for i in 0..3 {
        for j in 0..20 {
            let (u, v) = (whole[i * 43 + j], pa[i * 20 + j]);
            assert!((u - v).abs() <= 1e-5 * (1.0 + v.abs()), "{u} vs {v}");
        }
    }
    let other = random_matrix(&mut rng, QKind::Q4, 4, 32);
    assert!(QMatrix::concat(&[&a, &other]).is_err());
    assert!(QMatrix::concat(&[]).is_err());
}

#[test]
fn scales_are_stored_as_f16_exactly_when_they_all_are_f16s() {
    for bits in 0..=u16::MAX {
        if (bits >> 10) & 31 != 31 {
            assert_eq!(
                super::exact_f16(f16_to_f32(bits)),
                Some(bits),
                "{bits:#06x}"
            );
        }
    }
    for v in [
        1.0 + 2f32.powi(-11),
        65520.0,
        2f32.powi(-25),
        1e-30,
        f32::NAN,
    ] {
        assert_eq!(super::exact_f16(v), None, "{v}");
    }
    let mut rng = Rng(29);
    for (ty, half) in [
        (ggml::Q4_0, true),
        (ggml::Q4_1, true),
        (ggml::Q8_0, true),
        (ggml::Q4_K, false),
    ] {
        let m = QMatrix::from_ggml(&raw_blocks(&mut rng, ty, 16 * 256), ty, 16, 256).unwrap();
        assert_eq!(m.half_scales(), half, "type {ty}");
        let sym = ty == ggml::Q4_0 || ty == ggml::Q8_0;
        assert_eq!(m.implied_mins(), sym, "type {ty}");
        // Bits a weight, times 2: the quants, the scales, the mins unless implied.
        let scales = if half { 16 } else { 32 } * if sym { 1 } else { 2 };
        let quants = if m.kind() == QKind::Q4 { 8 } else { 16 };
        assert_eq!(
            m.nbytes() * 16 / (16 * 256),
            quants + scales / 16,
            "type {ty}"
        );
    }
}

#[test]
fn non_finite_activations_give_nan_rows_on_every_path() {
    let mut rng = Rng(31);
    let (m, n, k) = (4, 21, 96);
    let w = random_matrix(&mut rng, QKind::Q8, n, k);
    let mut x = rng.floats(m * k);
    x[k + 40] = f32::NAN;
    x[2 * k + 3] = f32::INFINITY;
    for isa in isas() {
        let out = matmul_on(&w, &x, m, n, isa);
        for i in 0..m {
            let row = &out[i * n..(i + 1) * n];
            if i == 1 || i == 2 {
                assert!(row.iter().all(|v| v.is_nan()), "{isa:?} row {i}: {row:?}");
            } else {
                assert!(row.iter().all(|v| v.is_finite()), "{isa:?} row {i}");
            }
        }
    }
}

/// A random `[n, k]` matrix of each x86-tiled kind: Q8, Q4 and Q6K (`k` a multiple of 256).
fn every_kind(rng: &mut Rng, n: usize, k: usize) -> [QMatrix; 3] {
    let raw_q6 = super::q6k_tests::random_raw(rng, n * k);
    [
        random_matrix(rng, QKind::Q8, n, k),
        random_matrix(rng, QKind::Q4, n, k),
        QMatrix::from_ggml(&raw_q6, ggml::Q6_K, n, k).unwrap(),
    ]
}

#[test]
fn the_weight_prefetch_does_not_change_a_bit() {
    // Only the memory traffic may differ: every kind, every path, near and far tiles (below
    // and from 3 rows), with the prefetch off and at two distances.
    let mut rng = Rng(29);
    let k = 256;
    let mats = every_kind(&mut rng, 48, k);
    let saved = super::prefetch_distances();
    for w in &mats {
        for isa in isas() {
            for m in [1, 3, 6, 11] {
                let x = rng.floats(m * k);
                let mut runs = Vec::new();
                for dist in [0, 64, 4096] {
                    super::set_prefetch_distances(dist, dist);
                    let mut out = vec![0.0f32; m * 48];
                    let opts = MatmulOpts {
                        threads: 2,
                        isa: Some(isa),
                        ..MatmulOpts::default()
                    };
                    w.matmul(&x, m, &mut out, &opts).unwrap();
                    runs.push(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                }
                assert!(runs.windows(2).all(|p| p[0] == p[1]), "{isa:?} m={m}");
            }
        }
    }
    super::set_prefetch_distances(saved.0, saved.1);
}

#[test]
fn rows_past_a_slab_get_the_bits_of_the_row_alone() {
    // A call of more rows than one slab (`SLAB_ROWS`) runs the groups once per slab: each row's
    // result is still its own tile sums, the same bits as that row multiplied alone.
    let mut rng = Rng(43);
    let k = 256;
    let mats = every_kind(&mut rng, 32, k);
    let m = 2 * super::kernel::SLAB_ROWS + 77;
    let x = rng.floats(m * k);
    for w in &mats {
        for isa in isas() {
            let opts = MatmulOpts {
                threads: 2,
                isa: Some(isa),
                ..MatmulOpts::default()
            };
            let mut all = vec![0.0f32; m * 32];
            w.matmul(&x, m, &mut all, &opts).unwrap();
            for i in [0, 511, 512, 513, 1023, 1024, m - 1] {
                let mut one = vec![0.0f32; 32];
                w.matmul(&x[i * k..(i + 1) * k], 1, &mut one, &opts)
                    .unwrap();
                let got = &all[i * 32..(i + 1) * 32];
                assert!(
                    got.iter()
                        .zip(&one)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{:?} {isa:?} row {i}",
                    w.kind()
                );
            }
        }
    }
}
