//! The core's error type. Each variant maps to one Python exception (see `py.rs`).

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// The waiting queue already holds `max_len` requests. Python: `QueueFullError`.
    QueueFull { max_len: usize },
    /// The request can never fit. Python: `RequestTooLargeError` (also a `ValueError`).
    RequestTooLarge(String),
    /// A request with this id is already in the core. Python: `DuplicateRequestError`.
    DuplicateRequest(String),
    /// A bad argument. Python: `InvalidArgumentError` (a `ValueError`) with `.param == name`.
    InvalidArgument { name: &'static str, reason: String },
    /// No free KV block. Python: `CoreError`.
    OutOfBlocks,
    /// A call that makes no sense in the current state. Python: `CoreError`.
    InvalidState(String),
    /// A grammar that does not compile, or not within its limits. Python: `GrammarError`
    /// (an `InvalidArgumentError`, `.param == "structured_outputs"` unless the caller says).
    Grammar(String),
}

impl CoreError {
    pub fn invalid(name: &'static str, reason: impl Into<String>) -> Self {
        CoreError::InvalidArgument {
            name,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::QueueFull { max_len } => {
                write!(f, "the request queue is full ({max_len} waiting requests)")
            }
            CoreError::RequestTooLarge(msg) => f.write_str(msg),
            CoreError::DuplicateRequest(id) => write!(f, "request id {id:?} is already in use"),
            CoreError::InvalidArgument { name, reason } => write!(f, "{name}: {reason}"),
            CoreError::OutOfBlocks => f.write_str("no free KV cache block"),
            CoreError::InvalidState(msg) => f.write_str(msg),
            CoreError::Grammar(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for CoreError {}

impl From<crate::sched::block::OutOfBlocks> for CoreError {
    fn from(_: crate::sched::block::OutOfBlocks) -> Self {
        CoreError::OutOfBlocks
    }
}

pub type CoreResult<T> = Result<T, CoreError>;

#[cfg(test)]
#[path = "error_tests.rs"]
mod tests;
