//! Results: medians over interleaved rounds, ratios measured in the same run, the targets, as
//! a markdown table and the same data as JSON.
//!
//! - `measure`: a scenario's runs and their medians; `over_limit`: scenario 7's runs;
//! - `compare`: ratios of scenarios run in the same rounds, and the comparisons built on them;
//! - `targets`: what the run is judged by;
//! - `markdown` and `json`: the two renderings, a function per table or section.

mod compare;
mod json;
mod markdown;
mod measure;
mod over_limit;
mod targets;

pub use compare::{
    AlgorithmComparison, MtlsComparison, NativeRatio, RlsComparison, SettleComparison, ALGORITHMS,
    NATIVE_PAIRS, SETTLING,
};
pub use measure::{median, percentile, Latency, Run, Scenario};
pub use over_limit::{InstanceRun, OverLimitRun};

/// How the run was set up (printed above the table).
#[derive(Debug, Clone, Default)]
pub struct Setup {
    pub date: String,
    pub commit: String,
    pub machine: String,
    pub envoy: String,
    pub concurrency: u32,
    pub wrk_threads: u32,
    pub connections: u32,
    pub seconds: f64,
    pub rounds: u32,
    pub tenants: u32,
    pub distribution: String,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub setup: Setup,
    pub scenarios: Vec<Scenario>,
    pub over_limit: Vec<OverLimitRun>,
}

impl Report {
    pub fn scenario(&self, id: &str) -> Option<&Scenario> {
        self.scenarios.iter().find(|s| s.id == id)
    }
}

#[cfg(test)]
mod tests;
