//! `GrammarCompiler` and `CompiledGrammar` for Python (structured outputs).

use std::time::Duration;

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::{count_arg, grammar_error, token_ids, value_error, QueueFullError};
use crate::grammar::{
    apply_bitmask, CompileError, CompiledGrammar, GrammarCompiler, GrammarLimits, ShapeLimits,
    Vocab,
};

/// A grammar compiled for one tokenizer; pass it to ``Scheduler.add_request(grammar=...)``.
/// Immutable and shared: any number of requests may use the same one.
#[pyclass(name = "CompiledGrammar", module = "ironlm._core", frozen)]
pub struct PyCompiledGrammar {
    pub(crate) inner: CompiledGrammar,
}

#[pymethods]
impl PyCompiledGrammar {
    /// 32-bit words per row of its token bitmask (``ceil(vocab_size / 32)``).
    #[getter]
    fn mask_words(&self) -> usize {
        self.inner.mask_words()
    }

    /// Estimated memory it holds, in bytes (its lexer tables after the first mask).
    #[getter]
    fn size_bytes(&self) -> usize {
        self.inner.size_bytes()
    }

    fn __repr__(&self) -> String {
        format!(
            "CompiledGrammar(mask_words={}, size_bytes={})",
            self.inner.mask_words(),
            self.inner.size_bytes()
        )
    }
}

/// Compiles structured-output grammars for one tokenizer; build it once per model.
#[pyclass(name = "GrammarCompiler", module = "ironlm._core", frozen)]
pub struct PyGrammarCompiler {
    inner: GrammarCompiler,
}

#[pymethods]
impl PyGrammarCompiler {
    /// ``token_bytes[id]``: the token's bytes (None: no text, never allowed); ids up to
    /// ``vocab_size`` (the logits width) past the list have none. ``special_token_ids`` are
    /// produced only by grammars that name them. The limits bound each compilation:
    /// ``max_threads`` compile threads alive at once (abandoned ones too), ``max_grammar_bytes``
    /// per compiled grammar, and the input's shape (``max_schema_depth``: values on the longest
    /// path through nesting and ``$ref`` chains; ``max_object_properties``; ``max_pattern_pairs``:
    /// ``patternProperties`` regex pairs; ``max_lark_depth``: Lark rule reference chain).
    #[new]
    #[pyo3(signature = (
        token_bytes,
        *,
        eos_token_ids,
        vocab_size,
        special_token_ids = None,
        timeout = 10.0,
        max_grammar_size = None,
        initial_lexer_fuel = None,
        step_lexer_fuel = None,
        max_lexer_states = None,
        max_threads = None,
        max_grammar_bytes = None,
        max_schema_depth = None,
        max_object_properties = None,
        max_pattern_pairs = None,
        max_lark_depth = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        token_bytes: &Bound<'_, PyList>,
        eos_token_ids: &Bound<'_, PyAny>,
        vocab_size: i64,
        special_token_ids: Option<&Bound<'_, PyAny>>,
        timeout: f64,
        max_grammar_size: Option<i64>,
        initial_lexer_fuel: Option<i64>,
        step_lexer_fuel: Option<i64>,
        max_lexer_states: Option<i64>,
        max_threads: Option<i64>,
        max_grammar_bytes: Option<i64>,
        max_schema_depth: Option<i64>,
        max_object_properties: Option<i64>,
        max_pattern_pairs: Option<i64>,
        max_lark_depth: Option<i64>,
    ) -> PyResult<Self> {
        let tokens = token_bytes
            .iter()
            .map(|t| {
                if t.is_none() {
                    Ok(None)
                } else {
                    t.cast::<PyBytes>()
                        .map(|b| Some(b.as_bytes().to_vec()))
                        .map_err(|_| value_error("token_bytes", "expected bytes or None"))
                }
            })
            .collect::<PyResult<Vec<_>>>()?;
        let eos = token_ids(eos_token_ids, "eos_token_ids")?;
        let special = match special_token_ids {
            Some(o) => token_ids(o, "special_token_ids")?,
            None => Vec::new(),
        };
        let vocab_size = count_arg("vocab_size", vocab_size, 1)?;
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(value_error(
                "timeout",
                "must be a positive number of seconds",
            ));
        }
        let d = GrammarLimits::default();
        let ds = ShapeLimits::default();
        let shape = ShapeLimits {
            max_schema_depth: opt_count("max_schema_depth", max_schema_depth)?
                .unwrap_or(ds.max_schema_depth),
            max_object_properties: opt_count("max_object_properties", max_object_properties)?
                .unwrap_or(ds.max_object_properties),
            max_pattern_pairs: opt_count("max_pattern_pairs", max_pattern_pairs)?
                .unwrap_or(ds.max_pattern_pairs),
            max_lark_depth: opt_count("max_lark_depth", max_lark_depth)?
                .unwrap_or(ds.max_lark_depth),
        };
        let limits = GrammarLimits {
            timeout: Duration::from_secs_f64(timeout),
            max_grammar_size: opt_count("max_grammar_size", max_grammar_size)?
                .unwrap_or(d.max_grammar_size),
            initial_lexer_fuel: opt_count("initial_lexer_fuel", initial_lexer_fuel)?
                .map_or(d.initial_lexer_fuel, |v| v as u64),
            step_lexer_fuel: opt_count("step_lexer_fuel", step_lexer_fuel)?
                .map_or(d.step_lexer_fuel, |v| v as u64),
            max_lexer_states: opt_count("max_lexer_states", max_lexer_states)?
                .unwrap_or(d.max_lexer_states),
            max_threads: opt_count("max_threads", max_threads)?.unwrap_or(d.max_threads),
            max_bytes: opt_count("max_grammar_bytes", max_grammar_bytes)?.unwrap_or(d.max_bytes),
            shape,
        };
        // Building the token trie and its slices takes a while on large vocabularies.
        let inner = py.detach(|| {
            let vocab = Vocab::new(&tokens, &special, &eos, vocab_size)?;
            GrammarCompiler::new(vocab, limits)
        })?;
        Ok(Self { inner })
    }

    /// Compile grammar text (llguidance's TopLevelGrammar JSON, or a Lark grammar) with the GIL
    /// released. Raises ``GrammarError`` (``.param`` = ``param``) if it does not compile within
    /// the limits, ``QueueFullError`` if every compile thread stayed busy for the timeout.
    #[pyo3(signature = (text, *, param = "structured_outputs"))]
    fn compile(&self, py: Python<'_>, text: &str, param: &str) -> PyResult<PyCompiledGrammar> {
        let inner = &self.inner;
        match py.detach(|| inner.compile_checked(text)) {
            Ok(g) => Ok(PyCompiledGrammar { inner: g }),
            Err(CompileError::Grammar(msg)) => Err(grammar_error(msg, param)),
            Err(CompileError::Busy(msg)) => Err(QueueFullError::new_err(msg)),
        }
    }

    /// Compile threads alive now, counting those whose caller timed out.
    #[getter]
    fn live_threads(&self) -> usize {
        self.inner.live_threads()
    }

    /// The logits width its masks cover.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab().vocab_size()
    }

    fn __repr__(&self) -> String {
        format!(
            "GrammarCompiler(vocab_size={})",
            self.inner.vocab().vocab_size()
        )
    }
}

fn opt_count(name: &str, v: Option<i64>) -> PyResult<Option<usize>> {
    v.map(|v| count_arg(name, v, 1)).transpose()
}

/// On each row ``rows[i]`` of ``logits`` (float32 ``[S, V]``, C-contiguous, e.g. a CPU tensor's
/// ``.numpy()``), in place: tokens not set in ``bits[i]`` (``Scheduler.take_bitmask``) become -inf.
#[pyfunction]
pub fn apply_token_bitmask(
    py: Python<'_>,
    logits: &Bound<'_, PyArray2<f32>>,
    rows: &Bound<'_, PyArray1<i64>>,
    bits: &Bound<'_, PyArray2<i32>>,
) -> PyResult<()> {
    let (s, v) = (logits.shape()[0], logits.shape()[1]);
    let (r, w) = (bits.shape()[0], bits.shape()[1]);
    let rows_ro = rows.readonly();
    let rows = rows_ro.as_slice().map_err(|e| value_error("rows", e))?;
    if rows.len() != r {
        return Err(value_error(
            "rows",
            format!("{} rows for {r} bitmask rows", rows.len()),
        ));
    }
    if let Some(bad) = rows.iter().find(|&&x| x < 0 || x as usize >= s) {
        return Err(value_error(
            "rows",
            format!("row {bad} out of range ({s} rows)"),
        ));
    }
    let bits_ro = bits.readonly();
    let bits = bits_ro.as_slice().map_err(|e| value_error("bits", e))?;
    // SAFETY: i32 and u32 have the same size and alignment; the bits are only reinterpreted.
    let bits: &[u32] = unsafe { std::slice::from_raw_parts(bits.as_ptr().cast(), bits.len()) };
    let mut out = logits.readwrite();
    let out = out.as_slice_mut().map_err(|e| value_error("logits", e))?;
    py.detach(|| apply_bitmask(out, v, rows, bits, w));
    Ok(())
}
