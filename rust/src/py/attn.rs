//! `paged_decode_attention`: the CPU decode kernel of `crate::attention` over numpy views of
//! torch tensors (zero-copy: `tensor.numpy()`), run with the GIL released.

use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyReadwriteArray3,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::value_error;
use crate::attention::{paged_decode, DecodeArgs, DecodeShape};

/// `out[i, h] = softmax(q[i, h] · K_i^T * scale) V_i` over the first `seq_lens[i]` positions of
/// sequence `i`'s pages. Shapes: q/out `[n, Hq, D]`, caches `[num_blocks, block_size, Hkv, D]`
/// (f32, C-contiguous), block_tables `[n, max_blocks]` and seq_lens `[n]` (int32).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, scale, out, threads = 1))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_decode_attention(
    py: Python<'_>,
    q: PyReadonlyArray3<'_, f32>,
    k_cache: PyReadonlyArray4<'_, f32>,
    v_cache: PyReadonlyArray4<'_, f32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    scale: f32,
    mut out: PyReadwriteArray3<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let (qs, cs, bt) = (q.shape(), k_cache.shape(), block_tables.shape());
    if v_cache.shape() != cs {
        return Err(value_error(
            "v_cache",
            format!("shape {:?} differs from k_cache {cs:?}", v_cache.shape()),
        ));
    }
    if cs[3] != qs[2] || bt[0] != qs[0] {
        return Err(value_error(
            "q",
            format!("shape {qs:?} does not fit k_cache {cs:?} and block_tables {bt:?}"),
        ));
    }
    if out.shape() != qs {
        return Err(value_error(
            "out",
            format!("shape {:?} differs from q {qs:?}", out.shape()),
        ));
    }
    let shape = DecodeShape {
        num_seqs: qs[0],
        num_q_heads: qs[1],
        num_kv_heads: cs[2],
        head_dim: qs[2],
        num_blocks: cs[0],
        block_size: cs[1],
        max_blocks: bt[1],
    };
    let contiguous = |name: &str, e| value_error(name, format!("must be C-contiguous ({e})"));
    let args = DecodeArgs {
        shape,
        q: q.as_slice().map_err(|e| contiguous("q", e))?,
        k_cache: k_cache.as_slice().map_err(|e| contiguous("k_cache", e))?,
        v_cache: v_cache.as_slice().map_err(|e| contiguous("v_cache", e))?,
        block_tables: block_tables
            .as_slice()
            .map_err(|e| contiguous("block_tables", e))?,
        seq_lens: seq_lens.as_slice().map_err(|e| contiguous("seq_lens", e))?,
        scale,
    };
    let out = out.as_slice_mut().map_err(|e| contiguous("out", e))?;
    py.detach(|| paged_decode(&args, out, threads))?;
    Ok(())
}

/// Where the CPU kernels run their threads: `"openmp"` (torch's pool) or `"threads"`.
#[pyfunction]
pub(crate) fn parallel_runtime() -> &'static str {
    crate::parallel::runtime_name()
}
