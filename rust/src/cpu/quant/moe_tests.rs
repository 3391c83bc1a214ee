//! `Experts::run` against the per-expert composition of `QMatrix::matmul` calls (bit for bit:
//! same tiles, same rows, same order), and against an f64 MLP over the dequantized weights
//! (within the activation rounding), over random shapes, routings, formats, activations, biases,
//! thread counts, SIMD paths and expert-parallel ranges.

use super::tests::isas;
use super::{Experts, Isa, MatmulOpts, MoeAct, QMatrix, Routing};
use crate::cpu::ops::{self, GatedAct};
use crate::test_rng::Rng;

struct Case {
    gate_up: Vec<QMatrix>,
    down: Vec<QMatrix>,
    gub: Option<Vec<f32>>,
    db: Option<Vec<f32>>,
    act: MoeAct,
    first: usize,
    num_experts: usize,
    h: usize,
    inter: usize,
}

impl Case {
    /// `bits` 4 or 8: load-time quantized; 6: GGUF Q6_K blocks (Q6K, 256 columns).
    fn random(rng: &mut Rng, local: usize, first: usize, num_experts: usize, bits: u32) -> Case {
        let (h, inter) = if bits == 6 {
            (256, 256)
        } else {
            (32 * (1 + rng.index(3)), 32 * (1 + rng.index(4)))
        };
        let group = if bits == 4 || rng.chance(50) { 32 } else { 0 };
        // bits 39: MXFP4 blocks (ggml type 39), weights up to 12 · 2^-5
        let mat = |rng: &mut Rng, rows: usize, cols: usize| {
            if bits == 39 {
                return super::mx4_tests::random_mx4(rng, rows, cols, 118..124).1;
            }
            if bits == 6 {
                let raw = super::q6k_tests::random_raw(rng, rows * cols);
                return QMatrix::from_ggml(&raw, super::ggml::Q6_K, rows, cols).unwrap();
            }
            let w: Vec<f32> = rng.floats(rows * cols).iter().map(|v| v * 0.3).collect();
            QMatrix::quantize(&w, rows, cols, bits, group).unwrap()
        };
        let gate_up = (0..local).map(|_| mat(rng, 2 * inter, h)).collect();
        let down = (0..local).map(|_| mat(rng, h, inter)).collect();
        let bias = |rng: &mut Rng, n: usize| rng.chance(50).then(|| rng.floats(n));
        let act = match rng.index(3) {
            0 => MoeAct::Gated(GatedAct::Silu),
            1 => MoeAct::Gated(GatedAct::GeluTanh),
            _ => MoeAct::ClampedSwiglu {
                alpha: 1.702,
                limit: 0.5,
            },
        };
        Case {
            gate_up,
            down,
            gub: bias(rng, local * 2 * inter),
            db: bias(rng, local * h),
            act,
            first,
            num_experts,
            h,
            inter,
        }
    }

    fn experts(&self) -> Experts<'_> {
        Experts::new(
            self.gate_up.iter().collect(),
            self.down.iter().collect(),
            self.gub.as_deref(),
            self.db.as_deref(),
            self.act,
            self.first,
            self.num_experts,
        )
        .unwrap()
    }

    fn local(&self, id: i64) -> Option<usize> {
        let l = (id as usize).wrapping_sub(self.first);
        (l < self.gate_up.len()).then_some(l)
    }

    /// The per-expert loop: pairs stably sorted by expert, each expert's rows through two
    /// matmuls and the activation, the weighted rows added in pair order.
    fn composed(&self, x: &[f32], r: &Routing, out: &mut [f32], threads: usize, isa: Isa) {
        let (h, inter, k) = (self.h, self.inter, r.top_k);
        let mut pairs: Vec<usize> = (0..r.ids.len())
            .filter(|&p| self.local(r.ids[p]).is_some())
            .collect();
        pairs.sort_by_key(|&p| r.ids[p]);
        let mut ys = Vec::new();
        for l in 0..self.gate_up.len() {
            let rows: Vec<usize> = pairs
                .iter()
                .copied()
                .filter(|&p| self.local(r.ids[p]) == Some(l))
                .collect();
            let n = rows.len();
            if n == 0 {
                continue;
            }
            let xs: Vec<f32> = rows
                .iter()
                .flat_map(|&p| x[p / k * h..][..h].iter().copied())
                .collect();
            let opts = |bias| MatmulOpts {
                accumulate: false,
                bias,
                threads,
                isa: Some(isa),
            };
            let mut gu = vec![0.0; n * 2 * inter];
            let gub = self.gub.as_ref().map(|b| &b[l * 2 * inter..][..2 * inter]);
            self.gate_up[l].matmul(&xs, n, &mut gu, &opts(gub)).unwrap();
            let mut a = vec![0.0; n * inter];
            match self.act {
                MoeAct::Gated(g) => ops::act_and_mul::<f32>(&gu, &mut a, inter, 1, g).unwrap(),
                MoeAct::ClampedSwiglu { alpha, limit } => {
                    for (i, a) in a.iter_mut().enumerate() {
                        let (row, c) = (i / inter, i % inter);
                        let g = gu[row * 2 * inter + c].min(limit);
                        let u = gu[row * 2 * inter + inter + c].max(-limit).min(limit);
                        let sig = 1.0 / (1.0 + (-(g * alpha)).exp());
                        *a = (u + 1.0) * (g * sig);
                    }
                }
            }
            let mut y = vec![0.0; n * h];
            let db = self.db.as_ref().map(|b| &b[l * h..][..h]);
            self.down[l].matmul(&a, n, &mut y, &opts(db)).unwrap();
            ys.extend(y);
        }
        for (j, &p) in pairs.iter().enumerate() {
            let w = r.weights[p];
            for c in 0..h {
                out[p / k * h + c] += ys[j * h + c] * w;
            }
        }
    }

    /// The MoE in f64 over the dequantized weights, unquantized activations.
    fn exact(&self, x: &[f32], r: &Routing) -> Vec<f64> {
        let (h, inter, k) = (self.h, self.inter, r.top_k);
        let mut out = vec![0.0f64; x.len()];
        let mv = |w: &[f32], rows: usize, cols: usize, v: &[f64], b: Option<&[f32]>| {
            (0..rows)
                .map(|i| {
                    let dot: f64 = (0..cols).map(|c| w[i * cols + c] as f64 * v[c]).sum();
                    dot + b.map_or(0.0, |b| b[i] as f64)
                })
                .collect::<Vec<f64>>()
        };
        for (p, &id) in r.ids.iter().enumerate() {
            let Some(l) = self.local(id) else { continue };
            let xv: Vec<f64> = x[p / k * h..][..h].iter().map(|&v| v as f64).collect();
            let gub = self.gub.as_ref().map(|b| &b[l * 2 * inter..][..2 * inter]);
            let gu = mv(&self.gate_up[l].dequantize(), 2 * inter, h, &xv, gub);
            let a: Vec<f64> = (0..inter)
                .map(|c| {
                    let (g, u) = (gu[c], gu[inter + c]);
                    let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
                    match self.act {
                        MoeAct::Gated(GatedAct::Silu) => g * sig(g) * u,
                        MoeAct::Gated(GatedAct::GeluTanh) => {
                            let inner =
                                (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
                            0.5 * g * (1.0 + inner.tanh()) * u
                        }
                        MoeAct::ClampedSwiglu { alpha, limit } => {
                            let (l, a) = (limit as f64, alpha as f64);
                            let g = g.min(l);
                            (u.clamp(-l, l) + 1.0) * g * sig(a * g)
                        }
                    }
                })
                .collect();
            let db = self.db.as_ref().map(|b| &b[l * h..][..h]);
            let y = mv(&self.down[l].dequantize(), h, inter, &a, db);
            for c in 0..h {
                out[p / k * h + c] += r.weights[p] as f64 * y[c];
            }
        }
        out
    }
}

/// Each token's `k` distinct experts of `num_experts`, and positive weights.
fn routing(rng: &mut Rng, t: usize, k: usize, num_experts: usize) -> (Vec<i64>, Vec<f32>) {
    let mut ids = Vec::new();
    for _ in 0..t {
        let mut chosen: Vec<i64> = Vec::new();
        while chosen.len() < k {
            let e = rng.index(num_experts) as i64;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen);
    }
    let weights = (0..t * k).map(|_| 0.05 + rng.floats(1)[0].abs()).collect();
    (ids, weights)
}

#[test]
fn run_is_the_per_expert_composition_bit_for_bit() {
    let mut rng = Rng(23);
    for case_no in 0..24 {
        let num_experts = 2 + rng.index(9);
        // every third case an expert-parallel rank holding a run of the experts
        let (first, local) = if case_no % 3 == 2 {
            let first = rng.index(num_experts - 1);
            (first, 1 + rng.index(num_experts - first))
        } else {
            (0, num_experts)
        };
        let bits = match case_no % 8 {
            7 => 6,
            3 => 39,
            n if n % 2 == 0 => 8,
            _ => 4,
        };
        let c = Case::random(&mut rng, local, first, num_experts, bits);
        let t = [1, 2, 3, 9, 17][rng.index(5)];
        let k = 1 + rng.index(num_experts.min(4));
        let (ids, weights) = routing(&mut rng, t, k, num_experts);
        let r = Routing {
            ids: &ids,
            weights: &weights,
            top_k: k,
        };
        let x: Vec<f32> = rng.floats(t * c.h);
        let init: Vec<f32> = rng.floats(t * c.h);
        let ex = c.experts();
        for isa in isas() {
            let mut want = init.clone();
            c.composed(&x, &r, &mut want, 1, isa);
            for threads in [1, 2, 3] {
                let mut got = init.clone();
                let bytes = ex.run(&x, &r, &mut got, threads, Some(isa)).unwrap();
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "case {case_no} {isa:?} threads {threads}: not bit-identical"
                );
                let routed = (0..local).filter(|&l| ids.contains(&((first + l) as i64)));
                let expect: usize = routed
                    .map(|l| c.gate_up[l].nbytes() + c.down[l].nbytes())
                    .sum();
                assert_eq!(bytes, expect, "case {case_no}: bytes streamed");
            }
        }
        // and the composition itself computes the MoE: within the int8 activation rounding
        let mut got = vec![0.0f32; t * c.h];
        ex.run(&x, &r, &mut got, 2, None).unwrap();
        let exact = c.exact(&x, &r);
        let err: f64 = got
            .iter()
            .zip(&exact)
            .map(|(&a, &b)| (a as f64 - b).powi(2))
            .sum();
        let norm: f64 = exact.iter().map(|b| b * b).sum();
        if norm > 0.0 {
            let rel = (err / norm).sqrt();
            assert!(rel < 0.05, "case {case_no}: relative error {rel}");
        } else {
            assert!(
                got.iter().all(|&v| v == 0.0),
                "case {case_no}: no expert local"
            );
        }
    }
}

#[test]
fn a_non_finite_row_poisons_only_its_token() {
    let mut rng = Rng(5);
    let c = Case::random(&mut rng, 4, 0, 4, 8);
    let (t, k) = (3, 2);
    let (ids, weights) = routing(&mut rng, t, k, 4);
    let r = Routing {
        ids: &ids,
        weights: &weights,
        top_k: k,
    };
    let mut x = rng.floats(t * c.h);
    x[c.h + 3] = f32::NAN;
    let mut out = vec![0.0f32; t * c.h];
    c.experts().run(&x, &r, &mut out, 2, None).unwrap();
    for (tok, row) in out.chunks_exact(c.h).enumerate() {
        assert_eq!(row.iter().all(|v| v.is_nan()), tok == 1, "token {tok}");
        assert!(tok == 1 || row.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn bad_arguments_are_errors_naming_them() {
    let mut rng = Rng(9);
    let c = Case::random(&mut rng, 3, 0, 3, 8);
    let (h, inter) = (c.h, c.inter);
    let ex = c.experts();
    let x = vec![0.5f32; 2 * h];
    let mut out = vec![0.0f32; 2 * h];
    let err = |e: crate::error::CoreError| e.to_string();
    let ids = [0i64, 3];
    let r = Routing {
        ids: &ids,
        weights: &[1.0, 1.0],
        top_k: 1,
    };
    assert!(err(ex.run(&x, &r, &mut out, 1, None).unwrap_err()).contains("ids"));
    let r = Routing {
        ids: &[0, 1, 2],
        weights: &[1.0; 3],
        top_k: 1,
    };
    assert!(err(ex.run(&x, &r, &mut out, 1, None).unwrap_err()).contains("ids"));
    let r = Routing {
        ids: &[0, 1],
        weights: &[1.0],
        top_k: 1,
    };
    assert!(err(ex.run(&x, &r, &mut out, 1, None).unwrap_err()).contains("weights"));
    let r = Routing {
        ids: &[0, 1],
        weights: &[1.0; 2],
        top_k: 1,
    };
    assert!(err(ex.run(&x[1..], &r, &mut out, 1, None).unwrap_err()).contains("x"));
    assert!(err(ex.run(&x, &r, &mut out[1..], 1, None).unwrap_err()).contains("out"));
    let mk = |gu: Vec<&QMatrix>, d: Vec<&QMatrix>, first, e| {
        Experts::new(gu, d, None, None, MoeAct::Gated(GatedAct::Silu), first, e).map(|_| ())
    };
    let (g, d) = (&c.gate_up, &c.down);
    assert!(err(mk(vec![], vec![], 0, 3).unwrap_err()).contains("gate_up"));
    assert!(err(mk(vec![&g[0], &g[1]], vec![&d[0]], 0, 3).unwrap_err()).contains("down"));
    assert!(err(mk(vec![&d[0]], vec![&g[0]], 0, 3).unwrap_err()).contains("down"));
    let gate_ups = vec![&g[0], &d[1]];
    assert!(err(mk(gate_ups, vec![&d[0], &d[1]], 0, 3).unwrap_err()).contains("gate_up"));
    let tall = QMatrix::quantize(&vec![0.1; (h + 32) * inter], h + 32, inter, 8, 0).unwrap();
    assert!(err(mk(vec![&g[0]], vec![&tall], 0, 3).unwrap_err()).contains("down"));
    assert!(err(mk(vec![&g[0], &g[1]], vec![&d[0], &d[1]], 2, 3).unwrap_err()).contains("first"));
    let short = vec![0.0f32; 2 * inter];
    let e = Experts::new(
        vec![&g[0], &g[1]],
        vec![&d[0], &d[1]],
        Some(&short),
        None,
        MoeAct::Gated(GatedAct::Silu),
        0,
        2,
    );
    assert!(err(e.map(|_| ()).unwrap_err()).contains("gate_up_bias"));
    let bad = MoeAct::ClampedSwiglu {
        alpha: 1.0,
        limit: f32::NAN,
    };
    let e = Experts::new(vec![&g[0]], vec![&d[0]], None, None, bad, 0, 1);
    assert!(err(e.map(|_| ()).unwrap_err()).contains("clamp"));
}
