//! `Scheduler` and `SchedulerPlan` for Python: one `schedule()` and one `update()` per step.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::grammar::PyCompiledGrammar;
use super::{as_i64_array, count_arg, time_arg, token_ids, value_error};
use crate::sched::fair::FairConfig;
use crate::sched::queue::Policy;
use crate::sched::scheduler::{Finished, Scheduler, SchedulerConfig, SchedulerOptions};
use crate::sched::sequence::{RequestParams, Slot};
use crate::sched::spec::SpecConfig;

/// Steps with at least this many running sequences run with the GIL released. Shorter ones
/// keep it: giving the GIL away for a few microseconds can cost a whole switch interval to
/// get it back when another thread is busy.
const DETACH_MIN_RUNNING: usize = 256;

/// Everything the model runner needs for one step. Arrays are freshly built numpy arrays.
#[pyclass(name = "SchedulerPlan", module = "ironlm._core", frozen)]
pub struct PySchedulerPlan {
    #[pyo3(get)]
    input_ids: Py<PyAny>,
    #[pyo3(get)]
    positions: Py<PyAny>,
    #[pyo3(get)]
    slot_mapping: Py<PyAny>,
    #[pyo3(get)]
    block_tables: Py<PyAny>,
    #[pyo3(get)]
    query_start_loc: Py<PyAny>,
    #[pyo3(get)]
    seq_lens: Py<PyAny>,
    #[pyo3(get)]
    context_lens: Py<PyAny>,
    #[pyo3(get)]
    seq_slots: Py<PyAny>,
    #[pyo3(get)]
    logits_indices: Py<PyAny>,
    #[pyo3(get)]
    sample_slots: Py<PyAny>,
    #[pyo3(get)]
    sample_output_lens: Py<PyAny>,
    #[pyo3(get)]
    sample_ban_stop: Py<PyAny>,
    #[pyo3(get)]
    sample_draft: Py<PyAny>,
    #[pyo3(get)]
    mask_rows: Py<PyAny>,
    #[pyo3(get)]
    cow_pairs: Py<PyAny>,
    #[pyo3(get)]
    kv_demote: Py<PyAny>,
    #[pyo3(get)]
    kv_promote: Py<PyAny>,
    #[pyo3(get)]
    new_request_ids: Py<PyList>,
    #[pyo3(get)]
    new_request_cached_tokens: Py<PyAny>,
    #[pyo3(get)]
    preempted_request_ids: Py<PyList>,
    #[pyo3(get)]
    finished: Py<PyList>,
    #[pyo3(get)]
    num_prefill_tokens: usize,
    #[pyo3(get)]
    num_decode_tokens: usize,
    #[pyo3(get)]
    num_cached_tokens: usize,
    #[pyo3(get)]
    max_query_len: usize,
    #[pyo3(get)]
    max_seq_len: usize,
    tokens: usize,
    seqs: usize,
    samples: usize,
}

#[pymethods]
impl PySchedulerPlan {
    #[getter]
    fn num_tokens(&self) -> usize {
        self.tokens
    }

    #[getter]
    fn num_seqs(&self) -> usize {
        self.seqs
    }

    /// Rows to sample (``len(sample_slots)``).
    #[getter]
    fn num_samples(&self) -> usize {
        self.samples
    }

    #[getter]
    fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerPlan(num_tokens={}, num_seqs={}, num_samples={}, prefill={}, decode={}, cached={})",
            self.tokens,
            self.seqs,
            self.samples,
            self.num_prefill_tokens,
            self.num_decode_tokens,
            self.num_cached_tokens
        )
    }
}

fn array_i64(py: Python<'_>, v: &[i64]) -> Py<PyAny> {
    PyArray1::from_slice(py, v).into_any().unbind()
}

/// `(request id, seq slot, reason, stop token id or None)` per finished sequence.
fn finished_list<'py>(py: Python<'py>, finished: &[Finished]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(
        py,
        finished
            .iter()
            .map(|(id, slot, why)| (id.as_ref(), *slot, why.as_str(), why.stop_token())),
    )
}

/// A flat `[k * 2]` list of pairs as a fresh int64 `[k, 2]` array.
fn pairs(py: Python<'_>, flat: &[i64], name: &str) -> PyResult<Py<PyAny>> {
    let k = flat.len() / 2;
    // SAFETY: a fresh, C-contiguous array owned by nobody else; every element is written.
    let a = unsafe { PyArray2::<i64>::new(py, [k, 2], false) };
    if k > 0 {
        unsafe { a.as_slice_mut() }
            .map_err(|e| value_error(name, e))?
            .copy_from_slice(flat);
    }
    Ok(a.into_any().unbind())
}

fn build_plan(py: Python<'_>, s: &Scheduler) -> PyResult<PySchedulerPlan> {
    let p = s.plan();
    let (b, w) = (p.num_seqs(), p.block_table_width);
    // SAFETY: fresh, C-contiguous arrays owned by nobody else; every element is written below.
    let block_tables = unsafe { PyArray2::<i32>::new(py, [b, w], false) };
    if b * w > 0 {
        let out =
            unsafe { block_tables.as_slice_mut() }.map_err(|e| value_error("block_tables", e))?;
        s.fill_block_tables(out);
    }
    let cow_pairs = pairs(py, &p.cow_pairs, "cow_pairs")?;
    let ids = |v: &[std::sync::Arc<str>]| -> PyResult<Py<PyList>> {
        Ok(PyList::new(py, v.iter().map(|x| x.as_ref()))?.unbind())
    };
    Ok(PySchedulerPlan {
        input_ids: array_i64(py, &p.input_ids),
        positions: array_i64(py, &p.positions),
        slot_mapping: array_i64(py, &p.slot_mapping),
        block_tables: block_tables.into_any().unbind(),
        query_start_loc: array_i64(py, &p.query_start_loc),
        seq_lens: array_i64(py, &p.seq_lens),
        context_lens: array_i64(py, &p.context_lens),
        seq_slots: array_i64(py, &p.seq_slots),
        logits_indices: array_i64(py, &p.logits_indices),
        sample_slots: array_i64(py, &p.sample_slots),
        sample_output_lens: array_i64(py, &p.sample_output_lens),
        sample_ban_stop: PyArray1::from_slice(py, &p.sample_ban_stop)
            .into_any()
            .unbind(),
        sample_draft: array_i64(py, &p.sample_draft),
        mask_rows: array_i64(py, &p.mask_rows),
        cow_pairs,
        kv_demote: pairs(py, &p.kv_demote, "kv_demote")?,
        kv_promote: pairs(py, &p.kv_promote, "kv_promote")?,
        new_request_ids: ids(&p.new_request_ids)?,
        new_request_cached_tokens: array_i64(py, &p.new_request_cached_tokens),
        preempted_request_ids: ids(&p.preempted_request_ids)?,
        finished: finished_list(py, &p.finished)?.unbind(),
        num_prefill_tokens: p.num_prefill_tokens,
        num_decode_tokens: p.num_decode_tokens,
        num_cached_tokens: p.num_cached_tokens,
        max_query_len: p.max_query_len,
        max_seq_len: p.max_seq_len,
        tokens: p.num_tokens(),
        seqs: b,
        samples: p.num_samples(),
    })
}

fn slot_arg(slot: i64) -> PyResult<Slot> {
    Slot::try_from(slot).map_err(|_| value_error("slot", format!("no sequence has slot {slot}")))
}

/// Continuous-batching scheduler owning the queue, the allocator and the radix cache.
#[pyclass(name = "Scheduler", module = "ironlm._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

/// The attributes `Scheduler(config)` reads (`ironlm.config.SchedulerConfig`'s fields).
#[derive(FromPyObject)]
struct SchedulerArgs {
    num_blocks: i64,
    block_size: i64,
    max_num_seqs: i64,
    max_num_batched_tokens: i64,
    max_model_len: i64,
    policy: String,
    enable_prefix_caching: bool,
    max_queue_len: Option<i64>,
    tenant_weights: std::collections::HashMap<String, f64>,
    input_token_weight: f64,
    output_token_weight: f64,
    scheduler_delay_factor: f64,
    tier_blocks: i64,
    swap: bool,
    sliding_window: Option<i64>,
    reserve_decode: bool,
}

#[pymethods]
impl PyScheduler {
    #[new]
    /// Built from one `ironlm.config.SchedulerConfig` (any object with its attributes): every
    /// field is required here, so `EngineConfig`, which builds it, is the one home of defaults.
    fn new(config: SchedulerArgs) -> PyResult<Self> {
        let a = config;
        let cfg = SchedulerConfig {
            num_blocks: count_arg("num_blocks", a.num_blocks, 1)?,
            block_size: count_arg("block_size", a.block_size, 1)?,
            max_num_seqs: count_arg("max_num_seqs", a.max_num_seqs, 1)?,
            max_num_batched_tokens: count_arg(
                "max_num_batched_tokens",
                a.max_num_batched_tokens,
                1,
            )?,
            max_model_len: count_arg("max_model_len", a.max_model_len, 2)?,
            policy: a.policy.parse::<Policy>()?,
            enable_prefix_caching: a.enable_prefix_caching,
            max_queue_len: a
                .max_queue_len
                .map(|m| count_arg("max_queue_len", m, 0))
                .transpose()?,
        };
        let mut tenant_weights: Vec<(String, f64)> = a.tenant_weights.into_iter().collect();
        tenant_weights.sort_by(|a, b| a.0.cmp(&b.0));
        let opts = SchedulerOptions {
            fair: FairConfig {
                tenant_weights,
                input_token_weight: a.input_token_weight,
                output_token_weight: a.output_token_weight,
            },
            delay_factor: a.scheduler_delay_factor,
            tier_blocks: count_arg("tier_blocks", a.tier_blocks, 0)?,
            swap: a.swap,
            sliding_window: a
                .sliding_window
                .map(|w| count_arg("sliding_window", w, 1))
                .transpose()?,
            reserve_decode: a.reserve_decode,
        };
        Ok(Self {
            inner: Scheduler::with_options(cfg, opts)?,
        })
    }

    /// Queue a request; returns its ``n`` sequence slots.
    #[pyo3(signature = (
        request_id,
        prompt_token_ids,
        max_tokens,
        *,
        min_tokens = 0,
        n = 1,
        priority = 0,
        eos_token_ids = None,
        stop_token_ids = None,
        ignore_eos = false,
        deadline = None,
        queue_timeout = None,
        namespace = None,
        arrival_time = None,
        grammar = None,
        tenant = None,
        speculate = true,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: i64,
        min_tokens: i64,
        n: i64,
        priority: i64,
        eos_token_ids: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        deadline: Option<f64>,
        queue_timeout: Option<f64>,
        namespace: Option<String>,
        arrival_time: Option<f64>,
        grammar: Option<PyRef<'_, PyCompiledGrammar>>,
        tenant: Option<String>,
        speculate: bool,
    ) -> PyResult<Vec<Slot>> {
        let prompt = token_ids(prompt_token_ids, "prompt_token_ids")?;
        let ids = |o: Option<&Bound<'_, PyAny>>, name| match o {
            Some(o) => token_ids(o, name),
            None => Ok(Vec::new()),
        };
        let params = RequestParams {
            max_tokens: count_arg("max_tokens", max_tokens, 1)?,
            min_tokens: count_arg("min_tokens", min_tokens, 0)?,
            n: count_arg("n", n, 1)?,
            priority,
            eos_token_ids: ids(eos_token_ids, "eos_token_ids")?,
            stop_token_ids: ids(stop_token_ids, "stop_token_ids")?,
            ignore_eos,
            deadline: time_arg("deadline", deadline)?,
            queue_timeout: time_arg("queue_timeout", queue_timeout)?,
            namespace,
            arrival_time: time_arg("arrival_time", arrival_time)?,
            grammar: grammar.map(|g| g.inner.clone()),
            tenant,
            speculate,
        };
        Ok(self.inner.add_request(request_id, &prompt, params)?)
    }

    /// Plan the next step.
    #[pyo3(signature = (now = None))]
    fn schedule(&mut self, py: Python<'_>, now: Option<f64>) -> PyResult<PySchedulerPlan> {
        let now = time_arg("now", now)?;
        let inner = &mut self.inner;
        if inner.num_running() >= DETACH_MIN_RUNNING {
            py.detach(|| {
                inner.schedule(now);
            });
        } else {
            inner.schedule(now);
        }
        build_plan(py, inner)
    }

    /// The last plan's token bitmask: ``(rows, bits)`` with ``bits`` int32 ``[len(rows),
    /// ceil(vocab_size / 32)]`` (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed) for
    /// the sample rows ``rows`` (= ``plan.mask_rows``), or None when the plan has no
    /// constrained row (or they were taken). Computed on a worker thread since ``schedule``:
    /// call it after the forward, so the computation overlaps it; waits with the GIL released.
    fn take_bitmask<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
        let inner = &mut self.inner;
        match py.detach(|| inner.take_bitmask()) {
            Some(m) => bitmask_arrays(py, &m).map(Some),
            None => Ok(None),
        }
    }

    /// Masks for a draft model's proposals under each constrained sequence's grammar:
    /// ``rows`` are sample rows of the last plan that verify a proposal (the ``j``-th of their
    /// run), ``prev[i]`` the draft's proposal before ``rows[i]`` (-1 for the first of a run),
    /// which its matcher takes first. ``(idx, bits)``: mask ``bits[i]`` is for ``rows[idx[i]]``;
    /// None when none of the rows is constrained. ``set_proposals`` rolls the matchers back.
    fn draft_masks<'py>(
        &mut self,
        py: Python<'py>,
        rows: &Bound<'py, PyAny>,
        prev: &Bound<'py, PyAny>,
    ) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
        let rows = as_i64_array(rows, "rows")?
            .to_vec()
            .map_err(|e| value_error("rows", e))?;
        let prev = as_i64_array(prev, "prev")?
            .to_vec()
            .map_err(|e| value_error("prev", e))?;
        let inner = &mut self.inner;
        match py.detach(|| inner.draft_masks(&rows, &prev))? {
            Some(m) => bitmask_arrays(py, &m).map(Some),
            None => Ok(None),
        }
    }

    /// Where the mask computation's time went: ``steps``, ``rows``, ``compute_s`` (worker
    /// time) and ``wait_s`` (time ``take_bitmask`` waited: what did not overlap the forward).
    fn mask_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.mask_stats();
        let d = PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("rows", s.rows)?;
        d.set_item("compute_s", s.compute_ns as f64 * 1e-9)?;
        d.set_item("wait_s", s.wait_ns as f64 * 1e-9)?;
        Ok(d)
    }

    /// Threads one step's mask computation may use (default: the machine's CPUs).
    #[getter]
    fn mask_threads(&self) -> usize {
        self.inner.mask_threads()
    }

    #[setter]
    fn set_mask_threads(&mut self, n: i64) -> PyResult<()> {
        self.inner
            .set_mask_threads(count_arg("mask_threads", n, 1)?);
        Ok(())
    }

    /// Append one token per ``plan.sample_slots`` row of the last plan; returns
    /// ``(request id, seq slot, reason, stop token id or None)`` for each sequence that finished.
    fn update<'py>(
        &mut self,
        py: Python<'py>,
        sampled_token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let arr = as_i64_array(sampled_token_ids, "sampled_token_ids")?;
        let inner = &mut self.inner;
        let finished = if inner.num_running() >= DETACH_MIN_RUNNING {
            let v = arr
                .to_vec()
                .map_err(|e| value_error("sampled_token_ids", e))?;
            py.detach(|| inner.update(&v))?
        } else {
            let ro = arr.readonly();
            let s = ro
                .as_slice()
                .map_err(|e| value_error("sampled_token_ids", e))?;
            inner.update(s)?
        };
        finished_list(py, &finished)
    }

    /// Per ``plan.sample_slots`` row of the last ``update``: whether its token was appended
    /// (False: a row after a rejected proposal, or of a sequence finished since the plan).
    fn emitted<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        PyArray1::from_slice(py, self.inner.emitted()).into_any()
    }

    /// Turn speculative decoding on (``num_speculative_tokens`` >= 1) for requests added from
    /// now; ``None`` turns it off. n-gram proposals, or with ``external`` rows reserved for
    /// proposals made outside (``set_proposals``).
    /// ``max_batch_tokens``: no proposals once the decode batch reaches it (None: no cap).
    #[pyo3(signature = (num_speculative_tokens, prompt_lookup_max = 4, prompt_lookup_min = 1, max_batch_tokens = None, external = false))]
    fn set_speculation(
        &mut self,
        num_speculative_tokens: Option<i64>,
        prompt_lookup_max: i64,
        prompt_lookup_min: i64,
        max_batch_tokens: Option<i64>,
        external: bool,
    ) -> PyResult<()> {
        let cfg = match num_speculative_tokens {
            None => None,
            Some(k) => Some(SpecConfig {
                num_speculative_tokens: count_arg("num_speculative_tokens", k, 1)?,
                prompt_lookup_max: count_arg("prompt_lookup_max", prompt_lookup_max, 1)?,
                prompt_lookup_min: count_arg("prompt_lookup_min", prompt_lookup_min, 1)?,
                max_batch_tokens: match max_batch_tokens {
                    Some(n) => count_arg("max_batch_tokens", n, 0)?,
                    None => usize::MAX,
                },
                external,
            }),
        };
        Ok(self.inner.set_speculation(cfg)?)
    }

    /// The most proposal tokens the next steps' plans may carry in all (the engine's cost
    /// model, per step; 0 pauses speculation); ``None`` lifts the limit.
    fn set_spec_budget(&mut self, budget: Option<i64>) -> PyResult<()> {
        let b = budget.map(|n| count_arg("budget", n, 0)).transpose()?;
        self.inner.set_spec_budget(b);
        Ok(())
    }

    /// External proposals for ``plan`` (the last ``schedule``'s): one token per sample row
    /// with ``sample_draft >= 0``, in row order. Written into the core's plan and into
    /// ``plan.input_ids`` / ``plan.sample_draft``.
    fn set_proposals(
        &mut self,
        py: Python<'_>,
        plan: &PySchedulerPlan,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let arr = as_i64_array(tokens, "proposals")?;
        let v = arr.to_vec().map_err(|e| value_error("proposals", e))?;
        let last = self.inner.plan();
        if plan.samples != last.num_samples() || plan.tokens != last.num_tokens() {
            return Err(value_error("plan", "not the last plan scheduled"));
        }
        self.inner.set_proposals(&v)?;
        let p = self.inner.plan();
        for (arr, src, name) in [
            (&plan.input_ids, &p.input_ids, "input_ids"),
            (&plan.sample_draft, &p.sample_draft, "sample_draft"),
        ] {
            let a = arr
                .bind(py)
                .cast::<PyArray1<i64>>()
                .map_err(|e| value_error(name, e))?;
            let mut rw = a.readwrite();
            rw.as_slice_mut()
                .map_err(|e| value_error(name, e))?
                .copy_from_slice(src);
        }
        Ok(())
    }

    /// Speculation counters: ``num_drafts`` (sequence-steps that verified proposals),
    /// ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_pos`` (list),
    /// ``grammar_cut_tokens`` (proposed tokens a grammar rejected).
    fn spec_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.spec_stats();
        let d = PyDict::new(py);
        d.set_item("num_drafts", s.num_drafts)?;
        d.set_item("num_draft_tokens", s.num_draft_tokens)?;
        d.set_item("num_accepted_tokens", s.num_accepted_tokens)?;
        d.set_item("accepted_per_pos", s.accepted_per_pos.clone())?;
        d.set_item("grammar_cut_tokens", s.grammar_cut_tokens)?;
        Ok(d)
    }

    /// Finish one sequence now (a stop string matched); frees its blocks.
    fn finish(&mut self, slot: i64) -> PyResult<bool> {
        if slot < 0 {
            return Err(value_error("slot", format!("must be >= 0, got {slot}")));
        }
        Ok(Slot::try_from(slot).is_ok_and(|s| self.inner.finish(s)))
    }

    /// Drop a request (all its sequences) wherever it is; frees its blocks.
    fn abort(&mut self, request_id: &str) -> bool {
        self.inner.abort(request_id)
    }

    /// Generated tokens of a sequence (live, or finished and its slot not reused yet).
    fn output_token_ids(&self, slot: i64) -> PyResult<Vec<u32>> {
        self.inner
            .output_token_ids(slot_arg(slot)?)
            .map(<[u32]>::to_vec)
            .ok_or_else(|| value_error("slot", format!("no sequence has slot {slot}")))
    }

    /// Prompt + generated tokens of a sequence (see ``output_token_ids``).
    fn token_ids(&self, slot: i64) -> PyResult<Vec<u32>> {
        self.inner
            .token_ids(slot_arg(slot)?)
            .map(<[u32]>::to_vec)
            .ok_or_else(|| value_error("slot", format!("no sequence has slot {slot}")))
    }

    /// Token ids that stop a live sequence (its stop_token_ids, plus EOS unless ignore_eos);
    /// the sampler masks them on the rows of ``plan.sample_ban_stop``.
    fn stop_token_ids(&self, slot: i64) -> PyResult<Vec<u32>> {
        self.inner
            .stop_token_ids(slot_arg(slot)?)
            .map(<[u32]>::to_vec)
            .ok_or_else(|| value_error("slot", format!("no live sequence has slot {slot}")))
    }

    /// Request id of a live sequence, else None.
    fn request_id(&self, slot: i64) -> Option<String> {
        let s = Slot::try_from(slot).ok()?;
        self.inner.request_id(s).map(|id| id.to_string())
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    /// Drop every unlocked cached block; False if some are still in use.
    fn reset_prefix_cache(&mut self, py: Python<'_>) -> bool {
        let inner = &mut self.inner;
        py.detach(|| inner.reset_prefix_cache())
    }

    /// The cost model: a hit on tier blocks promotes them only if copying a block back costs
    /// less than recomputing its ``block_size`` tokens (else the request recomputes them).
    fn set_promote_cost(
        &mut self,
        copy_s_per_block: f64,
        prefill_s_per_token: f64,
    ) -> PyResult<()> {
        Ok(self
            .inner
            .set_promote_cost(copy_s_per_block, prefill_s_per_token)?)
    }

    /// Whether tier hits are promoted (see ``set_promote_cost``).
    #[getter]
    fn promotes(&self) -> bool {
        self.inner.promotes()
    }

    /// Lock the device-cached full blocks of ``token_ids`` for good; returns the tokens pinned
    /// (0 if they are not cached: prefill them first).
    #[pyo3(signature = (token_ids, namespace = None))]
    fn pin_prefix(
        &mut self,
        token_ids: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<usize> {
        let t = super::token_ids(token_ids, "token_ids")?;
        Ok(self.inner.pin_prefix(&t, namespace))
    }

    /// Demote every unpinned, unused device-cached block the tier can take; returns the
    /// ``(device_block, tier_slot)`` copies (int64 ``[k, 2]``) the caller must run now.
    fn tier_flush(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let flat = self.inner.tier_flush();
        pairs(py, &flat, "tier_flush")
    }

    /// ``(slot, parent_slot or -1, namespace, block token ids)`` for every tier block whose
    /// whole path is in the tier, parents first.
    fn tier_entries(&self) -> Vec<(u32, i64, Option<String>, Vec<u32>)> {
        self.inner.tier_entries()
    }

    /// Rebuild tier nodes from ``tier_entries`` of an earlier run (parents first; entries
    /// whose parent is missing are skipped). Returns how many were restored.
    fn tier_restore(
        &mut self,
        entries: Vec<(u32, i64, Option<String>, Vec<u32>)>,
    ) -> PyResult<usize> {
        Ok(self.inner.tier_restore(&entries)?)
    }

    #[getter]
    fn tier_blocks(&self) -> usize {
        self.inner.options().tier_blocks
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    /// Slots handed out so far (highest slot + 1): size per-slot tables with it.
    #[getter]
    fn num_slots(&self) -> usize {
        self.inner.num_slots()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }

    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.config().max_num_seqs
    }

    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.config().max_num_batched_tokens
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.config().max_model_len
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.config().policy.as_str()
    }

    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.config().enable_prefix_caching
    }

    /// Counters without a scan.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("num_waiting", s.num_waiting)?;
        d.set_item("num_running", s.num_running)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("num_timeouts", s.num_timeouts)?;
        d.set_item("prefix_queries", s.prefix_queries)?;
        d.set_item("prefix_hits", s.prefix_hits)?;
        d.set_item("blocks_total", s.blocks.total)?;
        d.set_item("blocks_free", s.blocks.free)?;
        d.set_item("blocks_used", s.blocks.used)?;
        d.set_item("blocks_cached", s.blocks.cached)?;
        d.set_item("num_aborted", s.num_aborted)?;
        d.set_item("num_finished", s.num_finished)?;
        d.set_item("num_steps", s.num_steps)?;
        d.set_item("num_requests", s.num_requests)?;
        let t = s.tier;
        d.set_item("tier_blocks_total", t.capacity)?;
        d.set_item("tier_blocks_used", t.used)?;
        d.set_item("kv_promotions", t.promotions)?;
        d.set_item("kv_demotions", t.demotions)?;
        d.set_item("prefix_hits_tier", t.hits)?;
        d.set_item("swap_out_blocks", t.swap_out)?;
        d.set_item("swap_in_blocks", t.swap_in)?;
        d.set_item("blocks_pinned", t.pinned)?;
        d.set_item("kv_slots_allocated", s.kv_slots_allocated)?;
        d.set_item("kv_slots_used", s.kv_slots_used)?;
        d.set_item("window_freed_blocks", s.window_freed_blocks)?;
        Ok(d)
    }

    /// Per tenant seen so far: ``{name: {"weight", "counter", "input_tokens",
    /// "output_tokens", "live"}}`` (served tokens count under every policy).
    fn tenant_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for t in self.inner.tenant_stats() {
            let d = PyDict::new(py);
            d.set_item("weight", t.weight)?;
            d.set_item("counter", t.counter)?;
            d.set_item("input_tokens", t.input_tokens)?;
            d.set_item("output_tokens", t.output_tokens)?;
            d.set_item("live", t.live)?;
            out.set_item(t.name.as_ref(), d)?;
        }
        Ok(out)
    }

    #[getter]
    fn scheduler_delay_factor(&self) -> f64 {
        self.inner.delay_factor()
    }

    fn __contains__(&self, request_id: &str) -> bool {
        self.inner.contains_request(request_id)
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Scheduler(num_blocks={}, block_size={}, policy={:?}, running={}, waiting={})",
            c.num_blocks,
            c.block_size,
            c.policy.as_str(),
            self.inner.num_running(),
            self.inner.num_waiting()
        )
    }
}

/// A bitmask as numpy arrays: ``rows`` int64, ``bits`` int32 ``[len(rows), words_per_row]``.
fn bitmask_arrays<'py>(
    py: Python<'py>,
    m: &crate::grammar::TokenBitmask,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let rows = PyArray1::from_slice(py, &m.rows).into_any();
    // SAFETY: a fresh C-contiguous array owned by nobody else; every element is written.
    let bits = unsafe { PyArray2::<i32>::new(py, [m.rows.len(), m.words_per_row], false) };
    if !m.bits.is_empty() {
        let out = unsafe { bits.as_slice_mut() }.map_err(|e| value_error("bitmask", e))?;
        for (o, &b) in out.iter_mut().zip(&m.bits) {
            *o = b as i32;
        }
    }
    Ok((rows, bits.into_any()))
}
