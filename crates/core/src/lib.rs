//! Tollgate's shared logic, compiled into both the proxy-wasm filter and the limiter service.
//!
//! Everything here is sans-IO: no proxy-wasm, no tokio, no clock reads. Time comes in as an
//! argument (milliseconds), storage is the caller's business. That keeps the rules testable
//! natively and on `wasm32-wasip1` alike.

#![forbid(unsafe_code)]

pub mod assign;
pub mod bucket;
pub mod calendar;
pub mod condition;
pub mod duration;
pub mod identity;
pub mod in_flight;
pub mod key;
pub mod policy;
pub mod protocol;
pub mod response;
pub mod route;
pub mod usage;
pub mod window;
