//! The harness' one error type: a message that explains what failed, for `try_*` variants.
//!
//! Most helpers panic (test support code), but tests that assert on failures (a config Envoy
//! must reject, a request that must be reset) use the `try_*` variants that return this.

use std::fmt;

/// A harness failure with a human-readable explanation (including log tails where relevant).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarnessError(pub String);

impl HarnessError {
    pub fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

impl fmt::Display for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HarnessError {}

impl From<std::io::Error> for HarnessError {
    fn from(e: std::io::Error) -> Self {
        Self(format!("io error: {e}"))
    }
}

pub type Result<T> = std::result::Result<T, HarnessError>;
