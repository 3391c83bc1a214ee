use super::*;
use crate::test_rng::Rng;

/// Everything one call needs, in storage type `T`.
struct Case<T> {
    x: Vec<T>,
    w: Vec<T>,
    out: Vec<T>,
    bias: Option<Vec<f32>>,
    shape: Shape,
}

fn case<T: Weight>(rng: &mut Rng, shape: Shape, bias: bool) -> Case<T> {
    let v = |rng: &mut Rng, n: usize| rng.floats(n).into_iter().map(T::store).collect::<Vec<T>>();
    Case {
        x: v(rng, shape.m * shape.k),
        w: v(rng, shape.k * shape.n),
        out: v(rng, shape.m * shape.n),
        bias: bias.then(|| rng.floats(shape.n)),
        shape,
    }
}

/// `W[k][c]` of either layout.
fn at<T: Weight>(w: &[T], s: Shape, layout: Layout, k: usize, c: usize) -> f32 {
    match layout {
        Layout::Kn => w[k * s.n + c].load(),
        Layout::Nk => w[c * s.k + k].load(),
    }
}

fn call<T: Weight>(c: &Case<T>, layout: Layout, acc: bool, threads: usize, isa: Isa) -> Vec<T> {
    let mut out = c.out.clone();
    let opts = Opts {
        accumulate: acc,
        bias: c.bias.as_deref(),
        threads,
        isa: Some(isa),
    };
    matmul(&c.x, &c.w, &mut out, c.shape, layout, &opts).unwrap();
    out
}

/// Against an f64 reference: f32 accumulation over `k` terms (k ulps of Σ|w x| covers any
/// order, FMA or `vdpbf16ps`'s two roundings a pair), then one rounding to `T` (`rel` = half
/// its ulp, relative).
fn check_close<T: Weight>(c: &Case<T>, layout: Layout, acc: bool, got: &[T], rel: f64, what: &str) {
    let s = c.shape;
    for r in 0..s.m {
        for col in 0..s.n {
            let (mut want, mut mag) = (0.0f64, 0.0f64);
            for kk in 0..s.k {
                let p = at(&c.w, s, layout, kk, col) as f64 * c.x[r * s.k + kk].load() as f64;
                want += p;
                mag += p.abs();
            }
            if let Some(b) = &c.bias {
                want += b[col] as f64;
                mag += (b[col] as f64).abs();
            }
            if acc {
                let o = c.out[r * s.n + col].load() as f64;
                want += o;
                mag += o.abs();
            }
            let g = got[r * s.n + col].load() as f64;
            let tol =
                (s.k as f64 + 2.0) * 2f64.powi(-24) * mag * (1.0 + rel) + rel * want.abs() + 1e-30;
            assert!(
                (g - want).abs() <= tol,
                "{what}: row {r} col {col}: {g} vs {want} (tol {tol})"
            );
        }
    }
}

fn bits<T: Weight>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.load().to_bits()).collect()
}

fn shapes(rng: &mut Rng) -> Vec<Shape> {
    let mut s = vec![
        Shape {
            m: 1,
            k: 576,
            n: 960,
        },
        Shape {
            m: 8,
            k: 64,
            n: 256,
        },
        Shape { m: 3, k: 33, n: 17 },
        Shape {
            m: 5,
            k: 16,
            n: 160,
        },
        Shape { m: 1, k: 1, n: 1 },
    ];
    for _ in 0..6 {
        s.push(Shape {
            m: 1 + rng.index(9),
            k: 1 + rng.index(150),
            n: 1 + rng.index(300),
        });
    }
    s
}

fn each_type(f: &mut dyn FnMut(&mut Rng, Shape, &str)) {
    let mut rng = Rng(7);
    for s in shapes(&mut rng) {
        f(&mut rng, s, "");
    }
}

fn exercise<T: Weight>(rng: &mut Rng, s: Shape, rel: f64, name: &str) {
    for layout in [Layout::Kn, Layout::Nk] {
        for (acc, bias) in [(false, false), (true, true), (false, true)] {
            let c = case::<T>(rng, s, bias);
            let reference = call(&c, layout, acc, 1, Isa::Scalar);
            check_close(
                &c,
                layout,
                acc,
                &reference,
                rel,
                &format!("{name} scalar {layout:?} {s:?}"),
            );
            for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
                let what = format!("{name} {} {layout:?} {s:?} acc={acc}", isa.name());
                let one = call(&c, layout, acc, 1, isa);
                check_close(&c, layout, acc, &one, rel, &what);
                let dp = isa == Isa::Avx512Bf16 && T::KIND == Kind::Bf16;
                if !dp {
                    // The FMA paths run the scalar path's chains in its order: bit for bit.
                    assert_eq!(bits(&one), bits(&reference), "{what}: differs from scalar");
                }
                for threads in [2, 3] {
                    let t = call(&c, layout, acc, threads, isa);
                    assert_eq!(bits(&t), bits(&one), "{what}: {threads} threads");
                }
                // Row invariance: each row alone gives the bits it gets among all m.
                for r in 0..s.m {
                    let alone = Case {
                        x: c.x[r * s.k..(r + 1) * s.k].to_vec(),
                        w: c.w.clone(),
                        out: c.out[r * s.n..(r + 1) * s.n].to_vec(),
                        bias: c.bias.clone(),
                        shape: Shape { m: 1, ..s },
                    };
                    let got = call(&alone, layout, acc, 2, isa);
                    assert_eq!(
                        bits(&got),
                        bits(&one[r * s.n..(r + 1) * s.n]),
                        "{what}: row {r} alone"
                    );
                }
            }
        }
    }
}

#[test]
fn f32_matches_reference_on_every_path() {
    each_type(&mut |rng, s, _| exercise::<f32>(rng, s, 0.0, "f32"));
}

#[test]
fn bf16_matches_reference_on_every_path() {
    each_type(&mut |rng, s, _| exercise::<Bf16>(rng, s, 2f64.powi(-8), "bf16"));
}

#[test]
fn f16_matches_reference_on_every_path() {
    each_type(&mut |rng, s, _| exercise::<F16>(rng, s, 2f64.powi(-11), "f16"));
}

#[test]
fn bad_arguments_are_named() {
    let s = Shape { m: 2, k: 4, n: 3 };
    let (x, w, mut out) = (vec![0.0f32; 8], vec![0.0f32; 12], vec![0.0f32; 6]);
    let err = |x: &[f32], w: &[f32], out: &mut [f32], opts: &Opts| {
        matmul(x, w, out, s, Layout::Kn, opts)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&x[..7], &w, &mut out, &Opts::default()).starts_with("x"));
    assert!(err(&x, &w[..11], &mut out, &Opts::default()).starts_with("weight"));
    assert!(err(&x, &w, &mut out[..5], &Opts::default()).starts_with("out"));
    let bias = [0.0f32; 2];
    let opts = Opts {
        bias: Some(&bias),
        ..Opts::default()
    };
    assert!(err(&x, &w, &mut out, &opts).starts_with("bias"));
    if let Some(missing) = Isa::ALL.into_iter().find(|i| !i.available()) {
        let opts = Opts {
            isa: Some(missing),
            ..Opts::default()
        };
        assert!(err(&x, &w, &mut out, &opts).starts_with("isa"));
    }
}
