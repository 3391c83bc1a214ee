//! A MoE layer's routed experts in one call: `out[t] += Σ_j w[t, j] · E_ids[t, j](x[t])`, every
//! expert a gated MLP `down(act(gate_up(x)))` over two [`QMatrix`]es (int8 / int4 blocks,
//! load-time quantized or a GGUF file's own), run on the tiles of [`QMatrix::matmul`].
//!
//! The step's (token, choice) pairs are counting-sorted by expert (stable: token order within
//! an expert), so each routed expert multiplies one contiguous run of rows and an expert no token
//! chose is never read. The gathered rows are quantized once for all experts (a row's int8 blocks
//! do not depend on the rows beside it), then two parallel passes run over (routed expert, 16-row
//! group) items: gate_up, the activation, down. At decode (a row or two per expert, many experts)
//! the threads thus split the experts' columns between them with one fork a pass, where a matmul
//! per expert would fork twice an expert. The weighted rows are added in pair order, so the
//! result is bit for bit the per-expert composition of `matmul` calls (tests).

use super::act::{self, QActs};
use super::kernel::{self, OutPtr, TileFn};
use super::{Isa, QKind, QMatrix, ROWS};
use crate::cpu::ops::{self, GatedAct};
use crate::error::{CoreError, CoreResult};

/// The experts' activation on each gate_up row (`gate | up`, `2 * inter` wide) -> `inter`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MoeAct {
    /// `act(gate) * up` ([`ops::act_and_mul`]: SiLU, GELU-tanh).
    Gated(GatedAct),
    /// gpt-oss's SwiGLU: `(clamp(up, -limit, limit) + 1) · g σ(alpha g)` with `g = min(gate,
    /// limit)`, in transformers' order of operations.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// A layer's experts, all of one shape: `gate_up[i]` `[2I, H]` (gate rows, then up rows) and
/// `down[i]` `[H, I]` are expert `first + i` of `num_experts` (expert parallelism holds a run of
/// them), with optional biases `[len, 2I]` and `[len, H]`.
pub struct Experts<'a> {
    gate_up: Vec<&'a QMatrix>,
    down: Vec<&'a QMatrix>,
    gate_up_bias: Option<&'a [f32]>,
    down_bias: Option<&'a [f32]>,
    act: MoeAct,
    first: usize,
    num_experts: usize,
    hidden: usize,
    inter: usize,
}

/// Each token's `top_k` choices: `ids` and `weights`, `[t, top_k]` row-major.
#[derive(Clone, Copy, Debug)]
pub struct Routing<'a> {
    pub ids: &'a [i64],
    pub weights: &'a [f32],
    pub top_k: usize,
}

/// Whether any expert's matrix is Q6K: its tiles need the activations' half sums.
fn any_q6k(ws: &[&QMatrix]) -> bool {
    ws.iter().any(|w| w.kind() == QKind::Q6K)
}

fn check_len(name: &'static str, got: usize, want: usize, what: &str) -> CoreResult<()> {
    if got != want {
        let r = format!("has {got} elements, expected {what} = {want}");
        return Err(CoreError::invalid(name, r));
    }
    Ok(())
}

impl<'a> Experts<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gate_up: Vec<&'a QMatrix>,
        down: Vec<&'a QMatrix>,
        gate_up_bias: Option<&'a [f32]>,
        down_bias: Option<&'a [f32]>,
        act: MoeAct,
        first: usize,
        num_experts: usize,
    ) -> CoreResult<Self> {
        let Some(g0) = gate_up.first() else {
            return Err(CoreError::invalid("gate_up", "needs at least one expert"));
        };
        if down.len() != gate_up.len() {
            let r = format!("{} down matrices for {} gate_up", down.len(), gate_up.len());
            return Err(CoreError::invalid("down", r));
        }
        // The shape is the first gate_up's: each down has to fit it.
        let (hidden, inter) = (g0.cols(), g0.rows() / 2);
        for (i, (g, d)) in gate_up.iter().zip(&down).enumerate() {
            if g.rows() != 2 * inter || g.cols() != hidden {
                let r = format!(
                    "expert {i} is [{}, {}], expected [2 * {inter}, {hidden}]",
                    g.rows(),
                    g.cols()
                );
                return Err(CoreError::invalid("gate_up", r));
            }
            if d.rows() != hidden || d.cols() != inter {
                let r = format!(
                    "expert {i} is [{}, {}], expected [{hidden}, {inter}]",
                    d.rows(),
                    d.cols()
                );
                return Err(CoreError::invalid("down", r));
            }
        }
        let e = gate_up.len();
        if let Some(b) = gate_up_bias {
            check_len("gate_up_bias", b.len(), e * 2 * inter, "experts * 2I")?;
        }
        if let Some(b) = down_bias {
            check_len("down_bias", b.len(), e * hidden, "experts * hidden")?;
        }
        if first + e > num_experts {
            let r = format!(
                "experts {first}..{} exceed num_experts = {num_experts}",
                first + e
            );
            return Err(CoreError::invalid("first", r));
        }
        if let MoeAct::ClampedSwiglu { alpha, limit } = act {
            if !(alpha.is_finite() && limit >= 0.0 && limit.is_finite()) {
                let r = format!("alpha {alpha} and limit {limit} must be finite, limit >= 0");
                return Err(CoreError::invalid("clamp", r));
            }
        }
        Ok(Experts {
            gate_up,
            down,
            gate_up_bias,
            down_bias,
            act,
            first,
            num_experts,
            hidden,
            inter,
        })
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    pub fn inter(&self) -> usize {
        self.inter
    }

    /// `out[t] += Σ_j weights[t, j] · expert[ids[t, j]](x[t])` over this set's experts (ids of
    /// other ranks' experts are skipped), `x` and `out` `[t, hidden]`. Returns the weight bytes
    /// streamed: those of the experts some token chose.
    pub fn run(
        &self,
        x: &[f32],
        route: &Routing,
        out: &mut [f32],
        threads: usize,
        isa: Option<Isa>,
    ) -> CoreResult<usize> {
        let (h, k) = (self.hidden, route.top_k);
        if !x.len().is_multiple_of(h) {
            let r = format!("{} elements are not rows of hidden = {h}", x.len());
            return Err(CoreError::invalid("x", r));
        }
        let t = x.len() / h;
        check_len("out", out.len(), x.len(), "len(x)")?;
        if k == 0 {
            return Err(CoreError::invalid("ids", "needs top_k >= 1 columns"));
        }
        check_len("ids", route.ids.len(), t * k, "tokens * top_k")?;
        check_len("weights", route.weights.len(), t * k, "tokens * top_k")?;
        let isa = Isa::pick(isa)?;
        let (pairs, starts) = self.sort(route.ids)?;
        let total = pairs.len();
        if total == 0 {
            return Ok(0);
        }
        let mut xs = vec![0.0f32; total * h];
        for (row, &p) in xs.chunks_exact_mut(h).zip(&pairs) {
            row.copy_from_slice(&x[p / k * h..][..h]);
        }
        let active: Vec<usize> = (0..self.gate_up.len())
            .filter(|&l| starts[l + 1] > starts[l])
            .collect();
        let tile = kernel::tile_fn(isa);
        let pass = Pass {
            active: &active,
            starts: &starts,
            tile,
            isa,
            threads,
        };
        let inter = self.inter;
        let mut gu = vec![0.0f32; total * 2 * inter];
        let acts = act::quantize(&xs, total, h, threads, any_q6k(&self.gate_up));
        pass.run(&self.gate_up, self.gate_up_bias, &acts, &mut gu);
        let mut a = vec![0.0f32; total * inter];
        self.activate(&gu, &mut a, threads)?;
        let acts = act::quantize(&a, total, inter, threads, any_q6k(&self.down));
        let mut y = xs; // the gathered rows are spent: reuse their buffer, [total, h] as well
        pass.run(&self.down, self.down_bias, &acts, &mut y);
        combine(out, &y, &pairs, route, h, threads);
        let bytes = active
            .iter()
            .map(|&l| self.gate_up[l].nbytes() + self.down[l].nbytes());
        Ok(bytes.sum())
    }

    /// The local pairs (flat `t * top_k + j` indices) grouped by expert, stable, and where each
    /// local expert's run starts (`len + 1` offsets).
    fn sort(&self, ids: &[i64]) -> CoreResult<(Vec<usize>, Vec<usize>)> {
        let e = self.gate_up.len();
        let local = |id: i64| -> CoreResult<Option<usize>> {
            if id < 0 || id as usize >= self.num_experts {
                let r = format!(
                    "expert {id} out of range (num_experts = {})",
                    self.num_experts
                );
                return Err(CoreError::invalid("ids", r));
            }
            let l = (id as usize).wrapping_sub(self.first);
            Ok((l < e).then_some(l))
        };
        let mut starts = vec![0usize; e + 1];
        for &id in ids {
            if let Some(l) = local(id)? {
                starts[l + 1] += 1;
            }
        }
        for l in 0..e {
            starts[l + 1] += starts[l];
        }
        let mut next = starts.clone();
        let mut pairs = vec![0usize; starts[e]];
        for (p, &id) in ids.iter().enumerate() {
            if let Some(l) = local(id)? {
                pairs[next[l]] = p;
                next[l] += 1;
            }
        }
        Ok((pairs, starts))
    }

    fn activate(&self, gu: &[f32], a: &mut [f32], threads: usize) -> CoreResult<()> {
        match self.act {
            MoeAct::Gated(g) => ops::act_and_mul::<f32>(gu, a, self.inter, threads, g),
            MoeAct::ClampedSwiglu { alpha, limit } => {
                clamped_swiglu(gu, a, self.inter, alpha, limit);
                Ok(())
            }
        }
    }
}

/// One pass (gate_up or down) over the routed experts.
struct Pass<'a> {
    active: &'a [usize],
    starts: &'a [usize],
    tile: TileFn,
    isa: Isa,
    threads: usize,
}

impl Pass<'_> {
    /// Row `i` of `out` `[total, n]` = `acts` row `i` times its expert's matrix, `+ bias`.
    fn run(&self, mats: &[&QMatrix], bias: Option<&[f32]>, acts: &QActs, out: &mut [f32]) {
        let n = mats[0].rows();
        let groups = n.div_ceil(ROWS);
        let dst = OutPtr(out.as_mut_ptr());
        let dst = &dst;
        // Items run expert-major, so a part's contiguous share streams whole runs of one
        // expert's groups.
        kernel::steal(self.threads, self.active.len() * groups, &|item, res| {
            let (l, g) = (self.active[item / groups], item % groups);
            let rows = self.starts[l]..self.starts[l + 1];
            let b = bias.map(|b| &b[l * n..(l + 1) * n]);
            // SAFETY: `out` is `[total, n]`, expert `l`'s rows lie in `0..total`, and `steal`
            // hands each (expert, group) item, i.e. those rows' columns g*16 .. g*16 + 16,
            // to exactly one part.
            unsafe { mats[l].group_into(g, self.tile, self.isa, acts, rows, dst, b, false, res) }
        });
    }
}

/// `out[t] += w · y[j]` for each pair `j` (token `t`, weight `w`) in pair order: the product
/// rounded, then added, as a `y * w` then `index_add_` does.
fn combine(out: &mut [f32], y: &[f32], pairs: &[usize], route: &Routing, h: usize, threads: usize) {
    let k = route.top_k;
    // Parts own column ranges (multiples of 16 floats), so each element sees its pairs in order.
    let blocks = h.div_ceil(16);
    let parts = if pairs.len() * h < 1 << 15 {
        1
    } else {
        threads.clamp(1, blocks)
    };
    let dst = OutPtr(out.as_mut_ptr());
    let dst = &dst;
    crate::cpu::parallel::run_parts(parts, &|p| {
        let c0 = (blocks * p / parts * 16).min(h);
        let c1 = (blocks * (p + 1) / parts * 16).min(h);
        for (j, &pair) in pairs.iter().enumerate() {
            let w = route.weights[pair];
            // SAFETY: token `pair / k` < t and `c0..c1` within `h`: inside `out` `[t, h]`; the
            // parts' column ranges are disjoint.
            let o =
                unsafe { std::slice::from_raw_parts_mut(dst.0.add(pair / k * h + c0), c1 - c0) };
            for (o, &v) in o.iter_mut().zip(&y[j * h + c0..j * h + c1]) {
                *o += v * w;
            }
        }
    });
}

fn clamped_swiglu(gu: &[f32], out: &mut [f32], inter: usize, alpha: f32, limit: f32) {
    for (row, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (gate, up) = row.split_at(inter);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            let g = if g > limit { limit } else { g }; // not f32::min, which would drop a NaN
            let u = u.clamp(-limit, limit);
            let glu = g * (1.0 / (1.0 + (-(g * alpha)).exp()));
            *o = (u + 1.0) * glu;
        }
    }
}
