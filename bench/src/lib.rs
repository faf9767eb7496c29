//! `just bench`: tollgate against Envoy's own limiters and a per-request global check, side by
//! side in one run on one machine (see `src/main.rs` for the scenarios and the book's
//! docs/src/benchmarks/index.md), plus criterion microbenchmarks of the core (`benches/core.rs`).
//!
//! The library holds the parts with logic worth a unit test: config edits, wrk output, Redis
//! and `/proc` counters, medians, ratios and targets, the report, scenario 7's paced load,
//! the SVG charts drawn from the JSON result, and the bytes of shared state per key.

#![forbid(unsafe_code)]

pub mod chart;
pub mod config;
pub mod footprint;
pub mod micro;
pub mod paced;
pub mod report;
pub mod stats;
pub mod wrk;
