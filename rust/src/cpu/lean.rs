//! A whole decode step of a stack of Llama-shaped layers over block-quantized weights, in one
//! call: per layer the pre-norm, the fused q|k|v matmul, `decode_from_qkv` (qk-norm, RoPE, the
//! cache write and paged attention), o with the residual add, the MLP's norm, then gate_up, the
//! gated activation and down with the residual add, or for a MoE layer the router, the top-k
//! choice (`route.rs`) and the routed experts (`quant::Experts`) added to the residual.
//!
//! The Python lean step (`model/lean.py`) makes the same calls one by one; at one sequence the
//! Python between them (argument parsing, attribute lookups, numpy borrows: ~8 calls a layer)
//! cost about a quarter of a step of the default model. Every op here is the very kernel that
//! step calls with the same arguments, so a row gets the same bits either way (tests).

use crate::cpu::attention::DecodeShape;
use crate::cpu::decode::{decode_from_qkv, QkNorm, QkvStep};
use crate::cpu::elem::Elem;
use crate::cpu::ops::{self, GatedAct};
use crate::cpu::quant::{Experts, MatmulOpts, QMatrix, Routing};
use crate::cpu::route::{route_rows, Route};
use crate::error::{CoreError, CoreResult};

/// One layer's weights and attention options (the operands `lean_layer` passes its kernels).
pub struct Layer<'a> {
    pub input_norm: &'a [f32],
    pub post_norm: &'a [f32],
    pub qkv: &'a QMatrix,
    pub o: &'a QMatrix,
    pub mlp: Mlp<'a>,
    /// The biases of qkv, o, gate_up and down (a dense MLP's), each optional.
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
}

/// A layer's MLP: dense (`down(act(gate_up(x)))`) or a mixture of experts.
pub enum Mlp<'a> {
    Dense {
        gate_up: &'a QMatrix,
        down: &'a QMatrix,
        act: GatedAct,
    },
    Moe(Moe<'a>),
}

/// A MoE MLP: the router `[hidden, experts]` (float32, `[in, out]`) with its optional logit bias,
/// the routing and the routed experts (all of them: no expert parallelism here).
pub struct Moe<'a> {
    pub router: &'a [f32],
    pub router_bias: Option<&'a [f32]>,
    pub route: Route,
    pub experts: Experts<'a>,
}

/// The step's intermediate rows, grown as needed and reused across calls.
#[derive(Default)]
pub struct Scratch {
    f: Vec<f32>,
    ids: Vec<i64>,
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
    let mut shapes = vec![
        ("qkv", l.qkv, (q + 2 * hkv * d, hidden)),
        ("o", l.o, (hidden, q)),
    ];
    let inter = match &l.mlp {
        Mlp::Dense { gate_up, down, .. } => {
            let inter = gate_up.rows() / 2;
            shapes.push(("gate_up", gate_up, (2 * inter, hidden)));
            shapes.push(("down", down, (hidden, inter)));
            check_bias("gate_up_bias", l.bias[2], 2 * inter)?;
            check_bias("down_bias", l.bias[3], hidden)?;
            inter
        }
        Mlp::Moe(m) => {
            let e = m.router.len() / hidden.max(1);
            if m.router.len() != e * hidden || e == 0 || m.experts.hidden() != hidden {
                let r = format!(
                    "{} router weights and experts of hidden {} for hidden {hidden}",
                    m.router.len(),
                    m.experts.hidden()
                );
                return Err(CoreError::invalid("router", r));
            }
            if l.bias[2].is_some() || l.bias[3].is_some() {
                return Err(CoreError::invalid(
                    "biases",
                    "a MoE layer's experts hold theirs",
                ));
            }
            check_bias("router_bias", m.router_bias, e)?;
            0
        }
    };
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
    check_bias("qkv_bias", l.bias[0], q + 2 * hkv * d)?;
    check_bias("o_bias", l.bias[1], hidden)?;
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
/// `caches[i]`. Returns the expert weight bytes each layer streamed (0 for a dense MLP).
pub fn run<C: Elem>(
    layers: &[Layer],
    caches: &mut [Cache<C>],
    step: &Step,
    h: &mut [f32],
    hidden: usize,
    scratch: &mut Scratch,
) -> CoreResult<Vec<usize>> {
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
    let moe_need = |l: &Layer| match &l.mlp {
        Mlp::Moe(m) => t * (hidden + m.router.len() / hidden + m.route.top_k),
        Mlp::Dense { .. } => 0,
    };
    let need = ws
        .iter()
        .zip(layers)
        .map(|(w, l)| t * (hidden + w.qkv + w.q + 3 * w.inter) + moe_need(l))
        .max()
        .unwrap_or(0);
    if scratch.f.len() < need {
        scratch.f.resize(need, 0.0);
    }
    let mut streamed = Vec::with_capacity(layers.len());
    for ((l, c), w) in layers.iter().zip(caches.iter_mut()).zip(&ws) {
        let (x, rest) = scratch.f.split_at_mut(t * hidden);
        let (qkv, rest) = rest.split_at_mut(t * w.qkv);
        let (attn, rest) = rest.split_at_mut(t * w.q);
        attention(l, c, step, h, hidden, t, [&mut *x, qkv, attn])?;
        ops::rms_norm(h, Some(l.post_norm), l.eps, x, hidden, step.threads)?;
        streamed.push(match &l.mlp {
            Mlp::Dense { gate_up, down, act } => {
                let (gu, rest) = rest.split_at_mut(t * 2 * w.inter);
                let a = &mut rest[..t * w.inter];
                let opts = |bias, accumulate| MatmulOpts {
                    accumulate,
                    bias,
                    threads: step.threads,
                    isa: None,
                };
                gate_up.matmul(x, t, gu, &opts(l.bias[2], false))?;
                ops::act_and_mul(gu, a, w.inter, step.threads, *act)?;
                down.matmul(a, t, h, &opts(l.bias[3], true))?;
                0
            }
            Mlp::Moe(m) => moe(m, x, h, hidden, t, step.threads, rest, &mut scratch.ids)?,
        });
    }
    Ok(streamed)
}

/// The MoE MLP of normed rows `x` added into `h`: the experts' weighted sum into a zeroed branch,
/// then one add, as the per-layer step does (`MoeBlock` then `residual_add`).
#[allow(clippy::too_many_arguments)]
fn moe(
    m: &Moe,
    x: &[f32],
    h: &mut [f32],
    hidden: usize,
    t: usize,
    threads: usize,
    rest: &mut [f32],
    ids: &mut Vec<i64>,
) -> CoreResult<usize> {
    let (e, k) = (m.router.len() / hidden, m.route.top_k);
    let (logits, rest) = rest.split_at_mut(t * e);
    let (weights, rest) = rest.split_at_mut(t * k);
    let branch = &mut rest[..t * hidden];
    ids.resize(t * k, 0);
    route_rows(
        &m.route,
        x,
        m.router,
        m.router_bias,
        hidden,
        logits,
        ids,
        weights,
    )?;
    branch.fill(0.0);
    let routing = Routing {
        ids,
        weights,
        top_k: k,
    };
    let bytes = m.experts.run(x, &routing, branch, threads, None)?;
    ops::residual_add(branch, None, None, h, hidden, threads)?;
    Ok(bytes)
}

/// The attention half: `x` = input-normed `h`, q|k|v, attention into `attn`, `h += o(attn)`.
fn attention<C: Elem>(
    l: &Layer,
    c: &mut Cache<C>,
    step: &Step,
    h: &mut [f32],
    hidden: usize,
    t: usize,
    [x, qkv, attn]: [&mut [f32]; 3],
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
    l.o.matmul(attn, t, h, &opts(l.bias[1], true))
}

#[cfg(test)]
#[path = "lean_tests.rs"]
mod tests;
