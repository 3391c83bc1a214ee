//! `MoeExperts`: a MoE layer's routed experts over the `QuantMatrix` objects its linears already
//! hold (handles, not copies), run in one call per step with the GIL released
//! (`crate::cpu::quant::Experts`).

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::quant::{f32_2d, isa_arg, PyQuantMatrix};
use super::value_error;
use crate::cpu::ops::GatedAct;
use crate::cpu::quant::{Experts, MoeAct, QMatrix, Routing};

#[pyclass(name = "MoeExperts", module = "ironlm._core", frozen)]
pub struct PyMoeExperts {
    gate_up: Vec<Py<PyQuantMatrix>>,
    down: Vec<Py<PyQuantMatrix>>,
    gate_up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
    act: MoeAct,
    first: usize,
    num_experts: usize,
}

impl PyMoeExperts {
    pub(super) fn experts(&self) -> PyResult<Experts<'_>> {
        fn mats(v: &[Py<PyQuantMatrix>]) -> Vec<&QMatrix> {
            v.iter().map(|m| &m.get().inner).collect()
        }
        Ok(Experts::new(
            mats(&self.gate_up),
            mats(&self.down),
            self.gate_up_bias.as_deref(),
            self.down_bias.as_deref(),
            self.act,
            self.first,
            self.num_experts,
        )?)
    }
}

/// A `[experts, n]` float32 bias, copied.
fn bias_arg(
    obj: Option<&Bound<'_, PyAny>>,
    name: &str,
    experts: usize,
) -> PyResult<Option<Vec<f32>>> {
    let Some(obj) = obj else { return Ok(None) };
    let a = f32_2d(obj, name)?;
    if a.shape()[0] != experts {
        let r = format!(
            "has {} rows, one per expert expected ({experts})",
            a.shape()[0]
        );
        return Err(value_error(name, r));
    }
    let ro = a.readonly();
    Ok(Some(
        ro.as_slice().map_err(|e| value_error(name, e))?.to_vec(),
    ))
}

#[pymethods]
impl PyMoeExperts {
    /// Experts `first .. first + len(gate_up)` of `num_experts` (default: all of them):
    /// `gate_up[i]` `[2I, hidden]` (gate rows then up rows), `down[i]` `[hidden, I]`.
    /// `activation` "silu" or "gelu_tanh"; `clamp = (alpha, limit)` makes it gpt-oss's clamped
    /// SwiGLU. Biases `[experts, 2I]` and `[experts, hidden]` float32.
    #[new]
    #[pyo3(signature = (gate_up, down, activation = "silu", clamp = None, gate_up_bias = None,
                        down_bias = None, first = 0, num_experts = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        gate_up: Vec<Bound<'_, PyQuantMatrix>>,
        down: Vec<Bound<'_, PyQuantMatrix>>,
        activation: &str,
        clamp: Option<(f32, f32)>,
        gate_up_bias: Option<&Bound<'_, PyAny>>,
        down_bias: Option<&Bound<'_, PyAny>>,
        first: i64,
        num_experts: Option<i64>,
    ) -> PyResult<Self> {
        let gated = gated_act_arg(activation)?;
        let act = match clamp {
            None => MoeAct::Gated(gated),
            Some((alpha, limit)) if gated == GatedAct::Silu => {
                MoeAct::ClampedSwiglu { alpha, limit }
            }
            Some(_) => {
                return Err(value_error(
                    "clamp",
                    "is a SwiGLU clamp: needs activation \"silu\"",
                ))
            }
        };
        let first = super::count_arg("first", first, 0)?;
        let e = gate_up.len();
        let num_experts = match num_experts {
            Some(n) => super::count_arg("num_experts", n, 1)?,
            None => first + e,
        };
        let out = PyMoeExperts {
            gate_up_bias: bias_arg(gate_up_bias, "gate_up_bias", e)?,
            down_bias: bias_arg(down_bias, "down_bias", e)?,
            gate_up: gate_up.into_iter().map(Bound::unbind).collect(),
            down: down.into_iter().map(Bound::unbind).collect(),
            act,
            first,
            num_experts,
        };
        out.experts()?; // every shape checked once here
        Ok(out)
    }

    /// `out[t] += sum_j weights[t, j] * expert[ids[t, j]](x[t])` over these experts (ids of
    /// others are skipped): `x`, `out` float32 `[T, hidden]`, `ids` int64 and `weights` float32
    /// `[T, top_k]`, all C-contiguous. Returns the weight bytes streamed (the routed experts').
    #[pyo3(signature = (x, ids, weights, out, threads = 1, isa = None))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        threads: i64,
        isa: Option<&str>,
    ) -> PyResult<usize> {
        let ex = self.experts()?;
        let x = f32_2d(x, "x")?;
        let out = f32_2d(out, "out")?;
        let weights = f32_2d(weights, "weights")?;
        let ids = ids
            .cast::<PyArray2<i64>>()
            .map_err(|_| value_error("ids", "expected a 2-D int64 numpy array"))?;
        if !ids.is_c_contiguous() {
            return Err(value_error("ids", "must be C-contiguous"));
        }
        let t = x.shape()[0];
        if x.shape()[1] != ex.hidden() {
            let r = format!(
                "has {} columns, the experts' hidden = {}",
                x.shape()[1],
                ex.hidden()
            );
            return Err(value_error("x", r));
        }
        if out.shape() != x.shape() {
            return Err(value_error(
                "out",
                format!("shape {:?}, expected {:?}", out.shape(), x.shape()),
            ));
        }
        if ids.shape()[0] != t || weights.shape() != ids.shape() {
            let r = format!(
                "ids {:?} and weights {:?} must both be [T = {t}, top_k]",
                ids.shape(),
                weights.shape()
            );
            return Err(value_error("ids", r));
        }
        let top_k = ids.shape()[1];
        let (threads, isa) = (super::count_arg("threads", threads, 1)?, isa_arg(isa)?);
        let (xr, ir, wr) = (x.readonly(), ids.readonly(), weights.readonly());
        let xs = xr.as_slice().map_err(|e| value_error("x", e))?;
        let route = Routing {
            ids: ir.as_slice().map_err(|e| value_error("ids", e))?,
            weights: wr.as_slice().map_err(|e| value_error("weights", e))?,
            top_k,
        };
        let mut ow = out
            .try_readwrite()
            .map_err(|e| value_error("out", format!("cannot be written ({e})")))?;
        let os = ow.as_slice_mut().map_err(|e| value_error("out", e))?;
        Ok(py.detach(|| ex.run(xs, &route, os, threads, isa))?)
    }

    /// Experts held (a rank's share under expert parallelism).
    #[getter]
    pub(super) fn num_local(&self) -> usize {
        self.gate_up.len()
    }

    #[getter]
    pub(super) fn first(&self) -> usize {
        self.first
    }

    #[getter]
    pub(super) fn num_experts(&self) -> usize {
        self.num_experts
    }

    #[getter]
    fn hidden(&self) -> usize {
        self.gate_up[0].get().inner.cols()
    }

    #[getter]
    fn intermediate(&self) -> usize {
        self.down[0].get().inner.cols()
    }

    /// Packed bytes of all the experts held.
    #[getter]
    fn nbytes(&self) -> usize {
        let all = self.gate_up.iter().chain(&self.down);
        all.map(|m| m.get().inner.nbytes()).sum()
    }

    fn __repr__(&self) -> String {
        format!(
            "MoeExperts(experts={}..{} of {}, hidden={}, intermediate={}, act={:?})",
            self.first,
            self.first + self.gate_up.len(),
            self.num_experts,
            self.hidden(),
            self.intermediate(),
            self.act
        )
    }
}

/// An MLP's `activation` argument ("silu" or "gelu_tanh"), or a `ValueError` naming it.
pub(super) fn gated_act_arg(activation: &str) -> PyResult<GatedAct> {
    match activation {
        "silu" => Ok(GatedAct::Silu),
        "gelu_tanh" => Ok(GatedAct::GeluTanh),
        _ => {
            let r = format!("{activation:?} is none of \"silu\", \"gelu_tanh\"");
            Err(value_error("activation", r))
        }
    }
}

/// A router's `scoring` argument ("softmax", "sigmoid", "topk_softmax"), or a `ValueError`
/// naming `name`.
pub(super) fn scoring_arg(name: &str, scoring: &str) -> PyResult<crate::cpu::route::Scoring> {
    use crate::cpu::route::Scoring;
    match scoring {
        "softmax" => Ok(Scoring::Softmax),
        "sigmoid" => Ok(Scoring::Sigmoid),
        "topk_softmax" => Ok(Scoring::TopkSoftmax),
        other => {
            let r = format!("{other:?} is none of softmax, sigmoid, topk_softmax");
            Err(value_error(name, r))
        }
    }
}

/// `moe_route`'s `(weights, ids)`.
type Routed<'py> = (Bound<'py, PyArray2<f32>>, Bound<'py, PyArray2<i64>>);

/// A MoE router on the core (`crate::cpu::route`): the logits of rows `x` `[t, hidden]` against
/// `router` `[hidden, experts]` (+ `bias` `[experts]`), all float32 and C-contiguous, then each
/// row's choice: `(weights float32, ids int64)`, `[t, top_k]` each, best first. `scoring`
/// "softmax", "sigmoid" or "topk_softmax". model/moe/route.py is the reference.
#[pyfunction]
#[pyo3(signature = (x, router, top_k, scoring = "softmax", renormalize = false, renorm_eps = 0.0,
                    scaling = 1.0, bias = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_route<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    router: &Bound<'py, PyAny>,
    top_k: usize,
    scoring: &str,
    renormalize: bool,
    renorm_eps: f32,
    scaling: f32,
    bias: Option<PyReadonlyArray1<'py, f32>>,
) -> PyResult<Routed<'py>> {
    use crate::cpu::route::{route_rows, Route};
    let scoring = scoring_arg("scoring", scoring)?;
    let x = f32_2d(x, "x")?;
    let router = f32_2d(router, "router")?;
    let (t, hidden, e) = (x.shape()[0], x.shape()[1], router.shape()[1]);
    if router.shape()[0] != hidden {
        let r = format!("has {} rows, x has {hidden} columns", router.shape()[0]);
        return Err(value_error("router", r));
    }
    let route = Route {
        scoring,
        top_k,
        renormalize,
        renorm_eps,
        scaling,
    };
    let (mut ids, mut weights) = (vec![0i64; t * top_k], vec![0.0f32; t * top_k]);
    let mut logits = vec![0.0f32; t * e];
    {
        let (xr, rr) = (x.readonly(), router.readonly());
        let xs = xr.as_slice().map_err(|e| value_error("x", e))?;
        let rs = rr.as_slice().map_err(|e| value_error("router", e))?;
        let bs = match &bias {
            Some(b) => Some(b.as_slice().map_err(|e| value_error("bias", e))?),
            None => None,
        };
        route_rows(
            &route,
            xs,
            rs,
            bs,
            hidden,
            &mut logits,
            &mut ids,
            &mut weights,
        )?;
    }
    let w = PyArray1::from_vec(py, weights).reshape([t, top_k])?;
    let i = PyArray1::from_vec(py, ids).reshape([t, top_k])?;
    Ok((w, i))
}
