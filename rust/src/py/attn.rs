//! `paged_decode_attention`: the CPU decode kernel of `crate::cpu::attention` over numpy views of
//! torch tensors (zero-copy: `tensor.numpy()`, half tensors as int16 views of their bits), run
//! with the GIL released.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::ops::{cache_elem_arg, dtype_arg, ro, rw, with_elem, DType, Ro, Rw};
use super::value_error;
use crate::cpu::attention::{paged_decode, write_rows, DecodeArgs, DecodeShape, NewRows};
use crate::cpu::decode::{decode_from_qkv, QkNorm, QkvStep};
use crate::cpu::elem::{Bf16, Elem, F16, F8E4M3, F8E5M2};
use crate::cpu::prefill::{prefill, tiles_serve, PrefillArgs, PrefillShape};

/// Run `$body` with `$t` bound to the activations' element type and `$c` to the caches' (one of
/// the pairs `cache_dtype_arg` accepts).
macro_rules! with_elems {
    ($dt:expr, $ct:expr, $t:ident, $c:ident => $body:expr) => {
        match ($dt, $ct) {
            (DType::F32, DType::Bf16) => {
                type $t = f32;
                type $c = Bf16;
                $body
            }
            (DType::F32, DType::F16) => {
                type $t = f32;
                type $c = F16;
                $body
            }
            (DType::F32, DType::F8E4M3) => {
                type $t = f32;
                type $c = F8E4M3;
                $body
            }
            (DType::F32, DType::F8E5M2) => {
                type $t = f32;
                type $c = F8E5M2;
                $body
            }
            (DType::Bf16, DType::F8E4M3) => {
                type $t = Bf16;
                type $c = F8E4M3;
                $body
            }
            (DType::Bf16, DType::F8E5M2) => {
                type $t = Bf16;
                type $c = F8E5M2;
                $body
            }
            (dt, _) => with_elem!(dt, $t => {
                type $c = $t;
                $body
            }),
        }
    };
}

/// `out[i, h] = softmax(q[i, h] · K_i^T * scale) V_i` over the first `seq_lens[i]` positions of
/// sequence `i`'s pages. Shapes: q/out `[n, Hq, D]` (q's rows may be strided, as a view into a
/// fused q|k|v row), caches `[num_blocks, block_size, Hkv, D]` (C-contiguous), block_tables
/// `[n, max_blocks]` and seq_lens `[n]` (int32). Every float array has `dtype` but the caches,
/// which have `cache_dtype` (None: `dtype`; else bfloat16 or float16 under float32, float8_e4m3fn
/// or float8_e5m2 as uint8 codes under float32 or bfloat16). With `k`, `v`
/// (`[n, Hkv, D]`, rows may be strided) and `slot_mapping` (`[n]` int64, -1 = skip), those rows
/// are first written into the caches: the step's whole attention in one call. With `window`
/// (sliding-window attention) each query sees only its sequence's last `window` positions. With
/// `softcap` each logit `x` becomes `softcap * tanh(x / softcap)` before the softmax (Gemma 2).
/// With `sinks` (`[Hq]` float32, gpt-oss) each head's softmax denominator gains `exp(sinks[h])`.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, scale, out, threads = 1, *,
                    dtype = "float32", k = None, v = None, slot_mapping = None, window = None,
                    softcap = None, sinks = None, cache_dtype = None))]
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
    window: Option<usize>,
    softcap: Option<f32>,
    sinks: Option<PyReadonlyArray1<'_, f32>>,
    cache_dtype: Option<&str>,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let ct = cache_dtype_arg(cache_dtype, dt)?;
    let q = ro(q, "q", dt)?;
    let mut out = rw(out, "out", dt)?;
    // Writable only when this call writes new rows: a read-only call may pass one array twice.
    let mut caches = match k {
        Some(_) => Caches::Rw(rw(k_cache, "k_cache", ct)?, rw(v_cache, "v_cache", ct)?),
        None => Caches::Ro(ro(k_cache, "k_cache", ct)?, ro(v_cache, "v_cache", ct)?),
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
    let sinks = match &sinks {
        Some(s) => Some(s.as_slice().map_err(|e| contiguous("sinks", e))?),
        None => None,
    };
    let bt = block_tables.shape();
    with_elems!(dt, ct, T, C => {
        let qr = q.rows::<T>("q")?;
        let (kcs, cs, vcs, vs) = match &mut caches {
            Caches::Rw(kc, vc) => {
                let ((kcs, cs), (vcs, vs)) = (kc.slice::<C>("k_cache")?, vc.slice::<C>("v_cache")?);
                (Cache::Rw(kcs), cs, Cache::Rw(vcs), vs)
            }
            Caches::Ro(kc, vc) => {
                let (kr, vr) = (kc.rows::<C>("k_cache")?, vc.rows::<C>("v_cache")?);
                kc.slice::<C>("k_cache")?;
                vc.slice::<C>("v_cache")?;
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
            kv_stride: cs[2] * qs[2],
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
                window,
                softcap,
                sinks,
            };
            paged_decode(&args, os, threads)
        })?;
    });
    Ok(())
}

/// One layer's decode attention from its fused projection output `qkv` (`[n, (Hq + 2 Hkv) * D]`,
/// C-contiguous): with `q_norm` and `k_norm` the qk-norm of `qk_norm_inplace` (eps `eps`), then
/// RoPE on q and k (cos|sin rows of `rope_table` at `positions`; None = no positional encoding),
/// k and v written at `slot_mapping` (-1 = skip), then `out` (`[n, Hq * D]`) = paged attention of
/// q over each sequence's cache. The caches (of `cache_dtype`), block_tables, seq_lens, window and
/// softcap are as for `paged_decode_attention`.
#[pyfunction]
#[pyo3(signature = (qkv, k_cache, v_cache, block_tables, seq_lens, slot_mapping, positions, rope_table,
                    scale, out, num_q_heads, dtype = "float32", threads = 1, window = None, *,
                    q_norm = None, k_norm = None, eps = 1e-6, softcap = None, cache_dtype = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_attention_qkv(
    py: Python<'_>,
    qkv: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    slot_mapping: PyReadonlyArray1<'_, i64>,
    positions: PyReadonlyArray1<'_, i64>,
    rope_table: Option<&Bound<'_, PyAny>>,
    scale: f32,
    out: &Bound<'_, PyAny>,
    num_q_heads: usize,
    dtype: &str,
    threads: usize,
    window: Option<usize>,
    q_norm: Option<&Bound<'_, PyAny>>,
    k_norm: Option<&Bound<'_, PyAny>>,
    eps: f32,
    softcap: Option<f32>,
    cache_dtype: Option<&str>,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let ct = cache_dtype_arg(cache_dtype, dt)?;
    let qkv = ro(qkv, "qkv", dt)?;
    let table = rope_table.map(|t| ro(t, "rope_table", dt)).transpose()?;
    let norms = match (q_norm, k_norm) {
        (Some(q), Some(k)) => Some((ro(q, "q_norm", dt)?, ro(k, "k_norm", dt)?)),
        (None, None) => None,
        _ => return Err(value_error("k_norm", "q_norm and k_norm go together")),
    };
    let (mut kc, mut vc) = (rw(k_cache, "k_cache", ct)?, rw(v_cache, "v_cache", ct)?);
    let mut out = rw(out, "out", dt)?;
    let contiguous = |name: &str| value_error(name, "must be C-contiguous");
    let tables = block_tables
        .as_slice()
        .map_err(|_| contiguous("block_tables"))?;
    let lens = seq_lens.as_slice().map_err(|_| contiguous("seq_lens"))?;
    let slots = slot_mapping
        .as_slice()
        .map_err(|_| contiguous("slot_mapping"))?;
    let pos = positions.as_slice().map_err(|_| contiguous("positions"))?;
    let bt = block_tables.shape();
    with_elems!(dt, ct, T, C => {
        let qkv_data = qkv.slice::<T>("qkv")?;
        let rows = qkv.rows::<T>("qkv")?.shape.first().copied().unwrap_or(0);
        let table_data = table.as_ref().map(|t| t.slice::<T>("rope_table")).transpose()?;
        let qk_norm = match &norms {
            Some((q, k)) => Some(QkNorm {
                q_weight: q.slice::<T>("q_norm")?,
                k_weight: k.slice::<T>("k_norm")?,
                eps,
            }),
            None => None,
        };
        let (kcs, cs) = kc.slice::<C>("k_cache")?;
        let (vcs, vs) = vc.slice::<C>("v_cache")?;
        let (os, _) = out.slice::<T>("out")?;
        if cs.len() != 4 || vs != cs {
            let r = format!("k_cache {cs:?} and v_cache {vs:?} must be one 4-D shape");
            return Err(value_error("v_cache", r));
        }
        if bt[0] != rows {
            let r = format!("has {} rows for {rows} sequences", bt[0]);
            return Err(value_error("block_tables", r));
        }
        let shape = DecodeShape {
            num_seqs: rows,
            num_q_heads,
            num_kv_heads: cs[2],
            head_dim: cs[3],
            num_blocks: cs[0],
            block_size: cs[1],
            max_blocks: bt[1],
            kv_stride: cs[2] * cs[3],
        };
        let step = QkvStep {
            qkv: qkv_data,
            positions: pos,
            rope_table: table_data,
            slots,
            block_tables: tables,
            seq_lens: lens,
            scale,
            window,
            qk_norm,
            softcap,
        };
        py.detach(|| decode_from_qkv(&step, shape, kcs, vcs, os, threads))?;
    });
    Ok(())
}

/// The caches' element type: `dtype`'s without `cache_dtype`; a 16-bit one under float32
/// activations; an 8-bit one under float32 or bfloat16; else the same as `dtype`.
fn cache_dtype_arg(cache_dtype: Option<&str>, dt: DType) -> PyResult<DType> {
    let Some(name) = cache_dtype else {
        return Ok(dt);
    };
    let ct = cache_elem_arg(name, "cache_dtype")?;
    let byte = matches!(ct, DType::F8E4M3 | DType::F8E5M2);
    if byte && !matches!(dt, DType::F32 | DType::Bf16) {
        let r = format!("{name} caches are read under float32 or bfloat16 activations");
        return Err(value_error("cache_dtype", r));
    }
    if ct != dt && dt != DType::F32 && !byte {
        let r = format!("{name} caches are read under float32 activations or their own type only");
        return Err(value_error("cache_dtype", r));
    }
    Ok(ct)
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
    crate::cpu::parallel::runtime_name()
}

/// Causal attention of one sequence's prefill chunk (`crate::cpu::prefill`): `out[i, h] =
/// softmax(q[i, h] · K^T * scale) V` over keys `0..=context_len + i`. q `[n, Hq, D]`, k `[S, Hkv,
/// D]`, v `[S, Hkv, Dv]` (rows may be strided, as views into a fused q|k|v projection) with `S =
/// context_len + n` keys in position order; out `[n, Hq, Dv]` C-contiguous. q and out of `dtype`,
/// k and v of `kv_dtype` (default `dtype`), each float32 or bfloat16 (int16 views of the bits);
/// bf16 numerics whatever the types. Runs anywhere; fast where `prefill_attention_serves(D, Dv)`.
#[pyfunction]
#[pyo3(signature = (q, k, v, context_len, scale, out, threads = 1, dtype = "bfloat16", kv_dtype = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    context_len: usize,
    scale: f32,
    out: &Bound<'_, PyAny>,
    threads: usize,
    dtype: &str,
    kv_dtype: Option<&str>,
) -> PyResult<()> {
    let dt = prefill_dtype(dtype, "dtype")?;
    let kt = match kv_dtype {
        Some(name) => prefill_dtype(name, "kv_dtype")?,
        None => dt,
    };
    let (q, k, v) = (ro(q, "q", dt)?, ro(k, "k", kt)?, ro(v, "v", kt)?);
    let mut out = rw(out, "out", dt)?;
    match (dt, kt) {
        (DType::F32, DType::F32) => {
            prefill_typed::<f32, f32>(py, &q, &k, &v, context_len, scale, &mut out, threads)
        }
        (DType::F32, _) => {
            prefill_typed::<f32, Bf16>(py, &q, &k, &v, context_len, scale, &mut out, threads)
        }
        (_, DType::F32) => {
            prefill_typed::<Bf16, f32>(py, &q, &k, &v, context_len, scale, &mut out, threads)
        }
        _ => prefill_typed::<Bf16, Bf16>(py, &q, &k, &v, context_len, scale, &mut out, threads),
    }
}

/// float32 or bfloat16: the types `prefill_attention` takes.
fn prefill_dtype(name: &str, arg: &str) -> PyResult<DType> {
    match dtype_arg(name) {
        Ok(DType::F16) | Err(_) => Err(value_error(
            arg,
            format!("must be float32 or bfloat16, got {name:?}"),
        )),
        Ok(dt) => Ok(dt),
    }
}

#[allow(clippy::too_many_arguments)]
fn prefill_typed<Q: Elem, K: Elem>(
    py: Python<'_>,
    q: &Ro<'_>,
    k: &Ro<'_>,
    v: &Ro<'_>,
    context_len: usize,
    scale: f32,
    out: &mut Rw<'_>,
    threads: usize,
) -> PyResult<()> {
    let (qr, kr, vr) = (q.rows::<Q>("q")?, k.rows::<K>("k")?, v.rows::<K>("v")?);
    let (qs, ks, vs) = (&qr.shape, &kr.shape, &vr.shape);
    if qs.len() != 3 || ks.len() != 3 || vs.len() != 3 {
        let r = format!("q, k and v must be 3-D, got {qs:?}, {ks:?} and {vs:?}");
        return Err(value_error("q", r));
    }
    if ks[0] != context_len + qs[0] || vs[..2] != ks[..2] || ks[2] != qs[2] {
        let r = format!("k {ks:?} and v {vs:?} do not fit q {qs:?} after {context_len} keys");
        return Err(value_error("k", r));
    }
    let (os, oshape) = out.slice::<Q>("out")?;
    if oshape != [qs[0], qs[1], vs[2]] {
        let r = format!("shape {oshape:?}, expected {:?}", [qs[0], qs[1], vs[2]]);
        return Err(value_error("out", r));
    }
    let args = PrefillArgs {
        shape: PrefillShape {
            rows: qs[0],
            context_len,
            num_q_heads: qs[1],
            num_kv_heads: ks[1],
            head_dim: qs[2],
            v_dim: vs[2],
        },
        q: qr.data,
        q_stride: qr.stride,
        k: kr.data,
        k_stride: kr.stride,
        v: vr.data,
        v_stride: vr.stride,
        scale,
    };
    py.detach(|| prefill(&args, os, threads))?;
    Ok(())
}

/// Whether `prefill_attention` runs heads of these dims on its fast tiles on this CPU (AVX-512
/// BF16, head_dim a multiple of 32, v_dim of 16).
#[pyfunction]
pub(crate) fn prefill_attention_serves(head_dim: usize, v_dim: usize) -> bool {
    tiles_serve(head_dim, v_dim)
}
