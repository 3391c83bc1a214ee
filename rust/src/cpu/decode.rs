//! One decoder layer's attention at decode, from the fused q|k|v projection output: qk-norm and
//! RoPE on q and k, the new K/V rows into the paged cache, and paged attention, in one call. At batch 1
//! each separate step is a Python call and a torch dispatch that costs more than its work (and
//! runs with cold caches right after a weight-streaming matmul), so the lean decode step makes
//! exactly one call here per layer.

use crate::cpu::attention::{paged_decode, write_rows, DecodeArgs, DecodeShape, NewRows};
use crate::cpu::elem::Elem;
use crate::cpu::ops::{qk_norm, rope, QkShape, RopeShape};
use crate::error::{CoreError, CoreResult};

/// The step's inputs besides the caches: `qkv` `[n, (Hq + 2 Hkv) * D]` (q heads, k heads, v
/// heads), each row's position, the rotary cos|sin table `[P, D]` (None: a NoPE layer) and each
/// row's cache slot; optionally a qk-norm (applied before RoPE) and the logit soft-cap.
pub struct QkvStep<'a, T: Elem> {
    pub qkv: &'a [T],
    pub positions: &'a [i64],
    pub rope_table: Option<&'a [T]>,
    pub slots: &'a [i64],
    pub block_tables: &'a [i32],
    pub seq_lens: &'a [i32],
    pub scale: f32,
    pub window: Option<usize>, // sliding window, as `DecodeArgs::window`
    pub qk_norm: Option<QkNorm<'a, T>>,
    pub softcap: Option<f32>, // as `DecodeArgs::softcap`
}

/// `ops::qk_norm`'s weights and epsilon.
#[derive(Clone, Copy)]
pub struct QkNorm<'a, T: Elem> {
    pub q_weight: &'a [T],
    pub k_weight: &'a [T],
    pub eps: f32,
}

/// Attend every row of `step.qkv` (one decode token per sequence) into `out` `[n, Hq * D]`,
/// after writing its rotated k and its v into the caches (rounded to the caches' type `C`, which
/// may be narrower than the activations' `T`: a 16-bit cache under f32 activations).
pub fn decode_from_qkv<T: Elem, C: Elem>(
    step: &QkvStep<T>,
    shape: DecodeShape,
    k_cache: &mut [C],
    v_cache: &mut [C],
    out: &mut [T],
    threads: usize,
) -> CoreResult<()> {
    let (n, hq, hkv, d) = (
        shape.num_seqs,
        shape.num_q_heads,
        shape.num_kv_heads,
        shape.head_dim,
    );
    let (qk_width, width) = ((hq + hkv) * d, (hq + 2 * hkv) * d);
    if step.qkv.len() != n * width {
        let r = format!(
            "has {} elements, expected {n} rows of {width}",
            step.qkv.len()
        );
        return Err(CoreError::invalid("qkv", r));
    }
    if step.slots.len() != n {
        let r = format!("has {} entries for {n} rows", step.slots.len());
        return Err(CoreError::invalid("slot_mapping", r));
    }
    if n == 0 {
        return Ok(());
    }
    // Rotated copies of q and k: the projection output stays as it was, and the kernel reads
    // q from here and writes k from here.
    let mut qk: Vec<T> = Vec::with_capacity(n * qk_width);
    for row in step.qkv.chunks_exact(width) {
        qk.extend_from_slice(&row[..qk_width]);
    }
    if let Some(norm) = step.qk_norm {
        let shape = QkShape {
            rows: n,
            stride: qk_width,
            q_width: hq * d,
            k_width: hkv * d,
        };
        qk_norm(&mut qk, shape, norm.q_weight, norm.k_weight, norm.eps)?;
    }
    if let Some(table) = step.rope_table {
        let rope_shape = RopeShape {
            rows: n,
            stride: qk_width,
            heads: hq + hkv,
            head_dim: d,
        };
        rope(&mut qk, rope_shape, step.positions, table, 1)?;
    }
    let q_len = (n - 1) * qk_width + hq * d; // up to the last row's q heads
                                             // Everything checked before the caches are touched.
    {
        let args = DecodeArgs {
            shape,
            q: &qk[..q_len],
            q_stride: qk_width,
            k_cache: &*k_cache,
            v_cache: &*v_cache,
            block_tables: step.block_tables,
            seq_lens: step.seq_lens,
            scale: step.scale,
            window: step.window,
            softcap: step.softcap,
            sinks: None,
        };
        args.validate(out.len())?;
    }
    let rows = NewRows {
        k: &qk[hq * d..],
        v: &step.qkv[qk_width..],
        k_stride: qk_width,
        v_stride: width,
        slots: step.slots,
    };
    write_rows(k_cache, v_cache, &rows, hkv * d)?;
    let args = DecodeArgs {
        shape,
        q: &qk[..q_len],
        q_stride: qk_width,
        k_cache,
        v_cache,
        block_tables: step.block_tables,
        seq_lens: step.seq_lens,
        scale: step.scale,
        window: step.window,
        softcap: step.softcap,
        sinks: None,
    };
    paged_decode(&args, out, threads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    /// Gemma's options: qk-norm, soft-cap, and a NoPE layer's missing table.
    #[derive(Clone, Copy)]
    struct Opts {
        norm: bool,
        rope: bool,
        softcap: Option<f32>,
    }

    /// The one call equals its parts: qk-norm and rope on a copy, write the rows, then the
    /// decode kernel.
    fn equals_parts(o: Opts) {
        let (hq, hkv, d, bs, n) = (4, 2, 8, 4, 3);
        let mut rng = Rng(17);
        let width = (hq + 2 * hkv) * d;
        let qkv = rng.floats(n * width);
        let table = rng.floats(32 * d);
        let (q_w, k_w) = (rng.floats(d), rng.floats(d));
        let positions = [5i64, 0, 9];
        let lens = [6, 1, 10];
        let tables = [0, 1, 2, 3, 4, 5, 6, 7, 8];
        let slots: Vec<i64> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                let pos = l as usize - 1;
                (tables[i * 3 + pos / bs] * bs as i32 + (pos % bs) as i32) as i64
            })
            .collect();
        let cache = rng.floats(9 * bs * hkv * d);
        let shape = DecodeShape {
            num_seqs: n,
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            num_blocks: 9,
            block_size: bs,
            max_blocks: 3,
            kv_stride: hkv * d,
        };
        let norm = QkNorm {
            q_weight: &q_w,
            k_weight: &k_w,
            eps: 1e-6,
        };
        let step = QkvStep {
            qkv: &qkv,
            positions: &positions,
            rope_table: o.rope.then_some(&table[..]),
            slots: &slots,
            block_tables: &tables,
            seq_lens: &lens,
            scale: 0.3,
            window: Some(5), // the window reaches the fused path too
            qk_norm: o.norm.then_some(norm),
            softcap: o.softcap,
        };
        let (mut kc, mut vc) = (cache.clone(), cache.clone());
        let mut out = vec![0.0f32; n * hq * d];
        decode_from_qkv(&step, shape, &mut kc, &mut vc, &mut out, 2).unwrap();

        let mut rotated = qkv.clone();
        if o.norm {
            let qs = QkShape {
                rows: n,
                stride: width,
                q_width: hq * d,
                k_width: hkv * d,
            };
            qk_norm(&mut rotated, qs, &q_w, &k_w, 1e-6).unwrap();
        }
        if o.rope {
            let rs = RopeShape {
                rows: n,
                stride: width,
                heads: hq + hkv,
                head_dim: d,
            };
            rope(&mut rotated, rs, &positions, &table, 1).unwrap();
        }
        let (mut kc2, mut vc2) = (cache.clone(), cache);
        let rows = NewRows {
            k: &rotated[hq * d..],
            v: &rotated[(hq + hkv) * d..],
            k_stride: width,
            v_stride: width,
            slots: &slots,
        };
        write_rows(&mut kc2, &mut vc2, &rows, hkv * d).unwrap();
        let args = DecodeArgs {
            shape,
            q: &rotated[..(n - 1) * width + hq * d],
            q_stride: width,
            k_cache: &kc2,
            v_cache: &vc2,
            block_tables: &tables,
            seq_lens: &lens,
            scale: 0.3,
            window: Some(5),
            softcap: o.softcap,
            sinks: None,
        };
        let mut want = vec![0.0f32; n * hq * d];
        paged_decode(&args, &mut want, 1).unwrap();
        assert_eq!((&kc, &vc, &out), (&kc2, &vc2, &want));
        if o.norm || !o.rope {
            return;
        }

        let bad = QkvStep {
            seq_lens: &[6, 1, 13],
            ..step
        };
        let (mut kc3, mut vc3) = (vec![0.0; kc2.len()], vec![0.0; kc2.len()]);
        let err = decode_from_qkv(&bad, shape, &mut kc3, &mut vc3, &mut out, 1).unwrap_err();
        assert!(err.to_string().starts_with("seq_lens"), "{err}");
        assert!(
            kc3.iter().all(|&x| x == 0.0),
            "nothing written when the arguments are bad"
        );
    }

    #[test]
    fn equals_rope_then_write_then_attend() {
        let plain = Opts {
            norm: false,
            rope: true,
            softcap: None,
        };
        equals_parts(plain);
        equals_parts(Opts {
            norm: true,
            softcap: Some(1.5),
            ..plain
        });
        equals_parts(Opts {
            rope: false,
            ..plain
        });
    }

    /// The options change the result: none is silently dropped on the way to the kernel.
    #[test]
    fn options_reach_the_kernel() {
        let (hq, hkv, d, bs) = (2, 1, 8, 4);
        let mut rng = Rng(3);
        let qkv: Vec<f32> = rng
            .floats((hq + 2 * hkv) * d)
            .iter()
            .map(|x| 4.0 * x)
            .collect();
        let table = rng.floats(8 * d);
        let w = rng.floats(d);
        let cache: Vec<f32> = rng
            .floats(2 * bs * hkv * d)
            .iter()
            .map(|x| 4.0 * x)
            .collect();
        let shape = DecodeShape {
            num_seqs: 1,
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            num_blocks: 2,
            block_size: bs,
            max_blocks: 2,
            kv_stride: hkv * d,
        };
        let run = |rope: bool, norm: bool, softcap: Option<f32>| {
            let step = QkvStep {
                qkv: &qkv,
                positions: &[5],
                rope_table: rope.then_some(&table[..]),
                slots: &[5],
                block_tables: &[0, 1],
                seq_lens: &[6],
                scale: 0.5,
                window: None,
                qk_norm: norm.then_some(QkNorm {
                    q_weight: &w,
                    k_weight: &w,
                    eps: 1e-6,
                }),
                softcap,
            };
            let (mut kc, mut vc) = (cache.clone(), cache.clone());
            let mut out = vec![0.0f32; hq * d];
            decode_from_qkv(&step, shape, &mut kc, &mut vc, &mut out, 1).unwrap();
            out
        };
        let base = run(true, false, None);
        assert_ne!(base, run(false, false, None));
        assert_ne!(base, run(true, true, None));
        assert_ne!(base, run(true, false, Some(0.5)));
    }
}
