use super::*;

use crate::cpu::elem::F16;
use crate::test_rng::Rng;

/// One chunk: q `[n, Hq, D]`, k `[S, Hkv, D]`, v `[S, Hkv, Dv]`, each row followed by `pad`
/// unused elements (a strided view, as into a fused q|k|v projection).
struct Case {
    shape: PrefillShape,
    pad: usize,
    q: Vec<Bf16>,
    k: Vec<Bf16>,
    v: Vec<Bf16>,
}

fn bf16s(rng: &mut Rng, n: usize, gain: f32) -> Vec<Bf16> {
    rng.floats(n)
        .into_iter()
        .map(|x| Bf16::store(x * gain))
        .collect()
}

impl Case {
    fn new(rng: &mut Rng, shape: PrefillShape, pad: usize) -> Case {
        let s = shape;
        let rows = |n: usize, w: usize| if n == 0 { 0 } else { n * (w + pad) };
        Case {
            shape,
            pad,
            // Large enough logits that the softmax is far from uniform (an error shows)
            q: bf16s(rng, rows(s.rows, s.num_q_heads * s.head_dim), 4.0),
            k: bf16s(rng, rows(s.keys(), s.num_kv_heads * s.head_dim), 1.0),
            v: bf16s(rng, rows(s.keys(), s.num_kv_heads * s.v_dim), 1.0),
        }
    }

    fn random(rng: &mut Rng, dims: &[(usize, usize)]) -> Case {
        let (head_dim, v_dim) = dims[rng.index(dims.len())];
        let num_kv_heads = 1 + rng.index(3);
        let group = [1, 2, 3, 4][rng.index(4)];
        let rows = 1 + rng.index(70);
        let context_len = [0, 0, 1, 15, 16, 33, 100][rng.index(7)];
        let shape = PrefillShape {
            rows,
            context_len,
            num_q_heads: num_kv_heads * group,
            num_kv_heads,
            head_dim,
            v_dim,
        };
        let pad = [0, 0, 8][rng.index(3)];
        Case::new(rng, shape, pad)
    }

    fn args(&self) -> PrefillArgs<'_> {
        let s = self.shape;
        PrefillArgs {
            shape: s,
            q: &self.q,
            q_stride: s.num_q_heads * s.head_dim + self.pad,
            k: &self.k,
            k_stride: s.num_kv_heads * s.head_dim + self.pad,
            v: &self.v,
            v_stride: s.num_kv_heads * s.v_dim + self.pad,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
        }
    }

    fn run(&self, threads: usize, path: Path) -> Vec<Bf16> {
        let s = self.shape;
        let mut out = vec![Bf16(0x7fc0); s.rows * s.num_q_heads * s.v_dim];
        prefill_on(&self.args(), &mut out, threads, path).unwrap();
        out
    }

    /// Textbook causal attention in f64; `extra` keys past each row's own position are seen too
    /// (a wrong mask, to show the bound catches it).
    fn reference(&self, extra: usize) -> Vec<f64> {
        let (s, a) = (self.shape, self.args());
        let (g, d, dv) = (s.num_q_heads / s.num_kv_heads, s.head_dim, s.v_dim);
        let mut out = vec![0.0; s.rows * s.num_q_heads * dv];
        for i in 0..s.rows {
            let len = (s.context_len + i + 1 + extra).min(s.keys());
            for qh in 0..s.num_q_heads {
                let h = qh / g;
                let q = &a.q[i * a.q_stride + qh * d..][..d];
                let logits: Vec<f64> = (0..len)
                    .map(|j| {
                        let k = &a.k[j * a.k_stride + h * d..][..d];
                        let dot: f64 = q
                            .iter()
                            .zip(k)
                            .map(|(x, y)| x.load() as f64 * y.load() as f64)
                            .sum();
                        dot * a.scale as f64
                    })
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|x| (x - max).exp()).collect();
                let total: f64 = w.iter().sum();
                for x in 0..dv {
                    let sum: f64 = (0..len)
                        .map(|j| w[j] * a.v[j * a.v_stride + h * dv + x].load() as f64)
                        .sum();
                    out[(i * s.num_q_heads + qh) * dv + x] = sum / total;
                }
            }
        }
        out
    }

    /// The first element of `out` off `reference` by more than the kernel's rounding allows:
    /// the output's own bf16 rounding (2^-8 of it), the probabilities' bf16 rounding (2^-8 of
    /// the largest |v| it weighs, with room for the f32 sums), and f32 slack.
    fn violation(&self, out: &[Bf16], reference: &[f64]) -> Option<String> {
        let vmax = self.v.iter().map(|x| x.load().abs()).fold(0.0f32, f32::max) as f64;
        out.iter()
            .zip(reference)
            .enumerate()
            .find_map(|(i, (o, r))| {
                let o = o.load() as f64;
                let bound = r.abs() / 256.0 + vmax / 256.0 + 1e-5;
                // NaN fails too
                ((o - r).abs().is_nan() || (o - r).abs() > bound)
                    .then(|| format!("element {i}: {o} vs {r} (bound {bound})"))
            })
    }
}

fn paths(shape: &PrefillShape) -> Vec<Path> {
    [Path::Generic, Path::Bf16Tiles]
        .into_iter()
        .filter(|p| p.available(shape))
        .collect()
}

#[test]
fn random_chunks_match_f64_attention_on_every_path() {
    let mut rng = Rng(0x9e11);
    let dims = [(32, 32), (64, 64), (64, 16), (128, 128), (96, 48), (8, 6)];
    for trial in 0..60 {
        let case = Case::random(&mut rng, &dims);
        let reference = case.reference(0);
        for path in paths(&case.shape) {
            for threads in [1, 3] {
                let out = case.run(threads, path);
                if let Some(e) = case.violation(&out, &reference) {
                    panic!("trial {trial} {:?} {path:?} x{threads}: {e}", case.shape);
                }
            }
        }
    }
}

#[test]
fn the_bound_catches_a_key_past_the_row() {
    // A row that also saw the next key is off the reference by more than the bound allows.
    let mut rng = Rng(7);
    let shape = PrefillShape {
        rows: 24,
        context_len: 0,
        num_q_heads: 6,
        num_kv_heads: 2,
        head_dim: 64,
        v_dim: 64,
    };
    let case = Case::new(&mut rng, shape, 0);
    let out = case.run(2, Path::Generic);
    assert!(case.violation(&out, &case.reference(0)).is_none());
    assert!(case.violation(&out, &case.reference(1)).is_some());
}

#[test]
fn rows_do_not_depend_on_threads_tiles_or_chunking() {
    let mut rng = Rng(42);
    for (d, dv, hkv, g) in [(64, 64, 3, 3), (128, 64, 2, 4), (32, 32, 1, 1)] {
        let shape = PrefillShape {
            rows: 77,
            context_len: 0,
            num_q_heads: hkv * g,
            num_kv_heads: hkv,
            head_dim: d,
            v_dim: dv,
        };
        let case = Case::new(&mut rng, shape, 4);
        for path in paths(&shape) {
            let whole = case.run(1, path);
            for threads in [2, 3, 8] {
                assert!(case.run(threads, path) == whole, "{path:?} x{threads}");
            }
            // The last 30 rows as a chunk after a 47-token context: the same keys, the same bits.
            let (c, width) = (47, shape.num_q_heads * d + case.pad);
            let tail = PrefillShape {
                rows: 30,
                context_len: c,
                ..shape
            };
            let a = case.args();
            let args = PrefillArgs {
                shape: tail,
                q: &case.q[c * width..],
                ..a
            };
            let mut out = vec![Bf16(0); 30 * shape.num_q_heads * dv];
            prefill_on(&args, &mut out, 2, path).unwrap();
            assert!(
                out[..] == whole[c * shape.num_q_heads * dv..],
                "{path:?} chunked"
            );
        }
    }
}

#[test]
fn long_contexts_shrink_the_tile() {
    // 4,000 keys: a tile holds at most TILE_SCORES scores, so it takes 5 positions of 3 heads.
    let mut rng = Rng(3);
    let shape = PrefillShape {
        rows: 12,
        context_len: 3988,
        num_q_heads: 3,
        num_kv_heads: 1,
        head_dim: 64,
        v_dim: 64,
    };
    let case = Case::new(&mut rng, shape, 0);
    let reference = case.reference(0);
    for path in paths(&shape) {
        let out = case.run(2, path);
        assert!(case.violation(&out, &reference).is_none(), "{path:?}");
    }
}

#[test]
fn bad_arguments_are_errors_naming_them() {
    let mut rng = Rng(1);
    let shape = PrefillShape {
        rows: 4,
        context_len: 2,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 32,
        v_dim: 32,
    };
    let case = Case::new(&mut rng, shape, 0);
    let mut out = vec![Bf16(0); 4 * 4 * 32];
    let err = |args: &PrefillArgs, out: &mut [Bf16]| match prefill(args, out, 1) {
        Err(CoreError::InvalidArgument { name, .. }) => name,
        other => panic!("expected an error, got {other:?}"),
    };
    let a = case.args();
    assert_eq!(
        err(
            &PrefillArgs {
                k: &case.k[1..],
                ..case.args()
            },
            &mut out
        ),
        "k"
    );
    assert_eq!(
        err(
            &PrefillArgs {
                v_stride: 3,
                ..case.args()
            },
            &mut out
        ),
        "v"
    );
    assert_eq!(err(&a, &mut out[1..]), "out");
    let odd = PrefillShape {
        num_q_heads: 3,
        ..shape
    };
    assert_eq!(
        err(
            &PrefillArgs {
                shape: odd,
                ..case.args()
            },
            &mut out
        ),
        "q"
    );
    assert_eq!(
        err(
            &PrefillArgs {
                scale: f32::NAN,
                ..case.args()
            },
            &mut out
        ),
        "scale"
    );
    assert!(prefill(&a, &mut out, 2).is_ok());
    assert!(out.iter().all(|x| x.load().is_finite()));
}

/// `b`'s geometry over other rows (of other element types).
fn over<'a, Q: Elem, K: Elem>(
    b: &PrefillArgs,
    q: &'a [Q],
    k: &'a [K],
    v: &'a [K],
) -> PrefillArgs<'a, Q, K> {
    PrefillArgs {
        shape: b.shape,
        q,
        q_stride: b.q_stride,
        k,
        k_stride: b.k_stride,
        v,
        v_stride: b.v_stride,
        scale: b.scale,
    }
}

#[test]
fn f32_rows_give_the_bf16_results_widened() {
    // f32 q, k or v are rounded to bf16 as they are read, and an f32 output holds the bf16
    // result: the same bits as the bf16 call on the rounded rows, on every path, for every pair
    // of types (the f32 rows here are not bf16 values, so the rounding is exercised).
    let mut rng = Rng(7);
    for _ in 0..12 {
        let case = Case::random(&mut rng, &[(64, 64), (32, 16), (128, 128)]);
        let s = case.shape;
        let wide = |rng: &mut Rng, n: usize, gain: f32| -> Vec<f32> {
            rng.floats(n).into_iter().map(|x| x * gain).collect()
        };
        let (q32, k32, v32) = (
            wide(&mut rng, case.q.len(), 4.0),
            wide(&mut rng, case.k.len(), 1.0),
            wide(&mut rng, case.v.len(), 1.0),
        );
        let round = |x: &[f32]| x.iter().map(|&x| Bf16::store(x)).collect::<Vec<_>>();
        let rounded = Case {
            q: round(&q32),
            k: round(&k32),
            v: round(&v32),
            ..case
        };
        let b = rounded.args();
        let n = s.rows * s.num_q_heads * s.v_dim;
        for path in paths(&s) {
            let want: Vec<f32> = rounded.run(2, path).iter().map(|x| x.load()).collect();
            let mut out = vec![f32::NAN; n];
            prefill_on(&over(&b, &q32, &k32, &v32), &mut out, 2, path).unwrap();
            assert!(out == want, "{path:?} f32 q, k, v");
            prefill_on(&over(&b, &q32, b.k, b.v), &mut out, 2, path).unwrap();
            assert!(out == want, "{path:?} f32 q over bf16 k, v");
            let wide_kv = over(&b, b.q, &k32, &v32);
            let mut half = vec![Bf16(0); n];
            prefill_on(&wide_kv, &mut half, 2, path).unwrap();
            assert!(
                half.iter().map(|x| x.load()).eq(want.iter().copied()),
                "{path:?} f32 k, v"
            );
        }
    }
}

#[test]
fn other_output_types_run_on_the_generic_body() {
    // The tiles write bf16 or f32 only: an f16 output takes the generic body (its bits, stored
    // as f16), and asking the tiles for it is an error naming `out`.
    let mut rng = Rng(11);
    let case = Case::random(&mut rng, &[(64, 64)]);
    let s = case.shape;
    let q: Vec<F16> = case.q.iter().map(|x| F16::store(x.load())).collect();
    let b = case.args();
    let args = over(&b, &q, b.k, b.v);
    let n = s.rows * s.num_q_heads * s.v_dim;
    let (mut got, mut want) = (vec![F16(0); n], vec![F16(0); n]);
    prefill(&args, &mut got, 2).unwrap();
    prefill_on(&args, &mut want, 2, Path::Generic).unwrap();
    assert!(got == want);
    if Path::Bf16Tiles.available(&s) {
        match prefill_on(&args, &mut got, 2, Path::Bf16Tiles) {
            Err(CoreError::InvalidArgument { name, .. }) => assert_eq!(name, "out"),
            other => panic!("expected an error naming out, got {other:?}"),
        }
    }
}
