//! A whole decode step of a stack of Llama-shaped layers over block-quantized weights, in one
//! call: per layer the pre-norm, the fused q|k|v matmul, `decode_from_qkv` (qk-norm, RoPE, the
//! cache write and paged attention), o with the residual add, the MLP's norm, gate_up, the
//! gated activation and down with the residual add.
//!
//! The Python lean step (`model/lean.py`) makes the same calls one by one; at one sequence the
//! Python between them (argument parsing, attribute lookups, numpy borrows: ~8 calls a layer)
//! cost about a quarter of a step of the default model. Every op here is the very kernel that
//! step calls with the same arguments, so a row gets the same bits either way (tests).

use crate::cpu::attention::DecodeShape;
use crate::cpu::decode::{decode_from_qkv, QkNorm, QkvStep};
use crate::cpu::elem::Elem;
use crate::cpu::ops::{self, GatedAct};
use crate::cpu::quant::{MatmulOpts, QMatrix};
use crate::error::{CoreError, CoreResult};

/// One layer's weights and attention options (the operands `lean_layer` passes its kernels).
pub struct Layer<'a> {
    pub input_norm: &'a [f32],
    pub post_norm: &'a [f32],
    pub qkv: &'a QMatrix,
    pub o: &'a QMatrix,
    pub gate_up: &'a QMatrix,
    pub down: &'a QMatrix,
    /// The biases of qkv, o, gate_up and down, each optional.
    pub bias: [Option<&'a [f32]>; 4],
    /// q and k norm weights (per head, or the projections' whole widths).
    pub qk_norm: Option<(&'a [f32], &'a [f32])>,
    /// The rotary cos|sin table `[P, D]`; None = a NoPE layer.
    pub rope_table: Option<&'a [f32]>,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    pub scale: f32,
    pub num_q_heads: usize,
    pub eps: f32,
    pub act: GatedAct,
}

/// A layer's paged caches `[num_blocks, block_size, Hkv, D]`.
pub struct Cache<'a, C: Elem> {
    pub k: &'a mut [C],
    pub v: &'a mut [C],
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// What every layer shares in the step: one row per token, as `decode_from_qkv` takes them.
pub struct Step<'a> {
    pub positions: &'a [i64],
    pub slots: &'a [i64],
    pub block_tables: &'a [i32],
    pub max_blocks: usize,
    pub seq_lens: &'a [i32],
    pub threads: usize,
}

/// The widths a layer's matmuls chain through, checked against each other.
struct Widths {
    qkv: usize,
    q: usize,
    inter: usize,
}

fn widths(l: &Layer, c: &Cache<impl Elem>, hidden: usize) -> CoreResult<Widths> {
    let (hq, hkv, d) = (l.num_q_heads, c.kv_heads, c.head_dim);
    let q = hq * d;
    let inter = l.gate_up.rows() / 2;
    let shapes = [
        ("qkv", l.qkv, (q + 2 * hkv * d, hidden)),
        ("o", l.o, (hidden, q)),
        ("gate_up", l.gate_up, (2 * inter, hidden)),
        ("down", l.down, (hidden, inter)),
    ];
    for (name, m, (rows, cols)) in shapes {
        if (m.rows(), m.cols()) != (rows, cols) || rows == 0 {
            let r = format!(
                "is [{}, {}], the layer needs [{rows}, {cols}]",
                m.rows(),
                m.cols()
            );
            return Err(CoreError::invalid(name, r));
        }
    }
    let outs = [(l.qkv, l.bias[0]), (l.o, l.bias[1]), (l.gate_up, l.bias[2])];
    for (name, (m, b)) in ["qkv_bias", "o_bias", "gate_up_bias"].into_iter().zip(outs) {
        check_bias(name, b, m.rows())?;
    }
    check_bias("down_bias", l.bias[3], hidden)?;
    for (name, w) in [("input_norm", l.input_norm), ("post_norm", l.post_norm)] {
        if w.len() != hidden {
            let r = format!("has {} elements, hidden is {hidden}", w.len());
            return Err(CoreError::invalid(name, r));
        }
    }
    Ok(Widths {
        qkv: q + 2 * hkv * d,
        q,
        inter,
    })
}

fn check_bias(name: &'static str, b: Option<&[f32]>, n: usize) -> CoreResult<()> {
    match b {
        Some(b) if b.len() != n => {
            let r = format!("has {} elements for {n} outputs", b.len());
            Err(CoreError::invalid(name, r))
        }
        _ => Ok(()),
    }
}

/// Run every layer over the residual stream `h` `[t, hidden]` in place, layer `i` on
/// `caches[i]`; `scratch` is grown as needed and reused across calls.
pub fn run<C: Elem>(
    layers: &[Layer],
    caches: &mut [Cache<C>],
    step: &Step,
    h: &mut [f32],
    hidden: usize,
    scratch: &mut Vec<f32>,
) -> CoreResult<()> {
    if layers.len() != caches.len() {
        let r = format!("{} caches for {} layers", caches.len(), layers.len());
        return Err(CoreError::invalid("caches", r));
    }
    if hidden == 0 || !h.len().is_multiple_of(hidden) {
        let r = format!("{} elements are not rows of {hidden}", h.len());
        return Err(CoreError::invalid("h", r));
    }
    let t = h.len() / hidden;
    if step.seq_lens.len() != t || step.positions.len() != t {
        let r = format!(
            "{} lengths and {} positions for {t} rows",
            step.seq_lens.len(),
            step.positions.len()
        );
        return Err(CoreError::invalid("seq_lens", r));
    }
    // Every layer's shapes before the first cache write: a bad layer fails the step untouched.
    let ws = layers
        .iter()
        .zip(caches.iter())
        .map(|(l, c)| widths(l, c, hidden))
        .collect::<CoreResult<Vec<_>>>()?;
    let need = ws
        .iter()
        .map(|w| t * (hidden + w.qkv + w.q + 3 * w.inter))
        .max()
        .unwrap_or(0);
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    for ((l, c), w) in layers.iter().zip(caches.iter_mut()).zip(&ws) {
        let (x, rest) = scratch.split_at_mut(t * hidden);
        let (qkv, rest) = rest.split_at_mut(t * w.qkv);
        let (attn, rest) = rest.split_at_mut(t * w.q);
        let (gu, rest) = rest.split_at_mut(t * 2 * w.inter);
        let act = &mut rest[..t * w.inter];
        layer(l, c, step, h, hidden, t, [x, qkv, attn, gu, act])?;
    }
    Ok(())
}

fn layer<C: Elem>(
    l: &Layer,
    c: &mut Cache<C>,
    step: &Step,
    h: &mut [f32],
    hidden: usize,
    t: usize,
    [x, qkv, attn, gu, act]: [&mut [f32]; 5],
) -> CoreResult<()> {
    let threads = step.threads;
    let opts = |bias, accumulate| MatmulOpts {
        accumulate,
        bias,
        threads,
        isa: None,
    };
    ops::rms_norm(h, Some(l.input_norm), l.eps, x, hidden, threads)?;
    l.qkv.matmul(x, t, qkv, &opts(l.bias[0], false))?;
    let qk_step = QkvStep {
        qkv,
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
        num_q_heads: l.num_q_heads,
        num_kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        num_blocks: c.num_blocks,
        block_size: c.block_size,
        max_blocks: step.max_blocks,
        kv_stride: c.kv_heads * c.head_dim,
    };
    decode_from_qkv(&qk_step, shape, c.k, c.v, attn, threads)?;
    l.o.matmul(attn, t, h, &opts(l.bias[1], true))?;
    ops::rms_norm(h, Some(l.post_norm), l.eps, x, hidden, threads)?;
    l.gate_up.matmul(x, t, gu, &opts(l.bias[2], false))?;
    let inter = l.down.cols();
    ops::act_and_mul(gu, act, inter, threads, l.act)?;
    l.down.matmul(act, t, h, &opts(l.bias[3], true))
}

#[cfg(test)]
#[path = "lean_tests.rs"]
mod tests;
