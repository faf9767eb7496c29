//! The errors of a policy document: each names the policy (when known), the field path and
//! the reason; a document's errors are reported together.

use std::fmt;

/// One problem in a policy document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// The policy's name, when the problem is inside a named policy.
    pub policy: Option<String>,
    /// Path of the field, e.g. `policies[0].rate.per`.
    pub field: String,
    pub reason: String,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(policy) = &self.policy {
            write!(f, "policy `{policy}`: ")?;
        }
        write!(f, "{}: {}", self.field, self.reason)
    }
}

/// All problems found in a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyErrors(pub Vec<PolicyError>);

impl fmt::Display for PolicyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PolicyErrors {}
