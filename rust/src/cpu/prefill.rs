//! Causal prefill attention in bf16 for the CPU: one sequence's chunk of query rows against all
//! the keys it may see (its cached context and the chunk itself).
//!
//! torch's CPU flash kernel (SDPA) runs W's bf16 prompts at ~57 GFLOP/s on a 2-core Zen 4 whose
//! bf16 GEMMs reach ~400: its blocks are small and each carries softmax bookkeeping. Here a tile
//! of query positions (all G query heads of one KV head: the K and V rows are read once for the
//! G heads) computes its scores against every key it sees with `vdpbf16ps`, takes a whole-row
//! softmax (no running rescale) and multiplies the bf16 probabilities with V, again with
//! `vdpbf16ps`. K and V are first repacked once per call into the pair layouts those dot
//! products read (K: 16 keys a vector, pairs of dims; V: pairs of keys, a vector of dims).
//!
//! Numerics, as SDPA's bf16 path: `s = scale * q · k` accumulated in f32 (the products of bf16
//! values are exact), `p = exp(s - max)` in f32 (`ops::exp`'s bits), `l = Σ p` in f32, the
//! probabilities rounded to bf16 for `Σ p v` (f32 accumulation), the output `(Σ p v) / l`
//! rounded once to bf16. Keys past a row's own position are never multiplied past the 16-key
//! block that holds it, so a causal chunk costs about half its square.
//!
//! Layouts (row-major): `q` `[n, Hq, D]` and `out` `[n, Hq, Dv]`, `k` `[S, Hkv, D]` and `v`
//! `[S, Hkv, Dv]` with `S = context_len + n` keys in position order; the rows of q, k and v may
//! be strided (views into a fused q|k|v projection). Query head `h` reads KV head `h / G`.
//!
//! q and out are bf16 or f32 (`Q`), k and v bf16 or f32 (`K`). The numbers are bf16's whatever
//! the types: f32 queries are rounded to bf16 as they are read, f32 keys and values too (exact for
//! the bf16-valued rows a bf16 cache receives), and an f32 output holds the bf16-rounded result.
//! So a GGUF's f32 activations over a bf16 cache take the tiles without casting the chunk to bf16
//! and the output back around the call: W's prefill attention 1.35-1.40 -> 1.16-1.19 s on a
//! 2-core Zen 4 (the casts and the rounding of K/V before the cache write, less the conversions
//! the kernel now does as it reads).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::cpu::elem::{Bf16, Elem};
use crate::error::{CoreError, CoreResult};

/// Scores a tile holds at most (f32, plus as many bf16 probabilities): 256 KiB, within L2. The
/// tile's positions shrink as the context grows.
const TILE_SCORES: usize = 1 << 16;
/// Query positions a tile takes at most.
const TILE_POSITIONS: usize = 32;

#[derive(Clone, Copy, Debug)]
pub struct PrefillShape {
    /// Query positions in the chunk (`n`).
    pub rows: usize,
    /// Keys before the chunk: row `i` sits at position `context_len + i` and sees keys
    /// `0..=context_len + i`.
    pub context_len: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub v_dim: usize,
}

impl PrefillShape {
    pub fn keys(&self) -> usize {
        self.context_len + self.rows
    }

    fn group(&self) -> usize {
        self.num_q_heads / self.num_kv_heads
    }
}

pub struct PrefillArgs<'a, Q: Elem = Bf16, K: Elem = Bf16> {
    pub shape: PrefillShape,
    pub q: &'a [Q],
    pub q_stride: usize,
    pub k: &'a [K],
    pub k_stride: usize,
    pub v: &'a [K],
    pub v_stride: usize,
    pub scale: f32,
}

impl<Q: Elem, K: Elem> PrefillArgs<'_, Q, K> {
    /// Every index the kernel follows is checked here, so the loops can trust them.
    pub fn validate(&self, out_len: usize) -> CoreResult<()> {
        let s = self.shape;
        if s.num_kv_heads == 0 || s.head_dim == 0 || s.v_dim == 0 {
            return Err(CoreError::invalid("k", "zero-sized head dimension"));
        }
        if !s.head_dim.is_multiple_of(2) {
            let r = format!("head_dim {} is not even", s.head_dim);
            return Err(CoreError::invalid("q", r));
        }
        if !s.num_q_heads.is_multiple_of(s.num_kv_heads) {
            let r = format!(
                "{} query heads are not a multiple of {} KV heads",
                s.num_q_heads, s.num_kv_heads
            );
            return Err(CoreError::invalid("q", r));
        }
        if !self.scale.is_finite() {
            let r = format!("must be finite, got {}", self.scale);
            return Err(CoreError::invalid("scale", r));
        }
        let arrays = [
            (
                "q",
                self.q.len(),
                self.q_stride,
                s.rows,
                s.num_q_heads * s.head_dim,
            ),
            (
                "k",
                self.k.len(),
                self.k_stride,
                s.keys(),
                s.num_kv_heads * s.head_dim,
            ),
            (
                "v",
                self.v.len(),
                self.v_stride,
                s.keys(),
                s.num_kv_heads * s.v_dim,
            ),
        ];
        for (name, len, stride, rows, width) in arrays {
            if rows > 1 && stride < width {
                let r = format!("row stride {stride} overlaps its rows of {width}");
                return Err(CoreError::invalid(name, r));
            }
            let need = if rows == 0 {
                0
            } else {
                (rows - 1) * stride + width
            };
            if len < need {
                let r = format!("has {len} elements, {rows} rows need {need}");
                return Err(CoreError::invalid(name, r));
            }
        }
        let want = s.rows * s.num_q_heads * s.v_dim;
        if out_len != want {
            let r = format!("has {out_len} elements, expected {want}");
            return Err(CoreError::invalid("out", r));
        }
        Ok(())
    }
}

/// A body of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// Plain Rust, one row at a time (any CPU; the reference the tiles are tested against).
    Generic,
    /// `prefill_x86`'s `vdpbf16ps` tiles (AVX-512 BF16; head_dim % 32 == 0, v_dim % 16 == 0).
    Bf16Tiles,
}

impl Path {
    pub(crate) fn available(self, shape: &PrefillShape) -> bool {
        match self {
            Path::Generic => true,
            Path::Bf16Tiles => tiles_serve(shape.head_dim, shape.v_dim),
        }
    }
}

/// Whether this CPU runs heads of these dims on the `vdpbf16ps` tiles (where the kernel beats
/// SDPA; elsewhere it runs, correctly, on the slow generic body).
pub fn tiles_serve(head_dim: usize, v_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        head_dim.is_multiple_of(32)
            && v_dim.is_multiple_of(16)
            && has!("avx512f")
            && has!("avx512bw")
            && has!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (head_dim, v_dim);
        false
    }
}

/// Attend the chunk into `out` (`[n, Hq, Dv]`, contiguous) on up to `threads` threads.
pub fn prefill<Q: Elem, K: Elem>(
    args: &PrefillArgs<Q, K>,
    out: &mut [Q],
    threads: usize,
) -> CoreResult<()> {
    let path = if Path::Bf16Tiles.available(&args.shape) && tiles_write::<Q>() {
        Path::Bf16Tiles
    } else {
        Path::Generic
    };
    prefill_on(args, out, threads, path)
}

/// One KV head's tile of query positions `i0..i1` (chunk-relative).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Unit {
    pub head: usize,
    pub i0: usize,
    pub i1: usize,
}

/// `out` as raw memory the units write into: each writes only its own (position, head) rows.
pub(crate) struct OutPtr<Q>(pub *mut Q);
impl<Q> Clone for OutPtr<Q> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<Q> Copy for OutPtr<Q> {}
// SAFETY: the units partition the output's (position, query head) rows, so no two threads write
// one element, and `prefill_on` keeps `out` borrowed until every unit has finished.
unsafe impl<Q> Send for OutPtr<Q> {}
unsafe impl<Q> Sync for OutPtr<Q> {}

/// Whether the tiles write outputs of type `Q` (bf16, or f32 holding bf16 values).
fn tiles_write<Q: Elem>() -> bool {
    use std::any::TypeId;
    [TypeId::of::<Bf16>(), TypeId::of::<f32>()].contains(&TypeId::of::<Q>())
}

/// `x` rounded to bf16 (a bf16 as it is): the value every path computes with.
#[inline(always)]
pub(crate) fn bf16_of<E: Elem>(x: E) -> Bf16 {
    if std::any::TypeId::of::<E>() == std::any::TypeId::of::<Bf16>() {
        // SAFETY: `E` is `Bf16` itself.
        unsafe { std::mem::transmute_copy::<E, Bf16>(&x) }
    } else {
        Bf16::store(x.load())
    }
}

/// `prefill` on a given path (one that serves the shape on this CPU: else an error).
pub(crate) fn prefill_on<Q: Elem, K: Elem>(
    args: &PrefillArgs<Q, K>,
    out: &mut [Q],
    threads: usize,
    path: Path,
) -> CoreResult<()> {
    if !path.available(&args.shape) {
        let r = format!("this CPU or head size cannot run the {path:?} kernel");
        return Err(CoreError::invalid("path", r));
    }
    if path == Path::Bf16Tiles && !tiles_write::<Q>() {
        return Err(CoreError::invalid(
            "out",
            "the tiles write bf16 or f32 only",
        ));
    }
    args.validate(out.len())?;
    let s = args.shape;
    if s.rows == 0 {
        return Ok(());
    }
    let threads = threads.max(1);
    let g = s.group();
    // Positions a tile takes: bounded by the score budget, and small enough that short chunks
    // still give every thread a few units.
    let by_budget = (TILE_SCORES / (g * s.keys())).max(1);
    let by_threads = (s.rows * s.num_kv_heads).div_ceil(4 * threads).max(1);
    let per = by_budget.min(by_threads).min(TILE_POSITIONS);
    // Most expensive first (the last positions see the most keys), for the dynamic schedule.
    let mut units = Vec::with_capacity(s.num_kv_heads * s.rows.div_ceil(per));
    for i0 in (0..s.rows).step_by(per).rev() {
        for head in 0..s.num_kv_heads {
            units.push(Unit {
                head,
                i0,
                i1: (i0 + per).min(s.rows),
            });
        }
    }
    let dst = OutPtr(out.as_mut_ptr());
    match path {
        Path::Generic => run_units(&units, threads, &|u| generic_unit(args, u, dst)),
        Path::Bf16Tiles => {
            #[cfg(target_arch = "x86_64")]
            {
                let packed = x86::Packed::new(args, threads);
                let scratch = per * g * s.keys().next_multiple_of(32);
                run_units(&units, threads, &|u| {
                    thread_local! {
                        static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<Bf16>)> = const {
                            std::cell::RefCell::new((Vec::new(), Vec::new()))
                        };
                    }
                    SCRATCH.with(|cell| {
                        let (buf, qbuf) = &mut *cell.borrow_mut();
                        if buf.len() < 2 * scratch {
                            buf.resize(2 * scratch, 0.0);
                        }
                        // SAFETY: `Bf16Tiles` is available (checked above: AVX-512 BF16, the
                        // dims it serves), `validate` passed, and `buf` holds a tile's scores
                        // and probabilities.
                        unsafe { x86::unit(args, &packed, u, dst, buf, qbuf) }
                    })
                });
            }
        }
    }
    Ok(())
}

/// Every unit once, taken in order by whichever of up to `threads` threads is free.
fn run_units(units: &[Unit], threads: usize, f: &(dyn Fn(Unit) + Sync)) {
    let next = AtomicUsize::new(0);
    crate::cpu::parallel::run_parts(threads.min(units.len()), &|_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        match units.get(i) {
            Some(&u) => f(u),
            None => break,
        }
    });
}

/// The generic body: each (position, query head) row alone, every sum in order.
fn generic_unit<Q: Elem, K: Elem>(args: &PrefillArgs<Q, K>, u: Unit, dst: OutPtr<Q>) {
    let s = args.shape;
    let (g, d, dv) = (s.group(), s.head_dim, s.v_dim);
    let mut p = vec![0.0f32; s.keys()];
    let mut acc = vec![0.0f32; dv];
    for i in u.i0..u.i1 {
        let len = s.context_len + i + 1;
        for qh in u.head * g..(u.head + 1) * g {
            let q = &args.q[i * args.q_stride + qh * d..][..d];
            for (j, pj) in p[..len].iter_mut().enumerate() {
                let k = &args.k[j * args.k_stride + u.head * d..][..d];
                let dot: f32 = q
                    .iter()
                    .zip(k)
                    .map(|(&a, &b)| bf16_of(a).load() * bf16_of(b).load())
                    .sum();
                *pj = dot * args.scale;
            }
            let max = p[..len].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0f32;
            for pj in p[..len].iter_mut() {
                *pj = crate::cpu::ops::exp(*pj - max);
                total += *pj;
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (j, &pj) in p[..len].iter().enumerate() {
                let w = Bf16::store(pj).load();
                let v = &args.v[j * args.v_stride + u.head * dv..][..dv];
                for (a, &x) in acc.iter_mut().zip(v) {
                    *a += w * bf16_of(x).load();
                }
            }
            let inv = 1.0 / total;
            // SAFETY: row (i, qh) lies inside `out` (validated length) and belongs to this unit
            // alone (see `OutPtr`).
            let row = unsafe {
                std::slice::from_raw_parts_mut(dst.0.add((i * s.num_q_heads + qh) * dv), dv)
            };
            for (o, a) in row.iter_mut().zip(&acc) {
                *o = Q::store(Bf16::store(a * inv).load());
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[path = "prefill_x86.rs"]
mod x86;

#[cfg(test)]
#[path = "prefill_tests.rs"]
mod tests;
