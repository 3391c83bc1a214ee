//! `RequestQueue` for Python's tests (feature `test-bindings`), keyed by request id.

use pyo3::prelude::*;

use super::{count_arg, time_arg};
use crate::sched::queue::{monotonic, Policy, QueueParams, RequestQueue};

#[pyclass(name = "RequestQueue", module = "ironlm._core")]
pub struct PyRequestQueue {
    inner: RequestQueue<String>,
}

#[pymethods]
impl PyRequestQueue {
    #[new]
    #[pyo3(signature = (policy = "fcfs", max_len = None))]
    fn new(policy: &str, max_len: Option<i64>) -> PyResult<Self> {
        let policy: Policy = policy.parse()?;
        let max_len = max_len.map(|m| count_arg("max_len", m, 0)).transpose()?;
        Ok(Self {
            inner: RequestQueue::new(policy, max_len),
        })
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy().as_str()
    }

    #[getter]
    fn max_len(&self) -> Option<usize> {
        self.inner.max_len()
    }

    #[pyo3(signature = (request_id, priority = 0, deadline = None, queue_timeout = None, arrival_time = None))]
    fn push(
        &mut self,
        request_id: String,
        priority: i64,
        deadline: Option<f64>,
        queue_timeout: Option<f64>,
        arrival_time: Option<f64>,
    ) -> PyResult<()> {
        let arrival = time_arg("arrival_time", arrival_time)?.unwrap_or_else(monotonic);
        if self.inner.contains(request_id.as_str()) {
            return Err(crate::CoreError::DuplicateRequest(request_id).into());
        }
        let p = QueueParams {
            priority,
            arrival,
            deadline: time_arg("deadline", deadline)?,
            queue_timeout: time_arg("queue_timeout", queue_timeout)?,
            tenant: 0,
        };
        self.inner.push(request_id, p)?;
        Ok(())
    }

    fn pop(&mut self) -> Option<String> {
        self.inner.pop()
    }

    fn peek(&self) -> Option<String> {
        self.inner.peek().cloned()
    }

    fn remove(&mut self, request_id: &str) -> bool {
        self.inner.remove(request_id)
    }

    /// Remove and return the requests whose timeout has passed.
    #[pyo3(signature = (now = None))]
    fn expire(&mut self, now: Option<f64>) -> PyResult<Vec<String>> {
        let now = time_arg("now", now)?.unwrap_or_else(monotonic);
        Ok(self.inner.expire(now))
    }

    /// Ids in policy order.
    fn to_list(&self) -> Vec<String> {
        self.inner.iter().cloned().collect()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __contains__(&self, request_id: &str) -> bool {
        self.inner.contains(request_id)
    }

    fn __repr__(&self) -> String {
        format!(
            "RequestQueue(policy={:?}, len={})",
            self.inner.policy().as_str(),
            self.inner.len()
        )
    }
}
