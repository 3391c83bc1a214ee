//! A whole decode step of a stack of Llama-shaped layers, in one call, over block-quantized
//! weights (f32 rows) or the packed dense copies of `dense/` (bf16 or f32 rows, [`Proj`]): per
//! layer the pre-norm, the fused q|k|v matmul, `decode_from_qkv` (qk-norm, RoPE, the cache write
//! and paged attention), o with the residual add, the MLP's norm, then gate_up, the gated
//! activation and down with the residual add, or for a MoE layer the router, the top-k choice
//! (`route.rs`) and the routed experts (`quant::Experts`) added to the residual.
//!
//! The Python lean step (`model/lean.py`) makes the same calls one by one; at one sequence the
//! Python between them (argument parsing, attribute lookups, numpy borrows: ~8 calls a layer)
//! cost about a quarter of a step of the default model. Every op here is the very kernel that
//! step calls with the same arguments, so a row gets the same bits either way (tests).

use std::any::TypeId;

use crate::cpu::attention::DecodeShape;
use crate::cpu::decode::{decode_from_qkv, QkNorm, QkvStep};
use crate::cpu::dense::{PackedBf16, PackedF32};
use crate::cpu::elem::{Bf16, Elem};
use crate::cpu::ops::{self, GatedAct};
use crate::cpu::quant::{Experts, MatmulOpts, QMatrix, Routing};
use crate::cpu::route::{route_rows, Route};
use crate::error::{CoreError, CoreResult};

/// A projection the stack runs on activations `T`: `out [m, outputs] (+)= x [m, inputs] @ W^T
/// (+ bias)`, the bits of the same call from Python.
pub trait Proj<T>: Sync {
    /// `(inputs, outputs)`.
    fn dims(&self) -> (usize, usize);
    fn apply(
        &self,
        x: &[T],
        m: usize,
        out: &mut [T],
        accumulate: bool,
        bias: Option<&[f32]>,
        threads: usize,
    ) -> CoreResult<()>;
}

impl Proj<f32> for QMatrix {
    fn dims(&self) -> (usize, usize) {
        (self.cols(), self.rows())
    }
    fn apply(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        accumulate: bool,
        bias: Option<&[f32]>,
        threads: usize,
    ) -> CoreResult<()> {
        let opts = MatmulOpts {
            accumulate,
            bias,
            threads,
            isa: None,
        };
        self.matmul(x, m, out, &opts)
    }
}

/// The packed dense copies: their own `matmul` on rows of their element type.
macro_rules! packed_proj {
    ($packed:ty, $t:ty) => {
        impl Proj<$t> for $packed {
            fn dims(&self) -> (usize, usize) {
                (self.k(), self.n())
            }
            fn apply(
                &self,
                x: &[$t],
                m: usize,
                out: &mut [$t],
                accumulate: bool,
                bias: Option<&[f32]>,
                threads: usize,
            ) -> CoreResult<()> {
                self.matmul(x, m, out, accumulate, bias, threads)
            }
        }
    };
}

packed_proj!(PackedBf16, Bf16);
packed_proj!(PackedF32, f32);

/// One layer's weights and attention options (the operands `lean_layer` passes its kernels).
pub struct Layer<'a, T: Elem> {
    pub input_norm: &'a [T],
    pub post_norm: &'a [T],
    pub qkv: &'a dyn Proj<T>,
    pub o: &'a dyn Proj<T>,
    pub mlp: Mlp<'a, T>,
    /// The biases of qkv, o, gate_up and down (a dense MLP's), each optional.
    pub bias: [Option<&'a [f32]>; 4],
    /// q and k norm weights (per head, or the projections' whole widths).
    pub qk_norm: Option<(&'a [T], &'a [T])>,
    /// The rotary cos|sin table `[P, D]`; None = a NoPE layer.
    pub rope_table: Option<&'a [T]>,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    pub scale: f32,
    pub num_q_heads: usize,
    pub eps: f32,
}

/// A layer's MLP: dense (`down(act(gate_up(x)))`) or a mixture of experts (f32 rows only).
pub enum Mlp<'a, T: Elem> {
    Dense {
        gate_up: &'a dyn Proj<T>,
        down: &'a dyn Proj<T>,
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
pub struct Scratch<T> {
    f: Vec<T>,
    moe: Vec<f32>,
    ids: Vec<i64>,
}

impl<T> Default for Scratch<T> {
    fn default() -> Self {
        Scratch {
            f: Vec::new(),
            moe: Vec::new(),
            ids: Vec::new(),
        }
    }
}

/// `x` as f32 when `T` is f32 (a MoE layer's rows), else None.
fn as_f32<T: Elem>(x: &mut [T]) -> Option<&mut [f32]> {
    // SAFETY: T is f32 (the TypeId check), so this reinterprets nothing.
    (TypeId::of::<T>() == TypeId::of::<f32>())
        .then(|| unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<f32>(), x.len()) })
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

fn widths<T: Elem>(l: &Layer<T>, c: &Cache<impl Elem>, hidden: usize) -> CoreResult<Widths> {
    let (hq, hkv, d) = (l.num_q_heads, c.kv_heads, c.head_dim);
    let q = hq * d;
    check_proj("qkv", l.qkv, q + 2 * hkv * d, hidden)?;
    check_proj("o", l.o, hidden, q)?;
    let inter = match &l.mlp {
        Mlp::Dense { gate_up, down, .. } => {
            let inter = gate_up.dims().1 / 2;
            check_proj("gate_up", *gate_up, 2 * inter, hidden)?;
            check_proj("down", *down, hidden, inter)?;
            check_bias("gate_up_bias", l.bias[2], 2 * inter)?;
            check_bias("down_bias", l.bias[3], hidden)?;
            inter
        }
        Mlp::Moe(_) if TypeId::of::<T>() != TypeId::of::<f32>() => {
            return Err(CoreError::invalid("moe", "MoE layers take float32 rows"));
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

/// `p` maps `cols` inputs to `rows` outputs (QMatrix's `[rows, cols]`), or an error naming it.
fn check_proj<T>(name: &'static str, p: &dyn Proj<T>, rows: usize, cols: usize) -> CoreResult<()> {
    let (inputs, outputs) = p.dims();
    if (outputs, inputs) != (rows, cols) || rows == 0 {
        let r = format!("is [{outputs}, {inputs}], the layer needs [{rows}, {cols}]");
        return Err(CoreError::invalid(name, r));
    }
    Ok(())
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
pub fn run<T: Elem, C: Elem>(
    layers: &[Layer<T>],
    caches: &mut [Cache<C>],
    step: &Step,
    h: &mut [T],
    hidden: usize,
    scratch: &mut Scratch<T>,
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
    let moe_need = |l: &Layer<T>| match &l.mlp {
        Mlp::Moe(m) => t * (hidden + m.router.len() / hidden + m.route.top_k),
        Mlp::Dense { .. } => 0,
    };
    let need = ws
        .iter()
        .map(|w| t * (hidden + w.qkv + w.q + 3 * w.inter))
        .max()
        .unwrap_or(0);
    if scratch.f.len() < need {
        scratch.f.resize(need, T::store(0.0));
    }
    let moe_len = layers.iter().map(moe_need).max().unwrap_or(0);
    if scratch.moe.len() < moe_len {
        scratch.moe.resize(moe_len, 0.0);
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
                gate_up.apply(x, t, gu, false, l.bias[2], step.threads)?;
                ops::act_and_mul(gu, a, w.inter, step.threads, *act)?;
                down.apply(a, t, h, true, l.bias[3], step.threads)?;
                0
            }
            Mlp::Moe(m) => {
                let (Some(x), Some(h)) = (as_f32(x), as_f32(h)) else {
                    unreachable!("`widths` refused a MoE layer on rows other than f32")
                };
                moe(
                    m,
                    x,
                    h,
                    hidden,
                    t,
                    step.threads,
                    &mut scratch.moe,
                    &mut scratch.ids,
                )?
            }
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
fn attention<T: Elem, C: Elem>(
    l: &Layer<T>,
    c: &mut Cache<C>,
    step: &Step,
    h: &mut [T],
    hidden: usize,
    t: usize,
    [x, qkv, attn]: [&mut [T]; 3],
) -> CoreResult<()> {
    let threads = step.threads;
    ops::rms_norm(h, Some(l.input_norm), l.eps, x, hidden, threads)?;
    l.qkv.apply(x, t, qkv, false, l.bias[0], threads)?;
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
    l.o.apply(attn, t, h, true, l.bias[1], threads)
}

#[cfg(test)]
#[path = "lean_tests.rs"]
mod tests;
