//! Fused elementwise kernels of the decoder for the CPU: RMSNorm (also per head of q and k), rotary
//! embedding in place, SiLU-and-mul and GELU-tanh-and-mul. Each replaces a chain of torch ops (7
//! for RMSNorm, 7 for RoPE, 3 for SiLU-mul) with one pass over memory; at batch 1 those chains cost more in per-op dispatch than their
//! arithmetic, and at large batches the single pass saves the intermediate tensors' traffic.
//!
//! Every kernel reads f32, bf16 or f16 (`Elem`), computes in f32 and rounds once on the store.
//! The generic bodies are compiled three times (AVX-512, AVX2+FMA, baseline) and picked at run
//! time, so one wheel runs everywhere and vectorises for the CPU it lands on. Rows are split
//! across `threads` only when there is enough work to pay for waking them.

use std::sync::Mutex;

use crate::cpu::elem::Elem;
use crate::error::{CoreError, CoreResult};

/// Below this many elements a kernel runs on the calling thread: a fork-join on the OpenMP
/// pool costs a few microseconds, more than a decode row's whole norm or activation.
const PARALLEL_MIN_ELEMS: usize = 1 << 16;

/// `fn name<T: Elem>(args)` compiled for AVX-512, AVX2+FMA and baseline x86-64 (or the target's
/// baseline elsewhere), dispatched on the features this CPU reports.
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident<$t:ident: Elem>($($a:ident: $ty:ty),* $(,)?) $body:block) => {
        $vis fn $name<$t: Elem>($($a: $ty),*) {
            #[inline(always)]
            fn generic<$t: Elem>($($a: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw")]
            unsafe fn avx512<$t: Elem>($($a: $ty),*) {
                generic::<$t>($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<$t: Elem>($($a: $ty),*) {
                generic::<$t>($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                {
                    // SAFETY: the CPU supports AVX-512F and BW (checked just above).
                    return unsafe { avx512::<$t>($($a),*) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                    return unsafe { avx2::<$t>($($a),*) };
                }
            }
            generic::<$t>($($a),*)
        }
    };
}

/// Run `f(first_row, rows_of_out)` over `out` (rows of `row_len`, the last one may be cut
/// short), on up to `threads` threads when it holds at least `PARALLEL_MIN_ELEMS` elements.
fn par_rows<T: Send>(
    out: &mut [T],
    row_len: usize,
    threads: usize,
    f: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    let rows = out.len().div_ceil(row_len.max(1));
    let parts = if out.len() < PARALLEL_MIN_ELEMS {
        1
    } else {
        threads.clamp(1, rows.max(1))
    };
    if parts <= 1 || rows == 0 {
        return f(0, out);
    }
    let per = rows.div_ceil(parts);
    let chunks: Vec<Mutex<(usize, &mut [T])>> = out
        .chunks_mut(per * row_len)
        .enumerate()
        .map(|(i, c)| Mutex::new((i * per, c)))
        .collect();
    // Each chunk is locked by exactly one part: the mutex only proves the slices disjoint.
    crate::cpu::parallel::run_parts(chunks.len(), &|p| {
        let mut chunk = chunks[p].lock().unwrap_or_else(|e| e.into_inner());
        let (first, ref mut rows) = *chunk;
        f(first, rows);
    });
}

/// `x` is whole rows of `dim`, the output `(name, len)` as long as `x`, a weight one row.
fn check_rows<T>(
    x: &[T],
    dim: usize,
    out: (&'static str, usize),
    weight: Option<&[T]>,
) -> CoreResult<()> {
    if dim == 0 || !x.len().is_multiple_of(dim) {
        let r = format!("{} elements are not rows of {dim}", x.len());
        return Err(CoreError::invalid("x", r));
    }
    check_len(out.0, out.1, x.len())?;
    if let Some(w) = weight {
        check_len("weight", w.len(), dim)?;
    }
    Ok(())
}

fn check_len(name: &'static str, got: usize, want: usize) -> CoreResult<()> {
    if got != want {
        return Err(CoreError::invalid(
            name,
            format!("has {got} elements, expected {want}"),
        ));
    }
    Ok(())
}

/// `out = x / sqrt(mean(x^2) + eps) * weight` over rows of `dim` (weight `None` = all ones):
/// the Llama RMSNorm, statistics in f32 whatever the storage type.
pub fn rms_norm<T: Elem>(
    x: &[T],
    weight: Option<&[T]>,
    eps: f32,
    out: &mut [T],
    dim: usize,
    threads: usize,
) -> CoreResult<()> {
    check_rows(x, dim, ("out", out.len()), weight)?;
    par_rows(out, dim, threads, &|first, rows| {
        let x = &x[first * dim..first * dim + rows.len()];
        norm_rows(x, weight, eps, rows, dim)
    });
    Ok(())
}

simd_dispatch! {
    fn norm_rows<T: Elem>(x: &[T], weight: Option<&[T]>, eps: f32, out: &mut [T], dim: usize) {
        for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            let scale = 1.0 / (sum_squares(xr) / dim as f32 + eps).sqrt();
            match weight {
                Some(w) => {
                    for ((o, &v), &w) in or.iter_mut().zip(xr).zip(w) {
                        *o = T::store(v.load() * scale * w.load());
                    }
                }
                None => {
                    for (o, &v) in or.iter_mut().zip(xr) {
                        *o = T::store(v.load() * scale);
                    }
                }
            }
        }
    }
}

/// The norm of [`residual_add`]'s branch: RMSNorm with `weight` (`None` = all ones).
#[derive(Clone, Copy, Debug)]
pub struct BranchNorm<'a, T> {
    pub weight: Option<&'a [T]>,
    pub eps: f32,
}

/// `h += [scale *] [rms_norm(] x [)]` over rows of `dim`, in place on the residual stream `h`: a
/// branch's post-norm (Gemma, OLMo 2) and residual multiplier (Granite) and its add in one pass.
/// Each step rounds to `T` as the separate ops do (norm, then scale, then add), so the result
/// has the bits of `h + rms_norm(x) * scale` computed op by op.
pub fn residual_add<T: Elem>(
    x: &[T],
    norm: Option<BranchNorm<'_, T>>,
    scale: Option<f32>,
    h: &mut [T],
    dim: usize,
    threads: usize,
) -> CoreResult<()> {
    check_rows(x, dim, ("h", h.len()), norm.and_then(|n| n.weight))?;
    par_rows(h, dim, threads, &|first, rows| {
        let x = &x[first * dim..first * dim + rows.len()];
        add_rows(x, norm, scale, rows, dim)
    });
    Ok(())
}

simd_dispatch! {
    fn add_rows<T: Elem>(x: &[T], norm: Option<BranchNorm<'_, T>>, scale: Option<f32>, h: &mut [T],
                         dim: usize) {
        for (xr, hr) in x.chunks_exact(dim).zip(h.chunks_exact_mut(dim)) {
            let inv = norm.map(|n| 1.0 / (sum_squares(xr) / dim as f32 + n.eps).sqrt());
            let weight = norm.and_then(|n| n.weight);
            for (i, (o, &v)) in hr.iter_mut().zip(xr).enumerate() {
                let mut b = v.load();
                if let Some(inv) = inv {
                    b = T::store(b * inv * weight.map_or(1.0, |w| w[i].load())).load();
                }
                if let Some(s) = scale {
                    b = T::store(b * s).load();
                }
                *o = T::store(o.load() + b);
            }
        }
    }
}

/// Sixteen independent partial sums, so the reduction vectorises (float addition does not
/// reassociate on its own).
#[inline(always)]
fn sum_squares<T: Elem>(x: &[T]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let body = x.len() / LANES * LANES;
    for chunk in x[..body].chunks_exact(LANES) {
        for l in 0..LANES {
            let v = chunk[l].load();
            acc[l] += v * v;
        }
    }
    let tail: f32 = x[body..].iter().map(|v| v.load() * v.load()).sum();
    acc.iter().sum::<f32>() + tail
}

/// Where the rotary embedding goes: `rows` rows of `x`, `stride` elements apart, each starting
/// with `heads` heads of `head_dim` to rotate (q's heads then k's, in a fused q|k|v row).
#[derive(Clone, Copy, Debug)]
pub struct RopeShape {
    pub rows: usize,
    pub stride: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// Neox-style (rotate-half) rotary embedding, in place: for each head's halves (x1, x2) and the
/// row's position p, `x1' = x1 cos - x2 sin`, `x2' = x2 cos + x1 sin`, with cos|sin read from
/// `table` (`[P, head_dim]`: cos in the first half of a row, sin in the second).
pub fn rope<T: Elem>(
    x: &mut [T],
    shape: RopeShape,
    positions: &[i64],
    table: &[T],
    threads: usize,
) -> CoreResult<()> {
    let RopeShape {
        rows,
        stride,
        heads,
        head_dim: d,
    } = shape;
    if d == 0 || !d.is_multiple_of(2) {
        return Err(CoreError::invalid("head_dim", format!("{d} is not even")));
    }
    let width = heads * d;
    if rows > 1 && stride < width {
        let r = format!("row stride {stride} is shorter than {heads} heads of {d}");
        return Err(CoreError::invalid("x", r));
    }
    let need = if rows == 0 {
        0
    } else {
        (rows - 1) * stride + width
    };
    if x.len() < need {
        let r = format!("has {} elements, {rows} rows need {need}", x.len());
        return Err(CoreError::invalid("x", r));
    }
    check_len("positions", positions.len(), rows)?;
    if !table.len().is_multiple_of(d) {
        let r = format!("{} elements are not rows of {d}", table.len());
        return Err(CoreError::invalid("table", r));
    }
    let num_pos = (table.len() / d) as i64;
    if let Some(&p) = positions.iter().find(|&&p| p < 0 || p >= num_pos) {
        let r = format!("position {p} outside the table's {num_pos} rows");
        return Err(CoreError::invalid("positions", r));
    }
    // Whole rows per part: the last one ends at `need`, not at the full stride.
    let x = &mut x[..need];
    par_rows(x, stride.max(width), threads, &|first, part| {
        rope_rows(part, stride, heads, d, &positions[first..], table)
    });
    Ok(())
}

simd_dispatch! {
    fn rope_rows<T: Elem>(
        x: &mut [T],
        stride: usize,
        heads: usize,
        d: usize,
        positions: &[i64],
        table: &[T],
    ) {
        let half = d / 2;
        let mut cs = vec![0.0f32; d];
        let mut row_start = 0;
        let mut i = 0;
        while row_start < x.len() {
            let p = positions[i] as usize;
            for (c, &t) in cs.iter_mut().zip(&table[p * d..(p + 1) * d]) {
                *c = t.load();
            }
            let (cos, sin) = cs.split_at(half);
            for h in 0..heads {
                let head = &mut x[row_start + h * d..row_start + (h + 1) * d];
                let (x1, x2) = head.split_at_mut(half);
                for j in 0..half {
                    let (a, b) = (x1[j].load(), x2[j].load());
                    x1[j] = T::store(a * cos[j] - b * sin[j]);
                    x2[j] = T::store(b * cos[j] + a * sin[j]);
                }
            }
            row_start += stride;
            i += 1;
        }
    }
}

/// Which activation gates the up half in [`act_and_mul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatedAct {
    Silu,
    GeluTanh,
}

/// `out[r] = act(gate[r]) * up[r]` for rows `gate_up[r] = gate | up` of `2 * inter`.
pub fn act_and_mul<T: Elem>(
    gate_up: &[T],
    out: &mut [T],
    inter: usize,
    threads: usize,
    act: GatedAct,
) -> CoreResult<()> {
    if inter == 0 || !gate_up.len().is_multiple_of(2 * inter) {
        let r = format!("{} elements are not rows of 2 x {inter}", gate_up.len());
        return Err(CoreError::invalid("gate_up", r));
    }
    check_len("out", out.len(), gate_up.len() / 2)?;
    let rows_fn: fn(&[T], &mut [T], usize) = match act {
        GatedAct::Silu => silu_rows::<T>,
        GatedAct::GeluTanh => gelu_rows::<T>,
    };
    par_rows(out, inter, threads, &|first, rows| {
        let src = &gate_up[first * 2 * inter..(first * inter + rows.len()) * 2];
        rows_fn(src, rows, inter)
    });
    Ok(())
}

/// `out[r] = silu(gate[r]) * up[r]` for rows `gate_up[r] = gate | up` of `2 * inter`, with
/// `silu(g) = g / (1 + e^-g)`.
pub fn silu_and_mul<T: Elem>(
    gate_up: &[T],
    out: &mut [T],
    inter: usize,
    threads: usize,
) -> CoreResult<()> {
    act_and_mul(gate_up, out, inter, threads, GatedAct::Silu)
}

simd_dispatch! {
    fn silu_rows<T: Elem>(gate_up: &[T], out: &mut [T], inter: usize) {
        for (gu, o) in gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
            let (gate, up) = gu.split_at(inter);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                let g = g.load();
                *o = T::store(g / (1.0 + exp(-g)) * u.load());
            }
        }
    }
}

/// `out[r] = gelu_tanh(gate[r]) * up[r]` (GeGLU, Gemma's `gelu_pytorch_tanh`) for rows
/// `gate_up[r] = gate | up` of `2 * inter`. `0.5 g (1 + tanh(u))` is written as
/// `g / (1 + e^(-2u))`, u = sqrt(2/pi) (g + 0.044715 g^3): the same function, one `exp` and no
/// cancellation in `1 + tanh(u)` where u is very negative.
pub fn gelu_tanh_and_mul<T: Elem>(
    gate_up: &[T],
    out: &mut [T],
    inter: usize,
    threads: usize,
) -> CoreResult<()> {
    act_and_mul(gate_up, out, inter, threads, GatedAct::GeluTanh)
}

simd_dispatch! {
    fn gelu_rows<T: Elem>(gate_up: &[T], out: &mut [T], inter: usize) {
        const C: f32 = 0.797_884_6; // sqrt(2 / pi)
        for (gu, o) in gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
            let (gate, up) = gu.split_at(inter);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                let g = g.load();
                let inner = C * (g + 0.044_715 * g * g * g);
                *o = T::store(g / (1.0 + exp(-2.0 * inner)) * u.load());
            }
        }
    }
}

/// Where a qk-norm goes in a fused projection row: `rows` rows `stride` elements apart, each
/// starting with `q_width` elements of q then `k_width` of k.
#[derive(Clone, Copy, Debug)]
pub struct QkShape {
    pub rows: usize,
    pub stride: usize,
    pub q_width: usize,
    pub k_width: usize,
}

/// RMSNorm of q and k in place, before RoPE: q's elements in groups of `q_weight.len()` (one head
/// for Qwen3 / Gemma 3, the whole q for OLMo 2) each scaled by `q_weight`, k's likewise by
/// `k_weight`. Each group is `rms_norm`'s row: the same statistics and one rounding.
pub fn qk_norm<T: Elem>(
    x: &mut [T],
    shape: QkShape,
    q_weight: &[T],
    k_weight: &[T],
    eps: f32,
) -> CoreResult<()> {
    let QkShape {
        rows,
        stride,
        q_width,
        k_width,
    } = shape;
    for (name, w, width) in [
        ("q_weight", q_weight, q_width),
        ("k_weight", k_weight, k_width),
    ] {
        if w.is_empty() || !width.is_multiple_of(w.len()) {
            let r = format!("{} elements do not divide a width of {width}", w.len());
            return Err(CoreError::invalid(name, r));
        }
    }
    let width = q_width + k_width;
    if rows > 1 && stride < width {
        let r = format!("row stride {stride} is shorter than q and k ({width})");
        return Err(CoreError::invalid("x", r));
    }
    let need = if rows == 0 {
        0
    } else {
        (rows - 1) * stride + width
    };
    if x.len() < need {
        let r = format!("has {} elements, {rows} rows need {need}", x.len());
        return Err(CoreError::invalid("x", r));
    }
    let mut buf = vec![T::store(0.0); q_weight.len().max(k_weight.len())];
    for r in 0..rows {
        let row = &mut x[r * stride..r * stride + width];
        let (q, k) = row.split_at_mut(q_width);
        norm_in_place(q, q_weight, eps, &mut buf);
        norm_in_place(k, k_weight, eps, &mut buf);
    }
    Ok(())
}

/// `x`'s groups of `weight.len()` RMS-normed in place through `norm_rows` (a group is a head or
/// one projection: copying it costs less than a second kernel body to keep bit-equal).
fn norm_in_place<T: Elem>(x: &mut [T], weight: &[T], eps: f32, buf: &mut [T]) {
    let dim = weight.len();
    let buf = &mut buf[..dim];
    for group in x.chunks_exact_mut(dim) {
        buf.copy_from_slice(group);
        norm_rows(buf, Some(weight), eps, group, dim);
    }
}

/// e^x, branch-free so the loops that call it vectorise (libm's `expf` is a scalar call).
/// Cephes' single-precision scheme: x = n ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial
/// for e^r, then 2^n put straight into the exponent bits. n is rounded with the 1.5 * 2^23
/// trick (adding it leaves the integer in the low mantissa bits): `floor` plus a float-to-int
/// cast kept LLVM from vectorising the loop (1.7 vs 0.5 ns an element in SiLU). Relative error
/// about 1e-7. Inputs are clamped to [-87, 88]: below, e^-87 (~1.6e-38) instead of a denormal;
/// above, e^88 (~1.7e38) instead of infinity (so `1 / (1 + e^x)` stays a plain 0, never NaN).
#[inline(always)]
#[allow(clippy::manual_clamp)] // max/min vectorise to two instructions; `clamp` measured 2x slower here
pub(crate) fn exp(x: f32) -> f32 {
    use exp_consts::*;
    let x = x.max(LO).min(HI);
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI + n * LN2_LO;
    let mut p = P0;
    for c in POLY {
        p = p * r + c;
    }
    let y = p * r * r + r + 1.0;
    // n + 127 in the exponent field: t's bits are ROUND's plus n (|n| <= 127).
    let biased = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    y * f32::from_bits(biased << 23)
}

/// `exp`'s constants, also read by the 16-lane copy in `attention_x86` (which must give the same bits).
pub(crate) mod exp_consts {
    pub(crate) const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    pub(crate) const LO: f32 = -87.0;
    pub(crate) const HI: f32 = 88.0;
    // ln2 split in two for an exact product
    pub(crate) const LN2_HI: f32 = 0.693_359_4;
    pub(crate) const LN2_LO: f32 = 2.121_944_4e-4;
    // the polynomial for e^r, highest degree first after P0
    pub(crate) const P0: f32 = 1.987_569_1e-4;
    pub(crate) const POLY: [f32; 5] = [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
}

#[cfg(test)]
#[path = "ops_tests.rs"]
mod tests;
