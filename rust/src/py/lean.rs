//! `LeanLayer` and `LeanStack`: a model's Llama-shaped layers over the weight objects its linears
//! hold (`QuantMatrix`, or the packed dense copies `PackedBf16` / `PackedF32`) and numpy views of
//! its norms (handles, not copies), run as one decode step per call with the GIL released
//! (`crate::cpu::lean`).

use std::sync::Mutex;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::dense::{PyPackedBf16, PyPackedF32};
use super::moe::PyMoeExperts;
use super::ops::{cache_elem_arg, ro, rw, with_elem, DType, Ro, Rw};
use super::quant::PyQuantMatrix;
use super::value_error;
use crate::cpu::elem::{Bf16, Elem, F16, F8E4M3, F8E5M2};
use crate::cpu::lean::{run, Cache, Layer, Mlp, Moe, Proj, Scratch, Step};
use crate::cpu::ops::GatedAct;
use crate::cpu::route::Route;

/// The optional biases of qkv, o, gate_up and down.
type Biases<'py> = (
    Option<Bound<'py, PyArray1<f32>>>,
    Option<Bound<'py, PyArray1<f32>>>,
    Option<Bound<'py, PyArray1<f32>>>,
    Option<Bound<'py, PyArray1<f32>>>,
);

#[pyclass(name = "LeanLayer", module = "ironlm._core", frozen)]
pub struct PyLeanLayer {
    input_norm: Py<PyAny>,
    post_norm: Py<PyAny>,
    qkv: PyProj,
    o: PyProj,
    mlp: PyMlp,
    /// The rows its projections take: float32, or bfloat16 for `PackedBf16` weights.
    dtype: DType,
    biases: [Option<Py<PyArray1<f32>>>; 4],
    qk_norm: Option<(Py<PyAny>, Py<PyAny>)>,
    rotary: Option<usize>,
    window: Option<usize>,
    softcap: Option<f32>,
    scale: f32,
    num_heads: usize,
    eps: f32,
}

/// A projection's weights: block-quantized (f32 rows) or a packed dense copy (its own type's rows).
enum PyProj {
    Quant(Py<PyQuantMatrix>),
    Bf16(Py<PyPackedBf16>),
    F32(Py<PyPackedF32>),
}

impl PyProj {
    fn new(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        if let Ok(m) = obj.cast::<PyQuantMatrix>() {
            return Ok(PyProj::Quant(m.clone().unbind()));
        }
        if let Ok(m) = obj.cast::<PyPackedBf16>() {
            return Ok(PyProj::Bf16(m.clone().unbind()));
        }
        if let Ok(m) = obj.cast::<PyPackedF32>() {
            return Ok(PyProj::F32(m.clone().unbind()));
        }
        Err(value_error(
            name,
            "expected a QuantMatrix, PackedBf16 or PackedF32",
        ))
    }

    fn dtype(&self) -> DType {
        match self {
            PyProj::Bf16(_) => DType::Bf16,
            _ => DType::F32,
        }
    }
}

/// The row types a stack runs: each takes its projections and has its scratch.
trait Rows: Elem {
    const DT: DType;
    /// `p` as a projection on these rows (`LeanStack::new` checked that every one is).
    fn proj(p: &PyProj) -> &dyn Proj<Self>;
    fn scratch(stack: &PyLeanStack) -> &Mutex<Scratch<Self>>;
}

impl Rows for f32 {
    const DT: DType = DType::F32;
    fn proj(p: &PyProj) -> &dyn Proj<f32> {
        match p {
            PyProj::Quant(m) => &m.get().inner,
            PyProj::F32(m) => &m.get().inner,
            PyProj::Bf16(_) => unreachable!("a bf16 projection in a float32 stack"),
        }
    }
    fn scratch(stack: &PyLeanStack) -> &Mutex<Scratch<f32>> {
        &stack.scratch.0
    }
}

impl Rows for Bf16 {
    const DT: DType = DType::Bf16;
    fn proj(p: &PyProj) -> &dyn Proj<Bf16> {
        match p {
            PyProj::Bf16(m) => &m.get().inner,
            _ => unreachable!("a float32 projection in a bf16 stack"),
        }
    }
    fn scratch(stack: &PyLeanStack) -> &Mutex<Scratch<Bf16>> {
        &stack.scratch.1
    }
}

enum PyMlp {
    Dense {
        gate_up: PyProj,
        down: PyProj,
        act: GatedAct,
    },
    Moe {
        experts: Py<PyMoeExperts>,
        router: Py<PyAny>,
        router_bias: Option<Py<PyAny>>,
        route: Route,
    },
}

/// A MoE MLP's arguments: the core's experts, the router `[hidden, experts]` and its optional
/// bias (float32), and the routing: `scoring` ("softmax", "sigmoid", "topk_softmax"), `top_k`,
/// `renormalize`, `renorm_eps`, `scaling`.
type MoeArgs<'py> = (
    Bound<'py, PyMoeExperts>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    (String, usize, bool, f32, f32),
);

#[pymethods]
impl PyLeanLayer {
    /// One layer: `input_norm`, `post_norm` (float32 `[hidden]` arrays, read at each step),
    /// `qkv` / `o` matrices, the MLP's `gate_up` / `down` matrices or its `moe` = (experts,
    /// router, router bias, (scoring, top_k, renormalize, renorm_eps, scaling)), the four
    /// optional float32 biases (a MoE layer's experts hold their own), the optional
    /// q and k norm weights, the index of its rotary table in `LeanStack.run`'s `tables` (None:
    /// NoPE), its sliding `window`, logit `softcap`, attention `scale`, query heads, the norms'
    /// `eps` and the MLP's activation ("silu" or "gelu_tanh").
    #[new]
    #[pyo3(signature = (*, input_norm, post_norm, qkv, o, gate_up = None, down = None, moe = None, biases = None,
                        qk_norm = None, rotary = None, window = None, softcap = None, scale, num_heads, eps,
                        activation = "silu"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input_norm: &Bound<'_, PyAny>,
        post_norm: &Bound<'_, PyAny>,
        qkv: &Bound<'_, PyAny>,
        o: &Bound<'_, PyAny>,
        gate_up: Option<&Bound<'_, PyAny>>,
        down: Option<&Bound<'_, PyAny>>,
        moe: Option<MoeArgs<'_>>,
        biases: Option<Biases<'_>>,
        qk_norm: Option<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
        rotary: Option<usize>,
        window: Option<usize>,
        softcap: Option<f32>,
        scale: f32,
        num_heads: usize,
        eps: f32,
        activation: &str,
    ) -> PyResult<Self> {
        let act = super::moe::gated_act_arg(activation)?;
        let mlp = match (gate_up, down, moe) {
            (Some(gate_up), Some(down), None) => PyMlp::Dense {
                gate_up: PyProj::new(gate_up, "gate_up")?,
                down: PyProj::new(down, "down")?,
                act,
            },
            (None, None, Some((experts, router, router_bias, spec))) => {
                let (scoring, top_k, renormalize, renorm_eps, scaling) = spec;
                let scoring = super::moe::scoring_arg("moe", &scoring)?;
                let ex = experts.get();
                if ex.first() != 0 || ex.num_local() != ex.num_experts() {
                    return Err(value_error(
                        "moe",
                        "needs every expert (no expert parallelism)",
                    ));
                }
                if top_k == 0 || top_k > ex.num_experts() {
                    let r = format!("top_k {top_k} of {} experts", ex.num_experts());
                    return Err(value_error("moe", r));
                }
                for (name, a) in [
                    ("router", Some(&router)),
                    ("router_bias", router_bias.as_ref()),
                ] {
                    if let Some(a) = a {
                        ro(a, name, super::ops::DType::F32)?.slice::<f32>(name)?;
                    }
                }
                PyMlp::Moe {
                    experts: experts.unbind(),
                    router: router.unbind(),
                    router_bias: router_bias.map(Bound::unbind),
                    route: Route {
                        scoring,
                        top_k,
                        renormalize,
                        renorm_eps,
                        scaling,
                    },
                }
            }
            _ => {
                return Err(value_error(
                    "moe",
                    "a layer has gate_up and down, or moe, not both",
                ))
            }
        };
        if window == Some(0) {
            return Err(value_error("window", "must be >= 1"));
        }
        if num_heads == 0 {
            return Err(value_error("num_heads", "must be >= 1"));
        }
        let (qkv, o) = (PyProj::new(qkv, "qkv")?, PyProj::new(o, "o")?);
        let dtype = qkv.dtype();
        let kinds = match &mlp {
            PyMlp::Dense { gate_up, down, .. } => vec![o.dtype(), gate_up.dtype(), down.dtype()],
            PyMlp::Moe { .. } => vec![o.dtype(), DType::F32],
        };
        if kinds.iter().any(|&d| d != dtype) {
            return Err(value_error(
                "qkv",
                "the layer's projections take rows of different types",
            ));
        }
        // Checked now as well as at each step, so a wrong array fails where the stack is built.
        let arrays = [Some(input_norm), Some(post_norm)]
            .into_iter()
            .chain(qk_norm.iter().flat_map(|(q, k)| [Some(q), Some(k)]));
        for (name, a) in ["input_norm", "post_norm", "q_norm", "k_norm"]
            .iter()
            .zip(arrays)
        {
            if let Some(a) = a {
                with_elem!(dtype, T => ro(a, name, dtype)?.slice::<T>(name).map(|_| ())?);
            }
        }
        Ok(PyLeanLayer {
            input_norm: input_norm.clone().unbind(),
            post_norm: post_norm.clone().unbind(),
            qkv,
            o,
            mlp,
            dtype,
            biases: match biases {
                Some((a, b, c, d)) => [a, b, c, d].map(|x| x.map(Bound::unbind)),
                None => [None, None, None, None],
            },
            qk_norm: qk_norm.map(|(q, k)| (q.unbind(), k.unbind())),
            rotary,
            window,
            softcap,
            scale,
            num_heads,
            eps,
        })
    }
}

#[pyclass(name = "LeanStack", module = "ironlm._core", frozen)]
pub struct PyLeanStack {
    layers: Vec<Py<PyLeanLayer>>,
    hidden: usize,
    /// The rows every layer takes (float32, or bfloat16 over `PackedBf16` weights).
    dtype: DType,
    /// The step's intermediate rows by row type, grown to the largest step seen and reused.
    scratch: (Mutex<Scratch<f32>>, Mutex<Scratch<Bf16>>),
}

/// A layer's arrays, borrowed for one step.
struct Held<'py> {
    norms: [Ro<'py>; 2],
    biases: Vec<Option<PyReadonlyArray1<'py, f32>>>,
    qk: Option<[Ro<'py>; 2]>,
    /// A MoE layer's router and its optional bias.
    router: Option<(Ro<'py>, Option<Ro<'py>>)>,
}

/// The plan's arrays of one step.
struct Plan<'py> {
    block_tables: PyReadonlyArray2<'py, i32>,
    seq_lens: PyReadonlyArray1<'py, i32>,
    slots: PyReadonlyArray1<'py, i64>,
    positions: PyReadonlyArray1<'py, i64>,
}

#[pymethods]
impl PyLeanStack {
    #[new]
    fn new(layers: Vec<Bound<'_, PyLeanLayer>>, hidden: usize) -> PyResult<Self> {
        if hidden == 0 {
            return Err(value_error("hidden", "must be >= 1"));
        }
        let dtype = layers.first().map_or(DType::F32, |l| l.get().dtype);
        if layers.iter().any(|l| l.get().dtype != dtype) {
            return Err(value_error("layers", "take rows of different types"));
        }
        Ok(PyLeanStack {
            layers: layers.into_iter().map(Bound::unbind).collect(),
            hidden,
            dtype,
            scratch: Default::default(),
        })
    }

    fn __len__(&self) -> usize {
        self.layers.len()
    }

    /// The rows the stack takes: "float32" or "bfloat16".
    #[getter]
    fn dtype(&self) -> &'static str {
        match self.dtype {
            DType::Bf16 => "bfloat16",
            _ => "float32",
        }
    }

    /// Every layer over the residual stream `h` (`[t, hidden]` of the stack's `dtype`, bf16 as
    /// int16 bits; in place): layer `i` writes this step's K/V rows into `caches[i] = (k, v)`
    /// (`[blocks, block_size, Hkv, D]` of `cache_dtype`, 16-bit ones as int16 views of their
    /// bits, 8-bit ones as uint8) and attends them. The plan's `block_tables` `[t, max_blocks]`
    /// and `seq_lens` `[t]` (int32), `slots` and `positions` `[t]` (int64), one row per token as
    /// `decode_attention_qkv` takes them; `tables` the rotary tables (the stack's dtype) the
    /// layers' `rotary` indices name. Returns the expert weight bytes each layer streamed.
    #[pyo3(signature = (h, caches, block_tables, seq_lens, slots, positions, tables, threads = 1,
                        cache_dtype = "float32"))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        h: &Bound<'_, PyAny>,
        caches: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
        block_tables: PyReadonlyArray2<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        slots: PyReadonlyArray1<'_, i64>,
        positions: PyReadonlyArray1<'_, i64>,
        tables: Vec<Bound<'_, PyAny>>,
        threads: usize,
        cache_dtype: &str,
    ) -> PyResult<Vec<usize>> {
        let ct = cache_elem_arg(cache_dtype, "cache_dtype")?;
        if caches.len() != self.layers.len() {
            let r = format!("{} pairs for {} layers", caches.len(), self.layers.len());
            return Err(value_error("caches", r));
        }
        let plan = Plan {
            block_tables,
            seq_lens,
            slots,
            positions,
        };
        let args = (h, &caches[..], &plan, &tables[..], threads.max(1), ct);
        match (self.dtype, ct) {
            (DType::F32, DType::F32) => self.step::<f32, f32>(py, args),
            (DType::F32, DType::Bf16) => self.step::<f32, Bf16>(py, args),
            (DType::F32, DType::F16) => self.step::<f32, F16>(py, args),
            (DType::Bf16, DType::Bf16) => self.step::<Bf16, Bf16>(py, args),
            (DType::F32, DType::F8E4M3) => self.step::<f32, F8E4M3>(py, args),
            (DType::F32, DType::F8E5M2) => self.step::<f32, F8E5M2>(py, args),
            (DType::Bf16, DType::F8E4M3) => self.step::<Bf16, F8E4M3>(py, args),
            (DType::Bf16, DType::F8E5M2) => self.step::<Bf16, F8E5M2>(py, args),
            _ => Err(value_error(
                "cache_dtype",
                format!("{cache_dtype} caches under {} rows", self.dtype()),
            )),
        }
    }
}

/// `run`'s arguments past the caches' type: h, the caches, the plan, the tables, threads, and
/// the caches' dtype.
type StepArgs<'a, 'py> = (
    &'a Bound<'py, PyAny>,
    &'a [(Bound<'py, PyAny>, Bound<'py, PyAny>)],
    &'a Plan<'py>,
    &'a [Bound<'py, PyAny>],
    usize,
    DType,
);

impl PyLeanStack {
    fn step<T: Rows, C: Elem>(&self, py: Python<'_>, args: StepArgs) -> PyResult<Vec<usize>> {
        let (h, caches, plan, tables, threads, ct) = args;
        let (dt, f32t) = (T::DT, DType::F32);
        let mut hw = rw(h, "h", dt)?;
        let tables: Vec<Ro> = tables
            .iter()
            .map(|t| ro(t, "tables", dt))
            .collect::<PyResult<_>>()?;
        let layers: Vec<&PyLeanLayer> = self.layers.iter().map(|l| l.get()).collect();
        let held: Vec<Held> = layers
            .iter()
            .map(|l| {
                let norms = [
                    ro(l.input_norm.bind(py), "input_norm", dt)?,
                    ro(l.post_norm.bind(py), "post_norm", dt)?,
                ];
                let biases = l
                    .biases
                    .iter()
                    .map(|b| b.as_ref().map(|b| b.bind(py).readonly()))
                    .collect();
                let qk = match &l.qk_norm {
                    Some((q, k)) => {
                        Some([ro(q.bind(py), "q_norm", dt)?, ro(k.bind(py), "k_norm", dt)?])
                    }
                    None => None,
                };
                let router = match &l.mlp {
                    PyMlp::Moe {
                        router,
                        router_bias,
                        ..
                    } => Some((
                        ro(router.bind(py), "router", f32t)?,
                        match router_bias {
                            Some(b) => Some(ro(b.bind(py), "router_bias", f32t)?),
                            None => None,
                        },
                    )),
                    PyMlp::Dense { .. } => None,
                };
                Ok(Held {
                    norms,
                    biases,
                    qk,
                    router,
                })
            })
            .collect::<PyResult<_>>()?;
        let mut kv: Vec<(Rw, Rw)> = caches
            .iter()
            .map(|(k, v)| Ok((rw(k, "k_cache", ct)?, rw(v, "v_cache", ct)?)))
            .collect::<PyResult<_>>()?;
        let contiguous = |name: &str| value_error(name, "must be C-contiguous");
        let step = Step {
            positions: plan
                .positions
                .as_slice()
                .map_err(|_| contiguous("positions"))?,
            slots: plan.slots.as_slice().map_err(|_| contiguous("slots"))?,
            block_tables: plan
                .block_tables
                .as_slice()
                .map_err(|_| contiguous("block_tables"))?,
            max_blocks: plan.block_tables.shape()[1],
            seq_lens: plan
                .seq_lens
                .as_slice()
                .map_err(|_| contiguous("seq_lens"))?,
            threads,
        };
        let (hs, hshape) = hw.slice::<T>("h")?;
        if hshape.len() != 2 || hshape[1] != self.hidden {
            let r = format!("shape {hshape:?}, expected [t, {}]", self.hidden);
            return Err(value_error("h", r));
        }
        let mut ls = Vec::with_capacity(layers.len());
        for (l, held) in layers.iter().zip(&held) {
            let rope_table = match l.rotary {
                None => None,
                Some(i) => {
                    let t = tables.get(i).ok_or_else(|| {
                        value_error("tables", format!("has no table {i} for a layer's rotary"))
                    })?;
                    Some(t.slice::<T>("tables")?)
                }
            };
            let bias = |i: usize| -> PyResult<Option<&[f32]>> {
                held.biases[i]
                    .as_ref()
                    .map(|b| b.as_slice().map_err(|_| contiguous("biases")))
                    .transpose()
            };
            let qk_norm = match &held.qk {
                Some([q, k]) => Some((q.slice::<T>("q_norm")?, k.slice::<T>("k_norm")?)),
                None => None,
            };
            let mlp = match (&l.mlp, &held.router) {
                (PyMlp::Dense { gate_up, down, act }, _) => Mlp::Dense {
                    gate_up: T::proj(gate_up),
                    down: T::proj(down),
                    act: *act,
                },
                (PyMlp::Moe { experts, route, .. }, Some((router, bias))) => Mlp::Moe(Moe {
                    router: router.slice::<f32>("router")?,
                    router_bias: bias
                        .as_ref()
                        .map(|b| b.slice::<f32>("router_bias"))
                        .transpose()?,
                    route: *route,
                    experts: experts.get().experts()?,
                }),
                (PyMlp::Moe { .. }, _) => unreachable!("a MoE layer's router is held above"),
            };
            ls.push(Layer {
                input_norm: held.norms[0].slice::<T>("input_norm")?,
                post_norm: held.norms[1].slice::<T>("post_norm")?,
                qkv: T::proj(&l.qkv),
                o: T::proj(&l.o),
                mlp,
                bias: [bias(0)?, bias(1)?, bias(2)?, bias(3)?],
                qk_norm,
                rope_table,
                window: l.window,
                softcap: l.softcap,
                scale: l.scale,
                num_q_heads: l.num_heads,
                eps: l.eps,
            });
        }
        let mut cs = Vec::with_capacity(kv.len());
        for (k, v) in kv.iter_mut() {
            let (ks, kshape) = k.slice::<C>("k_cache")?;
            let (vs, vshape) = v.slice::<C>("v_cache")?;
            if kshape.len() != 4 || vshape != kshape {
                let r = format!("k_cache {kshape:?} and v_cache {vshape:?} must be one 4-D shape");
                return Err(value_error("caches", r));
            }
            cs.push(Cache {
                k: ks,
                v: vs,
                num_blocks: kshape[0],
                block_size: kshape[1],
                kv_heads: kshape[2],
                head_dim: kshape[3],
            });
        }
        let hidden = self.hidden;
        let scratch = T::scratch(self);
        Ok(py.detach(|| {
            let mut scratch = scratch.lock().unwrap_or_else(|e| e.into_inner());
            run(&ls, &mut cs, &step, hs, hidden, &mut scratch)
        })?)
    }
}
