//! `rms_norm`, `residual_add`, `qk_norm_inplace`, `rope_inplace`, `silu_and_mul`, `gelu_tanh_and_mul` and
//! `cpu_features`: the fused CPU kernels of
//! `crate::cpu::ops` over numpy views of torch tensors, run with the GIL released.
//!
//! numpy has no bfloat16, so half tensors cross as int16 views of their bits
//! (`t.view(torch.int16).numpy()`) and a `dtype` argument says how to read them.

use numpy::{
    PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyReadonlyArrayDyn, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::value_error;
use crate::cpu::elem::Elem;
use crate::cpu::ops::{self, QkShape, RopeShape};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DType {
    F32,
    Bf16,
    F16,
    /// The 8-bit floats: KV cache types only (`cache_dtype_arg`), never activations.
    F8E4M3,
    F8E5M2,
}

/// A KV cache's element type: an activation type or one of the 8-bit floats (torch's names).
pub(crate) fn cache_elem_arg(name: &str, arg: &str) -> PyResult<DType> {
    match name.trim_start_matches("torch.") {
        "float8_e4m3fn" => Ok(DType::F8E4M3),
        "float8_e5m2" => Ok(DType::F8E5M2),
        other => dtype_arg(other).map_err(|_| {
            let r = format!(
                "must be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, got {name:?}"
            );
            value_error(arg, r)
        }),
    }
}

pub(crate) fn dtype_arg(dtype: &str) -> PyResult<DType> {
    match dtype.trim_start_matches("torch.") {
        "float32" => Ok(DType::F32),
        "bfloat16" => Ok(DType::Bf16),
        "float16" => Ok(DType::F16),
        other => Err(value_error(
            "dtype",
            format!("must be float32, bfloat16 or float16, got {other:?}"),
        )),
    }
}

/// Run `$body` with `$t` bound to the element type of `$dt`.
macro_rules! with_elem {
    ($dt:expr, $t:ident => $body:expr) => {
        match $dt {
            $crate::py::ops::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::py::ops::DType::Bf16 => {
                type $t = $crate::cpu::elem::Bf16;
                $body
            }
            $crate::py::ops::DType::F16 => {
                type $t = $crate::cpu::elem::F16;
                $body
            }
            $crate::py::ops::DType::F8E4M3 | $crate::py::ops::DType::F8E5M2 => {
                unreachable!("8-bit floats are cache types: dtype_arg never returns them")
            }
        }
    };
}
pub(crate) use with_elem;

/// A float array from Python, read-only: f32 values, the bits of a 16-bit float or the codes of
/// an 8-bit one.
pub(crate) enum Ro<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    Half(PyReadonlyArrayDyn<'py, i16>),
    Byte(PyReadonlyArrayDyn<'py, u8>),
}

/// The same, writable.
pub(crate) enum Rw<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    Half(PyReadwriteArrayDyn<'py, i16>),
    Byte(PyReadwriteArrayDyn<'py, u8>),
}

fn wrong_type(name: &str, dt: DType) -> PyErr {
    let want = match dt {
        DType::F32 => "a float32 array",
        DType::F8E4M3 | DType::F8E5M2 => "a uint8 array (the codes of an 8-bit float tensor)",
        _ => "an int16 array (the bits of a 16-bit float tensor)",
    };
    value_error(name, format!("expected {want} for dtype {dt:?}"))
}

pub(crate) fn ro<'py>(obj: &Bound<'py, PyAny>, name: &str, dt: DType) -> PyResult<Ro<'py>> {
    let got = match dt {
        DType::F32 => obj.extract::<PyReadonlyArrayDyn<f32>>().map(Ro::F32),
        DType::F8E4M3 | DType::F8E5M2 => obj.extract::<PyReadonlyArrayDyn<u8>>().map(Ro::Byte),
        _ => obj.extract::<PyReadonlyArrayDyn<i16>>().map(Ro::Half),
    };
    got.map_err(|_| wrong_type(name, dt))
}

pub(crate) fn rw<'py>(obj: &Bound<'py, PyAny>, name: &str, dt: DType) -> PyResult<Rw<'py>> {
    let got = match dt {
        DType::F32 => obj.extract::<PyReadwriteArrayDyn<f32>>().map(Rw::F32),
        DType::F8E4M3 | DType::F8E5M2 => obj.extract::<PyReadwriteArrayDyn<u8>>().map(Rw::Byte),
        _ => obj.extract::<PyReadwriteArrayDyn<i16>>().map(Rw::Half),
    };
    // Right type but not writable: read-only, or already borrowed (the same array passed twice).
    got.map_err(|_| match ro(obj, name, dt) {
        Err(e) => e,
        Ok(_) => value_error(name, "must be writable and not alias another argument"),
    })
}

/// Where an array's elements lie: `rows` rows (the first axis) `stride` elements apart, each
/// of `inner` contiguous elements of `size` bytes, starting at `ptr`.
struct Layout {
    ptr: *mut u8,
    size: usize,
    shape: Vec<usize>,
    rows: usize,
    stride: usize,
    inner: usize,
}

impl Layout {
    /// The elements from the first to the last addressed one.
    fn span(&self) -> usize {
        match self.rows {
            0 => 0,
            n => (n - 1) * self.stride + self.inner,
        }
    }

    fn check<T>(&self, name: &str) -> PyResult<()> {
        if std::mem::size_of::<T>() != self.size {
            return Err(value_error(name, "element size does not match dtype"));
        }
        Ok(())
    }

    fn contiguous(&self, name: &str) -> PyResult<()> {
        if self.rows > 1 && self.stride != self.inner {
            return Err(value_error(name, "must be C-contiguous"));
        }
        Ok(())
    }
}

/// The layout of an array whose axes after the first are C-contiguous (a row slice of a wider
/// matrix, such as q in a fused q|k|v projection, qualifies).
fn layout<E: numpy::Element>(a: &Bound<'_, PyArrayDyn<E>>, name: &str) -> PyResult<Layout> {
    let (shape, strides) = (a.shape().to_vec(), a.strides());
    let size = std::mem::size_of::<E>();
    let bad = || value_error(name, "must be C-contiguous after its first axis");
    if shape.contains(&0) {
        // No elements: torch gives empty tensors arbitrary strides.
        let (ptr, inner) = (a.data().cast(), shape.iter().skip(1).product());
        let (rows, stride) = (0, inner);
        return Ok(Layout {
            ptr,
            size,
            shape,
            rows,
            stride,
            inner,
        });
    }
    let mut expect = size as isize;
    for i in (1..shape.len()).rev() {
        if shape[i] > 1 && strides[i] != expect {
            return Err(bad());
        }
        expect *= shape[i] as isize;
    }
    let inner: usize = shape.iter().skip(1).product();
    let (rows, stride) = match shape.first() {
        None => (1, 1), // a 0-d array: one element
        Some(&n) if n <= 1 => (n, inner),
        Some(&n) if strides[0] >= expect && strides[0] % size as isize == 0 => {
            (n, strides[0] as usize / size)
        }
        Some(_) => return Err(bad()),
    };
    Ok(Layout {
        ptr: a.data().cast(),
        size,
        shape,
        rows,
        stride,
        inner,
    })
}

/// A row-strided read-only array as a slice of `T` (see `Layout`), with its shape and stride.
pub(crate) struct Rows<'a, T> {
    pub data: &'a [T],
    pub shape: Vec<usize>,
    pub stride: usize,
}

impl Ro<'_> {
    fn layout(&self, name: &str) -> PyResult<Layout> {
        match self {
            Ro::F32(a) => layout(a, name),
            Ro::Half(a) => layout(a, name),
            Ro::Byte(a) => layout(a, name),
        }
    }

    pub(crate) fn rows<T: Elem>(&self, name: &str) -> PyResult<Rows<'_, T>> {
        let l = self.layout(name)?;
        l.check::<T>(name)?;
        // SAFETY: numpy guarantees every addressed element of the array is valid memory, and
        // `span` runs from the first to the last of them (strides checked non-negative, inner
        // axes contiguous); `T` has the element's size and every bit pattern is a valid `T`.
        // The read-only borrow keeps Rust writers away for the slice's lifetime.
        let data = match l.span() {
            0 => &[], // an empty tensor's data pointer may be null
            n => unsafe { std::slice::from_raw_parts(l.ptr as *const T, n) },
        };
        Ok(Rows {
            data,
            shape: l.shape,
            stride: l.stride,
        })
    }

    /// A C-contiguous array as a flat slice.
    pub(crate) fn slice<T: Elem>(&self, name: &str) -> PyResult<&[T]> {
        self.layout(name)?.contiguous(name)?;
        Ok(self.rows::<T>(name)?.data)
    }
}

impl Rw<'_> {
    /// A C-contiguous writable array as a flat slice, with its shape.
    pub(crate) fn slice<T: Elem>(&mut self, name: &str) -> PyResult<(&mut [T], Vec<usize>)> {
        let l = match self {
            Rw::F32(a) => layout(a, name)?,
            Rw::Half(a) => layout(a, name)?,
            Rw::Byte(a) => layout(a, name)?,
        };
        l.check::<T>(name)?;
        l.contiguous(name)?;
        // SAFETY: as in `Ro::rows`; the array is C-contiguous, so `span` elements from `ptr` are
        // exactly its elements, and the read-write borrow makes this the only reference.
        let data = match l.span() {
            0 => &mut [],
            n => unsafe { std::slice::from_raw_parts_mut(l.ptr as *mut T, n) },
        };
        Ok((data, l.shape))
    }
}

/// `out = x / sqrt(mean(x^2, -1) + eps) * weight` over the last axis (weight None = ones).
#[pyfunction]
#[pyo3(signature = (x, weight, eps, out, dtype = "float32", threads = 1))]
pub(crate) fn rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: Option<&Bound<'_, PyAny>>,
    eps: f32,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    threads: usize,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let x = ro(x, "x", dt)?;
    let weight = weight.map(|w| ro(w, "weight", dt)).transpose()?;
    let mut out = rw(out, "out", dt)?;
    with_elem!(dt, T => {
        let xs = x.slice::<T>("x")?;
        let shape = x.rows::<T>("x")?.shape;
        let dim = shape.last().copied().unwrap_or(1);
        let ws = weight.as_ref().map(|w| w.slice::<T>("weight")).transpose()?;
        let (os, _) = out.slice::<T>("out")?;
        py.detach(|| ops::rms_norm(xs, ws, eps, os, dim, threads))?;
    });
    Ok(())
}

/// `h += [scale *] [rms_norm(] x [, weight, eps)]` in place over the last axis (`norm` False:
/// no norm; weight None = ones): a branch's post-norm, residual multiplier and add in one call,
/// rounded step by step as the separate ops are.
#[pyfunction]
#[pyo3(signature = (x, h, norm = false, weight = None, eps = 1e-6, scale = None, dtype = "float32",
                    threads = 1))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn residual_add(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    h: &Bound<'_, PyAny>,
    norm: bool,
    weight: Option<&Bound<'_, PyAny>>,
    eps: f32,
    scale: Option<f32>,
    dtype: &str,
    threads: usize,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let x = ro(x, "x", dt)?;
    let weight = weight.map(|w| ro(w, "weight", dt)).transpose()?;
    if weight.is_some() && !norm {
        return Err(value_error("weight", "is only read with norm=True"));
    }
    let mut h = rw(h, "h", dt)?;
    with_elem!(dt, T => {
        let xs = x.slice::<T>("x")?;
        let shape = x.rows::<T>("x")?.shape;
        let dim = shape.last().copied().unwrap_or(1);
        let ws = weight.as_ref().map(|w| w.slice::<T>("weight")).transpose()?;
        let (hs, _) = h.slice::<T>("h")?;
        let branch = norm.then_some(ops::BranchNorm { weight: ws, eps });
        py.detach(|| ops::residual_add(xs, branch, scale, hs, dim, threads))?;
    });
    Ok(())
}

/// Rotate the first `heads` heads of `head_dim` of every row of `x` (`[rows, width]`, in place)
/// by the cos|sin row of `table` (`[P, head_dim]`) at that row's position.
#[pyfunction]
#[pyo3(signature = (x, positions, table, heads, head_dim, dtype = "float32", threads = 1))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_inplace(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    positions: PyReadonlyArray1<'_, i64>,
    table: &Bound<'_, PyAny>,
    heads: usize,
    head_dim: usize,
    dtype: &str,
    threads: usize,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let mut x = rw(x, "x", dt)?;
    let table = ro(table, "table", dt)?;
    let positions = positions
        .as_slice()
        .map_err(|_| value_error("positions", "must be C-contiguous"))?;
    with_elem!(dt, T => {
        let ts = table.slice::<T>("table")?;
        let (xs, shape) = x.slice::<T>("x")?;
        if shape.len() != 2 {
            return Err(value_error("x", format!("must be 2-D [rows, width], got {shape:?}")));
        }
        let rope = RopeShape { rows: shape[0], stride: shape[1], heads, head_dim };
        py.detach(|| ops::rope(xs, rope, positions, ts, threads))?;
    });
    Ok(())
}

/// `out = silu(gate) * up` for `gate_up = [gate | up]` along the last axis.
#[pyfunction]
#[pyo3(signature = (gate_up, out, dtype = "float32", threads = 1))]
pub(crate) fn silu_and_mul(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    threads: usize,
) -> PyResult<()> {
    act_and_mul(py, gate_up, out, dtype, threads, ops::GatedAct::Silu)
}

/// `out = gelu_tanh(gate) * up` for `gate_up = [gate | up]` along the last axis (GeGLU).
#[pyfunction]
#[pyo3(signature = (gate_up, out, dtype = "float32", threads = 1))]
pub(crate) fn gelu_tanh_and_mul(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    threads: usize,
) -> PyResult<()> {
    act_and_mul(py, gate_up, out, dtype, threads, ops::GatedAct::GeluTanh)
}

fn act_and_mul(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    threads: usize,
    act: ops::GatedAct,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let gate_up = ro(gate_up, "gate_up", dt)?;
    let mut out = rw(out, "out", dt)?;
    with_elem!(dt, T => {
        let gs = gate_up.slice::<T>("gate_up")?;
        let (os, shape) = out.slice::<T>("out")?;
        let inter = shape.last().copied().unwrap_or(1);
        py.detach(|| ops::act_and_mul(gs, os, inter, threads, act))?;
    });
    Ok(())
}

/// RMSNorm in place of the q part (the first `q_width` elements) and the k part (the next
/// `k_width`) of every row of `x` (`[rows, width]`), in groups of the weights' lengths: a head
/// (per-head qk-norm) or the whole part (OLMo 2).
#[pyfunction]
#[pyo3(signature = (x, q_weight, k_weight, eps, q_width, k_width, dtype = "float32"))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn qk_norm_inplace(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    q_weight: &Bound<'_, PyAny>,
    k_weight: &Bound<'_, PyAny>,
    eps: f32,
    q_width: usize,
    k_width: usize,
    dtype: &str,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let mut x = rw(x, "x", dt)?;
    let (qw, kw) = (ro(q_weight, "q_weight", dt)?, ro(k_weight, "k_weight", dt)?);
    with_elem!(dt, T => {
        let (qs, ks) = (qw.slice::<T>("q_weight")?, kw.slice::<T>("k_weight")?);
        let (xs, shape) = x.slice::<T>("x")?;
        if shape.len() != 2 {
            return Err(value_error("x", format!("must be 2-D [rows, width], got {shape:?}")));
        }
        let qk = QkShape { rows: shape[0], stride: shape[1], q_width, k_width };
        py.detach(|| ops::qk_norm(xs, qk, qs, ks, eps))?;
    });
    Ok(())
}

/// The SIMD features of this CPU that the OS enables, in `/proc/cpuinfo` spelling.
#[pyfunction]
pub(crate) fn cpu_features() -> Vec<&'static str> {
    crate::cpu::features::cpu_features()
}
