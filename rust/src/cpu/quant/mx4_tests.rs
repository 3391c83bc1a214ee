//! MXFP4 blocks ([`QKind::Mx4`]) against an f64 dequantizer written here from the OCP / ggml
//! definition (E2M1 decoded from its bit fields, `2^(e - 127)` in f64), and every SIMD path
//! this CPU has against the f64 matmul over those weights, within the activation rounding bound.

use super::ggml::MXFP4;
use super::tests::{isas, reference_matmul};
use super::{Isa, MatmulOpts, QKind, QMatrix, BLOCK};
use crate::test_rng::Rng;

const EPS: f64 = f32::EPSILON as f64;

/// Random MXFP4 bytes for `[rows, cols]` (exponents from `e`, any codes) and their matrix.
pub(super) fn random_mx4(
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    e: std::ops::Range<u8>,
) -> (Vec<u8>, QMatrix) {
    let mut raw = Vec::with_capacity(rows * cols / BLOCK * 17);
    for _ in 0..rows * cols / BLOCK {
        raw.push(e.start + rng.index((e.end - e.start) as usize) as u8);
        raw.extend((0..16).map(|_| rng.below(256) as u8));
    }
    let m = QMatrix::from_ggml(&raw, MXFP4, rows, cols).unwrap();
    (raw, m)
}

/// An E2M1 code's value from its fields: sign, 2 exponent bits (bias 1), 1 mantissa bit.
fn e2m1(code: u8) -> f64 {
    let (exp, man) = ((code >> 1) & 3, (code & 1) as f64);
    let mag = if exp == 0 {
        man / 2.0
    } else {
        (1.0 + man / 2.0) * 2f64.powi(exp as i32 - 1)
    };
    if code >> 3 == 1 {
        -mag
    } else {
        mag
    }
}

/// The weights of raw MXFP4 blocks, in f64.
fn reference_weights(raw: &[u8]) -> Vec<f64> {
    let mut w = Vec::new();
    for b in raw.chunks_exact(17) {
        let scale = 2f64.powi(b[0] as i32 - 127);
        let mut v = [0.0; BLOCK];
        for (j, &byte) in b[1..].iter().enumerate() {
            v[j] = e2m1(byte & 15) * scale;
            v[j + 16] = e2m1(byte >> 4) * scale;
        }
        w.extend(v);
    }
    w
}

/// f64 `x @ W^T` for raw MXFP4 blocks `[n, k]`, and the bound on |kernel - exact|: the
/// activations' rounding `|x - xs q| <= amax / 254` per element times `|w|` (the integer
/// products are exact: `u = 2 e2m1 + 12` and `q` are integers, and `s = 2^(e - 128)` times `xs`
/// is exact), plus the f32 rounding of the two FMAs a block and of the accumulation, over terms
/// of size `(s u + 12 s) (|x| + amax / 254) <= (|w| + 24 s) (...)`.
fn reference(raw: &[u8], n: usize, k: usize, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let (nb, w) = (k / BLOCK, reference_weights(raw));
    let wmag: Vec<f64> = (0..n * k)
        .map(|i| w[i].abs() + 24.0 * 2f64.powi(raw[(i / k * nb + i % k / BLOCK) * 17] as i32 - 128))
        .collect();
    reference_matmul(&w, &wmag, n, k, x, m)
}

#[test]
fn from_ggml_keeps_mxfp4_exactly_at_4_25_bits() {
    let mut rng = Rng(41);
    for (n, k) in [(16, 32), (35, 96), (48, 2880 / 10 * 2)] {
        // exponents over the whole range that cannot overflow 24 · 2^(e - 128)
        let (raw, w) = random_mx4(&mut rng, n, k, 0..251);
        assert_eq!(w.kind(), QKind::Mx4);
        let want = reference_weights(&raw);
        let got = w.dequantize();
        for (i, (&g, &r)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g as f64, r, "[{n}, {k}] element {i}");
        }
        // 16 rows · 32 codes (256 B) + 16 E8M0 bytes per block, padding rows included
        let blocks = n.div_ceil(16) * k / BLOCK;
        assert_eq!(w.nbytes(), (blocks * 272).div_ceil(64) * 64);
        if n * k >= 16 * 512 {
            // (the data is a whole number of 64-byte lines: 4.26 bits at [48, 576])
            let bits = w.nbytes() as f64 * 8.0 / (n * k) as f64;
            assert!((4.25..4.26).contains(&bits), "{bits} bits a weight");
        }
    }
    // The extremes: 2^-128 and 2^-127 are f32 subnormals, e = 250 the largest non-overflowing.
    for e in [0u8, 1, 2, 127, 128, 250] {
        let mut raw = vec![e];
        raw.extend((0..16).map(|i| (i as u8) | ((15 - i as u8) << 4)));
        let w = QMatrix::from_ggml(&raw, MXFP4, 1, 32).unwrap();
        let got: Vec<f64> = w.dequantize().iter().map(|&v| v as f64).collect();
        assert_eq!(got, reference_weights(&raw), "e = {e}");
    }
    assert!(QMatrix::from_ggml(&[0; 16], MXFP4, 1, 32).is_err());
}

#[test]
fn mxfp4_matmul_matches_f64_within_the_activation_quantization_bound() {
    let mut rng = Rng(43);
    let isas = isas();
    println!("paths tested: {isas:?}");
    for case in 0..24 {
        let m = [1, 2, 3, 5, 8, 9, 17][case % 7];
        let k = BLOCK * (1 + rng.index(20));
        let n = 1 + rng.index(70);
        // gpt-oss-like exponents (weights ~2^-8 .. 1), or a wide range whose sums stay finite
        let e = if case % 3 == 0 { 0..200 } else { 118..129 };
        let (raw, w) = random_mx4(&mut rng, n, k, e);
        let x: Vec<f32> = rng.floats(m * k).iter().map(|v| v * 4.0).collect();
        let (want, bound) = reference(&raw, n, k, &x, m);
        let mut first: Option<Vec<u32>> = None;
        for &isa in &isas {
            for threads in [1, 3] {
                let mut out = vec![f32::NAN; m * n];
                let opts = MatmulOpts {
                    threads,
                    isa: Some(isa),
                    ..Default::default()
                };
                w.matmul(&x, m, &mut out, &opts).unwrap();
                for i in 0..m * n {
                    let err = (out[i] as f64 - want[i]).abs();
                    let tol = bound[i] + 2.0 * EPS * want[i].abs() + f32::MIN_POSITIVE as f64;
                    assert!(
                        err <= tol,
                        "{isa:?} case {case} m={m} k={k} n={n} [{}, {}]: {} vs {} (bound {tol})",
                        i / n,
                        i % n,
                        out[i],
                        want[i]
                    );
                }
                // SIMD paths: the same integer sums and FMAs, so the same bits
                let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                match &first {
                    _ if isa == Isa::Scalar => {}
                    Some(f) => assert_eq!(f, &bits, "{isa:?} case {case} vs the first SIMD path"),
                    None => first = Some(bits),
                }
            }
        }
    }
}

#[test]
fn mxfp4_bound_is_tight_enough_to_see_a_wrong_exponent() {
    // One block's exponent off by one must break the bound: the test above can fail.
    let mut rng = Rng(47);
    let (m, n, k) = (2, 17, 64);
    let (mut raw, _) = random_mx4(&mut rng, n, k, 120..126);
    let x: Vec<f32> = rng.floats(m * k);
    let (want, bound) = reference(&raw, n, k, &x, m);
    raw[0] += 1;
    let bad = QMatrix::from_ggml(&raw, MXFP4, n, k).unwrap();
    let mut out = vec![0.0; m * n];
    bad.matmul(&x, m, &mut out, &MatmulOpts::default()).unwrap();
    assert!((0..m).any(|i| (out[i * n] as f64 - want[i * n]).abs() > bound[i * n]));
}

#[test]
fn mxfp4_concat_stays_mxfp4_and_widens_beside_other_kinds() {
    let mut rng = Rng(53);
    let (_, a) = random_mx4(&mut rng, 21, 64, 110..130);
    let (_, b) = random_mx4(&mut rng, 16, 64, 110..130);
    let ab = QMatrix::concat(&[&a, &b]).unwrap();
    assert_eq!(ab.kind(), QKind::Mx4);
    let stacked: Vec<f32> = a.dequantize().into_iter().chain(b.dequantize()).collect();
    assert_eq!(ab.dequantize(), stacked);
    let q4 = QMatrix::quantize(&rng.floats(5 * 64), 5, 64, 4, 32).unwrap();
    let mixed = QMatrix::concat(&[&a, &q4]).unwrap();
    assert_eq!(mixed.kind(), QKind::Q8);
    let stacked: Vec<f32> = a.dequantize().into_iter().chain(q4.dequantize()).collect();
    assert_eq!(mixed.dequantize(), stacked);
    // Beside a Q6K part too: the MXFP4 rows stay exact, the Q6K ones re-round as beside Q4.
    let (_, c) = random_mx4(&mut rng, 3, 256, 110..130);
    let raw = super::q6k_tests::random_raw(&mut rng, 4 * 256);
    let q6 = QMatrix::from_ggml(&raw, super::ggml::Q6_K, 4, 256).unwrap();
    let mixed = QMatrix::concat(&[&c, &q6]).unwrap();
    assert_eq!((mixed.kind(), mixed.rows()), (QKind::Q8, 7));
    let q4 = QMatrix::quantize(&rng.floats(2 * 256), 2, 256, 4, 32).unwrap();
    let beside_q4 = QMatrix::concat(&[&q4, &q6]).unwrap().dequantize();
    let deq = mixed.dequantize();
    assert_eq!(&deq[..3 * 256], &c.dequantize()[..]);
    assert_eq!(&deq[3 * 256..], &beside_q4[2 * 256..]);
    // and from_parts refuses the kind (its quants are table values, not free integers)
    let e = QMatrix::from_parts(&[12; 32], 1, 32, &[1.0], &[-12.0], QKind::Mx4).err();
    assert!(e.unwrap().to_string().contains("kind"));
}

#[test]
fn mxfp4_gather_rows_is_the_dequantized_rows() {
    let mut rng = Rng(59);
    let (_, w) = random_mx4(&mut rng, 19, 96, 115..130);
    let all = w.dequantize();
    let ids = [18i64, 0, 7, 7];
    let mut out = vec![0.0; ids.len() * 96];
    w.gather_rows(&ids, &mut out).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(out[i * 96..][..96], all[id as usize * 96..][..96]);
    }
}
