use super::*;

use crate::test_rng::Rng;

struct Case {
    shape: DecodeShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    tables: Vec<i32>,
    lens: Vec<i32>,
    window: Option<usize>,
    softcap: Option<f32>,
    sinks: Option<Vec<f32>>,
}

impl Case {
    fn random(rng: &mut Rng, hq: usize, hkv: usize, d: usize, bs: usize, n: usize) -> Case {
        let max_blocks = 1 + rng.index(6);
        let num_blocks = n * max_blocks + rng.index(4);
        let lens: Vec<i32> = (0..n)
            .map(|_| 1 + rng.index(max_blocks * bs) as i32)
            .collect();
        // Blocks in a shuffled order, so pages are never laid out contiguously by accident.
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.index(i + 1));
        }
        let tables = (0..n * max_blocks).map(|i| ids[i]).collect();
        let shape = DecodeShape {
            num_seqs: n,
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            num_blocks,
            block_size: bs,
            max_blocks,
            kv_stride: hkv * d,
        };
        let cache = num_blocks * bs * hkv * d;
        Case {
            shape,
            q: rng.floats(n * hq * d),
            k: rng.floats(cache),
            v: rng.floats(cache),
            tables,
            lens,
            window: None,
            softcap: None,
            sinks: None,
        }
    }

    fn args(&self) -> DecodeArgs<'_> {
        DecodeArgs {
            shape: self.shape,
            q: &self.q,
            q_stride: self.shape.num_q_heads * self.shape.head_dim,
            k_cache: &self.k,
            v_cache: &self.v,
            block_tables: &self.tables,
            seq_lens: &self.lens,
            scale: 1.0 / (self.shape.head_dim as f32).sqrt(),
            window: self.window,
            softcap: self.softcap,
            sinks: self.sinks.as_deref(),
        }
    }

    /// `args` over other caches (of another element type, say).
    fn over<'a, C: Elem>(&'a self, k: &'a [C], v: &'a [C]) -> DecodeArgs<'a, f32, C> {
        let a = self.args();
        DecodeArgs {
            shape: a.shape,
            q: a.q,
            q_stride: a.q_stride,
            k_cache: k,
            v_cache: v,
            block_tables: a.block_tables,
            seq_lens: a.seq_lens,
            scale: a.scale,
            window: a.window,
            softcap: a.softcap,
            sinks: a.sinks,
        }
    }

    /// The largest error of `path` on `threads` threads against `reference`.
    fn error(&self, threads: usize, path: Path) -> f32 {
        let mut out = vec![f32::NAN; self.q.len()];
        paged_decode_on(&self.args(), &mut out, threads, path).unwrap();
        max_diff(&out, &self.reference())
    }

    /// Textbook attention in f64: gather each position's K/V row by walking the block table.
    fn reference(&self) -> Vec<f32> {
        let s = self.shape;
        let (d, group) = (s.head_dim, s.num_q_heads / s.num_kv_heads);
        let scale = 1.0 / (d as f64).sqrt();
        let mut out = vec![0.0f32; self.q.len()];
        for seq in 0..s.num_seqs {
            let len = self.lens[seq] as usize;
            // Keys in (len - 1 - window, len - 1], spelled out independently of the kernel's span().
            let first = match self.window {
                Some(w) if w < len => len - w,
                _ => 0,
            };
            for qh in 0..s.num_q_heads {
                let kh = qh / group;
                let q = &self.q[(seq * s.num_q_heads + qh) * d..][..d];
                let at = |pos: usize| {
                    let b = self.tables[seq * s.max_blocks + pos / s.block_size] as usize;
                    ((b * s.block_size + pos % s.block_size) * s.num_kv_heads + kh) * d
                };
                let logits: Vec<f64> = (first..len)
                    .map(|p| {
                        (0..d)
                            .map(|i| q[i] as f64 * self.k[at(p) + i] as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .map(|x| match self.softcap {
                        Some(c) => c as f64 * (x / c as f64).tanh(),
                        None => x,
                    })
                    .collect();
                let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|x| (x - max).exp()).collect();
                // A sink is one more softmax term with no value row.
                let sink = self
                    .sinks
                    .as_ref()
                    .map_or(0.0, |s| (s[qh] as f64 - max).exp());
                let sum: f64 = w.iter().sum::<f64>() + sink;
                for i in 0..d {
                    let o: f64 = (first..len)
                        .map(|p| w[p - first] * self.v[at(p) + i] as f64)
                        .sum::<f64>()
                        / sum;
                    out[(seq * s.num_q_heads + qh) * d + i] = o as f32;
                }
            }
        }
        out
    }
}

/// Every kernel path this CPU has: each must match the reference and keep rows independent.
fn paths() -> impl Iterator<Item = Path> {
    Path::ALL.into_iter().filter(|p| p.available())
}

/// The largest elementwise difference of two outputs.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn matches_reference_across_shapes_and_thread_counts() {
    let mut rng = Rng(7);
    // (Hq, Hkv, D, block_size): MHA, GQA, MQA, head dims that are not a multiple of 16, every
    // register count of the AVX-512 path (D / 16 = 1..=8, 16), and of the AVX2 path a head dim
    // in one chunk of K registers, one with a remainder after full chunks (D / 8 = 9, 12), and
    // several chunks (16, 32).
    for &(hq, hkv, d, bs) in &[
        (4, 4, 16, 4),
        (9, 3, 64, 16),
        (8, 1, 128, 8),
        (6, 2, 40, 16),
        (2, 1, 8, 1),
        (8, 2, 80, 16),
        (8, 1, 64, 16),
        (3, 3, 32, 5),
        (6, 2, 48, 16),
        (4, 1, 96, 7),
        (2, 2, 112, 16),
        (4, 2, 256, 16),
        (3, 1, 72, 16),
        (6, 3, 24, 3),
        (4, 4, 104, 16),
    ] {
        for path in paths() {
            for threads in [1, 2, 3, 8] {
                let n = 1 + rng.index(7);
                let err = Case::random(&mut rng, hq, hkv, d, bs, n).error(threads, path);
                assert!(
                    err < 1e-5,
                    "{path:?} Hq={hq} Hkv={hkv} D={d} bs={bs} threads={threads}: max error {err}"
                );
            }
        }
    }
}

#[test]
fn sliding_window_attends_only_the_last_positions() {
    let mut rng = Rng(11);
    for &(hq, hkv, d, bs) in &[(4, 2, 16, 4), (9, 3, 64, 16)] {
        for window in [1, 3, bs, 2 * bs + 1, 1000] {
            for (threads, path) in [1, 3]
                .into_iter()
                .flat_map(|t| paths().map(move |p| (t, p)))
            {
                let mut case = Case::random(&mut rng, hq, hkv, d, bs, 6);
                case.window = Some(window);
                let err = case.error(threads, path);
                assert!(
                    err < 1e-5,
                    "{path:?} window={window} bs={bs}: max error {err}"
                );
            }
        }
    }
    // The window really changes the result once a sequence is longer than it.
    let mut case = Case::random(&mut Rng(5), 4, 2, 16, 4, 1);
    case.lens[0] = (case.shape.max_blocks * case.shape.block_size) as i32; // >= 4 positions
    let full = case.reference();
    case.window = Some(1);
    let mut out = vec![0.0; case.q.len()];
    paged_decode(&case.args(), &mut out, 1).unwrap();
    let diff = max_diff(&out, &full);
    assert!(diff > 1e-3, "a window of 1 left the output unchanged");
}

#[test]
fn rejects_what_it_cannot_follow() {
    let mut rng = Rng(3);
    let case = Case::random(&mut rng, 4, 2, 16, 4, 3);
    let mut out = vec![0.0; case.q.len()];
    let expect = |mut f: Box<dyn FnMut(&mut Case)>, name: &str| {
        let mut c = Case::random(&mut Rng(3), 4, 2, 16, 4, 3);
        f(&mut c);
        let err = paged_decode(&c.args(), &mut vec![0.0; c.q.len()], 2).unwrap_err();
        assert!(err.to_string().starts_with(name), "{err}");
    };
    expect(Box::new(|c| c.lens[1] = 0), "seq_lens");
    expect(
        Box::new(|c| c.lens[0] = (c.shape.max_blocks * c.shape.block_size + 1) as i32),
        "seq_lens",
    );
    expect(
        Box::new(|c| c.tables[0] = c.shape.num_blocks as i32),
        "block_tables",
    );
    expect(Box::new(|c| c.tables[0] = -1), "block_tables");
    expect(Box::new(|c| c.shape.num_q_heads = 3), "q");
    expect(Box::new(|c| c.window = Some(0)), "window");
    expect(
        Box::new(|c| {
            c.k.pop();
        }),
        "k_cache",
    );
    let short = paged_decode(&case.args(), &mut out[1..], 1).unwrap_err();
    assert!(short.to_string().starts_with("out"), "{short}");
}

/// (Hq, Hkv, D, block size) of the element-type tests: head dims on the explicit AVX-512 passes
/// (64, 16, 128; `vdpbf16ps` at 64 and 128) and one on the generic body (40).
const TYPE_SHAPES: [(usize, usize, usize, usize); 4] = [
    (9, 3, 64, 16),
    (4, 4, 16, 4),
    (8, 2, 128, 16),
    (4, 2, 40, 8),
];

#[test]
fn half_caches_and_strided_queries_match_the_f32_kernel() {
    use crate::cpu::elem::{Bf16, F16};
    fn run<T: Elem>(case: &Case, pad: usize, path: Path) -> Vec<f32> {
        let s = case.shape;
        let width = s.num_q_heads * s.head_dim;
        // Rows `pad` elements apart, as q sits in a fused q|k|v row.
        let mut q = vec![T::store(f32::NAN); s.num_seqs * (width + pad)];
        for (i, row) in case.q.chunks(width).enumerate() {
            for (j, &x) in row.iter().enumerate() {
                q[i * (width + pad) + j] = T::store(x);
            }
        }
        let (k, v): (Vec<T>, Vec<T>) = (
            case.k.iter().map(|&x| T::store(x)).collect(),
            case.v.iter().map(|&x| T::store(x)).collect(),
        );
        let args = DecodeArgs {
            shape: s,
            q: &q[..q.len() - pad],
            q_stride: width + pad,
            k_cache: &k,
            v_cache: &v,
            block_tables: &case.tables,
            seq_lens: &case.lens,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            window: case.window,
            softcap: case.softcap,
            sinks: case.sinks.as_deref(),
        };
        let mut out = vec![T::store(0.0); case.q.len()];
        paged_decode_on(&args, &mut out, 2, path).unwrap();
        out.iter().map(|x| x.load()).collect()
    }
    let mut rng = Rng(21);
    for &(hq, hkv, d, bs) in &TYPE_SHAPES {
        let mut case = Case::random(&mut rng, hq, hkv, d, bs, 5);
        // Round the inputs to bf16 first: the kernels then see the same values, and the
        // outputs differ only by the final rounding (bf16 2^-8, f16 2^-11 of a value <= 1).
        for x in case.q.iter_mut().chain(&mut case.k).chain(&mut case.v) {
            *x = Bf16::store(*x).load();
        }
        let reference = case.reference();
        for path in paths() {
            let want = run::<f32>(&case, 0, path);
            assert!(max_diff(&want, &reference) < 1e-5, "{path:?} D={d}");
            for (got, tol) in [
                (run::<Bf16>(&case, 2 * hkv * d, path), 4e-3),
                (run::<F16>(&case, 0, path), 5e-4),
            ] {
                let err = max_diff(&got, &want);
                assert!(err < tol, "{path:?} Hq={hq} D={d}: max error {err}");
            }
            assert_eq!(
                run::<f32>(&case, 7, path),
                want,
                "a row stride changes nothing"
            );
        }
    }
}

/// A 16- or 8-bit cache under f32 queries gives the bits of the f32 kernel over a cache holding
/// the same (rounded) values: the cache type changes what is stored, never the arithmetic.
/// Except on `Avx512Bf16` (head dims a multiple of 32): over a bf16 cache the logits take
/// `vdpbf16ps` on the queries rounded to bf16, there the reference's within bf16; over an 8-bit
/// cache the queries are rounded to bf16 too (as the prefill tiles round them), there the f32
/// kernel's bits on the rounded queries.
#[test]
fn a_narrow_cache_under_f32_queries_equals_the_f32_kernel_on_its_values() {
    use crate::cpu::elem::{Bf16, F16, F8E4M3, F8E5M2};
    fn run<C: Elem>(case: &Case, path: Path, threads: usize) -> (Vec<f32>, Vec<f32>) {
        let (k, v): (Vec<C>, Vec<C>) = (
            case.k.iter().map(|&x| C::store(x)).collect(),
            case.v.iter().map(|&x| C::store(x)).collect(),
        );
        let args = case.over(&k, &v);
        let mut got = vec![f32::NAN; case.q.len()];
        paged_decode_on(&args, &mut got, threads, path).unwrap();
        let (kw, vw): (Vec<f32>, Vec<f32>) = (
            k.iter().map(|x| x.load()).collect(),
            v.iter().map(|x| x.load()).collect(),
        );
        let byte = std::mem::size_of::<C>() == 1;
        let rounded: Vec<f32> = case.q.iter().map(|&x| Bf16::store(x).load()).collect();
        let mut wide = case.over(&kw, &vw);
        if byte && path == Path::Avx512Bf16 && case.shape.head_dim.is_multiple_of(32) {
            wide.q = &rounded;
        }
        let mut want = vec![f32::NAN; case.q.len()];
        paged_decode_on(&wide, &mut want, threads, path).unwrap();
        (got, want)
    }
    let mut rng = Rng(33);
    for &(hq, hkv, d, bs) in &TYPE_SHAPES {
        let mut case = Case::random(&mut rng, hq, hkv, d, bs, 4);
        // Rows 1 and 2 share row 1's table: one sequence's verification rows, read together.
        let m = case.shape.max_blocks;
        let (head, tail) = case.tables.split_at_mut(2 * m);
        tail[..m].copy_from_slice(&head[m..]);
        case.lens[2] = case.lens[1].min(2);
        case.window = (d == 64).then_some(5);
        case.sinks = (d == 16).then(|| rng.floats(hq));
        for path in paths() {
            for threads in [1, 2] {
                let (got, want) = run::<Bf16>(&case, path, threads);
                if path == Path::Avx512Bf16 && d % 32 == 0 {
                    let err = max_diff(&got, &case.reference());
                    assert!(err < 1e-2, "bf16 cache, {path:?} D={d}: max error {err}");
                    assert_ne!(got, want, "D={d}: the vdpbf16ps logits ran");
                } else {
                    assert_eq!(got, want, "bf16 cache, {path:?} D={d} threads={threads}");
                }
                let (got, want) = run::<F16>(&case, path, threads);
                assert_eq!(got, want, "f16 cache, {path:?} D={d} threads={threads}");
                assert!(max_diff(&got, &case.reference()) < 5e-3, "{path:?} D={d}");
                // 8-bit caches: the widening loads on every path; 3 and 2 mantissa bits keep
                // them only roughly near the reference.
                let (got, want) = run::<F8E4M3>(&case, path, threads);
                assert_eq!(got, want, "e4m3 cache, {path:?} D={d} threads={threads}");
                assert!(max_diff(&got, &case.reference()) < 0.25, "{path:?} D={d}");
                let (got, want) = run::<F8E5M2>(&case, path, threads);
                assert_eq!(got, want, "e5m2 cache, {path:?} D={d} threads={threads}");
                assert!(max_diff(&got, &case.reference()) < 0.5, "{path:?} D={d}");
            }
        }
    }
}

#[test]
fn write_rows_rounds_into_a_narrower_cache() {
    use crate::cpu::elem::Bf16;
    let k = [1.0f32 + 1.0 / 256.0, -3.0e38, 0.1, f32::NAN];
    let v = [2.0f32, 1.0e-3, -0.1, 4.0];
    let (mut kc, mut vc) = (vec![Bf16(0); 8], vec![Bf16(0); 8]);
    let rows = NewRows {
        k: &k,
        v: &v,
        k_stride: 4,
        v_stride: 4,
        slots: &[1],
    };
    write_rows(&mut kc, &mut vc, &rows, 4).unwrap();
    let want: Vec<Bf16> = k.iter().map(|&x| Bf16::store(x)).collect();
    assert_eq!(&kc[4..], &want[..]);
    assert_eq!(vc[4].load(), 2.0);
    assert!(kc[..4].iter().chain(&vc[..4]).all(|x| x.0 == 0));
}

#[test]
fn write_rows_fills_slots_and_skips_padding() {
    let (width, stride) = (6, 10);
    let k: Vec<f32> = (0..3 * stride).map(|i| i as f32).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let (mut kc, mut vc) = (vec![0.0f32; 5 * width], vec![0.0f32; 5 * width]);
    let rows = NewRows {
        k: &k[..2 * stride + width],
        v: &v[..2 * stride + width],
        k_stride: stride,
        v_stride: stride,
        slots: &[4, -1, 0],
    };
    write_rows(&mut kc, &mut vc, &rows, width).unwrap();
    assert_eq!(&kc[4 * width..], &k[..width]);
    assert_eq!(&vc[..width], &v[2 * stride..2 * stride + width]);
    assert!(
        kc[width..4 * width].iter().all(|&x| x == 0.0),
        "slot -1 is not written"
    );
    let bad = NewRows {
        slots: &[5],
        ..rows
    };
    let err = write_rows(&mut kc, &mut vc, &bad, width).unwrap_err();
    assert!(err.to_string().starts_with("slot_mapping"), "{err}");
}
#[test]
fn exp_is_close_to_libm() {
    let mut worst = 0.0f32;
    for i in 0..=100_000 {
        let x = -90.0 * i as f32 / 100_000.0;
        let (got, want) = (exp(x), x.exp());
        if want > 1e-30 {
            worst = worst.max((got - want).abs() / want);
        }
    }
    assert!(worst < 4e-7, "max relative error {worst}");
    assert_eq!(exp(0.0), 1.0);
}

#[test]
fn soft_capped_logits_match_reference() {
    let mut rng = Rng(33);
    for &(hq, hkv, d, bs) in &[(4, 2, 16, 4), (9, 3, 64, 16)] {
        for (cap, window) in [(0.5, None), (2.0, Some(3))] {
            let mut case = Case::random(&mut rng, hq, hkv, d, bs, 4);
            // Logits of several units, so a cap of 0.5 or 2 bends them far from linear.
            case.q.iter_mut().for_each(|x| *x *= 8.0);
            case.softcap = Some(cap);
            case.window = window;
            let want = case.reference();
            for path in paths() {
                let mut out = vec![0.0; case.q.len()];
                paged_decode_on(&case.args(), &mut out, 2, path).unwrap();
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-4, "{path:?}: {a} vs {b} (cap {cap})");
                }
            }
            case.softcap = None;
            let plain = case.reference();
            let moved = max_diff(&want, &plain);
            assert!(
                moved > 1e-2,
                "the cap must change the result here ({moved})"
            );
        }
    }
    let mut case = Case::random(&mut rng, 2, 1, 8, 4, 1);
    case.softcap = Some(0.0);
    let mut out = vec![0.0; case.q.len()];
    assert!(paged_decode(&case.args(), &mut out, 1).is_err());
}

#[test]
fn sinks_join_the_denominator_only() {
    let mut rng = Rng(41);
    for &(hq, hkv, d, bs) in &[(4, 2, 16, 4), (8, 1, 32, 8), (9, 3, 64, 16)] {
        for window in [None, Some(3)] {
            let mut case = Case::random(&mut rng, hq, hkv, d, bs, 5);
            // Sinks around the logits' own size (one far above them: weight ~0 left for the keys), and
            // the whole head range, so a head index off by one shows.
            let sinks: Vec<f32> = (0..hq)
                .map(|h| h as f32 - 1.5 + 30.0 * (h == 1) as u8 as f32)
                .collect();
            case.sinks = Some(sinks);
            case.window = window;
            let want = case.reference();
            for path in paths() {
                let mut out = vec![0.0; case.q.len()];
                paged_decode_on(&case.args(), &mut out, 3, path).unwrap();
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-5, "{path:?}: {a} vs {b}");
                }
            }
            case.sinks = None;
            let plain = case.reference();
            let moved = max_diff(&want, &plain);
            assert!(
                moved > 1e-2,
                "the sinks must change the result here ({moved})"
            );
        }
    }
    let mut case = Case::random(&mut rng, 4, 2, 8, 4, 1);
    case.sinks = Some(vec![0.0; 3]);
    let mut out = vec![0.0; case.q.len()];
    assert!(paged_decode(&case.args(), &mut out, 1).is_err());
    case.sinks = Some(vec![0.0, f32::NAN, 0.0, 0.0]);
    assert!(paged_decode(&case.args(), &mut out, 1).is_err());
}

/// Blocks of `bs` positions that take `rows` rows of `hq` heads of `d` past `split_heads`'
/// threshold even under the half-context window of odd trials (`long_case`), and not much more:
/// short contexts keep the debug build's tests quick.
fn past_split(rows: usize, hq: usize, d: usize, bs: usize) -> usize {
    2 * (SPLIT_MIN_WORK / (rows * hq * d * bs) + 2)
}

/// One sequence of `blocks` blocks in a shuffled pool (3 blocks spare), its last block partly
/// filled, random K and V, and trial `trial`'s variant: a window (odd trials), a soft-cap (2),
/// sinks (3).
fn long_case(
    rng: &mut Rng,
    (hq, hkv, d, bs): (usize, usize, usize, usize),
    blocks: usize,
    trial: usize,
) -> Case {
    let mut case = Case::random(rng, hq, hkv, d, bs, 1);
    let num_blocks = blocks + 3;
    case.shape.max_blocks = blocks;
    case.shape.num_blocks = num_blocks;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.index(i + 1));
    }
    case.tables = ids[..blocks].to_vec();
    case.lens = vec![(blocks * bs - rng.index(bs)) as i32];
    case.k = rng.floats(num_blocks * bs * hkv * d);
    case.v = rng.floats(num_blocks * bs * hkv * d);
    case.window = [None, Some(blocks * bs / 2 + 1)][trial % 2];
    case.softcap = (trial == 2).then_some(4.0);
    case.sinks = (trial == 3).then(|| rng.floats(hq));
    case
}

/// One sequence on several threads splits its query heads between them (long enough contexts),
/// cutting KV heads' groups where the runs end (MQA's one group included): every path gives the
/// bits of one thread, with windows, soft-caps and sinks, and stays close to the reference; a
/// stride that is not the cache's row is refused.
#[test]
fn one_sequence_split_over_heads_keeps_its_bits() {
    let mut rng = Rng(59);
    let shapes = [
        (9, 3, 64, 16),
        (8, 8, 32, 16),
        (12, 2, 128, 16),
        (6, 6, 16, 8),
        (4, 4, 48, 16),
        (4, 1, 64, 16),
        (5, 1, 32, 16),
    ];
    for (&(hq, hkv, d, bs), path) in shapes.iter().flat_map(|s| paths().map(move |p| (s, p))) {
        for trial in 0..4 {
            // contexts past the split threshold (and one under it, trial 0)
            let blocks = if trial == 0 {
                2
            } else {
                past_split(1, hq, d, bs) + rng.index(8)
            };
            let case = long_case(&mut rng, (hq, hkv, d, bs), blocks, trial);
            let run = |threads: usize| {
                let mut out = vec![f32::NAN; hq * d];
                paged_decode_on(&case.args(), &mut out, threads, path).unwrap();
                out
            };
            let one = run(1);
            for threads in [2, 3, 8] {
                let got = run(threads);
                assert!(
                    got.iter()
                        .zip(&one)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{path:?} Hq={hq} Hkv={hkv} D={d} trial {trial} threads {threads}"
                );
            }
            let err = max_diff(&one, &case.reference());
            assert!(err < 1e-5, "{path:?} trial {trial}: max error {err}");
        }
    }
    let mut case = Case::random(&mut rng, 4, 2, 16, 4, 1);
    case.shape.kv_stride += 16;
    let mut out = vec![0.0; case.q.len()];
    assert!(paged_decode(&case.args(), &mut out, 2).is_err());
}

/// One sequence's verification rows (3-6) alone in a call, long enough to split: the threads take
/// runs of query heads for every row (`split_heads`); each row comes out bit for bit as alone on one
/// thread, with windows, soft-caps and sinks, and close to the reference.
#[test]
fn one_sequences_rows_split_over_heads_keep_their_bits() {
    let mut rng = Rng(61);
    let shapes = [
        (9, 3, 64, 16),
        (4, 1, 64, 16),
        (12, 2, 128, 16),
        (6, 6, 16, 8),
    ];
    for (&(hq, hkv, d, bs), path) in shapes.iter().flat_map(|s| paths().map(move |p| (s, p))) {
        for trial in 0..4 {
            let k = 3 + rng.index(4);
            let blocks = past_split(k, hq, d, bs) + rng.index(8);
            let mut case = long_case(&mut rng, (hq, hkv, d, bs), blocks, trial);
            // k rows of the one table, ending at its length
            let last = case.lens[0];
            case.shape.num_seqs = k;
            case.tables = case.tables.repeat(k);
            case.lens = (0..k as i32).map(|j| last - (k as i32 - 1) + j).collect();
            case.q = rng.floats(k * hq * d);
            let width = hq * d;
            let alone: Vec<Vec<f32>> = (0..k)
                .map(|row| {
                    let one = DecodeArgs {
                        shape: DecodeShape {
                            num_seqs: 1,
                            ..case.shape
                        },
                        q: &case.q[row * width..(row + 1) * width],
                        block_tables: &case.tables[..blocks],
                        seq_lens: &case.lens[row..row + 1],
                        ..case.args()
                    };
                    let mut out = vec![f32::NAN; width];
                    paged_decode_on(&one, &mut out, 1, path).unwrap();
                    out
                })
                .collect();
            for threads in [2, 3, 8] {
                let mut out = vec![f32::NAN; k * width];
                paged_decode_on(&case.args(), &mut out, threads, path).unwrap();
                for (row, want) in alone.iter().enumerate() {
                    let got = &out[row * width..(row + 1) * width];
                    assert!(
                        got.iter().zip(want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{path:?} Hq={hq} Hkv={hkv} D={d} trial {trial} threads {threads}: row {row} of {k}"
                    );
                }
            }
            let err = max_diff(&alone.concat(), &case.reference());
            assert!(err < 1e-5, "{path:?} trial {trial}: max error {err}");
        }
    }
}

/// A speculative verification's rows: one sequence's table repeated for rows at consecutive
/// positions (`_row_plan`). They are attended as one group that reads the cache once; each row
/// must come out bit for bit as when it is the only row of a call, with windows, soft-caps and
/// sinks, at any thread count, and next to rows of other sequences.
#[test]
fn rows_sharing_a_table_equal_each_row_alone() {
    let mut rng = Rng(23);
    let shapes = [
        (9, 3, 64, 16),
        (4, 4, 16, 4),
        (6, 2, 40, 8),
        (8, 1, 128, 16),
        (8, 2, 80, 16),
        (8, 2, 48, 16),
        (10, 2, 64, 16),
    ];
    for (&(hq, hkv, d, bs), path) in shapes.iter().flat_map(|s| paths().map(move |p| (s, p))) {
        for trial in 0..6 {
            // two sequences: `a` verifies `k` rows, `b` decodes one
            let mut case = Case::random(&mut rng, hq, hkv, d, bs, 2);
            let m = case.shape.max_blocks;
            let k = 1 + rng.index(6);
            let cap = (m * bs) as i32;
            let base = (1 + rng.index((m * bs).saturating_sub(k).max(1))) as i32;
            let a_table = case.tables[..m].to_vec();
            let b_table = case.tables[m..].to_vec();
            let b_len = case.lens[1];
            let mut tables = Vec::new();
            let mut lens = Vec::new();
            for j in 0..k {
                tables.extend_from_slice(&a_table);
                lens.push((base + j as i32).min(cap));
            }
            tables.extend_from_slice(&b_table);
            lens.push(b_len);
            let n = k + 1;
            case.shape.num_seqs = n;
            case.tables = tables;
            case.lens = lens;
            case.q = rng.floats(n * hq * d);
            case.window = [None, Some(3), Some(bs + 1)][trial % 3];
            case.softcap = (trial % 2 == 1).then_some(4.0);
            case.sinks = (trial % 4 == 3).then(|| rng.floats(hq));
            let width = hq * d;
            for threads in [1, 2, 3] {
                let mut out = vec![f32::NAN; n * width];
                paged_decode_on(&case.args(), &mut out, threads, path).unwrap();
                for row in 0..n {
                    let mut one = DecodeArgs {
                        shape: DecodeShape {
                            num_seqs: 1,
                            ..case.shape
                        },
                        ..case.args()
                    };
                    one.q = &case.q[row * width..(row + 1) * width];
                    one.block_tables = &case.tables[row * m..(row + 1) * m];
                    one.seq_lens = &case.lens[row..row + 1];
                    let mut alone = vec![f32::NAN; width];
                    paged_decode_on(&one, &mut alone, 1, path).unwrap();
                    let got = &out[row * width..(row + 1) * width];
                    assert!(
                        got.iter()
                            .zip(&alone)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{path:?} Hq={hq} D={d} trial {trial} threads {threads}: row {row} of {n} differs"
                    );
                }
                let want = case.reference();
                let err = max_diff(&out, &want);
                assert!(
                    err < 1e-5,
                    "trial {trial}: max error {err} against the reference"
                );
            }
        }
    }
}

/// Random shapes (GQA groups 1, 3, 4, 8, and 5 and 6, which the AVX-512 logits take in two
/// chunks of query heads; head dims the AVX-512 and AVX2 paths serve and some
/// only the AVX2 one does; odd lengths and block sizes) with random windows, soft-caps and sinks, in f32, bf16 and
/// f16 caches, on every path: close to the f64 reference, and each row of a batch bit for bit
/// the row computed alone.
#[test]
fn random_shapes_and_options_match_the_reference_row_by_row() {
    use crate::cpu::elem::{Bf16, F16};
    fn run<T: Elem>(case: &Case, path: Path, threads: usize) -> Vec<f32> {
        let conv = |xs: &[f32]| xs.iter().map(|&x| T::store(x)).collect::<Vec<T>>();
        let (q, k, v) = (conv(&case.q), conv(&case.k), conv(&case.v));
        let f = case.args();
        let args = DecodeArgs {
            shape: f.shape,
            q: &q,
            q_stride: f.q_stride,
            k_cache: &k,
            v_cache: &v,
            block_tables: f.block_tables,
            seq_lens: f.seq_lens,
            scale: f.scale,
            window: f.window,
            softcap: f.softcap,
            sinks: f.sinks,
        };
        let mut out = vec![T::store(f32::NAN); q.len()];
        paged_decode_on(&args, &mut out, threads, path).unwrap();
        out.iter().map(|x| x.load()).collect()
    }
    fn check<T: Elem>(case: &Case, want: &[f32], tol: f32, what: &str) {
        let s = case.shape;
        let width = s.num_q_heads * s.head_dim;
        for path in paths() {
            let threads = 1 + (s.num_seqs % 3);
            let got = run::<T>(case, path, threads);
            let err = max_diff(&got, want);
            assert!(err < tol, "{what} {path:?}: max error {err}");
            for row in 0..s.num_seqs {
                let m = s.max_blocks;
                let one = Case {
                    shape: DecodeShape { num_seqs: 1, ..s },
                    q: case.q[row * width..(row + 1) * width].to_vec(),
                    k: case.k.clone(),
                    v: case.v.clone(),
                    tables: case.tables[row * m..(row + 1) * m].to_vec(),
                    lens: vec![case.lens[row]],
                    window: case.window,
                    softcap: case.softcap,
                    sinks: case.sinks.clone(),
                };
                let alone = run::<T>(&one, path, 1);
                let mine = &got[row * width..(row + 1) * width];
                assert!(
                    mine.iter()
                        .zip(&alone)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{what} {path:?}: row {row} of {} differs from the row alone",
                    s.num_seqs
                );
            }
        }
    }
    let mut rng = Rng(77);
    let dims = [64, 128, 80, 16, 40, 72, 24, 56];
    for trial in 0..32 {
        let hkv = 1 + rng.index(3);
        let group = [1, 3, 4, 8, 5, 6][trial % 6];
        let d = dims[rng.index(dims.len())];
        let bs = [16, 16, 1, 5, 8, 32][rng.index(6)];
        let n = 1 + rng.index(6);
        let mut case = Case::random(&mut rng, group * hkv, hkv, d, bs, n);
        // Some rows share the first row's table (a verification next to plain decode rows).
        let m = case.shape.max_blocks;
        for row in 1..n {
            if rng.index(2) == 0 {
                let t = case.tables[..m].to_vec();
                case.tables[row * m..(row + 1) * m].copy_from_slice(&t);
            }
        }
        case.window = [None, Some(1), Some(7), Some(bs + 3)][rng.index(4)];
        case.softcap = (rng.index(3) == 0).then_some(3.0);
        case.sinks = (rng.index(3) == 0).then(|| rng.floats(group * hkv));
        let what = format!(
            "trial {trial}: Hq={} Hkv={hkv} D={d} bs={bs} n={n} window={:?} softcap={:?} sinks={}",
            group * hkv,
            case.window,
            case.softcap,
            case.sinks.is_some()
        );
        let want = case.reference();
        check::<f32>(&case, &want, 1e-5, &what);
        // Half caches: inputs rounded first, so only the kernel's own rounding differs.
        for x in case.q.iter_mut().chain(&mut case.k).chain(&mut case.v) {
            *x = Bf16::store(*x).load();
        }
        let want = case.reference();
        check::<Bf16>(&case, &want, 4e-3, &what);
        check::<F16>(&case, &want, 5e-4, &what);
    }
}
