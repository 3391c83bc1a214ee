//! Q6K matrices: the repacking against the GGUF bytes and an f64 dequantizer written from
//! llama.cpp's loops (`tests.rs`), every path's matmul against an f64 dequantize-then-matmul
//! within the activation rounding bound, rows independent of the batch and of the threads, and
//! stacking with other kinds.

use super::ggml::{self, f16_to_f32};
use super::q6k::{RAW_BYTES, SUPER};
use super::tests::{assert_within_bound, isas, matmul_on, reference_block, reference_matmul};
use super::{DequantOut, Isa, MatmulOpts, QKind, QMatrix, BLOCK};
use crate::test_rng::Rng;

const EPS: f64 = f32::EPSILON as f64;

/// Random Q6_K super-blocks for `n` weights, `d` a random f16 of magnitude 2^-12 .. 2^-9 (weights
/// up to ~0.5: 128 · 32 · d).
pub(super) fn random_raw(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut raw = Vec::new();
    for _ in 0..n / SUPER {
        let mut blk: Vec<u8> = (0..RAW_BYTES).map(|_| rng.below(256) as u8).collect();
        let d = ((rng.below(2) as u16) << 15)
            | ((3 + rng.below(3) as u16) << 10)
            | rng.below(1024) as u16;
        blk[208..].copy_from_slice(&d.to_le_bytes());
        if rng.chance(10) {
            blk[192 + rng.index(16)] = 0x80; // the extreme sub-scale, -128
        }
        raw.extend(blk);
    }
    raw
}

fn reference_weights(raw: &[u8]) -> Vec<f64> {
    raw.chunks_exact(RAW_BYTES)
        .flat_map(|b| reference_block(ggml::Q6_K, b))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn q6k_keeps_the_gguf_blocks_at_their_size() {
    let mut rng = Rng(41);
    for (rows, cols) in [(1, 256), (16, 512), (37, 768), (50, 256)] {
        let raw = random_raw(&mut rng, rows * cols);
        let m = QMatrix::from_ggml(&raw, ggml::Q6_K, rows, cols).unwrap();
        assert_eq!(m.kind(), QKind::Q6K);
        assert!(
            m.q6k_raw() == raw,
            "[{rows}, {cols}]: the blocks come back byte for byte"
        );
        // 210 bytes per 256 weights (6.5625 bits), rows padded to 16, rounded up to a line.
        let padded = rows.div_ceil(16) * 16;
        assert_eq!(
            m.nbytes(),
            (padded * cols / SUPER * RAW_BYTES).div_ceil(64) * 64
        );
        // Dequantized: one f32 rounding of the exact weight ((d · sc) is exact).
        let want = reference_weights(&raw);
        let got = m.dequantize();
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= EPS / 2.0 * w.abs(),
                "[{rows}, {cols}] #{i}: {g} vs {w}"
            );
        }
        for threads in [2, 5] {
            let mut f = vec![0.0f32; rows * cols];
            m.dequantize_into(DequantOut::F32(&mut f), threads).unwrap();
            assert_eq!(bits(&f), bits(&got));
            let mut h = vec![0u16; rows * cols];
            m.dequantize_into(DequantOut::Bf16(&mut h), threads)
                .unwrap();
            for (&b, &v) in h.iter().zip(&got) {
                assert_eq!(b, <u16 as super::dequant::Elem>::from_f32(v));
            }
        }
        let ids: Vec<i64> = (0..3).map(|_| rng.index(rows) as i64).collect();
        let mut out = vec![0.0; ids.len() * cols];
        m.gather_rows(&ids, &mut out).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let row = &got[id as usize * cols..][..cols];
            assert_eq!(bits(&out[i * cols..][..cols]), bits(row), "row {id}");
        }
    }
    assert!(QMatrix::from_ggml(&[0u8; 210], ggml::Q6_K, 1, 128).is_err());
    let q = vec![0u8; 32];
    assert!(QMatrix::from_parts(&q, 1, 32, &[1.0], &[0.0], QKind::Q6K).is_err());
}

/// f64 `x @ W^T` over the Q6_K weights and the bound on |kernel - exact| (`reference_matmul`:
/// the kernel sums each weight whole, so its magnitude is `|w|`).
fn reference(w: &[f64], n: usize, k: usize, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let wmag: Vec<f64> = w.iter().map(|v| v.abs()).collect();
    reference_matmul(w, &wmag, n, k, x, m)
}

#[test]
fn q6k_matmul_matches_the_dequantized_weights_within_the_activation_bound() {
    let mut rng = Rng(43);
    println!("paths tested: {:?}", isas());
    for case in 0..24 {
        let m = [1, 2, 3, 5, 8, 13, 40][rng.index(7)];
        let k = SUPER * (1 + rng.index(3));
        let mut n = 1 + rng.index(70);
        if n.is_multiple_of(16) {
            n += 1 + rng.index(15);
        }
        let raw = random_raw(&mut rng, n * k);
        let w = QMatrix::from_ggml(&raw, ggml::Q6_K, n, k).unwrap();
        let x: Vec<f32> = rng.floats(m * k).iter().map(|v| v * 4.0).collect();
        let (bias, prior) = (rng.floats(n), rng.floats(m * n));
        let (want, bound) = reference(&reference_weights(&raw), n, k, &x, m);
        let (accumulate, use_bias) = (case % 3 == 1, case % 4 == 2);
        let mut simd: Option<Vec<u32>> = None;
        for isa in isas() {
            let mut first: Option<Vec<u32>> = None;
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
                    format!("{isa:?} case {case} m={m} k={k} n={n} threads={threads}")
                });
                match &first {
                    Some(f) => {
                        assert!(f == &bits(&out), "{isa:?} case {case}: threads change bits")
                    }
                    None => first = Some(bits(&out)),
                }
            }
            // The AVX2 and AVX-512 bodies sum the same exact integers: the same bits.
            if isa != Isa::Scalar {
                match &simd {
                    Some(s) => assert!(s == first.as_ref().unwrap(), "{isa:?} case {case}"),
                    None => simd = first,
                }
            }
        }
    }
}

/// Every `q` at 63 and every activation at ±127 (as quantized) puts the largest sums through
/// the AVX2 body's i16 lanes, which add two chunks' `vpmaddubsw` pairs before the sub-scales
/// (|Σ| = 4 · 63 · 127 = 32004 < 2^15): a wrapped lane would be off by 65536 · sc · d.
#[test]
fn q6k_extreme_quants_and_activations_stay_within_the_bound() {
    let (n, k, m) = (17, 2 * SUPER, 2);
    let mut raw = Vec::new();
    for s in 0..n * k / SUPER {
        let mut blk = vec![0xFFu8; RAW_BYTES]; // q = 15 | 3 << 4 = 63 everywhere
        for (i, sc) in blk[192..208].iter_mut().enumerate() {
            *sc = if (i + s) % 3 == 0 { 0x80 } else { 127 }; // -128 and 127
        }
        blk[208..].copy_from_slice(&0x1400u16.to_le_bytes()); // d = 2^-10
        raw.extend(blk);
    }
    let w = QMatrix::from_ggml(&raw, ggml::Q6_K, n, k).unwrap();
    // Row 0 all +1, row 1 all -1: every activation quantizes to +127 or -127.
    let x: Vec<f32> = (0..m * k).map(|i| if i < k { 1.0 } else { -1.0 }).collect();
    let (want, bound) = reference(&reference_weights(&raw), n, k, &x, m);
    for isa in isas() {
        let out = matmul_on(&w, &x, m, n, isa);
        assert_within_bound(&out, &want, &bound, None, None, &|| format!("{isa:?}"));
    }
}

#[test]
fn q6k_rows_do_not_depend_on_the_rows_beside_them() {
    let mut rng = Rng(47);
    let (n, k) = (41, 512);
    let w = QMatrix::from_ggml(&random_raw(&mut rng, n * k), ggml::Q6_K, n, k).unwrap();
    let x: Vec<f32> = rng.floats(17 * k).iter().map(|v| v * 3.0).collect();
    for isa in isas() {
        let alone: Vec<Vec<u32>> = (0..17)
            .map(|i| bits(&matmul_on(&w, &x[i * k..][..k], 1, n, isa)))
            .collect();
        for m in [2, 3, 4, 5, 7, 8, 9, 17] {
            for threads in [1, 2, 4] {
                let mut out = vec![0.0; m * n];
                let opts = MatmulOpts {
                    isa: Some(isa),
                    threads,
                    ..Default::default()
                };
                w.matmul(&x[..m * k], m, &mut out, &opts).unwrap();
                for (i, want) in alone.iter().take(m).enumerate() {
                    let got = bits(&out[i * n..][..n]);
                    assert!(&got == want, "{isa:?} m={m} threads={threads} row {i}");
                }
            }
        }
    }
}

#[test]
fn q6k_bound_is_tight_enough_to_see_a_wrong_sub_scale_or_offset() {
    let mut rng = Rng(53);
    let (m, n, k) = (2, 17, 256);
    let raw = random_raw(&mut rng, n * k);
    let x: Vec<f32> = rng.floats(m * k).iter().map(|v| v.abs() + 0.5).collect();
    let (want, bound) = reference(&reference_weights(&raw), n, k, &x, m);
    let wrong = |edit: &dyn Fn(&mut [u8])| {
        let mut bad = raw.clone();
        edit(&mut bad[..RAW_BYTES]); // row 0's super-block
        let w = QMatrix::from_ggml(&bad, ggml::Q6_K, n, k).unwrap();
        isas().into_iter().all(|isa| {
            let out = matmul_on(&w, &x, m, n, isa);
            (0..m).any(|i| (out[i * n] as f64 - want[i * n]).abs() > bound[i * n])
        })
    };
    // The largest sub-scale negated (the weights of 16 columns), and the high bits of 128
    // weights cleared (q 16, 32 or 48 lower, as a mishandled offset would shift them).
    let sc = |b: &[u8], i: usize| (b[192 + i] as i8 as i32).abs();
    let big = (0..16).max_by_key(|&i| sc(&raw, i)).unwrap();
    assert!(wrong(
        &|b| b[192 + big] = (b[192 + big] as i8).saturating_neg() as u8
    ));
    assert!(wrong(&|b| b[128..160].fill(0)));
}

#[test]
fn q6k_parts_stack_as_q6k_and_re_round_beside_other_kinds() {
    let mut rng = Rng(59);
    let k = 512;
    let (ra, rb) = (random_raw(&mut rng, 20 * k), random_raw(&mut rng, 7 * k));
    let a = QMatrix::from_ggml(&ra, ggml::Q6_K, 20, k).unwrap();
    let b = QMatrix::from_ggml(&rb, ggml::Q6_K, 7, k).unwrap();
    let both = QMatrix::concat(&[&a, &b]).unwrap();
    assert_eq!((both.kind(), both.rows()), (QKind::Q6K, 27));
    assert!(both.q6k_raw() == [ra.clone(), rb].concat());
    let w: Vec<f32> = rng.floats(5 * k);
    let q4 = QMatrix::quantize(&w, 5, k, 4, 32).unwrap();
    let mixed = QMatrix::concat(&[&q4, &a]).unwrap();
    assert_eq!((mixed.kind(), mixed.rows()), (QKind::Q8, 25));
    let deq = mixed.dequantize();
    assert_eq!(&deq[..5 * k], &q4.dequantize()[..]);
    // The Q6K rows re-rounded: within 1/8 of each 32-block's coarser Q6_K step.
    let want = reference_weights(&ra);
    for row in 0..20 {
        for blk in 0..k / BLOCK {
            let sb = &ra[(row * k + blk * BLOCK) / SUPER * RAW_BYTES..][..RAW_BYTES];
            let sub = (blk * BLOCK % SUPER) / 16;
            let d = f16_to_f32(u16::from_le_bytes([sb[208], sb[209]])) as f64;
            let sc = |i: usize| (sb[192 + i] as i8 as f64).abs();
            let step = d.abs() * sc(sub).max(sc(sub + 1));
            for c in 0..BLOCK {
                let (i, j) = ((5 + row) * k + blk * BLOCK + c, row * k + blk * BLOCK + c);
                let err = (deq[i] as f64 - want[j]).abs();
                let tol = step / 8.0 * (1.0 + 1e-5) + 4.0 * EPS * (want[j].abs() + step * 256.0);
                assert!(
                    err <= tol,
                    "row {row} block {blk} col {c}: {} vs {}",
                    deq[i],
                    want[j]
                );
            }
        }
    }
}

#[test]
fn q6k_non_finite_activations_give_nan_rows() {
    let mut rng = Rng(61);
    let (m, n, k) = (3, 18, 256);
    let w = QMatrix::from_ggml(&random_raw(&mut rng, n * k), ggml::Q6_K, n, k).unwrap();
    let mut x = rng.floats(m * k);
    x[k + 7] = f32::NAN;
    for isa in isas() {
        let out = matmul_on(&w, &x, m, n, isa);
        for i in 0..m {
            let row = &out[i * n..(i + 1) * n];
            assert!(
                row.iter().all(|v| v.is_nan() == (i == 1)),
                "{isa:?} row {i}: {row:?}"
            );
        }
    }
}
