//! `prefill`'s AVX-512 BF16 body: per unit (a KV head's tile of query positions), scores by
//! `vdpbf16ps` against K repacked as 16 keys a vector, a whole-row softmax, then probabilities
//! (bf16) times V repacked as pairs of keys, again by `vdpbf16ps`.
//!
//! Rows of a tile are position-major (`m = i * G + g`): a position's G query heads sit next to
//! each other and share their keys. Register blocks: 8 rows x 32 keys for the scores, 6 rows x
//! 64 value dims for the weighted sum, each sum over its whole range in registers.

use std::arch::x86_64::*;

use std::any::TypeId;

use super::{bf16_of, OutPtr, PrefillArgs, Unit};
use crate::cpu::attention::x86::{dot2, exp16};
use crate::cpu::elem::{Bf16, Elem};

/// Rows of a score block and of a weighted-sum block.
const QK_ROWS: usize = 8;
const PV_ROWS: usize = 6;

/// K and V of every KV head in the layouts the dot products read, as bf16 pairs (`u32`: the
/// lower half is the even element). K: per 16-key block, per pair of dims, the 16 keys' pairs;
/// V: per pair of keys, per value dim, the two keys' values. Keys past the end are zeros.
pub(crate) struct Packed {
    k: Vec<u32>,
    v: Vec<u32>,
    blocks: usize,
    pairs: usize,
}

/// Raw memory for the packing threads, each writing only its own blocks.
#[derive(Clone, Copy)]
struct Dst(*mut u32);
// SAFETY: every packing task writes a disjoint range (one K block or 16 V pairs of one head),
// and `Packed::new` keeps the vectors alive and unmoved until all tasks finish.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

impl Dst {
    /// # Safety
    /// `i` is inside the vector and belongs to the calling task alone.
    unsafe fn put(self, i: usize, x: u32) {
        // SAFETY: the caller's promise.
        unsafe { *self.0.add(i) = x }
    }
}

/// The pair `(x[0], x[1])` as one `u32`, the first element in the lower half.
#[inline(always)]
fn pair(lo: Bf16, hi: Bf16) -> u32 {
    lo.0 as u32 | (hi.0 as u32) << 16
}

impl Packed {
    pub(crate) fn new<Q: Elem, K: Elem>(args: &PrefillArgs<Q, K>, threads: usize) -> Packed {
        let s = args.shape;
        let (hkv, d, dv, keys) = (s.num_kv_heads, s.head_dim, s.v_dim, s.keys());
        let (blocks, pairs, dpn) = (keys.div_ceil(16), keys.div_ceil(2), d / 2);
        let mut packed = Packed {
            k: vec![0; hkv * blocks * dpn * 16],
            v: vec![0; hkv * pairs * dv],
            blocks,
            pairs,
        };
        let (kd, vd) = (Dst(packed.k.as_mut_ptr()), Dst(packed.v.as_mut_ptr()));
        let v_chunks = pairs.div_ceil(16);
        let k_tasks = hkv * blocks;
        let tasks = k_tasks + hkv * v_chunks;
        // Rows of f32 keys and values are rounded into these first (one vectorised pass a row).
        let width = d.max(dv);
        let task = |t: usize| {
            let (mut b0, mut b1) = (vec![Bf16(0); width], vec![Bf16(0); width]);
            if t < k_tasks {
                let (h, jb) = (t / blocks, t % blocks);
                let base = (h * blocks + jb) * dpn * 16;
                for l in 0..16.min(keys - jb * 16) {
                    // SAFETY: the tiles run only where AVX-512 F/BW are (the caller's contract).
                    let row = unsafe {
                        bf16_row(
                            &args.k[(jb * 16 + l) * args.k_stride + h * d..][..d],
                            &mut b0,
                        )
                    };
                    for dp in 0..dpn {
                        // SAFETY: below `hkv * blocks * dpn * 16`; this task's block only.
                        unsafe { kd.put(base + dp * 16 + l, pair(row[2 * dp], row[2 * dp + 1])) };
                    }
                }
            } else {
                let (h, c) = ((t - k_tasks) / v_chunks, (t - k_tasks) % v_chunks);
                for jp in c * 16..(c * 16 + 16).min(pairs) {
                    let j = 2 * jp;
                    let row = |j: usize| &args.v[j * args.v_stride + h * dv..][..dv];
                    // SAFETY: as for the keys.
                    let even = unsafe { bf16_row(row(j), &mut b0) };
                    let odd = (j + 1 < keys).then(|| unsafe { bf16_row(row(j + 1), &mut b1) });
                    let base = (h * pairs + jp) * dv;
                    for x in 0..dv {
                        let hi = odd.map_or(Bf16(0), |o| o[x]);
                        // SAFETY: below `hkv * pairs * dv`; this task's pairs only.
                        unsafe { vd.put(base + x, pair(even[x], hi)) };
                    }
                }
            }
        };
        let parts = threads.clamp(1, tasks.max(1));
        crate::cpu::parallel::run_parts(parts, &|p| (p..tasks).step_by(parts).for_each(task));
        packed
    }
}

/// `src` as bf16: itself where it is bf16, else rounded into `buf` (as `bf16_of`).
///
/// # Safety
/// The CPU has AVX-512 F and BW.
#[inline(always)]
unsafe fn bf16_row<'a, E: Elem>(src: &'a [E], buf: &'a mut [Bf16]) -> &'a [Bf16] {
    if TypeId::of::<E>() == TypeId::of::<Bf16>() {
        // SAFETY: `E` is `Bf16` itself.
        return unsafe { std::slice::from_raw_parts(src.as_ptr() as *const Bf16, src.len()) };
    }
    let dst = &mut buf[..src.len()];
    // SAFETY: the caller's contract.
    unsafe { round_into(src, dst) };
    dst
}

/// `src` rounded to bf16 into `dst`: a loop LLVM vectorises at 512 bits (a scalar one cost more
/// than the casts it replaces).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn round_into<E: Elem>(src: &[E], dst: &mut [Bf16]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = bf16_of(x);
    }
}

/// One unit into `dst`. `buf` holds at least `2 * rows * keys.next_multiple_of(32)` f32s;
/// `qbuf` takes the unit's query rows rounded to bf16 when `Q` is not bf16.
///
/// # Safety
/// The CPU has AVX-512 F/BW/BF16, the shape's head_dim is a multiple of 32 and v_dim of 16,
/// `args` passed `validate` against `dst`'s length, and `packed` was built from `args`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn unit<Q: Elem, K: Elem>(
    args: &PrefillArgs<Q, K>,
    packed: &Packed,
    u: Unit,
    dst: OutPtr<Q>,
    buf: &mut [f32],
    qbuf: &mut Vec<Bf16>,
) {
    let s = args.shape;
    let (g, d, dv, hq) = (
        s.num_q_heads / s.num_kv_heads,
        s.head_dim,
        s.v_dim,
        s.num_q_heads,
    );
    let dpn = d / 2;
    let rows = (u.i1 - u.i0) * g;
    let stride = s.keys().next_multiple_of(32);
    let (sc, pr) = buf.split_at_mut(rows * stride);
    assert!(pr.len() >= rows * stride / 2);
    let pr = pr.as_mut_ptr() as *mut u16; // bf16 probabilities, rows of `stride`
    let sc = sc.as_mut_ptr();
    // Keys row m sees: its position + 1.
    let limit = |m: usize| s.context_len + u.i0 + m / g + 1;
    let qoff = |m: usize| (u.i0 + m / g) * args.q_stride + (u.head * g + m % g) * d;
    let raw_q = TypeId::of::<Q>() == TypeId::of::<Bf16>();
    if !raw_q {
        qbuf.resize(rows * d, Bf16(0));
        for m in 0..rows {
            // SAFETY: this function's own features.
            unsafe { round_into(&args.q[qoff(m)..][..d], &mut qbuf[m * d..][..d]) };
        }
    }
    let qrow = |m: usize| {
        if raw_q {
            args.q[qoff(m)..].as_ptr() as *const u32
        } else {
            qbuf[m * d..].as_ptr() as *const u32
        }
    };
    // SAFETY (all blocks below): rows < `rows`, keys below `limit(rows - 1) <= keys`, rounded
    // up to 16 (scores) or 2 (pairs), stay inside `stride`; packed offsets follow `Packed`'s
    // layout for head `u.head`; output rows are this unit's (position, head) rows of `dst`.
    unsafe {
        let kp = packed.k.as_ptr().add(u.head * packed.blocks * dpn * 16);
        for m0 in (0..rows).step_by(QK_ROWS) {
            let mr = (rows - m0).min(QK_ROWS);
            let nb = limit(m0 + mr - 1).div_ceil(16);
            let q: [*const u32; QK_ROWS] = std::array::from_fn(|r| qrow(m0 + r.min(mr - 1)));
            let out: [*mut f32; QK_ROWS] =
                std::array::from_fn(|r| sc.add((m0 + r.min(mr - 1)) * stride));
            macro_rules! qk_rows {
                ($($n:literal)*) => {
                    match mr { $($n => scores::<$n>(&q, kp, dpn, nb, args.scale, &out),)* _ => unreachable!() }
                };
            }
            qk_rows!(1 2 3 4 5 6 7 8);
        }
        // Probabilities zero-padded to the tile's widest row, so a weighted-sum block can run
        // every row of it to its last row's length.
        let width = limit(rows - 1).next_multiple_of(2);
        let mut inv = vec![0.0f32; rows];
        for (m, inv) in inv.iter_mut().enumerate() {
            *inv = softmax(sc.add(m * stride), limit(m), pr.add(m * stride), width);
        }
        let vp = packed.v.as_ptr().add(u.head * packed.pairs * dv);
        for m0 in (0..rows).step_by(PV_ROWS) {
            let mr = (rows - m0).min(PV_ROWS);
            let np = limit(m0 + mr - 1).div_ceil(2);
            let p: [*const u32; PV_ROWS] =
                std::array::from_fn(|r| pr.add((m0 + r.min(mr - 1)) * stride) as *const u32);
            let w: [f32; PV_ROWS] = std::array::from_fn(|r| inv[m0 + r.min(mr - 1)]);
            let o: [*mut Q; PV_ROWS] = std::array::from_fn(|r| {
                let m = m0 + r.min(mr - 1);
                dst.0.add(((u.i0 + m / g) * hq + u.head * g + m % g) * dv)
            });
            let mut c = 0;
            while c < dv {
                let nc = ((dv - c) / 16).min(4);
                macro_rules! pv_rows {
                    ($nc:literal; $($n:literal)*) => {
                        match mr { $($n => weigh::<$n, $nc, Q>(&p, vp.add(c), dv, np, &w, &o, c),)* _ => unreachable!() }
                    };
                }
                match nc {
                    4 => pv_rows!(4; 1 2 3 4 5 6),
                    3 => pv_rows!(3; 1 2 3 4 5 6),
                    2 => pv_rows!(2; 1 2 3 4 5 6),
                    _ => pv_rows!(1; 1 2 3 4 5 6),
                }
                c += nc * 16;
            }
        }
    }
}

/// Scaled scores of `MR` rows against key blocks `0..nb` (16 keys each), two blocks at a time.
#[inline(always)]
unsafe fn scores<const MR: usize>(
    q: &[*const u32; QK_ROWS],
    kp: *const u32,
    dpn: usize,
    nb: usize,
    scale: f32,
    out: &[*mut f32; QK_ROWS],
) {
    // SAFETY: the caller's bounds (see `unit`).
    unsafe {
        let vs = _mm512_set1_ps(scale);
        let mut jb = 0;
        while jb < nb {
            let two = jb + 1 < nb;
            let k0 = kp.add(jb * dpn * 16);
            let k1 = if two { k0.add(dpn * 16) } else { k0 };
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            for dp in 0..dpn {
                let b0 = _mm512_loadu_si512(k0.add(dp * 16) as *const _);
                let b1 = _mm512_loadu_si512(k1.add(dp * 16) as *const _);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_epi32(q[r].add(dp).read_unaligned() as i32);
                    acc[0] = dot2(acc[0], a, b0);
                    acc[1] = dot2(acc[1], a, b1);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(out[r].add(jb * 16), _mm512_mul_ps(acc[0], vs));
                if two {
                    _mm512_storeu_ps(out[r].add(jb * 16 + 16), _mm512_mul_ps(acc[1], vs));
                }
            }
            jb += 2;
        }
    }
}

/// A row's scores `sc[..len]` to bf16 probabilities `exp(s - max)` in `p[..width]` (zeros past
/// `len`); returns `1 / Σ exp(s - max)` (f32 sum of the unrounded values).
#[inline(always)]
unsafe fn softmax(sc: *const f32, len: usize, p: *mut u16, width: usize) -> f32 {
    // SAFETY: `sc` holds `len` scores rounded up to 16, `p` holds `width` rounded up to 16.
    unsafe {
        let full = len / 16 * 16;
        let tail: __mmask16 = ((1u32 << (len - full)) - 1) as __mmask16;
        let neg = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut m = neg;
        for j in (0..full).step_by(16) {
            m = _mm512_max_ps(m, _mm512_loadu_ps(sc.add(j)));
        }
        if tail != 0 {
            m = _mm512_max_ps(m, _mm512_mask_loadu_ps(neg, tail, sc.add(full)));
        }
        let vmax = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        let mut acc = _mm512_setzero_ps();
        let mut j = 0;
        while j < len {
            let mask = if j + 16 <= len { !0 } else { tail };
            let e = _mm512_maskz_mov_ps(
                mask,
                exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sc.add(j)), vmax)),
            );
            acc = _mm512_add_ps(acc, e);
            let h = _mm512_cvtneps_pbh(e);
            _mm256_storeu_si256(
                p.add(j) as *mut __m256i,
                std::mem::transmute::<__m256bh, __m256i>(h),
            );
            j += 16;
        }
        // `j` is `len` rounded up to 16; the rest of the tile's width is zeros.
        while j < width {
            _mm256_storeu_si256(p.add(j) as *mut __m256i, _mm256_setzero_si256());
            j += 16;
        }
        1.0 / _mm512_reduce_add_ps(acc)
    }
}

/// Output dims `c..c + NC * 16` of `MR` rows: `Σ_j p_j v_j` over key pairs `0..np`, times the
/// row's `w`, rounded to bf16 (and widened back where `Q` is f32).
#[inline(always)]
unsafe fn weigh<const MR: usize, const NC: usize, Q: Elem>(
    p: &[*const u32; PV_ROWS],
    vp: *const u32,
    dv: usize,
    np: usize,
    w: &[f32; PV_ROWS],
    out: &[*mut Q; PV_ROWS],
    c: usize,
) {
    let wide = TypeId::of::<Q>() == TypeId::of::<f32>();
    // SAFETY: the caller's bounds (see `unit`).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NC]; MR];
        for jp in 0..np {
            let row = vp.add(jp * dv);
            let b: [__m512i; NC] =
                std::array::from_fn(|i| _mm512_loadu_si512(row.add(i * 16) as *const _));
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = _mm512_set1_epi32(p[r].add(jp).read() as i32);
                for (acc, &b) in acc.iter_mut().zip(&b) {
                    *acc = dot2(*acc, a, b);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let vw = _mm512_set1_ps(w[r]);
            for (i, &a) in acc.iter().enumerate() {
                let h = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(
                    _mm512_mul_ps(a, vw),
                ));
                let o = out[r].add(c + i * 16);
                if wide {
                    let f = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                    _mm512_storeu_si512(o as *mut __m512i, f);
                } else {
                    _mm256_storeu_si256(o as *mut __m256i, h);
                }
            }
        }
    }
}
