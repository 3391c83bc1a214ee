//! `dense_matmul`: the small-batch dense kernels of `crate::cpu::dense` over numpy views of torch
//! tensors (16-bit floats as int16 bits, as in `ops.rs`), run with the GIL released.

use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::ops::{dtype_arg, ro, rw, with_elem, DType, Ro};
use super::value_error;
use crate::cpu::dense::{self, Isa, Layout, Opts, PackedBf16, PackedF32, Shape};
use crate::cpu::elem::Bf16;

/// The weight `[k, n]` (what `x @ weight` multiplies by): C-contiguous is `Layout::Kn`, the
/// transpose of a C-contiguous `[n, k]` (e.g. `lm_head.t()`) is `Layout::Nk`. Returns its first
/// element's address, `k`, `n` and the layout.
fn matrix<E: numpy::Element>(
    a: &Bound<'_, PyArrayDyn<E>>,
) -> PyResult<(*const E, usize, usize, Layout)> {
    let (shape, strides) = (a.shape(), a.strides());
    if shape.len() != 2 {
        let r = format!("must be 2-D [in, out], got shape {shape:?}");
        return Err(value_error("weight", r));
    }
    let (k, n, size) = (shape[0], shape[1], std::mem::size_of::<E>() as isize);
    let row_major = (n <= 1 || strides[1] == size) && (k <= 1 || strides[0] == n as isize * size);
    let col_major = (k <= 1 || strides[0] == size) && (n <= 1 || strides[1] == k as isize * size);
    let layout = match (row_major, col_major) {
        (true, _) => Layout::Kn,
        (_, true) => Layout::Nk,
        _ => {
            let r = "must be C-contiguous [in, out] or the transpose of a C-contiguous [out, in]";
            return Err(value_error("weight", r));
        }
    };
    Ok((a.data() as *const E, k, n, layout))
}

fn weight_parts(w: &Ro<'_>) -> PyResult<(*const u8, usize, usize, Layout)> {
    Ok(match w {
        Ro::F32(a) => {
            let (p, k, n, l) = matrix(a)?;
            (p.cast(), k, n, l)
        }
        Ro::Half(a) => {
            let (p, k, n, l) = matrix(a)?;
            (p.cast(), k, n, l)
        }
        Ro::Byte(_) => {
            return Err(value_error(
                "weight",
                "8-bit float arrays are KV caches only",
            ))
        }
    })
}

/// The optional f32 bias as a slice (it must be contiguous).
fn bias_slice<'a>(bias: &'a Option<PyReadonlyArray1<'_, f32>>) -> PyResult<Option<&'a [f32]>> {
    bias.as_ref()
        .map(|b| {
            b.as_slice()
                .map_err(|_| value_error("bias", "must be contiguous"))
        })
        .transpose()
}

/// `out = x @ weight (+ bias)` for `x [m, k]`, `weight [k, n]` (either layout, see `matrix`),
/// `out [m, n]`; with `accumulate`, `out += ...` (the residual add). Rounded once to `dtype`.
#[pyfunction]
#[pyo3(signature = (x, weight, out, accumulate = false, bias = None, dtype = "float32", threads = 1, isa = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    accumulate: bool,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    dtype: &str,
    threads: i64,
    isa: Option<&str>,
) -> PyResult<()> {
    let dt = dtype_arg(dtype)?;
    let threads = super::count_arg("threads", threads, 1)?;
    let isa =
        match isa {
            None => None,
            Some(name) => Some(Isa::ALL.into_iter().find(|i| i.name() == name).ok_or_else(
                || {
                    let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
                    value_error("isa", format!("{name:?} is none of {names:?}"))
                },
            )?),
        };
    let (x, w) = (ro(x, "x", dt)?, ro(weight, "weight", dt)?);
    let mut out = rw(out, "out", dt)?;
    let (wp, k, n, layout) = weight_parts(&w)?;
    let bias = bias_slice(&bias)?;
    with_elem!(dt, T => {
        let xs = x.slice::<T>("x")?;
        let (os, oshape) = out.slice::<T>("out")?;
        if xs.len() % k.max(1) != 0 || (k == 0 && !xs.is_empty()) {
            let r = format!("has {} elements, not rows of the weight's {k} inputs", xs.len());
            return Err(value_error("x", r));
        }
        let m = xs.len().checked_div(k).unwrap_or(oshape.first().copied().unwrap_or(0));
        if oshape.len() != 2 || oshape != [m, n] {
            return Err(value_error("out", format!("shape {oshape:?}, expected [{m}, {n}]")));
        }
        // SAFETY: `matrix` checked that the k * n elements from `wp` are the array's own,
        // contiguous in one of the two layouts; the read-only borrow `w` outlives the slice.
        let ws: &[T] = match k * n {
            0 => &[],
            len => unsafe { std::slice::from_raw_parts(wp as *const T, len) },
        };
        let opts = Opts { accumulate, bias, threads, isa };
        py.detach(|| dense::matmul(xs, ws, os, Shape { m, k, n }, layout, &opts))?;
    });
    Ok(())
}

/// The path `dense_matmul` picks on this CPU, and every path this CPU can run.
#[pyfunction]
pub(crate) fn dense_isas() -> (&'static str, Vec<&'static str>) {
    let all = Isa::ALL.into_iter().filter(|i| i.available());
    (Isa::best().name(), all.map(Isa::name).collect())
}

/// A pyclass over one of the packed dense kernels: `$inner` packs elements `$raw` of a
/// C-contiguous `[k, n]` array (`$dt`'s numpy view) and multiplies `$elem` activations.
macro_rules! packed_class {
    ($(#[$doc:meta])* $py:ident, $name:literal, $inner:ty, $dt:expr, $raw:ty, $elem:ty, $needs:literal) => {
        $(#[$doc])*
        #[pyclass(name = $name, module = "ironlm._core", frozen)]
        pub(crate) struct $py {
            pub(super) inner: $inner,
        }

        #[pymethods]
        impl $py {
            /// Packs `weight`, a C-contiguous `[k, n]` (bf16 as its int16 bits).
            #[new]
            fn new(py: Python<'_>, weight: &Bound<'_, PyAny>) -> PyResult<Self> {
                let w = ro(weight, "weight", $dt)?;
                let (wp, k, n, layout) = weight_parts(&w)?;
                if layout != Layout::Kn {
                    return Err(value_error("weight", "must be C-contiguous [in, out]"));
                }
                // SAFETY: `matrix` checked that the k * n elements from `wp` are the array's
                // own and contiguous; the read-only borrow `w` outlives the slice.
                let raw: &[$raw] = match k * n {
                    0 => &[],
                    len => unsafe { std::slice::from_raw_parts(wp as *const $raw, len) },
                };
                let inner = py.detach(|| <$inner>::pack(raw, k, n))?;
                Ok($py { inner })
            }

            #[doc = concat!("Whether this CPU runs `matmul` (", $needs, ").")]
            #[staticmethod]
            fn available() -> bool {
                <$inner>::available()
            }

            #[getter]
            fn k(&self) -> usize {
                self.inner.k()
            }

            #[getter]
            fn n(&self) -> usize {
                self.inner.n()
            }

            #[getter]
            fn nbytes(&self) -> usize {
                self.inner.nbytes()
            }

            /// `out [m, n] = x [m, k] @ weight (+ bias)`, `+=` with `accumulate` (the residual
            /// add), rounded once; C-contiguous arrays of the weight's type. GIL released.
            #[pyo3(signature = (x, out, accumulate = false, bias = None, threads = 1))]
            fn matmul(
                &self,
                py: Python<'_>,
                x: &Bound<'_, PyAny>,
                out: &Bound<'_, PyAny>,
                accumulate: bool,
                bias: Option<PyReadonlyArray1<'_, f32>>,
                threads: i64,
            ) -> PyResult<()> {
                let threads = super::count_arg("threads", threads, 1)?;
                let x = ro(x, "x", $dt)?;
                let mut out = rw(out, "out", $dt)?;
                let bias = bias_slice(&bias)?;
                let (k, n) = (self.inner.k(), self.inner.n());
                let xs = x.slice::<$elem>("x")?;
                let (os, oshape) = out.slice::<$elem>("out")?;
                if k == 0 || xs.len() % k != 0 {
                    let r = format!("has {} elements, not rows of the weight's {k} inputs", xs.len());
                    return Err(value_error("x", r));
                }
                let m = xs.len() / k;
                if oshape != [m, n] {
                    let r = format!("shape {oshape:?}, expected [{m}, {n}]");
                    return Err(value_error("out", r));
                }
                py.detach(|| self.inner.matmul(xs, m, os, accumulate, bias, threads))?;
                Ok(())
            }
        }
    };
}

packed_class!(
    /// A bf16 weight `[k, n]` repacked once for the `vdpbf16ps` tiles
    /// (`crate::cpu::dense::packed`): `x @ weight` for decode batches of one to a few dozen
    /// rows, the same bits as `dense_matmul`'s `avx512_bf16` path.
    PyPackedBf16,
    "PackedBf16",
    PackedBf16,
    DType::Bf16,
    u16,
    Bf16,
    "AVX-512 BF16"
);

packed_class!(
    /// An f32 weight `[k, n]` repacked once in 16-column groups (`crate::cpu::dense::packed_f32`):
    /// one- and two-row `x @ weight` on CPUs without AVX-512 BF16, the same bits as
    /// `dense_matmul`'s f32 path on the same vector width.
    PyPackedF32,
    "PackedF32",
    PackedF32,
    DType::F32,
    f32,
    f32,
    "AVX2 and FMA"
);
