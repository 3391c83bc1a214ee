//! Fused paged decode attention for the CPU: one query token per sequence against its paged
//! K/V cache, read in place.
//!
//! The torch path gathers every sequence's blocks into a padded buffer and then runs SDPA, so
//! the cache is read, written and read again; at decode, with one query row per KV head group,
//! that traffic is the whole cost. Here each (sequence, KV head) reads its K rows once for the
//! logits and its V rows once for the output. Not bookkeeping, but it is the one piece of model
//! execution that torch cannot express without the copy.
//!
//! Layouts (row-major): `q` `[n, Hq, D]` whose rows may be `q_stride` elements apart (a view
//! into a fused q|k|v projection), `out` `[n, Hq, D]`; caches `[num_blocks, block_size, Hkv, D]`;
//! `block_tables` `[n, max_blocks]`. Query head `h` reads KV head `h / (Hq / Hkv)`. Every tensor
//! is f32, bf16 or f16: q and out of one type `T`, the caches of one type `C` (`T` itself, or a
//! 16-bit cache under f32 activations, which halves the bytes every decode step reads); logits,
//! softmax and the weighted sum are f32; the optional per-head sinks are f32 whatever the types.

use std::sync::Mutex;

use crate::cpu::elem::Elem;
use crate::cpu::ops::exp;
use crate::error::{CoreError, CoreResult};

#[derive(Clone, Copy, Debug)]
pub struct DecodeShape {
    pub num_seqs: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_blocks: usize,
    /// Elements between consecutive positions' cache rows: `num_kv_heads * head_dim` for a whole
    /// cache (what `validate` accepts); wider in the per-head views `paged_decode_on` makes.
    pub kv_stride: usize,
}

#[derive(Clone, Copy)]
pub struct DecodeArgs<'a, T: Elem = f32, C: Elem = T> {
    pub shape: DecodeShape,
    pub q: &'a [T],
    /// Elements between consecutive sequences' rows of `q` (`Hq * D` when packed).
    pub q_stride: usize,
    pub k_cache: &'a [C],
    pub v_cache: &'a [C],
    pub block_tables: &'a [i32],
    pub seq_lens: &'a [i32],
    pub scale: f32,
    /// Sliding-window attention: the query (at position `len - 1`) sees only the last `window`
    /// positions, keys in `(len - 1 - window, len - 1]`; `None` = the whole context.
    pub window: Option<usize>,
    /// Logit soft-capping (Gemma 2): each scaled logit `x` becomes `cap * tanh(x / cap)` before
    /// the softmax; `None` = plain logits.
    pub softcap: Option<f32>,
    /// Attention sinks (gpt-oss): one learned logit per query head, `[Hq]`, that joins each
    /// head's softmax denominator (`exp(sink)`) but has no value row: it only takes weight away
    /// from the keys. `None` = no sinks.
    pub sinks: Option<&'a [f32]>,
}

impl<T: Elem, C: Elem> DecodeArgs<'_, T, C> {
    /// The positions sequence `seq` attends: `first..len`.
    fn span(&self, seq: usize) -> (usize, usize) {
        let len = self.seq_lens[seq] as usize;
        (self.window.map_or(0, |w| len.saturating_sub(w)), len)
    }

    /// Every index the kernel will follow is checked here, so the loops can trust them.
    pub fn validate(&self, out_len: usize) -> CoreResult<()> {
        let s = self.shape;
        if s.num_kv_heads == 0 || s.head_dim == 0 || s.block_size == 0 {
            return Err(CoreError::invalid(
                "k_cache",
                "zero-sized head or block dimension",
            ));
        }
        if self.window == Some(0) {
            return Err(CoreError::invalid("window", "must be >= 1"));
        }
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(CoreError::invalid(
                    "softcap",
                    format!("must be > 0, got {cap}"),
                ));
            }
        }
        if let Some(sinks) = self.sinks {
            if sinks.len() != s.num_q_heads {
                let r = format!(
                    "has {} entries for {} query heads",
                    sinks.len(),
                    s.num_q_heads
                );
                return Err(CoreError::invalid("sinks", r));
            }
            if let Some(x) = sinks.iter().find(|x| !x.is_finite()) {
                return Err(CoreError::invalid(
                    "sinks",
                    format!("must be finite, got {x}"),
                ));
            }
        }
        if !s.num_q_heads.is_multiple_of(s.num_kv_heads) {
            let r = format!(
                "{} query heads are not a multiple of {} KV heads",
                s.num_q_heads, s.num_kv_heads
            );
            return Err(CoreError::invalid("q", r));
        }
        let q_len = s.num_seqs * s.num_q_heads * s.head_dim;
        let q_need = match s.num_seqs {
            0 => 0,
            n => (n - 1) * self.q_stride + s.num_q_heads * s.head_dim,
        };
        if s.num_seqs > 1 && self.q_stride < s.num_q_heads * s.head_dim {
            let r = format!("row stride {} overlaps its rows", self.q_stride);
            return Err(CoreError::invalid("q", r));
        }
        if s.kv_stride != s.num_kv_heads * s.head_dim {
            let r = format!(
                "cache row stride {} is not {} KV heads x {}",
                s.kv_stride, s.num_kv_heads, s.head_dim
            );
            return Err(CoreError::invalid("k_cache", r));
        }
        let cache_len = s.num_blocks * s.block_size * s.kv_stride;
        let lens = [
            ("q", self.q.len(), q_need),
            ("out", out_len, q_len),
            ("k_cache", self.k_cache.len(), cache_len),
            ("v_cache", self.v_cache.len(), cache_len),
            (
                "block_tables",
                self.block_tables.len(),
                s.num_seqs * s.max_blocks,
            ),
            ("seq_lens", self.seq_lens.len(), s.num_seqs),
        ];
        for (name, got, want) in lens {
            if got != want {
                return Err(CoreError::invalid(
                    name,
                    format!("has {got} elements, expected {want}"),
                ));
            }
        }
        for (i, &len) in self.seq_lens.iter().enumerate() {
            if len < 1 || len as usize > s.max_blocks * s.block_size {
                let r = format!(
                    "seq_lens[{i}] = {len} outside 1..={}",
                    s.max_blocks * s.block_size
                );
                return Err(CoreError::invalid("seq_lens", r));
            }
            let used = (len as usize).div_ceil(s.block_size);
            let row = &self.block_tables[i * s.max_blocks..i * s.max_blocks + used];
            if let Some(&b) = row.iter().find(|&&b| b < 0 || b as usize >= s.num_blocks) {
                let r = format!("row {i} names block {b}, the cache has {}", s.num_blocks);
                return Err(CoreError::invalid("block_tables", r));
            }
        }
        Ok(())
    }
}

/// This step's new K/V rows, `[n, Hkv, D]` each, rows `k_stride` / `v_stride` elements apart
/// (views into a fused q|k|v projection), and the cache slot of each (`block * block_size +
/// offset`; a negative slot marks a padding row, not written).
pub struct NewRows<'a, T: Elem> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub k_stride: usize,
    pub v_stride: usize,
    pub slots: &'a [i64],
}

/// Write `rows` into the caches (`[num_slots, width]` each), rounded to the caches' type where it
/// is narrower. Done in the attention call itself: at batch 1 a separate scatter per cache costs
/// more in dispatch than the copy.
pub fn write_rows<T: Elem, C: Elem>(
    k_cache: &mut [C],
    v_cache: &mut [C],
    rows: &NewRows<T>,
    width: usize,
) -> CoreResult<()> {
    let n = rows.slots.len();
    if width == 0 || k_cache.len() != v_cache.len() || !k_cache.len().is_multiple_of(width) {
        return Err(CoreError::invalid("v_cache", "does not match k_cache"));
    }
    for (name, got, stride) in [
        ("k", rows.k.len(), rows.k_stride),
        ("v", rows.v.len(), rows.v_stride),
    ] {
        if n > 1 && stride < width {
            let r = format!("row stride {stride} overlaps its rows");
            return Err(CoreError::invalid(name, r));
        }
        let need = if n == 0 { 0 } else { (n - 1) * stride + width };
        if got < need {
            let r = format!("has {got} elements, {n} rows need {need}");
            return Err(CoreError::invalid(name, r));
        }
    }
    let num_slots = (k_cache.len() / width) as i64;
    if let Some(&bad) = rows.slots.iter().find(|&&s| s >= num_slots) {
        let r = format!("slot {bad} outside a cache of {num_slots} slots");
        return Err(CoreError::invalid("slot_mapping", r));
    }
    for (i, &slot) in rows.slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let dst = slot as usize * width;
        let (ks, vs) = (i * rows.k_stride, i * rows.v_stride);
        put(&mut k_cache[dst..dst + width], &rows.k[ks..ks + width]);
        put(&mut v_cache[dst..dst + width], &rows.v[vs..vs + width]);
    }
    Ok(())
}

/// `dst = src`, each element rounded from `T` to `C` (a plain copy when they are one type).
#[inline(always)]
fn put<T: Elem, C: Elem>(dst: &mut [C], src: &[T]) {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<C>() {
        // SAFETY: T and C are the same type (the TypeId check), so this reinterprets nothing.
        let src = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<C>(), src.len()) };
        dst.copy_from_slice(src);
    } else {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = C::store(s.load()));
    }
}

/// Attend every sequence, splitting the sequences into `threads` runs of about equal total
/// context length (each thread then reads about the same number of cache rows).
pub fn paged_decode<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    out: &mut [T],
    threads: usize,
) -> CoreResult<()> {
    paged_decode_on(args, out, threads, Path::best())
}

/// A body of the kernel. Every path keeps the module's promise (a row's bits do not depend on
/// its neighbours); their bits differ from each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// Plain Rust, any CPU.
    Generic,
    /// The generic body compiled for AVX2 + FMA (for a CPU without F16C; tests run it).
    Avx2,
    /// `attention_avx2`'s explicit AVX2 passes where the head dim allows, else the generic body
    /// compiled for AVX2 + FMA + F16C.
    Avx2Tiles,
    /// The generic body compiled for AVX-512 (`Avx512Tiles` falls back to it; tests run it).
    #[cfg_attr(not(test), allow(dead_code))]
    Avx512,
    /// `attention_x86`'s explicit AVX-512 passes where the head dim allows, else `Avx512`.
    Avx512Tiles,
    /// `Avx512Tiles` with a bf16 cache's logits by `vdpbf16ps` on the raw bf16 K rows and queries
    /// (no widening; head dims a multiple of 32); other caches and dims as `Avx512Tiles`.
    Avx512Bf16,
}

impl Path {
    #[cfg(test)]
    pub(crate) const ALL: [Path; 6] = [
        Path::Generic,
        Path::Avx2,
        Path::Avx2Tiles,
        Path::Avx512,
        Path::Avx512Tiles,
        Path::Avx512Bf16,
    ];

    /// Whether this CPU can run the path.
    pub(crate) fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            match self {
                Path::Generic => true,
                Path::Avx2 => has!("avx2") && has!("fma"),
                Path::Avx2Tiles => has!("avx2") && has!("fma") && has!("f16c"),
                Path::Avx512 | Path::Avx512Tiles => has!("avx512f") && has!("avx512bw"),
                Path::Avx512Bf16 => has!("avx512f") && has!("avx512bw") && has!("avx512bf16"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Path::Generic
        }
    }

    fn best() -> Path {
        [
            Path::Avx512Bf16,
            Path::Avx512Tiles,
            Path::Avx2Tiles,
            Path::Avx2,
        ]
        .into_iter()
        .find(|p| p.available())
        .unwrap_or(Path::Generic)
    }
}

/// `paged_decode` on a given path (one this CPU has: an unavailable one is an error).
pub(crate) fn paged_decode_on<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    out: &mut [T],
    threads: usize,
    path: Path,
) -> CoreResult<()> {
    if !path.available() {
        let r = format!("this CPU cannot run the {path:?} kernel");
        return Err(CoreError::invalid("path", r));
    }
    args.validate(out.len())?;
    let s = args.shape;
    // One row, or 3+ rows of one table (2 rows split 1 : 1 by rows measured faster than by heads).
    let one_table = s.num_seqs != 2 && (1..s.num_seqs).all(|r| args.same_table(0, r));
    if threads > 1 && s.num_q_heads > 1 && one_table {
        let (first, len) = args.span(s.num_seqs - 1);
        if (len - first) * s.num_seqs * s.num_q_heads * s.head_dim >= SPLIT_MIN_WORK {
            split_heads(args, out, threads, path);
            return Ok(());
        }
    }
    let width = s.num_q_heads * s.head_dim; // one sequence's output
    let parts = threads.clamp(1, s.num_seqs.max(1));
    let attended = |i: usize| {
        let (first, len) = args.span(i);
        len - first
    };
    let total: usize = (0..s.num_seqs).map(attended).sum();
    let (mut start, mut done, mut rest) = (0, 0, out);
    let mut runs = Vec::with_capacity(parts);
    for p in 0..parts {
        let mut end = start;
        while end < s.num_seqs && (p + 1 == parts || done < total * (p + 1) / parts) {
            done += attended(end);
            end += 1;
        }
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut((end - start) * width);
        runs.push((*args, start, mine));
        (start, rest) = (end, tail);
    }
    run_split(runs, path);
    Ok(())
}

/// Each `(args, first, out)` run on a thread of its own: `run_seqs` over sequences `first..` of
/// `args` into `out`, the runs' outputs disjoint.
fn run_split<T: Elem, C: Elem>(runs: Vec<(DecodeArgs<'_, T, C>, usize, &mut [T])>, path: Path) {
    // Each run is locked by exactly one thread: the mutex only proves the slices disjoint.
    let runs: Vec<_> = runs.into_iter().map(Mutex::new).collect();
    crate::cpu::parallel::run_parts(runs.len(), &|p| {
        let mut run = runs[p].lock().unwrap_or_else(|e| e.into_inner());
        let (ref args, first, ref mut out) = *run;
        run_seqs(args, first, out, path);
    });
}

/// Query elements times positions (positions x query heads x head dim) from which a single
/// sequence's heads are split over the threads: below it the fork costs about what the second
/// thread saves. (SmolLM2's 9 / 3 heads of 64: 85 positions, as the K elements' 16 Ki before.)
const SPLIT_MIN_WORK: usize = 48 * 1024;

/// A view of some heads of the arguments, and its output: the run of `out` it writes (one row),
/// or a buffer of its own (`[rows, its heads, D]`, copied into `out` after).
type View<'a, T, C> = (DecodeArgs<'a, T, C>, Dest<'a, T>);

enum Dest<'a, T> {
    Out(&'a mut [T]),
    Own(Vec<T>),
}

/// One sequence's query rows (one row, or a speculative verification's rows sharing its table)
/// on up to `threads` threads, each attending a contiguous run of the heads, for every row,
/// through views of the arguments: the same kernels, each (row, head)'s arithmetic unchanged, so
/// the bits do not depend on the split (nor on the rows: the module's promise). One row: runs of
/// whole KV heads while there are at least as many KV heads as threads, else (MQA's single KV
/// head, say) runs of query heads, a KV head's group cut between threads that then each read its
/// cache rows (MQA's decode attention ran on one thread; cutting groups when whole KV heads split
/// unevenly, 3 on 2 threads, measured no faster at one row: a thread's time follows the KV heads
/// it reads). Several rows: runs of query heads (their work grows with the rows, the reads do
/// not), each thread reading its KV heads once for all rows, where a split by rows had every
/// thread read every head.
fn split_heads<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    out: &mut [T],
    threads: usize,
    path: Path,
) {
    let s = args.shape;
    let (rows, hq, hkv, d) = (s.num_seqs, s.num_q_heads, s.num_kv_heads, s.head_dim);
    let group = hq / hkv;
    let parts = threads.min(hq);
    let whole = rows == 1 && hkv >= parts;
    // Each part's views with their outputs, in head order.
    let mut runs: Vec<Vec<View<T, C>>> = Vec::with_capacity(parts);
    let mut rest = out;
    for p in 0..parts {
        let (h0, h1) = if whole {
            (hkv * p / parts * group, hkv * (p + 1) / parts * group)
        } else {
            (hq * p / parts, hq * (p + 1) / parts)
        };
        let mut views = Vec::new();
        let mut h = h0;
        while h < h1 {
            let kv = h / group;
            // Whole KV heads in one view; a cut group a view of its own.
            let end = if h % group == 0 && h1 % group == 0 {
                h1
            } else {
                h1.min((kv + 1) * group)
            };
            let dest = if rows == 1 {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut((end - h) * d);
                rest = tail;
                Dest::Out(mine)
            } else {
                Dest::Own(vec![T::store(0.0); rows * (end - h) * d])
            };
            let view = DecodeArgs {
                shape: DecodeShape {
                    num_q_heads: end - h,
                    num_kv_heads: (end - h).div_ceil(group),
                    ..s
                },
                q: &args.q[h * d..],
                q_stride: args.q_stride,
                k_cache: &args.k_cache[kv * d..],
                v_cache: &args.v_cache[kv * d..],
                block_tables: args.block_tables,
                seq_lens: args.seq_lens,
                scale: args.scale,
                window: args.window,
                softcap: args.softcap,
                sinks: args.sinks.map(|sk| &sk[h..end]),
            };
            views.push((view, dest));
            h = end;
        }
        runs.push(views);
    }
    // One view a thread (one row, whole KV heads): `run_split`, as before the views; through the
    // per-thread lists below one row at context 600 took 0.020-0.021 ms against 0.018 (2 threads).
    if rows == 1 && runs.iter().all(|views| views.len() == 1) {
        let mut single = Vec::with_capacity(runs.len());
        for mut views in runs {
            match views.pop() {
                Some((view, Dest::Out(out))) => single.push((view, 0, out)),
                _ => unreachable!("one row's views write their runs of `out`"),
            }
        }
        return run_split(single, path);
    }
    // Each part's views are locked by exactly one thread: the mutex only proves them disjoint.
    let runs: Vec<_> = runs.into_iter().map(Mutex::new).collect();
    crate::cpu::parallel::run_parts(runs.len(), &|p| {
        let mut views = runs[p].lock().unwrap_or_else(|e| e.into_inner());
        for (args, dest) in views.iter_mut() {
            match dest {
                Dest::Out(out) => run_seqs(args, 0, out, path),
                Dest::Own(buf) => run_seqs(args, 0, buf, path),
            }
        }
    });
    if rows == 1 {
        return;
    }
    // The views' rows into `out` (`rest` is all of it: no view took a run).
    let mut h0 = 0;
    for views in runs {
        for (view, dest) in views.into_inner().unwrap_or_else(|e| e.into_inner()) {
            let n = view.shape.num_q_heads * d;
            if let Dest::Own(buf) = dest {
                for (r, src) in buf.chunks_exact(n).enumerate() {
                    rest[r * hq * d + h0..][..n].copy_from_slice(src);
                }
            }
            h0 += n;
        }
    }
}

/// Sequences `first..first + out.len() / (Hq * D)` on `path` (one this CPU has): the generic
/// body is inlined into each wrapper and vectorised for its target features.
fn run_seqs<T: Elem, C: Elem>(args: &DecodeArgs<T, C>, first: usize, out: &mut [T], path: Path) {
    #[cfg(target_arch = "x86_64")]
    match path {
        // SAFETY: `paged_decode_on` checked that the CPU has the path's features; `validate` passed.
        Path::Avx512Tiles => return unsafe { run_seqs_tiles(args, first, out, false) },
        // SAFETY: as above (the path's features include AVX-512 BF16).
        Path::Avx512Bf16 => return unsafe { run_seqs_tiles(args, first, out, true) },
        // SAFETY: as above.
        Path::Avx512 => return unsafe { run_seqs_avx512(args, first, out) },
        // SAFETY: as above.
        Path::Avx2Tiles => return unsafe { run_seqs_avx2_tiles(args, first, out) },
        // SAFETY: as above.
        Path::Avx2 => return unsafe { run_seqs_avx2(args, first, out) },
        Path::Generic => {}
    }
    let _ = path;
    run_seqs_generic(args, first, out, attend)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn run_seqs_tiles<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    first: usize,
    out: &mut [T],
    dp: bool,
) {
    if !x86::serves(args.shape.head_dim) {
        return run_seqs_generic(args, first, out, attend);
    }
    // SAFETY: this function's features include AVX-512F; the args passed `validate`; `dp` only
    // on the path that checked AVX-512 BF16.
    let body = |a: &DecodeArgs<T, C>, rows, sc: &mut Scratch, o: &mut [T]| unsafe {
        x86::attend(a, rows, sc, o, dp)
    };
    run_seqs_generic(args, first, out, body)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn run_seqs_avx512<T: Elem, C: Elem>(args: &DecodeArgs<T, C>, first: usize, out: &mut [T]) {
    run_seqs_generic(args, first, out, attend)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_seqs_avx2_tiles<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    first: usize,
    out: &mut [T],
) {
    if !avx2::serves(args.shape.head_dim) {
        return run_seqs_generic(args, first, out, attend);
    }
    // SAFETY: this function's features are the body's; the args passed `validate`.
    let body = |a: &DecodeArgs<T, C>, rows, sc: &mut Scratch, o: &mut [T]| unsafe {
        avx2::attend(a, rows, sc, o)
    };
    run_seqs_generic(args, first, out, body)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_seqs_avx2<T: Elem, C: Elem>(args: &DecodeArgs<T, C>, first: usize, out: &mut [T]) {
    run_seqs_generic(args, first, out, attend)
}

/// Each run of rows that share a block table through `body` (an `attend`).
#[inline(always)]
fn run_seqs_generic<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    first: usize,
    out: &mut [T],
    mut body: impl FnMut(&DecodeArgs<T, C>, std::ops::Range<usize>, &mut Scratch, &mut [T]),
) {
    let width = args.shape.num_q_heads * args.shape.head_dim;
    let n = out.len() / width;
    let mut scratch = Scratch {
        scores: Vec::new(),
        q: Vec::new(),
        qb: Vec::new(),
        acc: Vec::new(),
        spans: Vec::new(),
        tile: Vec::new(),
    };
    let mut i = 0;
    while i < n {
        let mut end = i + 1;
        while end < n && args.same_table(first + i, first + end) {
            end += 1;
        }
        body(
            args,
            first + i..first + end,
            &mut scratch,
            &mut out[i * width..end * width],
        );
        i = end;
    }
}

impl<T: Elem, C: Elem> DecodeArgs<'_, T, C> {
    /// Rows with one block table are one sequence's consecutive query rows (a speculative
    /// verification, a short chunk): they share their cache rows.
    fn same_table(&self, a: usize, b: usize) -> bool {
        let m = self.shape.max_blocks;
        self.block_tables[a * m..(a + 1) * m] == self.block_tables[b * m..(b + 1) * m]
    }

    /// The group's queries widened to f32 into `q` and each row's attended positions `(first,
    /// len, offset of its logits)` into `spans`; returns the logits' total count and the
    /// positions `lo..hi` the group reads (positions before a row's `first` lie outside its
    /// window: never read for it).
    pub(super) fn gather(
        &self,
        rows: std::ops::Range<usize>,
        q: &mut Vec<f32>,
        spans: &mut Vec<(usize, usize, usize)>,
    ) -> (usize, usize, usize) {
        let width = self.shape.num_q_heads * self.shape.head_dim;
        spans.clear();
        q.clear();
        let mut total = 0;
        for seq in rows {
            let (first, len) = self.span(seq);
            spans.push((first, len, total));
            total += self.shape.num_q_heads * (len - first);
            let start = seq * self.q_stride;
            q.extend(self.q[start..start + width].iter().map(|y| y.load()));
        }
        let lo = spans.iter().map(|sp| sp.0).min().unwrap_or(0);
        let hi = spans.iter().map(|sp| sp.1).max().unwrap_or(0);
        (total, lo, hi)
    }
}

/// Per-thread f32 working rows: the group's logits, queries and output accumulators, each
/// row's attended positions with the offset of its logits, and (`attention_x86`,
/// `attention_avx2`) the partial dot products of a tile of positions.
struct Scratch {
    scores: Vec<f32>,
    q: Vec<f32>,
    /// `attention_x86`: f32 queries rounded to bf16 for `vdpbf16ps` over a bf16 cache.
    qb: Vec<crate::cpu::elem::Bf16>,
    acc: Vec<f32>,
    spans: Vec<(usize, usize, usize)>,
    tile: Vec<Lanes>,
}

/// 16 floats on one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes([f32; 16]);

/// Rows `rows` of one sequence (one block table), all heads at once: the cache rows of a
/// position (every KV head, contiguous) are read once for the whole group, in order, a block at
/// a time, so the prefetcher sees a stream and a verification of k rows reads the cache once, not
/// k times. Two passes: logits for every position, softmax per row and head, then V rows
/// weighted into `out`. Each row's arithmetic (its dots, its softmax, its sums in position
/// order) is the same whatever the group, so a row's output does not depend on its neighbours.
#[inline(always)]
fn attend<T: Elem, C: Elem>(
    args: &DecodeArgs<T, C>,
    rows: std::ops::Range<usize>,
    scratch: &mut Scratch,
    out: &mut [T],
) {
    let s = args.shape;
    let (d, hq) = (s.head_dim, s.num_q_heads);
    let group = hq / s.num_kv_heads;
    let (width, stride) = (s.num_kv_heads * d, s.kv_stride);
    let table = &args.block_tables[rows.start * s.max_blocks..(rows.start + 1) * s.max_blocks];
    let (scores, q, acc, spans) = (
        &mut scratch.scores,
        &mut scratch.q,
        &mut scratch.acc,
        &mut scratch.spans,
    );
    let (total, lo, hi) = args.gather(rows.clone(), q, spans);
    let row = |pos: usize| {
        (table[pos / s.block_size] as usize * s.block_size + pos % s.block_size) * stride
    };
    scores.clear();
    scores.resize(total, 0.0);
    for pos in lo..hi {
        if pos + s.block_size < hi {
            prefetch(&args.k_cache[row(pos + s.block_size)..row(pos + s.block_size) + width]);
        }
        let k = &args.k_cache[row(pos)..row(pos) + width];
        for (r, &(first, len, base)) in spans.iter().enumerate() {
            if pos < first || pos >= len {
                continue;
            }
            let span = len - first;
            for h in 0..hq {
                let kh = &k[h / group * d..(h / group + 1) * d];
                let qh = &q[(r * hq + h) * d..(r * hq + h + 1) * d];
                scores[base + h * span + pos - first] = dot(qh, kh) * args.scale;
            }
        }
    }
    if let Some(cap) = args.softcap {
        scores.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
    }
    for &(first, len, base) in spans.iter() {
        let span = len - first;
        let mine = &mut scores[base..base + hq * span];
        for (h, sc) in mine.chunks_exact_mut(span).enumerate() {
            // A sink enters the max too, so a sink far above every logit cannot overflow exp().
            let sink = args.sinks.map(|sk| sk[h]);
            let max = sc
                .iter()
                .copied()
                .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
            sc.iter_mut().for_each(|x| *x = exp(*x - max));
            let inv = 1.0 / (sum(sc) + sink.map_or(0.0, |x| exp(x - max)));
            sc.iter_mut().for_each(|x| *x *= inv);
        }
    }
    acc.clear();
    acc.resize(spans.len() * hq * d, 0.0);
    for pos in lo..hi {
        if pos + s.block_size < hi {
            prefetch(&args.v_cache[row(pos + s.block_size)..row(pos + s.block_size) + width]);
        }
        let v = &args.v_cache[row(pos)..row(pos) + width];
        for (r, &(first, len, base)) in spans.iter().enumerate() {
            if pos < first || pos >= len {
                continue;
            }
            let span = len - first;
            let mine = &mut acc[r * hq * d..(r + 1) * hq * d];
            for (h, o) in mine.chunks_exact_mut(d).enumerate() {
                let p = scores[base + h * span + pos - first];
                for (o, &x) in o.iter_mut().zip(&v[h / group * d..(h / group + 1) * d]) {
                    *o += p * x.load();
                }
            }
        }
    }
    for (o, &x) in out.iter_mut().zip(acc.iter()) {
        *o = T::store(x);
    }
}

/// Ask for `rows` ahead of use (a block ahead here, two in the AVX-512 passes): pages are
/// scattered, so the hardware prefetcher, which follows one contiguous stream, stalls at every
/// block boundary without this. Into L2 (T1), not L1: a block ahead is ~200 lines in flight,
/// past L1's few miss buffers, so with T0 one thread read a long context at 8-9 GB/s (2-core
/// Zen 4, ctx 4000, 30 layers: 0.64-0.67 -> 0.43-0.51 ms a layer with T1; the default model at
/// ctx 4000 decoded 39.9 -> 61.1 tok/s, medians of 3).
#[inline(always)]
fn prefetch<T>(rows: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in rows.chunks(64 / std::mem::size_of::<T>().max(1)) {
        // SAFETY: a prefetch is only a hint and never faults; the address is inside `rows`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = rows;
}

#[inline(always)]
fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (body, tail) = xs.split_at(xs.len() / 16 * 16);
    for chunk in body.chunks_exact(16) {
        for l in 0..16 {
            acc[l] += chunk[l];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

/// Sixteen independent partial sums: float addition is not associative, so without them the
/// compiler must keep one serial chain and cannot vectorise the reduction.
#[inline(always)]
fn dot<T: Elem>(a: &[f32], b: &[T]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let (a16, a_tail) = a.split_at(a.len() / LANES * LANES);
    let (b16, b_tail) = b.split_at(a16.len());
    for (x, y) in a16.chunks_exact(LANES).zip(b16.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l].load();
        }
    }
    let tail: f32 = a_tail.iter().zip(b_tail).map(|(x, y)| x * y.load()).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
#[path = "attention_x86.rs"]
pub(crate) mod x86;

#[cfg(target_arch = "x86_64")]
#[path = "attention_avx2.rs"]
mod avx2;

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
