//! `BlockAllocator` and `RadixCache` for Python's tests (feature `test-bindings`; the engine
//! uses `Scheduler`).

use pyo3::prelude::*;

use super::{count_arg, token_ids, value_error, CoreError};
use crate::sched::block::BlockAllocator;
use crate::sched::radix::RadixCache;

/// Block ids (any int sequence), each checked against `num_blocks`.
fn block_ids(obj: &Bound<'_, PyAny>, name: &str, num_blocks: usize) -> PyResult<Vec<u32>> {
    let v = token_ids(obj, name)?;
    if let Some(&b) = v.iter().find(|&&b| b as usize >= num_blocks) {
        return Err(value_error(
            name,
            format!("block {b} out of range (num_blocks = {num_blocks})"),
        ));
    }
    Ok(v)
}

/// `append_slot`'s answer: the updated block list and the copy-on-write pair, if any.
type AppendSlot = (Vec<u32>, Option<(u32, u32)>);

#[pyclass(name = "BlockAllocator", module = "ironlm._core")]
pub struct PyBlockAllocator {
    inner: BlockAllocator,
}

impl PyBlockAllocator {
    fn check(&self, name: &str, block: i64) -> PyResult<u32> {
        let n = self.inner.num_blocks();
        if block < 0 || block as usize >= n {
            return Err(value_error(
                name,
                format!("block {block} out of range (num_blocks = {n})"),
            ));
        }
        Ok(block as u32)
    }
}

#[pymethods]
impl PyBlockAllocator {
    #[new]
    #[pyo3(signature = (num_blocks, block_size = 16))]
    fn new(num_blocks: i64, block_size: i64) -> PyResult<Self> {
        let num_blocks = count_arg("num_blocks", num_blocks, 0)?;
        let block_size = count_arg("block_size", block_size, 1)?;
        if num_blocks >= u32::MAX as usize / 2 {
            return Err(value_error("num_blocks", "too large"));
        }
        Ok(Self {
            inner: BlockAllocator::new(num_blocks, block_size),
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }

    #[getter]
    fn num_used(&self) -> usize {
        self.inner.num_used()
    }

    #[getter]
    fn num_cached(&self) -> usize {
        self.inner.num_cached()
    }

    /// One free block with ref count 1; raises ``CoreError`` when none is free.
    fn allocate(&mut self) -> PyResult<u32> {
        self.inner
            .allocate()
            .ok_or_else(|| CoreError::new_err("no free KV cache block"))
    }

    fn incref(&mut self, block: i64) -> PyResult<()> {
        let b = self.check("block", block)?;
        self.inner.incref(b);
        Ok(())
    }

    fn decref(&mut self, block: i64) -> PyResult<()> {
        let b = self.check("block", block)?;
        if self.inner.ref_count(b) == 0 {
            return Err(value_error(
                "block",
                format!("block {b} has no reference to drop"),
            ));
        }
        self.inner.decref(b);
        Ok(())
    }

    fn ref_count(&self, block: i64) -> PyResult<u32> {
        let b = self.check("block", block)?;
        Ok(self.inner.ref_count(b))
    }

    fn is_cached(&self, block: i64) -> PyResult<bool> {
        let b = self.check("block", block)?;
        Ok(self.inner.is_cached(b))
    }

    /// Share ``blocks`` with a new holder (each ref count + 1); returns the same ids.
    fn fork(&mut self, blocks: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let v = block_ids(blocks, "blocks", self.inner.num_blocks())?;
        self.inner.fork(&v);
        Ok(v)
    }

    /// Drop one holder's refs on ``blocks`` (in reverse order).
    fn free_all(&mut self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = block_ids(blocks, "blocks", self.inner.num_blocks())?;
        // Check first so a bad list changes nothing.
        let mut need = std::collections::HashMap::<u32, u32>::new();
        for &b in &v {
            *need.entry(b).or_default() += 1;
        }
        for (&b, &k) in &need {
            if self.inner.ref_count(b) < k {
                return Err(value_error(
                    "blocks",
                    format!("block {b} has fewer than {k} references"),
                ));
            }
        }
        self.inner.free_all(&v);
        Ok(())
    }

    /// Make room for token number ``num_tokens`` (0-based) of a sequence owning ``blocks``.
    fn append_slot(&mut self, blocks: &Bound<'_, PyAny>, num_tokens: i64) -> PyResult<AppendSlot> {
        let mut v = block_ids(blocks, "blocks", self.inner.num_blocks())?;
        let n = count_arg("num_tokens", num_tokens, 0)?;
        let idx = n / self.inner.block_size();
        if idx > v.len() {
            return Err(value_error(
                "num_tokens",
                format!(
                    "token {n} is beyond the next block ({} blocks held)",
                    v.len()
                ),
            ));
        }
        if idx < v.len() && self.inner.ref_count(v[idx]) == 0 {
            return Err(value_error(
                "blocks",
                format!("block {} is not held", v[idx]),
            ));
        }
        let pair = self
            .inner
            .append_slot(&mut v, n)
            .map_err(crate::CoreError::from)?;
        Ok((v, pair))
    }

    fn __repr__(&self) -> String {
        let u = self.inner.usage();
        format!(
            "BlockAllocator(num_blocks={}, block_size={}, free={}, used={}, cached={})",
            u.total,
            self.inner.block_size(),
            u.free,
            u.used,
            u.cached
        )
    }
}

#[pyclass(name = "RadixCache", module = "ironlm._core")]
pub struct PyRadixCache {
    inner: RadixCache,
    alloc: Py<PyBlockAllocator>,
}

#[pymethods]
impl PyRadixCache {
    #[new]
    fn new(allocator: Bound<'_, PyBlockAllocator>) -> Self {
        let bs = allocator.borrow().inner.block_size();
        Self {
            inner: RadixCache::new(bs),
            alloc: allocator.unbind(),
        }
    }

    /// Blocks caching the longest block-aligned prefix of ``tokens``, never all of it.
    #[pyo3(signature = (tokens, namespace = None))]
    fn match_prefix(
        &mut self,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<Vec<u32>> {
        let t = token_ids(tokens, "tokens")?;
        Ok(self.inner.match_prefix(&t, namespace, true).blocks)
    }

    /// Cache the full blocks of ``tokens``; returns how many tokens were already cached.
    #[pyo3(signature = (tokens, blocks, namespace = None))]
    fn insert(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<usize> {
        let mut alloc = self.alloc.bind(py).try_borrow_mut()?;
        let t = token_ids(tokens, "tokens")?;
        let b = block_ids(blocks, "blocks", alloc.inner.num_blocks())?;
        let full = t.len() / self.inner.block_size();
        if b.len() < full {
            return Err(value_error(
                "blocks",
                format!("{} blocks for {full} full blocks of tokens", b.len()),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(&d) = b[..full].iter().find(|&&x| !seen.insert(x)) {
            return Err(value_error("blocks", format!("block {d} given twice")));
        }
        Ok(self
            .inner
            .insert(&mut alloc.inner, &t, &b, namespace)
            .num_cached_tokens)
    }

    /// Free up to ``num_blocks`` least-recently-used unlocked cached blocks; returns how many.
    fn evict(&mut self, py: Python<'_>, num_blocks: i64) -> PyResult<usize> {
        let n = count_arg("num_blocks", num_blocks, 0)?;
        let mut alloc = self.alloc.bind(py).try_borrow_mut()?;
        Ok(self.inner.evict(&mut alloc.inner, n))
    }

    /// Drop every unlocked cached block; True if the tree is now empty.
    fn reset(&mut self, py: Python<'_>) -> PyResult<bool> {
        let mut alloc = self.alloc.bind(py).try_borrow_mut()?;
        Ok(self.inner.reset(&mut alloc.inner))
    }

    #[getter]
    fn allocator(&self, py: Python<'_>) -> Py<PyBlockAllocator> {
        self.alloc.clone_ref(py)
    }

    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.inner.num_cached_blocks()
    }

    #[getter]
    fn num_evictable_blocks(&self) -> usize {
        self.inner.num_evictable_blocks()
    }

    #[getter]
    fn queries(&self) -> u64 {
        self.inner.queries()
    }

    #[getter]
    fn hits(&self) -> u64 {
        self.inner.hits()
    }
}
