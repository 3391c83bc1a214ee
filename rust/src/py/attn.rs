//! `paged_decode_attention`: the CPU decode kernel of `crate::attention` over numpy views of
//! torch tensors (zero-copy: `tensor.numpy()`, half tensors as int16 views of their bits), run
//! with the GIL released.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::ops::{dtype_arg, ro, rw, with_elem, Ro, Rw};
use super::value_error;
use crate::attention::{paged_decode, write_rows, DecodeArgs, DecodeShape, NewRows};

/// `out[i, h] = softmax(q[i, h] · K_i^T * scale) V_i` over the first `seq_lens[i]` positions of
/// sequence `i`'s pages. Shapes: q/out `[n, Hq, D]` (q's rows may be strided, as a view into a
/// fused q|k|v row), caches `[num_blocks, block_size, Hkv, D]` (C-contiguous), block_tables
/// `[n, max_blocks]` and seq_lens `[n]` (int32). Every float array has `dtype`. With `k`, `v`
/// (`[n, Hkv, D]`, rows may be strided) and `slot_mapping` (`[n]` int64, -1 = skip), those rows
/// are first written into the caches: the step's whole attention in one call.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, scale, out, threads = 1, *,
                    dtype = "float32", k = None, v = None, slot_mapping = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_decode_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    scale: f32,
    out: &Bound<'_, PyAny>,
    threads: usize,
    dtype: &str,
    k: Option<&Bound<'_, PyAny>>,
    v: Option<&Bound<'_, PyAny>>,
    slot_mapping: Option<PyReadonlyArray1<'_, i64>>,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let q = ro(q, "q", dt)?;
    let mut out = rw(out, "out", dt)?;
    // Writable only when this call writes new rows: a read-only call may pass one array twice.
    let mut caches = match k {
        Some(_) => Caches::Rw(rw(k_cache, "k_cache", dt)?, rw(v_cache, "v_cache", dt)?),
        None => Caches::Ro(ro(k_cache, "k_cache", dt)?, ro(v_cache, "v_cache", dt)?),
    };
    let new = match (k, v, &slot_mapping) {
        (Some(k), Some(v), Some(_)) => Some((ro(k, "k", dt)?, ro(v, "v", dt)?)),
        (None, None, None) => None,
        _ => {
            let r = "k, v and slot_mapping go together";
            return Err(value_error("slot_mapping", r));
        }
    };
    let slots = match &slot_mapping {
        Some(s) => s
            .as_slice()
            .map_err(|_| value_error("slot_mapping", "must be C-contiguous"))?,
        None => &[],
    };
    let contiguous = |name: &str, e| value_error(name, format!("must be C-contiguous ({e})"));
    let tables = block_tables
        .as_slice()
        .map_err(|e| contiguous("block_tables", e))?;
    let lens = seq_lens.as_slice().map_err(|e| contiguous("seq_lens", e))?;
    let bt = block_tables.shape();
    with_elem!(dt, T => {
        let qr = q.rows::<T>("q")?;
        let (kcs, cs, vcs, vs) = match &mut caches {
            Caches::Rw(kc, vc) => {
                let ((kcs, cs), (vcs, vs)) = (kc.slice::<T>("k_cache")?, vc.slice::<T>("v_cache")?);
                (Cache::Rw(kcs), cs, Cache::Rw(vcs), vs)
            }
            Caches::Ro(kc, vc) => {
                let (kr, vr) = (kc.rows::<T>("k_cache")?, vc.rows::<T>("v_cache")?);
                kc.slice::<T>("k_cache")?;
                vc.slice::<T>("v_cache")?;
                (Cache::Ro(kr.data), kr.shape, Cache::Ro(vr.data), vr.shape)
            }
        };
        let (os, oshape) = out.slice::<T>("out")?;
        let qs = &qr.shape;
        if qs.len() != 3 || cs.len() != 4 {
            let r = format!("q must be [n, Hq, D] and the caches 4-D, got {qs:?} and {cs:?}");
            return Err(value_error("q", r));
        }
        if vs != cs {
            let r = format!("shape {vs:?} differs from k_cache {cs:?}");
            return Err(value_error("v_cache", r));
        }
        if cs[3] != qs[2] || bt[0] != qs[0] {
            let r = format!("shape {qs:?} does not fit k_cache {cs:?} and block_tables {bt:?}");
            return Err(value_error("q", r));
        }
        if oshape != *qs {
            let r = format!("shape {oshape:?} differs from q {qs:?}");
            return Err(value_error("out", r));
        }
        let rows = match &new {
            Some((k, v)) => {
                let (kr, vr) = (k.rows::<T>("k")?, v.rows::<T>("v")?);
                let want = [slots.len(), cs[2], cs[3]];
                if kr.shape != want || vr.shape != want {
                    let r = format!("k {:?} and v {:?} must both be {want:?}", kr.shape, vr.shape);
                    return Err(value_error("k", r));
                }
                Some(NewRows {
                    k: kr.data,
                    v: vr.data,
                    k_stride: kr.stride,
                    v_stride: vr.stride,
                    slots,
                })
            }
            None => None,
        };
        let args_shape = DecodeShape {
            num_seqs: qs[0],
            num_q_heads: qs[1],
            num_kv_heads: cs[2],
            head_dim: qs[2],
            num_blocks: cs[0],
            block_size: cs[1],
            max_blocks: bt[1],
        };
        let q_stride = qr.stride;
        let qdata = qr.data;
        py.detach(|| {
            let (kcs, vcs) = match (kcs, vcs, &rows) {
                (Cache::Rw(kcs), Cache::Rw(vcs), Some(rows)) => {
                    write_rows(kcs, vcs, rows, cs[2] * cs[3])?;
                    (&*kcs, &*vcs)
                }
                (kcs, vcs, _) => (kcs.get(), vcs.get()),
            };
            let args = DecodeArgs {
                shape: args_shape,
                q: qdata,
                q_stride,
                k_cache: kcs,
                v_cache: vcs,
                block_tables: tables,
                seq_lens: lens,
                scale,
            };
            paged_decode(&args, os, threads)
        })?;
    });
    Ok(())
}

enum Caches<'py> {
    Ro(Ro<'py>, Ro<'py>),
    Rw(Rw<'py>, Rw<'py>),
}

enum Cache<'a, T> {
    Ro(&'a [T]),
    Rw(&'a mut [T]),
}

impl<'a, T> Cache<'a, T> {
    fn get(self) -> &'a [T] {
        match self {
            Cache::Ro(s) => s,
            Cache::Rw(s) => s,
        }
    }
}

/// Where the CPU kernels run their threads: `"openmp"` (torch's pool) or `"threads"`.
#[pyfunction]
pub(crate) fn parallel_runtime() -> &'static str {
    crate::parallel::runtime_name()
}
