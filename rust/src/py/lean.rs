//! `LeanLayer` and `LeanStack`: a model's Llama-shaped layers over the `QuantMatrix` objects its
//! linears hold and numpy views of its norms (handles, not copies), run as one decode step per
//! call with the GIL released (`crate::cpu::lean`).

use std::sync::Mutex;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::moe::PyMoeExperts;
use super::ops::{dtype_arg, ro, rw, with_elem, Ro, Rw};
use super::quant::PyQuantMatrix;
use super::value_error;
use crate::cpu::lean::{run, Cache, Layer, Mlp, Moe, Scratch, Step};
use crate::cpu::ops::GatedAct;
use crate::cpu::route::{Route, Scoring};

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
    qkv: Py<PyQuantMatrix>,
    o: Py<PyQuantMatrix>,
    mlp: PyMlp,
    biases: [Option<Py<PyArray1<f32>>>; 4],
    qk_norm: Option<(Py<PyAny>, Py<PyAny>)>,
    rotary: Option<usize>,
    window: Option<usize>,
    softcap: Option<f32>,
    scale: f32,
    num_heads: usize,
    eps: f32,
}

enum PyMlp {
    Dense {
        gate_up: Py<PyQuantMatrix>,
        down: Py<PyQuantMatrix>,
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
        qkv: Bound<'_, PyQuantMatrix>,
        o: Bound<'_, PyQuantMatrix>,
        gate_up: Option<Bound<'_, PyQuantMatrix>>,
        down: Option<Bound<'_, PyQuantMatrix>>,
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
        let act = match activation {
            "silu" => GatedAct::Silu,
            "gelu_tanh" => GatedAct::GeluTanh,
            _ => {
                let r = format!("{activation:?} is none of \"silu\", \"gelu_tanh\"");
                return Err(value_error("activation", r));
            }
        };
        let mlp = match (gate_up, down, moe) {
            (Some(gate_up), Some(down), None) => PyMlp::Dense {
                gate_up: gate_up.unbind(),
                down: down.unbind(),
                act,
            },
            (None, None, Some((experts, router, router_bias, spec))) => {
                let (scoring, top_k, renormalize, renorm_eps, scaling) = spec;
                let scoring = match scoring.as_str() {
                    "softmax" => Scoring::Softmax,
                    "sigmoid" => Scoring::Sigmoid,
                    "topk_softmax" => Scoring::TopkSoftmax,
                    other => {
                        let r = format!("{other:?} is none of softmax, sigmoid, topk_softmax");
                        return Err(value_error("moe", r));
                    }
                };
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
        // Checked now as well as at each step, so a wrong array fails where the stack is built.
        let f32s = [Some(input_norm), Some(post_norm)]
            .into_iter()
            .chain(qk_norm.iter().flat_map(|(q, k)| [Some(q), Some(k)]));
        for (name, a) in ["input_norm", "post_norm", "q_norm", "k_norm"]
            .iter()
            .zip(f32s)
        {
            if let Some(a) = a {
                ro(a, name, super::ops::DType::F32)?.slice::<f32>(name)?;
            }
        }
        Ok(PyLeanLayer {
            input_norm: input_norm.clone().unbind(),
            post_norm: post_norm.clone().unbind(),
            qkv: qkv.unbind(),
            o: o.unbind(),
            mlp,
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
    /// The step's intermediate rows, grown to the largest step seen and reused.
    scratch: Mutex<Scratch>,
}

/// A layer's arrays, borrowed for one step.
struct Held<'py> {
    norms: [Ro<'py>; 2],
    biases: Vec<Option<PyReadonlyArray1<'py, f32>>>,
    qk: Option<[Ro<'py>; 2]>,
    router: Option<[Option<Ro<'py>>; 2]>,
}

#[pymethods]
impl PyLeanStack {
    #[new]
    fn new(layers: Vec<Bound<'_, PyLeanLayer>>, hidden: usize) -> PyResult<Self> {
        if hidden == 0 {
            return Err(value_error("hidden", "must be >= 1"));
        }
        Ok(PyLeanStack {
            layers: layers.into_iter().map(Bound::unbind).collect(),
            hidden,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    fn __len__(&self) -> usize {
        self.layers.len()
    }

    /// Every layer over the residual stream `h` (float32 `[t, hidden]`, in place): layer `i`
    /// writes this step's K/V rows into `caches[i] = (k, v)` (`[blocks, block_size, Hkv, D]`
    /// of `cache_dtype`, 16-bit ones as int16 views of their bits) and attends them. The plan's
    /// `block_tables` `[t, max_blocks]` and `seq_lens` `[t]` (int32), `slots` and `positions`
    /// `[t]` (int64), one row per token as `decode_attention_qkv` takes them; `tables` the
    /// float32 rotary tables the layers' `rotary` indices name.
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
        let f32t = super::ops::DType::F32;
        let ct = dtype_arg(cache_dtype)?;
        if caches.len() != self.layers.len() {
            let r = format!("{} pairs for {} layers", caches.len(), self.layers.len());
            return Err(value_error("caches", r));
        }
        let mut hw = rw(h, "h", f32t)?;
        let tables: Vec<Ro> = tables
            .iter()
            .map(|t| ro(t, "tables", f32t))
            .collect::<PyResult<_>>()?;
        let layers: Vec<&PyLeanLayer> = self.layers.iter().map(|l| l.get()).collect();
        let held: Vec<Held> = layers
            .iter()
            .map(|l| {
                let norms = [
                    ro(l.input_norm.bind(py), "input_norm", f32t)?,
                    ro(l.post_norm.bind(py), "post_norm", f32t)?,
                ];
                let biases = l
                    .biases
                    .iter()
                    .map(|b| b.as_ref().map(|b| b.bind(py).readonly()))
                    .collect();
                let qk = match &l.qk_norm {
                    Some((q, k)) => Some([
                        ro(q.bind(py), "q_norm", f32t)?,
                        ro(k.bind(py), "k_norm", f32t)?,
                    ]),
                    None => None,
                };
                let router = match &l.mlp {
                    PyMlp::Moe {
                        router,
                        router_bias,
                        ..
                    } => Some([
                        Some(ro(router.bind(py), "router", f32t)?),
                        match router_bias {
                            Some(b) => Some(ro(b.bind(py), "router_bias", f32t)?),
                            None => None,
                        },
                    ]),
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
            positions: positions.as_slice().map_err(|_| contiguous("positions"))?,
            slots: slots.as_slice().map_err(|_| contiguous("slots"))?,
            block_tables: block_tables
                .as_slice()
                .map_err(|_| contiguous("block_tables"))?,
            max_blocks: block_tables.shape()[1],
            seq_lens: seq_lens.as_slice().map_err(|_| contiguous("seq_lens"))?,
            threads: threads.max(1),
        };
        let (hs, hshape) = hw.slice::<f32>("h")?;
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
                    Some(t.slice::<f32>("tables")?)
                }
            };
            let bias = |i: usize| -> PyResult<Option<&[f32]>> {
                held.biases[i]
                    .as_ref()
                    .map(|b| b.as_slice().map_err(|_| contiguous("biases")))
                    .transpose()
            };
            let qk_norm = match &held.qk {
                Some([q, k]) => Some((q.slice::<f32>("q_norm")?, k.slice::<f32>("k_norm")?)),
                None => None,
            };
            let mlp = match (&l.mlp, &held.router) {
                (PyMlp::Dense { gate_up, down, act }, _) => Mlp::Dense {
                    gate_up: &gate_up.get().inner,
                    down: &down.get().inner,
                    act: *act,
                },
                (PyMlp::Moe { experts, route, .. }, Some([Some(router), bias])) => Mlp::Moe(Moe {
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
                input_norm: held.norms[0].slice::<f32>("input_norm")?,
                post_norm: held.norms[1].slice::<f32>("post_norm")?,
                qkv: &l.qkv.get().inner,
                o: &l.o.get().inner,
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
        let hidden = self.hidden;
        with_elem!(ct, C => {
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
            let streamed = py.detach(|| {
                let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
                run(&ls, &mut cs, &step, hs, hidden, &mut scratch)
            })?;
            Ok(streamed)
        })
    }
}
