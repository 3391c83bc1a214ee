//! Fast dequantization into f32 or bf16, split over threads by row group: the fallback for
//! large batches, where a CPU with AMX runs a dense bf16 matmul faster than int8 VNNI dot
//! products (see `benches/bench_quant_matmul.py`), and for embedding lookups.

use std::sync::Mutex;

use super::{QKind, QMatrix, BLOCK, ROWS};
use crate::error::{CoreError, CoreResult};

/// Where [`QMatrix::dequantize_into`] writes `[rows, cols]`.
pub enum DequantOut<'a> {
    F32(&'a mut [f32]),
    /// bf16 bit patterns, rounded to nearest even (e.g. a torch bf16 tensor viewed as int16).
    Bf16(&'a mut [u16]),
}

/// An element type `dequantize_into` can write.
pub(crate) trait Elem: Copy + Send {
    fn from_f32(v: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Elem for u16 {
    /// Round to nearest even on the upper 16 bits (weights are finite).
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        let b = v.to_bits();
        ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// The 32 quants of row `r` (0..16) in a packed block, in column order.
#[inline(always)]
pub(crate) fn unpack(kind: QKind, blk: &[u8], r: usize) -> [u8; BLOCK] {
    let mut q = [0u8; BLOCK];
    match kind {
        QKind::Q8 => {
            for j in 0..8 {
                q[4 * j..4 * j + 4].copy_from_slice(&blk[j * 64 + r * 4..][..4]);
            }
        }
        QKind::Q4 => {
            for j in 0..4 {
                let w = &blk[j * 64 + r * 4..][..4];
                for i in 0..4 {
                    q[4 * j + i] = w[i] & 0x0F;
                    q[16 + 4 * j + i] = w[i] >> 4;
                }
            }
        }
        QKind::Q6K => unreachable!("Q6K blocks have two scales: see q6k.rs"),
    }
    q
}

/// Rows `g*16 ..` of the matrix into `out` (`[rows of the group, cols]`).
#[inline(always)]
fn group_into<T: Elem>(m: &QMatrix, g: usize, out: &mut [T]) {
    let (cols, fmt) = (m.cols, m.format());
    if fmt.kind == QKind::Q6K {
        let mut row = vec![0.0f32; cols];
        for (r, dst) in out.chunks_exact_mut(cols).enumerate() {
            m.q6k_row_into(g * ROWS + r, &mut row);
            for (o, &v) in dst.iter_mut().zip(&row) {
                *o = T::from_f32(v);
            }
        }
        return;
    }
    let bb = fmt.block_bytes();
    let blocks = m.group(g);
    for (r, dst) in out.chunks_exact_mut(cols).enumerate() {
        for (b, d) in dst.chunks_exact_mut(BLOCK).enumerate() {
            let blk = &blocks[b * bb..][..bb];
            let (s, mn) = fmt.scale_min_at(blk, r);
            let q = unpack(m.kind, blk, r);
            for (o, &q) in d.iter_mut().zip(&q) {
                *o = T::from_f32(s * q as f32 + mn);
            }
        }
    }
}

fn groups_into<T: Elem>(m: &QMatrix, first: usize, out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU supports AVX-512F/BW (checked just above).
            return unsafe { groups_avx512(m, first, out) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { groups_avx2(m, first, out) };
        }
    }
    groups_generic(m, first, out)
}

#[inline(always)]
fn groups_generic<T: Elem>(m: &QMatrix, first: usize, out: &mut [T]) {
    for (i, chunk) in out.chunks_mut(ROWS * m.cols).enumerate() {
        group_into(m, first + i, chunk);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn groups_avx512<T: Elem>(m: &QMatrix, first: usize, out: &mut [T]) {
    groups_generic(m, first, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn groups_avx2<T: Elem>(m: &QMatrix, first: usize, out: &mut [T]) {
    groups_generic(m, first, out)
}

fn run<T: Elem>(m: &QMatrix, out: &mut [T], threads: usize) {
    let groups = m.groups();
    let parts = threads.clamp(1, groups);
    let (mut rest, mut runs) = (out, Vec::with_capacity(parts));
    for p in 0..parts {
        let (g0, g1) = (groups * p / parts, groups * (p + 1) / parts);
        let rows = (g1 * ROWS).min(m.rows) - g0 * ROWS;
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(rows * m.cols);
        runs.push(Mutex::new((g0, mine)));
        rest = tail;
    }
    // Each run is locked by exactly one thread: the mutex only proves the slices disjoint.
    crate::cpu::parallel::run_parts(parts, &|p| {
        let mut run = runs[p].lock().unwrap_or_else(|e| e.into_inner());
        let (first, ref mut out) = *run;
        groups_into(m, first, out);
    });
}

impl QMatrix {
    /// All weights into `out` (`[rows, cols]`, f32 or bf16), `threads` parts.
    pub fn dequantize_into(&self, out: DequantOut, threads: usize) -> CoreResult<()> {
        let n = self.rows * self.cols;
        let len = match &out {
            DequantOut::F32(o) => o.len(),
            DequantOut::Bf16(o) => o.len(),
        };
        if len != n {
            let r = format!("has {len} elements, expected rows * cols = {n}");
            return Err(CoreError::invalid("out", r));
        }
        match out {
            DequantOut::F32(o) => run(self, o, threads),
            DequantOut::Bf16(o) => run(self, o, threads),
        }
        Ok(())
    }
}
