//! PyO3 bindings: the `ironlm._core` module. A thin layer: arguments are checked and turned
//! into owned Rust values here, the work happens in the pure-Rust modules, and every
//! `CoreError` maps to one Python exception (never a panic across the boundary).

use std::ffi::CStr;

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::CoreError as RsCoreError;

mod attn;
mod dense;
mod grammar;
// Classes only the Python tests use: built with the `test-bindings` feature (`make install` /
// `make develop`), left out of the wheel.
#[cfg(feature = "test-bindings")]
mod kv;
mod lean;
mod moe;
mod ops;
mod quant;
#[cfg(feature = "test-bindings")]
mod queue;
mod sched;

create_exception!(
    ironlm._core,
    CoreError,
    PyException,
    "Base class of the errors raised by the core, except bad argument values (`InvalidArgumentError`)."
);
create_exception!(
    ironlm._core,
    QueueFullError,
    CoreError,
    "The waiting queue already holds ``max_queue_len`` requests (the server answers 503)."
);

/// `RequestTooLargeError(CoreError, ValueError)` and `DuplicateRequestError(CoreError,
/// ValueError)` have two bases, which `create_exception!` cannot express: they are made with
/// `type(name, bases, dict)` on first use.
static REQUEST_TOO_LARGE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DUPLICATE_REQUEST: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_ARGUMENT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static GRAMMAR_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `InvalidArgumentError` needs a constructor that takes the parameter name and a `__reduce__`
/// that keeps it across pickling (exceptions pickle as `type(*args)`), which neither
/// `create_exception!` nor `type()` can give; a class statement is the plainest way. It is a
/// `ValueError` only, not a `CoreError`: Python-side validation raises it too, and callers that
/// catch `CoreError` for state errors must not start catching bad arguments.
const INVALID_ARGUMENT_SRC: &CStr = c"
class InvalidArgumentError(ValueError):
    '''A bad argument value; ``param`` names the argument (e.g. ``max_tokens``) or is None.'''

    __module__ = 'ironlm._core'

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        return (type(self), (self.args[0] if self.args else '', self.param))
";

fn two_base_exception(py: Python<'_>, name: &str, doc: &CStr) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(
        py,
        [py.get_type::<CoreError>(), py.get_type::<PyValueError>()],
    )?;
    let dict = PyDict::new(py);
    dict.set_item("__module__", "ironlm._core")?;
    dict.set_item("__doc__", doc.to_str().unwrap_or_default())?;
    let ty = py.get_type::<PyType>().call1((name, bases, dict))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

fn request_too_large(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    REQUEST_TOO_LARGE
        .get_or_try_init(py, || {
            two_base_exception(
                py,
                "RequestTooLargeError",
                c"prompt + max_tokens can never fit: beyond ``max_model_len`` or the whole KV cache.",
            )
        })
        .map(|t| t.bind(py))
}

fn duplicate_request(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    DUPLICATE_REQUEST
        .get_or_try_init(py, || {
            two_base_exception(
                py,
                "DuplicateRequestError",
                c"A request with this id is already in the core.",
            )
        })
        .map(|t| t.bind(py))
}

fn invalid_argument(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    INVALID_ARGUMENT
        .get_or_try_init(py, || {
            let scope = PyDict::new(py);
            py.run(INVALID_ARGUMENT_SRC, Some(&scope), None)?;
            let ty = scope
                .get_item("InvalidArgumentError")?
                .ok_or_else(|| PyTypeError::new_err("InvalidArgumentError was not defined"))?;
            Ok(ty.cast_into::<PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

/// A grammar that does not compile is a bad argument value: the server answers 400 naming the
/// request field (`param`) the grammar came from.
const GRAMMAR_ERROR_SRC: &CStr = c"
class GrammarError(InvalidArgumentError):
    '''A structured-output grammar (JSON schema, regex, choice, Lark) that does not compile, or not
    within its size and time limits. ``param`` names the request field, ``structured_outputs`` by default.'''

    __module__ = 'ironlm._core'

    def __init__(self, message, param='structured_outputs'):
        super().__init__(message, param)
";

pub(crate) fn grammar_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    GRAMMAR_ERROR
        .get_or_try_init(py, || {
            let scope = PyDict::new(py);
            scope.set_item("InvalidArgumentError", invalid_argument(py)?)?;
            py.run(GRAMMAR_ERROR_SRC, Some(&scope), None)?;
            let ty = scope
                .get_item("GrammarError")?
                .ok_or_else(|| PyTypeError::new_err("GrammarError was not defined"))?;
            Ok(ty.cast_into::<PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

/// `GrammarError(message, param)`.
pub(crate) fn grammar_error(message: String, param: &str) -> PyErr {
    Python::attach(|py| match grammar_error_type(py) {
        Ok(t) => PyErr::from_type(t.clone(), (message, param.to_owned())),
        Err(err) => err,
    })
}

/// `InvalidArgumentError(message, param=name)`.
fn invalid_argument_err(name: &str, message: String) -> PyErr {
    Python::attach(|py| match invalid_argument(py) {
        Ok(t) => PyErr::from_type(t.clone(), (message, name.to_owned())),
        Err(err) => err,
    })
}

impl From<RsCoreError> for PyErr {
    fn from(e: RsCoreError) -> PyErr {
        let msg = e.to_string();
        match e {
            RsCoreError::QueueFull { .. } => QueueFullError::new_err(msg),
            RsCoreError::InvalidArgument { name, .. } => invalid_argument_err(name, msg),
            RsCoreError::RequestTooLarge(_) => Python::attach(|py| match request_too_large(py) {
                Ok(t) => PyErr::from_type(t.clone(), msg),
                Err(err) => err,
            }),
            RsCoreError::DuplicateRequest(_) => Python::attach(|py| match duplicate_request(py) {
                Ok(t) => PyErr::from_type(t.clone(), msg),
                Err(err) => err,
            }),
            RsCoreError::OutOfBlocks | RsCoreError::InvalidState(_) => CoreError::new_err(msg),
            RsCoreError::Grammar(_) => grammar_error(msg, "structured_outputs"),
        }
    }
}

/// `InvalidArgumentError("{name}: {reason}")` with `.param == name` (a `ValueError`).
pub(crate) fn value_error(name: &str, reason: impl std::fmt::Display) -> PyErr {
    invalid_argument_err(name, format!("{name}: {reason}"))
}

/// A count argument: an int >= `min`.
pub(crate) fn count_arg(name: &str, v: i64, min: i64) -> PyResult<usize> {
    if v < min {
        return Err(value_error(name, format!("must be >= {min}, got {v}")));
    }
    usize::try_from(v).map_err(|_| value_error(name, "too large"))
}

/// A time argument: a finite float.
pub(crate) fn time_arg(name: &str, v: Option<f64>) -> PyResult<Option<f64>> {
    match v {
        Some(t) if !t.is_finite() => Err(value_error(name, "must be a finite number")),
        v => Ok(v),
    }
}

/// Token ids from a 1-D int numpy array (any integer dtype) or a sequence of ints.
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    fn check(name: &str, v: i64) -> PyResult<u32> {
        u32::try_from(v).map_err(|_| value_error(name, format!("token id {v} out of range")))
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        let ro = a.readonly();
        if let Ok(s) = ro.as_slice() {
            return s.iter().map(|&t| check(name, t)).collect();
        }
    }
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        let ro = a.readonly();
        if let Ok(s) = ro.as_slice() {
            return s.iter().map(|&t| check(name, t as i64)).collect();
        }
    }
    if let Ok(a) = obj.cast::<PyArray1<u32>>() {
        let ro = a.readonly();
        if let Ok(s) = ro.as_slice() {
            return Ok(s.to_vec());
        }
    }
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected a sequence of ints, got str"
        )));
    }
    let v: Vec<i64> = obj.extract().map_err(|e: PyErr| {
        // An int beyond 64 bits is a bad value, not a bad type: the caller must see the argument's name.
        if e.is_instance_of::<PyOverflowError>(obj.py()) {
            value_error(name, "token id out of range")
        } else {
            PyTypeError::new_err(format!("{name}: expected a sequence of ints ({e})"))
        }
    })?;
    v.into_iter().map(|t| check(name, t)).collect()
}

/// An int64 numpy view of `obj` (a 1-D int64 array is used as is).
pub(crate) fn as_i64_array<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        if a.is_c_contiguous() {
            return Ok(a.clone());
        }
    }
    let py = obj.py();
    let np = py.import("numpy")?;
    let arr = np
        .call_method1("ascontiguousarray", (obj, np.getattr("int64")?))
        .map_err(|e| PyTypeError::new_err(format!("{name}: expected an int array ({e})")))?;
    let arr = arr
        .cast_into::<PyArray1<i64>>()
        .map_err(|_| value_error(name, "expected a 1-D array"))?;
    Ok(arr)
}

#[pyfunction]
/// The core's clock, in seconds.
fn monotonic() -> f64 {
    crate::sched::queue::monotonic()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CoreError", py.get_type::<CoreError>())?;
    m.add("QueueFullError", py.get_type::<QueueFullError>())?;
    m.add("RequestTooLargeError", request_too_large(py)?)?;
    m.add("DuplicateRequestError", duplicate_request(py)?)?;
    m.add("InvalidArgumentError", invalid_argument(py)?)?;
    m.add("GrammarError", grammar_error_type(py)?)?;
    m.add_function(wrap_pyfunction!(monotonic, m)?)?;
    m.add_function(wrap_pyfunction!(attn::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(attn::parallel_runtime, m)?)?;
    m.add_function(wrap_pyfunction!(attn::decode_attention_qkv, m)?)?;
    m.add_function(wrap_pyfunction!(attn::prefill_attention, m)?)?;
    m.add_function(wrap_pyfunction!(attn::prefill_attention_serves, m)?)?;
    m.add_function(wrap_pyfunction!(ops::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(ops::residual_add, m)?)?;
    m.add_function(wrap_pyfunction!(ops::rope_inplace, m)?)?;
    m.add_function(wrap_pyfunction!(ops::silu_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(ops::gelu_tanh_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(ops::qk_norm_inplace, m)?)?;
    m.add_function(wrap_pyfunction!(ops::cpu_features, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quant_isas, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quant_prefetch, m)?)?;
    m.add_function(wrap_pyfunction!(dense::dense_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(dense::dense_isas, m)?)?;
    m.add_class::<quant::PyQuantMatrix>()?;
    m.add_class::<dense::PyPackedBf16>()?;
    m.add_class::<dense::PyPackedF32>()?;
    m.add_class::<moe::PyMoeExperts>()?;
    m.add_function(wrap_pyfunction!(moe::moe_route, m)?)?;
    m.add_class::<lean::PyLeanLayer>()?;
    m.add_class::<lean::PyLeanStack>()?;
    #[cfg(feature = "test-bindings")]
    {
        m.add_class::<kv::PyBlockAllocator>()?;
        m.add_class::<kv::PyRadixCache>()?;
        m.add_class::<queue::PyRequestQueue>()?;
    }
    m.add_function(wrap_pyfunction!(grammar::apply_token_bitmask, m)?)?;
    m.add_class::<grammar::PyGrammarCompiler>()?;
    m.add_class::<grammar::PyCompiledGrammar>()?;
    m.add_class::<sched::PyScheduler>()?;
    m.add_class::<sched::PySchedulerPlan>()?;
    Ok(())
}
