//! The policy document: serde types (`deny_unknown_fields`) and their validation into the
//! compiled [`Policies`] both the filter and the limiter use.
//!
//! One JSON document is the source of truth. It is parsed and validated once, at load; every
//! error names the policy (when known), the field path and the reason, and all errors of a
//! document are reported together.
//!
//! - `spec`: the document as written (the serde types);
//! - `compile`: its validation into the compiled form ([`Policies::from_json`]), a module per
//!   part of a policy;
//! - `model`: the compiled form; `matching`: how a compiled policy matches a request;
//! - `error`: the errors of a document.

mod compile;
mod error;
mod matching;
mod model;
mod spec;

pub use compile::{is_header_name, MAX_BODY_READ, MAX_LIMIT_ENTRIES};
pub use error::{PolicyError, PolicyErrors};
pub use matching::authority_host;
pub use model::*;
pub use spec::*;

#[cfg(test)]
mod tests;
