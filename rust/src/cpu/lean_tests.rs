use super::*;
use crate::cpu::elem::Bf16;
use crate::test_rng::Rng;

/// A random stack: `layers` layers of hidden 64, 4 query / 2 KV heads of 16, MLP 96, 4-bit
/// and 8-bit matrices mixed, biases on some, qk-norm and a window on others.
struct Model {
    norms: Vec<(Vec<f32>, Vec<f32>)>,
    mats: Vec<[QMatrix; 4]>,
    biases: Vec<[Option<Vec<f32>>; 4]>,
    qk: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    table: Vec<f32>,
}

const HIDDEN: usize = 64;
const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 16;
const INTER: usize = 96;
const BS: usize = 4;
const BLOCKS: usize = 12;

fn model(rng: &mut Rng, layers: usize) -> Model {
    let mut m = Model {
        norms: vec![],
        mats: vec![],
        biases: vec![],
        qk: vec![],
        table: rng.floats(64 * D),
    };
    let shapes = [
        ((HQ + 2 * HKV) * D, HIDDEN),
        (HIDDEN, HQ * D),
        (2 * INTER, HIDDEN),
        (HIDDEN, INTER),
    ];
    for i in 0..layers {
        let bits = if i % 2 == 0 { 4 } else { 8 };
        let mats = shapes.map(|(r, c)| {
            let w: Vec<f32> = rng.floats(r * c).iter().map(|v| v * 0.3).collect();
            QMatrix::quantize(&w, r, c, bits, 32).unwrap()
        });
        let biases = shapes.map(|(r, _)| rng.chance(50).then(|| rng.floats(r)));
        let norm = |rng: &mut Rng| rng.floats(HIDDEN).iter().map(|v| 1.0 + 0.2 * v).collect();
        m.norms.push((norm(rng), norm(rng)));
        m.mats.push(mats);
        m.biases.push(biases);
        m.qk.push((i == 1).then(|| (rng.floats(D), rng.floats(D))));
    }
    m
}

impl Model {
    fn layer(&self, i: usize) -> Layer<'_, f32> {
        let [qkv, o, gate_up, down] = &self.mats[i];
        Layer {
            input_norm: &self.norms[i].0,
            post_norm: &self.norms[i].1,
            qkv,
            o,
            mlp: Mlp::Dense {
                gate_up,
                down,
                act: if i == 1 {
                    GatedAct::GeluTanh
                } else {
                    GatedAct::Silu
                },
            },
            bias: std::array::from_fn(|j| self.biases[i][j].as_deref()),
            qk_norm: self.qk[i].as_ref().map(|(q, k)| (&q[..], &k[..])),
            rope_table: (i != 2).then_some(&self.table[..]),
            window: (i == 2).then_some(3),
            softcap: (i == 0).then_some(20.0),
            scale: 0.25,
            num_q_heads: HQ,
            eps: 1e-5,
        }
    }
}

/// The same layer op by op, each kernel called on buffers of its own (what `lean_layer` does).
fn by_parts<C: Elem>(m: &Model, caches: &mut [(Vec<C>, Vec<C>)], step: &Step, h: &mut [f32]) {
    let t = h.len() / HIDDEN;
    let th = step.threads;
    for (i, (k, v)) in caches.iter_mut().enumerate() {
        let l = m.layer(i);
        let opts = |bias, accumulate| MatmulOpts {
            accumulate,
            bias,
            threads: th,
            isa: None,
        };
        let mut x = vec![0.0; t * HIDDEN];
        ops::rms_norm(h, Some(l.input_norm), l.eps, &mut x, HIDDEN, th).unwrap();
        let mut qkv = vec![0.0; t * (HQ + 2 * HKV) * D];
        let [qkv_w, o_w, gate_up, down] = &m.mats[i];
        qkv_w
            .matmul(&x, t, &mut qkv, &opts(l.bias[0], false))
            .unwrap();
        let qs = QkvStep {
            qkv: &qkv,
            positions: step.positions,
            rope_table: l.rope_table,
            slots: step.slots,
            block_tables: step.block_tables,
            seq_lens: step.seq_lens,
            scale: l.scale,
            window: l.window,
            qk_norm: l.qk_norm.map(|(q_weight, k_weight)| QkNorm {
                q_weight,
                k_weight,
                eps: l.eps,
            }),
            softcap: l.softcap,
        };
        let shape = DecodeShape {
            num_seqs: t,
            num_q_heads: HQ,
            num_kv_heads: HKV,
            head_dim: D,
            num_blocks: BLOCKS,
            block_size: BS,
            max_blocks: step.max_blocks,
            kv_stride: HKV * D,
        };
        let mut attn = vec![0.0; t * HQ * D];
        decode_from_qkv(&qs, shape, k, v, &mut attn, th).unwrap();
        o_w.matmul(&attn, t, h, &opts(l.bias[1], true)).unwrap();
        ops::rms_norm(h, Some(l.post_norm), l.eps, &mut x, HIDDEN, th).unwrap();
        let mut gu = vec![0.0; t * 2 * INTER];
        let Mlp::Dense { act, .. } = l.mlp else {
            unreachable!("a dense test model")
        };
        gate_up
            .matmul(&x, t, &mut gu, &opts(l.bias[2], false))
            .unwrap();
        let mut a = vec![0.0; t * INTER];
        ops::act_and_mul(&gu, &mut a, INTER, th, act).unwrap();
        down.matmul(&a, t, h, &opts(l.bias[3], true)).unwrap();
    }
}

/// The test caches as the stack's views.
fn views<C: Elem>(caches: &mut [(Vec<C>, Vec<C>)]) -> Vec<Cache<'_, C>> {
    caches
        .iter_mut()
        .map(|(k, v)| Cache {
            k,
            v,
            num_blocks: BLOCKS,
            block_size: BS,
            kv_heads: HKV,
            head_dim: D,
        })
        .collect()
}

fn fused<C: Elem>(m: &Model, caches: &mut [(Vec<C>, Vec<C>)], step: &Step, h: &mut [f32]) {
    let layers: Vec<Layer<f32>> = (0..caches.len()).map(|i| m.layer(i)).collect();
    let mut cs = views(caches);
    let streamed = run(&layers, &mut cs, step, h, HIDDEN, &mut Scratch::default()).unwrap();
    assert_eq!(streamed, vec![0; layers.len()]);
}

/// Two sequences (contexts 7 and 10, the last row of each new) and a third row of the first
/// sequence's verification chunk, over 3 layers; f32 and bf16 caches; 1 and 2 threads.
fn same_bits<C: Elem>() {
    let mut rng = Rng(41);
    let m = model(&mut rng, 3);
    let lens = [7i32, 10, 8];
    let tables = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3];
    let positions: Vec<i64> = lens.iter().map(|&l| l as i64 - 1).collect();
    let slots: Vec<i64> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let pos = l as usize - 1;
            (tables[i * 4 + pos / BS] * BS as i32) as i64 + (pos % BS) as i64
        })
        .collect();
    for threads in [1, 2] {
        let step = Step {
            positions: &positions,
            slots: &slots,
            block_tables: &tables,
            max_blocks: 4,
            seq_lens: &lens,
            threads,
        };
        let h0 = rng.floats(3 * HIDDEN);
        let cache: Vec<(Vec<C>, Vec<C>)> = (0..3)
            .map(|_| {
                let n = BLOCKS * BS * HKV * D;
                let k = rng.floats(n).into_iter().map(C::store).collect();
                let v = rng.floats(n).into_iter().map(C::store).collect();
                (k, v)
            })
            .collect();
        let (mut a, mut b) = (cache.clone(), cache);
        let (mut ha, mut hb) = (h0.clone(), h0);
        by_parts(&m, &mut a, &step, &mut ha);
        fused(&m, &mut b, &step, &mut hb);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&ha), bits(&hb), "threads {threads}");
        let raw = |c: &[(Vec<C>, Vec<C>)]| -> Vec<u32> {
            c.iter()
                .flat_map(|(k, v)| k.iter().chain(v).map(|x| x.load().to_bits()))
                .collect()
        };
        assert_eq!(raw(&a), raw(&b), "the caches, threads {threads}");
        assert!(ha.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn the_fused_step_has_the_bits_of_its_parts() {
    same_bits::<f32>();
    same_bits::<Bf16>();
}

#[test]
fn a_mismatched_layer_fails_before_any_cache_is_written() {
    let mut rng = Rng(3);
    let m = model(&mut rng, 2);
    let mut layers: Vec<Layer<f32>> = (0..2).map(|i| m.layer(i)).collect();
    let wrong = QMatrix::quantize(&rng.floats(64 * 32), 64, 32, 8, 32).unwrap();
    layers[1].o = &wrong;
    let n = BLOCKS * BS * HKV * D;
    let mut kv: Vec<(Vec<f32>, Vec<f32>)> = (0..2).map(|_| (vec![0.0; n], vec![0.0; n])).collect();
    let mut cs = views(&mut kv);
    let step = Step {
        positions: &[0],
        slots: &[0],
        block_tables: &[0],
        max_blocks: 1,
        seq_lens: &[1],
        threads: 1,
    };
    let mut h = rng.floats(HIDDEN);
    let err = run(
        &layers,
        &mut cs,
        &step,
        &mut h,
        HIDDEN,
        &mut Scratch::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, CoreError::InvalidArgument { name: "o", .. }),
        "{err}"
    );
    drop(cs);
    assert!(kv.iter().all(|(k, v)| k.iter().chain(v).all(|&x| x == 0.0)));
}
