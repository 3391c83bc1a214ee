//! `QuantMatrix`: a block-quantized weight matrix of `crate::cpu::quant` and its matmul over numpy
//! views of torch tensors (zero-copy: `tensor.numpy()`), run with the GIL released.

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::value_error;
use crate::cpu::quant::{DequantOut, Isa, MatmulOpts, QKind, QMatrix, BLOCK};

#[pyclass(name = "QuantMatrix", module = "ironlm._core", frozen)]
pub struct PyQuantMatrix {
    pub(crate) inner: QMatrix,
}

/// `obj` as a C-contiguous 2-D float32 array, or a `ValueError` naming `name`.
pub(super) fn f32_2d<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let arr = obj
        .cast::<PyUntypedArray>()
        .map_err(|_| value_error(name, "expected a numpy array"))?;
    let a = arr.cast::<PyArray2<f32>>().map_err(|_| {
        value_error(
            name,
            format!(
                "expected a 2-D float32 array, got {}-D {}",
                arr.ndim(),
                arr.dtype()
            ),
        )
    })?;
    if !a.is_c_contiguous() {
        return Err(value_error(name, "must be C-contiguous"));
    }
    Ok(a.clone())
}

/// `obj` as a C-contiguous 2-D uint8 array, or a `ValueError` naming `name`.
fn u8_2d<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyArray2<u8>>> {
    let a = obj
        .cast::<PyArray2<u8>>()
        .map_err(|_| value_error(name, "expected a 2-D uint8 numpy array"))?;
    if !a.is_c_contiguous() {
        return Err(value_error(name, "must be C-contiguous"));
    }
    Ok(a.clone())
}

fn count(name: &str, v: i64) -> PyResult<usize> {
    super::count_arg(name, v, 0)
}

#[pymethods]
impl PyQuantMatrix {
    /// From the raw bytes of a GGUF tensor (`[rows, cols]`, `cols` = ggml's first dimension).
    #[staticmethod]
    #[pyo3(signature = (raw, ggml_type, rows, cols))]
    fn from_ggml(
        py: Python<'_>,
        raw: &Bound<'_, PyAny>,
        ggml_type: i64,
        rows: i64,
        cols: i64,
    ) -> PyResult<Self> {
        let arr = raw
            .cast::<PyArray1<u8>>()
            .map_err(|_| value_error("raw", "expected a 1-D uint8 numpy array"))?;
        let ro = arr.readonly();
        let bytes = ro
            .as_slice()
            .map_err(|_| value_error("raw", "must be contiguous"))?;
        let ty = u32::try_from(ggml_type).map_err(|_| value_error("ggml_type", "out of range"))?;
        let (rows, cols) = (count("rows", rows)?, count("cols", cols)?);
        let inner = py.detach(|| QMatrix::from_ggml(bytes, ty, rows, cols))?;
        Ok(Self { inner })
    }

    /// Quantize a float32 `[rows, cols]` weight: `bits` 8 (symmetric) or 4 (asymmetric),
    /// `group_size` a multiple of 32 dividing `cols`, 0 = per output channel.
    #[staticmethod]
    #[pyo3(signature = (weight, bits = 8, group_size = 0))]
    fn from_float(
        py: Python<'_>,
        weight: &Bound<'_, PyAny>,
        bits: i64,
        group_size: i64,
    ) -> PyResult<Self> {
        let w = f32_2d(weight, "weight")?;
        let (rows, cols) = (w.shape()[0], w.shape()[1]);
        let ro = w.readonly();
        let data = ro.as_slice().map_err(|e| value_error("weight", e))?;
        let bits = u32::try_from(bits).map_err(|_| value_error("bits", "must be 4 or 8"))?;
        let group = count("group_size", group_size)?;
        let inner = py.detach(|| QMatrix::quantize(data, rows, cols, bits, group))?;
        Ok(Self { inner })
    }

    /// From unpacked parts: `q` uint8 `[rows, cols]`, `scales` and `mins` float32
    /// `[rows, cols / 32]`, `w = scale * q + min` per 32-block; `bits` 4 (q <= 15) or 8.
    #[staticmethod]
    #[pyo3(signature = (q, scales, mins, bits))]
    fn from_parts(
        py: Python<'_>,
        q: &Bound<'_, PyAny>,
        scales: &Bound<'_, PyAny>,
        mins: &Bound<'_, PyAny>,
        bits: i64,
    ) -> PyResult<Self> {
        let kind = match bits {
            4 => QKind::Q4,
            8 => QKind::Q8,
            _ => return Err(value_error("bits", format!("must be 4 or 8, got {bits}"))),
        };
        let q = u8_2d(q, "q")?;
        let (rows, cols) = (q.shape()[0], q.shape()[1]);
        let (s, m) = (f32_2d(scales, "scales")?, f32_2d(mins, "mins")?);
        for (name, a) in [("scales", &s), ("mins", &m)] {
            if a.shape() != [rows, cols / BLOCK] {
                let r = format!(
                    "shape {:?}, expected [rows, cols / {BLOCK}] = [{rows}, {}]",
                    a.shape(),
                    cols / BLOCK
                );
                return Err(value_error(name, r));
            }
        }
        let (qr, sr, mr) = (q.readonly(), s.readonly(), m.readonly());
        let qs = qr.as_slice().map_err(|e| value_error("q", e))?;
        let ss = sr.as_slice().map_err(|e| value_error("scales", e))?;
        let ms = mr.as_slice().map_err(|e| value_error("mins", e))?;
        let inner = py.detach(|| QMatrix::from_parts(qs, rows, cols, ss, ms, kind))?;
        Ok(Self { inner })
    }

    /// The rows of `parts` stacked (e.g. q, k, v into one qkv matrix); q4 parts widen to q8
    /// losslessly when any part is q8.
    #[staticmethod]
    fn concat(py: Python<'_>, parts: Vec<PyRef<'_, PyQuantMatrix>>) -> PyResult<Self> {
        let refs: Vec<&QMatrix> = parts.iter().map(|p| &p.inner).collect();
        let inner = py.detach(|| QMatrix::concat(&refs))?;
        Ok(Self { inner })
    }

    /// `x @ W^T` for a float32 `x [m, cols]` into `out [m, rows]` (a new array when `None`; with
    /// `accumulate`, `out += x @ W^T`), plus `bias [rows]`. Returns `out`.
    #[pyo3(signature = (x, out = None, accumulate = false, bias = None, threads = 1, isa = None))]
    #[allow(clippy::too_many_arguments)]
    fn matmul<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        accumulate: bool,
        bias: Option<&Bound<'py, PyAny>>,
        threads: i64,
        isa: Option<&str>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let w = &self.inner;
        let x = f32_2d(x, "x")?;
        let m = x.shape()[0];
        if x.shape()[1] != w.cols() {
            let r = format!(
                "has {} columns, the matrix has cols = {}",
                x.shape()[1],
                w.cols()
            );
            return Err(value_error("x", r));
        }
        let out = match out {
            Some(o) => {
                let o = f32_2d(o, "out")?;
                if o.shape() != [m, w.rows()] {
                    let r = format!("shape {:?}, expected [{m}, {}]", o.shape(), w.rows());
                    return Err(value_error("out", r));
                }
                o
            }
            None if accumulate => return Err(value_error("accumulate", "needs an out array")),
            None => PyArray2::zeros(py, [m, w.rows()], false),
        };
        let bias = match bias {
            Some(b) => Some(
                b.cast::<PyArray1<f32>>()
                    .map_err(|_| value_error("bias", "expected a 1-D float32 array"))?
                    .readonly(),
            ),
            None => None,
        };
        let isa = isa_arg(isa)?;
        let threads = super::count_arg("threads", threads, 1)?;
        {
            let xr = x.readonly();
            let xs = xr.as_slice().map_err(|e| value_error("x", e))?;
            let mut ow = out
                .try_readwrite()
                .map_err(|e| value_error("out", format!("cannot be written ({e})")))?;
            let os = ow.as_slice_mut().map_err(|e| value_error("out", e))?;
            let bs = match &bias {
                Some(b) => Some(b.as_slice().map_err(|e| value_error("bias", e))?),
                None => None,
            };
            let opts = MatmulOpts {
                accumulate,
                bias: bs,
                threads,
                isa,
            };
            py.detach(|| w.matmul(xs, m, os, &opts))?;
        }
        Ok(out)
    }

    /// Rows `ids` dequantized into float32 `out [len(ids), cols]` (a new array when `None`): the
    /// embedding lookup. Returns `out`.
    #[pyo3(signature = (ids, out = None))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let w = &self.inner;
        let ids = super::as_i64_array(ids, "ids")?;
        let ids_ro = ids.readonly();
        let idx = ids_ro.as_slice().map_err(|e| value_error("ids", e))?;
        let out = match out {
            Some(o) => f32_2d(o, "out")?,
            None => PyArray2::zeros(py, [idx.len(), w.cols()], false),
        };
        {
            let mut ow = out
                .try_readwrite()
                .map_err(|e| value_error("out", format!("cannot be written ({e})")))?;
            let os = ow.as_slice_mut().map_err(|e| value_error("out", e))?;
            py.detach(|| w.gather_rows(idx, os))?;
        }
        Ok(out)
    }

    /// The weights `[rows, cols]`: into `out` when given (float32, or int16/uint16 receiving
    /// bf16 bits, e.g. `bf16_tensor.view(torch.int16).numpy()`), else a new float32 array.
    /// Returns the array written.
    #[pyo3(signature = (out = None, threads = 1))]
    fn dequantize<'py>(
        &self,
        py: Python<'py>,
        out: Option<&Bound<'py, PyAny>>,
        threads: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let w = &self.inner;
        let threads = super::count_arg("threads", threads, 1)?;
        let shape = [w.rows(), w.cols()];
        let out = match out {
            Some(o) => o.clone(),
            None => PyArray2::<f32>::zeros(py, shape, false).into_any(),
        };
        let check = |a: &Bound<'py, PyUntypedArray>| -> PyResult<()> {
            if a.shape() != shape || !a.is_c_contiguous() {
                let r = format!(
                    "must be a C-contiguous {shape:?} array, got {:?}",
                    a.shape()
                );
                return Err(value_error("out", r));
            }
            Ok(())
        };
        let untyped = out
            .cast::<PyUntypedArray>()
            .map_err(|_| value_error("out", "expected a numpy array"))?;
        check(untyped)?;
        let writable = |e| value_error("out", format!("cannot be written ({e})"));
        if let Ok(a) = out.cast::<PyArray2<f32>>() {
            let mut rw = a.try_readwrite().map_err(writable)?;
            let o = rw.as_slice_mut().map_err(|e| value_error("out", e))?;
            py.detach(|| w.dequantize_into(DequantOut::F32(o), threads))?;
        } else if let Ok(a) = out.cast::<PyArray2<i16>>() {
            let mut rw = a.try_readwrite().map_err(writable)?;
            let o = rw.as_slice_mut().map_err(|e| value_error("out", e))?;
            // SAFETY: i16 and u16 have one size and alignment; only bit patterns are written.
            let o: &mut [u16] =
                unsafe { std::slice::from_raw_parts_mut(o.as_mut_ptr().cast(), o.len()) };
            py.detach(|| w.dequantize_into(DequantOut::Bf16(o), threads))?;
        } else if let Ok(a) = out.cast::<PyArray2<u16>>() {
            let mut rw = a.try_readwrite().map_err(writable)?;
            let o = rw.as_slice_mut().map_err(|e| value_error("out", e))?;
            py.detach(|| w.dequantize_into(DequantOut::Bf16(o), threads))?;
        } else {
            let r = format!(
                "expected float32, or int16/uint16 for bf16 bits, got {}",
                untyped.dtype()
            );
            return Err(value_error("out", r));
        }
        Ok(out)
    }

    /// Resident bytes of the packed weights.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }

    #[getter]
    fn cols(&self) -> usize {
        self.inner.cols()
    }

    /// `"q8"`, `"q4"`, `"q6k"` or `"mxfp4"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind().name()
    }

    fn __repr__(&self) -> String {
        let w = &self.inner;
        format!(
            "QuantMatrix(rows={}, cols={}, kind={:?}, nbytes={})",
            w.rows(),
            w.cols(),
            w.kind().name(),
            w.nbytes()
        )
    }
}

/// A forced SIMD path by name (`None`: the best this CPU has).
pub(super) fn isa_arg(isa: Option<&str>) -> PyResult<Option<Isa>> {
    let Some(name) = isa else { return Ok(None) };
    let found = Isa::ALL.into_iter().find(|i| i.name() == name);
    found.map(Some).ok_or_else(|| {
        let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
        value_error("isa", format!("{name:?} is none of {names:?}"))
    })
}

/// The quantized tiles' weight prefetch distances in bytes `(near, far)`: for tiles of 1-2
/// activation rows and of 3 or more (0: off). Each one given is set first. Returns those in
/// force.
#[pyfunction]
#[pyo3(signature = (near=None, far=None))]
pub(crate) fn quant_prefetch(near: Option<usize>, far: Option<usize>) -> (usize, usize) {
    let (n, f) = crate::cpu::quant::prefetch_distances();
    crate::cpu::quant::set_prefetch_distances(near.unwrap_or(n), far.unwrap_or(f));
    crate::cpu::quant::prefetch_distances()
}

/// The SIMD path `QuantMatrix.matmul` picks on this CPU, and every path this CPU can run.
#[pyfunction]
pub(crate) fn quant_isas() -> (&'static str, Vec<&'static str>) {
    let all = Isa::ALL.into_iter().filter(|i| i.available());
    (Isa::best().name(), all.map(Isa::name).collect())
}
