//! AVX-512 body of `attention::attend` for head dims that are a multiple of 16 (up to 128, and
//! 256): the same two passes, arranged so that the instructions are the multiply-adds.
//!
//! - Logits: a tile of 16 positions at a time. For each row and KV head, up to four query heads
//!   of its group hold their queries in registers while the tile's K rows (from L1 after the
//!   first row) pass by, loaded (and widened) once for them; the products stay as 16-lane partial
//!   sums, 16 a head, and one transpose-reduce (45 instructions) turns them into 16 logits. A
//!   horizontal sum per dot would cost more instructions than the dot itself. Holding the queries
//!   (once loaded again at every position) and a tile that stays in L1 whatever the rows (it once
//!   held every row's heads: 54 KiB for a 6-row verification of 9 heads) gave the same bits
//!   1.17-1.2x faster on a 2-core Zen 4 (bf16 cache, 2 threads: W's decode shape with its cache
//!   in L3 0.334 -> 0.285 ms a layer, a 6-row verification at context 600 0.089 -> 0.075 ms, one
//!   row 0.022 -> 0.018 ms); with W's cache in DRAM it stays at ~0.5 ms, paced by the misses, not
//!   the instructions. On the `Avx512Bf16` path a bf16 cache's partial sums come from
//!   `vdpbf16ps` on the raw K row and query (no widening, half the multiply instructions): W's
//!   decode shape 0.85-1.0 -> 0.78-0.81 ms a layer (2 threads), one 600-token sequence 44 -> 35
//!   us, on a 2-core Zen 4. The weighted sum stays in f32 FMAs: a `vdpbf16ps` version (V rows
//!   interleaved by `vpermt2w`, bf16 probabilities) measured no faster there, the loads of
//!   scattered V rows being what it waits on.
//! - Softmax: max, `exp` (the polynomial of `ops::exp`, 16 lanes) and sum, vectorised.
//! - Weighted sum: per position each KV head's V row is loaded once and multiplied into the
//!   accumulators of up to 24 registers' worth of (row, head) pairs, kept in registers across all
//!   positions and stored once.
//!
//! Tiles sit at absolute positions (multiples of 16), so a position's logit comes out of the
//! same lane of the same reduction whatever rows share the call, every sum runs over a row's own
//! positions in order, and a row's result does not depend on its neighbours (the module's
//! promise, tested in `attention_tests.rs`).

use std::any::TypeId;
use std::arch::x86_64::*;
use std::ops::Range;

use super::{DecodeArgs, Lanes, Scratch};
use crate::cpu::elem::{Bf16, Elem, F16, F8E4M3, F8E5M2};

/// How far ahead, in blocks, both passes ask for cache rows (`super::prefetch`). Two, not one:
/// over a pool on huge pages, W's decode shape (34 sequences, contexts 100-700, bf16 cache)
/// 0.516 -> 0.458 ms a layer and 8 sequences at 1,000-3,000 0.471 -> 0.408 (2-core Zen 4, old /
/// new alternating in one process); four measured no better than two, and one sequence is the
/// same either way.
const AHEAD: usize = 2;

/// Whether this path serves head dim `d` (it needs AVX-512F, checked by the caller).
pub(super) fn serves(d: usize) -> bool {
    d.is_multiple_of(16) && matches!(d / 16, 1..=8 | 16)
}

/// `attend` for a head dim that `serves` accepts. With `dp`, a bf16 cache's logits come from
/// `vdpbf16ps` on the raw bf16 rows (head dims a multiple of 32; others as without).
///
/// # Safety
/// The CPU must support AVX-512F (and AVX-512 BF16 with `dp`), and `args` must have passed
/// `validate`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    rows: Range<usize>,
    scratch: &mut Scratch,
    out: &mut [T],
    dp: bool,
) {
    // SAFETY (all arms): the caller's contract, passed on.
    unsafe {
        match args.shape.head_dim / 16 {
            1 => attend_dv::<T, C, 1>(args, rows, scratch, out, false),
            2 => attend_dv::<T, C, 2>(args, rows, scratch, out, dp),
            3 => attend_dv::<T, C, 3>(args, rows, scratch, out, false),
            4 => attend_dv::<T, C, 4>(args, rows, scratch, out, dp),
            5 => attend_dv::<T, C, 5>(args, rows, scratch, out, false),
            6 => attend_dv::<T, C, 6>(args, rows, scratch, out, dp),
            7 => attend_dv::<T, C, 7>(args, rows, scratch, out, false),
            8 => attend_dv::<T, C, 8>(args, rows, scratch, out, dp),
            16 => attend_dv::<T, C, 16>(args, rows, scratch, out, dp),
            _ => unreachable!("head dim {} is not served here", args.shape.head_dim),
        }
    }
}

/// The group's queries as raw bf16 rows for `vdpbf16ps`: row `r` at `ptr + r * stride`.
#[derive(Clone, Copy)]
pub(super) struct QRaw {
    pub(super) ptr: *const u16,
    pub(super) stride: usize,
}

/// Where a (row, head) pair's numbers live: its logits at `scores[off..off + len - first]`
/// (position `first` first), its output at `out[out..out + D]`.
#[derive(Clone, Copy, Default)]
pub(super) struct Pair {
    pub(super) first: usize,
    pub(super) len: usize,
    pub(super) off: usize,
    pub(super) out: usize,
}

/// The cache geometry the passes need, pulled out of `DecodeArgs`.
#[derive(Clone, Copy)]
pub(super) struct Geo<'a> {
    pub(super) table: &'a [i32],
    pub(super) block_size: usize,
    /// Elements between positions' cache rows (`DecodeShape::kv_stride`).
    pub(super) stride: usize,
    /// `log2(block_size)` when it is a power of two: a shift and a mask instead of a 64-bit
    /// division per position and pass (several per position in all).
    shift: Option<u32>,
}

impl<'a> Geo<'a> {
    pub(super) fn new(table: &'a [i32], block_size: usize, stride: usize) -> Self {
        let shift = block_size
            .is_power_of_two()
            .then(|| block_size.trailing_zeros());
        Geo {
            table,
            block_size,
            stride,
            shift,
        }
    }

    /// The element offset of position `pos`'s cache row (every KV head of the view).
    #[inline(always)]
    pub(super) fn row(&self, pos: usize) -> usize {
        let b = self.block_size;
        let (blk, off) = match self.shift {
            Some(sh) => (pos >> sh, pos & (b - 1)),
            None => (pos / b, pos % b),
        };
        (self.table[blk] as usize * b + off) * self.stride
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn attend_dv<T: Elem, C: Elem, const DV: usize>(
    args: &DecodeArgs<T, C>,
    rows: Range<usize>,
    scratch: &mut Scratch,
    out: &mut [T],
    dp: bool,
) {
    let s = args.shape;
    let (d, hq) = (s.head_dim, s.num_q_heads);
    let geo = Geo::new(
        &args.block_tables[rows.start * s.max_blocks..(rows.start + 1) * s.max_blocks],
        s.block_size,
        s.kv_stride,
    );
    let Scratch {
        scores,
        q,
        qb,
        spans,
        tile,
        ..
    } = scratch;
    let bf16_cache = TypeId::of::<C>() == TypeId::of::<Bf16>();
    let byte_cache = [TypeId::of::<F8E4M3>(), TypeId::of::<F8E5M2>()].contains(&TypeId::of::<C>());
    let (half_q, wide_q) = (
        TypeId::of::<T>() == TypeId::of::<Bf16>(),
        TypeId::of::<T>() == TypeId::of::<f32>(),
    );
    let round_q = dp && byte_cache && wide_q;
    let dp = dp && bf16_cache && (half_q || wide_q);
    let (total, lo, hi) = args.gather(rows.clone(), q, spans);
    if round_q {
        // f32 queries over an 8-bit cache where prompts take the bf16 tiles (CpuAttention, which reads the
        // cache's 8-bit values as the bf16 values they are): rounded to bf16 as the tiles round a chunk's, so a
        // prefix hit's or a verification's rows (read here) see the queries a fresh prompt's rows saw there.
        q.iter_mut().for_each(|x| *x = Bf16::store(*x).load());
    }
    // The raw bf16 query rows `vdpbf16ps` reads: the caller's own, or (f32 queries over a bf16 cache) the
    // group's queries rounded to bf16 here, as the prefill tiles round a chunk's (CpuAttention's f32 path).
    let qraw = if dp && wide_q {
        qb.clear();
        qb.extend(q.iter().map(|&x| Bf16::store(x)));
        QRaw {
            ptr: qb.as_ptr().cast(),
            stride: hq * d,
        }
    } else {
        QRaw {
            // SAFETY: `validate` bounds `rows.start * q_stride` inside q (rows.start < num_seqs).
            ptr: unsafe { args.q.as_ptr().add(rows.start * args.q_stride).cast() },
            stride: args.q_stride,
        }
    };
    scores.clear();
    scores.resize(total, 0.0);
    tile.clear();
    tile.resize(HEADS * 16, Lanes([0.0; 16]));
    // SAFETY: the CPU has AVX-512F (this function's contract); `validate` checked every block
    // id and length, so each row offset and slice below stays inside its buffer.
    unsafe {
        if dp {
            logits_bf16::<T, C, DV>(args, geo, spans, qraw, tile, scores, lo..hi);
        } else {
            logits::<T, C, DV, false>(args, geo, spans, q, qraw, tile, scores, lo..hi);
        }
    }
    if let Some(cap) = args.softcap {
        scores.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
    }
    for &(first, len, base) in spans.iter() {
        let span = len - first;
        for h in 0..hq {
            let sink = args.sinks.map(|sk| sk[h]);
            // SAFETY: AVX-512F, as above.
            unsafe { softmax(&mut scores[base + h * span..base + (h + 1) * span], sink) };
        }
    }
    let group = hq / s.num_kv_heads;
    let mut pairs = [Pair::default(); 24];
    for kvh in 0..s.num_kv_heads {
        for c0 in (0..DV).step_by(4) {
            let nc = (DV - c0).min(4);
            let np = 24 / nc;
            // The (row, head) pairs of this KV head, `np` at a time.
            let mut n = 0;
            let all = spans
                .iter()
                .enumerate()
                .flat_map(|(r, &(first, len, base))| {
                    (0..group).map(move |g| {
                        let h = kvh * group + g;
                        Pair {
                            first,
                            len,
                            off: base + h * (len - first),
                            out: (r * hq + h) * d,
                        }
                    })
                });
            let mut flush = |chunk: &[Pair]| {
                let col = kvh * d + c0 * 16;
                // SAFETY: AVX-512F, as above; `nc` picks the instance whose width it names.
                unsafe {
                    let (v, sc) = (args.v_cache, &scores[..]);
                    match (nc, chunk.len()) {
                        // Whole widths (head dims 64, 128, 256) at their exact pair count: a
                        // loop that may stop early kept LLVM storing all 24 accumulators to
                        // the stack at every position.
                        (4, 6) => weigh::<T, C, 4, 6, true>(v, geo, chunk, col, sc, out, c0),
                        (4, 5) => weigh::<T, C, 4, 5, true>(v, geo, chunk, col, sc, out, c0),
                        (4, 4) => weigh::<T, C, 4, 4, true>(v, geo, chunk, col, sc, out, c0),
                        (4, 3) => weigh::<T, C, 4, 3, true>(v, geo, chunk, col, sc, out, c0),
                        (4, 2) => weigh::<T, C, 4, 2, true>(v, geo, chunk, col, sc, out, c0),
                        (4, _) => weigh::<T, C, 4, 1, true>(v, geo, chunk, col, sc, out, c0),
                        (3, _) => weigh::<T, C, 3, 8, false>(v, geo, chunk, col, sc, out, c0),
                        (2, _) => weigh::<T, C, 2, 12, false>(v, geo, chunk, col, sc, out, c0),
                        _ => weigh::<T, C, 1, 24, false>(v, geo, chunk, col, sc, out, c0),
                    }
                }
            };
            for p in all {
                pairs[n] = p;
                n += 1;
                if n == np {
                    flush(&pairs[..n]);
                    n = 0;
                }
            }
            if n > 0 {
                flush(&pairs[..n]);
            }
        }
    }
}

/// 16 elements at `p` widened to f32 (exactly, as `Elem::load`).
#[inline(always)]
unsafe fn load16<T: Elem>(p: *const T) -> __m512 {
    // SAFETY: the caller guarantees 16 readable elements at `p` and AVX-512F; the casts follow
    // the `TypeId` checks, so each reads the type that is really there.
    unsafe {
        if TypeId::of::<T>() == TypeId::of::<f32>() {
            _mm512_loadu_ps(p.cast())
        } else if TypeId::of::<T>() == TypeId::of::<Bf16>() {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else if TypeId::of::<T>() == TypeId::of::<F16>() {
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
        } else if TypeId::of::<T>() == TypeId::of::<F8E5M2>() {
            let b = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast()));
            _mm512_cvtph_ps(_mm256_slli_epi16::<8>(b))
        } else if TypeId::of::<T>() == TypeId::of::<F8E4M3>() {
            e4m3x16(_mm_loadu_si128(p.cast()))
        } else {
            let mut x = [0.0f32; 16];
            for (i, x) in x.iter_mut().enumerate() {
                *x = (*p.add(i)).load();
            }
            _mm512_loadu_ps(x.as_ptr())
        }
    }
}

/// 16 e4m3 codes widened to f32 in four instructions: each code sign-extended to 32 bits and
/// shifted so that its 7 magnitude bits sit at the top of an f32's exponent and mantissa (the
/// exponent then biased 120 below f32's; a subnormal code lands on the f32 subnormal of the same
/// digits), the sign's copies cleared but bit 31's, and one exact multiply by 2^120: `F8E4M3::load`
/// for every code but the two NaN codes, read as +-480. A cache holds those only for a NaN key or
/// value, whose attention is lost either way; turning them back into NaNs (a compare and a masked
/// move, five more instructions) made W's decode shape 1.0 ms a layer against 0.69 without on a
/// 2-core Zen 4 (bf16's 0.56-0.59, e5m2's 0.58), and the halves' route e5m2 takes needed twelve.
#[inline(always)]
unsafe fn e4m3x16(codes: __m128i) -> __m512 {
    // SAFETY: register-only AVX-512F arithmetic, which the caller has.
    unsafe {
        let x = _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(codes));
        let bits = _mm512_and_si512(x, _mm512_set1_epi32(0x87f0_0000u32 as i32));
        _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(E4M3_REBIAS))
    }
}

/// 2^120: an e4m3 exponent's bias (7) is 120 below an f32's (127).
pub(super) const E4M3_REBIAS: f32 = f32::from_bits((127 + 120) << 23);

/// Lane `j` of the result is the sum of `v[j]`'s 16 lanes, by the same tree for every `j`:
/// pairs of vectors interleaved and added (32-bit, then 64-bit, then twice by 128-bit lanes).
#[inline(always)]
unsafe fn reduce16(v: *const Lanes) -> __m512 {
    // SAFETY: the caller guarantees 16 readable `Lanes` at `v` and AVX-512F.
    unsafe {
        let at = |i: usize| _mm512_load_ps(v.add(i).cast());
        let mut s = [_mm512_setzero_ps(); 8];
        for (i, s) in s.iter_mut().enumerate() {
            let (a, b) = (at(2 * i), at(2 * i + 1));
            *s = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        let mut u = [_mm512_setzero_ps(); 4];
        for (i, u) in u.iter_mut().enumerate() {
            let (a, b) = (_mm512_castps_pd(s[2 * i]), _mm512_castps_pd(s[2 * i + 1]));
            // The 64-bit interleave moves f32 pairs; the add is f32.
            *u = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
            );
        }
        let half = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xdd>(x, y),
            )
        };
        let w = [half(u[0], u[1]), half(u[2], u[3])];
        half(w[0], w[1])
    }
}

/// `logits` of a bf16 cache by `vdpbf16ps`: each 16-lane partial sum is `D / 32` dot products
/// of bf16 pairs (exact products, f32 sums) of the raw query and K row, no widening.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn logits_bf16<T: Elem, C: Elem, const DV: usize>(
    args: &DecodeArgs<T, C>,
    geo: Geo,
    spans: &[(usize, usize, usize)],
    qraw: QRaw,
    tile: &mut [Lanes],
    scores: &mut [f32],
    range: Range<usize>,
) {
    // SAFETY: the caller's contract (C is Bf16, `qraw` holds the rows' bf16 queries, the CPU has AVX-512
    // BF16), passed on.
    unsafe { logits::<T, C, DV, true>(args, geo, spans, &[], qraw, tile, scores, range) }
}

/// Every logit of the rows in `spans` (bf16 query rows at `qraw` for `DP`) at positions `range`,
/// times `args.scale`, into `scores`; with `DP` (bf16 caches, AVX-512 BF16, DV even) by
/// `vdpbf16ps` on the raw rows, else from `q` (the rows widened to f32) by f32 FMAs.
///
/// A tile of 16 positions at a time: for each row and KV head, up to `HEADS` query heads hold
/// their queries in registers while the tile's K rows (in L1 after the first row) pass by once,
/// their 16-lane partial sums go to `tile` (16 `Lanes` a head, so it stays in L1 however many
/// rows share the call) and one transpose-reduce per head turns them into 16 logits.
///
/// # Safety
/// AVX-512F in the caller (and with `DP`: AVX-512 BF16, C being Bf16, `qraw` the rows' bf16
/// queries); `validate` passed; `tile` holds `HEADS * 16` lanes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn logits<T: Elem, C: Elem, const DV: usize, const DP: bool>(
    args: &DecodeArgs<T, C>,
    geo: Geo,
    spans: &[(usize, usize, usize)],
    q: &[f32],
    qraw: QRaw,
    tile: &mut [Lanes],
    scores: &mut [f32],
    range: Range<usize>,
) {
    let s = args.shape;
    let (d, hq, bs) = (s.head_dim, s.num_q_heads, s.block_size);
    let group = hq / s.num_kv_heads;
    let (lo, hi) = (range.start, range.end);
    let width = s.num_kv_heads * d;
    let mut rows = [0usize; 16];
    let mut t0 = lo / 16 * 16;
    while t0 < hi {
        for pos in t0.max(lo)..(t0 + 16).min(hi) {
            if pos + AHEAD * bs < hi {
                let next = geo.row(pos + AHEAD * bs);
                super::prefetch(&args.k_cache[next..next + width]);
            }
            rows[pos - t0] = geo.row(pos);
        }
        for (r, &(first, len, base)) in spans.iter().enumerate() {
            let (a, b) = (t0.max(first), (t0 + 16).min(len));
            if a >= b {
                continue;
            }
            let span = len - first;
            for kvh in 0..s.num_kv_heads {
                let mut h = kvh * group;
                while h < (kvh + 1) * group {
                    let n = ((kvh + 1) * group - h).min(HEADS);
                    // SAFETY: `validate` bounds every row offset; heads `h..h + n` of row `r` are
                    // inside q (or `qraw`'s rows); their logits at positions `a..b` lie inside
                    // the row's `span` scores for each head; the caller's features.
                    unsafe {
                        let job = Dots {
                            k: args.k_cache.as_ptr().add(kvh * d),
                            rows: &rows,
                            qb: qraw.ptr.wrapping_add(r * qraw.stride + h * d),
                            qf: q.as_ptr().wrapping_add((r * hq + h) * d),
                            d,
                            t0,
                            a,
                            b,
                            tile: tile.as_mut_ptr(),
                            dst: scores.as_mut_ptr().add(base + h * span),
                            span,
                            first,
                            scale: args.scale,
                        };
                        match n {
                            1 => dots::<C, DV, DP, 1>(&job),
                            2 => dots::<C, DV, DP, 2>(&job),
                            3 => dots::<C, DV, DP, 3>(&job),
                            _ => dots::<C, DV, DP, 4>(&job),
                        }
                    }
                    h += n;
                }
            }
        }
        t0 += 16;
    }
}

/// Query heads whose queries one pass of `dots` keeps in registers (a K row load serves them all).
const HEADS: usize = 4;

/// What `dots` works on: the K cache at one KV head's columns, the tile's cache row offsets, the
/// first head's query (bf16 `qb` for `vdpbf16ps`, else f32 `qf`; heads `d` elements apart), the
/// tile at `t0` and its positions `a..b`, and where head `j`'s logits go: `dst + j * span`,
/// position `pos` at `pos - first`.
struct Dots<'a, C> {
    k: *const C,
    rows: &'a [usize; 16],
    qb: *const u16,
    qf: *const f32,
    d: usize,
    t0: usize,
    a: usize,
    b: usize,
    tile: *mut Lanes,
    dst: *mut f32,
    span: usize,
    first: usize,
    scale: f32,
}

/// The logits of `HC` consecutive query heads of one row over one tile (see `logits`): the same
/// products, in the same order, and the same reduction as one head at a time.
///
/// # Safety
/// `logits`' contract; the job's pointers valid for `HC` heads and the tile's positions.
#[inline(always)]
unsafe fn dots<C: Elem, const DV: usize, const DP: bool, const HC: usize>(job: &Dots<C>) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut qv = [[_mm512_setzero_ps(); DV]; HC];
        for (j, qv) in qv.iter_mut().enumerate() {
            if DP {
                for (c, v) in qv.iter_mut().take(DV / 2).enumerate() {
                    *v = _mm512_castsi512_ps(_mm512_loadu_si512(
                        job.qb.add(j * job.d + c * 32).cast(),
                    ));
                }
            } else {
                for (c, v) in qv.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(job.qf.add(j * job.d + c * 16));
                }
            }
        }
        for pos in job.a..job.b {
            let slot = pos - job.t0;
            let krow = job.k.add(job.rows[slot]);
            if DP {
                let kraw = krow as *const u16;
                let mut k = [_mm512_setzero_si512(); DV];
                for (c, k) in k.iter_mut().take(DV / 2).enumerate() {
                    *k = _mm512_loadu_si512(kraw.add(c * 32).cast());
                }
                for (j, qv) in qv.iter().enumerate() {
                    let mut acc = _mm512_setzero_ps();
                    for (c, &k) in k.iter().take(DV / 2).enumerate() {
                        acc = dot2(acc, _mm512_castps_si512(qv[c]), k);
                    }
                    _mm512_store_ps(job.tile.add(j * 16 + slot).cast(), acc);
                }
            } else {
                let mut k = [_mm512_setzero_ps(); DV];
                for (c, k) in k.iter_mut().enumerate() {
                    *k = load16(krow.add(c * 16));
                }
                for (j, qv) in qv.iter().enumerate() {
                    let mut acc = _mm512_mul_ps(qv[0], k[0]);
                    for c in 1..DV {
                        acc = _mm512_fmadd_ps(qv[c], k[c], acc);
                    }
                    _mm512_store_ps(job.tile.add(j * 16 + slot).cast(), acc);
                }
            }
        }
        let scale = _mm512_set1_ps(job.scale);
        for j in 0..HC {
            let x = _mm512_mul_ps(reduce16(job.tile.add(j * 16)), scale);
            let dst = job.dst.add(j * job.span);
            if job.a == job.t0 && job.b == job.t0 + 16 {
                _mm512_storeu_ps(dst.add(job.t0 - job.first), x);
            } else {
                let mut lanes = [0.0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), x);
                for pos in job.a..job.b {
                    *dst.add(pos - job.first) = lanes[pos - job.t0];
                }
            }
        }
    }
}

/// `acc + a[2i] b[2i] + a[2i+1] b[2i+1]` per f32 lane, the operands bf16 pairs (`vdpbf16ps`;
/// the caller has AVX-512 BF16).
#[inline(always)]
pub(crate) unsafe fn dot2(acc: __m512, a: __m512i, b: __m512i) -> __m512 {
    // SAFETY: register arithmetic; the casts reinterpret bits.
    unsafe {
        _mm512_dpbf16_ps(
            acc,
            std::mem::transmute::<__m512i, __m512bh>(a),
            std::mem::transmute::<__m512i, __m512bh>(b),
        )
    }
}

/// `ops::exp` on 16 lanes, the same operations in the same order (so the same bits).
#[inline(always)]
pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
    // SAFETY: register arithmetic only; the caller guarantees AVX-512F.
    unsafe {
        use crate::cpu::ops::exp_consts::*;
        let c = _mm512_set1_ps;
        let round = c(ROUND);
        let x = _mm512_min_ps(_mm512_max_ps(x, c(LO)), c(HI));
        let t = _mm512_add_ps(_mm512_mul_ps(x, c(std::f32::consts::LOG2_E)), round);
        let n = _mm512_sub_ps(t, round);
        let r = _mm512_add_ps(
            _mm512_sub_ps(x, _mm512_mul_ps(n, c(LN2_HI))),
            _mm512_mul_ps(n, c(LN2_LO)),
        );
        let mut p = c(P0);
        for k in POLY {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), c(k));
        }
        let y = _mm512_add_ps(
            _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
            c(1.0),
        );
        let bits = _mm512_add_epi32(
            _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(round)),
            _mm512_set1_epi32(127),
        );
        _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bits)))
    }
}

/// One (row, head)'s logits to probabilities in place, the sink (if any) in the denominator.
#[target_feature(enable = "avx512f")]
unsafe fn softmax(sc: &mut [f32], sink: Option<f32>) {
    let n = sc.len() / 16 * 16;
    let p = sc.as_mut_ptr();
    // SAFETY: every access is below `sc.len()`: vectors at multiples of 16 below `n`.
    unsafe {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(16) {
            m = _mm512_max_ps(m, _mm512_loadu_ps(p.add(i)));
        }
        // A sink enters the max too, so a sink far above every logit cannot overflow exp().
        let max = sc[n..]
            .iter()
            .copied()
            .fold(_mm512_reduce_max_ps(m), f32::max)
            .max(sink.unwrap_or(f32::NEG_INFINITY));
        let (vmax, mut acc) = (_mm512_set1_ps(max), _mm512_setzero_ps());
        for i in (0..n).step_by(16) {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), vmax));
            _mm512_storeu_ps(p.add(i), e);
            acc = _mm512_add_ps(acc, e);
        }
        let mut lanes = [0.0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut tail = 0.0;
        for x in sc[n..].iter_mut() {
            *x = crate::cpu::ops::exp(*x - max);
            tail += *x;
        }
        let total = lanes.iter().sum::<f32>() + tail;
        let inv = 1.0 / (total + sink.map_or(0.0, |x| crate::cpu::ops::exp(x - max)));
        let vinv = _mm512_set1_ps(inv);
        for i in (0..n).step_by(16) {
            _mm512_storeu_ps(p.add(i), _mm512_mul_ps(_mm512_loadu_ps(p.add(i)), vinv));
        }
        sc[n..].iter_mut().for_each(|x| *x *= inv);
    }
}

/// `out` columns `c0 * 16..(c0 + NC) * 16` of every pair in `pairs` (at most `NP`; exactly `NP`
/// with `EXACT`): the sum over its positions of probability × V row (cache columns
/// `col..col + NC * 16`), accumulated in registers, positions in order.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn weigh<T: Elem, C: Elem, const NC: usize, const NP: usize, const EXACT: bool>(
    v_cache: &[C],
    geo: Geo,
    pairs: &[Pair],
    col: usize,
    scores: &[f32],
    out: &mut [T],
    c0: usize,
) {
    debug_assert!(!EXACT || pairs.len() == NP);
    let np = pairs.len().min(NP);
    let pairs = &pairs[..np];
    let Spans {
        lo,
        all_lo,
        all_hi,
        hi,
    } = Spans::of(pairs);
    let mut acc = [[_mm512_setzero_ps(); NC]; NP];
    let at = At {
        v_cache,
        scores,
        geo,
        col,
        hi,
    };
    // SAFETY (all three): AVX-512F (this function's contract); `step`'s own contract holds for
    // positions inside the pairs' spans, which these ranges are.
    unsafe {
        for pos in lo..all_lo.min(hi) {
            step::<C, NC, NP, true, EXACT>(&at, pairs, &mut acc, pos);
        }
        for pos in all_lo..all_hi {
            step::<C, NC, NP, false, EXACT>(&at, pairs, &mut acc, pos);
        }
        for pos in all_hi.max(lo)..hi {
            step::<C, NC, NP, true, EXACT>(&at, pairs, &mut acc, pos);
        }
    }
    for (pr, acc) in pairs.iter().zip(&acc) {
        let dst = &mut out[pr.out + c0 * 16..pr.out + (c0 + NC) * 16];
        let mut lanes = [0.0f32; 16];
        for (c, &a) in acc.iter().enumerate() {
            // SAFETY: a 16-float local buffer; AVX-512F.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), a) };
            for (o, &x) in dst[c * 16..(c + 1) * 16].iter_mut().zip(&lanes) {
                *o = T::store(x);
            }
        }
    }
}

/// What `weigh` reads: the V cache at columns `col..`, the probabilities, the positions' end
/// (both widths' `weigh`).
pub(super) struct At<'a, T> {
    pub(super) v_cache: &'a [T],
    pub(super) scores: &'a [f32],
    pub(super) geo: Geo<'a>,
    pub(super) col: usize,
    pub(super) hi: usize,
}

/// The positions `weigh` walks for its pairs: `lo..hi` in all, and `all_lo..all_hi`, attended
/// by every pair, where no span check is needed.
pub(super) struct Spans {
    pub(super) lo: usize,
    pub(super) all_lo: usize,
    pub(super) all_hi: usize,
    pub(super) hi: usize,
}

impl Spans {
    pub(super) fn of(pairs: &[Pair]) -> Spans {
        let all_lo = pairs.iter().map(|p| p.first).max().unwrap_or(0);
        Spans {
            lo: pairs.iter().map(|p| p.first).min().unwrap_or(0),
            all_lo,
            all_hi: pairs.iter().map(|p| p.len).min().unwrap_or(0).max(all_lo),
            hi: pairs.iter().map(|p| p.len).max().unwrap_or(0),
        }
    }
}

/// One position of `weigh`: its V row (NC vectors) into every pair's accumulators; with
/// `CHECK`, only the pairs whose span holds `pos`.
///
/// # Safety
/// AVX-512F; `pos` is a position of some pair's span (so its cache row exists), and with
/// `CHECK = false`, of every pair's.
#[inline(always)]
unsafe fn step<T: Elem, const NC: usize, const NP: usize, const CHECK: bool, const EXACT: bool>(
    at: &At<T>,
    pairs: &[Pair],
    acc: &mut [[__m512; NC]; NP],
    pos: usize,
) {
    let geo = at.geo;
    if pos + AHEAD * geo.block_size < at.hi {
        let next = geo.row(pos + AHEAD * geo.block_size) + at.col;
        super::prefetch(&at.v_cache[next..next + NC * 16]);
    }
    // SAFETY: `validate` bounds the row offset; a pair's score is read only at its own
    // positions, inside its `len - first` logits.
    unsafe {
        let vr = at.v_cache.as_ptr().add(geo.row(pos) + at.col);
        let mut v = [_mm512_setzero_ps(); NC];
        for (c, v) in v.iter_mut().enumerate() {
            *v = load16(vr.add(c * 16));
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            if !EXACT && i >= pairs.len() {
                break;
            }
            let pr = pairs.get_unchecked(i);
            if CHECK && (pos < pr.first || pos >= pr.len) {
                continue;
            }
            let w = _mm512_set1_ps(*at.scores.as_ptr().add(pr.off + pos - pr.first));
            for (a, &v) in acc.iter_mut().zip(&v) {
                *a = _mm512_fmadd_ps(w, v, *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce16_sums_each_vector_into_its_lane() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut v = vec![Lanes([0.0; 16]); 16];
        for (j, l) in v.iter_mut().enumerate() {
            for (i, x) in l.0.iter_mut().enumerate() {
                *x = (j * 100 + i) as f32 * if i % 3 == 0 { -1.0 } else { 1.0 };
            }
        }
        let mut got = [0.0f32; 16];
        // SAFETY: AVX-512F checked above; 16 Lanes.
        unsafe { _mm512_storeu_ps(got.as_mut_ptr(), reduce16(v.as_ptr())) };
        for (j, l) in v.iter().enumerate() {
            assert_eq!(got[j], l.0.iter().sum::<f32>(), "lane {j}");
        }
    }

    #[test]
    fn exp16_equals_the_scalar_exp() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        let xs: Vec<f32> = (0..4096)
            .map(|i| -100.0 + i as f32 * 0.0471)
            .chain([f32::NEG_INFINITY, 0.0, -0.0, 88.5])
            .collect();
        for chunk in xs.chunks(16).filter(|c| c.len() == 16) {
            let mut got = [0.0f32; 16];
            // SAFETY: AVX-512F checked above; 16 floats each way.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp16(_mm512_loadu_ps(chunk.as_ptr()))) };
            for (g, &x) in got.iter().zip(chunk) {
                assert_eq!(g.to_bits(), crate::cpu::ops::exp(x).to_bits(), "exp({x})");
            }
        }
    }

    #[test]
    fn load16_widens_every_8_bit_code_as_elem_load() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        fn check<T: Elem>(codes: &[T]) {
            for chunk in codes.chunks(16) {
                let mut got = [0.0f32; 16];
                // SAFETY: AVX-512F checked above; 16 elements each way.
                unsafe { _mm512_storeu_ps(got.as_mut_ptr(), load16(chunk.as_ptr())) };
                for (g, c) in got.iter().zip(chunk) {
                    let want = c.load();
                    // e4m3's NaN codes read as +-480 (`e4m3x16`), e5m2's stay NaNs.
                    let e4m3_nan =
                        std::mem::size_of::<T>() == 1 && want.is_nan() && g.abs() == 480.0;
                    assert!(
                        g.to_bits() == want.to_bits() || g.is_nan() && want.is_nan() || e4m3_nan
                    );
                }
            }
        }
        check(&(0..=255u8).map(F8E4M3).collect::<Vec<_>>());
        check(&(0..=255u8).map(F8E5M2).collect::<Vec<_>>());
    }
}
